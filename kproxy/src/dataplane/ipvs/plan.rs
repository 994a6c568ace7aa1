//! The pure IPVS planner: a [`Snapshot`] and an [`IpvsConfig`] in, the exact kernel objects out
//! ([`IpvsPlan`]): virtual services with their real servers, the addresses bound to the dummy
//! device, the ipsets with their entries, and the iptables rules upstream's IPVS mode puts
//! around them. No I/O; every decision is unit-tested.
//!
//! Per service port of the dataplane's family (upstream `syncProxyRules`):
//! - **ClusterIP** `vip:port` → a virtual service, the VIP bound to the dummy device, an entry
//!   in `KUBE-CLUSTER-IP`; real servers are the cluster endpoints, or the local ones with
//!   `internalTrafficPolicy: Local`.
//! - **externalIPs** → virtual service, bound, `KUBE-EXTERNAL-IP` (or `-LOCAL` with
//!   `externalTrafficPolicy: Local`); real servers are the external-policy endpoints.
//! - **LoadBalancer ingress IPs** (ipMode VIP) → the same with `KUBE-LOAD-BALANCER` (`-LOCAL`),
//!   and with source ranges `KUBE-LOAD-BALANCER-FW` + `-SOURCE-CIDR` (+ `-SOURCE-IP` when a
//!   range holds a node address, so the node itself may reach the VIP; otherwise node access is
//!   dropped in `KUBE-IPVS-OUT-FILTER`).
//! - **NodePort** → one virtual service per node address (not bound: the addresses are the
//!   node's own), `KUBE-NODE-PORT-TCP`/`-UDP` (bitmap) or `-SCTP-HASH` (ip,port), `-LOCAL-`
//!   variants with `externalTrafficPolicy: Local`.
//! - **local endpoints** → `KUBE-LOOP-BACK` (hairpin masquerade).
//!
//! Real servers get weight 1; endpoints that are terminating and not selected are kept with
//! weight 0 (no new connections, existing ones continue) while they are listed. ClientIP
//! session affinity makes the virtual service persistent with the affinity timeout.
//!
//! Differences from upstream, on purpose: two service ports mapping to the same virtual
//! service (e.g. the same external IP:port) are an error for the second one (named in
//! [`IpvsPlan::errors`]) instead of whichever syncs last winning.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use super::config::IpvsConfig;
use super::genl::{SVC_F_PERSISTENT, ServiceKey, VirtualService};
use crate::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName, Snapshot};

/// Kinds of ipset (`ipset create NAME <type>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SetType {
    HashIp,
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    BitmapPort,
}

impl SetType {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SetType::HashIp => "hash:ip",
            SetType::HashIpPort => "hash:ip,port",
            SetType::HashIpPortIp => "hash:ip,port,ip",
            SetType::HashIpPortNet => "hash:ip,port,net",
            SetType::BitmapPort => "bitmap:port",
        }
    }
}

/// The ipsets of upstream's IPVS mode: (base name, type, comment).
pub(crate) const IPSETS: &[(&str, SetType, &str)] = &[
    (
        LOOP_BACK,
        SetType::HashIpPortIp,
        "Kubernetes endpoints dst ip:port, source ip for solving hairpin purpose",
    ),
    (
        CLUSTER_IP,
        SetType::HashIpPort,
        "Kubernetes service cluster ip + port for masquerade purpose",
    ),
    (
        EXTERNAL_IP,
        SetType::HashIpPort,
        "Kubernetes service external ip + port for masquerade and filter purpose",
    ),
    (
        EXTERNAL_IP_LOCAL,
        SetType::HashIpPort,
        "Kubernetes service external ip + port with externalTrafficPolicy=local",
    ),
    (
        LOAD_BALANCER,
        SetType::HashIpPort,
        "Kubernetes service lb portal",
    ),
    (
        LOAD_BALANCER_LOCAL,
        SetType::HashIpPort,
        "Kubernetes service load balancer ip + port with externalTrafficPolicy=local",
    ),
    (
        LOAD_BALANCER_FW,
        SetType::HashIpPort,
        "Kubernetes service load balancer ip + port for load balancer with sourceRange",
    ),
    (
        LOAD_BALANCER_SOURCE_IP,
        SetType::HashIpPortIp,
        "Kubernetes service load balancer ip + port + source IP for packet filter purpose",
    ),
    (
        LOAD_BALANCER_SOURCE_CIDR,
        SetType::HashIpPortNet,
        "Kubernetes service load balancer ip + port + source cidr for packet filter purpose",
    ),
    (
        NODE_PORT_TCP,
        SetType::BitmapPort,
        "Kubernetes nodeport TCP port for masquerade purpose",
    ),
    (
        NODE_PORT_LOCAL_TCP,
        SetType::BitmapPort,
        "Kubernetes nodeport TCP port with externalTrafficPolicy=local",
    ),
    (
        NODE_PORT_UDP,
        SetType::BitmapPort,
        "Kubernetes nodeport UDP port for masquerade purpose",
    ),
    (
        NODE_PORT_LOCAL_UDP,
        SetType::BitmapPort,
        "Kubernetes nodeport UDP port with externalTrafficPolicy=local",
    ),
    (
        NODE_PORT_SCTP,
        SetType::HashIpPort,
        "Kubernetes nodeport SCTP port for masquerade purpose with type 'hash ip:port'",
    ),
    (
        NODE_PORT_LOCAL_SCTP,
        SetType::HashIpPort,
        "Kubernetes nodeport SCTP port with externalTrafficPolicy=local with type 'hash ip:port'",
    ),
    (
        HEALTH_CHECK_NODE_PORT,
        SetType::BitmapPort,
        "Kubernetes health check node port",
    ),
    (IPVS_IPS, SetType::HashIp, "Addresses on the ipvs interface"),
];

pub(crate) const LOOP_BACK: &str = "KUBE-LOOP-BACK";
pub(crate) const CLUSTER_IP: &str = "KUBE-CLUSTER-IP";
pub(crate) const EXTERNAL_IP: &str = "KUBE-EXTERNAL-IP";
pub(crate) const EXTERNAL_IP_LOCAL: &str = "KUBE-EXTERNAL-IP-LOCAL";
pub(crate) const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
pub(crate) const LOAD_BALANCER_LOCAL: &str = "KUBE-LOAD-BALANCER-LOCAL";
pub(crate) const LOAD_BALANCER_FW: &str = "KUBE-LOAD-BALANCER-FW";
pub(crate) const LOAD_BALANCER_SOURCE_IP: &str = "KUBE-LOAD-BALANCER-SOURCE-IP";
pub(crate) const LOAD_BALANCER_SOURCE_CIDR: &str = "KUBE-LOAD-BALANCER-SOURCE-CIDR";
pub(crate) const NODE_PORT_TCP: &str = "KUBE-NODE-PORT-TCP";
pub(crate) const NODE_PORT_LOCAL_TCP: &str = "KUBE-NODE-PORT-LOCAL-TCP";
pub(crate) const NODE_PORT_UDP: &str = "KUBE-NODE-PORT-UDP";
pub(crate) const NODE_PORT_LOCAL_UDP: &str = "KUBE-NODE-PORT-LOCAL-UDP";
pub(crate) const NODE_PORT_SCTP: &str = "KUBE-NODE-PORT-SCTP-HASH";
pub(crate) const NODE_PORT_LOCAL_SCTP: &str = "KUBE-NODE-PORT-LOCAL-SCTP-HASH";
pub(crate) const HEALTH_CHECK_NODE_PORT: &str = "KUBE-HEALTH-CHECK-NODE-PORT";
pub(crate) const IPVS_IPS: &str = "KUBE-IPVS-IPS";

/// The kernel name of a set for `family`: IPv6 sets are `KUBE-6-…`, cut to ipset's 31 bytes.
pub(crate) fn set_name(base: &str, family: IpFamily) -> String {
    match family {
        IpFamily::V4 => base.to_string(),
        IpFamily::V6 => {
            let mut n = base.replacen("KUBE-", "KUBE-6-", 1);
            n.truncate(31);
            n
        }
    }
}

/// Why a virtual service exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum VsKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

/// One planned virtual service with its real servers (`addr:port` → weight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlannedService {
    pub service: VirtualService,
    pub kind: VsKind,
    pub origin: ServicePortName,
    pub real_servers: BTreeMap<(IpAddr, u16), u32>,
}

/// One planned ipset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PlannedSet {
    /// Kernel name (family-adjusted).
    pub name: String,
    pub set_type: SetType,
    pub comment: &'static str,
    pub entries: BTreeSet<String>,
}

/// One rule in `iptables-restore` syntax (`-A CHAIN …`), with its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rules {
    pub nat: Vec<String>,
    pub filter: Vec<String>,
}

/// Chains upstream's IPVS mode owns, per table.
pub(crate) const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
];
pub(crate) const FILTER_CHAINS: &[&str] = &[
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// Jumps from the built-in chains: (table, from, to, comment).
pub(crate) const JUMPS: &[(&str, &str, &str, &str)] = &[
    (
        "nat",
        "OUTPUT",
        "KUBE-SERVICES",
        "kubernetes service portals",
    ),
    (
        "nat",
        "PREROUTING",
        "KUBE-SERVICES",
        "kubernetes service portals",
    ),
    (
        "nat",
        "POSTROUTING",
        "KUBE-POSTROUTING",
        "kubernetes postrouting rules",
    ),
    (
        "filter",
        "FORWARD",
        "KUBE-FORWARD",
        "kubernetes forwarding rules",
    ),
    (
        "filter",
        "INPUT",
        "KUBE-NODE-PORT",
        "kubernetes health check rules",
    ),
    (
        "filter",
        "INPUT",
        "KUBE-PROXY-FIREWALL",
        "kube-proxy firewall rules",
    ),
    (
        "filter",
        "FORWARD",
        "KUBE-PROXY-FIREWALL",
        "kube-proxy firewall rules",
    ),
    (
        "filter",
        "INPUT",
        "KUBE-IPVS-FILTER",
        "kubernetes ipvs access filter",
    ),
    (
        "filter",
        "OUTPUT",
        "KUBE-IPVS-OUT-FILTER",
        "kubernetes ipvs access filter",
    ),
];

/// Everything one IPVS dataplane instance should hold in the kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IpvsPlan {
    pub family: IpFamily,
    pub services: BTreeMap<ServiceKey, PlannedService>,
    /// Addresses bound to the dummy device.
    pub bound: BTreeSet<IpAddr>,
    /// Keyed by base name (`KUBE-CLUSTER-IP`), every set of [`IPSETS`] present (maybe empty).
    pub sets: BTreeMap<&'static str, PlannedSet>,
    pub rules: Rules,
    /// Service ports planned (of this family).
    pub service_ports: usize,
    /// Service ports left out, each with the reason.
    pub errors: Vec<(ServicePortName, String)>,
}

impl IpvsPlan {
    /// Distinct endpoints (`ip:port`) taking new connections in some virtual service.
    pub(crate) fn active_endpoints(&self) -> usize {
        self.services
            .values()
            .flat_map(|s| {
                s.real_servers
                    .iter()
                    .filter(|(_, w)| **w > 0)
                    .map(|(k, _)| *k)
            })
            .collect::<BTreeSet<_>>()
            .len()
    }
    /// Real servers with a non-zero weight, over all virtual services.
    pub(crate) fn active_real_servers(&self) -> usize {
        self.services
            .values()
            .map(|s| s.real_servers.values().filter(|w| **w > 0).count())
            .sum()
    }
}

fn ip_port_entry(ip: IpAddr, protocol: Protocol, port: u16) -> String {
    format!("{ip},{}:{port}", protocol.lower())
}

/// Builds the plan for `cfg.family`.
pub(crate) fn plan(snap: &Snapshot, cfg: &IpvsConfig) -> IpvsPlan {
    let family = cfg.family;
    let mut p = IpvsPlan {
        family,
        services: BTreeMap::new(),
        bound: BTreeSet::new(),
        sets: IPSETS
            .iter()
            .map(|(base, set_type, comment)| {
                (
                    *base,
                    PlannedSet {
                        name: set_name(base, family),
                        set_type: *set_type,
                        comment,
                        entries: BTreeSet::new(),
                    },
                )
            })
            .collect(),
        rules: Rules {
            nat: vec![],
            filter: vec![],
        },
        service_ports: 0,
        errors: vec![],
    };
    let mut no_node_access: BTreeSet<(IpAddr, Protocol, u16)> = BTreeSet::new();
    for svc in snap.services.values() {
        let Some(cluster_ip) = svc.cluster_ip(family) else {
            continue;
        };
        if let Err(reason) = plan_port(snap, cfg, svc, cluster_ip, &mut p, &mut no_node_access) {
            p.errors.push((svc.name.clone(), reason));
        } else {
            p.service_ports += 1;
        }
    }
    let ipvs_ips: BTreeSet<String> = p.bound.iter().map(|ip| ip.to_string()).collect();
    p.sets
        .get_mut(IPVS_IPS)
        .expect("every set is planned")
        .entries = ipvs_ips;
    p.rules = rules(cfg, &p.sets, &no_node_access);
    p
}

/// Plans one service port into `p`; on error `p` is left untouched.
fn plan_port(
    snap: &Snapshot,
    cfg: &IpvsConfig,
    svc: &ServicePort,
    cluster_ip: IpAddr,
    p: &mut IpvsPlan,
    no_node_access: &mut BTreeSet<(IpAddr, Protocol, u16)>,
) -> Result<(), String> {
    let mut d = PortDraft::new(snap, cfg, svc);
    d.add_cluster_ip(cluster_ip);
    d.add_external_ips();
    d.add_load_balancers(no_node_access);
    d.add_node_ports();
    d.add_health_check_node_port();
    d.add_loopback_entries();
    d.commit(p)
}

/// One service port's virtual services, bound addresses and set entries, before they are
/// checked against what earlier service ports planned.
struct PortDraft<'a> {
    cfg: &'a IpvsConfig,
    svc: &'a ServicePort,
    /// The service port's endpoints of the family (terminating ones included).
    all: Vec<&'a Endpoint>,
    /// The endpoints internal / external traffic goes to (per its traffic policy).
    internal_eps: Vec<Endpoint>,
    external_eps: Vec<Endpoint>,
    services: Vec<PlannedService>,
    bound: Vec<IpAddr>,
    entries: Vec<(&'static str, String)>,
}

impl<'a> PortDraft<'a> {
    fn new(snap: &'a Snapshot, cfg: &'a IpvsConfig, svc: &'a ServicePort) -> Self {
        let family = cfg.family;
        let cat = snap.categorize(svc);
        let all: Vec<&Endpoint> = snap
            .endpoints_of(&svc.name)
            .iter()
            .filter(|e| family.matches(&e.ip))
            .collect();
        let for_policy = |local: bool| {
            if local {
                cat.local.clone().unwrap_or_default()
            } else {
                cat.cluster.clone().unwrap_or_default()
            }
        };
        PortDraft {
            cfg,
            svc,
            all,
            internal_eps: for_policy(svc.internal_policy_local),
            external_eps: for_policy(svc.external_policy_local),
            services: vec![],
            bound: vec![],
            entries: vec![],
        }
    }

    /// The real servers of `selected` (weight 1), plus the terminating endpoints still
    /// listed, which keep draining with weight 0.
    fn real_servers(&self, selected: &[Endpoint]) -> BTreeMap<(IpAddr, u16), u32> {
        let family = self.cfg.family;
        let mut rs: BTreeMap<(IpAddr, u16), u32> = selected
            .iter()
            .filter(|e| family.matches(&e.ip))
            .map(|e| ((e.ip, e.port), 1))
            .collect();
        for e in &self.all {
            if e.terminating {
                rs.entry((e.ip, e.port)).or_insert(0);
            }
        }
        rs
    }

    /// Adds the virtual service `addr:port` of `kind`, to the internal or external endpoints.
    fn add_service(&mut self, addr: IpAddr, port: u16, kind: VsKind, external: bool) {
        let svc = self.svc;
        let (flags, timeout) = match svc.session_affinity_timeout {
            Some(t) => (SVC_F_PERSISTENT, t),
            None => (0, 0),
        };
        let real_servers = if external {
            self.real_servers(&self.external_eps)
        } else {
            self.real_servers(&self.internal_eps)
        };
        self.services.push(PlannedService {
            service: VirtualService {
                key: ServiceKey {
                    addr,
                    protocol: svc.protocol,
                    port,
                },
                scheduler: self.cfg.scheduler().to_string(),
                flags,
                timeout,
            },
            kind,
            origin: svc.name.clone(),
            real_servers,
        });
    }

    fn add_cluster_ip(&mut self, cluster_ip: IpAddr) {
        let svc = self.svc;
        self.add_service(cluster_ip, svc.port, VsKind::ClusterIp, false);
        self.bound.push(cluster_ip);
        self.entries.push((
            CLUSTER_IP,
            ip_port_entry(cluster_ip, svc.protocol, svc.port),
        ));
    }

    fn add_external_ips(&mut self) {
        let svc = self.svc;
        for ip in svc.external_ips_for(self.cfg.family) {
            self.add_service(ip, svc.port, VsKind::ExternalIp, true);
            self.bound.push(ip);
            let set = if svc.external_policy_local {
                EXTERNAL_IP_LOCAL
            } else {
                EXTERNAL_IP
            };
            self.entries
                .push((set, ip_port_entry(ip, svc.protocol, svc.port)));
        }
    }

    /// Load-balancer IPs, with their source ranges; an LB IP the node itself may not reach
    /// (no range holds a node IP) goes into `no_node_access`.
    fn add_load_balancers(&mut self, no_node_access: &mut BTreeSet<(IpAddr, Protocol, u16)>) {
        let (cfg, svc) = (self.cfg, self.svc);
        let ranges: Vec<IpNet> = svc.source_ranges_for(cfg.family).collect();
        for ip in svc.load_balancer_vips(cfg.family) {
            self.add_service(ip, svc.port, VsKind::LoadBalancer, true);
            self.bound.push(ip);
            let entry = ip_port_entry(ip, svc.protocol, svc.port);
            self.entries.push((LOAD_BALANCER, entry.clone()));
            if svc.external_policy_local {
                self.entries.push((LOAD_BALANCER_LOCAL, entry.clone()));
            }
            if !ranges.is_empty() {
                self.entries.push((LOAD_BALANCER_FW, entry.clone()));
                let mut node_allowed = false;
                for r in &ranges {
                    self.entries
                        .push((LOAD_BALANCER_SOURCE_CIDR, format!("{entry},{r}")));
                    node_allowed |= cfg.node_ips.iter().any(|n| r.contains(n));
                }
                if node_allowed {
                    self.entries
                        .push((LOAD_BALANCER_SOURCE_IP, format!("{entry},{ip}")));
                } else {
                    no_node_access.insert((ip, svc.protocol, svc.port));
                }
            }
        }
    }

    /// A virtual service per node IP, and the node port's set entries.
    fn add_node_ports(&mut self) {
        let (cfg, svc) = (self.cfg, self.svc);
        if svc.node_port == 0 {
            return;
        }
        let family = cfg.family;
        for &node_ip in cfg.node_ips.iter().filter(|ip| family.matches(ip)) {
            self.add_service(node_ip, svc.node_port, VsKind::NodePort, true);
        }
        let ext_local = svc.external_policy_local;
        match svc.protocol {
            Protocol::Tcp | Protocol::Udp => {
                let set = match (svc.protocol, ext_local) {
                    (Protocol::Tcp, false) => NODE_PORT_TCP,
                    (Protocol::Tcp, true) => NODE_PORT_LOCAL_TCP,
                    (_, false) => NODE_PORT_UDP,
                    (_, true) => NODE_PORT_LOCAL_UDP,
                };
                self.entries.push((set, svc.node_port.to_string()));
            }
            Protocol::Sctp => {
                let set = if ext_local {
                    NODE_PORT_LOCAL_SCTP
                } else {
                    NODE_PORT_SCTP
                };
                for &node_ip in cfg.node_ips.iter().filter(|ip| family.matches(ip)) {
                    self.entries
                        .push((set, ip_port_entry(node_ip, svc.protocol, svc.node_port)));
                }
            }
        }
    }

    fn add_health_check_node_port(&mut self) {
        if self.svc.health_check_node_port != 0 {
            self.entries.push((
                HEALTH_CHECK_NODE_PORT,
                self.svc.health_check_node_port.to_string(),
            ));
        }
    }

    /// LOOP_BACK entries for the local endpoints (hairpin masquerade).
    fn add_loopback_entries(&mut self) {
        let protocol = self.svc.protocol;
        for e in &self.all {
            if e.is_local {
                self.entries.push((
                    LOOP_BACK,
                    format!("{},{}", ip_port_entry(e.ip, protocol, e.port), e.ip),
                ));
            }
        }
    }

    /// Checks for conflicts with what earlier service ports planned, then adds the draft
    /// to `p`.
    fn commit(self, p: &mut IpvsPlan) -> Result<(), String> {
        let mut seen = BTreeSet::new();
        for s in &self.services {
            if !seen.insert(s.service.key) {
                return Err(format!(
                    "{} appears twice in this service (e.g. an external IP equal to a node address)",
                    s.service.key
                ));
            }
            if let Some(other) = p.services.get(&s.service.key) {
                return Err(format!(
                    "virtual service {} is already used by {}",
                    s.service.key, other.origin
                ));
            }
        }
        for s in self.services {
            p.services.insert(s.service.key, s);
        }
        p.bound.extend(self.bound);
        for (set, entry) in self.entries {
            p.sets
                .get_mut(set)
                .expect("every set is planned")
                .entries
                .insert(entry);
        }
        Ok(())
    }
}

/// A rule matching one ipset (upstream's `ipsetWithIptablesChain`).
struct IpsetChain {
    set: &'static str,
    /// In the filter table (else nat).
    filter: bool,
    from: &'static str,
    to: &'static str,
    matcher: &'static str,
    /// `-p` (empty: none).
    protocol: &'static str,
}

const fn ipset_chain(
    set: &'static str,
    filter: bool,
    from: &'static str,
    to: &'static str,
    matcher: &'static str,
    protocol: &'static str,
) -> IpsetChain {
    IpsetChain {
        set,
        filter,
        from,
        to,
        matcher,
        protocol,
    }
}

/// Upstream's `ipsetWithIptablesChain`, in its order.
const IPSET_CHAINS: &[IpsetChain] = &[
    ipset_chain(
        LOOP_BACK,
        false,
        "KUBE-POSTROUTING",
        "MASQUERADE",
        "dst,dst,src",
        "",
    ),
    ipset_chain(
        LOAD_BALANCER,
        false,
        "KUBE-SERVICES",
        "KUBE-LOAD-BALANCER",
        "dst,dst",
        "",
    ),
    ipset_chain(
        LOAD_BALANCER_LOCAL,
        false,
        "KUBE-LOAD-BALANCER",
        "RETURN",
        "dst,dst",
        "",
    ),
    ipset_chain(
        NODE_PORT_LOCAL_TCP,
        false,
        "KUBE-NODE-PORT",
        "RETURN",
        "dst",
        "tcp",
    ),
    ipset_chain(
        NODE_PORT_TCP,
        false,
        "KUBE-NODE-PORT",
        "KUBE-MARK-MASQ",
        "dst",
        "tcp",
    ),
    ipset_chain(
        NODE_PORT_LOCAL_UDP,
        false,
        "KUBE-NODE-PORT",
        "RETURN",
        "dst",
        "udp",
    ),
    ipset_chain(
        NODE_PORT_UDP,
        false,
        "KUBE-NODE-PORT",
        "KUBE-MARK-MASQ",
        "dst",
        "udp",
    ),
    ipset_chain(
        NODE_PORT_LOCAL_SCTP,
        false,
        "KUBE-NODE-PORT",
        "RETURN",
        "dst,dst",
        "sctp",
    ),
    ipset_chain(
        NODE_PORT_SCTP,
        false,
        "KUBE-NODE-PORT",
        "KUBE-MARK-MASQ",
        "dst,dst",
        "sctp",
    ),
    ipset_chain(
        LOAD_BALANCER_FW,
        true,
        "KUBE-PROXY-FIREWALL",
        "KUBE-SOURCE-RANGES-FIREWALL",
        "dst,dst",
        "",
    ),
    ipset_chain(
        LOAD_BALANCER_SOURCE_CIDR,
        true,
        "KUBE-SOURCE-RANGES-FIREWALL",
        "RETURN",
        "dst,dst,src",
        "",
    ),
    ipset_chain(
        LOAD_BALANCER_SOURCE_IP,
        true,
        "KUBE-SOURCE-RANGES-FIREWALL",
        "RETURN",
        "dst,dst,src",
        "",
    ),
];

/// The iptables rules (restore syntax, without `*table`/`COMMIT`), upstream's
/// `writeIptablesRules`: rules whose set is empty are left out, like upstream.
fn rules(
    cfg: &IpvsConfig,
    sets: &BTreeMap<&'static str, PlannedSet>,
    no_node_access: &BTreeSet<(IpAddr, Protocol, u16)>,
) -> Rules {
    let mut r = Rules {
        nat: vec![],
        filter: vec![],
    };
    let lo = match cfg.family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    };
    r.nat.push(format!("-A KUBE-SERVICES -s {lo} -j RETURN"));
    write_ipset_chain_rules(sets, &mut r);
    write_cluster_ip_rule(cfg, sets, &mut r.nat);
    write_external_ip_rules(sets, &mut r.nat);
    r.nat
        .push("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT".into());
    r.nat.push("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ".into());
    write_firewall_tail(no_node_access, &mut r.filter);
    for base in [CLUSTER_IP, LOAD_BALANCER] {
        if !sets[base].entries.is_empty() {
            r.nat.push(format!(
                "-A KUBE-SERVICES -m set --match-set {} dst,dst -j ACCEPT",
                sets[base].name
            ));
        }
    }
    write_filter_accept_rules(cfg, sets, &mut r.filter);
    write_masquerade_rules(cfg, &mut r.nat);
    r
}

/// One rule per non-empty set of [`IPSET_CHAINS`].
fn write_ipset_chain_rules(sets: &BTreeMap<&'static str, PlannedSet>, r: &mut Rules) {
    for c in IPSET_CHAINS {
        let s = &sets[c.set];
        if s.entries.is_empty() {
            continue;
        }
        let proto = if c.protocol.is_empty() {
            String::new()
        } else {
            format!(" -p {}", c.protocol)
        };
        let line = format!(
            "-A {}{proto} -m comment --comment \"{}\" -m set --match-set {} {} -j {}",
            c.from, s.comment, s.name, c.matcher, c.to
        );
        if c.filter {
            r.filter.push(line);
        } else {
            r.nat.push(line);
        }
    }
}

/// Masquerade for cluster IPs: everything (`masqueradeAll`), traffic from outside the
/// cluster CIDR, or (no cluster CIDR) by source.
fn write_cluster_ip_rule(
    cfg: &IpvsConfig,
    sets: &BTreeMap<&'static str, PlannedSet>,
    nat: &mut Vec<String>,
) {
    let s = &sets[CLUSTER_IP];
    if s.entries.is_empty() {
        return;
    }
    // Written the way iptables-save prints it (address matches first).
    let (src, matcher) = match (cfg.masquerade_all, cfg.cluster_cidr) {
        (true, _) => (String::new(), "dst,dst"),
        (false, Some(cidr)) => (format!(" ! -s {cidr}"), "dst,dst"),
        (false, None) => (String::new(), "src,dst"),
    };
    nat.push(format!(
        "-A KUBE-SERVICES{src} -m comment --comment \"{}\" -m set --match-set {} {matcher} -j KUBE-MARK-MASQ",
        s.comment, s.name
    ));
}

/// External IPs: masquerade (Cluster policy), accept what is not from a local bridge or
/// is for a local address.
fn write_external_ip_rules(sets: &BTreeMap<&'static str, PlannedSet>, nat: &mut Vec<String>) {
    for (base, masq) in [(EXTERNAL_IP, true), (EXTERNAL_IP_LOCAL, false)] {
        let s = &sets[base];
        if s.entries.is_empty() {
            continue;
        }
        let head = format!(
            "-A KUBE-SERVICES -m comment --comment \"{}\" -m set --match-set {} dst,dst",
            s.comment, s.name
        );
        if masq {
            nat.push(format!("{head} -j KUBE-MARK-MASQ"));
        }
        nat.push(format!(
            "{head} -m physdev ! --physdev-is-in -m addrtype ! --src-type LOCAL -j ACCEPT"
        ));
        nat.push(format!("{head} -m addrtype --dst-type LOCAL -j ACCEPT"));
    }
}

/// The source-ranges firewall's final drop, and the drops of LB IPs the node may not reach.
fn write_firewall_tail(
    no_node_access: &BTreeSet<(IpAddr, Protocol, u16)>,
    filter: &mut Vec<String>,
) {
    filter.push("-A KUBE-SOURCE-RANGES-FIREWALL -j DROP".into());
    for (ip, proto, port) in no_node_access {
        filter.push(format!(
            "-A KUBE-IPVS-OUT-FILTER -s {ip} -m ipvs --vaddr {ip} --vproto {} --vport {port} -j DROP",
            proto.number()
        ));
    }
}

/// KUBE-FORWARD, the health check node ports, and KUBE-IPVS-FILTER (service addresses pass,
/// new connections to other IPVS-bound addresses are rejected).
fn write_filter_accept_rules(
    cfg: &IpvsConfig,
    sets: &BTreeMap<&'static str, PlannedSet>,
    filter: &mut Vec<String>,
) {
    let mark = cfg.masquerade_mark();
    filter.push(format!(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
    ));
    filter.push(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT".into(),
    );
    let hc = &sets[HEALTH_CHECK_NODE_PORT];
    filter.push(format!(
        "-A KUBE-NODE-PORT -m comment --comment \"{}\" -m set --match-set {} dst -j ACCEPT",
        hc.comment, hc.name
    ));
    for (base, matcher) in [
        (LOAD_BALANCER, "dst,dst"),
        (CLUSTER_IP, "dst,dst"),
        (EXTERNAL_IP, "dst,dst"),
        (EXTERNAL_IP_LOCAL, "dst,dst"),
        (HEALTH_CHECK_NODE_PORT, "dst"),
    ] {
        filter.push(format!(
            "-A KUBE-IPVS-FILTER -m set --match-set {} {matcher} -j RETURN",
            sets[base].name
        ));
    }
    filter.push(format!(
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
        sets[IPVS_IPS].name
    ));
}

/// KUBE-POSTROUTING's masquerade of marked traffic, and KUBE-MARK-MASQ.
fn write_masquerade_rules(cfg: &IpvsConfig, nat: &mut Vec<String>) {
    let mark = cfg.masquerade_mark();
    nat.push(format!(
        "-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN"
    ));
    nat.push(format!("-A KUBE-POSTROUTING -j MARK --xor-mark {mark}"));
    nat.push(
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".into(),
    );
    nat.push(format!("-A KUBE-MARK-MASQ -j MARK --or-mark {mark}"));
}

/// `iptables-restore --noflush` input: our chains declared (so flushed) and refilled.
pub(crate) fn iptables_restore_input(rules: &Rules) -> String {
    let mut out = String::new();
    for (table, chains, lines) in [
        ("filter", FILTER_CHAINS, &rules.filter),
        ("nat", NAT_CHAINS, &rules.nat),
    ] {
        let _ = writeln!(out, "*{table}");
        for c in chains {
            let _ = writeln!(out, ":{c} - [0:0]");
        }
        for l in lines {
            let _ = writeln!(out, "{l}");
        }
        let _ = writeln!(out, "COMMIT");
    }
    out
}

/// Human-readable listing of everything planned (`kproxy … --render`, debugging).
pub fn render(snap: &Snapshot, cfg: &IpvsConfig) -> String {
    let p = plan(snap, cfg);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# IPVS plan ({:?}): {} service ports, {} virtual services, {} active real servers",
        p.family,
        p.service_ports,
        p.services.len(),
        p.active_real_servers()
    );
    for (name, reason) in &p.errors {
        let _ = writeln!(out, "# error: {name}: {reason}");
    }
    let _ = writeln!(out, "## virtual services");
    for s in p.services.values() {
        let v = &s.service;
        let persist = if v.flags & SVC_F_PERSISTENT != 0 {
            format!(" persistent {}", v.timeout)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "{} {:?} {} ({}){persist}",
            v.key, s.kind, v.scheduler, s.origin
        );
        for ((ip, port), w) in &s.real_servers {
            let _ = writeln!(
                out,
                "  -> {} masq weight {w}",
                std::net::SocketAddr::new(*ip, *port)
            );
        }
    }
    let _ = writeln!(out, "## addresses on {}", cfg.dummy_device);
    for ip in &p.bound {
        let _ = writeln!(out, "{ip}");
    }
    let _ = writeln!(out, "## ipsets");
    for s in p.sets.values() {
        let _ = writeln!(
            out,
            "{} {} ({} entries)",
            s.name,
            s.set_type.as_str(),
            s.entries.len()
        );
        for e in &s.entries {
            let _ = writeln!(out, "  {e}");
        }
    }
    let _ = writeln!(out, "## iptables");
    out.push_str(&iptables_restore_input(&p.rules));
    out
}

#[cfg(test)]
mod tests;
