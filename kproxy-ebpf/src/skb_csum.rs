//! The checksum state of the packet (`ip_summed`), read from the kernel's `struct sk_buff`
//! through `bpf_cast_to_kern_ctx` (inlined by the verifier: no call). The four instructions
//! and their load-time completion are `kproxy_common::skb`'s; on a kernel where the agent
//! cannot complete them they yield `CHECKSUM_COMPLETE`, which sends every rewrite to the
//! checksum helpers.
//!
//! Why (issue #3): each `l4_csum_replace` helper call cost ≈ 40 ns in the bench (this CPU's
//! return-thunk mitigation makes every kernel call/return dear); an established-flow DNAT made
//! two. Updating the L4 checksum in place is right whenever the skb is not
//! `CHECKSUM_COMPLETE` (whose `skb->csum` a program cannot update without a helper):
//! `CHECKSUM_NONE` / `CHECKSUM_UNNECESSARY` take the full RFC 1624 update, `CHECKSUM_PARTIAL`
//! (the field holds the pseudo-header sum the device completes) only the address part.

use aya_ebpf::programs::TcContext;
use kproxy_common::skb::{CALL_PLACEHOLDER, LOAD_PLACEHOLDER, MASK_IP_SUMMED, SHIFT_PLACEHOLDER};
pub(crate) use kproxy_common::skb::{CHECKSUM_COMPLETE, CHECKSUM_PARTIAL};

/// `skb->ip_summed` of the packet (`CHECKSUM_*`).
#[inline(always)]
pub(crate) fn ip_summed(ctx: &TcContext) -> u8 {
    let r: u64;
    // SAFETY: the kfunc takes the program's context in r1 and returns the kernel's skb in r0,
    // which the verifier types as a trusted `struct sk_buff *`; the load reads one byte of a
    // field it checks against the kernel's BTF. r1–r5 are clobbered as by any call.
    unsafe {
        core::arch::asm!(
            ".quad {call}",
            ".quad {load}",
            ".quad {shift}",
            ".quad {mask}",
            call = const CALL_PLACEHOLDER,
            load = const LOAD_PLACEHOLDER,
            shift = const SHIFT_PLACEHOLDER,
            mask = const MASK_IP_SUMMED,
            inout("r1") ctx.skb.skb => _,
            lateout("r0") r,
            out("r2") _,
            out("r3") _,
            out("r4") _,
            out("r5") _,
        );
    }
    r as u8
}
