//! One service port's part of a sync (upstream `syncProxyRules`' loop body): its map and set
//! elements and its own chains, and the [`PortRecord`] of what it holds in the table.

use std::collections::BTreeSet;
use std::net::IpAddr;

use crate::model::topology::categorize_endpoints;
use crate::model::{Endpoint, IpFamily, NodeInfo, ServicePort};

use super::config::NftablesConfig;
use super::elements::ElementStorage;
use super::names::{ServiceChains, affinity_set, endpoint_chain, service_chains};
use super::setup::{MARK_MASQ, REJECT_CHAIN, ensure_chain};
use super::transaction::{Object, SetSpec, Transaction};

/// The element storages, one per set/map a service port puts elements into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Storages {
    pub cluster_ips: ElementStorage,
    pub service_ips: ElementStorage,
    pub firewall_ips: ElementStorage,
    pub no_endpoint_services: ElementStorage,
    pub no_endpoint_nodeports: ElementStorage,
    pub service_nodeports: ElementStorage,
}

impl Default for Storages {
    fn default() -> Self {
        use super::setup::*;
        Storages {
            cluster_ips: ElementStorage::new(CLUSTER_IPS),
            service_ips: ElementStorage::new(SERVICE_IPS),
            firewall_ips: ElementStorage::new(FIREWALL_IPS),
            no_endpoint_services: ElementStorage::new(NO_ENDPOINT_SERVICES),
            no_endpoint_nodeports: ElementStorage::new(NO_ENDPOINT_NODEPORTS),
            service_nodeports: ElementStorage::new(SERVICE_NODEPORTS),
        }
    }
}

/// Which of [`Storages`] an element key is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Store {
    ClusterIps,
    ServiceIps,
    FirewallIps,
    NoEndpointServices,
    NoEndpointNodeports,
    ServiceNodeports,
}

/// What one service port holds in the table after the sync that last planned it: its
/// chains, affinity sets and element keys (each key once per time the port ensured it), and
/// whether it counts for upstream's no-local-endpoints metric. A partial sync replaces the
/// records of the services it rewrites, so it knows what they no longer hold without
/// walking the others.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PortRecord {
    pub chains: Vec<String>,
    pub affinity_sets: Vec<String>,
    pub elements: Vec<(Store, String)>,
    pub no_local_internal: bool,
    pub no_local_external: bool,
}

impl Storages {
    pub(crate) fn get_mut(&mut self, store: Store) -> &mut ElementStorage {
        match store {
            Store::ClusterIps => &mut self.cluster_ips,
            Store::ServiceIps => &mut self.service_ips,
            Store::FirewallIps => &mut self.firewall_ips,
            Store::NoEndpointServices => &mut self.no_endpoint_services,
            Store::NoEndpointNodeports => &mut self.no_endpoint_nodeports,
            Store::ServiceNodeports => &mut self.service_nodeports,
        }
    }

    pub(crate) fn all_mut(&mut self) -> [&mut ElementStorage; 6] {
        [
            &mut self.cluster_ips,
            &mut self.service_ips,
            &mut self.firewall_ips,
            &mut self.no_endpoint_services,
            &mut self.no_endpoint_nodeports,
            &mut self.service_nodeports,
        ]
    }
}

/// State shared by every service port of one sync.
pub(crate) struct SyncContext<'a> {
    pub cfg: &'a NftablesConfig,
    pub node: &'a NodeInfo,
    pub tx: Transaction,
    pub storages: &'a mut Storages,
    /// Service/endpoint chains of the service ports planned so far (upstream `activeChains`).
    pub active_chains: BTreeSet<String>,
    pub active_affinity_sets: BTreeSet<String>,
    /// Full sync only: chains and sets already in the table; an existing endpoint chain whose
    /// affinity set existence matches is not rewritten (its rules follow from its name).
    pub existing: Option<(BTreeSet<String>, BTreeSet<String>)>,
    /// Existing endpoint chains this full sync keeps as they are.
    pub kept_chains: BTreeSet<String>,
    /// The record of the service port being planned.
    record: PortRecord,
}

fn l3l4(ip: &IpAddr, proto: &str, port: u16) -> String {
    format!("{ip} . {proto} . {port}")
}

/// What chains and verdicts one service port uses.
struct PortShape {
    ch: ServiceChains,
    cluster_eps: Vec<Endpoint>,
    local_eps: Vec<Endpoint>,
    all_reachable: Vec<Endpoint>,
    has_endpoints: bool,
    has_internal: bool,
    has_external: bool,
    internal_chain: String,
    external_policy_chain: String,
    uses_cluster_chain: bool,
    uses_local_chain: bool,
    uses_ext_chain: bool,
    uses_fw_chain: bool,
    internal_verdict: String,
    external_verdict: String,
}

fn shape(svc: &ServicePort, eps: &[Endpoint], node: &NodeInfo, family: IpFamily) -> PortShape {
    let ch = service_chains(&svc.name);
    let cat = categorize_endpoints(eps, svc, node);
    let cluster_eps = cat.cluster.clone().unwrap_or_default();
    let local_eps = cat.local.clone().unwrap_or_default();
    let has_endpoints = cat.has_any_endpoints;
    let mut internal_chain = ch.cluster.clone();
    let mut has_internal = has_endpoints;
    if svc.internal_policy_local {
        internal_chain = ch.local.clone();
        has_internal &= !local_eps.is_empty();
    }
    let mut external_policy_chain = ch.cluster.clone();
    let mut has_external = has_endpoints;
    if svc.external_policy_local {
        external_policy_chain = ch.local.clone();
        has_external &= !local_eps.is_empty();
    }
    let (internal_verdict, external_verdict) = if !has_endpoints {
        let v = format!("goto {REJECT_CHAIN}");
        (v.clone(), v)
    } else {
        ("drop".to_string(), "drop".to_string())
    };
    PortShape {
        uses_cluster_chain: !cluster_eps.is_empty() && svc.uses_cluster_endpoints(),
        uses_local_chain: !local_eps.is_empty() && svc.uses_local_endpoints(),
        uses_ext_chain: has_endpoints && svc.externally_accessible(),
        uses_fw_chain: svc.load_balancer_vips(family).next().is_some()
            && !svc.load_balancer_source_ranges.is_empty(),
        ch,
        cluster_eps,
        local_eps,
        all_reachable: cat.all_reachable,
        has_endpoints,
        has_internal,
        has_external,
        internal_chain,
        external_policy_chain,
        internal_verdict,
        external_verdict,
    }
}

impl<'a> SyncContext<'a> {
    pub(crate) fn new(
        cfg: &'a NftablesConfig,
        node: &'a NodeInfo,
        tx: Transaction,
        storages: &'a mut Storages,
        existing: Option<(BTreeSet<String>, BTreeSet<String>)>,
    ) -> Self {
        SyncContext {
            cfg,
            node,
            tx,
            storages,
            active_chains: BTreeSet::new(),
            active_affinity_sets: BTreeSet::new(),
            existing,
            kept_chains: BTreeSet::new(),
            record: PortRecord::default(),
        }
    }

    /// `kept`: not written (an existing endpoint chain a full sync keeps as it is, or a port
    /// whose elements alone are reconciled).
    fn ensure_chain(&mut self, chain: &str, kept: bool) {
        self.record.chains.push(chain.to_string());
        ensure_chain(&mut self.tx, &mut self.active_chains, chain, kept);
    }

    /// Upstream `ensureElem` into `store`, recorded as held by the port being planned.
    fn ensure(
        &mut self,
        store: Store,
        key: String,
        value: Option<String>,
        comment: Option<String>,
    ) {
        self.record.elements.push((store, key.clone()));
        self.storages
            .get_mut(store)
            .ensure(&mut self.tx, key, value, comment);
    }

    /// Whether a full sync can leave an existing endpoint chain as it is.
    fn endpoint_chain_current(&self, chain: &str, affinity: Option<&str>) -> bool {
        let Some((chains, sets)) = &self.existing else {
            return false;
        };
        chains.contains(chain)
            && match affinity {
                Some(set) => sets.contains(set),
                None => !sets.contains(&chain.replacen("endpoint-", "affinity-", 1)),
            }
    }

    /// Plans one service port (`eps`: all its endpoints, any family): writes its chains
    /// (unless `elements_only`), reconciles its elements and returns what it holds in the
    /// table.
    pub(crate) fn service_port(
        &mut self,
        svc: &ServicePort,
        cluster_ip: IpAddr,
        eps: &[Endpoint],
        elements_only: bool,
    ) -> PortRecord {
        let family = self.cfg.family;
        let eps = ServicePort::family_endpoints(eps, family);
        let svc = svc.for_family(family);
        let s = shape(&svc, &eps, self.node, family);
        let affinity = svc.session_affinity_timeout.is_some();
        for ep in &s.all_reachable {
            let chain = endpoint_chain(&svc.name, ep);
            let set = affinity_set(&svc.name, ep);
            let current = self.endpoint_chain_current(&chain, affinity.then_some(set.as_str()));
            self.ensure_chain(&chain, current || elements_only);
            if current && !elements_only {
                self.kept_chains.insert(chain);
            }
            if affinity {
                self.record.affinity_sets.push(set.clone());
                self.active_affinity_sets.insert(set);
            }
        }
        if s.uses_cluster_chain {
            self.ensure_chain(&s.ch.cluster, elements_only);
        }
        if s.uses_local_chain {
            self.ensure_chain(&s.ch.local, elements_only);
        }
        if s.uses_ext_chain {
            self.ensure_chain(&s.ch.external, elements_only);
        }
        if s.uses_fw_chain {
            self.ensure_chain(&s.ch.firewall, elements_only);
        }
        self.record.no_local_internal = s.has_endpoints && !s.has_internal;
        self.record.no_local_external = s.has_endpoints && !s.has_external;
        self.elements(&svc, cluster_ip, &s);
        if !elements_only {
            self.chains(&svc, cluster_ip, &s);
        }
        std::mem::take(&mut self.record)
    }

    fn elements(&mut self, svc: &ServicePort, cluster_ip: IpAddr, s: &PortShape) {
        let proto = svc.protocol.lower();
        let port = svc.port;
        let name = Some(svc.name.to_string());
        self.ensure(Store::ClusterIps, cluster_ip.to_string(), None, None);
        if s.has_internal {
            self.ensure(
                Store::ServiceIps,
                l3l4(&cluster_ip, proto, port),
                Some(format!("goto {}", s.internal_chain)),
                None,
            );
        } else {
            self.ensure(
                Store::NoEndpointServices,
                l3l4(&cluster_ip, proto, port),
                Some(s.internal_verdict.clone()),
                name.clone(),
            );
        }
        let ext_goto = format!("goto {}", s.ch.external);
        for ip in &svc.external_ips {
            if s.has_endpoints {
                let key = l3l4(ip, proto, port);
                self.ensure(Store::ServiceIps, key, Some(ext_goto.clone()), None);
            }
            if !s.has_external {
                self.ensure(
                    Store::NoEndpointServices,
                    l3l4(ip, proto, port),
                    Some(s.external_verdict.clone()),
                    name.clone(),
                );
            }
        }
        let vips: Vec<IpAddr> = svc.load_balancer_vips(self.cfg.family).collect();
        for ip in &vips {
            if s.has_endpoints {
                let key = l3l4(ip, proto, port);
                self.ensure(Store::ServiceIps, key, Some(ext_goto.clone()), None);
            }
            if s.uses_fw_chain {
                self.ensure(
                    Store::FirewallIps,
                    l3l4(ip, proto, port),
                    Some(format!("goto {}", s.ch.firewall)),
                    None,
                );
            }
        }
        if !s.has_external {
            for ip in &vips {
                self.ensure(
                    Store::NoEndpointServices,
                    l3l4(ip, proto, port),
                    Some(s.external_verdict.clone()),
                    name.clone(),
                );
            }
        }
        if svc.node_port != 0 {
            let key = format!("{proto} . {}", svc.node_port);
            if s.has_endpoints {
                let goto = Some(ext_goto.clone());
                self.ensure(Store::ServiceNodeports, key.clone(), goto, None);
            }
            if !s.has_external {
                let verdict = Some(s.external_verdict.clone());
                self.ensure(Store::NoEndpointNodeports, key, verdict, name);
            }
        }
    }

    fn chains(&mut self, svc: &ServicePort, cluster_ip: IpAddr, s: &PortShape) {
        let cfg = self.cfg;
        let ip = cfg.ip_x();
        let tx = &mut self.tx;
        if s.has_internal {
            let dst = format!("{ip} daddr {cluster_ip}");
            if cfg.masquerade_all {
                tx.add(Object::rule(
                    &s.internal_chain,
                    format!("{dst} jump {MARK_MASQ}"),
                ));
            } else if let Some(not_local) = cfg.if_not_local() {
                tx.add(Object::rule(
                    &s.internal_chain,
                    format!("{dst} {not_local} jump {MARK_MASQ}"),
                ));
            }
        }
        if s.uses_ext_chain {
            let ext = &s.ch.external;
            if !svc.external_policy_local {
                tx.add(Object::rule(ext, format!("jump {MARK_MASQ}")));
            } else {
                if let Some(local) = cfg.if_local() {
                    tx.add(Object::rule_commented(
                        ext,
                        format!("{local} goto {}", s.ch.cluster),
                        "short-circuit pod traffic",
                    ));
                }
                tx.add(Object::rule_commented(
                    ext,
                    format!("fib saddr type local jump {MARK_MASQ}"),
                    "masquerade local traffic",
                ));
                tx.add(Object::rule_commented(
                    ext,
                    format!("fib saddr type local goto {}", s.ch.cluster),
                    "short-circuit local traffic",
                ));
            }
            if s.has_external {
                tx.add(Object::rule(
                    ext,
                    format!("goto {}", s.external_policy_chain),
                ));
            }
        }
        if s.uses_fw_chain {
            self.firewall_rule(svc, s);
        }
        self.endpoint_chains(svc, s);
    }

    fn firewall_rule(&mut self, svc: &ServicePort, s: &PortShape) {
        let mut sources: Vec<String> = vec![];
        let mut allow_from_node = false;
        for cidr in &svc.load_balancer_source_ranges {
            sources.push(cidr.to_string());
            allow_from_node |= self.cfg.node_ip.is_some_and(|ip| cidr.contains(&ip));
        }
        if allow_from_node {
            sources.extend(
                svc.load_balancer_vips(self.cfg.family)
                    .map(|i| i.to_string()),
            );
        }
        self.tx.add(Object::rule(
            &s.ch.firewall,
            format!(
                "{} saddr != {{ {} }} drop",
                self.cfg.ip_x(),
                sources.join(" , ")
            ),
        ));
    }

    fn endpoint_chains(&mut self, svc: &ServicePort, s: &PortShape) {
        let ip = self.cfg.ip_x();
        let affinity = svc.session_affinity_timeout;
        if let Some(timeout) = affinity {
            for ep in &s.all_reachable {
                self.tx.add(Object::Set {
                    name: affinity_set(&svc.name, ep),
                    spec: SetSpec {
                        kind: self.cfg.addr_type().into(),
                        flags: vec!["dynamic".into(), "timeout".into()],
                        timeout: Some(timeout),
                        comment: None,
                    },
                });
            }
        }
        if s.uses_cluster_chain {
            self.service_to_endpoints(svc, &s.ch.cluster, &s.cluster_eps);
        }
        if s.uses_local_chain {
            self.service_to_endpoints(svc, &s.ch.local, &s.local_eps);
        }
        let proto = svc.protocol.lower();
        for ep in &s.all_reachable {
            let chain = endpoint_chain(&svc.name, ep);
            if self.kept_chains.contains(&chain) {
                continue; // an existing endpoint chain a full sync keeps as it is
            }
            self.tx.add(Object::rule(
                &chain,
                format!("{ip} saddr {} jump {MARK_MASQ}", ep.ip),
            ));
            if affinity.is_some() {
                self.tx.add(Object::rule(
                    &chain,
                    format!("update @{} {{ {ip} saddr }}", affinity_set(&svc.name, ep)),
                ));
            }
            self.tx.add(Object::rule(
                &chain,
                format!("meta l4proto {proto} dnat to {}", ep.addr()),
            ));
        }
    }

    /// Upstream `writeServiceToEndpointRules`.
    fn service_to_endpoints(&mut self, svc: &ServicePort, chain: &str, eps: &[Endpoint]) {
        let ip = self.cfg.ip_x();
        if svc.session_affinity_timeout.is_some() {
            for ep in eps {
                self.tx.add(Object::rule(
                    chain,
                    format!(
                        "{ip} saddr @{} goto {}",
                        affinity_set(&svc.name, ep),
                        endpoint_chain(&svc.name, ep)
                    ),
                ));
            }
        }
        let vmap: Vec<String> = eps
            .iter()
            .enumerate()
            .map(|(i, ep)| format!("{i} : goto {}", endpoint_chain(&svc.name, ep)))
            .collect();
        self.tx.add(Object::rule(
            chain,
            format!(
                "numgen random mod {} vmap {{ {} }}",
                eps.len(),
                vmap.join(" , ")
            ),
        ));
    }
}
