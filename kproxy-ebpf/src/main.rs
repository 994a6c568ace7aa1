//! kproxy's BPF programs: this crate root is the agent's object (embedded by
//! `kproxy/build.rs`); `bench.rs` builds a second object with the same programs plus the
//! bench and test tools (the packet counter and the floors), which the agent never carries.
//!
//! Built with Debian's rustc-web for `bpfel-unknown-none` (see `TOOLCHAIN.md` / README); the
//! target's panic strategy is `abort`, so no profile setting is needed for it. Names, map
//! value types and constants come from `kproxy-common`, never from here.
//!
//! - [`tc`]: the TC service path on node devices, both address families
//!   (NodePort/ExternalIP/LB from outside: DNAT, SNAT, conntrack, reverse NAT), with
//!   [`tc_icmp`] (ICMP errors about translated flows) and [`tc_reject`] (TCP RST / ICMP port
//!   unreachable for frontends without endpoints).
//! - [`xdp`]: the XDP program on node devices: early drop of new flows TC would drop, and
//!   [`xdp_fwd`], the NodePort/LB forwarding fast path for remote backends (IPv4).
//! - [`flow`]: connection table logic, backend choice, new-flow CT entries and SNAT port
//!   allocation TC and XDP share (a flow may start in either).
//! - [`family`]: what that shared code needs to know about an address family, and its IPv4
//!   and IPv6 implementations (the code above is written once, generic over it).
//! - [`frontend`]: the frontend lookups TC and XDP share.
//! - [`packet`], [`packet6`]: direct packet access (bounds-checked pointers), the IPv4 and
//!   IPv6 parsers and checksum arithmetic the service-path programs share.
//! - [`maps`]: every map of the object, declared once.
//! - [`sock`]: socket-level load balancing (cgroup connect/sendmsg/recvmsg/getpeername).
//!
//! Keep logging (aya-log) off the per-packet path: it costs ~10x a map lookup.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

include!("programs.rs");

/// Host stub: this crate is only meaningful as a BPF object.
#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!(
        "kproxy-ebpf is a BPF object, not a host program: `cargo xtask build-ebpf` builds it \
         (and `cargo build -p kproxy` embeds it)"
    );
    std::process::exit(2);
}
