//! What the agent tells the outside world: Prometheus [`metrics`], proxy `health` (`/healthz`,
//! `/livez`), per-service health (`healthCheckNodePort`s, `service_health`), Kubernetes
//! `events`, and the HTTP `server` plumbing they share. Observers read snapshots and sync
//! outcomes; they never import a datapath (only the `dataplane` root's vocabulary).

pub(crate) mod events;
pub(crate) mod health;
pub mod metrics;
pub(crate) mod server;
pub(crate) mod service_health;
