//! kproxy: a drop-in replacement for Kubernetes' kube-proxy.
//!
//! Data flow (see README.md): [`source`] → [`model::Tracker`] → [`sync::Runner`] →
//! [`dataplane::Dataplane::sync`].

pub mod agent;
pub mod bpf;
pub mod btf;
pub mod cli;
pub mod config;
pub mod conntrack;
pub mod dataplane;
pub mod events;
pub mod health;
pub mod healthcheck;
pub mod httpserve;
pub mod inspect;
pub mod localdetect;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod netlink;
pub mod nodeip;
pub mod source;
pub mod sync;
pub mod sysctl;
pub mod vecmap;
