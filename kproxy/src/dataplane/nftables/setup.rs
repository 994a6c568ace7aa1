//! The static part of the table a full sync (re)writes: upstream `setupNFTables` — base
//! chains, the chains they jump to, masquerading, the sets and maps and the dispatch rules.

use std::collections::BTreeSet;

use super::config::NftablesConfig;
use super::transaction::{BaseChain, Object, SetSpec, Transaction};
use crate::dataplane::netfilter::node_ports::masquerade_mark;

pub(crate) const TABLE: &str = "kube-proxy";
pub(crate) const SERVICES: &str = "services";
pub(crate) const SERVICE_IPS: &str = "service-ips";
pub(crate) const SERVICE_NODEPORTS: &str = "service-nodeports";
pub(crate) const NODEPORT_IPS: &str = "nodeport-ips";
pub(crate) const CLUSTER_IPS: &str = "cluster-ips";
pub(crate) const SERVICE_ENDPOINTS_CHECK: &str = "service-endpoints-check";
pub(crate) const NODEPORT_ENDPOINTS_CHECK: &str = "nodeport-endpoints-check";
pub(crate) const NO_ENDPOINT_SERVICES: &str = "no-endpoint-services";
pub(crate) const NO_ENDPOINT_NODEPORTS: &str = "no-endpoint-nodeports";
pub(crate) const REJECT_CHAIN: &str = "reject-chain";
pub(crate) const CLUSTER_IPS_CHECK: &str = "cluster-ips-check";
pub(crate) const FIREWALL_IPS: &str = "firewall-ips";
pub(crate) const FIREWALL_CHECK: &str = "firewall-check";
pub(crate) const MARK_MASQ: &str = "mark-for-masquerade";
pub(crate) const MASQUERADING: &str = "masquerading";

pub(crate) const FILTER_PREROUTING_PRE_DNAT: &str = "filter-prerouting-pre-dnat";
pub(crate) const FILTER_OUTPUT_PRE_DNAT: &str = "filter-output-pre-dnat";
pub(crate) const FILTER_INPUT: &str = "filter-input";
pub(crate) const FILTER_FORWARD: &str = "filter-forward";
pub(crate) const FILTER_OUTPUT: &str = "filter-output";
pub(crate) const NAT_PREROUTING: &str = "nat-prerouting";
pub(crate) const NAT_OUTPUT: &str = "nat-output";
pub(crate) const NAT_POSTROUTING: &str = "nat-postrouting";

/// Base chains: (name, type, hook, priority). Filtering that must see pre-DNAT addresses runs
/// at DNAT-10 (-110); the rest at the filter (0), dstnat (-100) and srcnat (100) priorities.
pub(crate) const BASE_CHAINS: [(&str, &str, &str, i32); 8] = [
    (FILTER_PREROUTING_PRE_DNAT, "filter", "prerouting", -110),
    (FILTER_OUTPUT_PRE_DNAT, "filter", "output", -110),
    (FILTER_INPUT, "filter", "input", 0),
    (FILTER_FORWARD, "filter", "forward", 0),
    (FILTER_OUTPUT, "filter", "output", 0),
    (NAT_PREROUTING, "nat", "prerouting", -100),
    (NAT_OUTPUT, "nat", "output", -100),
    (NAT_POSTROUTING, "nat", "postrouting", 100),
];

/// Jumps from base chains: (target, from, extra match), in upstream's order.
pub(crate) const JUMP_CHAINS: [(&str, &str, &str); 11] = [
    (NODEPORT_ENDPOINTS_CHECK, FILTER_INPUT, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_INPUT, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_FORWARD, "ct state new"),
    (SERVICE_ENDPOINTS_CHECK, FILTER_OUTPUT, "ct state new"),
    (FIREWALL_CHECK, FILTER_PREROUTING_PRE_DNAT, "ct state new"),
    (FIREWALL_CHECK, FILTER_OUTPUT_PRE_DNAT, "ct state new"),
    (SERVICES, NAT_OUTPUT, ""),
    (SERVICES, NAT_PREROUTING, ""),
    (MASQUERADING, NAT_POSTROUTING, ""),
    (CLUSTER_IPS_CHECK, FILTER_FORWARD, "ct state new"),
    (CLUSTER_IPS_CHECK, FILTER_OUTPUT, "ct state new"),
];

/// Upstream `ensureChain`: add + flush `chain` once per transaction (`created` remembers).
/// With `skip`, the chain is only recorded as in use.
pub(crate) fn ensure_chain(
    tx: &mut Transaction,
    created: &mut BTreeSet<String>,
    chain: &str,
    skip: bool,
) {
    if !created.insert(chain.to_string()) || skip {
        return;
    }
    tx.add(Object::chain(chain));
    tx.flush(Object::chain(chain));
}

fn set_spec(kind: String, comment: &str) -> SetSpec {
    SetSpec {
        kind,
        flags: vec![],
        timeout: None,
        comment: Some(comment.into()),
    }
}

/// Appends upstream's `setupNFTables` operations to `tx`. Unlike upstream's older versions
/// the service sets and maps are not flushed: their elements are reconciled one by one
/// (like upstream's restart optimisation), so a restart does not empty them.
/// With `recreate_base_chains` (the proxier's first sync, upstream kubernetes#123162) every
/// base chain is added and deleted first, so one left by an older version with another hook
/// or priority is recreated instead of failing the transaction.
pub(crate) fn setup(cfg: &NftablesConfig, tx: &mut Transaction, recreate_base_chains: bool) {
    let ip = cfg.ip_x();
    let addr = cfg.addr_type();
    let no_localhost = match cfg.family {
        crate::model::IpFamily::V4 => "ip daddr != 127.0.0.0/8",
        crate::model::IpFamily::V6 => "ip6 daddr != ::1",
    };
    let mark = masquerade_mark(cfg.masquerade_bit);
    tx.add(Object::Table {
        comment: Some("rules for kube-proxy".into()),
    });
    if recreate_base_chains {
        for (name, ..) in BASE_CHAINS {
            tx.add(Object::chain(name));
            tx.delete(Object::chain(name));
        }
    }
    for (name, kind, hook, priority) in BASE_CHAINS {
        let c = Object::Chain {
            name: name.into(),
            base: Some(BaseChain {
                kind: kind.into(),
                hook: hook.into(),
                priority,
            }),
            comment: None,
        };
        tx.add(c.clone());
        tx.flush(c);
    }
    let mut created = BTreeSet::new();
    for (to, from, extra) in JUMP_CHAINS {
        ensure_chain(tx, &mut created, to, false);
        let rule = if extra.is_empty() {
            format!("jump {to}")
        } else {
            format!("{extra} jump {to}")
        };
        tx.add(Object::rule(from, rule));
    }
    for c in [SERVICES, CLUSTER_IPS_CHECK, MASQUERADING, MARK_MASQ] {
        ensure_chain(tx, &mut created, c, false);
    }
    tx.add(Object::rule(MARK_MASQ, format!("mark set mark or {mark}")));
    tx.add(Object::rule(
        MASQUERADING,
        format!("mark and {mark} == 0 return"),
    ));
    tx.add(Object::rule(
        MASQUERADING,
        format!("mark set mark xor {mark}"),
    ));
    tx.add(Object::rule(MASQUERADING, "masquerade fully-random"));

    tx.add(Object::Set {
        name: CLUSTER_IPS.into(),
        spec: set_spec(addr.into(), "Active ClusterIPs"),
    });
    tx.add(Object::rule_commented(
        CLUSTER_IPS_CHECK,
        format!("{ip} daddr @{CLUSTER_IPS} reject"),
        "Reject traffic to invalid ports of ClusterIPs",
    ));
    let cidrs = cfg.service_cidrs_text();
    if !cidrs.is_empty() {
        tx.add(Object::rule_commented(
            CLUSTER_IPS_CHECK,
            format!("{ip} daddr {{ {cidrs} }} drop"),
            "Drop traffic to unallocated ClusterIPs",
        ));
    }
    setup_nodeport_ips(cfg, tx);
    setup_maps(cfg, tx, no_localhost);
}

fn setup_nodeport_ips(cfg: &NftablesConfig, tx: &mut Transaction) {
    let set = Object::Set {
        name: NODEPORT_IPS.into(),
        spec: set_spec(cfg.addr_type().into(), "IPs that accept NodePort traffic"),
    };
    tx.add(set.clone());
    if cfg.node_ports().match_all() {
        tx.delete(set);
        return;
    }
    tx.flush(set);
    for ip in cfg.node_ports().node_ips() {
        if ip.is_loopback() {
            tracing::error!(address = %ip, "--nodeport-addresses includes localhost but localhost NodePorts are not supported");
            continue;
        }
        tx.add(Object::Element {
            name: NODEPORT_IPS.into(),
            key: ip.to_string(),
            value: None,
            comment: None,
        });
    }
}

fn setup_maps(cfg: &NftablesConfig, tx: &mut Transaction, no_localhost: &str) {
    let ip = cfg.ip_x();
    let addr = cfg.addr_type();
    let l3l4 = format!("{addr} . inet_proto . inet_service : verdict");
    let l4 = "inet_proto . inet_service : verdict".to_string();
    tx.add(Object::Map {
        name: NO_ENDPOINT_SERVICES.into(),
        spec: set_spec(
            l3l4.clone(),
            "vmap to drop or reject packets to services with no endpoints",
        ),
    });
    tx.add(Object::Map {
        name: NO_ENDPOINT_NODEPORTS.into(),
        spec: set_spec(
            l4.clone(),
            "vmap to drop or reject packets to service nodeports with no endpoints",
        ),
    });
    tx.add(Object::Chain {
        name: REJECT_CHAIN.into(),
        base: None,
        comment: Some("helper for @no-endpoint-services / @no-endpoint-nodeports".into()),
    });
    tx.flush(Object::chain(REJECT_CHAIN));
    tx.add(Object::rule(REJECT_CHAIN, "reject"));
    tx.add(Object::rule(
        SERVICE_ENDPOINTS_CHECK,
        format!("{ip} daddr . meta l4proto . th dport vmap @{NO_ENDPOINT_SERVICES}"),
    ));
    let match_all = cfg.node_ports().match_all();
    let np_dest = if match_all {
        no_localhost.to_string()
    } else {
        format!("{ip} daddr @{NODEPORT_IPS}")
    };
    tx.add(Object::rule(
        NODEPORT_ENDPOINTS_CHECK,
        format!("{np_dest} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}"),
    ));
    tx.add(Object::Map {
        name: FIREWALL_IPS.into(),
        spec: set_spec(
            l3l4.clone(),
            "destinations that are subject to LoadBalancerSourceRanges",
        ),
    });
    tx.add(Object::rule(
        FIREWALL_CHECK,
        format!("{ip} daddr . meta l4proto . th dport vmap @{FIREWALL_IPS}"),
    ));
    tx.add(Object::Map {
        name: SERVICE_IPS.into(),
        spec: set_spec(l3l4, "ClusterIP, ExternalIP and LoadBalancer IP traffic"),
    });
    tx.add(Object::Map {
        name: SERVICE_NODEPORTS.into(),
        spec: set_spec(l4, "NodePort traffic"),
    });
    tx.add(Object::rule(
        SERVICES,
        format!("{ip} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}"),
    ));
    let np_services = if match_all {
        format!("fib daddr type local {no_localhost}")
    } else {
        format!("{ip} daddr @{NODEPORT_IPS}")
    };
    tx.add(Object::rule(
        SERVICES,
        format!("{np_services} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}"),
    ));
}
