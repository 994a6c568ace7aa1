//! `kp_xdp`: the XDP program on node devices (`--bpf-xdp`), in front of the TC service path
//! ([`crate::tc`]). Per packet, with TC's own classification ([`crate::frontend`]) and
//! connection table ([`crate::flow`]):
//!
//! 1. a reply from a remote backend to a SNATed flow (destination port in the SNAT range and
//!    its `SnatIn` entry exists) is translated back and forwarded to the client
//!    ([`crate::xdp_fwd::reply`]);
//! 2. not a frontend per the frontend filter: passed (no hash lookup);
//! 3. an established flow (`Service` entry): forwarded by the fast path when its backend is
//!    remote ([`crate::xdp_fwd::forward`]), else passed;
//! 4. a new flow: dropped before the stack when TC would drop it anyway — clients outside a
//!    frontend's loadBalancerSourceRanges, frontends without endpoints whose packets are
//!    dropped rather than rejected (eTP/iTP=Local without local endpoints); otherwise
//!    load-balanced exactly as TC does and forwarded when the backend is remote
//!    ([`crate::xdp_fwd::new_flow`]).
//!
//! Everything the fast path cannot do is passed (`XDP_PASS`) and TC handles it as if XDP were
//! off (see [`crate::xdp_fwd`]); rejections (TCP RST, ICMP port unreachable) stay with TC,
//! which builds them. A source-range change does not affect admitted flows (their CT entries
//! exist), exactly as with TC alone.

use aya_ebpf::{bindings::xdp_action, macros::xdp, programs::XdpContext};
use kproxy_common::ct::{CtKind, PROTO_ICMP, XdpStat};
use kproxy_common::service::SVC_F_REJECT;

use crate::family::{Family, V4};
use crate::flow::{end_flow, in_snat_range, reopens};
use crate::frontend::{candidates, new_flow_entry, source_allowed};
use crate::maps::{KP_CT, KP_XDP_STATS};
use crate::packet::{Parsed, parse};
use crate::xdp_fwd::{forward, new_flow, plain, reply};

#[inline(always)]
pub(crate) fn stat(s: XdpStat) {
    if let Some(v) = KP_XDP_STATS.get_ptr_mut(s.index()) {
        // SAFETY: per-CPU value of this CPU; programs are not preempted on a CPU.
        unsafe { *v += 1 };
    }
}

/// Counts `s` and passes the frame.
#[inline(always)]
fn pass(s: XdpStat) -> u32 {
    stat(s);
    xdp_action::XDP_PASS
}

/// `kproxy_common::ct::PROG_XDP`.
#[xdp]
pub fn kp_xdp(ctx: XdpContext) -> u32 {
    let Parsed::Packet(p) = parse(ctx.data(), ctx.data_end()) else {
        return xdp_action::XDP_PASS;
    };
    if p.proto == PROTO_ICMP {
        return xdp_action::XDP_PASS;
    }
    if in_snat_range(p.dport)
        && let Some(e) = KP_CT.get_ptr_mut(V4::key_of(&p, CtKind::SnatIn))
    {
        return match plain(&ctx, &p) {
            Ok(h) => reply(&ctx, &p, &h, e),
            Err(s) => pass(s),
        };
    }
    let c = candidates::<V4>(&p);
    if c.none() {
        return xdp_action::XDP_PASS;
    }
    if let Some(e) = KP_CT.get_ptr_mut(V4::key_of(&p, CtKind::Service)) {
        if !reopens::<V4>(e, p.tcp_flags) {
            let h = match plain(&ctx, &p) {
                Ok(h) => h,
                Err(s) => return pass(s),
            };
            // SAFETY: lookup result, read by value.
            let (addr, port, flags) = unsafe { ((*e).nat_addr, (*e).nat_port, (*e).flags) };
            return forward(&ctx, &p, &h, (addr, port), flags, e);
        }
        // A new connection on a closed flow's tuple: a new flow, as in TC.
        end_flow::<V4>(e, &p.saddr, p.sport, p.proto);
    }
    let Some(svc) = new_flow_entry::<V4>(&p, c) else {
        return xdp_action::XDP_PASS;
    };
    if !source_allowed::<V4>(&svc, p.saddr) {
        stat(XdpStat::SourceRangeDrop);
        return xdp_action::XDP_DROP;
    }
    if svc.count == 0 {
        if svc.flags & SVC_F_REJECT == 0 {
            stat(XdpStat::NoEndpointsDrop);
            return xdp_action::XDP_DROP;
        }
        // TC builds the rejection.
        return xdp_action::XDP_PASS;
    }
    match plain(&ctx, &p) {
        Ok(h) => new_flow(&ctx, &p, &h, &svc),
        Err(s) => pass(s),
    }
}
