//! Support code for kproxy's integration tests.
//!
//! - [`agentproc`]: the `kproxy` binary as a child process for end-to-end agent tests.
//! - [`bench`]: the benchmark scenarios and report of `cargo xtask bench` (`kp-bench`).
//! - [`bpf`]: the packet counter and `BPF_PROG_TEST_RUN` of the node path (test tools that
//!   stay out of the agent).
//! - [`fakeapi`]: a fake Kubernetes API server speaking real list/watch.
//! - [`maglev`]: the Maglev NodePort scenario of the `ebpf_maglev` test and the maglev bench.
//! - [`netns`]: network-namespace topologies, private bpffs and test cgroups.
//! - [`recording`]: a `Dataplane` that records what it was asked to program.
//! - [`fixtures`]: paths of the copied upstream data.
//! - [`http`]: a minimal HTTP client for kproxy's servers.
//! - [`iptables_corpus`] / [`iptables_tracer`]: upstream iptables corpus loading and the rule
//!   tracer (upstream `tracePacket` semantics).
//! - [`topology`]: the shared traffic-test topology (node, pods, second node, client) and the
//!   `kp-probe` servers/clients (`src/bin/kp-probe.rs`).

pub mod agentproc;
pub mod bench;
pub mod bpf;
pub mod fakeapi;
pub mod fixtures;
pub mod http;
pub mod iptables_corpus;
pub mod iptables_tracer;
pub mod maglev;
pub mod netns;
pub mod recording;
pub mod topology;
