//! The proxy's health, upstream's `ProxyHealthServer` (pkg/proxy/healthcheck/proxy_health.go).
//!
//! [`ProxyHealth`] is the pure state: per IP family, when the proxy last synced
//! (`lastUpdated`) and since when a wanted sync has been waiting (`oldestPendingQueued`).
//! - [`ProxyHealth::queued_update`] (upstream `QueuedUpdate`): a change needs a sync; the
//!   family's pending time is set unless one is already waiting.
//! - [`ProxyHealth::updated`] (upstream `Updated`): at loop start and after every successful
//!   sync; clears the pending time, sets `lastUpdated`.
//! - [`ProxyHealth::report`] (upstream `Health()`): a family is unhealthy iff a sync has been
//!   pending for at least the health timeout (kube-proxy passes 2 × `syncPeriod`).
//! - Node eligibility (upstream `NodeEligible`): `/healthz` fails while the Node is unknown,
//!   being deleted (deletionTimestamp) or tainted `ToBeDeletedByClusterAutoscaler`, so load
//!   balancers drain the node; `/livez` ignores the node.
//!
//! [`HealthHandle`] shares the state between the sync loop (as a
//! [`crate::sync::SyncObserver`]), the Node watcher and the HTTP [`server`].
//!
//! Differences from upstream, on purpose:
//! - A *failed* sync also counts as a queued update: kproxy retries it, so the proxy is
//!   waiting for a sync; after the health timeout of failures `/healthz` turns 503. (Upstream
//!   only queues on change notifications, so a proxier failing on periodic resyncs with no
//!   new changes stays "healthy".)
//! - In standalone mode (`--manifests`) there is no node lifecycle: a missing Node object
//!   makes the node eligible ([`NodeEligibility::Standalone`]). Against an API server, an
//!   unknown Node is ineligible as upstream.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Node;
use serde::Serialize;

use crate::model::IpFamily;
use crate::sync::{ChangeNotice, SyncObserver, SyncOutcome};

pub(crate) mod server;

/// Taint key the cluster autoscaler sets on nodes it is about to delete.
pub(crate) const TO_BE_DELETED_TAINT: &str = "ToBeDeletedByClusterAutoscaler";

/// Whether the node may take traffic, from what is known of its Node object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NodeEligibility {
    /// No Node object seen (API mode): not eligible, as upstream.
    Unknown,
    /// Standalone mode without a Node object: eligible.
    Standalone,
    /// The Node as last seen.
    Known { eligible: bool },
}

impl NodeEligibility {
    pub(crate) fn is_eligible(self) -> bool {
        match self {
            NodeEligibility::Unknown => false,
            NodeEligibility::Standalone => true,
            NodeEligibility::Known { eligible } => eligible,
        }
    }
}

/// Upstream `NodeEligible` for a present Node: not being deleted and not tainted
/// [`TO_BE_DELETED_TAINT`].
pub(crate) fn node_eligible(node: &Node) -> bool {
    if node.metadata.deletion_timestamp.is_some() {
        return false;
    }
    let tainted = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .is_some_and(|t| t.iter().any(|t| t.key == TO_BE_DELETED_TAINT));
    !tainted
}

/// Health of one IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FamilyHealth {
    pub last_updated: SystemTime,
    pub healthy: bool,
}

/// Upstream's `ProxyHealth` result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HealthReport {
    /// Every family healthy (true when nothing was ever recorded).
    pub healthy: bool,
    /// Latest `lastUpdated` over families (`None`: never updated).
    pub last_updated: Option<SystemTime>,
    pub current_time: SystemTime,
    /// Families that have ever been updated.
    pub status: BTreeMap<IpFamily, FamilyHealth>,
}

/// The pure health state (every method takes the current time).
#[derive(Debug, Clone)]
pub struct ProxyHealth {
    timeout: Duration,
    last_updated: BTreeMap<IpFamily, SystemTime>,
    oldest_pending: BTreeMap<IpFamily, SystemTime>,
    node: NodeEligibility,
}

impl ProxyHealth {
    pub(crate) fn new(timeout: Duration, node: NodeEligibility) -> Self {
        ProxyHealth {
            timeout,
            last_updated: BTreeMap::new(),
            oldest_pending: BTreeMap::new(),
            node,
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Upstream `QueuedUpdate(family)`.
    pub(crate) fn queued_update(&mut self, family: IpFamily, now: SystemTime) {
        self.oldest_pending.entry(family).or_insert(now);
    }

    /// Upstream `Updated(family)`.
    pub(crate) fn updated(&mut self, family: IpFamily, now: SystemTime) {
        self.oldest_pending.remove(&family);
        self.last_updated.insert(family, now);
    }

    pub(crate) fn set_node(&mut self, node: NodeEligibility) {
        self.node = node;
    }

    pub(crate) fn node(&self) -> NodeEligibility {
        self.node
    }

    /// Upstream `Health()`.
    pub(crate) fn report(&self, now: SystemTime) -> HealthReport {
        let mut status = BTreeMap::new();
        let mut healthy = true;
        for (family, last) in &self.last_updated {
            let fam_healthy = match self.oldest_pending.get(family) {
                Some(pending) => now.duration_since(*pending).unwrap_or_default() < self.timeout,
                None => true,
            };
            healthy &= fam_healthy;
            status.insert(
                *family,
                FamilyHealth {
                    last_updated: *last,
                    healthy: fam_healthy,
                },
            );
        }
        // A family queued but never updated is judged the same way.
        for (family, pending) in &self.oldest_pending {
            if !self.last_updated.contains_key(family)
                && now.duration_since(*pending).unwrap_or_default() >= self.timeout
            {
                healthy = false;
            }
        }
        HealthReport {
            healthy,
            last_updated: self.last_updated.values().max().copied(),
            current_time: now,
            status,
        }
    }
}

/// Go's zero `time.Time` as JSON (what upstream reports before any update).
const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// RFC 3339 (UTC, nanoseconds trimmed as Go's `RFC3339Nano`).
pub(crate) fn rfc3339(t: SystemTime) -> String {
    k8s_openapi::jiff::Timestamp::try_from(t)
        .map(|ts| ts.to_string())
        .unwrap_or_else(|_| GO_ZERO_TIME.to_owned())
}

#[derive(Serialize)]
struct FamilyBody {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    healthy: bool,
}

#[derive(Serialize)]
struct Body {
    #[serde(rename = "lastUpdated")]
    last_updated: String,
    #[serde(rename = "currentTime")]
    current_time: String,
    #[serde(rename = "nodeEligible", skip_serializing_if = "Option::is_none")]
    node_eligible: Option<bool>,
    healthy: bool,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    status: BTreeMap<&'static str, FamilyBody>,
}

/// What `/healthz` (`livez == false`) or `/livez` answers: status code and JSON body.
pub(crate) fn answer(health: &ProxyHealth, livez: bool, now: SystemTime) -> (u16, String) {
    let r = health.report(now);
    let node_eligible = (!livez).then(|| health.node().is_eligible());
    let healthy = r.healthy && node_eligible.unwrap_or(true);
    // Upstream reports the current time as lastUpdated when healthy (backward compatibility).
    let last_updated = if r.healthy {
        rfc3339(now)
    } else {
        r.last_updated
            .map(rfc3339)
            .unwrap_or_else(|| GO_ZERO_TIME.to_owned())
    };
    let body = Body {
        last_updated,
        current_time: rfc3339(now),
        node_eligible,
        healthy: r.healthy,
        status: r
            .status
            .iter()
            .map(|(f, s)| {
                (
                    (*f).name(),
                    FamilyBody {
                        last_updated: rfc3339(s.last_updated),
                        healthy: s.healthy,
                    },
                )
            })
            .collect(),
    };
    let code = if healthy { 200 } else { 503 };
    (
        code,
        serde_json::to_string(&body).expect("health body serializes"),
    )
}

/// `IPv4` / `IPv6`, upstream's `v1.IPFamily` strings.
/// Shared health state: fed by the sync loop and the Node watcher, read by the servers.
#[derive(Debug, Clone)]
pub struct HealthHandle {
    state: Arc<Mutex<ProxyHealth>>,
    families: Vec<IpFamily>,
    standalone: bool,
}

impl HealthHandle {
    /// Health of a proxy syncing `families` with the given timeout (kube-proxy: 2 × syncPeriod).
    pub(crate) fn new(timeout: Duration, families: &[IpFamily], node: NodeEligibility) -> Self {
        HealthHandle {
            state: Arc::new(Mutex::new(ProxyHealth::new(timeout, node))),
            families: families.to_vec(),
            standalone: node == NodeEligibility::Standalone,
        }
    }

    pub fn lock(&self) -> MutexGuard<'_, ProxyHealth> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Upstream `Health().Healthy` now (the service health servers use this).
    pub(crate) fn is_healthy(&self) -> bool {
        self.lock().report(SystemTime::now()).healthy
    }

    /// The Node object changed (`None`: deleted or not found).
    pub(crate) fn node_seen(&self, node: Option<&Node>) {
        let mut s = self.lock();
        let e = match node {
            Some(n) => NodeEligibility::Known {
                eligible: node_eligible(n),
            },
            None if self.standalone => NodeEligibility::Standalone,
            None => NodeEligibility::Unknown,
        };
        s.set_node(e);
    }

    fn updated_all(&self, now: SystemTime) {
        let mut s = self.lock();
        for f in &self.families {
            s.updated(*f, now);
        }
    }

    fn queued_all(&self, now: SystemTime) {
        let mut s = self.lock();
        for f in &self.families {
            s.queued_update(*f, now);
        }
    }
}

impl SyncObserver for HealthHandle {
    fn loop_started(&self, now: SystemTime) {
        self.updated_all(now);
    }

    fn changes(&self, notice: &ChangeNotice, now: SystemTime) {
        if notice.queued {
            self.queued_all(now);
        }
    }

    fn sync_finished(&self, o: &SyncOutcome<'_>) {
        let now = SystemTime::now();
        match o.result {
            Ok(_) => self.updated_all(now),
            Err(_) => self.queued_all(now),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, Taint};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::Value;

    const S: Duration = Duration::from_secs(1);
    const V4: IpFamily = IpFamily::V4;
    const V6: IpFamily = IpFamily::V6;

    fn body(h: &ProxyHealth, livez: bool, now: SystemTime) -> (u16, Value) {
        let (code, text) = answer(h, livez, now);
        (code, serde_json::from_str(&text).unwrap())
    }

    fn node(taint: Option<&str>, deleting: bool) -> Node {
        let mut n = Node::default();
        n.metadata.name = Some("n".into());
        if deleting {
            n.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        n.spec = Some(NodeSpec {
            taints: taint.map(|k| {
                vec![Taint {
                    key: k.into(),
                    effect: "NoSchedule".into(),
                    ..Default::default()
                }]
            }),
            ..Default::default()
        });
        n
    }

    /// Upstream's TestHealthzServer sequence (healthTimeout 10 s), per family.
    #[test]
    fn upstream_health_sequence() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut h = ProxyHealth::new(10 * S, NodeEligibility::Known { eligible: true });
        assert_eq!(body(&h, false, t0).0, 200, "initial");
        h.updated(V4, t0);
        h.updated(V6, t0);
        assert_eq!(body(&h, false, t0).0, 200);
        let t1 = t0 + 25 * S;
        assert_eq!(body(&h, false, t1).0, 200, "no queued updates");
        for fam in [V4, V6] {
            let mut h = h.clone();
            h.queued_update(fam, t1);
            let (code, b) = body(&h, false, t1 + 25 * S);
            assert_eq!(code, 503, "{fam:?} queued 25 s ago");
            assert_eq!(b["healthy"], false);
            assert_eq!(b["status"][fam.name()]["healthy"], false);
            let other = if fam == V4 { V6 } else { V4 };
            assert_eq!(b["status"][other.name()]["healthy"], true);
            assert_eq!(b["lastUpdated"], rfc3339(t0), "last real update");
            let t2 = t1 + 25 * S;
            h.updated(V4, t2);
            h.updated(V6, t2);
            let (code, b) = body(&h, false, t2 + 5 * S);
            assert_eq!(code, 200);
            assert_eq!(
                b["lastUpdated"],
                rfc3339(t2 + 5 * S),
                "current time when healthy"
            );
        }
        // queued less than the timeout ago: still healthy
        h.queued_update(V4, t1);
        assert_eq!(body(&h, false, t1 + 9 * S).0, 200);
        assert_eq!(body(&h, false, t1 + 10 * S).0, 503);
    }

    #[test]
    fn node_eligibility_affects_healthz_not_livez() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let cases = [
            (Some("other"), false, 200),
            (Some(TO_BE_DELETED_TAINT), false, 503),
            (None, true, 503),
            (None, false, 200),
        ];
        for (taint, deleting, want) in cases {
            let n = node(taint, deleting);
            let mut h = ProxyHealth::new(10 * S, NodeEligibility::Unknown);
            h.set_node(NodeEligibility::Known {
                eligible: node_eligible(&n),
            });
            h.updated(V4, t0);
            let (code, b) = body(&h, false, t0);
            assert_eq!(code, want, "taint {taint:?} deleting {deleting}");
            assert_eq!(b["healthy"], true);
            assert_eq!(b["nodeEligible"], want == 200);
            let (code, b) = body(&h, true, t0);
            assert_eq!(code, 200, "livez ignores the node");
            assert!(b.get("nodeEligible").is_none());
        }
        let h = ProxyHealth::new(10 * S, NodeEligibility::Unknown);
        assert_eq!(body(&h, false, t0).0, 503, "unknown node");
        let h = ProxyHealth::new(10 * S, NodeEligibility::Standalone);
        assert_eq!(body(&h, false, t0).0, 200, "standalone");
    }

    #[test]
    fn body_shape() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_250);
        let mut h = ProxyHealth::new(10 * S, NodeEligibility::Standalone);
        let (_, b) = body(&h, false, t0);
        assert!(b.get("status").is_none(), "status omitted when empty");
        assert_eq!(b["currentTime"], "2023-11-14T22:13:20.25Z");
        h.updated(V4, t0);
        let (_, b) = body(&h, false, t0);
        let keys: Vec<&String> = b.as_object().unwrap().keys().collect();
        assert_eq!(
            keys,
            [
                "currentTime",
                "healthy",
                "lastUpdated",
                "nodeEligible",
                "status"
            ]
        );
        assert_eq!(
            b["status"]["IPv4"]["lastUpdated"],
            "2023-11-14T22:13:20.25Z"
        );
    }
}
