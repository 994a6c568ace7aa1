//! nftables objects and transactions (the subset of knftables kube-proxy uses), rendered as
//! `nft -f` input and parsed back from such text, plus upstream's canonical sort of a dump
//! (`sortNFTablesTransaction` in pkg/proxy/nftables/helpers_test.go).

use std::fmt::{self, Write as _};

/// A base chain's hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseChain {
    /// `filter` / `nat`.
    pub kind: String,
    pub hook: String,
    pub priority: i32,
}

/// Type, flags, timeout and comment of a set or map.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SetSpec {
    /// e.g. `ipv4_addr` or `ipv4_addr . inet_proto . inet_service : verdict`.
    pub kind: String,
    pub flags: Vec<String>,
    /// Seconds.
    pub timeout: Option<u32>,
    pub comment: Option<String>,
}

/// One object of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Object {
    Table {
        comment: Option<String>,
    },
    Chain {
        name: String,
        base: Option<BaseChain>,
        comment: Option<String>,
    },
    Rule {
        chain: String,
        rule: String,
        comment: Option<String>,
    },
    Set {
        name: String,
        spec: SetSpec,
    },
    Map {
        name: String,
        spec: SetSpec,
    },
    /// An element of the set or map `name`; `value` is set for map elements.
    Element {
        name: String,
        key: String,
        value: Option<String>,
        comment: Option<String>,
    },
}

impl Object {
    pub(crate) fn chain(name: impl Into<String>) -> Self {
        Object::Chain {
            name: name.into(),
            base: None,
            comment: None,
        }
    }
    pub(crate) fn rule(chain: impl Into<String>, rule: impl Into<String>) -> Self {
        Object::Rule {
            chain: chain.into(),
            rule: rule.into(),
            comment: None,
        }
    }
    pub(crate) fn rule_commented(
        chain: impl Into<String>,
        rule: impl Into<String>,
        comment: impl Into<String>,
    ) -> Self {
        Object::Rule {
            chain: chain.into(),
            rule: rule.into(),
            comment: Some(comment.into()),
        }
    }
    fn type_word(&self) -> &'static str {
        match self {
            Object::Table { .. } => "table",
            Object::Chain { .. } => "chain",
            Object::Rule { .. } => "rule",
            Object::Set { .. } => "set",
            Object::Map { .. } => "map",
            Object::Element { .. } => "element",
        }
    }
}

/// What an operation does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    Add,
    Flush,
    Delete,
}

impl Verb {
    fn word(self) -> &'static str {
        match self {
            Verb::Add => "add",
            Verb::Flush => "flush",
            Verb::Delete => "delete",
        }
    }
}

/// One operation of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub verb: Verb,
    pub object: Object,
}

/// An ordered list of operations on one table, applied atomically.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transaction {
    /// `ip` / `ip6`.
    pub family: String,
    pub table: String,
    pub ops: Vec<Op>,
}

fn quote(s: &str) -> String {
    format!("\"{s}\"")
}

fn spec_text(spec: &SetSpec) -> String {
    let mut s = format!("{{ type {} ; ", spec.kind);
    if !spec.flags.is_empty() {
        let _ = write!(s, "flags {} ; ", spec.flags.join(","));
    }
    if let Some(t) = spec.timeout {
        let _ = write!(s, "timeout {t}s ; ");
    }
    if let Some(c) = &spec.comment {
        let _ = write!(s, "comment {} ; ", quote(c));
    }
    s.push('}');
    s
}

impl Transaction {
    pub(crate) fn new(family: &str, table: &str) -> Self {
        Transaction {
            family: family.into(),
            table: table.into(),
            ops: vec![],
        }
    }
    pub(crate) fn add(&mut self, o: Object) {
        self.ops.push(Op {
            verb: Verb::Add,
            object: o,
        });
    }
    pub(crate) fn flush(&mut self, o: Object) {
        self.ops.push(Op {
            verb: Verb::Flush,
            object: o,
        });
    }
    pub(crate) fn delete(&mut self, o: Object) {
        self.ops.push(Op {
            verb: Verb::Delete,
            object: o,
        });
    }
    /// knftables `NumOperations`.
    pub(crate) fn num_operations(&self) -> usize {
        self.ops.len()
    }

    /// One operation as an `nft -f` line.
    pub(crate) fn render_op(&self, op: &Op) -> String {
        let verb = op.verb.word();
        let o = &op.object;
        let mut line = format!("{verb} {} {} {}", o.type_word(), self.family, self.table);
        let full = op.verb == Verb::Add;
        match o {
            Object::Table { comment } => {
                if let (true, Some(c)) = (full, comment) {
                    let _ = write!(line, " {{ comment {} ; }}", quote(c));
                }
            }
            Object::Chain {
                name,
                base,
                comment,
            } => {
                let _ = write!(line, " {name}");
                if full && (base.is_some() || comment.is_some()) {
                    line.push_str(" {");
                    if let Some(b) = base {
                        let _ = write!(
                            line,
                            " type {} hook {} priority {} ;",
                            b.kind, b.hook, b.priority
                        );
                    }
                    if let Some(c) = comment {
                        let _ = write!(line, " comment {} ;", quote(c));
                    }
                    line.push_str(" }");
                }
            }
            Object::Rule {
                chain,
                rule,
                comment,
            } => {
                let _ = write!(line, " {chain} {rule}");
                if let Some(c) = comment {
                    let _ = write!(line, " comment {}", quote(c));
                }
            }
            Object::Set { name, spec } | Object::Map { name, spec } => {
                let _ = write!(line, " {name}");
                if full {
                    let _ = write!(line, " {}", spec_text(spec));
                }
            }
            Object::Element {
                name,
                key,
                value,
                comment,
            } => {
                let _ = write!(line, " {name} {{ {key}");
                if full {
                    if let Some(c) = comment {
                        let _ = write!(line, " comment {}", quote(c));
                    }
                    if let Some(v) = value {
                        let _ = write!(line, " : {v}");
                    }
                }
                line.push_str(" }");
            }
        }
        line
    }
}

impl fmt::Display for Transaction {
    /// The transaction as `nft -f` input.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for op in &self.ops {
            writeln!(f, "{}", self.render_op(op))?;
        }
        Ok(())
    }
}

/// Bad `nft -f` text.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("line {line}: {reason}: {text:?}")]
pub struct ParseError {
    pub line: usize,
    pub text: String,
    pub reason: String,
}

/// Splits a trailing ` comment "…"` off `s`.
fn split_comment(s: &str) -> (String, Option<String>) {
    if s.ends_with('"')
        && let Some(i) = s.rfind(" comment \"")
    {
        let c = &s[i + " comment \"".len()..s.len() - 1];
        if !c.contains('"') {
            return (s[..i].to_string(), Some(c.to_string()));
        }
    }
    (s.to_string(), None)
}

/// The `a ; b ; ` clauses of a `{ … }` spec.
fn spec_clauses(s: &str) -> Vec<String> {
    let inner = s
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim();
    inner
        .split(" ;")
        .map(|c| c.trim().trim_end_matches(';').trim().to_string())
        .filter(|c| !c.is_empty())
        .collect()
}

fn unquote(s: &str) -> String {
    s.trim().trim_matches('"').to_string()
}

fn parse_spec(s: &str) -> SetSpec {
    let mut spec = SetSpec::default();
    for c in spec_clauses(s) {
        if let Some(t) = c.strip_prefix("type ") {
            spec.kind = t.to_string();
        } else if let Some(f) = c.strip_prefix("flags ") {
            spec.flags = f.split(',').map(|x| x.trim().to_string()).collect();
        } else if let Some(t) = c.strip_prefix("timeout ") {
            spec.timeout = t.trim_end_matches('s').parse().ok();
        } else if let Some(t) = c.strip_prefix("comment ") {
            spec.comment = Some(unquote(t));
        }
    }
    spec
}

fn parse_chain(name: &str, rest: &str) -> Object {
    let mut base = None;
    let mut comment = None;
    for c in spec_clauses(rest) {
        if let Some(t) = c.strip_prefix("comment ") {
            comment = Some(unquote(t));
        } else if let Some(t) = c.strip_prefix("type ") {
            let w: Vec<&str> = t.split_whitespace().collect();
            if let [kind, "hook", hook, "priority", prio] = w.as_slice() {
                base = Some(BaseChain {
                    kind: kind.to_string(),
                    hook: hook.to_string(),
                    priority: prio.parse().unwrap_or(0),
                });
            }
        }
    }
    Object::Chain {
        name: name.into(),
        base,
        comment,
    }
}

fn parse_element(name: &str, rest: &str) -> Option<Object> {
    let inner = rest.trim().strip_prefix('{')?.strip_suffix('}')?.trim();
    let (kv, value) = match inner.split_once(" : ") {
        Some((k, v)) => (k.to_string(), Some(v.trim().to_string())),
        None => (inner.to_string(), None),
    };
    let (key, comment) = split_comment(kv.trim());
    Some(Object::Element {
        name: name.into(),
        key: key.trim().to_string(),
        value,
        comment,
    })
}

/// Parses `nft -f` text (one operation a line; blank lines and `#` comments skipped).
pub fn parse(text: &str) -> Result<Transaction, ParseError> {
    let mut tx: Option<Transaction> = None;
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let err = |reason: &str| ParseError {
            line: i + 1,
            text: line.to_string(),
            reason: reason.into(),
        };
        let mut w = line.splitn(5, ' ');
        let (verb, kind, family, table) = (w.next(), w.next(), w.next(), w.next());
        let rest = w.next().unwrap_or("");
        let verb = match verb {
            Some("add") | Some("create") => Verb::Add,
            Some("flush") => Verb::Flush,
            Some("delete") | Some("destroy") => Verb::Delete,
            _ => return Err(err("unknown verb")),
        };
        let (Some(kind), Some(family), Some(table)) = (kind, family, table) else {
            return Err(err("want `<verb> <type> <family> <table> …`"));
        };
        let t = tx.get_or_insert_with(|| Transaction::new(family, table));
        let (name, after) = rest.split_once(' ').unwrap_or((rest, ""));
        let object = match kind {
            "table" => Object::Table {
                comment: spec_clauses(rest)
                    .iter()
                    .find_map(|c| c.strip_prefix("comment ").map(unquote)),
            },
            "chain" => parse_chain(name, after),
            "rule" => {
                let (rule, comment) = split_comment(after);
                Object::Rule {
                    chain: name.into(),
                    rule,
                    comment,
                }
            }
            "set" => Object::Set {
                name: name.into(),
                spec: parse_spec(after),
            },
            "map" => Object::Map {
                name: name.into(),
                spec: parse_spec(after),
            },
            "element" => parse_element(name, after).ok_or_else(|| err("bad element"))?,
            _ => return Err(err("unknown object type")),
        };
        t.ops.push(Op { verb, object });
    }
    Ok(tx.unwrap_or_else(|| Transaction::new("ip", "kube-proxy")))
}

/// Upstream's canonical order of a dump or transaction text: drop blank and `#` lines;
/// stable-sort by object type (table, chain, rule, set, map, element, other), then object
/// name; rules of one chain keep their order, other ties sort by the whole line.
pub fn canonical_sort(text: &str) -> String {
    fn rank(t: &str) -> u8 {
        match t {
            "table" => 0,
            "chain" => 1,
            "rule" => 2,
            "set" => 3,
            "map" => 4,
            "element" => 5,
            _ => 6,
        }
    }
    let mut lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    lines.sort_by(|a, b| {
        let wa: Vec<&str> = a.split_whitespace().collect();
        let wb: Vec<&str> = b.split_whitespace().collect();
        let ta = wa.get(1).copied().unwrap_or("");
        let tb = wb.get(1).copied().unwrap_or("");
        rank(ta)
            .cmp(&rank(tb))
            .then_with(|| wa.get(4).cmp(&wb.get(4)))
            .then_with(|| {
                if ta == "rule" && tb == "rule" {
                    std::cmp::Ordering::Equal
                } else {
                    a.cmp(b)
                }
            })
    });
    lines.iter().map(|l| format!("{l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let text = "\
add table ip kube-proxy { comment \"rules for kube-proxy\" ; }
add chain ip kube-proxy filter-input { type filter hook input priority 0 ; }
add chain ip kube-proxy reject-chain { comment \"helper\" ; }
add chain ip kube-proxy services
flush chain ip kube-proxy services
add rule ip kube-proxy cluster-ips-check ip daddr @cluster-ips reject comment \"Reject traffic\"
add set ip kube-proxy affinity-X { type ipv4_addr ; flags dynamic,timeout ; timeout 10800s ; }
add map ip kube-proxy no-endpoint-nodeports { type inet_proto . inet_service : verdict ; comment \"vmap\" ; }
add element ip kube-proxy no-endpoint-services { 172.30.0.46 . tcp . 80 comment \"ns6/svc6:p80\" : goto reject-chain }
add element ip kube-proxy cluster-ips { 172.30.0.41 }
delete element ip kube-proxy cluster-ips { 172.30.0.41 }
delete chain ip kube-proxy services
";
        let tx = parse(text).expect("parse");
        assert_eq!(tx.num_operations(), 12);
        assert_eq!(tx.to_string(), text);
    }

    #[test]
    fn sort_keeps_rule_order_within_a_chain() {
        let s = canonical_sort(
            "add rule ip t b z\nadd element ip t s { 2 }\nadd rule ip t a y\nadd rule ip t b a\n# c\n\nadd chain ip t b\nadd element ip t s { 1 }\n",
        );
        assert_eq!(
            s,
            "add chain ip t b\nadd rule ip t a y\nadd rule ip t b z\nadd rule ip t b a\nadd element ip t s { 1 }\nadd element ip t s { 2 }\n"
        );
    }
}
