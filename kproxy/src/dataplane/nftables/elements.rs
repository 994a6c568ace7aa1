//! Upstream `nftElementStorage`: what a set or map holds, so a sync adds only new elements,
//! replaces changed values and deletes the leftovers.

use std::collections::{BTreeMap, BTreeSet};

use super::transaction::{Object, Transaction};

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ElementStorage {
    pub name: String,
    /// key → value (`None` for set elements).
    pub elements: BTreeMap<String, Option<String>>,
    leftover: BTreeSet<String>,
}

impl ElementStorage {
    pub fn new(name: &str) -> Self {
        ElementStorage {
            name: name.into(),
            ..Default::default()
        }
    }

    /// Replaces the known content (what the kernel holds) and marks every key leftover.
    pub fn reset(&mut self, content: impl IntoIterator<Item = (String, Option<String>)>) {
        self.elements = content.into_iter().collect();
        self.leftover = self.elements.keys().cloned().collect();
    }

    /// Starts a sync: every known key is leftover until ensured.
    pub fn begin(&mut self) {
        self.leftover = self.elements.keys().cloned().collect();
    }

    /// Upstream `ensureElem`.
    pub fn ensure(
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
    }

    /// Whether `key` was ensured in this sync (or is not known at all).
    pub fn is_leftover(&self, key: &str) -> bool {
        self.leftover.contains(key)
    }

    /// Upstream `cleanupLeftoverKeys`: deletes what this sync did not ensure.
    pub fn cleanup(&mut self, tx: &mut Transaction) {
        for key in std::mem::take(&mut self.leftover) {
            tx.delete(Object::Element {
                name: self.name.clone(),
                key: key.clone(),
                value: None,
                comment: None,
            });
            self.elements.remove(&key);
        }
        self.begin();
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
