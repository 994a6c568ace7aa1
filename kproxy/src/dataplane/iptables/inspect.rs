//! `kproxy inspect` in the iptables mode: per service port, the nat-table rules of its chains,
//! found by name (the hashed `KUBE-SVC-`/`SVL-`/`EXT-`/`FW-` names computed from the port, as
//! the proxier does), the rules jumping to them and the `KUBE-SEP-` chains they jump to — not
//! by comment, since upstream's large-cluster mode (> 1000 endpoints) drops the comments. One
//! `iptables-save -t nat` per backend and family, indexed by chain and by jump target.

use std::collections::{HashMap, HashSet};

use crate::dataplane::inspect::{Selected, ServiceReport};
use crate::model::ServicePortName;

use super::names::service_chains;

/// `iptables-save -t nat` of the backends that hold `KUBE-SERVICES` (IPv4 then IPv6).
fn iptables_nat() -> String {
    super::exec::nat_tables_everywhere()
        .into_iter()
        .filter(|text| text.lines().any(|l| l.starts_with(":KUBE-SERVICES")))
        .collect()
}

/// `iptables-save -t nat` text indexed by chain and by jump target.
#[derive(Default)]
struct NatRules<'a> {
    /// `-A` lines per chain, in order.
    by_chain: HashMap<&'a str, Vec<&'a str>>,
    /// `-A` lines per chain they jump (`-j`/`-g`) to.
    by_target: HashMap<&'a str, Vec<&'a str>>,
}

impl<'a> NatRules<'a> {
    fn parse(text: &'a str) -> Self {
        let mut r = NatRules::default();
        for line in text.lines().filter(|l| l.starts_with("-A ")) {
            let mut words = line.split_whitespace().skip(1);
            let Some(chain) = words.next() else { continue };
            r.by_chain.entry(chain).or_default().push(line);
            if let Some(target) = jump_target(line) {
                r.by_target.entry(target).or_default().push(line);
            }
        }
        r
    }

    fn chain(&self, name: &str) -> &[&'a str] {
        self.by_chain.get(name).map_or(&[], Vec::as_slice)
    }

    /// The rules of a service port: those jumping to its chains, its chains' own, and those
    /// of the endpoint chains its chains jump to (each once, in that order); and the DNAT
    /// destinations of the endpoint chains.
    fn of(&self, name: &ServicePortName) -> (Vec<&'a str>, Vec<String>) {
        let c = service_chains(name);
        let own = [&c.firewall, &c.external, &c.cluster, &c.local];
        let mut seen = HashSet::new();
        let mut lines = vec![];
        let mut add = |l: &'a str, lines: &mut Vec<&'a str>| {
            if seen.insert(l) {
                lines.push(l);
            }
        };
        for chain in own {
            for l in self.by_target.get(chain.as_str()).into_iter().flatten() {
                add(l, &mut lines);
            }
        }
        let mut endpoints = vec![];
        for chain in own {
            for l in self.chain(chain) {
                add(l, &mut lines);
                if let Some(t) = jump_target(l).filter(|t| t.starts_with("KUBE-SEP-"))
                    && !endpoints.contains(&t)
                {
                    endpoints.push(t);
                }
            }
        }
        let mut backends = vec![];
        for sep in endpoints {
            for l in self.chain(sep) {
                add(l, &mut lines);
                if let Some(dst) = l.split("--to-destination ").nth(1) {
                    let dst = dst.split_whitespace().next().unwrap_or("").to_string();
                    if !backends.contains(&dst) {
                        backends.push(dst);
                    }
                }
            }
        }
        (lines, backends)
    }
}

/// The chain an `-A` rule jumps or goes to.
fn jump_target(line: &str) -> Option<&str> {
    let mut words = line.split_whitespace();
    while let Some(w) = words.next() {
        if w == "-j" || w == "-g" {
            return words.next();
        }
    }
    None
}

pub(crate) fn view(selected: &Selected, reports: &mut [ServiceReport]) {
    let nat = iptables_nat();
    let rules = NatRules::parse(&nat);
    for ((name, _), r) in selected.iter().zip(reports.iter_mut()) {
        let (lines, backends) = rules.of(name);
        r.kernel = lines.into_iter().map(String::from).collect();
        r.kernel_backends = backends;
    }
}
