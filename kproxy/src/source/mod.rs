//! Sources turn the outside world into [`Event`]s (the model's input vocabulary,
//! [`crate::model::input`]) for the tracker.
//!
//! [`Event`]: crate::model::input::Event
//! [`Delta::Replace`]: crate::model::input::Delta::Replace
//! [`Delta::ListStart`]: crate::model::input::Delta::ListStart
//! [`Delta::Listed`]: crate::model::input::Delta::Listed
//! [`Delta::ListDone`]: crate::model::input::Delta::ListDone
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

pub mod kube;
pub mod manifests;
pub mod retry;

/// Label selector upstream kube-proxy uses for Services and EndpointSlices.
pub const PROXYABLE_LABEL_SELECTOR: &str =
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless";
