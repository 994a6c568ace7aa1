//! The pure service model: Kubernetes objects in, an immutable [`Snapshot`] out. No I/O here.
//!
//! - `types`: `ServicePort`, `Endpoint`, names and enums.
//! - `service`: Service → `ServicePort`s (which services are proxied, validation, defaults).
//! - `endpoints`: EndpointSlice → `Endpoint`s, merged per service port like upstream's
//!   EndpointSliceCache.
//! - [`topology`]: upstream's `CategorizeEndpoints`.
//! - `tracker`: folds source events into state and builds snapshots + change sets.
//! - `service_cidrs`: `ServiceCIDR` objects → the cluster's service CIDRs.
//! - `testing`: fluent builders of ports, endpoints and snapshots for tests (hidden).

pub(crate) mod endpoints;
pub mod input;
pub(crate) mod service;
pub(crate) mod service_cidrs;
pub(crate) mod snapshot;
#[doc(hidden)]
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod topology;
pub(crate) mod tracker;
pub(crate) mod types;
pub(crate) mod vecmap;
pub mod warning;

pub use snapshot::{ChangedSet, Snapshot};
pub use tracker::Tracker;
pub use types::*;
pub(crate) use warning::ModelWarning;

#[cfg(test)]
mod tests;
