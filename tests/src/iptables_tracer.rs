//! A packet tracer over an iptables ruleset, with the semantics of upstream kube-proxy's test
//! tracer (`tracePacket` in pkg/proxy/iptables/proxier_test.go; see
//! `tests/fixtures/upstream/iptables/README.md`):
//!
//! runs nat `PREROUTING`, then — with the destination replaced by the first DNAT target's
//! host — filter `KUBE-SERVICES`, `KUBE-EXTERNAL-SERVICES`, `KUBE-NODEPORTS`,
//! `KUBE-PROXY-FIREWALL`. A rule matches when `-s`/`-d` (IP or CIDR, `!`), `--src-type` /
//! `--dst-type LOCAL`, `-p` and `--dport` all match; rules checking history (`--rcheck`),
//! marks or conntrack state never match; anything else is assumed to match. `KUBE-MARK-MASQ`
//! sets the masquerade flag and continues; ACCEPT/REJECT/DROP/DNAT end the chain; a jump
//! through a `--probability` rule does not end the calling chain (so every endpoint is seen).

use std::collections::HashMap;
use std::net::IpAddr;

use ipnet::IpNet;

/// One parsed rule.
#[derive(Debug, Clone, Default)]
pub struct Rule {
    pub raw: String,
    source: Option<(bool, String)>,
    dest: Option<(bool, String)>,
    src_type: Option<(bool, String)>,
    dst_type: Option<(bool, String)>,
    protocol: Option<(bool, String)>,
    dport: Option<(bool, String)>,
    jump: Option<String>,
    dnat_to: Option<String>,
    probability: bool,
    history: bool,
}

/// Splits a rule line into words, honouring double quotes.
pub fn tokenize(line: &str) -> Vec<String> {
    let mut out = vec![];
    let mut cur = String::new();
    let mut in_q = false;
    let mut any = false;
    for ch in line.chars() {
        match ch {
            '"' => {
                in_q = !in_q;
                any = true;
            }
            c if c.is_whitespace() && !in_q => {
                if any {
                    out.push(std::mem::take(&mut cur));
                    any = false;
                }
            }
            c => {
                cur.push(c);
                any = true;
            }
        }
    }
    if any {
        out.push(cur);
    }
    out
}

fn parse_rule(line: &str) -> (String, String, Rule) {
    let w = tokenize(line);
    let chain = w.get(1).cloned().unwrap_or_default();
    let mut r = Rule {
        raw: line.to_string(),
        ..Default::default()
    };
    let mut neg = false;
    let mut i = 2;
    while i < w.len() {
        let a = w[i].as_str();
        let next = w.get(i + 1).cloned().unwrap_or_default();
        match a {
            "!" => {
                neg = true;
                i += 1;
                continue;
            }
            "-s" | "--source" => r.source = Some((neg, next)),
            "-d" | "--destination" => r.dest = Some((neg, next)),
            "--src-type" => r.src_type = Some((neg, next)),
            "--dst-type" => r.dst_type = Some((neg, next)),
            "-p" | "--protocol" => r.protocol = Some((neg, next)),
            "--dport" => r.dport = Some((neg, next)),
            "-j" | "-g" => r.jump = Some(next),
            "--to-destination" => r.dnat_to = Some(next),
            "--probability" => r.probability = true,
            "--rcheck" => {
                r.history = true;
                i += 1;
                neg = false;
                continue;
            }
            "--mark" | "--ctstate" => {
                // A mark check (`-m mark --mark`), not `-j MARK --or-mark`; conntrack state.
                r.history = true;
            }
            _ => {
                i += 1;
                neg = false;
                continue;
            }
        }
        i += 2;
        neg = false;
    }
    let table_chain = chain.clone();
    (table_chain, chain, r)
}

/// A ruleset: table → chain → rules.
#[derive(Debug, Default)]
pub struct Ruleset {
    pub tables: HashMap<String, HashMap<String, Vec<Rule>>>,
}

impl Ruleset {
    /// Parses iptables-restore / iptables-save text (several tables may follow each other).
    pub fn parse(text: &str) -> Ruleset {
        let mut rs = Ruleset::default();
        let mut table = String::new();
        for line in text.lines().map(str::trim) {
            if let Some(t) = line.strip_prefix('*') {
                table = t.to_string();
                rs.tables.entry(table.clone()).or_default();
            } else if let Some(c) = line.strip_prefix(':') {
                let name = c.split_whitespace().next().unwrap_or("").to_string();
                rs.tables
                    .entry(table.clone())
                    .or_default()
                    .entry(name)
                    .or_default();
            } else if line.starts_with("-A ") {
                let (_, chain, rule) = parse_rule(line);
                rs.tables
                    .entry(table.clone())
                    .or_default()
                    .entry(chain)
                    .or_default()
                    .push(rule);
            }
        }
        rs
    }
}

/// Result of one trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// Raw rules that matched, in order.
    pub matches: Vec<String>,
    /// DNAT targets / verdicts joined with ", ".
    pub output: String,
    pub masq: bool,
}

struct Tracer<'a> {
    rs: &'a Ruleset,
    local_ips: &'a [IpAddr],
    matches: Vec<String>,
    outputs: Vec<String>,
    masq: bool,
}

fn addr_matches(ip: &str, spec: &str) -> bool {
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return false;
    };
    if let Ok(net) = spec.parse::<IpNet>() {
        return net.contains(&ip);
    }
    spec.parse::<IpAddr>().is_ok_and(|a| a == ip)
}

impl Tracer<'_> {
    fn is_local(&self, ip: &str) -> bool {
        ip.parse::<IpAddr>()
            .is_ok_and(|a| self.local_ips.contains(&a))
    }

    fn rule_matches(&self, r: &Rule, src: &str, proto: &str, dst: &str, dport: &str) -> bool {
        let check = |m: &Option<(bool, String)>, f: &dyn Fn(&str) -> bool| match m {
            None => true,
            Some((neg, v)) => f(v) != *neg,
        };
        check(&r.source, &|v| addr_matches(src, v))
            && check(&r.src_type, &|v| {
                (if self.is_local(src) {
                    "LOCAL"
                } else {
                    "not-matched"
                }) == v
            })
            && check(&r.protocol, &|v| v == proto)
            && check(&r.dest, &|v| addr_matches(dst, v))
            && check(&r.dst_type, &|v| {
                (if self.is_local(dst) {
                    "LOCAL"
                } else {
                    "not-matched"
                }) == v
            })
            && check(&r.dport, &|v| v == dport)
            && !r.history
    }

    fn run_chain(
        &mut self,
        table: &str,
        chain: &str,
        src: &str,
        proto: &str,
        dst: &str,
        dport: &str,
    ) -> bool {
        let rs = self.rs;
        let Some(rules) = rs.tables.get(table).and_then(|t| t.get(chain)) else {
            return false;
        };
        for r in rules {
            if !self.rule_matches(r, src, proto, dst, dport) {
                continue;
            }
            self.matches.push(r.raw.clone());
            let Some(jump) = r.jump.as_deref() else {
                continue;
            };
            match jump {
                "KUBE-MARK-MASQ" => {
                    self.masq = true;
                }
                "ACCEPT" | "REJECT" | "DROP" => {
                    self.outputs.push(jump.to_string());
                    return true;
                }
                "DNAT" => {
                    self.outputs.push(r.dnat_to.clone().unwrap_or_default());
                    return true;
                }
                other => {
                    let terminated = self.run_chain(table, other, src, proto, dst, dport);
                    if terminated && !r.probability {
                        return true;
                    }
                }
            }
        }
        false
    }
}

/// Traces one packet (`protocol` lower-case: tcp/udp/sctp) through `rs`.
pub fn trace_packet(
    rs: &Ruleset,
    local_ips: &[IpAddr],
    src: &str,
    protocol: &str,
    dst: &str,
    dport: u16,
) -> Trace {
    let mut t = Tracer {
        rs,
        local_ips,
        matches: vec![],
        outputs: vec![],
        masq: false,
    };
    let dport = dport.to_string();
    t.run_chain("nat", "PREROUTING", src, protocol, dst, &dport);
    let mut dst = dst.to_string();
    if let Some(first) = t.outputs.first() {
        // Upstream splits at the first ':' (so an IPv6 target yields no usable address).
        dst = first.split(':').next().unwrap_or("").to_string();
    }
    for chain in [
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-PROXY-FIREWALL",
    ] {
        t.run_chain("filter", chain, src, protocol, &dst, &dport);
    }
    Trace {
        matches: t.matches,
        output: t.outputs.join(", "),
        masq: t.masq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_keeps_quoted_comment() {
        assert_eq!(
            tokenize(r#"-A X -m comment --comment "a b" -j Y"#),
            ["-A", "X", "-m", "comment", "--comment", "a b", "-j", "Y"]
        );
    }

    #[test]
    fn negation_and_history() {
        let (_, _, r) = parse_rule("-A X -m mark ! --mark 0x4000/0x4000 -j RETURN");
        assert!(r.history);
        let (_, _, r) = parse_rule("-A X ! -s 10.0.0.0/8 -j KUBE-MARK-MASQ");
        assert_eq!(r.source, Some((true, "10.0.0.0/8".into())));
        let (_, _, r) = parse_rule("-A X -j MARK --or-mark 0x4000");
        assert!(!r.history);
    }
}
