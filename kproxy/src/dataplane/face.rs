//! [`ModeFace`]: everything the composition root needs from a proxy mode, behind one trait —
//! whether it can run here, building its [`Dataplane`] from the resolved configuration, the
//! evidence and removal of its kernel state, its `kproxy inspect` reader and `render` output,
//! its sync periods and the metrics it reports.
//!
//! Each mode implements it once, in `dataplane/<mode>/face.rs`; `app::registry` lists the
//! faces (detection order, which mode a name means) and knows no mode's internals. A face may
//! read [`ProxyConfig`] (it maps the configuration onto its datapath's own config types); the
//! datapath behind it may not, so it stays testable from a plain config struct.
//!
//! The helpers below are what several faces share: the host's IP families, the local-traffic
//! detector, the NodePort CIDRs, cleanup bookkeeping.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use tracing::{info, warn};

use crate::config::{NodePortAddresses, ProxyConfig, SyncPeriods};
use crate::dataplane::inspect::{MapFill, Selected, ServiceReport};
use crate::dataplane::netfilter::local_detect::{LocalDetector, detectors};
use crate::dataplane::{Dataplane, ModeMetrics, ProxyMode, Telemetry};
use crate::model::{IpFamily, Snapshot};

/// Called by a datapath that needs a sync without a service change (the iptables canary
/// monitor after an external flush); the agent wires it to the sync loop.
pub(crate) type ResyncHook = Arc<dyn Fn() + Send + Sync>;

/// What building a datapath takes besides the configuration.
pub(crate) struct BuildContext<'a> {
    pub cfg: &'a ProxyConfig,
    /// The families the host can program ([`host_families`]).
    pub families: &'a [IpFamily],
    /// The Node's `spec.podCIDRs` (what `detectLocalMode: NodeCIDR` detects local traffic by).
    pub node_pod_cidrs: &'a [IpNet],
    pub telemetry: Option<Arc<dyn Telemetry>>,
    pub resync: Option<ResyncHook>,
}

/// One proxy mode, as the composition root sees it.
pub(crate) trait ModeFace: Sync {
    fn mode(&self) -> ProxyMode;

    /// Whether the mode can run here (`mode: ""` tries them in the registry's order); `Err`
    /// says why not. Removes whatever it created to find out.
    fn probe(&self, cfg: &ProxyConfig) -> Result<(), String>;

    /// The mode's datapath. Conntrack sysctls and cleanup are not its job: the registry adds
    /// them when [`Self::netfilter_conntrack`] says so.
    fn build(&self, cx: &BuildContext<'_>) -> anyhow::Result<Box<dyn Dataplane>>;

    /// Whether the datapath DNATs through netfilter conntrack (the registry then applies
    /// `conntrack:`'s sysctls and deletes stale UDP entries after each sync).
    fn netfilter_conntrack(&self) -> bool;

    /// The mode-specific metric families the mode reports.
    fn metrics(&self) -> ModeMetrics;

    /// The mode's `syncPeriod` / `minSyncPeriod`.
    fn sync_periods(&self, cfg: &ProxyConfig) -> SyncPeriods;

    /// `nodePortAddresses` as the mode runs it (an unset list keeps "every local address"
    /// unless the mode defaults it otherwise).
    fn node_port_addresses(&self, cfg: &ProxyConfig) -> NodePortAddresses {
        cfg.node_port_addresses.clone()
    }

    /// The CIDRs NodePorts are accepted in (empty: every local address), `primary` as the
    /// node's primary IPs found at start-up ([`ProxyConfig::primary_node_ips`]).
    fn node_port_cidrs(&self, cfg: &ProxyConfig) -> Vec<IpNet> {
        match self.node_port_addresses(cfg) {
            NodePortAddresses::Unset => vec![],
            NodePortAddresses::Cidrs(c) => c,
            NodePortAddresses::Primary => NodePortAddresses::primary_cidrs(&cfg.primary_node_ips),
        }
    }

    /// Logged when the mode is chosen (upstream's deprecation of ipvs).
    fn start_notice(&self) {}

    /// The feature gates only this mode implements (the registry says when one is on but
    /// another mode runs).
    fn feature_gates(&self) -> &'static [&'static str] {
        &[]
    }

    /// What the mode's planner programs for `snap` (`kproxy render --proxy-mode`), both
    /// families, each after a `# IPv4` / `# IPv6` header where the mode plans per family.
    fn render(&self, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String>;

    /// Whether the mode's datapath is programmed here (`kproxy inspect` without a mode).
    fn programmed_here(&self, cfg: &ProxyConfig) -> bool;

    /// Whether the mode keeps rules in the iptables chains `KUBE-SERVICES`, `KUBE-MARK-MASQ`, …
    /// (the iptables and ipvs modes share them).
    fn uses_kube_chains(&self) -> bool {
        false
    }

    /// Whether `running`'s start-up must remove this mode's leftovers (never asked for the
    /// running mode itself).
    fn has_leftovers(&self, cfg: &ProxyConfig, running: &dyn ModeFace) -> bool;

    /// Before any mode's leftovers are removed: drop the references other modes' removal
    /// would trip over (the ipvs mode's jumps into chains the iptables mode removes).
    fn unhook(&self) {}

    /// Removes the mode's kernel state (and upstream kube-proxy's of the same mode); each
    /// failed step is logged and added to `errors`.
    fn remove_leftovers(&self, cfg: &ProxyConfig, errors: &mut Vec<String>);

    /// Fills `reports` (one per `selected` port) with what the kernel holds for each, and
    /// `maps` with the fill of the mode's maps where it has any.
    fn inspect(
        &self,
        cfg: &ProxyConfig,
        snap: &Snapshot,
        selected: &Selected<'_>,
        reports: &mut [ServiceReport],
        maps: &mut Vec<MapFill>,
    ) -> anyhow::Result<()>;
}

/// The IP families this host can program: IPv4, and IPv6 unless the kernel has it disabled.
pub(crate) fn host_families() -> Vec<IpFamily> {
    let v6 = std::fs::read_to_string("/proc/sys/net/ipv6/conf/all/disable_ipv6")
        .map(|s| s.trim() == "0")
        .unwrap_or(false);
    if v6 {
        vec![IpFamily::V4, IpFamily::V6]
    } else {
        vec![IpFamily::V4]
    }
}

/// The first CIDR of `family` in `cidrs`.
pub(crate) fn first_of(cidrs: &[IpNet], family: IpFamily) -> Option<IpNet> {
    cidrs.iter().copied().find(|c| family.matches(&c.addr()))
}

/// The local-traffic detector of `family` ([`detectors`]); `node_pod_cidrs` are the Node's
/// `spec.podCIDRs` (used by NodeCIDR only).
pub(crate) fn local_detector(
    cfg: &ProxyConfig,
    family: IpFamily,
    node_pod_cidrs: &[IpNet],
) -> LocalDetector {
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

/// `bindAddress` as a netfilter proxier's node IP of `family` (unset or another family: none).
pub(crate) fn bind_node_ip(cfg: &ProxyConfig, family: IpFamily) -> Option<IpAddr> {
    (!cfg.bind_address.is_unspecified() && family.matches(&cfg.bind_address))
        .then_some(cfg.bind_address)
}

/// The `# IPv4` / `# IPv6` header of a family's part of `render`'s output.
pub(crate) fn render_header(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "# IPv4\n",
        IpFamily::V6 => "# IPv6\n",
    }
}

/// One cleanup step's outcome, logged and collected for `kproxy cleanup`'s error.
pub(crate) fn cleanup_step(errors: &mut Vec<String>, what: &str, r: Result<(), String>) {
    match r {
        Ok(()) => tracing::debug!("cleanup: {what} done"),
        Err(e) => {
            warn!("cleanup: {what}: {e}");
            errors.push(format!("{what}: {e}"));
        }
    }
}

/// Whether `bin --version` runs.
pub(crate) fn have(bin: &str) -> bool {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}
