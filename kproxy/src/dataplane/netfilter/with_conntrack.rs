//! [`WithConntrackCleanup`]: wraps a datapath that DNATs through netfilter conntrack (iptables,
//! IPVS) and runs upstream's end-of-sync step: after every *successful* sync, the stale UDP
//! conntrack entries of each IP family are deleted ([`Cleaner`]).
//!
//! A failed cleanup is logged and never fails the sync (as upstream). Deleted entries and the
//! cleanup's duration go to `kubeproxy_conntrack_reconciler_*`.

use std::sync::Arc;

use super::conntrack::{Cleaner, advance_endpoints};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport, Telemetry};
use crate::model::{ChangedSet, IpFamily, Snapshot};

/// A datapath plus conntrack cleanup after its syncs.
pub struct WithConntrackCleanup<D: Dataplane> {
    inner: D,
    cleaners: Vec<Cleaner>,
    /// The endpoints of the last successful sync (empty at start, so the first sync cleans
    /// what a previous proxy left), kept up to date for the changed services only
    /// ([`advance_endpoints`]) rather than cloned from every snapshot.
    prev: Snapshot,
    telemetry: Option<Arc<dyn Telemetry>>,
}

impl<D: Dataplane> WithConntrackCleanup<D> {
    pub fn new(inner: D, families: &[IpFamily], telemetry: Option<Arc<dyn Telemetry>>) -> Self {
        WithConntrackCleanup {
            inner,
            cleaners: families.iter().map(|f| Cleaner::new(*f)).collect(),
            prev: Snapshot::default(),
            telemetry,
        }
    }

    pub fn inner(&self) -> &D {
        &self.inner
    }
}

impl<D: Dataplane> Dataplane for WithConntrackCleanup<D> {
    fn mode(&self) -> ProxyMode {
        self.inner.mode()
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let report = self.inner.sync(snap, changed)?;
        for c in &mut self.cleaners {
            let family = c.family();
            match c.after_sync(&self.prev, snap, changed) {
                Ok(stats) => {
                    if stats.ran {
                        tracing::debug!(?family, ?stats, "conntrack cleanup");
                        if let Some(t) = &self.telemetry {
                            t.conntrack_cleanup(
                                family,
                                stats.deleted as u64,
                                stats.duration.as_secs_f64(),
                            );
                        }
                    }
                }
                Err(e) => tracing::warn!(?family, error = %e, "conntrack cleanup failed"),
            }
        }
        advance_endpoints(&mut self.prev, snap, changed);
        Ok(report)
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.inner.cleanup()
    }
}
