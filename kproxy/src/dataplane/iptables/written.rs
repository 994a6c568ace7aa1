//! What the proxier knows the kernel holds: per table, every chain known to exist and, for the
//! chains it wrote itself, a hash of their complete content (pure bookkeeping, no I/O).
//!
//! Used by partial syncs to leave out of the *applied* restore input every chain whose content
//! is identical to what was written last time (a `--noflush` restore that omits a chain leaves
//! it as it is, so the kernel ends up exactly as with upstream's input), and in large-cluster
//! mode to find stale per-service chains without an `iptables-save` of a huge table.
//!
//! The knowledge is rebuilt by every full sync (from `iptables-save` and the full input) and
//! dropped after any failure; between full syncs it assumes nobody else rewrites our chains —
//! the assumption upstream's partial syncs make for unchanged services, extended to
//! KUBE-SERVICES & co. An external flush is caught by the canary monitor (forces a full sync).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

use super::render::TableInput;

/// Content hash of a chain's rule lines (in order).
fn content_hash<'a>(rules: impl Iterator<Item = &'a str>) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut n = 0usize;
    for r in rules {
        r.hash(&mut h);
        n += 1;
    }
    n.hash(&mut h);
    h.finish()
}

/// The chain a rule line (`-A CHAIN …`) appends to.
fn rule_chain(rule: &str) -> &str {
    rule.split_whitespace().nth(1).unwrap_or("")
}

/// Rules of `input` grouped by chain, each group in input order.
fn rules_by_chain(input: &TableInput) -> HashMap<&str, Vec<&str>> {
    let mut by: HashMap<&str, Vec<&str>> = HashMap::new();
    for r in &input.rules {
        by.entry(rule_chain(r)).or_default().push(r.as_str());
    }
    by
}

/// Known kernel chains per table: `Some(hash)` = written by us with this content, `None` =
/// exists (seen in `iptables-save`), content not tracked.
#[derive(Debug, Clone, Default)]
pub(crate) struct KernelChains {
    tables: HashMap<String, HashMap<String, Option<u64>>>,
}

impl KernelChains {
    /// Forgets everything (after a failure; the next sync is full).
    pub(crate) fn clear(&mut self) {
        self.tables.clear();
    }

    /// Whether nothing is known.
    pub(crate) fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }

    /// `table` holds exactly `chains` (from `iptables-save`), contents unknown.
    pub(crate) fn set_saved<'a>(&mut self, table: &str, chains: impl IntoIterator<Item = &'a str>) {
        let t = self.tables.entry(table.to_owned()).or_default();
        t.clear();
        t.extend(chains.into_iter().map(|c| (c.to_owned(), None)));
    }

    /// Nothing is known of `table` (a full sync whose save failed): it holds nothing known
    /// until [`Self::record`].
    pub(crate) fn forget_table(&mut self, table: &str) {
        self.tables.entry(table.to_owned()).or_default().clear();
    }

    /// `input` was restored successfully (`--noflush`): its declared chains hold its rules,
    /// its deleted chains are gone.
    pub(crate) fn record(&mut self, input: &TableInput) {
        let by = rules_by_chain(input);
        let t = self.tables.entry(input.name.clone()).or_default();
        for c in &input.chains {
            let rules = by.get(c.as_str()).map(Vec::as_slice).unwrap_or_default();
            t.insert(c.clone(), Some(content_hash(rules.iter().copied())));
        }
        for c in &input.deletes {
            t.remove(c);
        }
    }

    /// `input` without the chains whose content equals what the kernel is known to hold
    /// (their declaration and rules left out; deletions always kept), and how many were left
    /// out.
    pub(crate) fn without_unchanged(&self, input: &TableInput) -> (TableInput, usize) {
        let known = self.tables.get(&input.name);
        let by = rules_by_chain(input);
        let deleted: std::collections::HashSet<&str> =
            input.deletes.iter().map(String::as_str).collect();
        let unchanged = |c: &str| -> bool {
            if deleted.contains(c) {
                return false;
            }
            let Some(Some(old)) = known.and_then(|t| t.get(c)) else {
                return false;
            };
            let rules = by.get(c).map(Vec::as_slice).unwrap_or_default();
            *old == content_hash(rules.iter().copied())
        };
        let mut out = TableInput::new(&input.name);
        let mut omitted = 0;
        for c in &input.chains {
            if unchanged(c) {
                omitted += 1;
            } else {
                out.chains.push(c.clone());
            }
        }
        let kept: std::collections::HashSet<&str> = out.chains.iter().map(String::as_str).collect();
        out.rules = input
            .rules
            .iter()
            .filter(|r| kept.contains(rule_chain(r)))
            .cloned()
            .collect();
        out.deletes = input.deletes.clone();
        (out, omitted)
    }

    /// Every chain known to exist in `table`.
    pub(crate) fn chains(&self, table: &str) -> impl Iterator<Item = &str> {
        self.tables
            .get(table)
            .into_iter()
            .flat_map(|t| t.keys().map(String::as_str))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(chains: &[(&str, &[&str])], deletes: &[&str]) -> TableInput {
        let mut t = TableInput::new("nat");
        for (c, rules) in chains {
            t.chains.push(c.to_string());
            t.rules.extend(rules.iter().map(|r| format!("-A {c} {r}")));
        }
        t.deletes = deletes.iter().map(|s| s.to_string()).collect();
        t.chains.extend(t.deletes.clone());
        t
    }

    #[test]
    fn unchanged_chains_are_left_out_and_changed_ones_kept() {
        let mut k = KernelChains::default();
        let first = input(
            &[
                (
                    "KUBE-SERVICES",
                    &["-d 10.0.0.1 -j KUBE-SVC-A", "-d 10.0.0.2 -j KUBE-SVC-B"],
                ),
                ("KUBE-SVC-A", &["-j KUBE-SEP-1"]),
                ("KUBE-SEP-1", &["-j DNAT --to-destination 1.1.1.1:80"]),
            ],
            &[],
        );
        // Nothing known yet: everything is written.
        assert_eq!(k.without_unchanged(&first), (first.clone(), 0));
        k.record(&first);
        let second = input(
            &[
                (
                    "KUBE-SERVICES",
                    &["-d 10.0.0.1 -j KUBE-SVC-A", "-d 10.0.0.2 -j KUBE-SVC-B"],
                ),
                ("KUBE-SVC-A", &["-j KUBE-SEP-2"]),
                ("KUBE-SEP-2", &["-j DNAT --to-destination 2.2.2.2:80"]),
            ],
            &["KUBE-SEP-1"],
        );
        let (out, omitted) = k.without_unchanged(&second);
        assert_eq!(omitted, 1);
        assert_eq!(out.chains, ["KUBE-SVC-A", "KUBE-SEP-2", "KUBE-SEP-1"]);
        assert_eq!(
            out.rules,
            [
                "-A KUBE-SVC-A -j KUBE-SEP-2",
                "-A KUBE-SEP-2 -j DNAT --to-destination 2.2.2.2:80"
            ]
        );
        assert_eq!(out.deletes, ["KUBE-SEP-1"]);
        k.record(&out);
        let mut known: Vec<&str> = k.chains("nat").collect();
        known.sort();
        assert_eq!(known, ["KUBE-SEP-2", "KUBE-SERVICES", "KUBE-SVC-A"]);
        // A rule order change is a change.
        let third = input(
            &[(
                "KUBE-SERVICES",
                &["-d 10.0.0.2 -j KUBE-SVC-B", "-d 10.0.0.1 -j KUBE-SVC-A"],
            )],
            &[],
        );
        assert_eq!(k.without_unchanged(&third).1, 0);
        // An emptied chain is a change too.
        let fourth = input(&[("KUBE-SVC-A", &[])], &[]);
        assert_eq!(k.without_unchanged(&fourth).1, 0);
    }

    #[test]
    fn saved_chains_of_unknown_content_are_always_written() {
        let mut k = KernelChains::default();
        k.set_saved("nat", ["KUBE-SERVICES", "KUBE-SEP-OLD"]);
        let t = input(&[("KUBE-SERVICES", &[])], &[]);
        assert_eq!(k.without_unchanged(&t).1, 0);
        k.record(&t);
        assert_eq!(k.without_unchanged(&t).1, 1);
        k.forget_table("nat");
        assert_eq!(k.chains("nat").count(), 0);
        assert_eq!(k.without_unchanged(&t).1, 0);
        k.clear();
        assert!(k.is_empty());
    }
}
