//! The TC service path for IPv6: `kp_tc_in6` / `kp_tc_eg6`, attached beside `kp_tc_in` /
//! `kp_tc_eg` ([`crate::tc`]) on every node device (TCX runs them in turn; each passes the
//! other family's frames on after one ethertype compare). Separate programs rather than a
//! branch inside the IPv4 ones: the two paths in one program exceed the 512-byte BPF stack
//! (a BPF-to-BPF call does not help, the verifier adds the caller's frame). The same model as IPv4 (`kproxy_common::ct` has the entry table; this file mirrors
//! `crate::tc` function by function), with IPv6 state in its own maps (`kproxy_common::ct6`):
//! `KP_CT6` (connection table) and `KP_NODE_ADDR6` (SNAT source per device). The SNAT port
//! range, the counters, the service maps and the source-range trie are shared with IPv4
//! (service-map keys and LPM keys hold 16-byte addresses already).
//!
//! - Ingress: reply to a SNATed flow (`SnatIn`, dst := client) → established flow
//!   (`Service`) → frontend filter and lookup ([`crate::frontend`], the order of [`crate::tc`])
//!   → new flow (source ranges, no endpoints ⇒ TCP RST / ICMPv6 port unreachable or drop, backend choice, CT6 entries, DNAT).
//! - Egress: reply from a backend (`RevDnat`, src := frontend) → SNAT (the source kept in the
//!   flow's `RevDnat` entry, looked up reversed; port allocated on the flow's first packet from
//!   the range of `KP_NAT_CFG` by `crate::flow::allocate_port_in`, claimed by a
//!   `BPF_NOEXIST` insert of the `SnatIn` entry; any free port of the range is found).
//! - ICMPv6 errors (destination unreachable, packet too big, time exceeded, parameter
//!   problem) about translated flows are translated like IPv4's (quoted tuple reversed → the
//!   flow's entry); other ICMPv6 (echo, neighbour discovery) passes unchanged.
//!
//! Checksums: IPv6 has no header checksum. A translated flow's TCP/UDP checksum is updated in
//! place unless the skb is `CHECKSUM_COMPLETE` ([`crate::skb_csum`]); then, and for ICMPv6
//! (whose checksum covers the pseudo header too), with `l4_csum_replace` one 32-bit address
//! word at a time with `BPF_F_PSEUDO_HDR`, ports plain.
//!
//! Not handled (passed unchanged, see [`crate::packet6`]): packets with extension headers
//! (fragments included), ICMPv6 errors whose quoted packet has extension headers. Session
//! affinity works as for IPv4; Maglev does not apply (the planner builds Maglev tables for
//! IPv4 sets only, so IPv6 frontends never carry `SVC_F_MAGLEV`).

use aya_ebpf::{
    bindings::{BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    helpers::{bpf_redirect, bpf_skb_change_tail},
    macros::{classifier, map},
    maps::{HashMap, LruHashMap, PerCpuArray},
    programs::TcContext,
};
use kproxy_common::ct::{
    CT_F_FIN_ORIG, CT_F_FIN_REPLY, CtKind, DEFAULT_CT_ENTRIES, NODE_ADDR_ENTRIES, TcStat,
};
use kproxy_common::ct6::{CtEntry6, CtKey6, NodeAddr6, PROTO_ICMPV6};
use kproxy_common::service::{
    PROTO_TCP, PROTO_UDP, SVC_F_NODE_PORT, SVC_F_REJECT, ServiceValue, is_v4_mapped,
};

use crate::flow::{
    Egress, Family, PortSearch, TCP_RST, allocate_port_in, choose_backend_in, create_flow_in,
    egress_entry_in, end_flow, in_snat_range, now, reopens, touch_in,
};
use crate::frontend::{candidates_at, new_flow_entry_at, source_allowed_at};
use crate::packet::{ETH_HLEN, at, fold, l4_check_in_place};
use crate::packet6::is_ipv6;
use crate::packet6::{IP6_DADDR, IP6_HLEN, IP6_PLEN, IP6_SADDR, PARSE6_LEN, Packet6, parse6};
use crate::skb_csum::{CHECKSUM_COMPLETE, CHECKSUM_PARTIAL, ip_summed};
use crate::tc::{
    DROP, IcmpErrors, NEXT, Verdict, bounce, icmp_error, parse_pulled, reset_tcp_header, stat,
};

/// `kproxy_common::ct6::MAP_CT6`.
#[map]
static KP_CT6: LruHashMap<CtKey6, CtEntry6> = LruHashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// `kproxy_common::ct6::MAP_NODE_ADDR6`.
#[map]
static KP_NODE_ADDR6: HashMap<u32, NodeAddr6> = HashMap::pinned(NODE_ADDR_ENTRIES, 0);

const L4: usize = Packet6::L4;
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
const ICMP6_PARAMPROB: u8 = 4;
const ICMP6_PORT_UNREACH: u8 = 4;

/// `kproxy_common::ct6::PROG_TC6_INGRESS`.
#[classifier]
pub fn kp_tc_in6(mut ctx: TcContext) -> i32 {
    if !is_ipv6(ctx.data(), ctx.data_end()) {
        return NEXT;
    }
    let Some(p) = parse_tc6(&ctx) else {
        return NEXT;
    };
    if p.proto == PROTO_ICMPV6 {
        return icmp_error_in6(TcContext::new(ctx.skb.skb), &p);
    }
    ingress6(&mut ctx, &p).unwrap_or(DROP)
}

/// `kproxy_common::ct6::PROG_TC6_EGRESS`.
#[classifier]
pub fn kp_tc_eg6(mut ctx: TcContext) -> i32 {
    if !is_ipv6(ctx.data(), ctx.data_end()) {
        return NEXT;
    }
    let Some(p) = parse_tc6(&ctx) else {
        return NEXT;
    };
    if p.proto == PROTO_ICMPV6 {
        return icmp_error_out6(TcContext::new(ctx.skb.skb), &p);
    }
    egress6(&mut ctx, &p).unwrap_or(DROP)
}

#[inline(always)]
fn parse_tc6(ctx: &TcContext) -> Option<Packet6> {
    parse_pulled(ctx, parse6, PARSE6_LEN)
}

#[inline(always)]
fn key6(p: &Packet6, kind: CtKind) -> CtKey6 {
    V6::key(p.saddr, p.daddr, p.sport, p.dport, p.proto, kind)
}

// ---- rewriting ------------------------------------------------------------------------------

/// Offset of the L4 checksum, and the `l4_csum_replace` flags it needs.
#[inline(always)]
fn l4_csum(proto: u8) -> (usize, u64) {
    match proto {
        PROTO_TCP => (L4 + 16, 0),
        PROTO_UDP => (L4 + 6, BPF_F_MARK_MANGLED_0 as u64),
        // ICMPv6.
        _ => (L4 + 2, 0),
    }
}

/// Feeds an address change into the checksum at `csum`, word by word (`flags` says whether
/// it is a pseudo-header field and how to treat a zero UDP checksum).
#[inline(always)]
fn csum_addr(
    ctx: &mut TcContext,
    csum: usize,
    old: &[u32; 4],
    new: &[u32; 4],
    flags: u64,
) -> Result<(), ()> {
    let mut i = 0;
    while i < 4 {
        if old[i] != new[i] {
            ctx.l4_csum_replace(csum, old[i] as u64, new[i] as u64, flags | 4)
                .map_err(|_| ())?;
        }
        i += 1;
    }
    Ok(())
}

/// Writes 16 address bytes at `off` (after the checksum helpers; re-derives the pointer).
#[inline(always)]
fn store_addr(ctx: &TcContext, off: usize, addr: &[u32; 4]) -> Result<(), ()> {
    let a = at::<[u32; 4]>(ctx.data(), ctx.data_end(), off).ok_or(())?;
    // SAFETY: bounds-checked by `at`.
    unsafe { *a = *addr };
    Ok(())
}

/// Rewrites the destination (`dst == true`) or source address and port, with the L4 checksum.
#[inline(always)]
fn rewrite6(
    ctx: &mut TcContext,
    p: &Packet6,
    dst: bool,
    addr: &[u32; 4],
    port: u16,
) -> Result<(), ()> {
    let (old_addr, old_port, addr_off, port_off) = if dst {
        (p.daddr, p.dport, IP6_DADDR, L4 + 2)
    } else {
        (p.saddr, p.sport, IP6_SADDR, L4)
    };
    let ports = old_port != port;
    let summed = ip_summed(ctx);
    let l4 = p.proto == PROTO_TCP || p.proto == PROTO_UDP;
    if l4 && summed != CHECKSUM_COMPLETE {
        // In place (see `crate::skb_csum`); one bounds check for the whole header.
        let (data, end) = (ctx.data(), ctx.data_end());
        let (h, check) = if p.proto == PROTO_TCP {
            let h = at::<[u16; 9]>(data, end, L4).ok_or(())? as *mut u16;
            // SAFETY: offset 16 of a checked 18-byte header.
            (h, unsafe { h.add(8) })
        } else {
            let h = at::<[u16; 4]>(data, end, L4).ok_or(())? as *mut u16;
            // SAFETY: offset 6 of a checked 8-byte header.
            (h, unsafe { h.add(3) })
        };
        let pairs = [
            (old_addr[0], addr[0]),
            (old_addr[1], addr[1]),
            (old_addr[2], addr[2]),
            (old_addr[3], addr[3]),
        ];
        // SAFETY: bounds-checked above.
        unsafe {
            *check = l4_check_in_place(
                *check,
                p.proto == PROTO_UDP,
                summed == CHECKSUM_PARTIAL,
                &pairs,
                ports.then_some((old_port, port)),
            );
            if ports {
                *h.add(if dst { 1 } else { 0 }) = port;
            }
        }
    } else {
        let (csum, flags) = l4_csum(p.proto);
        csum_addr(ctx, csum, &old_addr, addr, flags | BPF_F_PSEUDO_HDR as u64)?;
        if ports {
            ctx.l4_csum_replace(csum, old_port as u64, port as u64, flags | 2)
                .map_err(|_| ())?;
            let pp = at::<u16>(ctx.data(), ctx.data_end(), port_off).ok_or(())?;
            // SAFETY: bounds-checked by `at`.
            unsafe { *pp = port };
        }
    }
    if old_addr != *addr {
        store_addr(ctx, addr_off, addr)?;
    }
    Ok(())
}

// ---- ingress / egress -----------------------------------------------------------------------

#[inline(always)]
fn ingress6(ctx: &mut TcContext, p: &Packet6) -> Result<Verdict, ()> {
    if in_snat_range(p.dport)
        && let Some(e) = KP_CT6.get_ptr_mut(key6(p, CtKind::SnatIn))
    {
        touch_in::<V6>(e, p.tcp_flags, CT_F_FIN_REPLY);
        // SAFETY: lookup result, read by value.
        let (addr, port) = unsafe { ((*e).nat_addr, (*e).nat_port) };
        rewrite6(ctx, p, true, &addr, port)?;
        stat(TcStat::Reply);
        return Ok(NEXT);
    }
    // Established first, as in `crate::tc` (see its module docs), and a new connection on a
    // closed flow's tuple is a new flow there too.
    if let Some(e) = KP_CT6.get_ptr_mut(key6(p, CtKind::Service)) {
        if !reopens::<V6>(e, p.tcp_flags) {
            touch_in::<V6>(e, p.tcp_flags, CT_F_FIN_ORIG);
            // SAFETY: as above.
            let (addr, port) = unsafe { ((*e).nat_addr, (*e).nat_port) };
            rewrite6(ctx, p, true, &addr, port)?;
            stat(TcStat::Established);
            return Ok(NEXT);
        }
        end_flow::<V6>(e, &p.saddr, p.sport, p.proto);
    }
    let c = candidates_at(&p.daddr, p.dport, p.proto);
    let Some(svc) = new_flow_entry_at(p.daddr, p.dport, p.proto, c) else {
        return Ok(NEXT);
    };
    if !source_allowed_at(&svc, p.saddr) {
        stat(TcStat::SourceRangeDrop);
        return Ok(DROP);
    }
    if svc.count == 0 {
        stat(TcStat::NoEndpoints);
        if svc.flags & SVC_F_REJECT == 0 {
            return Ok(DROP);
        }
        if p.proto == PROTO_TCP {
            return Ok(tcp_reset6(TcContext::new(ctx.skb.skb), p));
        }
        // UDP to a NodePort: the node's stack answers ICMPv6 port unreachable itself.
        if svc.flags & SVC_F_NODE_PORT != 0 {
            return Ok(NEXT);
        }
        return Ok(udp_unreachable6(TcContext::new(ctx.skb.skb)));
    }
    Ok(new_flow6(TcContext::new(ctx.skb.skb), p, &svc))
}

/// A new flow to `svc` (which has endpoints and admits the client): backend choice, CT6
/// entries, DNAT. A BPF-to-BPF call, like the other large steps of the IPv6 programs: each
/// gets its own stack frame, and only the caller's small one adds to it.
#[inline(never)]
fn new_flow6(mut ctx: TcContext, p: &Packet6, svc: &ServiceValue) -> Verdict {
    new_flow6_inner(&mut ctx, p, svc).unwrap_or(DROP)
}

#[inline(always)]
fn new_flow6_inner(ctx: &mut TcContext, p: &Packet6, svc: &ServiceValue) -> Result<Verdict, ()> {
    if svc.count == 0 {
        // Checked by the caller; repeated so the slot choice has no division-by-zero panic
        // path (the verifier rejects one).
        return Ok(DROP);
    }
    let ts = now();
    let Some((backend_id, be)) = choose_backend_in::<V6>(svc, p, ts, None) else {
        return Ok(DROP);
    };
    if create_flow_in::<V6>(p, svc, backend_id, &be, ts).is_err() {
        stat(TcStat::CtInsertFailed);
        return Ok(DROP);
    }
    rewrite6(ctx, p, true, &be.addr, be.port)?;
    stat(TcStat::NewFlow);
    Ok(NEXT)
}

#[inline(always)]
fn egress6(ctx: &mut TcContext, p: &Packet6) -> Result<Verdict, ()> {
    let (e, n_addr, n_port) =
        match egress_entry_in::<V6>(p.saddr, p.daddr, p.sport, p.dport, p.proto) {
            None => return Ok(NEXT),
            Some(Egress::Reply(e)) => {
                touch_in::<V6>(e, p.tcp_flags, CT_F_FIN_REPLY);
                // SAFETY: lookup result, read by value.
                let (addr, port) = unsafe { ((*e).nat_addr, (*e).nat_port) };
                rewrite6(ctx, p, false, &addr, port)?;
                stat(TcStat::Reply);
                return Ok(NEXT);
            }
            Some(Egress::Snat(e, addr, port)) => (e, addr, port),
        };
    touch_in::<V6>(e, p.tcp_flags, CT_F_FIN_ORIG);
    // SAFETY: fields of a lookup result.
    let (mut addr, mut port) = unsafe { (*n_addr, *n_port) };
    if addr == [0; 4] {
        // SAFETY: reads the context's ifindex field.
        let ifindex = unsafe { (*ctx.skb.skb).ifindex };
        let Some(node) = (unsafe { KP_NODE_ADDR6.get(ifindex) }) else {
            stat(TcStat::SnatExhausted);
            return Ok(DROP);
        };
        addr = node.addr;
        // SAFETY: lookup result, read in place (a copy would cost stack).
        let template = unsafe { &*e };
        port = match allocate_port_in::<V6>(
            p.saddr, p.daddr, p.sport, p.dport, p.proto, addr, template, None,
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
    rewrite6(ctx, p, false, &addr, port)?;
    stat(TcStat::Snat);
    Ok(NEXT)
}

/// IPv6: `KP_CT6`.
pub(crate) struct V6;

impl Family for V6 {
    type Addr = [u32; 4];
    type Key = CtKey6;
    type Entry = CtEntry6;
    type Packet = Packet6;
    const MAGLEV: bool = false;

    #[inline(always)]
    fn stamps(e: *mut CtEntry6) -> (*mut u64, *mut u16) {
        // SAFETY: field addresses of a valid entry pointer, no access.
        unsafe { (&raw mut (*e).last_seen_ns, &raw mut (*e).flags) }
    }

    #[inline(always)]
    fn created(e: *mut CtEntry6) -> u64 {
        // SAFETY: a valid entry pointer (lookup result), read by value.
        unsafe { (*e).created_ns }
    }

    #[inline(always)]
    fn key_src(k: &CtKey6) -> (&[u32; 4], u16) {
        (&k.saddr, k.sport)
    }

    #[inline(always)]
    fn write_key(
        out: &mut CtKey6,
        saddr: &[u32; 4],
        daddr: &[u32; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        kind: CtKind,
    ) {
        out.saddr = *saddr;
        out.daddr = *daddr;
        out.sport = sport;
        out.dport = dport;
        out.proto = proto;
        out.kind = kind as u8;
        out._pad = [0; 2];
    }

    #[inline(always)]
    fn tuple(p: &Packet6) -> ([u32; 4], [u32; 4], u16, u16, u8) {
        (p.saddr, p.daddr, p.sport, p.dport, p.proto)
    }

    #[inline(always)]
    fn mapped(addr: [u32; 4]) -> [u32; 4] {
        // IPv6 addresses are stored as they are.
        addr
    }

    #[inline(always)]
    fn is_family(addr: &[u32; 4]) -> bool {
        !is_v4_mapped(addr)
    }

    #[inline(always)]
    fn backend_addr(addr: &[u32; 4]) -> [u32; 4] {
        *addr
    }

    #[inline(always)]
    fn maglev(_: u32, _: [u32; 4], _: [u32; 4], _: u16, _: u16, _: u8) -> Option<u32> {
        None
    }

    #[inline(always)]
    fn entry(
        nat_addr: [u32; 4],
        nat_port: u16,
        flags: u16,
        backend_id: u32,
        svc_id: u32,
        ts: u64,
    ) -> CtEntry6 {
        CtEntry6 {
            nat_addr,
            nat_port,
            flags,
            backend_id,
            svc_id,
            _pad: 0,
            created_ns: ts,
            last_seen_ns: ts,
            snat_addr: [0; 4],
            snat_port: 0,
            _pad2: [0; 3],
        }
    }

    #[inline(always)]
    fn ct() -> &'static LruHashMap<CtKey6, CtEntry6> {
        &KP_CT6
    }

    #[inline(always)]
    fn key(
        saddr: [u32; 4],
        daddr: [u32; 4],
        sport: u16,
        dport: u16,
        proto: u8,
        kind: CtKind,
    ) -> CtKey6 {
        CtKey6 {
            saddr,
            daddr,
            sport,
            dport,
            proto,
            kind: kind as u8,
            _pad: [0; 2],
        }
    }

    #[inline(always)]
    fn set_dport(k: &mut CtKey6, port: u16) {
        k.dport = port;
    }

    #[inline(always)]
    fn with_nat(template: &CtEntry6, addr: [u32; 4], port: u16) -> CtEntry6 {
        CtEntry6 {
            nat_addr: addr,
            nat_port: port,
            ..*template
        }
    }

    #[inline(always)]
    fn nat_slot(e: *mut CtEntry6) -> (*mut [u32; 4], *mut u16) {
        // SAFETY: field addresses of a valid entry pointer, no access.
        unsafe { (&raw mut (*e).nat_addr, &raw mut (*e).nat_port) }
    }

    #[inline(always)]
    fn snat_slot(e: *mut CtEntry6) -> (*mut [u32; 4], *mut u16) {
        // SAFETY: as above.
        unsafe { (&raw mut (*e).snat_addr, &raw mut (*e).snat_port) }
    }

    #[inline(always)]
    fn port_search() -> Option<*mut PortSearch<V6>> {
        KP_PORT_SEARCH6.get_ptr_mut(0)
    }
}

/// `Family::port_search` of IPv6 (private to each loaded instance; not pinned).
#[map]
static KP_PORT_SEARCH6: PerCpuArray<PortSearch<V6>> = PerCpuArray::with_max_entries(1, 0);

// ---- no endpoints ---------------------------------------------------------------------------

/// Answers a TCP segment to a frontend without endpoints with a RST from the frontend, sent
/// back out of the device it came in on (as `crate::tc`'s IPv4 `tcp_reset`). Segments with
/// data are dropped.
#[inline(never)]
fn tcp_reset6(ctx: TcContext, p: &Packet6) -> Verdict {
    tcp_reset6_inner(&ctx, p).unwrap_or(DROP)
}

#[inline(always)]
fn tcp_reset6_inner(ctx: &TcContext, p: &Packet6) -> Result<Verdict, ()> {
    if p.tcp_flags & TCP_RST != 0 {
        return Ok(DROP);
    }
    let tcp_len = u16::from_be(ctx.load::<u16>(IP6_PLEN).map_err(|_| ())?) as usize;
    if !reset_tcp_header(ctx, L4, p.tcp_flags, p.sport, p.dport, tcp_len)? {
        return Ok(DROP);
    }
    let new_len = 20u16.to_be();
    ctx.store(IP6_SADDR, &p.daddr, 0).map_err(|_| ())?;
    ctx.store(IP6_DADDR, &p.saddr, 0).map_err(|_| ())?;
    ctx.store(IP6_PLEN, &new_len, 0).map_err(|_| ())?;
    bounce(ctx, (L4 + 20) as u32)
}

/// Bytes of the ICMPv6 port-unreachable reply [`udp_unreachable6`] builds: Ethernet, IPv6,
/// ICMPv6 header, then the client's IPv6 header and UDP header (RFC 4443 §3.1 asks for as
/// much as fits in the minimum MTU; the UDP header is what the client's stack needs to find
/// its socket).
const UNREACH6_LEN: usize = ETH_HLEN + IP6_HLEN + 8 + IP6_HLEN + 8;
/// 16-bit words: of the reply, where its IPv6 header starts, where its ICMPv6 header starts.
const W: usize = UNREACH6_LEN / 2;
const W_IP: usize = ETH_HLEN / 2;
const W_ICMP: usize = W_IP + IP6_HLEN / 2;
/// Words quoted: the client's IPv6 and UDP headers.
const W_QUOTE: usize = (IP6_HLEN + 8) / 2;

/// Answers a UDP datagram to a frontend without endpoints with an ICMPv6 destination
/// unreachable / port unreachable from the frontend, sent back out of the device it came in
/// on (upstream: `REJECT`). Built in place like IPv4's `udp_unreachable` (ICMPv6 header
/// where the UDP header was, frame resized to exactly the reply), without a copy of the
/// frame on the stack (the BPF stack is 512 bytes); the checksum, which covers the IPv6
/// pseudo header, is computed in full. A CHECKSUM_PARTIAL datagram (from a local veth peer)
/// gives a reply the receiving peer's stack does not verify; on a physical device ingress
/// skbs are never CHECKSUM_PARTIAL. Not rate limited.
#[inline(never)]
fn udp_unreachable6(ctx: TcContext) -> Verdict {
    if ctx.len() as usize != UNREACH6_LEN {
        // SAFETY: the context pointer is valid for the program's run.
        if unsafe { bpf_skb_change_tail(ctx.skb.skb, UNREACH6_LEN as u32, 0) } != 0 {
            return DROP;
        }
    }
    if ctx.data() + UNREACH6_LEN > ctx.data_end() && ctx.pull_data(UNREACH6_LEN as u32).is_err() {
        return DROP;
    }
    let Some(f) = at::<[u16; W]>(ctx.data(), ctx.data_end(), 0) else {
        return DROP;
    };
    // SAFETY (every access below): `f` is bounds-checked by `at` and no helper ran since.
    // Quote first (its source, the client's headers, is overwritten next); the target lies
    // after the source, so a forward copy is safe.
    let mut i = 0;
    while i < W_QUOTE {
        unsafe { (*f)[W_ICMP + 4 + i] = (*f)[W_IP + i] };
        i += 1;
    }
    // Ethernet and IPv6 addresses swapped: back to where it came from, from the frontend.
    i = 0;
    while i < 3 {
        unsafe { (*f).swap(i, 3 + i) };
        i += 1;
    }
    i = 0;
    while i < 8 {
        unsafe { (*f).swap(W_IP + 4 + i, W_IP + 12 + i) };
        i += 1;
    }
    // Version 6, payload length, next header ICMPv6, hop limit 64.
    let plen = (8 + IP6_HLEN + 8) as u16;
    unsafe {
        (*f)[W_IP] = u16::from_ne_bytes([0x60, 0]);
        (*f)[W_IP + 1] = 0;
        (*f)[W_IP + 2] = plen.to_be();
        (*f)[W_IP + 3] = u16::from_ne_bytes([PROTO_ICMPV6, 64]);
        // ICMPv6 header: type 1 code 4, checksum, "unused" zero.
        (*f)[W_ICMP] = u16::from_ne_bytes([ICMP6_DEST_UNREACH, ICMP6_PORT_UNREACH]);
        (*f)[W_ICMP + 1] = 0;
        (*f)[W_ICMP + 2] = 0;
        (*f)[W_ICMP + 3] = 0;
    }
    // Pseudo header (addresses, upper-layer length, next header), then the message.
    let mut s = u32::from(plen.to_be()) + u32::from(u16::from(PROTO_ICMPV6).to_be());
    i = W_IP + 4;
    while i < W {
        s += u32::from(unsafe { (*f)[i] });
        i += 1;
    }
    unsafe { (*f)[W_ICMP + 1] = !fold(s) };
    // SAFETY: the context pointer is valid for the program's run.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // SAFETY: helper with plain arguments.
    (unsafe { bpf_redirect(ifindex, 0) }) as i32
}

// ---- ICMPv6 errors --------------------------------------------------------------------------

/// The quoted packet of an ICMPv6 error (its tuple, network order).
pub(crate) struct Quoted6 {
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport: u16,
    dport: u16,
    proto: u8,
}

/// Offset of the quoted IPv6 header.
const Q_IP: usize = L4 + 8;

impl IcmpErrors for V6 {
    type Quoted = Quoted6;

    #[inline(always)]
    fn quoted(ctx: &TcContext, _: &Packet6) -> Option<Quoted6> {
        let ty: u8 = ctx.load(L4).ok()?;
        if ty != ICMP6_DEST_UNREACH
            && ty != ICMP6_PACKET_TOO_BIG
            && ty != ICMP6_TIME_EXCEEDED
            && ty != ICMP6_PARAMPROB
        {
            return None;
        }
        let v: u8 = ctx.load(Q_IP).ok()?;
        if v >> 4 != 6 {
            return None;
        }
        let proto: u8 = ctx.load(Q_IP + 6).ok()?;
        if proto != PROTO_TCP && proto != PROTO_UDP {
            return None;
        }
        Some(Quoted6 {
            saddr: ctx.load(Q_IP + 8).ok()?,
            daddr: ctx.load(Q_IP + 24).ok()?,
            sport: ctx.load(Q_IP + IP6_HLEN).ok()?,
            dport: ctx.load(Q_IP + IP6_HLEN + 2).ok()?,
            proto,
        })
    }

    #[inline(always)]
    fn quoted_tuple(q: &Quoted6) -> ([u32; 4], [u32; 4], u16, u16, u8) {
        (q.saddr, q.daddr, q.sport, q.dport, q.proto)
    }

    #[inline(always)]
    fn nat(e: &CtEntry6) -> ([u32; 4], u16) {
        (e.nat_addr, e.nat_port)
    }

    /// Rewrites the quoted packet's source (`dst == false`) or destination address and port,
    /// keeping the ICMPv6 checksum right (the quoted L4 checksum is left as is, like IPv4).
    #[inline(always)]
    fn rewrite_quoted(
        ctx: &mut TcContext,
        q: &Quoted6,
        dst: bool,
        addr: [u32; 4],
        port: u16,
    ) -> Result<(), ()> {
        let addr = &addr;
        let (old_addr, old_port, addr_off, port_off) = if dst {
            (q.daddr, q.dport, Q_IP + 24, Q_IP + IP6_HLEN + 2)
        } else {
            (q.saddr, q.sport, Q_IP + 8, Q_IP + IP6_HLEN)
        };
        let (csum, _) = l4_csum(PROTO_ICMPV6);
        csum_addr(ctx, csum, &old_addr, addr, 0)?;
        ctx.l4_csum_replace(csum, old_port as u64, port as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, addr, 0).map_err(|_| ())?;
        ctx.store(port_off, &port, 0).map_err(|_| ())?;
        Ok(())
    }

    /// Outer address rewrite of an ICMPv6 packet (its checksum covers the pseudo header).
    #[inline(always)]
    fn rewrite_outer(
        ctx: &mut TcContext,
        dst: bool,
        old: [u32; 4],
        new: [u32; 4],
    ) -> Result<(), ()> {
        let (csum, _) = l4_csum(PROTO_ICMPV6);
        csum_addr(ctx, csum, &old, &new, BPF_F_PSEUDO_HDR as u64)?;
        ctx.store(if dst { IP6_DADDR } else { IP6_SADDR }, &new, 0)
            .map_err(|_| ())
    }
}

/// Ingress ICMPv6 errors ([`icmp_error`]): a BPF-to-BPF call with its own stack frame.
#[inline(never)]
fn icmp_error_in6(mut ctx: TcContext, p: &Packet6) -> Verdict {
    icmp_error::<V6, true>(&mut ctx, p).unwrap_or(NEXT)
}

/// Egress ICMPv6 errors ([`icmp_error`]): a BPF-to-BPF call with its own stack frame.
#[inline(never)]
fn icmp_error_out6(mut ctx: TcContext, p: &Packet6) -> Verdict {
    icmp_error::<V6, false>(&mut ctx, p).unwrap_or(NEXT)
}
