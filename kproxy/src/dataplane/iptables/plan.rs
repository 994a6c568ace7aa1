//! The pure planner: [`Snapshot`] + [`IptablesConfig`] → the filter and nat rules upstream's
//! `syncProxyRules` writes, kept structured (table → chain → rules) so the applier can write
//! only the per-service chains that changed.
//!
//! Rule text, rule order inside every chain, comments and chain names are upstream's
//! (pkg/proxy/iptables/proxier.go at the commit named in tests/fixtures/upstream/SOURCES.md);
//! the corpus test compares whole dumps after upstream's canonical sort.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::model::topology::categorize_endpoints;
use crate::model::{Endpoint, IpFamily, ServicePort, ServicePortName, Snapshot};

use super::config::{IptablesConfig, NFACCT_CT_INVALID, NFACCT_LOCALHOST_NODEPORTS};
use super::names::*;

/// `namespace/name` of a service: the unit of partial syncs (upstream `NamespacedName`).
pub type ServiceKey = (String, String);

/// The service key of a service port.
pub fn service_key(name: &ServicePortName) -> ServiceKey {
    (name.namespace.clone(), name.name.clone())
}

/// One chain and its complete rule lines (`-A CHAIN …`), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChainRules {
    pub name: String,
    pub rules: Vec<String>,
}

/// Chains of one table in declaration order, each with its rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TablePlan {
    pub chains: Vec<ChainRules>,
}

impl TablePlan {
    pub fn chain_mut(&mut self, name: &str) -> &mut ChainRules {
        if let Some(i) = self.chains.iter().position(|c| c.name == name) {
            return &mut self.chains[i];
        }
        self.chains.push(ChainRules {
            name: name.to_owned(),
            rules: vec![],
        });
        self.chains.last_mut().expect("just pushed")
    }
    /// Declares `chain` (no-op if declared).
    fn declare(&mut self, chain: &str) {
        self.chain_mut(chain);
    }
    /// Appends `-A chain args`.
    fn push(&mut self, chain: &str, args: impl AsRef<str>) {
        let args = args.as_ref();
        let line = if args.is_empty() {
            format!("-A {chain}")
        } else {
            format!("-A {chain} {args}")
        };
        self.chain_mut(chain).rules.push(line);
    }
    /// Number of rules.
    pub fn rule_count(&self) -> usize {
        self.chains.iter().map(|c| c.rules.len()).sum()
    }
    pub fn get(&self, chain: &str) -> Option<&ChainRules> {
        self.chains.iter().find(|c| c.name == chain)
    }
}

/// A jump rule from a built-in chain, ensured outside the restore input (upstream
/// `iptablesJumpChains` + `iptablesKubeletJumpChains`, `EnsureRule(Prepend, …)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JumpRule {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    /// The rule's arguments after `-A <from>` (extra args, comment, `-j <to>`), as argv.
    pub args: Vec<String>,
}

/// The jump rules from built-in chains, in upstream's order.
pub fn jump_rules() -> Vec<JumpRule> {
    const NEW: &[&str] = &["-m", "conntrack", "--ctstate", "NEW"];
    let spec: [(&str, &str, &str, &str, &[&str]); 14] = [
        (
            "filter",
            "INPUT",
            KUBE_EXTERNAL_SERVICES,
            "kubernetes externally-visible service portals",
            NEW,
        ),
        (
            "filter",
            "FORWARD",
            KUBE_EXTERNAL_SERVICES,
            "kubernetes externally-visible service portals",
            NEW,
        ),
        (
            "filter",
            "INPUT",
            KUBE_NODEPORTS,
            "kubernetes health check service ports",
            &[],
        ),
        (
            "filter",
            "FORWARD",
            KUBE_SERVICES,
            "kubernetes service portals",
            NEW,
        ),
        (
            "filter",
            "OUTPUT",
            KUBE_SERVICES,
            "kubernetes service portals",
            NEW,
        ),
        (
            "filter",
            "FORWARD",
            KUBE_FORWARD,
            "kubernetes forwarding rules",
            &[],
        ),
        (
            "filter",
            "INPUT",
            KUBE_PROXY_FIREWALL,
            "kubernetes load balancer firewall",
            NEW,
        ),
        (
            "filter",
            "OUTPUT",
            KUBE_PROXY_FIREWALL,
            "kubernetes load balancer firewall",
            NEW,
        ),
        (
            "filter",
            "FORWARD",
            KUBE_PROXY_FIREWALL,
            "kubernetes load balancer firewall",
            NEW,
        ),
        (
            "nat",
            "OUTPUT",
            KUBE_SERVICES,
            "kubernetes service portals",
            &[],
        ),
        (
            "nat",
            "PREROUTING",
            KUBE_SERVICES,
            "kubernetes service portals",
            &[],
        ),
        (
            "nat",
            "POSTROUTING",
            KUBE_POSTROUTING,
            "kubernetes postrouting rules",
            &[],
        ),
        ("filter", "INPUT", KUBE_FIREWALL, "", &[]),
        ("filter", "OUTPUT", KUBE_FIREWALL, "", &[]),
    ];
    spec.iter()
        .map(|(table, from, to, comment, extra)| {
            let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
            if !comment.is_empty() {
                args.extend(["-m", "comment", "--comment", comment].map(String::from));
            }
            args.extend(["-j".to_string(), to.to_string()]);
            JumpRule {
                table,
                from,
                to,
                args,
            }
        })
        .collect()
}

/// Everything one sync writes, before choosing what a partial sync may omit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    /// The complete filter table input.
    pub filter: TablePlan,
    /// nat chains written on every sync (KUBE-SERVICES, KUBE-NODEPORTS, KUBE-POSTROUTING,
    /// KUBE-MARK-MASQ) with their rules.
    pub nat: TablePlan,
    /// Per-service nat chains (SVC/SVL/EXT/FW/SEP) by service, written when the service changed.
    pub services: BTreeMap<ServiceKey, TablePlan>,
    /// Large-cluster mode was chosen (more endpoints than the threshold).
    pub large_cluster: bool,
    /// Endpoints of proxied service ports of this family (upstream's count for the mode).
    pub total_endpoints: usize,
    /// Service ports programmed.
    pub service_ports: usize,
    /// Services with iTP=Local / eTP=Local and no local endpoints (upstream metric).
    pub no_local_endpoints_internal: usize,
    pub no_local_endpoints_external: usize,
}

impl Plan {
    /// Every per-service nat chain this plan keeps.
    pub fn active_nat_chains(&self) -> BTreeSet<String> {
        self.services
            .values()
            .flat_map(|t| t.chains.iter().map(|c| c.name.clone()))
            .collect()
    }
}

/// Upstream `computeProbability`: `%0.10f` of 1/n.
pub fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

fn quoted(s: &str) -> String {
    format!("\"{s}\"")
}

/// The family's view of a service port (upstream's per-family `BaseServicePortInfo`): only
/// this family's external IPs, LB ingress IPs and source ranges.
fn for_family(svc: &ServicePort, family: IpFamily) -> ServicePort {
    let mut s = svc.clone();
    s.external_ips.retain(|ip| family.matches(ip));
    s.load_balancer_ingress.retain(|i| family.matches(&i.ip));
    s.load_balancer_source_ranges
        .retain(|n| family.matches(&n.addr()));
    s
}

/// The planned pieces of one service port, independent of every other service port: its
/// rules in the shared chains (filter KUBE-SERVICES & co., nat KUBE-SERVICES and
/// KUBE-NODEPORTS) and its own SVC/SVL/EXT/FW/SEP chains. [`assemble`] concatenates them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PortPlan {
    /// Rules in shared filter chains, grouped by chain.
    pub filter: TablePlan,
    /// Rules in shared nat chains, grouped by chain.
    pub nat: TablePlan,
    /// The port's own nat chains.
    pub chains: TablePlan,
    /// Endpoints of this family (counted for large-cluster mode).
    pub endpoints: usize,
    /// iTP=Local / eTP=Local without local endpoints (upstream metric).
    pub no_local_internal: bool,
    pub no_local_external: bool,
}

/// What a port plan depends on besides its service port and endpoints: the global inputs.
/// A change of any of these invalidates every cached [`PortPlan`].
pub struct PortContext<'a> {
    pub cfg: &'a IptablesConfig,
    pub node: &'a crate::model::NodeInfo,
    /// Large-cluster mode (no per-endpoint comments).
    pub large_cluster: bool,
}

/// The family's service ports of `snap` with their cluster IP and endpoints of the family
/// (unsorted), in snapshot order.
pub fn family_ports<'a>(
    snap: &'a Snapshot,
    family: IpFamily,
) -> impl Iterator<Item = (&'a std::sync::Arc<ServicePort>, IpAddr, &'a [Endpoint])> + 'a {
    snap.services.values().filter_map(move |svc| {
        let cluster_ip = svc.cluster_ip(family)?;
        Some((svc, cluster_ip, snap.endpoints_of(&svc.name)))
    })
}

/// Endpoints of `eps` in `family` (upstream's count for large-cluster mode).
pub fn family_endpoint_count(eps: &[Endpoint], family: IpFamily) -> usize {
    eps.iter().filter(|e| family.matches(&e.ip)).count()
}

/// Plans one service port (`eps`: all its endpoints, any family).
pub fn plan_port(
    ctx: &PortContext<'_>,
    svc: &ServicePort,
    cluster_ip: IpAddr,
    eps: &[Endpoint],
) -> PortPlan {
    let family = ctx.cfg.family;
    let mut eps: Vec<Endpoint> = eps
        .iter()
        .filter(|e| family.matches(&e.ip))
        .cloned()
        .collect();
    // Sorted by "IP:port" like upstream.
    eps.sort_by_cached_key(|e| e.addr());
    let svc = for_family(svc, family);
    let mut pp = PortPlan {
        endpoints: eps.len(),
        ..Default::default()
    };
    write_service_port(&mut pp, ctx, &svc, cluster_ip, &eps);
    pp
}

/// The chains and rules that do not depend on any service port: declarations of the shared
/// chains and the rules that come before every service port's.
pub fn plan_head(cfg: &IptablesConfig) -> Plan {
    let mark = cfg.masquerade_mark();
    let localhost_nps = cfg.effective_localhost_node_ports();
    let is_v6 = cfg.family == IpFamily::V6;
    let mut p = Plan::default();

    for c in [
        KUBE_SERVICES,
        KUBE_EXTERNAL_SERVICES,
        KUBE_FORWARD,
        KUBE_NODEPORTS,
        KUBE_PROXY_FIREWALL,
    ] {
        p.filter.declare(c);
    }
    for c in [
        KUBE_SERVICES,
        KUBE_NODEPORTS,
        KUBE_POSTROUTING,
        KUBE_MARK_MASQ,
    ] {
        p.nat.declare(c);
    }
    p.nat.push(
        KUBE_POSTROUTING,
        format!("-m mark ! --mark {mark}/{mark} -j RETURN"),
    );
    p.nat
        .push(KUBE_POSTROUTING, format!("-j MARK --xor-mark {mark}"));
    p.nat.push(
        KUBE_POSTROUTING,
        format!(
            "-m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE{}",
            if cfg.random_fully {
                " --random-fully"
            } else {
                ""
            }
        ),
    );
    p.nat
        .push(KUBE_MARK_MASQ, format!("-j MARK --or-mark {mark}"));
    if !is_v6 && localhost_nps {
        p.filter.declare(KUBE_FIREWALL);
        p.filter.push(
            KUBE_FIREWALL,
            "-m comment --comment \"block incoming localnet connections\" -d 127.0.0.0/8 ! -s 127.0.0.0/8 -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
        );
    }
    p
}

/// Appends the rules that come after every service port's (the KUBE-NODEPORTS tail call,
/// KUBE-FORWARD).
pub fn plan_tail(p: &mut Plan, cfg: &IptablesConfig) {
    let mark = cfg.masquerade_mark();
    let localhost_nps = cfg.effective_localhost_node_ports();
    let is_v6 = cfg.family == IpFamily::V6;
    // Tail call to KUBE-NODEPORTS; must stay the last rule of KUBE-SERVICES.
    let last = "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    if cfg.node_ports_match_all() {
        let extra = if is_v6 {
            " ! -d ::1/128"
        } else if !localhost_nps {
            " ! -d 127.0.0.0/8"
        } else {
            ""
        };
        p.nat.push(
            KUBE_SERVICES,
            format!("{last} -m addrtype --dst-type LOCAL{extra} -j {KUBE_NODEPORTS}"),
        );
    } else {
        for ip in cfg.node_port_ips() {
            if ip.is_loopback() {
                if is_v6 {
                    tracing::warn!(address = %ip, "--nodeport-addresses includes localhost but localhost NodePorts are not supported on IPv6");
                    continue;
                } else if !localhost_nps {
                    tracing::warn!(address = %ip, "--nodeport-addresses includes localhost but localhost NodePorts are disabled");
                    continue;
                }
            }
            p.nat
                .push(KUBE_SERVICES, format!("{last} -d {ip} -j {KUBE_NODEPORTS}"));
        }
    }

    if !cfg.conntrack_tcp_liberal {
        let nfacct = if cfg.nfacct_counters.ct_state_invalid_dropped_pkts {
            format!(" -m nfacct --nfacct-name {NFACCT_CT_INVALID}")
        } else {
            String::new()
        };
        p.filter.push(
            KUBE_FORWARD,
            format!("-m conntrack --ctstate INVALID{nfacct} -j DROP"),
        );
    }
    p.filter.push(
        KUBE_FORWARD,
        format!("-m comment --comment \"kubernetes forwarding rules\" -m mark --mark {mark}/{mark} -j ACCEPT"),
    );
    p.filter.push(
        KUBE_FORWARD,
        "-m comment --comment \"kubernetes forwarding conntrack rule\" -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    );
}

/// Appends one port's rules in shared chains to `p` (its own chains are not copied: see
/// [`Plan::services`]) and counts it.
pub fn add_port_shared(p: &mut Plan, pp: &PortPlan) {
    for c in &pp.filter.chains {
        p.filter
            .chain_mut(&c.name)
            .rules
            .extend(c.rules.iter().cloned());
    }
    for c in &pp.nat.chains {
        p.nat
            .chain_mut(&c.name)
            .rules
            .extend(c.rules.iter().cloned());
    }
    p.total_endpoints += pp.endpoints;
    p.service_ports += 1;
    p.no_local_endpoints_internal += usize::from(pp.no_local_internal);
    p.no_local_endpoints_external += usize::from(pp.no_local_external);
}

/// Whether `total_endpoints` puts the proxier in large-cluster mode.
pub fn is_large_cluster(total_endpoints: usize, cfg: &IptablesConfig) -> bool {
    total_endpoints > cfg.large_cluster_threshold
}

/// The whole plan from the port plans, in snapshot order (every port of a service is
/// adjacent in that order, so its chains group by service like upstream's).
pub fn assemble<'a>(
    cfg: &IptablesConfig,
    large_cluster: bool,
    ports: impl IntoIterator<Item = (&'a ServicePortName, &'a PortPlan)>,
) -> Plan {
    let mut p = plan_head(cfg);
    p.large_cluster = large_cluster;
    for (name, pp) in ports {
        add_port_shared(&mut p, pp);
        p.services
            .entry(service_key(name))
            .or_default()
            .chains
            .extend(pp.chains.chains.iter().cloned());
    }
    plan_tail(&mut p, cfg);
    p
}

/// Builds the plan for one family, from scratch.
pub fn plan(snap: &Snapshot, cfg: &IptablesConfig) -> Plan {
    let ports: Vec<_> = family_ports(snap, cfg.family).collect();
    let total: usize = ports
        .iter()
        .map(|(_, _, eps)| family_endpoint_count(eps, cfg.family))
        .sum();
    let ctx = PortContext {
        cfg,
        node: &snap.node,
        large_cluster: is_large_cluster(total, cfg),
    };
    let planned: Vec<(&ServicePortName, PortPlan)> = ports
        .iter()
        .map(|(svc, ip, eps)| (&svc.name, plan_port(&ctx, svc, *ip, eps)))
        .collect();
    assemble(
        cfg,
        ctx.large_cluster,
        planned.iter().map(|(n, pp)| (*n, pp)),
    )
}

fn write_service_port(
    p: &mut PortPlan,
    ctx: &PortContext<'_>,
    svc: &ServicePort,
    cluster_ip: IpAddr,
    eps: &[Endpoint],
) {
    let cfg = ctx.cfg;
    let node = ctx.node;
    let localhost_nps = cfg.effective_localhost_node_ports();
    let name = svc.name.to_string();
    let proto = svc.protocol.lower();
    let port = svc.port;
    let ch = ServiceChains::of(&svc.name);
    let cat = categorize_endpoints(eps, svc, node);
    let cluster_eps = cat.cluster.clone().unwrap_or_default();
    let local_eps = cat.local.clone().unwrap_or_default();
    let has_endpoints = cat.has_any_endpoints;

    let uses_cluster_chain = !cluster_eps.is_empty() && svc.uses_cluster_endpoints();
    let uses_local_chain = !local_eps.is_empty() && svc.uses_local_endpoints();

    let mut internal_chain = ch.cluster.as_str();
    let mut has_internal = has_endpoints;
    if svc.internal_policy_local {
        internal_chain = ch.local.as_str();
        if local_eps.is_empty() {
            has_internal = false;
        }
    }
    let mut external_policy_chain = ch.cluster.as_str();
    let mut has_external = has_endpoints;
    if svc.external_policy_local {
        external_policy_chain = ch.local.as_str();
        if local_eps.is_empty() {
            has_external = false;
        }
    }
    let ext_chain = ch.external.as_str();
    let uses_ext_chain = has_endpoints && svc.externally_accessible();
    let lb_vips: Vec<IpAddr> = svc.load_balancer_vips(cfg.family).collect();
    let ranges = &svc.load_balancer_source_ranges;
    let uses_fw_chain = has_endpoints && !lb_vips.is_empty() && !ranges.is_empty();
    let lb_chain = if uses_fw_chain {
        ch.firewall.as_str()
    } else {
        ext_chain
    };

    let (internal_target, internal_comment, external_target, external_comment);
    if !has_endpoints {
        internal_target = "REJECT";
        internal_comment = quoted(&format!("{name} has no endpoints"));
        external_target = "REJECT";
        external_comment = internal_comment.clone();
    } else {
        internal_target = "DROP";
        internal_comment = quoted(&format!("{name} has no local endpoints"));
        external_target = "DROP";
        external_comment = internal_comment.clone();
        p.no_local_internal = !has_internal;
        p.no_local_external = !has_external;
    }
    let dst = |ip: &IpAddr| format!("-m {proto} -p {proto} -d {ip} --dport {port}");

    // ClusterIP.
    if has_internal {
        p.nat.push(
            KUBE_SERVICES,
            format!(
                "-m comment --comment {} {} -j {internal_chain}",
                quoted(&format!("{name} cluster IP")),
                dst(&cluster_ip)
            ),
        );
    } else {
        p.filter.push(
            KUBE_SERVICES,
            format!(
                "-m comment --comment {internal_comment} {} -j {internal_target}",
                dst(&cluster_ip)
            ),
        );
    }
    // External IPs.
    for ip in &svc.external_ips {
        if has_endpoints {
            p.nat.push(
                KUBE_SERVICES,
                format!(
                    "-m comment --comment {} {} -j {ext_chain}",
                    quoted(&format!("{name} external IP")),
                    dst(ip)
                ),
            );
        }
        if !has_external {
            p.filter.push(
                KUBE_EXTERNAL_SERVICES,
                format!(
                    "-m comment --comment {external_comment} {} -j {external_target}",
                    dst(ip)
                ),
            );
        }
    }
    // Load-balancer IPs.
    for ip in &lb_vips {
        if has_endpoints {
            p.nat.push(
                KUBE_SERVICES,
                format!(
                    "-m comment --comment {} {} -j {lb_chain}",
                    quoted(&format!("{name} loadbalancer IP")),
                    dst(ip)
                ),
            );
        }
        if uses_fw_chain {
            p.filter.push(
                KUBE_PROXY_FIREWALL,
                format!(
                    "-m comment --comment {} {} -j DROP",
                    quoted(&format!("{name} traffic not accepted by {}", ch.firewall)),
                    dst(ip)
                ),
            );
        }
    }
    if !has_external {
        for ip in &lb_vips {
            p.filter.push(
                KUBE_EXTERNAL_SERVICES,
                format!(
                    "-m comment --comment {external_comment} {} -j {external_target}",
                    dst(ip)
                ),
            );
        }
    }
    // NodePort.
    if svc.node_port != 0 {
        let np = svc.node_port;
        if has_endpoints {
            if localhost_nps
                && cfg.family == IpFamily::V4
                && cfg.nfacct_counters.localhost_nps_accepted_pkts
            {
                p.nat.push(
                    KUBE_NODEPORTS,
                    format!(
                        "-m comment --comment {name} -m {proto} -p {proto} -d 127.0.0.0/8 --dport {np} -m nfacct --nfacct-name {NFACCT_LOCALHOST_NODEPORTS} -j {ext_chain}"
                    ),
                );
            }
            p.nat.push(
                KUBE_NODEPORTS,
                format!(
                    "-m comment --comment {name} -m {proto} -p {proto} --dport {np} -j {ext_chain}"
                ),
            );
        }
        if !has_external {
            p.filter.push(
                KUBE_EXTERNAL_SERVICES,
                format!(
                    "-m comment --comment {external_comment} -m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {np} -j {external_target}"
                ),
            );
        }
    }
    // Health check node port.
    if svc.health_check_node_port != 0 {
        p.filter.push(
            KUBE_NODEPORTS,
            format!(
                "-m comment --comment {} -m tcp -p tcp --dport {} -j ACCEPT",
                quoted(&format!("{name} health check node port")),
                svc.health_check_node_port
            ),
        );
    }

    // Per-service chains.
    let mut t = TablePlan::default();
    if has_internal {
        let args = format!(
            "-m comment --comment {} {}",
            quoted(&format!("{name} cluster IP")),
            dst(&cluster_ip)
        );
        if cfg.masquerade_all {
            t.push(internal_chain, format!("{args} -j {KUBE_MARK_MASQ}"));
        } else if let Some(not_local) = cfg.local_detector.if_not_local() {
            t.push(
                internal_chain,
                format!("{args} {not_local} -j {KUBE_MARK_MASQ}"),
            );
        }
    }
    if uses_ext_chain {
        t.declare(ext_chain);
        if !svc.external_policy_local {
            t.push(
                ext_chain,
                format!(
                    "-m comment --comment {} -j {KUBE_MARK_MASQ}",
                    quoted(&format!(
                        "masquerade traffic for {name} external destinations"
                    ))
                ),
            );
        } else {
            if let Some(local) = cfg.local_detector.if_local() {
                t.push(
                    ext_chain,
                    format!(
                        "-m comment --comment {} {local} -j {}",
                        quoted(&format!("pod traffic for {name} external destinations")),
                        ch.cluster
                    ),
                );
            }
            t.push(
                ext_chain,
                format!(
                    "-m comment --comment {} -m addrtype --src-type LOCAL -j {KUBE_MARK_MASQ}",
                    quoted(&format!(
                        "masquerade LOCAL traffic for {name} external destinations"
                    ))
                ),
            );
            t.push(
                ext_chain,
                format!(
                    "-m comment --comment {} -m addrtype --src-type LOCAL -j {}",
                    quoted(&format!(
                        "route LOCAL traffic for {name} external destinations"
                    )),
                    ch.cluster
                ),
            );
        }
        if has_external {
            t.push(ext_chain, format!("-j {external_policy_chain}"));
        }
    }
    if uses_fw_chain {
        let fw = ch.firewall.as_str();
        t.declare(fw);
        let args = format!(
            "-m comment --comment {}",
            quoted(&format!("{name} loadbalancer IP"))
        );
        let mut allow_from_node = false;
        for cidr in ranges {
            t.push(fw, format!("{args} -s {cidr} -j {ext_chain}"));
            if cfg.node_ip.is_some_and(|ip| cidr.contains(&ip)) {
                allow_from_node = true;
            }
        }
        if allow_from_node {
            for ip in &lb_vips {
                t.push(fw, format!("{args} -s {ip} -j {ext_chain}"));
            }
        }
        t.push(
            fw,
            format!(
                "-m comment --comment {}",
                quoted(&format!(
                    "other traffic to {name} will be dropped by KUBE-PROXY-FIREWALL"
                ))
            ),
        );
    }
    let large = ctx.large_cluster;
    let comment = |c: &str| {
        if large {
            String::new()
        } else {
            format!("-m comment --comment {c} ")
        }
    };
    let endpoint_rules = |t: &mut TablePlan, chain: &str, eps: &[Endpoint]| {
        t.declare(chain);
        if let Some(timeout) = svc.session_affinity_timeout {
            for ep in eps {
                let sep = endpoint_chain(&svc.name, ep);
                t.push(
                    chain,
                    format!(
                        "{}-m recent --name {sep} --rcheck --seconds {timeout} --reap -j {sep}",
                        comment(&quoted(&format!("{name} -> {}", ep.addr())))
                    ),
                );
            }
        }
        let n = eps.len();
        for (i, ep) in eps.iter().enumerate() {
            let sep = endpoint_chain(&svc.name, ep);
            let prob = if i + 1 < n {
                format!(
                    "-m statistic --mode random --probability {} ",
                    probability(n - i)
                )
            } else {
                String::new()
            };
            t.push(
                chain,
                format!(
                    "{}{prob}-j {sep}",
                    comment(&quoted(&format!("{name} -> {}", ep.addr())))
                ),
            );
        }
    };
    if uses_cluster_chain {
        endpoint_rules(&mut t, &ch.cluster, &cluster_eps);
    }
    if uses_local_chain {
        endpoint_rules(&mut t, &ch.local, &local_eps);
    }
    for ep in &cat.all_reachable {
        let sep = endpoint_chain(&svc.name, ep);
        t.declare(&sep);
        let c = comment(&name);
        t.push(&sep, format!("{c}-s {} -j {KUBE_MARK_MASQ}", ep.ip));
        let affinity = if svc.session_affinity_timeout.is_some() {
            format!("-m recent --name {sep} --set ")
        } else {
            String::new()
        };
        t.push(
            &sep,
            format!(
                "{c}{affinity}-m {proto} -p {proto} -j DNAT --to-destination {}",
                ep.addr()
            ),
        );
    }
    p.chains = t;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probabilities_are_formatted_like_upstream() {
        // Upstream TestComputeProbability.
        for (n, want) in [
            (1, "1.0000000000"),
            (2, "0.5000000000"),
            (10, "0.1000000000"),
            (100000, "0.0000100000"),
            (100001, "0.0000099999"),
        ] {
            assert_eq!(probability(n), want, "n={n}");
        }
    }

    #[test]
    fn empty_snapshot_has_only_the_fixed_rules() {
        let cfg = IptablesConfig::new(IpFamily::V4, super::super::LocalTrafficDetector::NoOp);
        let p = plan(&Snapshot::default(), &cfg);
        assert!(p.services.is_empty());
        assert_eq!(
            p.nat.rule_count(),
            5,
            "POSTROUTING 3, MARK-MASQ 1, NODEPORTS tail call 1"
        );
        let fw = p
            .filter
            .get(KUBE_FIREWALL)
            .expect("KUBE-FIREWALL with localhost NodePorts");
        assert_eq!(fw.rules.len(), 1);
        let v6 = plan(
            &Snapshot::default(),
            &IptablesConfig::new(IpFamily::V6, super::super::LocalTrafficDetector::NoOp),
        );
        assert!(v6.filter.get(KUBE_FIREWALL).is_none(), "IPv4 only");
        let tail = &v6.nat.get(KUBE_SERVICES).expect("chain").rules[0];
        assert!(
            tail.ends_with("--dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"),
            "{tail}"
        );
    }
}
