//! An in-memory nftables table (like knftables' `Fake`): applies transactions atomically with
//! nft's semantics for the operations kube-proxy uses, and dumps its content as `nft -f` text.

use std::collections::BTreeMap;

use super::transaction::{BaseChain, Object, Op, SetSpec, Transaction, Verb, parse};

/// A transaction the table refused; nothing of it was applied.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("nft transaction failed at `{op}`: {reason}")]
pub(crate) struct ApplyError {
    pub op: String,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeChain {
    pub base: Option<BaseChain>,
    pub comment: Option<String>,
    /// (rule, comment) in order.
    pub rules: Vec<(String, Option<String>)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeSet {
    pub is_map: bool,
    pub spec: SetSpec,
    /// key → (value, comment).
    pub elements: BTreeMap<String, (Option<String>, Option<String>)>,
}

/// The state of one table; `None` content = the table does not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeTable {
    pub family: String,
    pub name: String,
    pub exists: bool,
    pub comment: Option<String>,
    pub chains: BTreeMap<String, FakeChain>,
    pub sets: BTreeMap<String, FakeSet>,
    /// Operations in the last transaction applied (knftables `LastTransaction.NumOperations`).
    pub last_transaction_ops: Option<usize>,
    /// Every transaction applied, in order.
    pub transactions: Vec<Transaction>,
}

impl FakeTable {
    pub fn new(family: &str, name: &str) -> Self {
        FakeTable {
            family: family.into(),
            name: name.into(),
            ..Default::default()
        }
    }

    /// Loads `nft -f` text (upstream `Fake.ParseDump`), as one transaction.
    pub fn load(&mut self, text: &str) -> Result<(), String> {
        let mut tx = parse(text).map_err(|e| e.to_string())?;
        tx.family = self.family.clone();
        tx.table = self.name.clone();
        self.apply(&tx).map_err(|e| e.to_string())?;
        self.transactions.pop();
        self.last_transaction_ops = None;
        Ok(())
    }

    /// Applies `tx` atomically.
    pub(crate) fn apply(&mut self, tx: &Transaction) -> Result<(), ApplyError> {
        let mut next = self.clone();
        for op in &tx.ops {
            next.apply_op(op).map_err(|reason| ApplyError {
                op: tx.render_op(op),
                reason,
            })?;
        }
        next.last_transaction_ops = Some(tx.num_operations());
        next.transactions.push(tx.clone());
        *self = next;
        Ok(())
    }

    fn need_table(&self) -> Result<(), String> {
        if self.exists {
            Ok(())
        } else {
            Err("no such table".into())
        }
    }

    fn apply_op(&mut self, op: &Op) -> Result<(), String> {
        match (&op.object, op.verb) {
            (Object::Table { comment }, Verb::Add) => {
                if !self.exists {
                    self.exists = true;
                    self.comment = comment.clone();
                }
            }
            (Object::Table { .. }, Verb::Flush) => {
                self.need_table()?;
                self.chains.values_mut().for_each(|c| c.rules.clear());
                self.sets.values_mut().for_each(|s| s.elements.clear());
            }
            (Object::Table { .. }, Verb::Delete) => {
                self.need_table()?;
                *self = FakeTable {
                    transactions: std::mem::take(&mut self.transactions),
                    ..FakeTable::new(&self.family, &self.name)
                };
            }
            (Object::Chain { .. }, _) => self.chain_op(op)?,
            (Object::Rule { .. }, _) => self.rule_op(op)?,
            (Object::Set { .. } | Object::Map { .. }, _) => self.set_op(op)?,
            (Object::Element { .. }, _) => self.element_op(op)?,
        }
        Ok(())
    }

    fn chain_op(&mut self, op: &Op) -> Result<(), String> {
        let Object::Chain {
            name,
            base,
            comment,
        } = &op.object
        else {
            unreachable!("chain op");
        };
        self.need_table()?;
        match op.verb {
            Verb::Add => {
                let c = self.chains.entry(name.clone()).or_default();
                if c.base.is_some() && base.is_some() && c.base != *base {
                    return Err("cannot change a base chain's hook or priority".into());
                }
                if base.is_some() {
                    c.base = base.clone();
                }
                if comment.is_some() {
                    c.comment = comment.clone();
                }
            }
            Verb::Flush => {
                self.chains
                    .get_mut(name)
                    .ok_or("no such chain")?
                    .rules
                    .clear();
            }
            Verb::Delete => {
                if !self.chains.contains_key(name) {
                    return Err("no such chain".into());
                }
                if let Some(user) = self.chain_user(name) {
                    return Err(format!("chain is referenced by {user}"));
                }
                self.chains.remove(name);
            }
        }
        Ok(())
    }

    /// Something (rule or map element) that jumps/goes to `chain`.
    fn chain_user(&self, chain: &str) -> Option<String> {
        let refers = |text: &str| {
            text.split_whitespace()
                .collect::<Vec<_>>()
                .windows(2)
                .any(|w| (w[0] == "goto" || w[0] == "jump") && w[1] == chain)
        };
        for (n, c) in &self.chains {
            if n != chain && c.rules.iter().any(|(r, _)| refers(r)) {
                return Some(format!("a rule of chain {n}"));
            }
        }
        for (n, s) in &self.sets {
            if s.elements
                .values()
                .any(|(v, _)| v.as_deref().is_some_and(refers))
            {
                return Some(format!("an element of map {n}"));
            }
        }
        None
    }

    fn rule_op(&mut self, op: &Op) -> Result<(), String> {
        let Object::Rule {
            chain,
            rule,
            comment,
        } = &op.object
        else {
            unreachable!("rule op");
        };
        self.need_table()?;
        if op.verb != Verb::Add {
            return Err("only `add rule` is supported".into());
        }
        for w in rule.split_whitespace() {
            if let Some(set) = w.strip_prefix('@')
                && !self.sets.contains_key(set)
            {
                return Err(format!("no such set or map {set}"));
            }
        }
        self.chains
            .get_mut(chain)
            .ok_or("no such chain")?
            .rules
            .push((rule.clone(), comment.clone()));
        Ok(())
    }

    fn set_op(&mut self, op: &Op) -> Result<(), String> {
        let (Object::Set { name, spec } | Object::Map { name, spec }) = &op.object else {
            unreachable!("set op");
        };
        let is_map = matches!(op.object, Object::Map { .. });
        self.need_table()?;
        match op.verb {
            Verb::Add => {
                if let Some(s) = self.sets.get(name) {
                    if s.is_map != is_map || s.spec.kind != spec.kind || s.spec.flags != spec.flags
                    {
                        return Err("cannot change the type or flags of an existing set".into());
                    }
                } else {
                    self.sets.insert(
                        name.clone(),
                        FakeSet {
                            is_map,
                            spec: spec.clone(),
                            elements: BTreeMap::new(),
                        },
                    );
                }
            }
            Verb::Flush => self
                .sets
                .get_mut(name)
                .ok_or("no such set")?
                .elements
                .clear(),
            Verb::Delete => {
                self.sets.remove(name).ok_or("no such set")?;
            }
        }
        Ok(())
    }

    fn element_op(&mut self, op: &Op) -> Result<(), String> {
        let Object::Element {
            name,
            key,
            value,
            comment,
        } = &op.object
        else {
            unreachable!("element op");
        };
        self.need_table()?;
        let chains: Vec<String> = self.chains.keys().cloned().collect();
        let set = self.sets.get_mut(name).ok_or("no such set or map")?;
        match op.verb {
            Verb::Add => {
                if set.is_map != value.is_some() {
                    return Err("element value does not match the set/map type".into());
                }
                if let Some(v) = value
                    && let Some(target) =
                        v.strip_prefix("goto ").or_else(|| v.strip_prefix("jump "))
                    && !chains.iter().any(|c| c == target)
                {
                    return Err(format!("no such chain {target}"));
                }
                set.elements
                    .entry(key.clone())
                    .or_insert((value.clone(), comment.clone()));
            }
            Verb::Delete => {
                set.elements.remove(key).ok_or("no such element")?;
            }
            Verb::Flush => return Err("cannot flush an element".into()),
        }
        Ok(())
    }

    /// Names of the chains (knftables `List("chains")`).
    pub fn list_chains(&self) -> Vec<String> {
        self.chains.keys().cloned().collect()
    }

    /// Names of the sets (knftables `List("sets")`).
    pub fn list_sets(&self) -> Vec<String> {
        self.sets
            .iter()
            .filter(|(_, s)| !s.is_map)
            .map(|(n, _)| n.clone())
            .collect()
    }

    /// Elements of a set or map as (key, value).
    pub fn list_elements(&self, name: &str) -> Vec<(String, Option<String>)> {
        self.sets
            .get(name)
            .map(|s| {
                s.elements
                    .iter()
                    .map(|(k, (v, _))| (k.clone(), v.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The whole table as `nft -f` text (knftables `Fake.Dump`).
    pub fn dump(&self) -> String {
        if !self.exists {
            return String::new();
        }
        let mut tx = Transaction::new(&self.family, &self.name);
        tx.add(Object::Table {
            comment: self.comment.clone(),
        });
        for (name, c) in &self.chains {
            tx.add(Object::Chain {
                name: name.clone(),
                base: c.base.clone(),
                comment: c.comment.clone(),
            });
        }
        for (name, s) in &self.sets {
            let o = if s.is_map {
                Object::Map {
                    name: name.clone(),
                    spec: s.spec.clone(),
                }
            } else {
                Object::Set {
                    name: name.clone(),
                    spec: s.spec.clone(),
                }
            };
            tx.add(o);
        }
        for (name, c) in &self.chains {
            for (rule, comment) in &c.rules {
                tx.add(Object::Rule {
                    chain: name.clone(),
                    rule: rule.clone(),
                    comment: comment.clone(),
                });
            }
        }
        for (name, s) in &self.sets {
            for (key, (value, comment)) in &s.elements {
                tx.add(Object::Element {
                    name: name.clone(),
                    key: key.clone(),
                    value: value.clone(),
                    comment: comment.clone(),
                });
            }
        }
        tx.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_transactions_change_nothing() {
        let mut t = FakeTable::new("ip", "kube-proxy");
        t.load("add table ip kube-proxy\nadd chain ip kube-proxy a\nadd chain ip kube-proxy b\nadd rule ip kube-proxy a goto b\n")
            .expect("load");
        let before = t.dump();
        let tx = parse("delete chain ip kube-proxy b\n").expect("parse");
        let err = t.apply(&tx).expect_err("b is referenced");
        assert!(err.reason.contains("referenced"), "{err}");
        assert_eq!(t.dump(), before);
        let tx =
            parse("flush chain ip kube-proxy a\ndelete chain ip kube-proxy b\n").expect("parse");
        t.apply(&tx).expect("flush then delete");
        assert_eq!(t.list_chains(), vec!["a".to_string()]);
        assert_eq!(t.last_transaction_ops, Some(2));
    }

    #[test]
    fn elements_need_their_set_and_target_chain() {
        let mut t = FakeTable::new("ip", "kube-proxy");
        t.load("add table ip kube-proxy\nadd map ip kube-proxy m { type inet_proto . inet_service : verdict ; }\n")
            .expect("load");
        let tx = parse("add element ip kube-proxy m { tcp . 80 : goto nowhere }\n").expect("parse");
        assert!(t.apply(&tx).is_err());
        let tx = parse("add element ip kube-proxy m { tcp . 80 : drop }\n").expect("parse");
        t.apply(&tx).expect("drop verdict");
        assert_eq!(
            t.list_elements("m"),
            vec![("tcp . 80".to_string(), Some("drop".to_string()))]
        );
    }
}
