//! Kubernetes Events kproxy publishes (events.k8s.io/v1 through kube-rs' [`Recorder`]), as
//! upstream kube-proxy does:
//! - `Normal Starting` (action `StartKubeProxy`) on the Node when the agent starts;
//! - `Warning FailedToStartServiceHealthcheck` (action `Listen`) on a Service whose
//!   healthCheckNodePort cannot be opened.
//!
//! Without an API client (standalone mode) events are only logged. Publishing runs in its own
//! task, so a slow or failing API server never delays the caller; a failed publish is logged.
//! Node events go to the `default` namespace (the Node is cluster-scoped), as upstream's do.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{info, warn};

/// Reporting controller name in published events.
pub(crate) const REPORTER: &str = "kproxy";

/// Where events go.
#[derive(Clone)]
pub(crate) struct Events {
    recorder: Option<Recorder>,
    node_name: String,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events")
            .field("api", &self.recorder.is_some())
            .field("node_name", &self.node_name)
            .finish()
    }
}

/// Upstream's reference to the proxy's Node (uid = the node name, as upstream sets it).
pub(crate) fn node_ref(node_name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Node".into()),
        name: Some(node_name.into()),
        uid: Some(node_name.into()),
        ..Default::default()
    }
}

/// Upstream's reference to a Service (uid = `namespace/name`).
pub(crate) fn service_ref(namespace: &str, name: &str) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Service".into()),
        namespace: Some(namespace.into()),
        name: Some(name.into()),
        uid: Some(format!("{namespace}/{name}")),
        ..Default::default()
    }
}

impl Events {
    /// Events published through `client` (`None`: logged only).
    pub(crate) fn new(client: Option<kube::Client>, node_name: &str) -> Self {
        let recorder = client.map(|c| {
            Recorder::new(
                c,
                Reporter {
                    controller: REPORTER.into(),
                    instance: Some(node_name.into()),
                },
            )
        });
        Events {
            recorder,
            node_name: node_name.into(),
        }
    }

    /// `Normal Starting` on this node.
    pub(crate) fn starting(&self) {
        self.publish(
            EventType::Normal,
            "Starting",
            "StartKubeProxy",
            "Starting kproxy.".into(),
            node_ref(&self.node_name),
        );
    }

    /// `Warning FailedToStartServiceHealthcheck` on a Service (upstream's message).
    pub(crate) fn failed_service_healthcheck(
        &self,
        namespace: &str,
        name: &str,
        port: u16,
        err: &str,
    ) {
        let note = format!(
            "node {} failed to start healthcheck \"{namespace}/{name}\" on port {port}: {err}",
            self.node_name
        );
        self.publish(
            EventType::Warning,
            "FailedToStartServiceHealthcheck",
            "Listen",
            note,
            service_ref(namespace, name),
        );
    }

    fn publish(
        &self,
        type_: EventType,
        reason: &'static str,
        action: &'static str,
        note: String,
        regarding: ObjectReference,
    ) {
        let object = format!(
            "{}/{}",
            regarding.kind.as_deref().unwrap_or(""),
            regarding.name.as_deref().unwrap_or("")
        );
        match type_ {
            EventType::Normal => info!(%object, reason, "{note}"),
            EventType::Warning => warn!(%object, reason, "{note}"),
        }
        let Some(recorder) = self.recorder.clone() else {
            return;
        };
        let ev = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&ev, &regarding).await {
                warn!(%object, reason, error = %e, "cannot publish event");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_match_upstream() {
        let n = node_ref("node-1");
        assert_eq!(
            (
                n.kind.as_deref(),
                n.name.as_deref(),
                n.uid.as_deref(),
                n.namespace
            ),
            (Some("Node"), Some("node-1"), Some("node-1"), None)
        );
        let s = service_ref("ns", "web");
        assert_eq!(
            (s.kind.as_deref(), s.namespace.as_deref(), s.uid.as_deref()),
            (Some("Service"), Some("ns"), Some("ns/web"))
        );
    }
}
