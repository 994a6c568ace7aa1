//! iptables-restore text: writing it from a plan, and upstream's canonical sort
//! (`sortIPTablesRules` in upstream's proxier_test.go) used to compare and to print rulesets.

use std::fmt::Write as _;

use super::plan::TablePlan;

/// One table of restore input: declared chains, rule lines and `-X` deletions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TableInput {
    pub name: String,
    pub chains: Vec<String>,
    pub rules: Vec<String>,
    /// Chains deleted with `-X` after all rules (each is also declared, which flushes it).
    pub deletes: Vec<String>,
}

impl TableInput {
    pub(crate) fn new(name: &str) -> Self {
        TableInput {
            name: name.into(),
            ..Default::default()
        }
    }
    /// Adds all chains and rules of `t`.
    pub(crate) fn add(&mut self, t: &TablePlan) {
        for c in &t.chains {
            self.chains.push(c.name.clone());
            self.rules.extend(c.rules.iter().cloned());
        }
    }
    /// Declares and deletes `chain`.
    pub(crate) fn delete(&mut self, chain: &str) {
        self.chains.push(chain.to_owned());
        self.deletes.push(chain.to_owned());
    }
    /// The length of [`Self::render`]'s text, to size buffers once: at 10k services a restore
    /// input is ≈ 17 MB, and a String grown by doubling holds up to twice that while it
    /// reallocates.
    pub(crate) fn rendered_len(&self) -> usize {
        let line = |s: &String| s.len() + 1;
        "*\nCOMMIT\n".len()
            + self.name.len()
            + self
                .chains
                .iter()
                .map(|c| line(c) + ": - [0:0]".len())
                .sum::<usize>()
            + self.rules.iter().map(line).sum::<usize>()
            + self
                .deletes
                .iter()
                .map(|c| line(c) + "-X ".len())
                .sum::<usize>()
    }
    /// `*table … COMMIT` text.
    pub(crate) fn render(&self, out: &mut String) {
        let _ = writeln!(out, "*{}", self.name);
        for c in &self.chains {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        for r in &self.rules {
            out.push_str(r);
            out.push('\n');
        }
        for c in &self.deletes {
            let _ = writeln!(out, "-X {c}");
        }
        out.push_str("COMMIT\n");
    }
}

/// Renders tables as one iptables-restore input.
pub(crate) fn render_tables(tables: &[TableInput]) -> String {
    let mut out = String::with_capacity(tables.iter().map(TableInput::rendered_len).sum());
    for t in tables {
        t.render(&mut out);
    }
    out
}

fn chain_rank(name: &str) -> (u8, &str) {
    match name {
        "KUBE-NODEPORTS" => (0, ""),
        "KUBE-SERVICES" => (1, ""),
        n if n.starts_with("KUBE-") => (2, n),
        n => (3, n),
    }
}

/// The service name of a rule: its comment value up to the first space or colon.
fn rule_service(rule: &str) -> String {
    let Some(i) = rule.find("--comment ") else {
        return String::new();
    };
    let rest = &rule[i + "--comment ".len()..];
    let rest = rest.strip_prefix('"').unwrap_or(rest);
    let end = rest.find([' ', ':', '"']).unwrap_or(rest.len());
    rest[..end].to_string()
}

fn rule_chain(rule: &str) -> &str {
    rule.split_whitespace().nth(1).unwrap_or("")
}

/// Upstream's canonical form of an iptables-restore text: tables by name; chain lines sorted
/// (KUBE-NODEPORTS, KUBE-SERVICES, other KUBE-*, the rest); rules grouped by chain in that
/// order, keeping relative order, with KUBE-NODEPORTS and KUBE-SERVICES rules stable-sorted by
/// service name (the "must be the last rule" rule stays last); `-X` lines after all rules.
pub fn canonical_sort(text: &str) -> String {
    struct T {
        name: String,
        chains: Vec<String>,
        rules: Vec<String>,
        deletes: Vec<String>,
    }
    let mut tables: Vec<T> = vec![];
    for line in text.lines() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') || line == "COMMIT" {
            continue;
        }
        if let Some(n) = line.strip_prefix('*') {
            tables.push(T {
                name: n.to_string(),
                chains: vec![],
                rules: vec![],
                deletes: vec![],
            });
            continue;
        }
        let Some(t) = tables.last_mut() else { continue };
        if let Some(c) = line.strip_prefix(':') {
            let name = c.split_whitespace().next().unwrap_or("").to_string();
            t.chains.push(name);
        } else if line.starts_with("-X") {
            t.deletes.push(line.to_string());
        } else {
            t.rules.push(line.to_string());
        }
    }
    tables.sort_by(|a, b| a.name.cmp(&b.name));
    let mut out = String::new();
    for t in &mut tables {
        let mut chains = t.chains.clone();
        chains.sort_by(|a, b| chain_rank(a).cmp(&chain_rank(b)));
        chains.dedup();
        let _ = writeln!(out, "*{}", t.name);
        for c in &chains {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        // Chains named by rules but not declared go after the declared ones, sorted.
        let mut by_chain: std::collections::HashMap<&str, Vec<&String>> =
            std::collections::HashMap::new();
        for r in &t.rules {
            by_chain.entry(rule_chain(r)).or_default().push(r);
        }
        let declared: std::collections::HashSet<&str> = chains.iter().map(String::as_str).collect();
        let mut order = chains.clone();
        let mut extra: Vec<String> = by_chain
            .keys()
            .filter(|c| !declared.contains(*c))
            .map(|c| c.to_string())
            .collect();
        extra.sort_by(|a, b| chain_rank(a).cmp(&chain_rank(b)));
        extra.dedup();
        order.extend(extra);
        for c in &order {
            let mut rules: Vec<&String> = by_chain.remove(c.as_str()).unwrap_or_default();
            if c == "KUBE-NODEPORTS" || c == "KUBE-SERVICES" {
                let (last, mut others): (Vec<&String>, Vec<&String>) = if c == "KUBE-SERVICES" {
                    rules
                        .into_iter()
                        .partition(|r| r.contains("must be the last rule"))
                } else {
                    (vec![], rules)
                };
                others.sort_by_cached_key(|r| rule_service(r));
                others.extend(last);
                rules = others;
            }
            for r in rules {
                out.push_str(r);
                out.push('\n');
            }
        }
        for d in &t.deletes {
            out.push_str(d);
            out.push('\n');
        }
        out.push_str("COMMIT\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_name_of_rule() {
        assert_eq!(
            rule_service("-A KUBE-SERVICES -m comment --comment \"ns1/svc1:p80 cluster IP\" -j X"),
            "ns1/svc1"
        );
        assert_eq!(
            rule_service("-A KUBE-NODEPORTS -m comment --comment ns2/svc2:p80 -m tcp"),
            "ns2/svc2"
        );
        assert_eq!(rule_service("-A KUBE-NODEPORTS -j X"), "");
    }

    #[test]
    fn sort_orders_chains_and_keeps_last_rule_last() {
        let input = "*nat\n:KUBE-SVC-B - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-NODEPORTS - [0:0]\n:FOO - [0:0]\n\
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -j KUBE-NODEPORTS\n\
-A KUBE-SERVICES -m comment --comment \"ns2/b cluster IP\" -j KUBE-SVC-B\n\
-X KUBE-SEP-OLD\n\
-A KUBE-SERVICES -m comment --comment \"ns1/a cluster IP\" -j KUBE-SVC-B\n\
-A KUBE-SVC-B -j DNAT\nCOMMIT\n*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n";
        let want = "*filter\n:KUBE-FORWARD - [0:0]\nCOMMIT\n*nat\n:KUBE-NODEPORTS - [0:0]\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-B - [0:0]\n:FOO - [0:0]\n\
-A KUBE-SERVICES -m comment --comment \"ns1/a cluster IP\" -j KUBE-SVC-B\n\
-A KUBE-SERVICES -m comment --comment \"ns2/b cluster IP\" -j KUBE-SVC-B\n\
-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\" -j KUBE-NODEPORTS\n\
-A KUBE-SVC-B -j DNAT\n-X KUBE-SEP-OLD\nCOMMIT\n";
        assert_eq!(canonical_sort(input), want);
    }
}

#[cfg(test)]
mod rendered_len_tests {
    use super::TableInput;

    #[test]
    fn rendered_len_is_the_rendered_texts_length() {
        let mut t = TableInput::new("nat");
        t.chains = vec!["KUBE-SERVICES".into(), "KUBE-SVC-X".into()];
        t.rules = vec![
            "-A KUBE-SERVICES -j KUBE-SVC-X".into(),
            "-A KUBE-SVC-X -j DROP".into(),
        ];
        t.delete("KUBE-SEP-OLD");
        let mut out = String::new();
        t.render(&mut out);
        assert_eq!(t.rendered_len(), out.len(), "{out}");
        assert_eq!(TableInput::new("filter").rendered_len(), {
            let mut s = String::new();
            TableInput::new("filter").render(&mut s);
            s.len()
        });
    }
}
