//! kproxy: a drop-in replacement for Kubernetes' kube-proxy.
//!
//! ARCHITECTURE.md at the repository root is the map. Data flow: [`source`] → [`model::Tracker`]
//! → [`sync::Runner`] → [`dataplane::Dataplane::sync`]; [`app`] wires it together from
//! [`config`] (filled by [`cli`]), [`observe`] reports on it, [`kernel`] holds the kernel
//! interfaces more than one datapath uses.

pub mod app;
pub mod cli;
pub mod config;
pub mod dataplane;
pub mod kernel;
pub mod model;
pub mod observe;
pub mod source;
pub mod sync;

/// The import rules of ARCHITECTURE.md, checked against the code.
#[cfg(test)]
mod layering;
