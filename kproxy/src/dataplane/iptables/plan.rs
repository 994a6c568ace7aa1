//! The pure planner: [`Snapshot`] + [`IptablesConfig`] → the filter and nat rules upstream's
//! `syncProxyRules` writes, kept structured (table → chain → rules) so the applier can write
//! only the per-service chains that changed.
//!
//! Rule text, rule order inside every chain, comments and chain names are upstream's
//! (pkg/proxy/iptables/proxier.go at the commit named in tests/fixtures/upstream/SOURCES.md);
//! the corpus test compares whole dumps after upstream's canonical sort.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::dataplane::netfilter::node_ports::masquerade_mark;
use crate::model::topology::categorize_endpoints;
use crate::model::{Endpoint, IpFamily, ServicePort, ServicePortName, Snapshot};

use super::config::{IptablesConfig, NFACCT_CT_INVALID, NFACCT_LOCALHOST_NODEPORTS};
use super::names::*;

/// `namespace/name` of a service: the unit of partial syncs (upstream `NamespacedName`).
pub(crate) type ServiceKey = (String, String);

/// The service key of a service port.
pub(crate) fn service_key(name: &ServicePortName) -> ServiceKey {
    (name.namespace.clone(), name.name.clone())
}

/// One chain and its complete rule lines (`-A CHAIN …`), in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ChainRules {
    pub name: String,
    pub rules: Vec<String>,
}

/// Chains of one table in declaration order, each with its rules.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TablePlan {
    pub chains: Vec<ChainRules>,
}

impl TablePlan {
    pub(crate) fn chain_mut(&mut self, name: &str) -> &mut ChainRules {
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
    pub(crate) fn rule_count(&self) -> usize {
        self.chains.iter().map(|c| c.rules.len()).sum()
    }
    #[cfg(test)]
    pub fn get(&self, chain: &str) -> Option<&ChainRules> {
        self.chains.iter().find(|c| c.name == chain)
    }
}

/// A jump rule from a built-in chain, ensured outside the restore input (upstream
/// `iptablesJumpChains` + `iptablesKubeletJumpChains`, `EnsureRule(Prepend, …)`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JumpRule {
    pub table: &'static str,
    pub from: &'static str,
    pub to: &'static str,
    /// The rule's arguments after `-A <from>` (extra args, comment, `-j <to>`), as argv.
    pub args: Vec<String>,
}

/// The jump rules from built-in chains, in upstream's order.
pub(crate) fn jump_rules() -> Vec<JumpRule> {
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
pub(crate) struct RulesPlan {
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

/// Upstream `computeProbability`: `%0.10f` of 1/n.
pub(crate) fn probability(n: usize) -> String {
    format!("{:.10}", 1.0 / n as f64)
}

fn quoted(s: &str) -> String {
    format!("\"{s}\"")
}

/// The planned pieces of one service port, independent of every other service port: its
/// rules in the shared chains (filter KUBE-SERVICES & co., nat KUBE-SERVICES and
/// KUBE-NODEPORTS) and its own SVC/SVL/EXT/FW/SEP chains. [`assemble`] concatenates them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PortPlan {
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
pub(crate) struct PortContext<'a> {
    pub cfg: &'a IptablesConfig,
    pub node: &'a crate::model::NodeInfo,
    /// Large-cluster mode (no per-endpoint comments).
    pub large_cluster: bool,
}

/// The family's service ports of `snap` with their cluster IP and endpoints of the family
/// (unsorted), in snapshot order.
pub(crate) fn family_ports<'a>(
    snap: &'a Snapshot,
    family: IpFamily,
) -> impl Iterator<Item = (&'a std::sync::Arc<ServicePort>, IpAddr, &'a [Endpoint])> + 'a {
    snap.services.values().filter_map(move |svc| {
        let cluster_ip = svc.cluster_ip(family)?;
        Some((svc, cluster_ip, snap.endpoints_of(&svc.name)))
    })
}

/// Endpoints of `eps` in `family` (upstream's count for large-cluster mode).
pub(crate) fn family_endpoint_count(eps: &[Endpoint], family: IpFamily) -> usize {
    eps.iter().filter(|e| family.matches(&e.ip)).count()
}

/// Plans one service port (`eps`: all its endpoints, any family).
pub(crate) fn plan_port(
    ctx: &PortContext<'_>,
    svc: &ServicePort,
    cluster_ip: IpAddr,
    eps: &[Endpoint],
) -> PortPlan {
    let family = ctx.cfg.family;
    let eps = ServicePort::family_endpoints(eps, family);
    let svc = svc.for_family(family);
    let mut pp = PortPlan {
        endpoints: eps.len(),
        ..Default::default()
    };
    write_service_port(&mut pp, ctx, &svc, cluster_ip, &eps);
    pp
}

/// The chains and rules that do not depend on any service port: declarations of the shared
/// chains and the rules that come before every service port's.
pub(crate) fn plan_head(cfg: &IptablesConfig) -> RulesPlan {
    let mark = masquerade_mark(cfg.masquerade_bit);
    let localhost_nps = cfg.effective_localhost_node_ports();
    let is_v6 = cfg.family == IpFamily::V6;
    let mut p = RulesPlan::default();

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
pub(crate) fn plan_tail(p: &mut RulesPlan, cfg: &IptablesConfig) {
    let mark = masquerade_mark(cfg.masquerade_bit);
    let localhost_nps = cfg.effective_localhost_node_ports();
    let is_v6 = cfg.family == IpFamily::V6;
    // Tail call to KUBE-NODEPORTS; must stay the last rule of KUBE-SERVICES.
    let last = "-m comment --comment \"kubernetes service nodeports; NOTE: this must be the last rule in this chain\"";
    if cfg.node_ports().match_all() {
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
        for ip in cfg.node_ports().node_ips() {
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
/// [`RulesPlan::services`]) and counts it.
pub(crate) fn add_port_shared(p: &mut RulesPlan, pp: &PortPlan) {
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
pub(crate) fn is_large_cluster(total_endpoints: usize, cfg: &IptablesConfig) -> bool {
    total_endpoints > cfg.large_cluster_threshold
}

/// The whole plan from the port plans, in snapshot order (every port of a service is
/// adjacent in that order, so its chains group by service like upstream's).
pub(crate) fn assemble<'a>(
    cfg: &IptablesConfig,
    large_cluster: bool,
    ports: impl IntoIterator<Item = (&'a ServicePortName, &'a PortPlan)>,
) -> RulesPlan {
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
pub(crate) fn plan(snap: &Snapshot, cfg: &IptablesConfig) -> RulesPlan {
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

/// What one service port's rules are built from: the decisions of upstream's per-service
/// block in `syncProxyRules` (which chains it uses, where traffic without endpoints goes),
/// shared by the steps that write its rules.
struct PortRules<'a> {
    cfg: &'a IptablesConfig,
    svc: &'a ServicePort,
    cluster_ip: IpAddr,
    /// `namespace/name:port`.
    name: String,
    /// `tcp`, `udp`, `sctp`.
    proto: &'static str,
    ch: ServiceChains,
    cat: crate::model::topology::CategorizedEndpoints,
    has_endpoints: bool,
    /// Internal traffic has endpoints to go to (per its traffic policy).
    has_internal: bool,
    /// External traffic has endpoints to go to (per its traffic policy).
    has_external: bool,
    /// The chain internal traffic jumps to (`KUBE-SVC-…` or `KUBE-SVL-…`).
    internal_chain: String,
    /// The chain the external chain ends in (`KUBE-SVC-…` or `KUBE-SVL-…`).
    external_policy_chain: String,
    lb_vips: Vec<IpAddr>,
    uses_fw_chain: bool,
    /// `REJECT` (no endpoints at all) or `DROP` (no local ones).
    no_endpoints_target: &'static str,
    no_endpoints_comment: String,
    large_cluster: bool,
}

impl<'a> PortRules<'a> {
    fn new(
        ctx: &PortContext<'a>,
        svc: &'a ServicePort,
        cluster_ip: IpAddr,
        eps: &[Endpoint],
    ) -> Self {
        let cfg = ctx.cfg;
        let name = svc.name.to_string();
        let ch = service_chains(&svc.name);
        let cat = categorize_endpoints(eps, svc, ctx.node);
        let has_endpoints = cat.has_any_endpoints;
        let no_local = cat.local.as_ref().is_none_or(|l| l.is_empty());
        let policy_chain = |local: bool| {
            if local {
                ch.local.clone()
            } else {
                ch.cluster.clone()
            }
        };
        let lb_vips: Vec<IpAddr> = svc.load_balancer_vips(cfg.family).collect();
        let uses_fw_chain =
            has_endpoints && !lb_vips.is_empty() && !svc.load_balancer_source_ranges.is_empty();
        let (no_endpoints_target, no_endpoints_comment) = if has_endpoints {
            ("DROP", quoted(&format!("{name} has no local endpoints")))
        } else {
            ("REJECT", quoted(&format!("{name} has no endpoints")))
        };
        PortRules {
            cfg,
            svc,
            cluster_ip,
            proto: svc.protocol.lower(),
            has_endpoints,
            has_internal: has_endpoints && !(svc.internal_policy_local && no_local),
            has_external: has_endpoints && !(svc.external_policy_local && no_local),
            internal_chain: policy_chain(svc.internal_policy_local),
            external_policy_chain: policy_chain(svc.external_policy_local),
            lb_vips,
            uses_fw_chain,
            no_endpoints_target,
            no_endpoints_comment,
            large_cluster: ctx.large_cluster,
            name,
            ch,
            cat,
        }
    }

    /// `-m <proto> -p <proto> -d <ip> --dport <port>`.
    fn dst(&self, ip: &IpAddr) -> String {
        let (proto, port) = (self.proto, self.svc.port);
        format!("-m {proto} -p {proto} -d {ip} --dport {port}")
    }

    /// The chain load-balancer traffic jumps to: the firewall chain when source ranges apply.
    fn lb_chain(&self) -> &str {
        if self.uses_fw_chain {
            &self.ch.firewall
        } else {
            &self.ch.external
        }
    }

    /// A rule in KUBE-EXTERNAL-SERVICES dropping/rejecting external traffic to `matches`.
    fn no_external_endpoints(&self, p: &mut PortPlan, matches: &str) {
        p.filter.push(
            KUBE_EXTERNAL_SERVICES,
            format!(
                "-m comment --comment {} {matches} -j {}",
                self.no_endpoints_comment, self.no_endpoints_target
            ),
        );
    }

    /// KUBE-SERVICES: the cluster IP jumps to its chain, or is rejected/dropped in filter.
    fn write_cluster_ip_rules(&self, p: &mut PortPlan) {
        let name = &self.name;
        if self.has_internal {
            p.nat.push(
                KUBE_SERVICES,
                format!(
                    "-m comment --comment {} {} -j {}",
                    quoted(&format!("{name} cluster IP")),
                    self.dst(&self.cluster_ip),
                    self.internal_chain
                ),
            );
        } else {
            p.filter.push(
                KUBE_SERVICES,
                format!(
                    "-m comment --comment {} {} -j {}",
                    self.no_endpoints_comment,
                    self.dst(&self.cluster_ip),
                    self.no_endpoints_target
                ),
            );
        }
    }

    /// KUBE-SERVICES / KUBE-EXTERNAL-SERVICES for each external IP.
    fn write_external_ip_rules(&self, p: &mut PortPlan) {
        for ip in &self.svc.external_ips {
            if self.has_endpoints {
                p.nat.push(
                    KUBE_SERVICES,
                    format!(
                        "-m comment --comment {} {} -j {}",
                        quoted(&format!("{} external IP", self.name)),
                        self.dst(ip),
                        self.ch.external
                    ),
                );
            }
            if !self.has_external {
                self.no_external_endpoints(p, &self.dst(ip));
            }
        }
    }

    /// KUBE-SERVICES for each load-balancer IP, KUBE-PROXY-FIREWALL's drops when source
    /// ranges apply, then KUBE-EXTERNAL-SERVICES when external traffic has no endpoints.
    fn write_load_balancer_rules(&self, p: &mut PortPlan) {
        for ip in &self.lb_vips {
            if self.has_endpoints {
                p.nat.push(
                    KUBE_SERVICES,
                    format!(
                        "-m comment --comment {} {} -j {}",
                        quoted(&format!("{} loadbalancer IP", self.name)),
                        self.dst(ip),
                        self.lb_chain()
                    ),
                );
            }
            if self.uses_fw_chain {
                p.filter.push(
                    KUBE_PROXY_FIREWALL,
                    format!(
                        "-m comment --comment {} {} -j DROP",
                        quoted(&format!(
                            "{} traffic not accepted by {}",
                            self.name, self.ch.firewall
                        )),
                        self.dst(ip)
                    ),
                );
            }
        }
        if !self.has_external {
            for ip in &self.lb_vips {
                self.no_external_endpoints(p, &self.dst(ip));
            }
        }
    }

    /// KUBE-NODEPORTS (nat) and KUBE-EXTERNAL-SERVICES for the node port.
    fn write_node_port_rules(&self, p: &mut PortPlan) {
        let np = self.svc.node_port;
        if np == 0 {
            return;
        }
        let (cfg, name, proto, ext_chain) = (self.cfg, &self.name, self.proto, &self.ch.external);
        if self.has_endpoints {
            if cfg.effective_localhost_node_ports()
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
        if !self.has_external {
            self.no_external_endpoints(
                p,
                &format!("-m addrtype --dst-type LOCAL -m {proto} -p {proto} --dport {np}"),
            );
        }
    }

    /// KUBE-NODEPORTS (filter): accept the health check node port.
    fn write_health_check_rule(&self, p: &mut PortPlan) {
        if self.svc.health_check_node_port != 0 {
            p.filter.push(
                KUBE_NODEPORTS,
                format!(
                    "-m comment --comment {} -m tcp -p tcp --dport {} -j ACCEPT",
                    quoted(&format!("{} health check node port", self.name)),
                    self.svc.health_check_node_port
                ),
            );
        }
    }

    /// The internal chain's masquerade rule (all traffic, or traffic not from a local pod).
    fn write_internal_masquerade(&self, t: &mut TablePlan) {
        if !self.has_internal {
            return;
        }
        let args = format!(
            "-m comment --comment {} {}",
            quoted(&format!("{} cluster IP", self.name)),
            self.dst(&self.cluster_ip)
        );
        let chain = self.internal_chain.as_str();
        if self.cfg.masquerade_all {
            t.push(chain, format!("{args} -j {KUBE_MARK_MASQ}"));
        } else if let Some(not_local) = self.cfg.local_detector.if_not_local() {
            t.push(chain, format!("{args} {not_local} -j {KUBE_MARK_MASQ}"));
        }
    }

    /// `KUBE-EXT-…`: masquerade external traffic (or, for Local policy, only the node's own
    /// and short-circuit pods'), then the policy chain.
    fn write_external_chain(&self, t: &mut TablePlan) {
        if !(self.has_endpoints && self.svc.externally_accessible()) {
            return;
        }
        let (name, ext_chain) = (&self.name, self.ch.external.as_str());
        t.declare(ext_chain);
        if !self.svc.external_policy_local {
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
            if let Some(local) = self.cfg.local_detector.if_local() {
                t.push(
                    ext_chain,
                    format!(
                        "-m comment --comment {} {local} -j {}",
                        quoted(&format!("pod traffic for {name} external destinations")),
                        self.ch.cluster
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
                    self.ch.cluster
                ),
            );
        }
        if self.has_external {
            t.push(ext_chain, format!("-j {}", self.external_policy_chain));
        }
    }

    /// `KUBE-FW-…`: loadBalancerSourceRanges (and the LB IPs themselves when the node is in
    /// a range) go on to the external chain; anything else falls through to be dropped.
    fn write_firewall_chain(&self, t: &mut TablePlan) {
        if !self.uses_fw_chain {
            return;
        }
        let (fw, ext_chain) = (self.ch.firewall.as_str(), self.ch.external.as_str());
        t.declare(fw);
        let args = format!(
            "-m comment --comment {}",
            quoted(&format!("{} loadbalancer IP", self.name))
        );
        let mut allow_from_node = false;
        for cidr in &self.svc.load_balancer_source_ranges {
            t.push(fw, format!("{args} -s {cidr} -j {ext_chain}"));
            if self.cfg.node_ip.is_some_and(|ip| cidr.contains(&ip)) {
                allow_from_node = true;
            }
        }
        if allow_from_node {
            for ip in &self.lb_vips {
                t.push(fw, format!("{args} -s {ip} -j {ext_chain}"));
            }
        }
        t.push(
            fw,
            format!(
                "-m comment --comment {}",
                quoted(&format!(
                    "other traffic to {} will be dropped by KUBE-PROXY-FIREWALL",
                    self.name
                ))
            ),
        );
    }

    /// `-m comment --comment <c> `, left out in large-cluster mode.
    fn comment(&self, c: &str) -> String {
        if self.large_cluster {
            String::new()
        } else {
            format!("-m comment --comment {c} ")
        }
    }

    /// `KUBE-SVC-…` / `KUBE-SVL-…`: affinity checks, then a random pick of an endpoint chain.
    fn write_service_chain(&self, t: &mut TablePlan, chain: &str, eps: &[Endpoint]) {
        let svc = self.svc;
        let name = &self.name;
        t.declare(chain);
        if let Some(timeout) = svc.session_affinity_timeout {
            for ep in eps {
                let sep = endpoint_chain(&svc.name, ep);
                t.push(
                    chain,
                    format!(
                        "{}-m recent --name {sep} --rcheck --seconds {timeout} --reap -j {sep}",
                        self.comment(&quoted(&format!("{name} -> {}", ep.addr())))
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
                    self.comment(&quoted(&format!("{name} -> {}", ep.addr())))
                ),
            );
        }
    }

    /// The cluster and local service chains, when used.
    fn write_service_chains(&self, t: &mut TablePlan) {
        let svc = self.svc;
        if let Some(eps) = self.cat.cluster.as_deref()
            && !eps.is_empty()
            && svc.uses_cluster_endpoints()
        {
            self.write_service_chain(t, &self.ch.cluster, eps);
        }
        if let Some(eps) = self.cat.local.as_deref()
            && !eps.is_empty()
            && svc.uses_local_endpoints()
        {
            self.write_service_chain(t, &self.ch.local, eps);
        }
    }

    /// `KUBE-SEP-…` for every reachable endpoint: hairpin masquerade, then DNAT.
    fn write_endpoint_chains(&self, t: &mut TablePlan) {
        let proto = self.proto;
        for ep in &self.cat.all_reachable {
            let sep = endpoint_chain(&self.svc.name, ep);
            t.declare(&sep);
            let c = self.comment(&self.name);
            t.push(&sep, format!("{c}-s {} -j {KUBE_MARK_MASQ}", ep.ip));
            let affinity = if self.svc.session_affinity_timeout.is_some() {
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
    }
}

/// One service port's rules (upstream's per-service block in `syncProxyRules`): its rules in
/// the shared chains, then its own chains.
fn write_service_port(
    p: &mut PortPlan,
    ctx: &PortContext<'_>,
    svc: &ServicePort,
    cluster_ip: IpAddr,
    eps: &[Endpoint],
) {
    let r = PortRules::new(ctx, svc, cluster_ip, eps);
    if r.has_endpoints {
        p.no_local_internal = !r.has_internal;
        p.no_local_external = !r.has_external;
    }
    r.write_cluster_ip_rules(p);
    r.write_external_ip_rules(p);
    r.write_load_balancer_rules(p);
    r.write_node_port_rules(p);
    r.write_health_check_rule(p);

    let mut t = TablePlan::default();
    r.write_internal_masquerade(&mut t);
    r.write_external_chain(&mut t);
    r.write_firewall_chain(&mut t);
    r.write_service_chains(&mut t);
    r.write_endpoint_chains(&mut t);
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
        let cfg = IptablesConfig::new(
            IpFamily::V4,
            crate::dataplane::netfilter::local_detect::LocalDetector::None,
        );
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
            &IptablesConfig::new(
                IpFamily::V6,
                crate::dataplane::netfilter::local_detect::LocalDetector::None,
            ),
        );
        assert!(v6.filter.get(KUBE_FIREWALL).is_none(), "IPv4 only");
        let tail = &v6.nat.get(KUBE_SERVICES).expect("chain").rules[0];
        assert!(
            tail.ends_with("--dst-type LOCAL ! -d ::1/128 -j KUBE-NODEPORTS"),
            "{tail}"
        );
    }
}
