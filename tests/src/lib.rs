//! Support code for kproxy's integration tests (tests/tests/, grouped as tests/README.md
//! explains) and its benchmarks (the `kproxy-bench` crate). Every helper lives here; the
//! helpers' own tests are this library's unit tests (`selftest`).
//!
//! - [`agentproc`]: the `kproxy` binary as a child process for end-to-end agent tests;
//!   [`agentns`]: a fake API server in the agent's network namespace, its nat rules.
//! - [`bpf`]: the packet counter and `BPF_PROG_TEST_RUN` of the node path (test tools that
//!   stay out of the agent).
//! - [`fakeapi`]: a fake Kubernetes API server speaking real list/watch.
//! - [`maglev`]: the Maglev NodePort scenario of the `ebpf_maglev` test and the maglev bench.
//! - [`manifests`]: the Node, Services and EndpointSlices as YAML for the agent's
//!   `--manifests` directory.
//! - [`netns`]: network-namespace topologies, private bpffs and test cgroups.
//! - [`recording`]: a `Dataplane` that records what it was asked to program.
//! - [`fixtures`]: paths of the copied upstream data.
//! - [`http`]: a minimal HTTP client for kproxy's servers.
//! - [`iptables_corpus`] / [`iptables_tracer`]: upstream iptables corpus loading and the rule
//!   tracer (upstream `tracePacket` semantics).
//! - [`nftables_corpus`] / [`nftables_tracer`]: the same for upstream's nftables corpus.
//! - [`topology`]: the shared traffic-test topology (node, pods, second node, client) and the
//!   `kp-probe` servers/clients (`src/bin/kp-probe.rs`).
//! - [`traffic`]: what the netfilter traffic tests share on the topology: Service and
//!   EndpointSlice objects of its pods, a rig syncing any `Dataplane` in the node namespace, a
//!   long-lived UDP flow and its conntrack entries, long-lived TCP connections (`kp-probe hold`).
//! - [`deploy`]: the deploy manifests, rendered (`kubectl kustomize`) and parsed.
//! - [`podman`]: the container image under podman: the archive of `cargo xtask image`, a
//!   DaemonSet's pod spec as `podman run` options, a running container.
//! - [`tools`]: external tools a test runs (`kubectl`, `promtool`), skipped or required.
//! - [`tc`]: the TC-program kit of the eBPF tests (object loading, service maps, crafted
//!   frames, the traffic rig).

pub mod agentns;
pub mod agentproc;
pub mod bpf;
pub mod deploy;
pub mod fakeapi;
pub mod fixtures;
pub mod http;
pub mod iptables_corpus;
pub mod iptables_tracer;
pub mod maglev;
pub mod manifests;
pub mod netns;
pub mod nftables_corpus;
pub mod nftables_tracer;
pub mod podman;
pub mod recording;
#[cfg(test)]
mod selftest;
pub mod tc;
pub mod tools;
pub mod topology;
pub mod traffic;
