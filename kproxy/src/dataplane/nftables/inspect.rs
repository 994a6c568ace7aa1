//! `kproxy inspect` in the nftables mode: per service port, what the `ip`/`ip6 kube-proxy`
//! tables hold for it, read through nf_tables netlink ([`crate::kernel::nftables`]):
//!
//! - the elements of the dispatch maps and sets (`service-ips`, `service-nodeports`,
//!   `firewall-ips`, `no-endpoint-services`, `no-endpoint-nodeports`, `cluster-ips`) whose
//!   verdict goes to one of the port's chains or whose key is one of its frontends;
//! - the port's chains (`service-`, `local-`, `external-`, `firewall-`, `endpoint-`, found
//!   by their `HASH-ns/name/proto/port` names) with their rule counts.
//!
//! An endpoint counts as programmed when its `endpoint-` chain (the name the proxier
//! computes for it) exists. Each table's chains, sets and the six storages' elements are
//! read once and indexed, then joined to the selected ports.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::IpAddr;

use anyhow::Context;

use super::names::endpoint_chain;
use crate::kernel::nftables::{NFPROTO_IPV4, NFPROTO_IPV6, NftNetlink};
use crate::model::{ServicePort, ServicePortName, Snapshot};

use crate::dataplane::inspect::{Selected, ServiceReport};

const TABLE: &str = "kube-proxy";
/// The element storages a service port has elements in.
const STORAGES: [&str; 6] = [
    "service-ips",
    "service-nodeports",
    "firewall-ips",
    "no-endpoint-services",
    "no-endpoint-nodeports",
    "cluster-ips",
];

/// One family's table as read.
struct TableView {
    family: &'static str,
    /// Chain name → rule count, per `ns/name/proto/port` of the chain.
    chains_by_port: HashMap<String, Vec<(String, usize)>>,
    chains: HashSet<String>,
    /// (storage, key, value) of every element.
    elements: Vec<(&'static str, String, Option<String>)>,
}

/// The `ns/name/proto/port` part of a service or endpoint chain name
/// (`service-HASH8-ns/name/tcp/p`, `endpoint-HASH8-ns/name/tcp/p__10.0.0.1/80`).
fn port_of_chain(chain: &str) -> Option<&str> {
    let (_, rest) = chain.split_once('-')?;
    let rest = rest.get(9..)?; // HASH8 and '-'
    Some(rest.split("__").next().unwrap_or(rest))
}

/// `ns/name/proto/port` of a service port, as in its chain names.
fn port_key(name: &ServicePortName) -> String {
    format!(
        "{}/{}/{}/{}",
        name.namespace,
        name.name,
        name.protocol.lower(),
        name.port
    )
}

/// Whether `true` iff the table exists (`Ok(None)` when it does not).
fn read(family: u8, family_name: &'static str) -> anyhow::Result<Option<TableView>> {
    let mut nl = NftNetlink::open(family, None)?;
    if nl.table(TABLE)?.is_none() {
        return Ok(None);
    }
    let mut view = TableView {
        family: family_name,
        chains_by_port: HashMap::new(),
        chains: HashSet::new(),
        elements: vec![],
    };
    for c in nl.chains(TABLE)? {
        if let Some(port) = port_of_chain(&c.name).filter(|_| c.name.contains('/')) {
            let rules = nl.rule_count(TABLE, &c.name)?;
            view.chains_by_port
                .entry(port.to_string())
                .or_default()
                .push((c.name.clone(), rules));
        }
        view.chains.insert(c.name);
    }
    let sets = nl.sets(TABLE)?;
    for storage in STORAGES {
        if let Some(s) = sets.iter().find(|s| s.name == storage) {
            for (k, v) in nl.elements(s)? {
                view.elements.push((storage, k, v));
            }
        }
    }
    Ok(Some(view))
}

/// The element keys a port's frontends have (`ip . proto . port`, `proto . nodePort`, `ip`).
fn frontend_keys(sp: &ServicePort) -> HashSet<String> {
    let proto = sp.protocol.lower();
    let mut ips: Vec<IpAddr> = sp.cluster_ips.clone();
    ips.extend(sp.external_ips.iter().copied());
    ips.extend(sp.load_balancer_ingress.iter().map(|i| i.ip));
    let mut keys: HashSet<String> = ips
        .iter()
        .map(|ip| format!("{ip} . {proto} . {}", sp.port))
        .collect();
    keys.extend(sp.cluster_ips.iter().map(IpAddr::to_string));
    if sp.node_port != 0 {
        keys.insert(format!("{proto} . {}", sp.node_port));
    }
    keys
}

fn port_view(
    t: &TableView,
    snap: &Snapshot,
    name: &ServicePortName,
    sp: &ServicePort,
    r: &mut ServiceReport,
) {
    let chains: BTreeMap<&str, usize> = t
        .chains_by_port
        .get(&port_key(name))
        .into_iter()
        .flatten()
        .map(|(c, n)| (c.as_str(), *n))
        .collect();
    let keys = frontend_keys(sp);
    for (storage, key, value) in &t.elements {
        let to_mine = value
            .as_deref()
            .and_then(|v| v.split_once(' '))
            .is_some_and(|(_, target)| chains.contains_key(target));
        if to_mine || keys.contains(key) {
            let v = value
                .as_deref()
                .map(|v| format!(" : {v}"))
                .unwrap_or_default();
            r.kernel.push(format!("{} {storage}: {key}{v}", t.family));
        }
    }
    for (chain, rules) in &chains {
        r.kernel
            .push(format!("{} chain {chain} ({rules} rules)", t.family));
    }
    // Endpoints of the table's family only (an `ip6` table never holds an IPv4 endpoint).
    let family_v6 = t.family == "ip6";
    for ep in snap
        .endpoints_of(name)
        .iter()
        .filter(|e| e.ip.is_ipv6() == family_v6)
    {
        if t.chains.contains(&endpoint_chain(name, ep)) {
            let a = match ep.ip {
                IpAddr::V4(a) => format!("{a}:{}", ep.port),
                IpAddr::V6(a) => format!("[{a}]:{}", ep.port),
            };
            if !r.kernel_backends.contains(&a) {
                r.kernel_backends.push(a);
            }
        }
    }
}

/// Fills the kernel view of the `selected` ports from both families' tables.
pub(crate) fn view(
    snap: &Snapshot,
    selected: &Selected<'_>,
    reports: &mut [ServiceReport],
) -> anyhow::Result<()> {
    for (fam, fam_name) in [(NFPROTO_IPV4, "ip"), (NFPROTO_IPV6, "ip6")] {
        let Some(t) = read(fam, fam_name)
            .with_context(|| format!("reading table {fam_name} {TABLE} through netlink"))?
        else {
            continue;
        };
        for ((name, sp), r) in selected.iter().zip(reports.iter_mut()) {
            port_view(&t, snap, name, sp, r);
        }
    }
    Ok(())
}

/// Whether a `kube-proxy` nftables table with its `services` chain exists here (mode
/// detection for `kproxy inspect`).
pub(crate) fn programmed() -> bool {
    [NFPROTO_IPV4, NFPROTO_IPV6].into_iter().any(|f| {
        NftNetlink::open(f, None)
            .and_then(|mut nl| nl.chains(TABLE))
            .is_ok_and(|c| c.iter().any(|c| c.name == "services"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_names_map_to_their_service_port() {
        assert_eq!(
            port_of_chain("service-ULMVA6XW-ns1/svc1/tcp/p80"),
            Some("ns1/svc1/tcp/p80")
        );
        assert_eq!(
            port_of_chain("endpoint-5OJB2KTY-ns1/svc1/tcp/p80__10.180.0.1/80"),
            Some("ns1/svc1/tcp/p80")
        );
        assert_eq!(port_of_chain("services"), None);
    }
}
