//! Answers to a new flow toward a frontend without endpoints whose service rejects
//! (`SVC_F_REJECT`; upstream's `REJECT` rules), built in place and sent back out of the device
//! the packet came in on: a TCP segment gets a RST from the frontend ([`tcp_reset`], one
//! implementation for both families), a UDP datagram an ICMP / ICMPv6 port unreachable
//! ([`Reject::udp_unreachable`], per family: the two messages differ in every header). Not
//! rate limited, unlike the kernel's own ICMP errors; a reply goes only to the packet's
//! source.

use aya_ebpf::{
    bindings::BPF_F_PSEUDO_HDR,
    helpers::{bpf_redirect, bpf_skb_change_tail},
    programs::TcContext,
};
use kproxy_common::ct::PROTO_ICMP;
use kproxy_common::ct6::PROTO_ICMPV6;

use crate::family::{V4, V6};
use crate::flow::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
use crate::packet::{ETH_HLEN, IP_CSUM, IP_OFF, Packet, at, fold};
use crate::packet6::{IP6_HLEN, IP6_PLEN, Packet6};
use crate::tc::{DROP, TcFamily, Verdict};

const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_PORT_UNREACH: u8 = 3;
const ICMP6_DEST_UNREACH: u8 = 1;
const ICMP6_PORT_UNREACH: u8 = 4;

/// The family-specific pieces of a rejection.
pub(crate) trait Reject: TcFamily {
    /// Offset of the L4 header of a packet without IPv4 options (IPv6: always, extension
    /// headers are not parsed): the only packets answered.
    const L4_PLAIN: usize;
    /// Offset of the IP length field (IPv4 total length, IPv6 payload length).
    const LEN: usize;
    /// Bytes of that length before the L4 header (IPv4: its header; IPv6: none).
    const LEN_HDR: usize;
    /// Sets the IP length field from `old` to `new` (raw network-order words), with the IPv4
    /// header checksum.
    fn set_len(ctx: &TcContext, old: u16, new: u16) -> Result<(), ()>;
    /// Answers UDP datagram `p` with an ICMP port unreachable (module docs).
    fn udp_unreachable(ctx: &mut TcContext, p: &Self::Packet) -> Result<Verdict, ()>;
}

/// Answers TCP segment `p` with a RST from the frontend, sent back out of the device it came
/// in on (RFC 9293 §3.10.7.1 reset generation). Segments carrying data are dropped instead
/// (the client's next SYN gets the RST).
#[inline(always)]
pub(crate) fn tcp_reset<F: Reject>(ctx: &mut TcContext, p: &F::Packet) -> Result<Verdict, ()> {
    if F::tcp_flags(p) & TCP_RST != 0 || F::l4(p) != F::L4_PLAIN {
        return Ok(DROP);
    }
    let old_len: u16 = ctx.load(F::LEN).map_err(|_| ())?;
    let tcp_len = (u16::from_be(old_len) as usize).wrapping_sub(F::LEN_HDR);
    if !reset_tcp_header(
        ctx,
        F::L4_PLAIN,
        F::tcp_flags(p),
        F::sport(p),
        F::dport(p),
        tcp_len,
    )? {
        return Ok(DROP);
    }
    ctx.store(F::SADDR, F::daddr(p), 0).map_err(|_| ())?;
    ctx.store(F::DADDR, F::saddr(p), 0).map_err(|_| ())?;
    F::set_len(ctx, old_len, ((F::LEN_HDR + 20) as u16).to_be())?;
    bounce(ctx, (F::L4_PLAIN + 20) as u32)
}

/// Sends a reply built in place back out of the device it came in on: swaps the Ethernet
/// addresses, trims the frame to `len` bytes and redirects it.
#[inline(always)]
fn bounce(ctx: &TcContext, len: u32) -> Result<Verdict, ()> {
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
/// header's length) into a RST answering it: sequence numbers per RFC 9293 §3.10.7.1, ports
/// swapped, options dropped, the checksum updated (the pseudo header's length included; the
/// caller swaps the addresses, which leaves it unchanged). `Ok(false)`: the segment carries
/// data or a bad data offset; nothing was changed.
#[inline(always)]
fn reset_tcp_header(
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

/// Bytes of the ICMP port-unreachable reply of IPv4: Ethernet, IPv4, ICMP header, then the
/// client's IPv4 header and the first 8 bytes of its UDP datagram (RFC 1812 §4.3.2.3 asks for
/// as much as fits; RFC 792's minimum is what Linux's UDP error handling reads).
const UNREACH_LEN: usize = ETH_HLEN + 20 + 8 + 20 + 8;

impl Reject for V4 {
    const L4_PLAIN: usize = IP_OFF + 20;
    const LEN: usize = IP_OFF + 2;
    const LEN_HDR: usize = 20;

    #[inline(always)]
    fn set_len(ctx: &TcContext, old: u16, new: u16) -> Result<(), ()> {
        ctx.l3_csum_replace(IP_CSUM, old as u64, new as u64, 2)
            .map_err(|_| ())?;
        ctx.store(Self::LEN, &new, 0).map_err(|_| ())
    }

    /// ICMP destination unreachable / port unreachable from the frontend address. Datagrams
    /// with IP options are dropped instead.
    ///
    /// Ethernet and IPv4 headers stay where they were, the ICMP header takes the UDP header's
    /// place, the quote follows (the frame is resized to exactly that); both checksums are
    /// computed in full. Keeping the ICMP header where the UDP header was keeps a
    /// CHECKSUM_PARTIAL skb (a datagram from a local veth peer) correct too: its checksum start
    /// then points at the ICMP header and the offset at the zero "unused" word, so a device
    /// (or the stack) finishing the checksum writes `~sum` of an already valid message there,
    /// 0.
    #[inline(always)]
    fn udp_unreachable(ctx: &mut TcContext, p: &Packet) -> Result<Verdict, ()> {
        if p.l4 != Self::L4_PLAIN {
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
        // IPv4 (word 7 = byte 14): version/IHL, length, no fragmentation, TTL 64, ICMP, from
        // the frontend to the client.
        let ip = IP_OFF / 2;
        new[ip] = u16::from_ne_bytes([0x45, 0]);
        new[ip + 1] = ((UNREACH_LEN - ETH_HLEN) as u16).to_be();
        new[ip + 4] = u16::from_ne_bytes([64, PROTO_ICMP]);
        new[ip + 6] = old[ip + 8];
        new[ip + 7] = old[ip + 9];
        new[ip + 8] = old[ip + 6];
        new[ip + 9] = old[ip + 7];
        // ICMP header (type 3 code 3, "unused" zero), then the quote: the client's IPv4 header
        // and UDP header as they arrived.
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
}

/// Bytes of the ICMPv6 port-unreachable reply: Ethernet, IPv6, ICMPv6 header, then the
/// client's IPv6 header and UDP header (RFC 4443 §3.1 asks for as much as fits in the minimum
/// MTU; the UDP header is what the client's stack needs to find its socket).
const UNREACH6_LEN: usize = ETH_HLEN + IP6_HLEN + 8 + IP6_HLEN + 8;
/// 16-bit words: of the reply, where its IPv6 header starts, where its ICMPv6 header starts.
const W: usize = UNREACH6_LEN / 2;
const W_IP: usize = ETH_HLEN / 2;
const W_ICMP: usize = W_IP + IP6_HLEN / 2;
/// Words quoted: the client's IPv6 and UDP headers.
const W_QUOTE: usize = (IP6_HLEN + 8) / 2;

impl Reject for V6 {
    const L4_PLAIN: usize = Packet6::L4;
    const LEN: usize = IP6_PLEN;
    const LEN_HDR: usize = 0;

    #[inline(always)]
    fn set_len(ctx: &TcContext, _: u16, new: u16) -> Result<(), ()> {
        ctx.store(Self::LEN, &new, 0).map_err(|_| ())
    }

    /// ICMPv6 destination unreachable / port unreachable from the frontend. Built in place
    /// like IPv4's (ICMPv6 header where the UDP header was, frame resized to exactly the
    /// reply), without a copy of the frame on the stack (the BPF stack is 512 bytes); the
    /// checksum, which covers the IPv6 pseudo header, is computed in full. A CHECKSUM_PARTIAL
    /// datagram (from a local veth peer) gives a reply the receiving peer's stack does not
    /// verify; on a physical device ingress skbs are never CHECKSUM_PARTIAL.
    #[inline(always)]
    fn udp_unreachable(ctx: &mut TcContext, _: &Packet6) -> Result<Verdict, ()> {
        if ctx.len() as usize != UNREACH6_LEN {
            // SAFETY: the context pointer is valid for the program's run.
            if unsafe { bpf_skb_change_tail(ctx.skb.skb, UNREACH6_LEN as u32, 0) } != 0 {
                return Ok(DROP);
            }
        }
        if ctx.data() + UNREACH6_LEN > ctx.data_end() && ctx.pull_data(UNREACH6_LEN as u32).is_err()
        {
            return Ok(DROP);
        }
        let Some(f) = at::<[u16; W]>(ctx.data(), ctx.data_end(), 0) else {
            return Ok(DROP);
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
        Ok((unsafe { bpf_redirect(ifindex, 0) }) as i32)
    }
}
