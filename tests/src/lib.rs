//! Support code for kproxy's integration tests.
//!
//! - [`fakeapi`]: a fake Kubernetes API server speaking real list/watch.
//! - [`netns`]: network-namespace topologies, private bpffs and test cgroups.
//! - [`recording`]: a `Dataplane` that records what it was asked to program.
//! - [`fixtures`]: paths of the copied upstream data.

pub mod fakeapi;
pub mod fixtures;
pub mod iptables_corpus;
pub mod iptables_tracer;
pub mod netns;
pub mod recording;
