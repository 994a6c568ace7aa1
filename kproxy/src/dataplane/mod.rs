//! Datapaths: one trait, one implementation per proxy mode.
//!
//! A datapath receives a complete, immutable [`Snapshot`] on every sync plus the set of
//! service ports that changed since the previous one, and makes the kernel match it. Each
//! implementation is a pure planner (snapshot → exact kernel objects, tested without root)
//! plus a thin applier that diffs against the kernel.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::model::{ChangedSet, IpFamily, Snapshot};

pub mod ebpf;
pub(crate) mod face;
pub(crate) mod inspect;
pub mod iptables;
pub mod ipvs;
pub mod netfilter;
pub mod nftables;
pub(crate) mod per_family;
pub(crate) mod settings;

/// The proxy modes kproxy knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyMode {
    Ebpf,
    Ipvs,
    Iptables,
    Nftables,
}

impl ProxyMode {
    pub const ALL: [ProxyMode; 4] = [
        ProxyMode::Ebpf,
        ProxyMode::Ipvs,
        ProxyMode::Iptables,
        ProxyMode::Nftables,
    ];
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Iptables => "iptables",
            ProxyMode::Nftables => "nftables",
        }
    }
}

impl fmt::Display for ProxyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ProxyMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ebpf" => Ok(ProxyMode::Ebpf),
            "ipvs" => Ok(ProxyMode::Ipvs),
            "iptables" => Ok(ProxyMode::Iptables),
            "nftables" => Ok(ProxyMode::Nftables),
            other => Err(format!(
                "unknown proxy mode {other:?}: expected \"\" (detect), \"ebpf\", \"nftables\", \"ipvs\" or \"iptables\""
            )),
        }
    }
}

/// Which of the mode-specific metric families a mode reports, beside those every mode has
/// (upstream registers some families only in some modes). Each mode's face says
/// ([`face::ModeFace::metrics`]); `observe::metrics::Metrics` registers accordingly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ModeMetrics {
    pub mode: ProxyMode,
    /// `kubeproxy_sync_proxy_rules_iptables_restore_failures_total` (iptables and ipvs).
    pub iptables_restore: bool,
    /// The iptables proxier's sync durations, rule gauges and nfacct counters.
    pub iptables_sync: bool,
    /// The nftables proxier's sync durations and failure counters.
    pub nftables_sync: bool,
    /// The eBPF datapath's series (`kproxy_bpf_skipped_service_ports{protocol="SCTP"}` from
    /// the start).
    pub bpf: bool,
}

impl ModeMetrics {
    /// Only the metrics every mode has.
    pub(crate) const fn generic(mode: ProxyMode) -> Self {
        ModeMetrics {
            mode,
            iptables_restore: false,
            iptables_sync: false,
            nftables_sync: false,
            bpf: false,
        }
    }
}

/// What one successful sync did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SyncReport {
    /// Service ports programmed after this sync.
    pub services: usize,
    /// Endpoints programmed after this sync.
    pub endpoints: usize,
    /// Service ports that could not be programmed (each named in the log), the rest was.
    pub failed_services: usize,
}

impl SyncReport {
    /// A complete sync of the service ports that have a ClusterIP in one of `families`, with
    /// `endpoints` programmed.
    pub(crate) fn of_families(snap: &Snapshot, families: &[IpFamily], endpoints: usize) -> Self {
        let services = snap
            .services
            .values()
            .filter(|s| families.iter().any(|f| s.cluster_ip(*f).is_some()))
            .count();
        SyncReport {
            services,
            endpoints,
            failed_services: 0,
        }
    }
}

/// A sync that did not complete; the runner retries it with backoff.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("{0}")]
    Kernel(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Removing a datapath's kernel state failed.
#[derive(Debug, thiserror::Error)]
#[error("cleanup of {mode} datapath: {reason}")]
pub struct CleanupError {
    pub mode: ProxyMode,
    pub reason: String,
}

/// What a datapath reports beyond its [`SyncReport`]: kernel-side gauges and counters that
/// observers turn into metrics. Datapaths hold an `Arc<dyn Telemetry>` and never import
/// `observe` (`observe::metrics::Metrics` implements this).
pub trait Telemetry: Send + Sync {
    /// Fill of one BPF map (`kproxy_bpf_map_entries` / `kproxy_bpf_map_capacity`).
    fn bpf_map(&self, map: &str, entries: i64, capacity: i64);
    /// Service ports of `protocol` the datapath cannot translate.
    fn skipped_service_ports(&self, protocol: &str, count: i64);
    /// The node path's running count of new flows dropped for want of a SNAT port.
    fn snat_failures(&self, total: u64);
    /// One conntrack cleanup of `family`: entries deleted and how long it took.
    fn conntrack_cleanup(&self, family: IpFamily, deleted: u64, seconds: f64);
    /// A netfilter proxier's sync of `family` (full or partial) finished, taking `seconds`.
    fn proxier_sync(&self, family: IpFamily, full: bool, seconds: f64) {
        let _ = (family, full, seconds);
    }
    /// A netfilter proxier's sync of `family` failed (nftables: a rejected transaction).
    fn proxier_sync_failed(&self, family: IpFamily) {
        let _ = family;
    }
    /// An `iptables-restore` of `family` failed (`partial`: a partial restore).
    fn restore_failed(&self, family: IpFamily, partial: bool) {
        let _ = (family, partial);
    }
    /// Rules the last sync of `family` wrote into the nat table.
    fn nat_rules_last(&self, family: IpFamily, rules: u64) {
        let _ = (family, rules);
    }
    /// Removing a stale nftables chain of `family` failed.
    fn stale_chain_cleanup_failed(&self, family: IpFamily) {
        let _ = family;
    }
}

/// One datapath. `sync` is called from one thread at a time with successive snapshots.
pub trait Dataplane: Send {
    fn mode(&self) -> ProxyMode;
    /// Makes the kernel match `snap`. `changed` names the service ports that differ from the
    /// previous call; an implementation may use it for partial syncs but must be correct when
    /// it treats every sync as full.
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError>;
    /// Removes everything this datapath put into the kernel.
    fn cleanup(&mut self) -> Result<(), CleanupError>;
}

/// A boxed datapath is one (the registry wraps a face's boxed datapath for conntrack cleanup).
impl<D: Dataplane + ?Sized> Dataplane for Box<D> {
    fn mode(&self) -> ProxyMode {
        (**self).mode()
    }
    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        (**self).sync(snap, changed)
    }
    fn cleanup(&mut self) -> Result<(), CleanupError> {
        (**self).cleanup()
    }
}
