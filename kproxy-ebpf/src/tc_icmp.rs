//! ICMP errors about translated flows on the TC path, for both families ([`icmp_error`],
//! generic over [`IcmpErrors`]): at ingress an error about a SNATed flow (quoted
//! `N:np → B:bp`) goes to its client; at egress an error about a DNATed flow (quoted
//! `C:cp → B:bp`) names the frontend. The quoted tuple, reversed, finds the flow's entry; the
//! quoted packet and the outer address are rewritten, with the checksums.
//!
//! Handled: IPv4 destination unreachable, time exceeded, parameter problem; ICMPv6
//! destination unreachable, packet too big, time exceeded, parameter problem — about TCP or
//! UDP. Other ICMP (echo, neighbour discovery) and quotes with IPv4 options or IPv6 extension
//! headers pass unchanged. The quoted L4 checksum is left as is (receivers do not verify it
//! on truncated quotes).

use aya_ebpf::{bindings::BPF_F_PSEUDO_HDR, programs::TcContext};
use kproxy_common::ct::{CtKind, TcStat};
use kproxy_common::service::{PROTO_TCP, PROTO_UDP};

use crate::family::{V4, V6};
use crate::packet::{IP_CSUM, Packet};
use crate::packet6::{IP6_HLEN, Packet6};
use crate::tc::{NEXT, TcFamily, Verdict, csum_words, stat};

const IP_OFFSET_MASK: u16 = 0x1fff;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PACKET_TOO_BIG: u8 = 2;
const ICMP6_TIME_EXCEEDED: u8 = 3;
const ICMP6_PARAMPROB: u8 = 4;

/// The family-specific pieces of ICMP error translation (the quoted packet, rewrites).
pub(crate) trait IcmpErrors: TcFamily {
    /// The quoted packet of an ICMP error.
    type Quoted;
    /// The quoted packet of `p`, if `p` is an ICMP error about a TCP/UDP flow we parse.
    fn quoted(ctx: &TcContext, p: &Self::Packet) -> Option<Self::Quoted>;
    /// The quoted `(saddr, daddr, sport, dport, proto)`, network order.
    fn quoted_tuple(q: &Self::Quoted) -> (Self::Addr, Self::Addr, u16, u16, u8);
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

/// ICMP error translation (module docs): at ingress (`INGRESS`) through the flow's `SnatIn`
/// entry, at egress through its `RevDnat` entry.
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
        // A flow the XDP fast path started: the egress toward the client needs its `RevDnat`
        // entry for the quoted packet.
        F::complete_xdp_reply(found, &key);
    }
    let (nat_addr, nat_port) = F::nat(found);
    let (saddr, daddr) = (*F::saddr(p), *F::daddr(p));
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

    /// Keeps the quoted IP header's checksum and the ICMP checksum right.
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

    /// The ICMP checksum has no pseudo header: only the IP header checksum changes.
    #[inline(always)]
    fn rewrite_outer(ctx: &mut TcContext, dst: bool, old: u32, new: u32) -> Result<(), ()> {
        ctx.l3_csum_replace(IP_CSUM, old as u64, new as u64, 4)
            .map_err(|_| ())?;
        ctx.store(if dst { Self::DADDR } else { Self::SADDR }, &new, 0)
            .map_err(|_| ())
    }
}

/// The quoted packet of an ICMPv6 error (its tuple, network order).
pub(crate) struct Quoted6 {
    saddr: [u32; 4],
    daddr: [u32; 4],
    sport: u16,
    dport: u16,
    proto: u8,
}

/// Offset of the ICMPv6 checksum (no extension headers, see [`crate::packet6`]).
const ICMP6_CSUM: usize = Packet6::L4 + 2;
/// Offset of the quoted IPv6 header.
const Q_IP: usize = Packet6::L4 + 8;

impl IcmpErrors for V6 {
    type Quoted = Quoted6;

    #[inline(always)]
    fn quoted(ctx: &TcContext, _: &Packet6) -> Option<Quoted6> {
        let ty: u8 = ctx.load(Packet6::L4).ok()?;
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

    /// Keeps the ICMPv6 checksum right (the quoted packet has no header checksum).
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
        csum_words(ctx, ICMP6_CSUM, &old_addr, addr, 0)?;
        ctx.l4_csum_replace(ICMP6_CSUM, old_port as u64, port as u64, 2)
            .map_err(|_| ())?;
        ctx.store(addr_off, addr, 0).map_err(|_| ())?;
        ctx.store(port_off, &port, 0).map_err(|_| ())?;
        Ok(())
    }

    /// The ICMPv6 checksum covers the pseudo header.
    #[inline(always)]
    fn rewrite_outer(
        ctx: &mut TcContext,
        dst: bool,
        old: [u32; 4],
        new: [u32; 4],
    ) -> Result<(), ()> {
        csum_words(ctx, ICMP6_CSUM, &old, &new, BPF_F_PSEUDO_HDR as u64)?;
        ctx.store(if dst { Self::DADDR } else { Self::SADDR }, &new, 0)
            .map_err(|_| ())
    }
}
