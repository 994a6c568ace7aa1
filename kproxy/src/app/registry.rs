//! The mode registry: which proxy modes exist (`face`, the only place that names each
//! mode's `ModeFace`), the order `mode: ""` tries them in (`DETECT_ORDER`), and what the
//! agent, `render`, `inspect` and `cleanup` do with them — through the faces only; no mode's
//! internals are known here.
//!
//! - `select`: the forced mode, or the first of `DETECT_ORDER` whose probe passes and
//!   that builds (logging why each earlier one was rejected).
//! - [`build`]: a face's datapath plus what every netfilter-conntrack mode gets from here, in
//!   this one place: `conntrack:`'s sysctls and the stale-UDP-entry cleanup after each sync
//!   ([`WithConntrackCleanup`]).
//! - `cleanup_others` (start-up, upstream's `CleanupLeftovers`) and [`cleanup_all`]
//!   (`kproxy cleanup`): each face says whether its leftovers are here and removes them.
//!
//! Knowingly different from upstream: a conntrack sysctl that cannot be written is logged as a
//! warning instead of failing start-up (inside a network namespace most of them are
//! read-only).

use std::sync::Arc;

use anyhow::{Context, bail};
use ipnet::IpNet;
use tracing::{info, warn};

use crate::config::{ModeChoice, NodePortAddresses, ProxyConfig};
use crate::dataplane::face::{BuildContext, ModeFace, host_families};
use crate::dataplane::netfilter::with_conntrack::WithConntrackCleanup;
use crate::dataplane::{Dataplane, ProxyMode, Telemetry};
use crate::model::Snapshot;
use crate::observe::metrics::Metrics;
use crate::sync::{RunnerConfig, SyncRequester};

/// The face of `mode`.
pub(crate) fn face(mode: ProxyMode) -> &'static dyn ModeFace {
    match mode {
        ProxyMode::Ebpf => &crate::dataplane::ebpf::face::Face,
        ProxyMode::Nftables => &crate::dataplane::nftables::face::Face,
        ProxyMode::Ipvs => &crate::dataplane::ipvs::face::Face,
        ProxyMode::Iptables => &crate::dataplane::iptables::face::Face,
    }
}

/// The order `mode: ""` tries the modes in (upstream's empty mode means iptables; kproxy
/// prefers its eBPF datapath, then nftables, upstream's recommended mode).
pub(crate) const DETECT_ORDER: [ProxyMode; 4] = [
    ProxyMode::Ebpf,
    ProxyMode::Nftables,
    ProxyMode::Ipvs,
    ProxyMode::Iptables,
];

/// The order `kproxy inspect` looks for a programmed datapath in: pins, then `kube-ipvs0`
/// or its ipsets, then the iptables chains (the ipvs mode has `KUBE-SERVICES` too), then a
/// `kube-proxy` nftables table.
const INSPECT_ORDER: [ProxyMode; 4] = [
    ProxyMode::Ebpf,
    ProxyMode::Ipvs,
    ProxyMode::Iptables,
    ProxyMode::Nftables,
];

/// The order leftovers are removed in (after every selected mode's [`ModeFace::unhook`]):
/// the iptables mode's chains before the ipvs mode's, which shares some of them.
const REMOVAL_ORDER: [ProxyMode; 4] = [
    ProxyMode::Ebpf,
    ProxyMode::Iptables,
    ProxyMode::Ipvs,
    ProxyMode::Nftables,
];

/// The metrics of a proxy running `mode`.
pub fn metrics(mode: ProxyMode) -> Metrics {
    Metrics::new(face(mode).metrics())
}

/// The sync runner's timing for `mode`.
pub(crate) fn runner_config(cfg: &ProxyConfig, mode: ProxyMode) -> RunnerConfig {
    face(mode).sync_periods(cfg).runner()
}

/// The CIDRs NodePorts are accepted in when `mode` runs (empty: every local address).
pub(crate) fn node_port_cidrs(cfg: &ProxyConfig, mode: ProxyMode) -> Vec<IpNet> {
    face(mode).node_port_cidrs(cfg)
}

/// Whether `mode` runs `nodePortAddresses: primary` (its node IPs then matter).
pub(crate) fn runs_primary(cfg: &ProxyConfig, mode: ProxyMode) -> bool {
    face(mode).node_port_addresses(cfg) == NodePortAddresses::Primary
}

/// Whether the configured mode may run with `primary` (so the node's primary IPs are needed
/// before the datapath is built): the forced mode does, or, detecting, any mode would.
pub(crate) fn may_run_primary(cfg: &ProxyConfig) -> bool {
    match cfg.mode {
        ModeChoice::Forced(mode) => runs_primary(cfg, mode),
        ModeChoice::Detect => DETECT_ORDER.iter().any(|m| runs_primary(cfg, *m)),
    }
}

/// Whether `mode` can run here; `Err` says why not.
pub(crate) fn probe(mode: ProxyMode, cfg: &ProxyConfig) -> Result<(), String> {
    face(mode).probe(cfg)
}

/// Builds the forced mode, or the first mode of [`DETECT_ORDER`] whose probe passes and that
/// builds; logs why each earlier mode was rejected. Removes what the other modes (and
/// upstream kube-proxy) left ([`build_cleaned`]). Returns the datapath and the metrics it
/// reports into; the datapath asks `resync` for syncs it needs on its own (hand it to the
/// sync loop too). `node_pod_cidrs` as for [`build`].
pub(crate) fn select(
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    resync: &SyncRequester,
) -> anyhow::Result<(Box<dyn Dataplane>, Metrics)> {
    let attempt = |mode: ProxyMode| -> anyhow::Result<(Box<dyn Dataplane>, Metrics)> {
        let metrics = metrics(mode);
        let dp = build_cleaned(mode, cfg, node_pod_cidrs, &metrics, resync)?;
        Ok((dp, metrics))
    };
    match cfg.mode {
        ModeChoice::Forced(mode) => attempt(mode).with_context(|| format!("--proxy-mode={mode}")),
        ModeChoice::Detect => {
            let mut reasons = Vec::new();
            for mode in DETECT_ORDER {
                if let Err(why) = probe(mode, cfg) {
                    warn!(%mode, "proxy mode rejected: {why}");
                    reasons.push(format!("{mode}: {why}"));
                    continue;
                }
                match attempt(mode) {
                    Ok(r) => {
                        info!(%mode, "proxy mode detected");
                        return Ok(r);
                    }
                    Err(e) => {
                        warn!(%mode, "proxy mode rejected: {e:#}");
                        reasons.push(format!("{mode}: {e:#}"));
                    }
                }
            }
            bail!("no proxy mode can run here ({})", reasons.join("; "))
        }
    }
}

/// Builds `mode`'s datapath, reporting into `metrics`, after removing what the other modes
/// left ([`cleanup_others`], as upstream's `CleanupLeftovers` before its proxier is built).
pub(crate) fn build_cleaned(
    mode: ProxyMode,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    metrics: &Metrics,
    resync: &SyncRequester,
) -> anyhow::Result<Box<dyn Dataplane>> {
    face(mode).start_notice();
    cleanup_others(mode, cfg);
    build(mode, cfg, node_pod_cidrs, Some(metrics), Some(resync))
}

/// Constructs the datapath of `mode`, reporting into `metrics`; fails with a clear message
/// when the mode cannot run here. `node_pod_cidrs`: the Node's `spec.podCIDRs` (what
/// `detectLocalMode: NodeCIDR` detects local traffic by; the agent waits for them before it
/// builds, as upstream waits before starting its proxier). `resync`, for the agent: the sync
/// loop's requester, which the datapath calls when it needs a sync without a service change.
pub fn build(
    mode: ProxyMode,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    metrics: Option<&Metrics>,
    resync: Option<&SyncRequester>,
) -> anyhow::Result<Box<dyn Dataplane>> {
    let face = face(mode);
    warn_foreign_feature_gates(face, cfg);
    let families = host_families();
    let telemetry = metrics.map(|m| Arc::new(m.clone()) as Arc<dyn Telemetry>);
    if face.netfilter_conntrack() {
        apply_conntrack_sysctls(cfg);
    }
    let dp = face.build(&BuildContext {
        cfg,
        families: &families,
        node_pod_cidrs,
        telemetry: telemetry.clone(),
        resync: resync
            .cloned()
            .map(|r| Arc::new(move || r.request()) as crate::dataplane::face::ResyncHook),
    })?;
    Ok(if face.netfilter_conntrack() {
        Box::new(WithConntrackCleanup::new(dp, &families, telemetry))
    } else {
        dp
    })
}

/// Logs a feature gate that is on but belongs to another mode than the one running.
fn warn_foreign_feature_gates(running: &dyn ModeFace, cfg: &ProxyConfig) {
    for other in DETECT_ORDER.map(face) {
        for gate in other.feature_gates() {
            if cfg.feature(gate) && !running.feature_gates().contains(gate) {
                info!(
                    "feature gate {gate} applies to {} mode only; {} mode ignores it",
                    other.mode(),
                    running.mode()
                );
            }
        }
    }
}

/// Sets the `conntrack:` sysctls (modes that DNAT through netfilter conntrack). Failures are
/// warnings (see the module docs).
fn apply_conntrack_sysctls(cfg: &ProxyConfig) {
    let sc = super::sysctl::SysctlConfig {
        conntrack: cfg.conntrack.clone(),
        // The iptables datapath sets route_localnet itself when it needs it.
        localhost_node_ports: false,
    };
    let report = super::sysctl::apply(&sc, &super::sysctl::Host::real());
    for e in &report.errors {
        warn!("conntrack sysctl not applied: {e}");
    }
}

/// `kproxy render --proxy-mode MODE`: the kernel state `mode`'s planner gives for `snap`
/// under `cfg` (both IP families; `primary` NodePort addresses from the manifests' Node: its
/// addresses as listed, then `bindAddress`).
pub fn render_plan(mode: ProxyMode, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
    let mut first_per_family: Vec<std::net::IpAddr> = vec![];
    for ip in &snap.node.addresses {
        if !first_per_family
            .iter()
            .any(|k| crate::model::IpFamily::of(k) == crate::model::IpFamily::of(ip))
        {
            first_per_family.push(*ip);
        }
    }
    let bind = (!cfg.bind_address.is_unspecified()).then_some(cfg.bind_address);
    let mut with_primary = cfg.clone();
    with_primary.primary_node_ips = super::nodeip::detect_node_ips(&first_per_family, bind).known();
    face(mode).render(&with_primary, snap)
}

/// The mode whose datapath is programmed here ([`INSPECT_ORDER`]), if any.
pub(crate) fn programmed_mode(cfg: &ProxyConfig) -> Option<ProxyMode> {
    INSPECT_ORDER
        .into_iter()
        .find(|m| face(*m).programmed_here(cfg))
}

/// Removes what the modes other than `mode` (and upstream kube-proxy) left, as upstream's
/// `CleanupLeftovers` at start-up, where each face says its leftovers are here
/// ([`ModeFace::has_leftovers`]): the iptables and ipvs modes share chain names, so one of
/// them removes the other's rules only when that mode's own objects show it ran, and a restart
/// in the same mode never flushes live rules; the IPVS mode's leftovers only where its device
/// or ipsets exist (IPVS may serve something else on the host). Failures are logged; they
/// never stop the start.
pub(crate) fn cleanup_others(mode: ProxyMode, cfg: &ProxyConfig) {
    let running = face(mode);
    let others: Vec<&dyn ModeFace> = REMOVAL_ORDER
        .into_iter()
        .filter(|m| *m != mode)
        .map(face)
        .filter(|f| f.has_leftovers(cfg, running))
        .collect();
    if !others.is_empty() {
        let names: Vec<String> = others.iter().map(|f| f.mode().to_string()).collect();
        info!(%mode, "removing the leftovers of other modes: {}", names.join(", "));
    }
    remove(&others, cfg);
}

/// Unhooks every one of `faces`, then removes their leftovers in [`REMOVAL_ORDER`]; returns
/// the failed steps.
fn remove(faces: &[&dyn ModeFace], cfg: &ProxyConfig) -> Vec<String> {
    let mut errors = vec![];
    for f in faces {
        f.unhook();
    }
    for f in faces {
        f.remove_leftovers(cfg, &mut errors);
    }
    errors
}

/// Removes everything any mode (and upstream kube-proxy) left in the kernel: eBPF pins
/// (maps, socket-LB and TC links), iptables rules of both backends and families, upstream's
/// `kube-proxy` nftables tables, IPVS virtual services, `kube-ipvs0`, the IPVS mode's ipsets
/// and rules. Every step runs; the error lists the ones that failed.
pub fn cleanup_all(cfg: &ProxyConfig) -> anyhow::Result<()> {
    let errors = remove(&REMOVAL_ORDER.map(face), cfg);
    if errors.is_empty() {
        info!("cleanup: removed what every mode and kube-proxy left");
        Ok(())
    } else {
        bail!("cleanup incomplete: {}", errors.join("; "))
    }
}

#[cfg(test)]
mod tests;
