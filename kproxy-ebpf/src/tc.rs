//! The TC service path on node devices: NodePort / ExternalIP / LoadBalancer traffic from
//! outside the node, for both address families. The ingress programs (`kp_tc_in`,
//! `kp_tc_in6`) DNAT new flows to a backend chosen from the service maps and established ones
//! from the family's connection table (`KP_CT`, `KP_CT6`), and undo SNAT on replies; the
//! egress programs (`kp_tc_eg`, `kp_tc_eg6`) SNAT flows that need it to the device's node
//! address (`KP_NODE_ADDR4`, `KP_NODE_ADDR6`) and undo DNAT on replies. Entry kinds and the
//! reason for this split: `kproxy_common::ct`. The SNAT port range, the counters, the service
//! maps and the source-range trie are shared by both families (service-map and LPM keys hold
//! 16-byte addresses).
//!
//! One implementation, generic over the address family ([`Family`], and the header formats:
//! [`TcFamily`] here, [`IcmpErrors`], [`Reject`]), monomorphised into each family's programs.
//! Separate programs per family rather than a branch inside one: both paths in one program
//! exceed the 512-byte BPF stack (a BPF-to-BPF call does not help, the verifier adds the
//! caller's frame). TCX runs both pairs on every node device in turn; each passes the other
//! family's frames on after one ethertype compare. For the same reason the IPv6 programs run
//! the large steps off the common path as BPF-to-BPF calls with their own frames
//! ([`TcFamily::OWN_FRAMES`]).
//!
//! Per-packet cost (issue #3): headers are read and rewritten by direct packet access
//! ([`crate::packet`]), kernel calls are avoided on the common paths (each cost ≈ 40 ns in the
//! bench: in-place checksums, [`crate::skb_csum`]; a cached coarse clock,
//! [`crate::flow::now_coarse`]), and the ingress order of lookups makes an established or
//! reply packet cost one hash lookup before it is translated:
//! 1. destination port inside the SNAT port range (an array read): maybe the reply of a
//!    SNATed flow, `SnatIn` lookup;
//! 2. the connection table's `Service` entry: an established flow;
//! 3. the frontend filter, then `KP_SERVICES` only in the scopes the filter allows
//!    ([`crate::frontend`], shared with the XDP program): nothing found means "not for a
//!    service" and the packet goes on untouched; otherwise a new flow (source ranges; no
//!    endpoints ⇒ TCP RST / ICMP port unreachable or drop, [`crate::tc_reject`]; backend
//!    choice, CT entries, DNAT).
//!
//! So a packet that is not for a service costs one lookup (2) and, unless the filter gives a
//! false positive, no service-map lookup; a new flow to an external frontend one service-map
//! lookup. Until 2026-11 the order was 3 then 2 (one lookup for packets not for a service,
//! two for established ones); established service traffic is what this path exists for, so it
//! gets the single lookup. (Step 3 was then a cluster-scope lookup, and a new flow to an
//! external frontend read both scopes; the filter came later the same month.) A consequence
//! of 2 coming first: packets of an established flow keep their translation after the
//! frontend is deleted, until the agent purges the flow with its backends — as upstream's
//! conntrack keeps the NAT of established connections after the rules are gone.
//!
//! Egress: reply from a backend (`RevDnat`, src := frontend) → SNAT (the source kept in the
//! flow's `RevDnat` entry, looked up reversed; port allocated on the flow's first packet by
//! [`crate::flow::allocate_port`]). ICMP errors about translated flows: [`crate::tc_icmp`].
//!
//! Checksums: L4 checksums are updated in place (RFC 1624; for `CHECKSUM_PARTIAL` skbs only
//! the pseudo-header part), or with the kernel helper (`l4_csum_replace`, one 32-bit address
//! word at a time with `BPF_F_PSEUDO_HDR`, ports plain) for `CHECKSUM_COMPLETE` skbs, whose
//! `skb->csum` must follow ([`crate::skb_csum`]); the IPv4 header checksum is updated in
//! place (IPv6 has none). Packets that are not ours go on unchanged with `TC_ACT_UNSPEC` (TCX
//! "next"). No logging on this path. Not handled (passed unchanged): VLAN tags, IPv4
//! non-first fragments, IPv6 extension headers (fragments included, see
//! [`crate::packet6`]), IP options on the quoted header of ICMP errors.

use aya_ebpf::{
    bindings::{__sk_buff, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::classifier,
    programs::TcContext,
};
use kproxy_common::ct::{CT_F_FIN_ORIG, CT_F_FIN_REPLY, CtKind, TcStat};
use kproxy_common::service::{PROTO_TCP, PROTO_UDP, SVC_F_NODE_PORT, SVC_F_REJECT, ServiceValue};

use crate::family::{Family, V4, V6};
use crate::flow::{
    Egress, allocate_port, choose_backend, create_flow, egress_entry, end_flow, in_snat_range, now,
    reopens, touch,
};
use crate::frontend::{candidates, new_flow_entry, source_allowed};
use crate::maps::KP_TC_STATS;
use crate::packet::{IP_CSUM, IP_DADDR, IP_SADDR, Parsed, at, csum_replace4, l4_check_in_place};
use crate::packet6::{IP6_DADDR, IP6_SADDR, is_ipv6};
use crate::skb_csum::{CHECKSUM_COMPLETE, CHECKSUM_PARTIAL, ip_summed};
use crate::tc_icmp::{IcmpErrors, icmp_error};
use crate::tc_reject::{Reject, tcp_reset};

pub(crate) type Verdict = i32;
pub(crate) const NEXT: Verdict = TC_ACT_UNSPEC;
pub(crate) const DROP: Verdict = TC_ACT_SHOT;

/// `kproxy_common::ct::PROG_TC_INGRESS`.
#[classifier]
pub fn kp_tc_in(ctx: TcContext) -> i32 {
    ingress::<V4>(ctx)
}

/// `kproxy_common::ct::PROG_TC_EGRESS`.
#[classifier]
pub fn kp_tc_eg(ctx: TcContext) -> i32 {
    egress::<V4>(ctx)
}

/// `kproxy_common::ct6::PROG_TC6_INGRESS`.
#[classifier]
pub fn kp_tc_in6(ctx: TcContext) -> i32 {
    ingress::<V6>(ctx)
}

/// `kproxy_common::ct6::PROG_TC6_EGRESS`.
#[classifier]
pub fn kp_tc_eg6(ctx: TcContext) -> i32 {
    egress::<V6>(ctx)
}

/// What the TC path needs to know about a family's headers beyond [`Family`] (ICMP errors:
/// [`IcmpErrors`]; rejections: [`Reject`]).
pub(crate) trait TcFamily: Family {
    /// Whether the large steps off the common path (a new flow's backend choice and CT
    /// entries, a rejection, an ICMP error) run as BPF-to-BPF calls with their own stack
    /// frames ([`step`]): IPv6, whose addresses leave no room to inline them into one 512-byte
    /// stack. IPv4 has the room and inlines them, as it always did (no call added to its
    /// paths).
    const OWN_FRAMES: bool;
    /// Offset of the source address.
    const SADDR: usize;
    /// Offset of the destination address.
    const DADDR: usize;
    /// Whether the frame may be of the family, before parsing: IPv6 checks the ethertype, so
    /// the IPv4 programs' frames pass its programs after one compare; IPv4 leaves it to the
    /// parser.
    fn precheck(data: usize, end: usize) -> bool;
    /// Writes address `new` over `old` at offset `off` of `[data, end)`, with the IPv4 header
    /// checksum (IPv6 has none).
    fn store_addr(
        data: usize,
        end: usize,
        off: usize,
        old: &Self::Addr,
        new: &Self::Addr,
    ) -> Result<(), ()>;
}

impl TcFamily for V4 {
    const OWN_FRAMES: bool = false;
    const SADDR: usize = IP_SADDR;
    const DADDR: usize = IP_DADDR;

    #[inline(always)]
    fn precheck(_: usize, _: usize) -> bool {
        true
    }

    #[inline(always)]
    fn store_addr(data: usize, end: usize, off: usize, old: &u32, new: &u32) -> Result<(), ()> {
        let check = at::<u16>(data, end, IP_CSUM).ok_or(())?;
        let a = at::<u32>(data, end, off).ok_or(())?;
        // SAFETY: bounds-checked by `at`.
        unsafe {
            *check = csum_replace4(*check, *old, *new);
            *a = *new;
        }
        Ok(())
    }
}

impl TcFamily for V6 {
    const OWN_FRAMES: bool = true;
    const SADDR: usize = IP6_SADDR;
    const DADDR: usize = IP6_DADDR;

    #[inline(always)]
    fn precheck(data: usize, end: usize) -> bool {
        is_ipv6(data, end)
    }

    #[inline(always)]
    fn store_addr(
        data: usize,
        end: usize,
        off: usize,
        _: &[u32; 4],
        new: &[u32; 4],
    ) -> Result<(), ()> {
        let a = at::<[u32; 4]>(data, end, off).ok_or(())?;
        // SAFETY: bounds-checked by `at`.
        unsafe { *a = *new };
        Ok(())
    }
}

/// Counts `s` in `KP_TC_STATS` (both families).
#[inline(always)]
pub(crate) fn stat(s: TcStat) {
    if let Some(v) = KP_TC_STATS.get_ptr_mut(s.index()) {
        // SAFETY: per-CPU value of this CPU; programs are not preempted on a CPU.
        unsafe { *v += 1 };
    }
}

/// Runs `step`, a large step off the common path, inline, or for [`TcFamily::OWN_FRAMES`] in
/// a BPF-to-BPF call with its own stack frame ([`own_frame`]).
#[inline(always)]
fn step<F: TcFamily>(ctx: &mut TcContext, step: impl FnOnce(&mut TcContext) -> Verdict) -> Verdict {
    if F::OWN_FRAMES {
        own_frame(ctx.skb.skb, step)
    } else {
        step(ctx)
    }
}

/// [`step`] in its own stack frame: only the caller's small frame adds to it.
#[inline(never)]
fn own_frame(skb: *mut __sk_buff, step: impl FnOnce(&mut TcContext) -> Verdict) -> Verdict {
    step(&mut TcContext::new(skb))
}

/// Parses the packet by direct access; when its headers are not all in the linear area, pulls
/// them in once ([`Family::PARSE_LEN`] bytes, or the whole packet if shorter) and parses
/// again. `None`: not a packet of the family we handle.
#[inline(always)]
pub(crate) fn parse<F: TcFamily>(ctx: &TcContext) -> Option<F::Packet> {
    if !F::precheck(ctx.data(), ctx.data_end()) {
        return None;
    }
    match F::parse(ctx.data(), ctx.data_end()) {
        Parsed::Packet(p) => return Some(p),
        Parsed::Other => return None,
        Parsed::Short => {}
    }
    let len = ctx.len().min(F::PARSE_LEN);
    ctx.pull_data(len).ok()?;
    match F::parse(ctx.data(), ctx.data_end()) {
        Parsed::Packet(p) => Some(p),
        _ => None,
    }
}

/// An ingress program.
#[inline(always)]
fn ingress<F: IcmpErrors + Reject>(mut ctx: TcContext) -> Verdict {
    let Some(p) = parse::<F>(&ctx) else {
        return NEXT;
    };
    if F::proto(&p) == F::ICMP {
        return step::<F>(&mut ctx, |ctx| {
            icmp_error::<F, true>(ctx, &p).unwrap_or(NEXT)
        });
    }
    ingress_packet::<F>(&mut ctx, &p).unwrap_or(DROP)
}

/// An egress program.
#[inline(always)]
fn egress<F: IcmpErrors>(mut ctx: TcContext) -> Verdict {
    let Some(p) = parse::<F>(&ctx) else {
        return NEXT;
    };
    if F::proto(&p) == F::ICMP {
        return step::<F>(&mut ctx, |ctx| {
            icmp_error::<F, false>(ctx, &p).unwrap_or(NEXT)
        });
    }
    egress_packet::<F>(&mut ctx, &p).unwrap_or(DROP)
}

#[inline(always)]
fn ingress_packet<F: Reject>(ctx: &mut TcContext, p: &F::Packet) -> Result<Verdict, ()> {
    // A reply to a SNATed flow: give it back its client as destination.
    if in_snat_range(F::dport(p)) {
        let k = F::key_of(p, CtKind::SnatIn);
        if let Some(e) = F::ct().get_ptr_mut(&k) {
            touch::<F>(e, F::tcp_flags(p), CT_F_FIN_REPLY);
            let (addr, port) = F::nat(e);
            // Started by the XDP fast path: the egress toward the client needs its `RevDnat`
            // entry.
            F::complete_xdp_reply(e, &k);
            rewrite::<F>(ctx, p, true, &addr, port)?;
            stat(TcStat::Reply);
            return Ok(NEXT);
        }
    }
    // An established flow keeps its backend (one lookup; see the module docs); a new
    // connection on a closed flow's tuple is a new flow (`crate::flow::reopens`).
    if let Some(e) = F::ct().get_ptr_mut(F::key_of(p, CtKind::Service)) {
        if !reopens::<F>(e, F::tcp_flags(p)) {
            touch::<F>(e, F::tcp_flags(p), CT_F_FIN_ORIG);
            let (addr, port) = F::nat(e);
            // Started by the XDP fast path: the egress toward the backend needs its `RevDnat`
            // entry (the SNAT source).
            F::complete_xdp_flow(e, p);
            rewrite::<F>(ctx, p, true, &addr, port)?;
            stat(TcStat::Established);
            return Ok(NEXT);
        }
        end_flow::<F>(e, F::saddr(p), F::sport(p), F::proto(p));
    }
    // Not a frontend (most such packets stop at the filter): not ours.
    let Some(svc) = new_flow_entry::<F>(p, candidates::<F>(p)) else {
        return Ok(NEXT);
    };
    Ok(new_flow::<F>(ctx, p, &svc))
}

/// A new flow to `svc`: source ranges, then a rejection when it has no endpoints, else
/// [`balance`].
#[inline(always)]
fn new_flow<F: Reject>(ctx: &mut TcContext, p: &F::Packet, svc: &ServiceValue) -> Verdict {
    if !source_allowed::<F>(svc, *F::saddr(p)) {
        stat(TcStat::SourceRangeDrop);
        return DROP;
    }
    if svc.count == 0 {
        stat(TcStat::NoEndpoints);
        if svc.flags & SVC_F_REJECT == 0 {
            return DROP;
        }
        if F::proto(p) == PROTO_TCP {
            return step::<F>(ctx, |ctx| tcp_reset::<F>(ctx, p).unwrap_or(DROP));
        }
        // UDP: a NodePort is a node address with nothing listening on the port, so the
        // node's stack answers ICMP port unreachable itself; other frontends get it from here.
        if svc.flags & SVC_F_NODE_PORT != 0 {
            return NEXT;
        }
        return step::<F>(ctx, |ctx| F::udp_unreachable(ctx, p).unwrap_or(DROP));
    }
    step::<F>(ctx, |ctx| balance::<F>(ctx, p, svc).unwrap_or(DROP))
}

/// A new flow to `svc` (which has endpoints and admits the client): backend choice, CT
/// entries, DNAT.
#[inline(always)]
fn balance<F: TcFamily>(
    ctx: &mut TcContext,
    p: &F::Packet,
    svc: &ServiceValue,
) -> Result<Verdict, ()> {
    if svc.count == 0 {
        // Checked by the caller; repeated so the slot choice has no division-by-zero panic
        // path in an own frame (the verifier rejects one).
        return Ok(DROP);
    }
    let ts = now();
    let Some((backend_id, be)) = choose_backend::<F>(svc, p, ts, None) else {
        return Ok(DROP);
    };
    let Ok((be_addr, _)) = create_flow::<F>(p, svc, backend_id, &be, ts) else {
        stat(TcStat::CtInsertFailed);
        return Ok(DROP);
    };
    rewrite::<F>(ctx, p, true, &be_addr, be.port)?;
    stat(TcStat::NewFlow);
    Ok(NEXT)
}

#[inline(always)]
fn egress_packet<F: TcFamily>(ctx: &mut TcContext, p: &F::Packet) -> Result<Verdict, ()> {
    let (e, n_addr, n_port) = match egress_entry::<F>(
        *F::saddr(p),
        *F::daddr(p),
        F::sport(p),
        F::dport(p),
        F::proto(p),
    ) {
        None => return Ok(NEXT),
        // A reply from a backend: its source becomes the frontend again.
        Some(Egress::Reply(e)) => {
            touch::<F>(e, F::tcp_flags(p), CT_F_FIN_REPLY);
            let (addr, port) = F::nat(e);
            rewrite::<F>(ctx, p, false, &addr, port)?;
            stat(TcStat::Reply);
            return Ok(NEXT);
        }
        // A packet to a backend: its flow's SNAT source (see `crate::flow::snat_slot`).
        Some(Egress::Snat(e, addr, port)) => (e, addr, port),
    };
    touch::<F>(e, F::tcp_flags(p), CT_F_FIN_ORIG);
    // SAFETY: fields of a lookup result.
    let (mut addr, mut port) = unsafe { (*n_addr, *n_port) };
    if addr == F::Addr::default() {
        // SAFETY: reads the context's ifindex field.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let Some(node) = F::node_addr(ifindex) else {
            stat(TcStat::SnatExhausted);
            return Ok(DROP);
        };
        addr = node;
        // SAFETY: lookup result, read in place (a copy would cost stack).
        let template = unsafe { &*e };
        port = match allocate_port::<F>(
            *F::saddr(p),
            *F::daddr(p),
            F::sport(p),
            F::dport(p),
            F::proto(p),
            addr,
            template,
            None,
        ) {
            Some(port) => port,
            None => {
                stat(TcStat::SnatExhausted);
                return Ok(DROP);
            }
        };
        // SAFETY: fields of a lookup result; only the flow's first packet gets here.
        unsafe {
            *n_addr = addr;
            *n_port = port;
        }
    }
    rewrite::<F>(ctx, p, false, &addr, port)?;
    stat(TcStat::Snat);
    Ok(NEXT)
}

/// Feeds an address change `old` → `new` into the checksum at `csum` with the kernel helper,
/// one 32-bit word at a time (`flags`: whether it is a pseudo-header field and how to treat a
/// zero UDP checksum).
#[inline(always)]
pub(crate) fn csum_words(
    ctx: &mut TcContext,
    csum: usize,
    old: &[u32],
    new: &[u32],
    flags: u64,
) -> Result<(), ()> {
    for (&old, &new) in old.iter().zip(new) {
        if old != new {
            ctx.l4_csum_replace(csum, old as u64, new as u64, flags | 4)
                .map_err(|_| ())?;
        }
    }
    Ok(())
}

/// Rewrites the destination (`dst == true`) or source address and port of a TCP/UDP packet,
/// with checksums: the L4 one in place unless the skb is `CHECKSUM_COMPLETE` (then by the
/// kernel helper, which also updates `skb->csum`; see [`crate::skb_csum`]), the IPv4
/// header's and the fields themselves in place.
#[inline(always)]
fn rewrite<F: TcFamily>(
    ctx: &mut TcContext,
    p: &F::Packet,
    dst: bool,
    addr: &F::Addr,
    port: u16,
) -> Result<(), ()> {
    let l4_off = F::l4(p);
    let (old_addr, old_port, addr_off, port_off) = if dst {
        (*F::daddr(p), F::dport(p), F::DADDR, l4_off + 2)
    } else {
        (*F::saddr(p), F::sport(p), F::SADDR, l4_off)
    };
    let proto = F::proto(p);
    let l4 = proto == PROTO_TCP || proto == PROTO_UDP;
    let ports = l4 && old_port != port;
    let summed = ip_summed(ctx);
    if l4 && summed == CHECKSUM_COMPLETE {
        let (csum, flags) = if proto == PROTO_TCP {
            (l4_off + 16, 0)
        } else {
            (l4_off + 6, BPF_F_MARK_MANGLED_0 as u64)
        };
        csum_words(
            ctx,
            csum,
            F::words(&old_addr),
            F::words(addr),
            flags | BPF_F_PSEUDO_HDR as u64,
        )?;
        if ports {
            ctx.l4_csum_replace(csum, old_port as u64, port as u64, flags | 2)
                .map_err(|_| ())?;
        }
    } else if l4 {
        // One bounds check for the whole header: checks LLVM merges are lost on the verifier.
        let (data, end) = (ctx.data(), ctx.data_end());
        let check = if proto == PROTO_TCP {
            // SAFETY: offset 16 of a checked 18-byte header.
            unsafe { (at::<[u16; 9]>(data, end, l4_off).ok_or(())? as *mut u16).add(8) }
        } else {
            // SAFETY: offset 6 of a checked 8-byte header.
            unsafe { (at::<[u16; 4]>(data, end, l4_off).ok_or(())? as *mut u16).add(3) }
        };
        // SAFETY: bounds-checked above.
        unsafe {
            *check = l4_check_in_place(
                *check,
                proto == PROTO_UDP,
                summed == CHECKSUM_PARTIAL,
                F::words(&old_addr),
                F::words(addr),
                ports.then_some((old_port, port)),
            );
        }
    }
    // Helpers invalidate every packet pointer: derive them again.
    let (data, end) = (ctx.data(), ctx.data_end());
    if ports {
        let pp = at::<u16>(data, end, port_off).ok_or(())?;
        // SAFETY: bounds-checked by `at`.
        unsafe { *pp = port };
    }
    if old_addr != *addr {
        F::store_addr(data, end, addr_off, &old_addr, addr)?;
    }
    Ok(())
}
