//! Builds a datapath from the resolved configuration.
//!
//! This is the one place that knows every [`ProxyMode`]'s constructor; [`super::modes::select`]
//! calls it for the agent (and [`super::modes::cleanup_all`] cleans up after every mode); the
//! `*_configs` functions map [`ProxyConfig`] onto each datapath's own configuration (also used
//! by `kproxy render --proxy-mode`).
//!
//! - **iptables**: one proxier per IP family ([`IptablesDataplane`]), conntrack cleanup after
//!   each successful sync ([`WithConntrackCleanup`]), the conntrack sysctls of `conntrack:`.
//! - **ipvs**: one [`IpvsDataplane`] per family (NodePorts on the node's addresses inside
//!   `nodePortAddresses`), conntrack cleanup and sysctls as iptables.
//! - **nftables**: one proxier per IP family ([`NftablesDataplane`], the `ip`/`ip6`
//!   `kube-proxy` tables), settings from `nftables.*`, conntrack cleanup and sysctls as
//!   iptables. The service CIDRs of the "drop traffic to unallocated ClusterIPs" rule come from
//!   the `ServiceCIDR` objects when the API server serves them (the snapshot's), else from
//!   kproxy's `serviceCIDRs` / `--service-cidrs` (none: no such rule).
//! - **ebpf**: [`EbpfDataplane`] (service maps + socket LB + the TC path on the node's devices).
//!
//! `detectLocalMode: NodeCIDR`: the caller passes the Node's `spec.podCIDRs` (`main.rs` waits
//! for them before building the datapath, as upstream waits before starting its proxier); the
//! iptables proxiers' detector and the ipvs proxiers' local CIDR are the first pod CIDR of
//! their family.
//!
//! Knowingly different from upstream: a conntrack sysctl that cannot be written is logged as a
//! warning instead of failing start-up (inside a network namespace most of them are
//! read-only).

use std::net::IpAddr;
use std::time::Duration;

use anyhow::Context;
use ipnet::IpNet;
use tracing::{info, warn};

use super::modes::have;
use crate::config::{DetectLocal, NodePortAddresses, ProxyConfig};
use crate::dataplane::ebpf::EbpfConfig;
use crate::dataplane::ebpf::EbpfDataplane;
use crate::dataplane::ebpf::service_maps::MapSizes;
use crate::dataplane::ebpf::service_maps::ServiceMapsConfig;
use crate::dataplane::iptables::exec::{Flavor, Runner, detect_flavor};
use crate::dataplane::iptables::{self as ipt, IptablesDataplane};
use crate::dataplane::ipvs::{self as ipvs_mod, IpvsDataplane};
use crate::dataplane::netfilter::local_detect::LocalDetector;
use crate::dataplane::netfilter::with_conntrack::WithConntrackCleanup;
use crate::dataplane::nftables::kernel::NftRunner;
use crate::dataplane::nftables::{self as nft, NftablesDataplane};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport};
use crate::model::{ChangedSet, IpFamily, Snapshot};
use crate::observe::metrics::Metrics;
use crate::sync::SyncRequester;

/// The IP families this host can program: IPv4, and IPv6 unless the kernel has it disabled.
pub fn host_families() -> Vec<IpFamily> {
    let v6 = std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
        .map(|s| s.trim() == "0")
        .unwrap_or(false);
    if v6 {
        vec![IpFamily::V4, IpFamily::V6]
    } else {
        vec![IpFamily::V4]
    }
}

fn first_of(cidrs: &[IpNet], family: IpFamily) -> Option<IpNet> {
    cidrs.iter().copied().find(|c| family.matches(&c.addr()))
}

/// The local-traffic detector of `family`, chosen by [`crate::dataplane::netfilter::local_detect::detectors`];
/// `node_pod_cidrs` are the Node's `spec.podCIDRs` (used by NodeCIDR only).
pub fn local_detector(
    cfg: &ProxyConfig,
    family: IpFamily,
    node_pod_cidrs: &[IpNet],
) -> LocalDetector {
    use crate::dataplane::netfilter::local_detect::detectors;
    match detectors(
        &cfg.detect_local,
        &cfg.cluster_cidrs,
        IpFamily::V4,
        node_pod_cidrs,
    ) {
        Ok((d, warnings)) => {
            for w in warnings {
                info!("{w}");
            }
            d.get(family).clone()
        }
        Err(e) => {
            warn!("{e}; no traffic is treated as local");
            LocalDetector::None
        }
    }
}

/// The CIDRs NodePorts are accepted in, in `mode` (empty: every local address):
/// `nodePortAddresses` with the mode's default ([`NodePortAddresses::for_mode`]: `primary` in
/// nftables mode), `primary` as the node's primary IPs found at start-up
/// ([`ProxyConfig::primary_node_ips`]).
pub fn node_port_cidrs(cfg: &ProxyConfig, mode: ProxyMode) -> Vec<IpNet> {
    match cfg.node_port_addresses.for_mode(mode) {
        NodePortAddresses::Unset => vec![],
        NodePortAddresses::Cidrs(c) => c,
        NodePortAddresses::Primary => NodePortAddresses::primary_cidrs(&cfg.primary_node_ips),
    }
}

/// The iptables proxiers' configurations (one per family in `families`); `node_pod_cidrs`
/// as for [`local_detector`].
pub fn iptables_configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_pod_cidrs: &[IpNet],
) -> Vec<ipt::IptablesConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c =
                ipt::IptablesConfig::new(family, local_detector(cfg, family, node_pod_cidrs));
            c.node_ip = (!cfg.bind_address.is_unspecified() && family.matches(&cfg.bind_address))
                .then_some(cfg.bind_address);
            c.masquerade_bit = cfg.masquerade_bit;
            c.masquerade_all = cfg.masquerade_all;
            c.localhost_node_ports = cfg.iptables.localhost_node_ports;
            c.node_port_addresses = node_port_cidrs(cfg, ProxyMode::Iptables);
            c.sync_period = cfg.iptables.sync.sync_period;
            c
        })
        .collect()
}

/// The nftables proxiers' configurations (one per family in `families`); `node_pod_cidrs`
/// as for [`local_detector`].
pub fn nftables_configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_pod_cidrs: &[IpNet],
) -> Vec<nft::NftablesConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c =
                nft::NftablesConfig::new(family, local_detector(cfg, family, node_pod_cidrs));
            c.node_ip = (!cfg.bind_address.is_unspecified() && family.matches(&cfg.bind_address))
                .then_some(cfg.bind_address);
            c.masquerade_bit = cfg.nftables.masquerade_bit;
            c.masquerade_all = cfg.nftables.masquerade_all;
            c.node_port_addresses = node_port_cidrs(cfg, ProxyMode::Nftables);
            c.service_cidrs = cfg.service_cidrs.clone();
            c
        })
        .collect()
}

/// Whether nftables mode serves NodePorts on 127.0.0.1 (feature gate
/// `KubeProxyNFTablesLocalhostNodePorts`): the gate is on, the node runs IPv4, and
/// `nodePortAddresses` does not exclude loopback (an explicit CIDR list must hold 127.0.0.1,
/// e.g. the `localhost` keyword; unset and `primary` do not exclude it — the gate itself asks
/// for localhost).
fn localhost_node_ports(cfg: &ProxyConfig, families: &[IpFamily]) -> bool {
    let gate = nft::localhost::FEATURE_GATE;
    if !cfg.feature(gate) {
        return false;
    }
    if !families.contains(&IpFamily::V4) {
        tracing::warn!("{gate}: localhost NodePorts are IPv4-only; this node runs no IPv4");
        return false;
    }
    let loopback = IpAddr::V4(nft::localhost::LOOPBACK);
    match &cfg.node_port_addresses {
        NodePortAddresses::Cidrs(c) if !c.iter().any(|n| n.contains(&loopback)) => {
            tracing::warn!("{gate}: nodePortAddresses excludes 127.0.0.1; localhost NodePorts off");
            false
        }
        _ => true,
    }
}

/// The node's addresses NodePorts are served on in ipvs mode (non-loopback, non-link-local
/// addresses of every device but the IPVS dummy, inside `nodePortAddresses`).
fn ipvs_node_ips(cfg: &ProxyConfig, family: IpFamily) -> Vec<IpAddr> {
    let cidrs = node_port_cidrs(cfg, ProxyMode::Ipvs);
    let ifaces = crate::kernel::addresses::scan().unwrap_or_default();
    let mut ips: Vec<IpAddr> = ifaces
        .iter()
        .filter(|i| !i.loopback && i.name != ipvs_mod::config::DEFAULT_DUMMY_DEVICE)
        .flat_map(|i| i.node_addrs())
        .filter(|ip| family.matches(ip))
        .filter(|ip| cidrs.is_empty() || cidrs.iter().any(|c| c.contains(ip)))
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

fn secs(d: Option<Duration>) -> u32 {
    d.map_or(0, |d| d.as_secs().min(u64::from(u32::MAX)) as u32)
}

/// The IPVS proxiers' configurations; `node_ips` gives the NodePort addresses of a family;
/// the local CIDR is the first `--cluster-cidr` of the family, or with NodeCIDR the first of
/// `node_pod_cidrs`.
pub fn ipvs_configs(
    cfg: &ProxyConfig,
    families: &[IpFamily],
    node_ips: impl Fn(IpFamily) -> Vec<IpAddr>,
    flavor: Flavor,
    node_pod_cidrs: &[IpNet],
) -> Vec<ipvs_mod::IpvsConfig> {
    families
        .iter()
        .map(|&family| {
            let mut c = ipvs_mod::IpvsConfig::new(family, node_ips(family));
            c.scheduler = cfg.ipvs.scheduler.clone();
            c.strict_arp = cfg.ipvs.strict_arp;
            c.timeouts = ipvs_mod::genl::Timeouts {
                tcp: secs(cfg.ipvs.tcp_timeout),
                tcp_fin: secs(cfg.ipvs.tcp_fin_timeout),
                udp: secs(cfg.ipvs.udp_timeout),
            };
            c.masquerade_all = cfg.masquerade_all;
            c.cluster_cidr = match cfg.detect_local {
                DetectLocal::NodeCidr => first_of(node_pod_cidrs, family),
                _ => first_of(&cfg.cluster_cidrs, family),
            };
            c.masquerade_bit = cfg.masquerade_bit;
            c.exclude_cidrs = cfg.ipvs.exclude_cidrs.clone();
            c.iptables_restore = restore_binary(family, flavor);
            c
        })
        .collect()
}

pub(super) fn restore_binary(family: IpFamily, flavor: Flavor) -> String {
    let base = match family {
        IpFamily::V4 => "iptables",
        IpFamily::V6 => "ip6tables",
    };
    let f = match flavor {
        Flavor::Nft => "nft",
        Flavor::Legacy => "legacy",
    };
    format!("{base}-{f}-restore")
}

/// The eBPF mode's configuration.
pub fn ebpf_config(cfg: &ProxyConfig, families: &[IpFamily]) -> anyhow::Result<EbpfConfig> {
    let size = |name: &str, default: u32| cfg.bpf.map_sizes.get(name).copied().unwrap_or(default);
    let d = MapSizes::default();
    let map_sizes = MapSizes {
        services: size("services", d.services),
        backend_slots: size("backendSlots", d.backend_slots),
        backends: size("backends", d.backends),
        affinity: size("affinity", d.affinity),
        source_ranges: size("sourceRanges", d.source_ranges),
        ct: size("ct", d.ct),
        sock_rev_nat: size("revNat", d.sock_rev_nat),
        maglev: size("maglev", d.maglev),
    };
    let mut timeouts = crate::dataplane::ebpf::node_path::flows::Timeouts::default();
    if !cfg.conntrack.tcp_established_timeout.is_zero() {
        timeouts.tcp = cfg.conntrack.tcp_established_timeout;
    }
    if !cfg.conntrack.tcp_close_wait_timeout.is_zero() {
        timeouts.tcp_closing = cfg.conntrack.tcp_close_wait_timeout;
    }
    if !cfg.conntrack.udp_stream_timeout.is_zero() {
        timeouts.udp = cfg.conntrack.udp_stream_timeout;
    }
    // kproxy extensions (`bpf.conntrack`): the kernel's TIME_WAIT / CLOSE timeouts, which
    // upstream never sets, and the expiry period.
    timeouts.tcp_time_wait = cfg.bpf.ct_tcp_time_wait;
    timeouts.tcp_close = cfg.bpf.ct_tcp_close;
    timeouts.interval = cfg.bpf.ct_expiry_interval;
    Ok(EbpfConfig {
        ebpf: ServiceMapsConfig {
            families: families.to_vec(),
            map_sizes,
            bpffs: cfg.bpf.bpffs.clone(),
            cgroup: cfg.bpf.cgroup.clone(),
            lb_algorithm: cfg.bpf.lb_algorithm,
            maglev_table_size: cfg.bpf.maglev_table_size,
            full_sync_period: cfg.sync_periods(ProxyMode::Ebpf).sync_period,
            ..ServiceMapsConfig::default()
        },
        devices: (!cfg.bpf.devices.is_empty()).then(|| cfg.bpf.devices.clone()),
        tc: true,
        xdp: cfg.bpf.xdp,
        ct_timeouts: timeouts,
        node_port_cidrs: node_port_cidrs(cfg, ProxyMode::Ebpf),
    })
}

/// Sets the `conntrack:` sysctls (modes that DNAT through netfilter conntrack). Failures are
/// warnings (see the module docs).
fn apply_conntrack_sysctls(cfg: &ProxyConfig) {
    let sc = crate::app::sysctl::SysctlConfig {
        conntrack: cfg.conntrack.clone(),
        // The iptables datapath sets route_localnet itself when it needs it.
        localhost_node_ports: false,
    };
    let report = crate::app::sysctl::apply(&sc, &crate::app::sysctl::Host::real());
    for e in &report.errors {
        warn!("conntrack sysctl not applied: {e}");
    }
}

/// The iptables datapath reporting into upstream's iptables metrics: sync duration (full or
/// partial), restore failures, nat rules written by the last sync.
struct IptablesWithMetrics {
    inner: IptablesDataplane,
    metrics: Metrics,
}

impl Dataplane for IptablesWithMetrics {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Iptables
    }
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let before: Vec<_> = self.inner.proxiers().iter().map(|p| p.stats).collect();
        let start = std::time::Instant::now();
        let result = self.inner.sync(snap, changed);
        let seconds = start.elapsed().as_secs_f64();
        if let Some(m) = self.metrics.iptables() {
            for (p, b) in self.inner.proxiers().iter().zip(before) {
                let (family, a) = (p.cfg.family, p.stats);
                if a.full_syncs > b.full_syncs {
                    m.observe_sync(family, true, seconds);
                } else if a.partial_syncs > b.partial_syncs {
                    m.observe_sync(family, false, seconds);
                }
                for _ in b.restore_failures..a.restore_failures {
                    let partial = a.partial_restore_failures > b.partial_restore_failures;
                    m.restore_failed(family, partial);
                }
                if a.full_syncs + a.partial_syncs > b.full_syncs + b.partial_syncs {
                    m.set_rules_last(
                        family,
                        crate::observe::metrics::IptablesTable::Nat,
                        a.nat_rules_last as i64,
                    );
                }
            }
        }
        result
    }
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.inner.cleanup()
    }
}

/// The nftables datapath reporting into upstream's nftables metrics: sync duration (full or
/// partial) and sync failures per family.
struct NftablesWithMetrics {
    inner: NftablesDataplane,
    metrics: Metrics,
}

impl Dataplane for NftablesWithMetrics {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Nftables
    }
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let before: Vec<_> = self
            .inner
            .families()
            .iter()
            .map(|f| (f.syncs, f.failures, f.proxier.cleanup_failures))
            .collect();
        let start = std::time::Instant::now();
        let result = self.inner.sync(snap, changed);
        let seconds = start.elapsed().as_secs_f64();
        if let Some(m) = self.metrics.nftables() {
            for (f, (syncs, failures, cleanups)) in self.inner.families().iter().zip(before) {
                let family = f.proxier.cfg.family;
                if f.syncs > syncs {
                    m.observe_sync(family, f.proxier.stats.full, seconds);
                }
                if f.failures > failures {
                    m.sync_failed(family);
                }
                for _ in cleanups..f.proxier.cleanup_failures {
                    m.cleanup_failed(family);
                }
            }
        }
        result
    }
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.inner.cleanup()
    }
}

/// Several per-family datapaths as one (ipvs mode).
struct PerFamily {
    mode: ProxyMode,
    parts: Vec<Box<dyn Dataplane>>,
}

impl Dataplane for PerFamily {
    fn mode(&self) -> ProxyMode {
        self.mode
    }
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let mut total = SyncReport::default();
        let mut errors = vec![];
        for p in &mut self.parts {
            match p.sync(snap, changed) {
                Ok(r) => {
                    total.services += r.services;
                    total.endpoints += r.endpoints;
                    total.failed_services += r.failed_services;
                }
                Err(e) => errors.push(e.to_string()),
            }
        }
        if errors.is_empty() {
            Ok(total)
        } else {
            Err(SyncError::Kernel(errors.join("; ")))
        }
    }
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        for p in &mut self.parts {
            p.cleanup()?;
        }
        Ok(())
    }
}

/// Constructs the datapath of `mode`, reporting into `metrics`. Fails with a clear message
/// when the mode cannot run here. `node_pod_cidrs`: the Node's `spec.podCIDRs` (what
/// `detectLocalMode: NodeCIDR` detects local traffic by; ignored by the other modes).
pub fn build(
    mode: ProxyMode,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    metrics: Option<&Metrics>,
) -> anyhow::Result<Box<dyn Dataplane>> {
    build_with_resync(mode, cfg, node_pod_cidrs, metrics, None)
}

/// [`build`] for the agent: `resync` is the sync loop's requester, which the datapath calls
/// when it needs a sync without a service change (the iptables canary monitor after an
/// external flush).
pub fn build_with_resync(
    mode: ProxyMode,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    metrics: Option<&Metrics>,
    resync: Option<&SyncRequester>,
) -> anyhow::Result<Box<dyn Dataplane>> {
    let families = host_families();
    let gate = nft::localhost::FEATURE_GATE;
    if mode != ProxyMode::Nftables && cfg.feature(gate) {
        tracing::info!(
            "feature gate {gate} applies to nftables mode only; {mode:?} mode ignores it"
        );
    }
    match mode {
        ProxyMode::Iptables => {
            apply_conntrack_sysctls(cfg);
            let dp = IptablesDataplane::new(iptables_configs(cfg, &families, node_pod_cidrs))
                .context("setting up the iptables proxier")?;
            if let Some(r) = resync.cloned() {
                dp.set_resync_callback(std::sync::Arc::new(move || r.request()));
            }
            Ok(match metrics {
                Some(m) => Box::new(WithConntrackCleanup::new(
                    IptablesWithMetrics {
                        inner: dp,
                        metrics: m.clone(),
                    },
                    &families,
                    Some(telemetry(m)),
                )),
                None => Box::new(WithConntrackCleanup::new(dp, &families, None)),
            })
        }
        ProxyMode::Ipvs => {
            ipvs_mod::usable().map_err(|e| anyhow::anyhow!("IPVS is not usable: {e}"))?;
            apply_conntrack_sysctls(cfg);
            let flavor = if have("iptables-nft") {
                detect_flavor(Default::default(), &Runner { netns: None })
            } else {
                Flavor::Legacy
            };
            let mut parts: Vec<Box<dyn Dataplane>> = vec![];
            let node_ips = |f| ipvs_node_ips(cfg, f);
            for c in ipvs_configs(cfg, &families, node_ips, flavor, node_pod_cidrs) {
                let family = c.family;
                parts.push(Box::new(IpvsDataplane::new(c).with_context(|| {
                    format!("setting up the {family:?} IPVS proxier")
                })?));
            }
            Ok(Box::new(WithConntrackCleanup::new(
                PerFamily {
                    mode: ProxyMode::Ipvs,
                    parts,
                },
                &families,
                metrics.map(telemetry),
            )))
        }
        ProxyMode::Nftables => {
            apply_conntrack_sysctls(cfg);
            let dp = NftablesDataplane::new(
                nftables_configs(cfg, &families, node_pod_cidrs),
                NftRunner::default(),
                // Upstream's `proxyutil.FullSyncPeriod` (hourly), as the iptables mode; the
                // mode's syncPeriod only paces the (partial) syncs.
                nft::FULL_SYNC_PERIOD,
            )
            .context("setting up the nftables proxier")?;
            let dp = match localhost_node_ports(cfg, &families) {
                true => dp.with_localhost(
                    nft::localhost::LocalhostNodePorts::new()
                        .context("starting the localhost NodePort proxy")?,
                ),
                false => dp,
            };
            Ok(match metrics {
                Some(m) => Box::new(WithConntrackCleanup::new(
                    NftablesWithMetrics {
                        inner: dp,
                        metrics: m.clone(),
                    },
                    &families,
                    Some(telemetry(m)),
                )),
                None => Box::new(WithConntrackCleanup::new(dp, &families, None)),
            })
        }
        ProxyMode::Ebpf => {
            let c = ebpf_config(cfg, &families)?;
            let dp = EbpfDataplane::new(c, metrics.map(telemetry))
                .context("setting up the eBPF datapath")?;
            Ok(Box::new(dp))
        }
    }
}

/// The metrics as the datapaths see them.
fn telemetry(m: &Metrics) -> std::sync::Arc<dyn crate::dataplane::Telemetry> {
    std::sync::Arc::new(m.clone())
}

/// `kproxy render --proxy-mode MODE`: the kernel state `mode`'s planner gives for `snap`
/// under `cfg` (both IP families; NodePorts of ipvs and nftables on the Node object's addresses).
pub fn render_plan(mode: ProxyMode, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
    let families = [IpFamily::V4, IpFamily::V6];
    // `primary` from the manifests' Node (its addresses as listed, then `bindAddress`).
    let mut first_per_family: Vec<IpAddr> = vec![];
    for ip in &snap.node.addresses {
        if !first_per_family
            .iter()
            .any(|k| IpFamily::of(k) == IpFamily::of(ip))
        {
            first_per_family.push(*ip);
        }
    }
    let bind = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
    let mut with_primary = cfg.clone();
    with_primary.primary_node_ips = super::nodeip::detect_node_ips(&first_per_family, bind).known();
    let cfg = &with_primary;
    let header = |f: IpFamily| match f {
        IpFamily::V4 => "# IPv4\n",
        IpFamily::V6 => "# IPv6\n",
    };
    Ok(match mode {
        ProxyMode::Iptables => iptables_configs(cfg, &families, &snap.node.pod_cidrs)
            .iter()
            .map(|c| format!("{}{}", header(c.family), ipt::render(snap, c)))
            .collect(),
        ProxyMode::Ipvs => {
            let node_ips = |f: IpFamily| -> Vec<IpAddr> {
                snap.node
                    .addresses
                    .iter()
                    .copied()
                    .filter(|ip| f.matches(ip))
                    .collect()
            };
            ipvs_configs(cfg, &families, node_ips, Flavor::Nft, &snap.node.pod_cidrs)
                .iter()
                .map(|c| format!("{}{}", header(c.family), ipvs_mod::render(snap, c)))
                .collect()
        }
        ProxyMode::Nftables => {
            let mut out = String::new();
            for mut c in nftables_configs(cfg, &families, &snap.node.pod_cidrs) {
                // The node's addresses stand for the interfaces' (as ipvs' NodePorts above).
                c.local_addresses = snap.node.addresses.clone();
                out.push_str(header(c.family));
                out.push_str(&nft::render(snap, &c)?);
            }
            out
        }
        ProxyMode::Ebpf => {
            crate::dataplane::ebpf::service_maps::render(snap, &ebpf_config(cfg, &families)?.ebpf)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli;

    fn cfg(args: &[&str]) -> ProxyConfig {
        let mut v = vec!["kproxy"];
        v.extend_from_slice(args);
        let inv = cli::parse(v.into_iter().map(std::ffi::OsString::from)).unwrap();
        cli::load(&inv, Some("n".into())).unwrap().config
    }

    #[test]
    fn iptables_configs_follow_the_proxy_config() {
        let c = cfg(&[
            "--cluster-cidr=10.244.0.0/16,fd00:10::/64",
            "--masquerade-all",
            "--iptables-masquerade-bit=12",
            "--nodeport-addresses=192.0.2.0/24",
        ]);
        let v = iptables_configs(&c, &[IpFamily::V4, IpFamily::V6], &[]);
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[0].local_detector,
            LocalDetector::Cidr("10.244.0.0/16".parse().unwrap())
        );
        assert_eq!(
            v[1].local_detector,
            LocalDetector::Cidr("fd00:10::/64".parse().unwrap())
        );
        assert!(v.iter().all(|c| c.masquerade_all && c.masquerade_bit == 12));
        assert_eq!(
            v[0].node_port_addresses,
            vec!["192.0.2.0/24".parse::<IpNet>().unwrap()]
        );
    }

    #[test]
    fn node_cidr_mode_detects_local_traffic_by_the_nodes_pod_cidrs() {
        let c = cfg(&["--cluster-cidr=10.0.0.0/8", "--detect-local-mode=NodeCIDR"]);
        let pod_cidrs: Vec<IpNet> = vec![
            "10.244.1.0/24".parse().unwrap(),
            "fd00:244:1::/64".parse().unwrap(),
        ];
        let v = iptables_configs(&c, &[IpFamily::V4, IpFamily::V6], &pod_cidrs);
        assert_eq!(v[0].local_detector, LocalDetector::Cidr(pod_cidrs[0]));
        assert_eq!(v[1].local_detector, LocalDetector::Cidr(pod_cidrs[1]));
        // Not known (yet): nothing is local, never the cluster CIDR.
        let v = iptables_configs(&c, &[IpFamily::V4], &[]);
        assert_eq!(v[0].local_detector, LocalDetector::None);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let v = ipvs_configs(&c, &[IpFamily::V4], |_| vec![ip], Flavor::Nft, &pod_cidrs);
        assert_eq!(v[0].cluster_cidr, Some(pod_cidrs[0]));
        let c = cfg(&["--cluster-cidr=10.0.0.0/8"]);
        let v = ipvs_configs(&c, &[IpFamily::V4], |_| vec![ip], Flavor::Nft, &pod_cidrs);
        assert_eq!(v[0].cluster_cidr, Some("10.0.0.0/8".parse().unwrap()));
    }

    #[test]
    fn nftables_configs_follow_the_nftables_section() {
        let c = cfg(&[
            "--cluster-cidr=10.244.0.0/16,fd00:10::/64",
            "--masquerade-all",
        ]);
        let v = nftables_configs(&c, &[IpFamily::V4, IpFamily::V6], &[]);
        assert_eq!(v.len(), 2);
        assert_eq!(
            v[1].local_detector,
            LocalDetector::Cidr("fd00:10::/64".parse().unwrap())
        );
        assert!(v.iter().all(|c| c.masquerade_all && c.masquerade_bit == 14));
        let mut c = cfg(&[]);
        c.nftables.masquerade_bit = 9;
        let v = nftables_configs(&c, &[IpFamily::V4], &[]);
        assert_eq!(
            crate::dataplane::netfilter::node_ports::masquerade_mark(v[0].masquerade_bit),
            "0x200"
        );
        assert!(!v[0].masquerade_all);
    }

    #[test]
    fn node_port_addresses_default_to_the_primary_ips_in_nftables_mode_only() {
        let mut c = cfg(&[]);
        c.primary_node_ips = vec!["192.0.2.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        let primary: Vec<IpNet> = vec![
            "192.0.2.7/32".parse().unwrap(),
            "fd00::7/128".parse().unwrap(),
        ];
        let v = nftables_configs(&c, &[IpFamily::V4], &[]);
        assert_eq!(v[0].node_port_addresses, primary);
        assert_eq!(
            iptables_configs(&c, &[IpFamily::V4], &[])[0].node_port_addresses,
            vec![]
        );
        assert!(node_port_cidrs(&c, ProxyMode::Ipvs).is_empty());
        assert!(node_port_cidrs(&c, ProxyMode::Ebpf).is_empty());
        // `primary` given explicitly applies to every mode.
        let mut p = cfg(&["--nodeport-addresses=primary"]);
        p.primary_node_ips = c.primary_node_ips.clone();
        assert_eq!(node_port_cidrs(&p, ProxyMode::Iptables), primary);
        // Explicit CIDRs (and `all`) win over the nftables default.
        let a = cfg(&["--nodeport-addresses=all"]);
        assert_eq!(
            nftables_configs(&a, &[IpFamily::V4], &[])[0].node_port_addresses,
            vec![
                "0.0.0.0/0".parse::<IpNet>().unwrap(),
                "::/0".parse().unwrap()
            ]
        );
        // The Node's IPs unknown: every local address, as upstream with loopback node IPs.
        let unknown = cfg(&["--proxy-mode=nftables"]);
        assert!(node_port_cidrs(&unknown, ProxyMode::Nftables).is_empty());
    }

    #[test]
    fn render_plan_takes_the_primary_ips_from_the_node() {
        use crate::model::testing::snapshot;
        let mut snap = snapshot("n").build();
        snap.node.addresses = vec!["192.0.2.7".parse().unwrap(), "192.0.2.8".parse().unwrap()];
        let out = render_plan(ProxyMode::Nftables, &cfg(&[]), &snap).unwrap();
        assert!(
            out.contains("add element ip kube-proxy nodeport-ips { 192.0.2.7 }"),
            "{out}"
        );
        assert!(!out.contains("192.0.2.8"), "{out}");
    }

    #[test]
    fn render_plan_prints_both_nftables_tables() {
        use crate::model::testing::{endpoint, service_port, snapshot};
        let snap = snapshot("n")
            .service(
                service_port("ns1", "svc1", "p80")
                    .cluster_ip("172.30.0.41")
                    .build(),
                vec![endpoint("10.180.0.1", 8080).build()],
            )
            .build();
        let out = render_plan(ProxyMode::Nftables, &cfg(&[]), &snap).unwrap();
        assert!(out.starts_with("# IPv4\nadd table ip kube-proxy"), "{out}");
        assert!(out.contains("# IPv6\nadd table ip6 kube-proxy"), "{out}");
        assert!(out.contains("dnat to 10.180.0.1:8080"), "{out}");
    }

    #[test]
    fn ipvs_configs_follow_the_proxy_config() {
        let c = cfg(&[
            "--cluster-cidr=10.244.0.0/16",
            "--ipvs-scheduler=lc",
            "--ipvs-strict-arp",
            "--ipvs-tcp-timeout=10s",
        ]);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let v = ipvs_configs(&c, &[IpFamily::V4], |_| vec![ip], Flavor::Legacy, &[]);
        assert_eq!(v[0].scheduler, "lc");
        assert!(v[0].strict_arp);
        assert_eq!(v[0].timeouts.tcp, 10);
        assert_eq!(v[0].node_ips, vec![ip]);
        assert_eq!(v[0].cluster_cidr, Some("10.244.0.0/16".parse().unwrap()));
        assert_eq!(v[0].iptables_restore, "iptables-legacy-restore");
        assert!(v[0].validate().is_ok());
    }

    #[test]
    fn ebpf_config_maps_sizes_lb_algorithm_and_xdp() {
        let c = cfg(&["--bpf-map-sizes=services=4096,ct=1024", "--bpffs=/tmp/x"]);
        let e = ebpf_config(&c, &[IpFamily::V4]).unwrap();
        assert_eq!(e.ebpf.map_sizes.services, 4096);
        assert_eq!(e.ebpf.map_sizes.ct, 1024);
        assert_eq!(e.ebpf.bpffs, std::path::PathBuf::from("/tmp/x"));
        let c = cfg(&[
            "--bpf-lb-algorithm=maglev",
            "--bpf-lb-maglev-table-size=1021",
            "--bpf-map-sizes=maglev=8",
        ]);
        let e = ebpf_config(&c, &[IpFamily::V4]).unwrap();
        assert_eq!(
            e.ebpf.lb_algorithm,
            crate::dataplane::ebpf::service_maps::LbAlgorithm::Maglev
        );
        assert_eq!(e.ebpf.maglev_table_size, 1021);
        assert_eq!(e.ebpf.map_sizes.maglev, 8);
        let c = cfg(&["--bpf-xdp=native"]);
        let e = ebpf_config(&c, &[IpFamily::V4]).unwrap();
        assert_eq!(e.xdp, crate::config::XdpPolicy::Native);
    }

    #[test]
    fn ebpf_ct_timeouts_follow_upstream_conntrack_and_the_bpf_extension() {
        use std::time::Duration;
        let mut c = cfg(&["--conntrack-tcp-timeout-close-wait=30m"]);
        c.bpf.ct_tcp_time_wait = Duration::from_secs(7);
        c.bpf.ct_tcp_close = Duration::from_secs(3);
        c.bpf.ct_expiry_interval = Duration::from_secs(2);
        let t = ebpf_config(&c, &[IpFamily::V4]).unwrap().ct_timeouts;
        // Half-closed: upstream's close-wait flag; fully closed / reset: the extension.
        assert_eq!(t.tcp_closing, Duration::from_secs(1800));
        assert_eq!(t.tcp, Duration::from_secs(86_400));
        assert_eq!(t.tcp_time_wait, Duration::from_secs(7));
        assert_eq!(t.tcp_close, Duration::from_secs(3));
        assert_eq!(t.interval, Duration::from_secs(2));
    }
}
