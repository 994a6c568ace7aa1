//! Types and names shared by the kproxy BPF programs (`kproxy-ebpf`, built for
//! `bpfel-unknown-none`) and the agent (`kproxy`, feature `user`).
//!
//! Everything a map key/value or a program/map name means is defined here once. Map values are
//! `#[repr(C)]`, `Copy` and free of padding the two sides could disagree on; the `user` feature
//! implements `aya::Pod` for them so the agent can read and write the maps.
//!
//! Attribute macros on the BPF side (`#[map]`, `#[xdp]`, `#[classifier]`) only take literals, so
//! the BPF crate repeats each name once as an identifier; the agent's unit test
//! `bpf::tests::object_has_every_shared_name` parses the built object and fails if any name here
//! is missing from it.
//!
//! - [`counter`]: the per-CPU packet counter.
//! - [`service`]: the service maps (frontends, backend slots, backends, affinity, source
//!   ranges, socket rev-NAT). Written by the agent (`kproxy::dataplane::ebpf`), read by socket
//!   LB (`kproxy-ebpf/src/sock.rs`) and the TC programs; see the module for who writes what.
//!   Conntrack/SNAT/NAT maps belong to the TC programs and live in their own module.
//! - [`frontend_filter`]: the bit array that lets the node-device programs skip service-map
//!   lookups that would miss.
//! - [`maglev`]: the Maglev tables (`--bpf-lb-algorithm maglev`) and the flow hash.
//! - [`ct`]: the TC service path's connection table, SNAT configuration, node addresses per
//!   device and counters (`kp_tc_in` / `kp_tc_eg`).
//! - [`ct6`]: the IPv6 connection table and node addresses of the same programs.
//! - [`skb`]: the instructions that read `struct sk_buff`'s checksum state, completed by the
//!   agent from the kernel's BTF before loading.
//! - [`layout`]: each pinned map's layout (type, sizes, version) and the pinned record of
//!   them, so an upgraded agent reuses, carries over or replaces pins deliberately.
#![no_std]

pub mod counter;
pub mod ct;
pub mod ct6;
pub mod frontend_filter;
pub mod layout;
pub mod maglev;
pub mod service;
pub mod skb;
pub mod sock;

/// `BPF_F_MMAPABLE` (`map_flags`): an array the agent writes through a shared mapping
/// instead of one `bpf(2)` call per element (kernel ≥ 5.5).
pub const BPF_F_MMAPABLE: u32 = 1 << 10;
