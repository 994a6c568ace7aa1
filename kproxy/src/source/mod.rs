//! Sources turn the outside world into [`Event`]s for the model tracker.
//!
//! - [`kube`]: Services, EndpointSlices and the node's own Node from the API server (kube-rs).
//! - [`manifests`]: the same kinds from a file or directory of YAML (standalone mode).
//!
//! Each kind first arrives as a complete list — one [`Delta::Replace`], or streamed as
//! [`Delta::ListStart`], a [`Delta::Listed`] per page of objects, [`Delta::ListDone`]. A finished list
//! is how a source reports "initial sync done" for the kind, and how a re-list (after 410 Gone
//! or a file re-read) swaps the whole state. The kube source streams Services and
//! EndpointSlices so that a list of 10k objects is never held in memory as raw API objects
//! (they are parsed into the model one by one; a raw Service alone is ≈ 1.4 KB before its
//! strings); the manifests source and the Node watch send `Replace`.

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

pub mod kube;
pub mod manifests;
pub mod retry;

/// A change to one kind of object.
#[derive(Debug, Clone)]
pub enum Delta<T> {
    /// Added or updated.
    Apply(T),
    /// Deleted (the last known state).
    Delete(T),
    /// The complete current set of this kind; replaces everything known before.
    Replace(Vec<T>),
    /// A list of this kind begins (a later `ListStart` restarts it).
    ListStart,
    /// Objects of the list in progress (added or updated, like `Apply`), a page at a time.
    Listed(Vec<T>),
    /// The list is complete: objects not `Listed` since `ListStart` are gone.
    ListDone,
}

/// One event from a source.
#[derive(Debug, Clone)]
#[allow(
    clippy::large_enum_variant,
    reason = "events are moved once through a channel; boxing would only add an allocation"
)]
pub enum Event {
    Service(Delta<Service>),
    EndpointSlice(Delta<EndpointSlice>),
    /// The node's own Node object (`Replace(vec![])` when the source has none).
    Node(Delta<Node>),
}

/// Label selector upstream kube-proxy uses for Services and EndpointSlices.
pub const PROXYABLE_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
