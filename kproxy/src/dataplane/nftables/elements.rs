//! Upstream `nftElementStorage`: what a set or map holds, so a sync adds only new elements,
//! replaces changed values and deletes the leftovers.
//!
//! Upstream marks every known key leftover at the start of each sync and ensures every
//! service port's keys again, so each sync walks all of them. kproxy counts how many
//! service ports hold each key instead ([`ElementStorage::release`]): a full sync still
//! ensures every key (and deletes what nobody ensured), a partial sync releases the keys of
//! the service ports it rewrites and ensures their new ones, and deletes only the keys
//! nobody holds any more — the same operations for the work of the changed ports alone.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::transaction::{Object, Transaction};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ElementStorage {
    pub name: String,
    /// key → value (`None` for set elements).
    pub elements: BTreeMap<String, Option<String>>,
    leftover: BTreeSet<String>,
    /// How many service ports hold each key (every [`Self::ensure`] since the last
    /// [`Self::reset`], minus every [`Self::release`]).
    holders: HashMap<String, u32>,
}

impl ElementStorage {
    pub(crate) fn new(name: &str) -> Self {
        ElementStorage {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Starts a full sync: replaces the known content (what the kernel holds), marks every
    /// key leftover until ensured and forgets who held what.
    pub(crate) fn reset(&mut self, content: impl IntoIterator<Item = (String, Option<String>)>) {
        self.elements = content.into_iter().collect();
        self.leftover = self.elements.keys().cloned().collect();
        self.holders.clear();
    }

    /// A service port no longer holds `key` (a partial sync rewrites it): once nobody
    /// holds it, it is leftover unless ensured again in this sync.
    pub(crate) fn release(&mut self, key: &str) {
        if let Some(n) = self.holders.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                self.holders.remove(key);
                self.leftover.insert(key.to_string());
            }
        }
    }

    /// Upstream `ensureElem`.
    pub(crate) fn ensure(
        &mut self,
        tx: &mut Transaction,
        key: String,
        value: Option<String>,
        comment: Option<String>,
    ) {
        let elem = Object::Element {
            name: self.name.clone(),
            key: key.clone(),
            value: value.clone(),
            comment,
        };
        match self.elements.get(&key) {
            Some(v) if *v == value => {}
            Some(_) => {
                tx.delete(elem.clone());
                tx.add(elem);
                self.elements.insert(key.clone(), value);
            }
            None => {
                tx.add(elem);
                self.elements.insert(key.clone(), value);
            }
        }
        self.leftover.remove(&key);
        *self.holders.entry(key).or_insert(0) += 1;
    }

    /// Whether a service port holds `key`.
    pub(crate) fn is_held(&self, key: &str) -> bool {
        self.holders.contains_key(key)
    }

    /// Upstream `cleanupLeftoverKeys`: deletes what this sync did not ensure.
    pub(crate) fn cleanup(&mut self, tx: &mut Transaction) {
        for key in std::mem::take(&mut self.leftover) {
            tx.delete(Object::Element {
                name: self.name.clone(),
                key: key.clone(),
                value: None,
                comment: None,
            });
            self.elements.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_differences_become_operations() {
        let mut s = ElementStorage::new("service-ips");
        s.reset([
            ("a . tcp . 80".into(), Some("goto x".into())),
            ("b . tcp . 80".into(), Some("goto y".into())),
            ("c . tcp . 80".into(), Some("goto z".into())),
        ]);
        let mut tx = Transaction::new("ip", "kube-proxy");
        s.ensure(&mut tx, "a . tcp . 80".into(), Some("goto x".into()), None);
        s.ensure(&mut tx, "b . tcp . 80".into(), Some("goto w".into()), None);
        s.ensure(&mut tx, "d . tcp . 80".into(), Some("goto v".into()), None);
        s.cleanup(&mut tx);
        assert_eq!(
            tx.to_string(),
            "delete element ip kube-proxy service-ips { b . tcp . 80 }\n\
             add element ip kube-proxy service-ips { b . tcp . 80 : goto w }\n\
             add element ip kube-proxy service-ips { d . tcp . 80 : goto v }\n\
             delete element ip kube-proxy service-ips { c . tcp . 80 }\n"
        );
        assert_eq!(s.elements.len(), 3);
    }
}
