//! The TC service path on node devices (IPv4): NodePort / ExternalIP / LoadBalancer traffic
//! from outside the node. `kp_tc_in` (ingress) DNATs new flows to a backend chosen from the
//! service maps and established ones from `KP_CT`, and undoes SNAT on replies; `kp_tc_eg`
//! (egress) SNATs flows that need it to the device's node address and undoes DNAT on replies.
//! Entry kinds and the reason for this split: `kproxy_common::ct`.
//!
//! Per-packet cost (issue #3): headers are read and rewritten by direct packet access
//! ([`crate::packet`]), kernel calls are avoided on the common paths (each cost ≈ 40 ns in the
//! bench: in-place checksums, [`crate::skb_csum`]; a cached coarse clock,
//! [`crate::flow::now_coarse`]), and the ingress order of lookups makes an established or
//! reply packet cost one hash lookup before it is translated:
//! 1. destination port inside the SNAT port range (an array read): maybe the reply of a
//!    SNATed flow, `SnatIn` lookup;
//! 2. the `KP_CT` `Service` entry: an established flow;
//! 3. the frontend filter, then `KP_SERVICES` only in the scopes the filter allows
//!    ([`crate::frontend`], shared with the XDP program): nothing found means "not for a
//!    service" and the packet goes on untouched; otherwise a new flow.
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
//! L4 checksums are updated in place (RFC 1624; for `CHECKSUM_PARTIAL` skbs only the
//! pseudo-header part), or with the kernel helper (`l4_csum_replace`) for `CHECKSUM_COMPLETE`
//! skbs, whose `skb->csum` must follow ([`crate::skb_csum`]); the IPv4 header checksum is
//! updated in place. Packets that are not ours go on unchanged with
//! `TC_ACT_UNSPEC` (TCX "next"). No logging on this path. IPv6 frames pass unchanged here;
//! [`crate::tc6`]'s programs, attached next to these, handle them. Not handled (passed
//! unchanged): VLAN tags, IP options on the quoted header of ICMP errors, non-first fragments.

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR, TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_redirect, bpf_skb_change_tail},
    macros::{classifier, map},
    maps::PerCpuArray,
    programs::TcContext,
};
use kproxy_common::ct::{
    CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_NO_REV, CtEntry, CtKey, CtKind, PROTO_ICMP, TC_STATS,
    TcStat,
};
use kproxy_common::service::{PROTO_TCP, PROTO_UDP, SVC_F_NODE_PORT, SVC_F_REJECT, ServiceValue};

// The flow state moved to `crate::flow` (shared with the XDP fast path); re-exported under
// the old paths.
use crate::flow::{
    Egress, Family, KP_NODE_ADDR4, NewFlow, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN, V4, adopt_xdp_flow,
    adopt_xdp_reply, allocate_port, choose_backend, create_flow, egress_entry_in, end_flow,
    in_snat_range, now, reopens, touch,
};
pub(crate) use crate::flow::{KP_CT, key};
use crate::frontend::{candidates, new_flow_entry, source_allowed};
use crate::packet::{
    ETH_HLEN, IP_CSUM, IP_DADDR, IP_OFF, IP_SADDR, PARSE_LEN, Packet, Parsed, at, csum_replace4,
    fold, l4_check_in_place, parse,
};
use crate::skb_csum::{CHECKSUM_COMPLETE, CHECKSUM_PARTIAL, ip_summed};

/// `kproxy_common::ct::MAP_TC_STATS`.
#[map]
static KP_TC_STATS: PerCpuArray<u64> = PerCpuArray::pinned(TC_STATS, 0);

const IP_OFFSET_MASK: u16 = 0x1fff;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

pub(crate) type Verdict = i32;
pub(crate) const NEXT: Verdict = TC_ACT_UNSPEC;
pub(crate) const DROP: Verdict = TC_ACT_SHOT;

/// Offset of the L4 checksum, and the `l4_csum_replace` flags it needs.
#[inline(always)]
fn l4_csum(p: &Packet) -> (usize, u64) {
    if p.proto == PROTO_TCP {
        (p.l4 + 16, 0)
    } else {
        (p.l4 + 6, BPF_F_MARK_MANGLED_0 as u64)
    }
}

#[inline(always)]
pub(crate) fn stat(s: TcStat) {
    if let Some(v) = KP_TC_STATS.get_ptr_mut(s.index()) {
        // SAFETY: per-CPU value of this CPU; programs are not preempted on a CPU.
        unsafe { *v += 1 };
    }
}

/// Parses the packet by direct access; when its headers are not all in the linear area, pulls
/// them in once ([`PARSE_LEN`] bytes, or the whole packet if shorter) and parses again.
/// `None`: not an IPv4 packet we handle.
#[inline(always)]
fn parse_tc(ctx: &TcContext) -> Option<Packet> {
    parse_pulled(ctx, parse, PARSE_LEN)
}

/// [`parse_tc`] for either family: `parse` is the family's parser, `parse_len` the bytes its
/// headers take at most.
#[inline(always)]
pub(crate) fn parse_pulled<P>(
    ctx: &TcContext,
    parse: impl Fn(usize, usize) -> Parsed<P>,
    parse_len: u32,
) -> Option<P> {
    match parse(ctx.data(), ctx.data_end()) {
        Parsed::Packet(p) => return Some(p),
        Parsed::Other => return None,
        Parsed::Short => {}
    }
    let len = ctx.len().min(parse_len);
    ctx.pull_data(len).ok()?;
    match parse(ctx.data(), ctx.data_end()) {
        Parsed::Packet(p) => Some(p),
        _ => None,
    }
}

/// Rewrites the destination (`dst == true`) or source address and port, with checksums: the
/// L4 one in place unless the skb is `CHECKSUM_COMPLETE` (then by the kernel helper, which
/// also updates `skb->csum`; see [`crate::skb_csum`]), the IPv4 header's and the fields
/// themselves in place.
#[inline(always)]
fn rewrite(ctx: &mut TcContext, p: &Packet, dst: bool, addr: u32, port: u16) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if dst {
        (p.daddr, p.dport, IP_DADDR, p.l4 + 2)
    } else {
        (p.saddr, p.sport, IP_SADDR, p.l4)
    };
    let l4 = p.proto == PROTO_TCP || p.proto == PROTO_UDP;
    let ports = l4 && old_port != port;
    let summed = ip_summed(ctx);
    if l4 && summed == CHECKSUM_COMPLETE {
        let (csum, flags) = l4_csum(p);
        if old_addr != addr {
            ctx.l4_csum_replace(
                csum,
                old_addr as u64,
                addr as u64,
                flags | BPF_F_PSEUDO_HDR as u64 | 4,
            )
            .map_err(|_| ())?;
        }
        if ports {
            ctx.l4_csum_replace(csum, old_port as u64, port as u64, flags | 2)
                .map_err(|_| ())?;
        }
    } else if l4 {
        // One bounds check for the whole header: checks LLVM merges are lost on the verifier.
        let (data, end) = (ctx.data(), ctx.data_end());
        let check = if p.proto == PROTO_TCP {
            // SAFETY: offset 16 of a checked 18-byte header.
            unsafe { (at::<[u16; 9]>(data, end, p.l4).ok_or(())? as *mut u16).add(8) }
        } else {
            // SAFETY: offset 6 of a checked 8-byte header.
            unsafe { (at::<[u16; 4]>(data, end, p.l4).ok_or(())? as *mut u16).add(3) }
        };
        let ports = ports.then_some((old_port, port));
        // SAFETY: bounds-checked above.
        unsafe {
            *check = l4_check_in_place(
                *check,
                p.proto == PROTO_UDP,
                summed == CHECKSUM_PARTIAL,
                &[(old_addr, addr)],
                ports,
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
    if old_addr != addr {
        let check = at::<u16>(data, end, IP_CSUM).ok_or(())?;
        let a = at::<u32>(data, end, addr_off).ok_or(())?;
        // SAFETY: bounds-checked by `at`.
        unsafe {
            *check = csum_replace4(*check, old_addr, addr);
            *a = addr;
        }
    }
    Ok(())
}

/// `kproxy_common::ct::PROG_TC_INGRESS`.
#[classifier]
pub fn kp_tc_in(mut ctx: TcContext) -> i32 {
    let Some(p) = parse_tc(&ctx) else {
        return NEXT;
    };
    if p.proto == PROTO_ICMP {
        return icmp_error::<V4, true>(&mut ctx, &p).unwrap_or(NEXT);
    }
    ingress(&mut ctx, &p).unwrap_or(DROP)
}

/// `kproxy_common::ct::PROG_TC_EGRESS`.
#[classifier]
pub fn kp_tc_eg(mut ctx: TcContext) -> i32 {
    let Some(p) = parse_tc(&ctx) else {
        return NEXT;
    };
    if p.proto == PROTO_ICMP {
        return icmp_error::<V4, false>(&mut ctx, &p).unwrap_or(NEXT);
    }
    egress(&mut ctx, &p).unwrap_or(DROP)
}

#[inline(always)]
fn ingress(ctx: &mut TcContext, p: &Packet) -> Result<Verdict, ()> {
    // A reply to a SNATed flow: give it back its client as destination.
    if in_snat_range(p.dport) {
        let k = key(p, CtKind::SnatIn);
        if let Some(e) = KP_CT.get_ptr_mut(&k) {
            touch(e, p.tcp_flags, CT_F_FIN_REPLY);
            // SAFETY: lookup result, read by value.
            let (addr, port, flags) = unsafe { ((*e).nat_addr, (*e).nat_port, (*e).flags) };
            if flags & CT_F_NO_REV != 0 {
                // Started by the XDP fast path: the egress toward the client needs its
                // `RevDnat` entry.
                adopt_xdp_reply(e, &k);
            }
            rewrite(ctx, p, true, addr, port)?;
            stat(TcStat::Reply);
            return Ok(NEXT);
        }
    }
    // An established flow keeps its backend (one lookup; see the module docs); a new
    // connection on a closed flow's tuple is a new flow (`crate::flow::reopens`).
    if let Some(e) = KP_CT.get_ptr_mut(key(p, CtKind::Service)) {
        if !reopens::<V4>(e, p.tcp_flags) {
            touch(e, p.tcp_flags, CT_F_FIN_ORIG);
            // SAFETY: as above.
            let (addr, port, flags) = unsafe { ((*e).nat_addr, (*e).nat_port, (*e).flags) };
            if flags & CT_F_NO_REV != 0 {
                // Started by the XDP fast path: the egress toward the backend needs its
                // `RevDnat` entry (the SNAT source).
                adopt_xdp_flow(e, p);
            }
            rewrite(ctx, p, true, addr, port)?;
            stat(TcStat::Established);
            return Ok(NEXT);
        }
        end_flow::<V4>(e, &p.saddr, p.sport, p.proto);
    }
    // Not a frontend (most such packets stop at the filter): not ours.
    let Some(svc) = new_flow_entry(p, candidates(p)) else {
        return Ok(NEXT);
    };
    new_flow(ctx, p, &svc)
}

#[inline(always)]
fn new_flow(ctx: &mut TcContext, p: &Packet, svc: &ServiceValue) -> Result<Verdict, ()> {
    if !source_allowed(svc, p.saddr) {
        stat(TcStat::SourceRangeDrop);
        return Ok(DROP);
    }
    if svc.count == 0 {
        stat(TcStat::NoEndpoints);
        if svc.flags & SVC_F_REJECT == 0 {
            return Ok(DROP);
        }
        if p.proto == PROTO_TCP {
            return Ok(tcp_reset(ctx, p).unwrap_or(DROP));
        }
        // UDP: a NodePort is a node address with nothing listening on the port, so the
        // node's stack answers ICMP port unreachable itself; other frontends get it from here.
        if svc.flags & SVC_F_NODE_PORT != 0 {
            return Ok(NEXT);
        }
        return Ok(udp_unreachable(ctx, p).unwrap_or(DROP));
    }
    let ts = now();
    let Some((backend_id, be)) = choose_backend(svc, p, ts, None) else {
        return Ok(DROP);
    };
    let Ok(NewFlow {
        be_addr, be_port, ..
    }) = create_flow(p, svc, backend_id, &be, ts)
    else {
        stat(TcStat::CtInsertFailed);
        return Ok(DROP);
    };
    rewrite(ctx, p, true, be_addr, be_port)?;
    stat(TcStat::NewFlow);
    Ok(NEXT)
}

#[inline(always)]
fn egress(ctx: &mut TcContext, p: &Packet) -> Result<Verdict, ()> {
    let (e, n_addr, n_port) =
        match egress_entry_in::<V4>(p.saddr, p.daddr, p.sport, p.dport, p.proto) {
            None => return Ok(NEXT),
            // A reply from a backend: its source becomes the frontend again.
            Some(Egress::Reply(e)) => {
                touch(e, p.tcp_flags, CT_F_FIN_REPLY);
                // SAFETY: lookup result, read by value.
                let (addr, port) = unsafe { ((*e).nat_addr, (*e).nat_port) };
                rewrite(ctx, p, false, addr, port)?;
                stat(TcStat::Reply);
                return Ok(NEXT);
            }
            // A packet to a backend: its flow's SNAT source (see `crate::flow::snat_slot_in`).
            Some(Egress::Snat(e, addr, port)) => (e, addr, port),
        };
    touch(e, p.tcp_flags, CT_F_FIN_ORIG);
    // SAFETY: fields of a lookup result.
    let (mut addr, mut port) = unsafe { (*n_addr, *n_port) };
    if addr == 0 {
        // SAFETY: reads the context's ifindex field.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let Some(node) = (unsafe { KP_NODE_ADDR4.get(ifindex) }) else {
            stat(TcStat::SnatExhausted);
            return Ok(DROP);
        };
        addr = node.addr;
        // SAFETY: lookup result, read in place (a copy would cost stack).
        let template = unsafe { &*e };
        port = match allocate_port(p, addr, template, None) {
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
    rewrite(ctx, p, false, addr, port)?;
    stat(TcStat::Snat);
    Ok(NEXT)
}

/// Answers a TCP segment to a frontend without endpoints with a RST from the frontend, sent
/// back out of the device it came in on (RFC 9293 §3.10.7.1 reset generation). Segments
/// carrying data are dropped instead (the client's next SYN gets the RST).
#[inline(always)]
fn tcp_reset(ctx: &mut TcContext, p: &Packet) -> Result<Verdict, ()> {
    if p.tcp_flags & TCP_RST != 0 || p.l4 != IP_OFF + 20 {
        return Ok(DROP);
    }
    let tot_len = u16::from_be(ctx.load::<u16>(IP_OFF + 2).map_err(|_| ())?);
    let tcp_len = (tot_len as usize).wrapping_sub(20);
    if !reset_tcp_header(ctx, p.l4, p.tcp_flags, p.sport, p.dport, tcp_len)? {
        return Ok(DROP);
    }
    ctx.store(IP_SADDR, &p.daddr, 0).map_err(|_| ())?;
    ctx.store(IP_DADDR, &p.saddr, 0).map_err(|_| ())?;
    let old_tot = tot_len.to_be();
    let new_tot = 40u16.to_be();
    ctx.l3_csum_replace(IP_CSUM, old_tot as u64, new_tot as u64, 2)
        .map_err(|_| ())?;
    ctx.store(IP_OFF + 2, &new_tot, 0).map_err(|_| ())?;
    bounce(ctx, (ETH_HLEN + 40) as u32)
}

/// Sends a reply built in place back out of the device it came in on, for both families:
/// swaps the Ethernet addresses, trims the frame to `len` bytes and redirects it.
#[inline(always)]
pub(crate) fn bounce(ctx: &TcContext, len: u32) -> Result<Verdict, ()> {
    let dst_mac: [u8; 6] = ctx.load(0).map_err(|_| ())?;
    let src_mac: [u8; 6] = ctx.load(6).map_err(|_| ())?;
    ctx.store(0, &src_mac, 0).map_err(|_| ())?;
    ctx.store(6, &dst_mac, 0).map_err(|_| ())?;
    // SAFETY: the context pointer is valid for the program's run.
    unsafe {
        if bpf_skb_change_tail(ctx.skb.skb, len, 0) != 0 {
            return Ok(DROP);
        }
        let ifindex = (*ctx.skb.skb).ifindex;
        Ok(bpf_redirect(ifindex, 0) as i32)
    }
}

/// Turns the TCP header at `l4` of a segment without data (`tcp_len` bytes from the IP
/// header's length) into a RST answering it, for both families: sequence numbers per RFC 9293
/// §3.10.7.1, ports swapped, options dropped, the checksum updated (the pseudo header's length
/// included; the caller swaps the addresses, which leaves it unchanged). `Ok(false)`: the
/// segment carries data or a bad data offset; nothing was changed.
#[inline(always)]
pub(crate) fn reset_tcp_header(
    ctx: &TcContext,
    l4: usize,
    tcp_flags: u8,
    sport: u16,
    dport: u16,
    tcp_len: usize,
) -> Result<bool, ()> {
    let doff_word: u16 = ctx.load(l4 + 12).map_err(|_| ())?;
    let doff = ((u16::from_be(doff_word) >> 12) as usize) * 4;
    if !(20..=60).contains(&doff) || tcp_len != doff {
        return Ok(false);
    }
    let seq = u32::from_be(ctx.load::<u32>(l4 + 4).map_err(|_| ())?);
    let ack = u32::from_be(ctx.load::<u32>(l4 + 8).map_err(|_| ())?);
    let (new_seq, new_ack, new_flags) = if tcp_flags & TCP_ACK != 0 {
        (ack, 0u32, TCP_RST)
    } else {
        let mut len = 0u32;
        if tcp_flags & TCP_SYN != 0 {
            len += 1;
        }
        if tcp_flags & TCP_FIN != 0 {
            len += 1;
        }
        (0u32, seq.wrapping_add(len), TCP_RST | TCP_ACK)
    };
    let csum = l4 + 16;
    // Options are dropped: take their sum out of the checksum (ignored for CHECKSUM_PARTIAL,
    // where the stack sums the data later).
    let opt_words = (doff - 20) / 4;
    let mut i = 0usize;
    while i < 10 {
        if i >= opt_words {
            break;
        }
        let w: u32 = ctx.load(l4 + 20 + i * 4).map_err(|_| ())?;
        ctx.l4_csum_replace(csum, w as u64, 0, 4).map_err(|_| ())?;
        i += 1;
    }
    let new_doff_word = ((5u16 << 12) | u16::from(new_flags)).to_be();
    ctx.l4_csum_replace(csum, seq.to_be() as u64, new_seq.to_be() as u64, 4)
        .map_err(|_| ())?;
    ctx.l4_csum_replace(csum, ack.to_be() as u64, new_ack.to_be() as u64, 4)
        .map_err(|_| ())?;
    ctx.l4_csum_replace(csum, doff_word as u64, new_doff_word as u64, 2)
        .map_err(|_| ())?;
    let window: u16 = ctx.load(l4 + 14).map_err(|_| ())?;
    let urg: u16 = ctx.load(l4 + 18).map_err(|_| ())?;
    ctx.l4_csum_replace(csum, window as u64, 0, 2)
        .map_err(|_| ())?;
    ctx.l4_csum_replace(csum, urg as u64, 0, 2)
        .map_err(|_| ())?;
    // The pseudo header's upper-layer length.
    let old_len = (tcp_len as u16).to_be();
    let new_len = 20u16.to_be();
    ctx.l4_csum_replace(
        csum,
        old_len as u64,
        new_len as u64,
        BPF_F_PSEUDO_HDR as u64 | 2,
    )
    .map_err(|_| ())?;
    // Swapping addresses and ports leaves the checksum unchanged.
    ctx.store(l4, &dport, 0).map_err(|_| ())?;
    ctx.store(l4 + 2, &sport, 0).map_err(|_| ())?;
    ctx.store(l4 + 4, &new_seq.to_be(), 0).map_err(|_| ())?;
    ctx.store(l4 + 8, &new_ack.to_be(), 0).map_err(|_| ())?;
    ctx.store(l4 + 12, &new_doff_word, 0).map_err(|_| ())?;
    ctx.store(l4 + 14, &0u16, 0).map_err(|_| ())?;
    ctx.store(l4 + 18, &0u16, 0).map_err(|_| ())?;
    Ok(true)
}

/// Bytes of the ICMP port-unreachable reply [`udp_unreachable`] builds: Ethernet, IPv4, ICMP
/// header, then the client's IPv4 header and the first 8 bytes of its UDP datagram
/// (RFC 1812 §4.3.2.3 asks for as much as fits; RFC 792's minimum is what Linux's UDP error
/// handling reads).
const UNREACH_LEN: usize = ETH_HLEN + 20 + 8 + 20 + 8;

/// Answers a UDP datagram to a frontend without endpoints with an ICMP destination
/// unreachable / port unreachable from the frontend address, sent back out of the device it
/// came in on — what upstream's `REJECT --reject-with icmp-port-unreachable` rule does for
/// services without endpoints. Datagrams with IP options are dropped instead.
///
/// The reply is built in place: Ethernet and IPv4 headers where they were, the ICMP header
/// where the UDP header was, the quote after it (the frame is resized to exactly that). Both
/// checksums are computed in full. Keeping the ICMP header where the UDP header was keeps a
/// CHECKSUM_PARTIAL skb (a datagram from a local veth peer) correct too: its checksum start
/// then points at the ICMP header and the offset at the zero "unused" word, so a device (or
/// the stack) finishing the checksum writes `~sum` of an already valid message there, 0.
/// Unlike the kernel's own ICMP errors these are not rate limited; a reply is 70 bytes and
/// goes only to the datagram's source.
#[inline(always)]
fn udp_unreachable(ctx: &mut TcContext, p: &Packet) -> Result<Verdict, ()> {
    if p.l4 != IP_OFF + 20 {
        return Ok(DROP);
    }
    if ctx.len() as usize != UNREACH_LEN {
        // SAFETY: the context pointer is valid for the program's run.
        if unsafe { bpf_skb_change_tail(ctx.skb.skb, UNREACH_LEN as u32, 0) } != 0 {
            return Ok(DROP);
        }
    }
    if ctx.data() + UNREACH_LEN > ctx.data_end() {
        ctx.pull_data(UNREACH_LEN as u32).map_err(|_| ())?;
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    let frame = at::<[u16; UNREACH_LEN / 2]>(data, end, 0).ok_or(())?;
    // SAFETY: bounds-checked by `at`; read by value.
    let old = unsafe { *frame };
    let mut new = [0u16; UNREACH_LEN / 2];
    // Ethernet: back to where it came from.
    let mut i = 0;
    while i < 3 {
        new[i] = old[3 + i];
        new[3 + i] = old[i];
        i += 1;
    }
    new[6] = old[6];
    // IPv4 (word 7 = byte 14): version/IHL, length, no fragmentation, TTL 64, ICMP, from the
    // frontend to the client.
    let ip = IP_OFF / 2;
    new[ip] = u16::from_ne_bytes([0x45, 0]);
    new[ip + 1] = ((UNREACH_LEN - ETH_HLEN) as u16).to_be();
    new[ip + 4] = u16::from_ne_bytes([64, PROTO_ICMP]);
    new[ip + 6] = old[ip + 8];
    new[ip + 7] = old[ip + 9];
    new[ip + 8] = old[ip + 6];
    new[ip + 9] = old[ip + 7];
    // ICMP header (type 3 code 3, "unused" zero), then the quote: the client's IPv4 header and
    // UDP header as they arrived.
    let icmp = ip + 10;
    new[icmp] = u16::from_ne_bytes([ICMP_DEST_UNREACH, ICMP_PORT_UNREACH]);
    i = 0;
    while i < 14 {
        new[icmp + 4 + i] = old[ip + i];
        i += 1;
    }
    let mut s = 0u32;
    i = ip;
    while i < icmp {
        s += u32::from(new[i]);
        i += 1;
    }
    new[ip + 5] = !fold(s);
    s = 0;
    i = icmp;
    while i < UNREACH_LEN / 2 {
        s += u32::from(new[i]);
        i += 1;
    }
    new[icmp + 1] = !fold(s);
    // SAFETY: bounds-checked by `at` (no helper call since).
    unsafe { *frame = new };
    // SAFETY: the context pointer is valid for the program's run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: helper with plain arguments.
    Ok(unsafe { bpf_redirect(ifindex, 0) } as i32)
}

/// The quoted packet of an ICMP error: offsets and its tuple (network order).
pub(crate) struct Quoted {
    /// Offset of the ICMP checksum.
    icmp_csum: usize,
    /// Offset of the quoted IP header.
    ip: usize,
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
}

impl IcmpErrors for V4 {
    type Quoted = Quoted;

    #[inline(always)]
    fn quoted(ctx: &TcContext, p: &Packet) -> Option<Quoted> {
        let ty: u8 = ctx.load(p.l4).ok()?;
        if ty != ICMP_DEST_UNREACH && ty != ICMP_TIME_EXCEEDED && ty != ICMP_PARAMETERPROB {
            return None;
        }
        let ip = p.l4 + 8;
        let vihl: u8 = ctx.load(ip).ok()?;
        if vihl != 0x45 {
            return None;
        }
        let frag = u16::from_be(ctx.load::<u16>(ip + 6).ok()?);
        if frag & IP_OFFSET_MASK != 0 {
            return None;
        }
        let proto: u8 = ctx.load(ip + 9).ok()?;
        if proto != PROTO_TCP && proto != PROTO_UDP {
            return None;
        }
        Some(Quoted {
            icmp_csum: p.l4 + 2,
            ip,
            saddr: ctx.load(ip + 12).ok()?,
            daddr: ctx.load(ip + 16).ok()?,
            sport: ctx.load(ip + 20).ok()?,
            dport: ctx.load(ip + 22).ok()?,
            proto,
        })
    }

    #[inline(always)]
    fn quoted_tuple(q: &Quoted) -> (u32, u32, u16, u16, u8) {
        (q.saddr, q.daddr, q.sport, q.dport, q.proto)
    }

    #[inline(always)]
    fn nat(e: &CtEntry) -> (u32, u16) {
        (e.nat_addr, e.nat_port)
    }

    #[inline(always)]
    fn adopt_reply(e: *mut CtEntry, k: &CtKey) {
        // SAFETY: lookup result, read by value.
        if unsafe { (*e).flags } & CT_F_NO_REV != 0 {
            adopt_xdp_reply(e, k);
        }
    }

    /// Rewrites the quoted packet's source (`dst == false`) or destination address and port,
    /// keeping its IP checksum and the ICMP checksum right. The quoted L4 checksum is left as is
    /// (receivers do not verify it on truncated quotes).
    #[inline(always)]
    fn rewrite_quoted(
        ctx: &mut TcContext,
        q: &Quoted,
        dst: bool,
        addr: u32,
        port: u16,
    ) -> Result<(), ()> {
        let (old_addr, old_port, addr_off, port_off) = if dst {
            (q.daddr, q.dport, q.ip + 16, q.ip + 22)
        } else {
            (q.saddr, q.sport, q.ip + 12, q.ip + 20)
        };
        let ip_csum = q.ip + 10;
        let old_ip_csum: u16 = ctx.load(ip_csum).map_err(|_| ())?;
        ctx.l3_csum_replace(ip_csum, old_addr as u64, addr as u64, 4)
            .map_err(|_| ())?;
        let new_ip_csum: u16 = ctx.load(ip_csum).map_err(|_| ())?;
        ctx.l4_csum_replace(q.icmp_csum, old_addr as u64, addr as u64, 4)
            .map_err(|_| ())?;
        ctx.l4_csum_replace(q.icmp_csum, old_port as u64, port as u64, 2)
            .map_err(|_| ())?;
        ctx.l4_csum_replace(q.icmp_csum, old_ip_csum as u64, new_ip_csum as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, &addr, 0).map_err(|_| ())?;
        ctx.store(port_off, &port, 0).map_err(|_| ())?;
        Ok(())
    }

    /// Outer address rewrite of an ICMP packet (no pseudo header in the ICMP checksum).
    #[inline(always)]
    fn rewrite_outer(ctx: &mut TcContext, dst: bool, old: u32, new: u32) -> Result<(), ()> {
        ctx.l3_csum_replace(IP_CSUM, old as u64, new as u64, 4)
            .map_err(|_| ())?;
        ctx.store(if dst { IP_DADDR } else { IP_SADDR }, &new, 0)
            .map_err(|_| ())
    }
}

/// The family-specific pieces of ICMP error translation (the quoted packet, rewrites);
/// [`icmp_error`] is the skeleton both families' TC programs share.
pub(crate) trait IcmpErrors: Family {
    /// The quoted packet of an ICMP error.
    type Quoted;
    /// The quoted packet of `p`, if `p` is an ICMP error about a TCP/UDP flow we parse.
    fn quoted(ctx: &TcContext, p: &Self::Packet) -> Option<Self::Quoted>;
    /// The quoted `(saddr, daddr, sport, dport, proto)`, network order.
    fn quoted_tuple(q: &Self::Quoted) -> (Self::Addr, Self::Addr, u16, u16, u8);
    /// A CT entry's NAT address and port.
    fn nat(e: &Self::Entry) -> (Self::Addr, u16);
    /// An ICMP error about a SNATed flow found its `SnatIn` entry `e` at `k`: completes a flow
    /// the XDP fast path started without a `RevDnat` entry (IPv4 only: the fast path has no
    /// IPv6 flows), which the egress toward the client needs for the quoted packet.
    #[inline(always)]
    fn adopt_reply(_e: *mut Self::Entry, _k: &Self::Key) {}
    /// Rewrites the quoted packet's source (`dst == false`) or destination address and port.
    fn rewrite_quoted(
        ctx: &mut TcContext,
        q: &Self::Quoted,
        dst: bool,
        addr: Self::Addr,
        port: u16,
    ) -> Result<(), ()>;
    /// Rewrites the outer source (`dst == false`) or destination address `old` to `new`.
    fn rewrite_outer(
        ctx: &mut TcContext,
        dst: bool,
        old: Self::Addr,
        new: Self::Addr,
    ) -> Result<(), ()>;
}

/// ICMP error translation for both families. Ingress (`INGRESS`): an error about a SNATed flow
/// (quoted `N:np → B:bp`) goes to its client. Egress: an error about a DNATed flow (quoted
/// `C:cp → B:bp`) names the frontend.
#[inline(always)]
pub(crate) fn icmp_error<F: IcmpErrors, const INGRESS: bool>(
    ctx: &mut TcContext,
    p: &F::Packet,
) -> Result<Verdict, ()> {
    let Some(q) = F::quoted(ctx, p) else {
        return Ok(NEXT);
    };
    let (q_saddr, q_daddr, q_sport, q_dport, proto) = F::quoted_tuple(&q);
    let kind = if INGRESS {
        CtKind::SnatIn
    } else {
        CtKind::RevDnat
    };
    let key = F::key(q_daddr, q_saddr, q_dport, q_sport, proto, kind);
    let Some(found) = F::ct().get_ptr_mut(&key) else {
        return Ok(NEXT);
    };
    if INGRESS {
        F::adopt_reply(found, &key);
    }
    // SAFETY: lookup result, read by value.
    let e = unsafe { *found };
    let (nat_addr, nat_port) = F::nat(&e);
    let (saddr, daddr, ..) = F::tuple(p);
    if INGRESS {
        if daddr != q_saddr {
            return Ok(NEXT);
        }
        F::rewrite_quoted(ctx, &q, false, nat_addr, nat_port)?;
        F::rewrite_outer(ctx, true, daddr, nat_addr)?;
    } else {
        F::rewrite_quoted(ctx, &q, true, nat_addr, nat_port)?;
        if saddr == q_daddr {
            // Sent by the backend itself (port unreachable): it speaks as the frontend.
            F::rewrite_outer(ctx, false, saddr, nat_addr)?;
        }
    }
    stat(TcStat::IcmpError);
    Ok(NEXT)
}
