//! The vocabulary sources speak to the tracker: a [`Delta`] of one kind of object, wrapped in
//! an [`Event`]. Defined here, not in `source`, so the model never imports where objects come
//! from (`source` imports the model).

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;

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
    /// `ServiceCIDR` objects (networking.k8s.io/v1), from an API server that serves them;
    /// never sent otherwise (see `crate::model::service_cidrs`).
    ServiceCidr(Delta<ServiceCIDR>),
}
