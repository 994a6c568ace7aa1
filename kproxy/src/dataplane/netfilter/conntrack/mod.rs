//! Conntrack cleanup after a sync, for the iptables and IPVS datapaths (and any datapath that
//! DNATs through netfilter conntrack).
//!
//! # Why
//!
//! UDP has no connection end: once conntrack has recorded "client:port → ClusterIP:port was
//! DNATed to endpoint A", every later packet of that flow goes to A, even after A was removed
//! from the service, until the entry times out (which it never does while the client keeps
//! sending). Upstream kube-proxy therefore deletes, after each successful sync that changed a
//! UDP service's endpoints, the UDP entries whose DNAT target is no longer a serving endpoint.
//! The next packet then creates a new entry through the current rules.
//!
//! # Use
//!
//! ```no_run
//! # use kproxy::model::{ChangedSet, IpFamily, Snapshot};
//! # fn sync(prev: &Snapshot, next: &Snapshot, changed: &ChangedSet) {
//! let mut cleaner = kproxy::dataplane::netfilter::conntrack::Cleaner::new(IpFamily::V4);
//! // … after the ruleset for `next` was applied successfully:
//! match cleaner.after_sync(prev, next, changed) {
//!     Ok(stats) => tracing::debug!(?stats, "conntrack cleanup"),
//!     Err(err) => tracing::warn!(%err, "conntrack cleanup failed"),
//! }
//! # }
//! ```
//!
//! One [`Cleaner`] per IP family (like upstream's one proxier per family). Call
//! [`Cleaner::after_sync`] only after the datapath applied `next` successfully (never after a
//! failed sync: the old rules would still be in place). It runs in the calling thread's
//! network namespace: its netlink socket is opened on first use (and again after a socket
//! error) and stays in the namespace of the thread that opened it.
//! Errors are for logging: a failed cleanup must never fail the sync.
//!
//! # Parts
//!
//! - `stale`: the pure decision (when to clean, which entries are stale), upstream's
//!   algorithm and the places kproxy knowingly differs.
//! - [`netlink`]: ctnetlink dump and delete; encoding and decoding as pure functions.
//! - `entry`: the entry type both share.

pub(crate) mod entry;
pub mod netlink;
pub(crate) mod stale;

use std::io;
use std::time::Instant;

use serde::Serialize;

use crate::model::{ChangedSet, IpFamily, Snapshot};

pub use entry::{Entry, Tuple};
pub use stale::{StaleFilters, advance_endpoints, cleanup_required};

/// What one cleanup did (upstream's metrics: `kubeproxy_conntrack_reconciler_sync_duration_seconds`
/// is `duration`, `kubeproxy_conntrack_reconciler_deleted_entries_total` grows by `deleted`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CleanupStats {
    /// False when no cleanup was needed (no UDP service's endpoints changed); all counts are
    /// then 0.
    pub ran: bool,
    /// Entries of the family in the table dump.
    pub listed: usize,
    /// The dump was interrupted by table changes; the partial list was used (as upstream).
    pub dump_interrupted: bool,
    /// Entries found stale.
    pub stale: usize,
    /// Stale entries the kernel deleted.
    pub deleted: usize,
    /// Stale entries that were gone before the delete reached them.
    pub already_gone: usize,
    /// Time spent dumping, deciding and deleting.
    pub duration: std::time::Duration,
}

/// A cleanup that failed (for the log; the sync itself is not affected).
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    #[error("opening a ctnetlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("dumping the {family:?} conntrack table: {source}")]
    Dump {
        family: IpFamily,
        #[source]
        source: io::Error,
    },
    #[error("deleting stale conntrack entries: {source} ({deleted} deleted before the error)")]
    Send {
        deleted: usize,
        #[source]
        source: io::Error,
    },
    /// Some entries could not be deleted; the others were.
    #[error(
        "{failed} of {stale} stale conntrack entries could not be deleted ({deleted} deleted); first: {first_entry}: {first_error}"
    )]
    Delete {
        stale: usize,
        deleted: usize,
        failed: usize,
        first_entry: Box<Entry>,
        first_error: io::Error,
        /// The complete statistics of the run.
        stats: CleanupStats,
    },
}

/// Deletes the stale UDP conntrack entries of one IP family after a sync.
#[derive(Debug)]
pub struct Cleaner {
    family: IpFamily,
    socket: Option<netlink::Socket>,
}

impl Cleaner {
    pub fn new(family: IpFamily) -> Cleaner {
        Cleaner {
            family,
            socket: None,
        }
    }

    pub(crate) fn family(&self) -> IpFamily {
        self.family
    }

    /// Upstream's end-of-sync step: if a UDP service's endpoints changed between `prev` and
    /// `next` ([`cleanup_required`]), deletes the entries [`StaleFilters`] built from `next`
    /// finds stale.
    ///
    /// `prev` is the snapshot of the previous *successful* sync (an empty one at startup, so
    /// the first sync cleans whatever a previous proxy left); `changed` must name every
    /// service port changed since then (the sync runner carries the changes of failed syncs
    /// over, so its `changed` is right as is).
    pub fn after_sync(
        &mut self,
        prev: &Snapshot,
        next: &Snapshot,
        changed: &ChangedSet,
    ) -> Result<CleanupStats, ConntrackError> {
        if !cleanup_required(prev, next, changed, self.family) {
            return Ok(CleanupStats::default());
        }
        self.reconcile(next)
    }

    /// Dumps the table and deletes every entry that is stale for `snap`, unconditionally.
    pub fn reconcile(&mut self, snap: &Snapshot) -> Result<CleanupStats, ConntrackError> {
        let start = Instant::now();
        let mut stats = CleanupStats {
            ran: true,
            ..Default::default()
        };
        let filters = StaleFilters::build(snap, self.family);
        if filters.is_empty() {
            // Nothing can be stale: skip the dump (upstream dumps anyway and deletes nothing).
            stats.duration = start.elapsed();
            return Ok(stats);
        }
        let family = self.family;
        let mut stale: Vec<Entry> = vec![];
        let dump = self.socket()?.dump_each(family, |e| {
            if filters.is_stale(&e) {
                stale.push(e);
            }
        });
        let (listed, interrupted) = match dump {
            Ok(d) => d,
            Err(source) => {
                self.socket = None;
                return Err(ConntrackError::Dump { family, source });
            }
        };
        stats.listed = listed;
        stats.dump_interrupted = interrupted;
        if interrupted {
            tracing::info!(
                ?family,
                "conntrack dump interrupted by table changes; using the partial list"
            );
        }
        stats.stale = stale.len();
        for e in &stale {
            tracing::debug!(entry = %e, "deleting stale conntrack entry");
        }
        let outcome = self.socket()?.delete(&stale);
        stats.deleted = outcome.deleted;
        stats.already_gone = outcome.already_gone;
        stats.duration = start.elapsed();
        if let Some(source) = outcome.aborted {
            self.socket = None;
            return Err(ConntrackError::Send {
                deleted: stats.deleted,
                source,
            });
        }
        if let Some((first_entry, first_error)) = outcome.failed.into_iter().next() {
            return Err(ConntrackError::Delete {
                stale: stats.stale,
                deleted: stats.deleted,
                failed: stats.stale - stats.deleted - stats.already_gone,
                first_entry: Box::new(first_entry),
                first_error,
                stats,
            });
        }
        tracing::debug!(?family, ?stats, "conntrack cleanup done");
        Ok(stats)
    }

    fn socket(&mut self) -> Result<&mut netlink::Socket, ConntrackError> {
        if self.socket.is_none() {
            self.socket = Some(netlink::Socket::open().map_err(ConntrackError::Socket)?);
        }
        Ok(self.socket.as_mut().expect("just set"))
    }
}

/// Dumps the conntrack table of `family` in the calling thread's network namespace (a
/// convenience for tests and debugging tools).
pub fn list(family: IpFamily) -> Result<netlink::Dump, ConntrackError> {
    netlink::Socket::open()
        .map_err(ConntrackError::Socket)?
        .dump(family)
        .map_err(|source| ConntrackError::Dump { family, source })
}
