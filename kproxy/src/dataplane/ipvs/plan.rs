//! The pure IPVS planner: a [`Snapshot`] and an [`IpvsConfig`] in, the exact kernel objects out
//! ([`Plan`]): virtual services with their real servers, the addresses bound to the dummy
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
//! [`Plan::errors`]) instead of whichever syncs last winning.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use ipnet::IpNet;

use super::config::IpvsConfig;
use super::genl::{SVC_F_PERSISTENT, ServiceKey, VirtualService};
use crate::model::{Endpoint, IpFamily, Protocol, ServicePort, ServicePortName, Snapshot};

/// Kinds of ipset (`ipset create NAME <type>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SetType {
    HashIp,
    HashIpPort,
    HashIpPortIp,
    HashIpPortNet,
    BitmapPort,
}

impl SetType {
    pub fn as_str(self) -> &'static str {
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
pub const IPSETS: &[(&str, SetType, &str)] = &[
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

pub const LOOP_BACK: &str = "KUBE-LOOP-BACK";
pub const CLUSTER_IP: &str = "KUBE-CLUSTER-IP";
pub const EXTERNAL_IP: &str = "KUBE-EXTERNAL-IP";
pub const EXTERNAL_IP_LOCAL: &str = "KUBE-EXTERNAL-IP-LOCAL";
pub const LOAD_BALANCER: &str = "KUBE-LOAD-BALANCER";
pub const LOAD_BALANCER_LOCAL: &str = "KUBE-LOAD-BALANCER-LOCAL";
pub const LOAD_BALANCER_FW: &str = "KUBE-LOAD-BALANCER-FW";
pub const LOAD_BALANCER_SOURCE_IP: &str = "KUBE-LOAD-BALANCER-SOURCE-IP";
pub const LOAD_BALANCER_SOURCE_CIDR: &str = "KUBE-LOAD-BALANCER-SOURCE-CIDR";
pub const NODE_PORT_TCP: &str = "KUBE-NODE-PORT-TCP";
pub const NODE_PORT_LOCAL_TCP: &str = "KUBE-NODE-PORT-LOCAL-TCP";
pub const NODE_PORT_UDP: &str = "KUBE-NODE-PORT-UDP";
pub const NODE_PORT_LOCAL_UDP: &str = "KUBE-NODE-PORT-LOCAL-UDP";
pub const NODE_PORT_SCTP: &str = "KUBE-NODE-PORT-SCTP-HASH";
pub const NODE_PORT_LOCAL_SCTP: &str = "KUBE-NODE-PORT-LOCAL-SCTP-HASH";
pub const HEALTH_CHECK_NODE_PORT: &str = "KUBE-HEALTH-CHECK-NODE-PORT";
pub const IPVS_IPS: &str = "KUBE-IPVS-IPS";

/// The kernel name of a set for `family`: IPv6 sets are `KUBE-6-…`, cut to ipset's 31 bytes.
pub fn set_name(base: &str, family: IpFamily) -> String {
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
pub enum VsKind {
    ClusterIp,
    ExternalIp,
    LoadBalancer,
    NodePort,
}

/// One planned virtual service with its real servers (`addr:port` → weight).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedService {
    pub service: VirtualService,
    pub kind: VsKind,
    pub origin: ServicePortName,
    pub real_servers: BTreeMap<(IpAddr, u16), u32>,
}

/// One planned ipset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedSet {
    /// Kernel name (family-adjusted).
    pub name: String,
    pub set_type: SetType,
    pub comment: &'static str,
    pub entries: BTreeSet<String>,
}

/// One rule in `iptables-restore` syntax (`-A CHAIN …`), with its table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rules {
    pub nat: Vec<String>,
    pub filter: Vec<String>,
}

/// Chains upstream's IPVS mode owns, per table.
pub const NAT_CHAINS: &[&str] = &[
    "KUBE-SERVICES",
    "KUBE-POSTROUTING",
    "KUBE-NODE-PORT",
    "KUBE-LOAD-BALANCER",
    "KUBE-MARK-MASQ",
];
pub const FILTER_CHAINS: &[&str] = &[
    "KUBE-FORWARD",
    "KUBE-NODE-PORT",
    "KUBE-PROXY-FIREWALL",
    "KUBE-SOURCE-RANGES-FIREWALL",
    "KUBE-IPVS-FILTER",
    "KUBE-IPVS-OUT-FILTER",
];

/// Jumps from the built-in chains: (table, from, to, comment).
pub const JUMPS: &[(&str, &str, &str, &str)] = &[
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
pub struct Plan {
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

impl Plan {
    /// Distinct endpoints (`ip:port`) taking new connections in some virtual service.
    pub fn active_endpoints(&self) -> usize {
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
    pub fn active_real_servers(&self) -> usize {
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
pub fn plan(snap: &Snapshot, cfg: &IpvsConfig) -> Plan {
    let family = cfg.family;
    let mut p = Plan {
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
    p: &mut Plan,
    no_node_access: &mut BTreeSet<(IpAddr, Protocol, u16)>,
) -> Result<(), String> {
    let family = cfg.family;
    let cat = snap.categorize(svc);
    let all: &[Endpoint] = snap.endpoints_of(&svc.name);
    let all: Vec<&Endpoint> = all.iter().filter(|e| family.matches(&e.ip)).collect();
    let internal_eps = if svc.internal_policy_local {
        cat.local.clone().unwrap_or_default()
    } else {
        cat.cluster.clone().unwrap_or_default()
    };
    let external_eps = if svc.external_policy_local {
        cat.local.clone().unwrap_or_default()
    } else {
        cat.cluster.clone().unwrap_or_default()
    };
    let real_servers = |selected: &[Endpoint]| -> BTreeMap<(IpAddr, u16), u32> {
        let mut rs: BTreeMap<(IpAddr, u16), u32> = selected
            .iter()
            .filter(|e| family.matches(&e.ip))
            .map(|e| ((e.ip, e.port), 1))
            .collect();
        // Terminating endpoints still listed keep draining with weight 0.
        for e in &all {
            if e.terminating {
                rs.entry((e.ip, e.port)).or_insert(0);
            }
        }
        rs
    };
    let (flags, timeout) = match svc.session_affinity_timeout {
        Some(t) => (SVC_F_PERSISTENT, t),
        None => (0, 0),
    };
    let vs = |addr: IpAddr, port: u16| VirtualService {
        key: ServiceKey {
            addr,
            protocol: svc.protocol,
            port,
        },
        scheduler: cfg.scheduler().to_string(),
        flags,
        timeout,
    };

    let mut services: Vec<PlannedService> = vec![];
    let mut bound: Vec<IpAddr> = vec![];
    let mut entries: Vec<(&'static str, String)> = vec![];
    let ext_local = svc.external_policy_local;

    services.push(PlannedService {
        service: vs(cluster_ip, svc.port),
        kind: VsKind::ClusterIp,
        origin: svc.name.clone(),
        real_servers: real_servers(&internal_eps),
    });
    bound.push(cluster_ip);
    entries.push((
        CLUSTER_IP,
        ip_port_entry(cluster_ip, svc.protocol, svc.port),
    ));

    for ip in svc.external_ips_for(family) {
        services.push(PlannedService {
            service: vs(ip, svc.port),
            kind: VsKind::ExternalIp,
            origin: svc.name.clone(),
            real_servers: real_servers(&external_eps),
        });
        bound.push(ip);
        let set = if ext_local {
            EXTERNAL_IP_LOCAL
        } else {
            EXTERNAL_IP
        };
        entries.push((set, ip_port_entry(ip, svc.protocol, svc.port)));
    }

    let ranges: Vec<IpNet> = svc.source_ranges_for(family).collect();
    for ip in svc.load_balancer_vips(family) {
        services.push(PlannedService {
            service: vs(ip, svc.port),
            kind: VsKind::LoadBalancer,
            origin: svc.name.clone(),
            real_servers: real_servers(&external_eps),
        });
        bound.push(ip);
        let entry = ip_port_entry(ip, svc.protocol, svc.port);
        entries.push((LOAD_BALANCER, entry.clone()));
        if ext_local {
            entries.push((LOAD_BALANCER_LOCAL, entry.clone()));
        }
        if !ranges.is_empty() {
            entries.push((LOAD_BALANCER_FW, entry.clone()));
            let mut node_allowed = false;
            for r in &ranges {
                entries.push((LOAD_BALANCER_SOURCE_CIDR, format!("{entry},{r}")));
                node_allowed |= cfg.node_ips.iter().any(|n| r.contains(n));
            }
            if node_allowed {
                entries.push((LOAD_BALANCER_SOURCE_IP, format!("{entry},{ip}")));
            } else {
                no_node_access.insert((ip, svc.protocol, svc.port));
            }
        }
    }

    if svc.node_port != 0 {
        for &node_ip in cfg.node_ips.iter().filter(|ip| family.matches(ip)) {
            services.push(PlannedService {
                service: vs(node_ip, svc.node_port),
                kind: VsKind::NodePort,
                origin: svc.name.clone(),
                real_servers: real_servers(&external_eps),
            });
        }
        match svc.protocol {
            Protocol::Tcp | Protocol::Udp => {
                let set = match (svc.protocol, ext_local) {
                    (Protocol::Tcp, false) => NODE_PORT_TCP,
                    (Protocol::Tcp, true) => NODE_PORT_LOCAL_TCP,
                    (_, false) => NODE_PORT_UDP,
                    (_, true) => NODE_PORT_LOCAL_UDP,
                };
                entries.push((set, svc.node_port.to_string()));
            }
            Protocol::Sctp => {
                let set = if ext_local {
                    NODE_PORT_LOCAL_SCTP
                } else {
                    NODE_PORT_SCTP
                };
                for &node_ip in cfg.node_ips.iter().filter(|ip| family.matches(ip)) {
                    entries.push((set, ip_port_entry(node_ip, svc.protocol, svc.node_port)));
                }
            }
        }
    }
    if svc.health_check_node_port != 0 {
        entries.push((
            HEALTH_CHECK_NODE_PORT,
            svc.health_check_node_port.to_string(),
        ));
    }
    for e in &all {
        if e.is_local {
            entries.push((
                LOOP_BACK,
                format!("{},{}", ip_port_entry(e.ip, svc.protocol, e.port), e.ip),
            ));
        }
    }

    // Conflicts with what earlier service ports planned.
    let mut seen = BTreeSet::new();
    for s in &services {
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
    for s in services {
        p.services.insert(s.service.key, s);
    }
    p.bound.extend(bound);
    for (set, entry) in entries {
        p.sets
            .get_mut(set)
            .expect("every set is planned")
            .entries
            .insert(entry);
    }
    Ok(())
}

/// The iptables rules (restore syntax, without `*table`/`COMMIT`), upstream's
/// `writeIptablesRules`: rules whose set is empty are left out, like upstream.
fn rules(
    cfg: &IpvsConfig,
    sets: &BTreeMap<&'static str, PlannedSet>,
    no_node_access: &BTreeSet<(IpAddr, Protocol, u16)>,
) -> Rules {
    let mut nat = vec![];
    let mut filter = vec![];
    let set = |base: &str| &sets[base];
    let nonempty = |base: &str| !sets[base].entries.is_empty();
    let mark = cfg.masquerade_mark();
    let lo = match cfg.family {
        IpFamily::V4 => "127.0.0.0/8",
        IpFamily::V6 => "::1/128",
    };
    nat.push(format!("-A KUBE-SERVICES -s {lo} -j RETURN"));
    // (set, table is filter, from, to, match, protocol): upstream's ipsetWithIptablesChain.
    let table: &[(&str, bool, &str, &str, &str, &str)] = &[
        (
            LOOP_BACK,
            false,
            "KUBE-POSTROUTING",
            "MASQUERADE",
            "dst,dst,src",
            "",
        ),
        (
            LOAD_BALANCER,
            false,
            "KUBE-SERVICES",
            "KUBE-LOAD-BALANCER",
            "dst,dst",
            "",
        ),
        (
            LOAD_BALANCER_LOCAL,
            false,
            "KUBE-LOAD-BALANCER",
            "RETURN",
            "dst,dst",
            "",
        ),
        (
            NODE_PORT_LOCAL_TCP,
            false,
            "KUBE-NODE-PORT",
            "RETURN",
            "dst",
            "tcp",
        ),
        (
            NODE_PORT_TCP,
            false,
            "KUBE-NODE-PORT",
            "KUBE-MARK-MASQ",
            "dst",
            "tcp",
        ),
        (
            NODE_PORT_LOCAL_UDP,
            false,
            "KUBE-NODE-PORT",
            "RETURN",
            "dst",
            "udp",
        ),
        (
            NODE_PORT_UDP,
            false,
            "KUBE-NODE-PORT",
            "KUBE-MARK-MASQ",
            "dst",
            "udp",
        ),
        (
            NODE_PORT_LOCAL_SCTP,
            false,
            "KUBE-NODE-PORT",
            "RETURN",
            "dst,dst",
            "sctp",
        ),
        (
            NODE_PORT_SCTP,
            false,
            "KUBE-NODE-PORT",
            "KUBE-MARK-MASQ",
            "dst,dst",
            "sctp",
        ),
        (
            LOAD_BALANCER_FW,
            true,
            "KUBE-PROXY-FIREWALL",
            "KUBE-SOURCE-RANGES-FIREWALL",
            "dst,dst",
            "",
        ),
        (
            LOAD_BALANCER_SOURCE_CIDR,
            true,
            "KUBE-SOURCE-RANGES-FIREWALL",
            "RETURN",
            "dst,dst,src",
            "",
        ),
        (
            LOAD_BALANCER_SOURCE_IP,
            true,
            "KUBE-SOURCE-RANGES-FIREWALL",
            "RETURN",
            "dst,dst,src",
            "",
        ),
    ];
    for (base, is_filter, from, to, matcher, proto) in table {
        if !nonempty(base) {
            continue;
        }
        let s = set(base);
        let proto = if proto.is_empty() {
            String::new()
        } else {
            format!(" -p {proto}")
        };
        let line = format!(
            "-A {from}{proto} -m comment --comment \"{}\" -m set --match-set {} {matcher} -j {to}",
            s.comment, s.name
        );
        if *is_filter {
            filter.push(line);
        } else {
            nat.push(line);
        }
    }
    if nonempty(CLUSTER_IP) {
        let s = set(CLUSTER_IP);
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
    for (base, masq) in [(EXTERNAL_IP, true), (EXTERNAL_IP_LOCAL, false)] {
        if !nonempty(base) {
            continue;
        }
        let s = set(base);
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
    nat.push("-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODE-PORT".into());
    nat.push("-A KUBE-LOAD-BALANCER -j KUBE-MARK-MASQ".into());
    filter.push("-A KUBE-SOURCE-RANGES-FIREWALL -j DROP".into());
    for (ip, proto, port) in no_node_access {
        filter.push(format!(
            "-A KUBE-IPVS-OUT-FILTER -s {ip} -m ipvs --vaddr {ip} --vproto {} --vport {port} -j DROP",
            proto.number()
        ));
    }
    for base in [CLUSTER_IP, LOAD_BALANCER] {
        if nonempty(base) {
            nat.push(format!(
                "-A KUBE-SERVICES -m set --match-set {} dst,dst -j ACCEPT",
                set(base).name
            ));
        }
    }
    filter.push(format!(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"
    ));
    filter.push(
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT".into(),
    );
    let hc = set(HEALTH_CHECK_NODE_PORT);
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
            set(base).name
        ));
    }
    filter.push(format!(
        "-A KUBE-IPVS-FILTER -m conntrack --ctstate NEW -m set --match-set {} dst -j REJECT",
        set(IPVS_IPS).name
    ));
    nat.push(format!(
        "-A KUBE-POSTROUTING -m mark ! --mark {mark}/{mark} -j RETURN"
    ));
    nat.push(format!("-A KUBE-POSTROUTING -j MARK --xor-mark {mark}"));
    nat.push(
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully".into(),
    );
    nat.push(format!("-A KUBE-MARK-MASQ -j MARK --or-mark {mark}"));
    Rules { nat, filter }
}

/// `iptables-restore --noflush` input: our chains declared (so flushed) and refilled.
pub fn iptables_restore_input(rules: &Rules) -> String {
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
#[path = "plan_tests.rs"]
mod tests;
