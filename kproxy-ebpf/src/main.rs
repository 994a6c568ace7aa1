//! kproxy's BPF programs (one ELF object, embedded into the agent by `kproxy/build.rs`).
//!
//! Built with Debian's rustc-web for `bpfel-unknown-none` (see `TOOLCHAIN.md` / README); the
//! target's panic strategy is `abort`, so no profile setting is needed for it. Names, map
//! value types and constants come from `kproxy-common`, never from here.
//!
//! - [`counter`]: per-CPU packet counter (XDP and TC), the baseline program.
//! - [`tc`]: the TC service path on node devices (NodePort/ExternalIP/LB from outside: DNAT,
//!   SNAT, conntrack, reverse NAT, ICMP errors).
//! - [`xdp`]: the XDP program on node devices: early drop of new flows TC would drop, and
//!   [`xdp_fwd`], the NodePort/LB forwarding fast path for remote backends.
//! - [`flow`]: connection table, backend choice, new-flow CT entries and SNAT port allocation
//!   TC and XDP share (a flow may start in either).
//! - [`tc6`]: the same service path for IPv6 frames (own connection table and node addresses).
//! - [`packet6`]: the Ethernet + IPv6 parser of [`tc6`].
//! - [`frontend`]: the frontend lookups TC and XDP share.
//! - [`packet`]: direct packet access (bounds-checked pointers), the IPv4 parser and checksum
//!   arithmetic the service-path programs share.
//! - [`service_maps`]: the service maps shared by socket LB and the TC programs.
//! - [`sock`]: socket-level load balancing (cgroup connect/sendmsg/recvmsg/getpeername).
//!
//! Keep logging (aya-log) off the per-packet path: it costs ~10x a map lookup.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

mod counter;
mod floor;
mod flow;
mod frontend;
mod packet;
mod packet6;
mod service_maps;
mod skb_csum;
mod sock;
mod tc;
mod tc6;
mod xdp;
mod xdp_fwd;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    // The verifier rejects any path that could reach here (there is no way to abort a BPF
    // program), so this is never executed; loop instead of UB to keep it obviously safe.
    #[allow(clippy::empty_loop)]
    loop {}
}

/// The license the kernel sees; GPL-compatible so GPL-only helpers and kfuncs are allowed.
#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// Host stub: this crate is only meaningful as a BPF object.
#[cfg(not(target_arch = "bpf"))]
fn main() {
    eprintln!(
        "kproxy-ebpf is a BPF object, not a host program: `cargo xtask build-ebpf` builds it \
         (and `cargo build -p kproxy` embeds it)"
    );
    std::process::exit(2);
}
