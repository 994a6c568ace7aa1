//! `kp_xdp`: the XDP half of the node-device service path (`--bpf-xdp`). It drops, before the
//! kernel allocates an skb, the first packets of new flows that the TC ingress program
//! ([`crate::tc`]) would drop anyway — clients outside a frontend's loadBalancerSourceRanges,
//! and frontends without endpoints whose packets are dropped rather than rejected
//! (eTP/iTP=Local without local endpoints) — and passes everything else (`XDP_PASS`) to the
//! stack and TC, which translate it. Classification is TC's own ([`crate::frontend`]): a
//! packet that is no frontend's costs one hash lookup; an established flow (its `KP_CT`
//! `Service` entry exists) is always passed, so a flow admitted before a source-range change
//! keeps going exactly as with TC alone.
//!
//! Rejections (TCP RST, ICMP port unreachable) stay with TC, which builds them.

use aya_ebpf::{
    bindings::xdp_action,
    macros::{map, xdp},
    maps::PerCpuArray,
    programs::XdpContext,
};
use kproxy_common::ct::{CtKind, PROTO_ICMP, XDP_STATS, XdpStat};
use kproxy_common::service::SVC_F_REJECT;

use crate::frontend::{cluster_entry, new_flow_entry, source_allowed};
use crate::packet::{Parsed, parse};
use crate::tc::{KP_CT, key};

/// `kproxy_common::ct::MAP_XDP_STATS`.
#[map]
static KP_XDP_STATS: PerCpuArray<u64> = PerCpuArray::pinned(XDP_STATS, 0);

#[inline(always)]
fn stat(s: XdpStat) {
    if let Some(v) = KP_XDP_STATS.get_ptr_mut(s.index()) {
        // SAFETY: per-CPU value of this CPU; programs are not preempted on a CPU.
        unsafe { *v += 1 };
    }
}

/// `kproxy_common::ct::PROG_XDP`.
#[xdp]
pub fn kp_xdp(ctx: XdpContext) -> u32 {
    if early_drop(&ctx) {
        xdp_action::XDP_DROP
    } else {
        xdp_action::XDP_PASS
    }
}

#[inline(always)]
fn early_drop(ctx: &XdpContext) -> bool {
    let Parsed::Packet(p) = parse(ctx.data(), ctx.data_end()) else {
        return false;
    };
    if p.proto == PROTO_ICMP {
        return false;
    }
    let Some(cluster) = cluster_entry(&p) else {
        return false;
    };
    // SAFETY: only tested for presence.
    if unsafe { KP_CT.get(key(&p, CtKind::Service)) }.is_some() {
        return false;
    }
    let Some(svc) = new_flow_entry(&p, &cluster) else {
        return false;
    };
    if !source_allowed(&svc, p.saddr) {
        stat(XdpStat::SourceRangeDrop);
        return true;
    }
    if svc.count == 0 && svc.flags & SVC_F_REJECT == 0 {
        stat(XdpStat::NoEndpointsDrop);
        return true;
    }
    false
}
