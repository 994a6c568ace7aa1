// The crate-root items both BPF objects share (included by `main.rs`, the agent's object, and
// `bench.rs`, the bench/test tools' object): the program modules, the panic handler and the
// license. A file of items, not a module, so each object's crate root declares the modules.

mod family;
mod flow;
mod frontend;
mod maps;
mod packet;
mod packet6;
mod skb_csum;
mod sock;
mod tc;
mod tc_icmp;
mod tc_reject;
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
