//! Support code for kproxy's integration tests.
//!
//! - [`fakeapi`]: a fake Kubernetes API server speaking real list/watch.
//! - [`netns`]: network-namespace topologies, private bpffs and test cgroups.
//! - [`recording`]: a `Dataplane` that records what it was asked to program.
//! - [`fixtures`]: paths of the copied upstream data.
//! - [`topology`]: the shared traffic-test topology (node, pods, second node, client) and the
//!   `kp-probe` servers/clients (`src/bin/kp-probe.rs`).

pub mod fakeapi;
pub mod fixtures;
pub mod netns;
pub mod recording;
pub mod topology;
