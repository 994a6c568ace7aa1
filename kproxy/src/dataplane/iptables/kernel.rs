//! The kernel interface of the iptables proxier (upstream `utiliptables.Interface`, reduced to
//! what the proxier uses), and an in-memory model of it for tests.

use std::collections::BTreeMap;

/// An iptables operation failed.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{op}: {reason}")]
pub struct IptablesError {
    pub op: String,
    pub reason: String,
}

impl IptablesError {
    pub(crate) fn new(op: impl Into<String>, reason: impl Into<String>) -> Self {
        IptablesError {
            op: op.into(),
            reason: reason.into(),
        }
    }
}

/// How a restore is applied. Both are `--noflush` restores with the same result: only the
/// declared chains are flushed (and the `-X` ones deleted); everything else in a table —
/// other programs' chains and rules included — stays as it is. No restore ever replaces a
/// table as a whole: nothing could keep a rule another program adds between the save that
/// decided "only our rules here" and such a restore (see the proxier's module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestoreMode {
    /// A restore of a few chains (a partial sync, a cleanup).
    NoFlush,
    /// A restore that rewrites every chain of ours (a full sync): the backend may read the
    /// whole table's state up front instead of chain by chain (iptables-nft: see
    /// [`ExecIptables`](super::exec::ExecIptables)'s `restore`).
    NoFlushBulk,
}

/// What the proxier needs from iptables for one family.
pub trait IptablesBackend: Send {
    /// `iptables-restore --noflush --counters -w` with `input`.
    fn restore(&mut self, input: &str, mode: RestoreMode) -> Result<(), IptablesError>;
    /// `iptables-save -t <table>`.
    fn save(&mut self, table: &str) -> Result<String, IptablesError>;
    /// Creates `chain` if missing (upstream `EnsureChain`); true if it existed.
    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError>;
    /// Whether `chain` exists.
    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError>;
    /// `-C` then `-I chain 1` if missing (upstream `EnsureRule(Prepend, …)`); true if it existed.
    fn ensure_rule_prepend(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError>;
    /// Whether the rule exists (`-C`).
    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError>;
    /// `-D chain args` (no error if absent).
    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), IptablesError>;
    /// `-F chain` then `-X chain` (no error if absent).
    fn delete_chain(&mut self, table: &str, chain: &str) -> Result<(), IptablesError>;
}

/// Targets that are not chains.
pub fn is_builtin_target(t: &str) -> bool {
    matches!(
        t,
        "ACCEPT"
            | "DROP"
            | "REJECT"
            | "RETURN"
            | "MARK"
            | "DNAT"
            | "SNAT"
            | "MASQUERADE"
            | "LOG"
            | "CONNMARK"
            | "REDIRECT"
            | "NOTRACK"
            | "CT"
    )
}

fn builtin_chains(table: &str) -> &'static [&'static str] {
    match table {
        "filter" => &["INPUT", "FORWARD", "OUTPUT"],
        "nat" => &["PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"],
        "mangle" => &["PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"],
        "raw" => &["PREROUTING", "OUTPUT"],
        _ => &[],
    }
}

/// The jump target of a rule's text (`-j X`), if any.
pub fn rule_target(rule: &str) -> Option<&str> {
    let mut it = rule.split_whitespace();
    while let Some(w) = it.next() {
        if w == "-j" || w == "-g" {
            return it.next();
        }
    }
    None
}

/// One table of [`FakeIptables`]: chains in creation order with their rules (the text after
/// `-A CHAIN `).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FakeTable {
    pub chains: Vec<(String, Vec<String>)>,
}

impl FakeTable {
    fn new(table: &str) -> Self {
        FakeTable {
            chains: builtin_chains(table)
                .iter()
                .map(|c| (c.to_string(), vec![]))
                .collect(),
        }
    }
    fn chain(&mut self, name: &str) -> Option<&mut Vec<String>> {
        self.chains
            .iter_mut()
            .find(|(n, _)| n == name)
            .map(|(_, r)| r)
    }
    pub(crate) fn rules(&self, name: &str) -> Option<&Vec<String>> {
        self.chains.iter().find(|(n, _)| n == name).map(|(_, r)| r)
    }
    fn has(&self, name: &str) -> bool {
        self.chains.iter().any(|(n, _)| n == name)
    }
}

/// An in-memory model of the kernel's iptables state with `iptables-restore --noflush` semantics: a
/// table's input is applied atomically at `COMMIT`; `-A` needs its chain and its jump target
/// to exist; `-X` fails while any rule still jumps to the chain. Tests can add rules directly
/// ([`FakeIptables::inject`]) to provoke failures, as upstream's tests do.
#[derive(Debug, Clone, Default)]
pub struct FakeIptables {
    pub tables: BTreeMap<String, FakeTable>,
    /// Every restore input received, with its mode.
    pub restores: Vec<(String, RestoreMode)>,
    /// Every `delete_rule` call received (table, chain, rule), whether or not the rule existed.
    pub rule_deletes: Vec<(String, String, String)>,
}

impl FakeIptables {
    pub fn new() -> Self {
        let mut f = FakeIptables::default();
        for t in ["filter", "nat", "mangle"] {
            f.tables.insert(t.into(), FakeTable::new(t));
        }
        f
    }
    fn table(&mut self, t: &str) -> &mut FakeTable {
        self.tables
            .entry(t.to_string())
            .or_insert_with(|| FakeTable::new(t))
    }
    /// Appends a raw rule (`-A chain rule`) without any check.
    pub fn inject(&mut self, table: &str, chain: &str, rule: &str) {
        let t = self.table(table);
        if !t.has(chain) {
            t.chains.push((chain.to_string(), vec![]));
        }
        t.chain(chain).expect("exists").push(rule.to_string());
    }
    /// `iptables -t table -F` (flush every chain, keep chains).
    pub fn flush_table(&mut self, table: &str) {
        for (_, r) in &mut self.table(table).chains {
            r.clear();
        }
    }

    fn apply_table(&self, name: &str, lines: &[&str]) -> Result<FakeTable, IptablesError> {
        let err = |r: String| IptablesError::new(format!("iptables-restore (table {name})"), r);
        let mut t = self
            .tables
            .get(name)
            .cloned()
            .unwrap_or_else(|| FakeTable::new(name));
        for line in lines {
            if let Some(c) = line.strip_prefix(':') {
                let chain = c.split_whitespace().next().unwrap_or("");
                match t.chain(chain) {
                    Some(r) => r.clear(),
                    None => t.chains.push((chain.to_string(), vec![])),
                }
            } else if let Some(rest) = line.strip_prefix("-A ") {
                let (chain, rule) = rest.split_once(' ').unwrap_or((rest, ""));
                if let Some(target) = rule_target(rule)
                    && !is_builtin_target(target)
                    && !t.has(target)
                {
                    return Err(err(format!("line {line:?}: chain {target} does not exist")));
                }
                t.chain(chain)
                    .ok_or_else(|| err(format!("line {line:?}: chain {chain} does not exist")))?
                    .push(rule.replace('"', ""));
            } else if let Some(chain) = line.strip_prefix("-X ") {
                let chain = chain.trim();
                if !t.has(chain) {
                    return Err(err(format!("-X {chain}: no such chain")));
                }
                if t.chains
                    .iter()
                    .any(|(_, rules)| rules.iter().any(|r| rule_target(r) == Some(chain)))
                {
                    return Err(err(format!("-X {chain}: chain is still referenced")));
                }
                t.chains.retain(|(n, _)| n != chain);
            } else {
                return Err(err(format!("unsupported line {line:?}")));
            }
        }
        Ok(t)
    }
}

impl IptablesBackend for FakeIptables {
    fn restore(&mut self, input: &str, mode: RestoreMode) -> Result<(), IptablesError> {
        self.restores.push((input.to_string(), mode));
        // iptables-restore commits table by table; a failing table leaves earlier ones applied.
        let mut current: Option<(String, Vec<&str>)> = None;
        for line in input.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if let Some(t) = line.strip_prefix('*') {
                current = Some((t.to_string(), vec![]));
            } else if line == "COMMIT" {
                let (name, lines) = current.take().ok_or_else(|| {
                    IptablesError::new("iptables-restore", "COMMIT outside a table")
                })?;
                let t = self.apply_table(&name, &lines)?;
                self.tables.insert(name, t);
            } else if let Some((_, lines)) = current.as_mut() {
                lines.push(line);
            } else if !line.starts_with('#') {
                return Err(IptablesError::new(
                    "iptables-restore",
                    format!("line outside a table: {line:?}"),
                ));
            }
        }
        Ok(())
    }

    fn save(&mut self, table: &str) -> Result<String, IptablesError> {
        let builtins = builtin_chains(table);
        let t = self.table(table).clone();
        let mut out = format!("*{table}\n");
        for (c, _) in &t.chains {
            let policy = if builtins.contains(&c.as_str()) {
                "ACCEPT"
            } else {
                "-"
            };
            out.push_str(&format!(":{c} {policy} [0:0]\n"));
        }
        for (c, rules) in &t.chains {
            for r in rules {
                out.push_str(&format!("-A {c} {r}\n"));
            }
        }
        out.push_str("COMMIT\n");
        Ok(out)
    }

    fn ensure_chain(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        let t = self.table(table);
        if t.has(chain) {
            return Ok(true);
        }
        t.chains.push((chain.to_string(), vec![]));
        Ok(false)
    }

    fn chain_exists(&mut self, table: &str, chain: &str) -> Result<bool, IptablesError> {
        Ok(self.table(table).has(chain))
    }

    fn ensure_rule_prepend(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        let rule = args.join(" ");
        let t = self.table(table);
        let rules = t
            .chain(chain)
            .ok_or_else(|| IptablesError::new("-I", format!("no chain {chain}")))?;
        if rules.contains(&rule) {
            return Ok(true);
        }
        rules.insert(0, rule);
        Ok(false)
    }

    fn rule_exists(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<bool, IptablesError> {
        let rule = args.join(" ");
        Ok(self
            .table(table)
            .rules(chain)
            .is_some_and(|r| r.contains(&rule)))
    }

    fn delete_rule(
        &mut self,
        table: &str,
        chain: &str,
        args: &[String],
    ) -> Result<(), IptablesError> {
        let rule = args.join(" ");
        self.rule_deletes
            .push((table.to_string(), chain.to_string(), rule.clone()));
        if let Some(r) = self.table(table).chain(chain)
            && let Some(i) = r.iter().position(|x| *x == rule)
        {
            r.remove(i);
        }
        Ok(())
    }

    fn delete_chain(&mut self, table: &str, chain: &str) -> Result<(), IptablesError> {
        self.table(table).chains.retain(|(n, _)| n != chain);
        Ok(())
    }
}
