//! From the API server to a sync: the Kubernetes source against the fake API server, the sync
//! runner, upstream's endpoint-categorization cases. One test binary (see tests/README.md).

mod kube_source;
mod sync_runner;
mod topology_corpus;
