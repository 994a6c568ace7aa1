//! Per-CPU packet counter: every packet seen at a hook adds 1 packet and its length in bytes
//! to that hook's slot of `KP_PKT_COUNT` (see `kproxy_common::counter`). Never drops or
//! changes a packet: XDP returns `XDP_PASS`, TC returns `TC_ACT_UNSPEC` (TCX "next": later
//! programs on the same hook still run).

use aya_ebpf::{
    bindings::{TC_ACT_UNSPEC, xdp_action},
    macros::{classifier, map, xdp},
    maps::PerCpuArray,
    programs::{TcContext, XdpContext},
};
use kproxy_common::counter::{COUNTER_SLOTS, CounterSlot, PacketCount};

/// `kproxy_common::counter::MAP_PACKET_COUNT`.
#[map]
static KP_PKT_COUNT: PerCpuArray<PacketCount> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

#[inline(always)]
fn count(slot: CounterSlot, bytes: u64) {
    if let Some(value) = KP_PKT_COUNT.get_ptr_mut(slot.index()) {
        // SAFETY: the pointer comes from a successful lookup in a per-CPU array, so it points
        // at this CPU's value; BPF programs are not preempted on a CPU, so no other writer
        // runs concurrently on it.
        unsafe {
            (*value).packets = (*value).packets.wrapping_add(1);
            (*value).bytes = (*value).bytes.wrapping_add(bytes);
        }
    }
}

/// `kproxy_common::counter::PROG_COUNT_XDP`.
#[xdp]
pub fn kp_count_xdp(ctx: XdpContext) -> u32 {
    count(CounterSlot::Xdp, (ctx.data_end() - ctx.data()) as u64);
    xdp_action::XDP_PASS
}

/// `kproxy_common::counter::PROG_COUNT_TC_INGRESS`.
#[classifier]
pub fn kp_count_tc_in(ctx: TcContext) -> i32 {
    count(CounterSlot::TcIngress, u64::from(ctx.len()));
    TC_ACT_UNSPEC
}

/// `kproxy_common::counter::PROG_COUNT_TC_EGRESS`.
#[classifier]
pub fn kp_count_tc_eg(ctx: TcContext) -> i32 {
    count(CounterSlot::TcEgress, u64::from(ctx.len()));
    TC_ACT_UNSPEC
}
