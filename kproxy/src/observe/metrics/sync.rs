//! [`SyncMetrics`]: the generic (every-mode) sync metrics, fed by the sync loop.

use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::{Endpoint, IpFamily, Snapshot};
use crate::sync::{ChangeNotice, SyncObserver, SyncOutcome};

use crate::observe::metrics::FamilyPolicyLabels;
use crate::observe::metrics::Metrics;
use crate::observe::metrics::ModeLabels;
use crate::observe::metrics::fam;

/// Sets the generic sync metrics from the sync loop's progress:
/// - `*_changes_total` grow with every change notification, `*_changes_pending` follow the
///   tracker's pending counts and drop to 0 when a sync takes the changes;
/// - `last_queued_timestamp_seconds` is set at loop start and whenever a sync gets queued;
/// - `sync_proxy_rules_duration_seconds` is observed for every sync, successful or not (as
///   upstream's deferred observation); `last_timestamp_seconds`, the no-local-endpoints gauges
///   and `kproxy_programmed_*` after a successful one; `kproxy_sync_errors_total{mode}` counts
///   the failed ones.
#[derive(Debug, Clone)]
pub struct SyncMetrics {
    metrics: Metrics,
}

impl SyncMetrics {
    pub(crate) fn new(metrics: Metrics) -> Self {
        SyncMetrics { metrics }
    }

    fn set_timestamps(&self, which: Which, at: SystemTime) {
        let secs = at
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let g = self.metrics.generic();
        let family = match which {
            Which::Queued => &g.last_queued,
            Which::Synced => &g.last_synced,
        };
        for f in self.metrics.families() {
            family.get_or_create(&fam(*f)).set(secs);
        }
    }
}

#[derive(Clone, Copy)]
enum Which {
    Queued,
    Synced,
}

/// Upstream's per-sync no-local-endpoints counts for one family: (internal, external) —
/// service ports of that family that have usable endpoints somewhere but whose Local
/// internal resp. external traffic policy finds none on this node.
pub fn no_local_endpoints(snap: &Snapshot, family: IpFamily) -> (i64, i64) {
    let (mut internal, mut external) = (0, 0);
    for svc in snap.services.values() {
        if svc.cluster_ip(family).is_none() {
            continue;
        }
        if !svc.internal_policy_local && !svc.external_policy_local {
            continue;
        }
        let eps: Vec<Endpoint> = snap
            .endpoints_of(&svc.name)
            .iter()
            .filter(|e| family.matches(&e.ip))
            .cloned()
            .collect();
        let cat = crate::model::topology::categorize_endpoints(&eps, svc, &snap.node);
        let no_local = cat.local.as_ref().is_none_or(Vec::is_empty);
        if cat.has_any_endpoints && no_local {
            internal += i64::from(svc.internal_policy_local);
            external += i64::from(svc.external_policy_local);
        }
    }
    (internal, external)
}

impl SyncObserver for SyncMetrics {
    fn loop_started(&self, now: SystemTime) {
        self.set_timestamps(Which::Queued, now);
    }

    fn changes(&self, notice: &ChangeNotice, now: SystemTime) {
        let g = self.metrics.generic();
        g.service_changes_total
            .inc_by(notice.service_changes as u64);
        g.endpoint_changes_total
            .inc_by(notice.endpoint_changes as u64);
        g.service_changes_pending
            .set(notice.pending.services as i64);
        g.endpoint_changes_pending
            .set(notice.pending.endpoints as i64);
        if notice.queued {
            self.set_timestamps(Which::Queued, now);
        }
    }

    fn sync_started(&self, _now: SystemTime) {
        let g = self.metrics.generic();
        g.service_changes_pending.set(0);
        g.endpoint_changes_pending.set(0);
    }

    fn sync_finished(&self, o: &SyncOutcome<'_>) {
        let g = self.metrics.generic();
        for f in self.metrics.families() {
            g.sync_duration
                .get_or_create(&fam(*f))
                .observe(o.took.as_secs_f64());
        }
        match o.result {
            Ok(report) => {
                let now = SystemTime::now();
                self.set_timestamps(Which::Synced, now);
                let services: std::collections::BTreeSet<(&str, &str)> = o
                    .changed
                    .services
                    .iter()
                    .map(|n| (n.namespace.as_str(), n.name.as_str()))
                    .collect();
                for (ns, name) in services {
                    for (family, t) in self.metrics.take_trigger_times(ns, name) {
                        let latency = now.duration_since(t).unwrap_or_default();
                        g.network_programming
                            .get_or_create(&fam(family))
                            .observe(latency.as_secs_f64());
                    }
                }
                g.programmed_services.set(report.services as i64);
                g.programmed_endpoints.set(report.endpoints as i64);
                for f in self.metrics.families() {
                    let (internal, external) = no_local_endpoints(o.snapshot, *f);
                    for (policy, n) in [("internal", internal), ("external", external)] {
                        g.no_local_endpoints
                            .get_or_create(&FamilyPolicyLabels {
                                ip_family: (*f).into(),
                                traffic_policy: policy.into(),
                            })
                            .set(n);
                    }
                }
            }
            Err(_) => {
                g.sync_errors
                    .get_or_create(&ModeLabels {
                        mode: o.mode.as_str().into(),
                    })
                    .inc();
            }
        }
    }
}
