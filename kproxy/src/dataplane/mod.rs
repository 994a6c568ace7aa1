//! Datapaths: one trait, one implementation per proxy mode.
//!
//! A datapath receives a complete, immutable [`Snapshot`] on every sync plus the set of
//! service ports that changed since the previous one, and makes the kernel match it. Each
//! implementation is a pure planner (snapshot → exact kernel objects, tested without root)
//! plus a thin applier that diffs against the kernel.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

use crate::model::{ChangedSet, Snapshot};

pub mod detect;
pub mod ebpf;
pub mod ebpf_cgroup;
pub mod ebpf_mode;
pub mod ebpf_tc;
pub mod factory;
pub mod iptables;
pub mod ipvs;
pub mod nftables;
pub mod with_conntrack;

/// The proxy modes kproxy knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProxyMode {
    Ebpf,
    Ipvs,
    Iptables,
}

impl ProxyMode {
    pub const ALL: [ProxyMode; 3] = [ProxyMode::Ebpf, ProxyMode::Ipvs, ProxyMode::Iptables];
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyMode::Ebpf => "ebpf",
            ProxyMode::Ipvs => "ipvs",
            ProxyMode::Iptables => "iptables",
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
            other => Err(format!(
                "unknown proxy mode {other:?}: expected \"\" (detect), \"ebpf\", \"ipvs\" or \"iptables\""
            )),
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
