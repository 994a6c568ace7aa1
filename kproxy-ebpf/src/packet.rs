//! Direct packet access for the service-path programs (TC and XDP): bounds-checked
//! pointers into `[data, data_end)`, the IPv4 header parser, the L4 parser both families use
//! and checksum arithmetic. Reading
//! headers through pointers the verifier has bounds-checked costs a load each; the
//! `bpf_skb_load_bytes` helper this replaces cost a helper call per field.
//!
//! Pointers are only valid until the next helper that may move packet data
//! (`l3/l4_csum_replace`, `skb_store_bytes`, `skb_pull_data`, `skb_change_tail`,
//! `skb_adjust_room`, …): the verifier forgets them and callers re-derive them from the
//! context.

use core::mem::size_of;

use kproxy_common::ct::PROTO_ICMP;
use kproxy_common::service::{PROTO_TCP, PROTO_UDP};

pub const ETH_HLEN: usize = 14;
/// `ETH_P_IP` as the frame carries it (network order, read as a native `u16`).
const ETH_P_IP_BE: u16 = 0x0800u16.to_be();
pub const IP_OFF: usize = ETH_HLEN;
pub const IP_CSUM: usize = IP_OFF + 10;
pub const IP_SADDR: usize = IP_OFF + 12;
pub const IP_DADDR: usize = IP_OFF + 16;
const IP_OFFSET_MASK: u16 = 0x1fff;
/// Bytes of every header the parser reads, at most (Ethernet + IPv4 with options + the TCP
/// bytes up to the flags): what a TC program pulls into the linear area when it is short.
pub const PARSE_LEN: u32 = (ETH_HLEN + 60 + 20) as u32;

/// `T` at `data + off`, if it lies inside the packet.
#[inline(always)]
pub fn at<T>(data: usize, end: usize, off: usize) -> Option<*mut T> {
    let p = data + off;
    if p + size_of::<T>() > end {
        return None;
    }
    Some(p as *mut T)
}

/// An IPv4 packet's 5-tuple and where its headers are. Addresses and ports in network order.
pub struct Packet {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// TCP flags (0 for others).
    pub tcp_flags: u8,
    /// Offset of the L4 header.
    pub l4: usize,
}

/// What [`parse`] (IPv4) or [`crate::packet6::parse6`] (IPv6) found.
pub enum Parsed<P = Packet> {
    Packet(P),
    /// The headers end beyond `data_end`: not in the linear area (or a truncated packet).
    Short,
    /// Not a TCP/UDP/ICMP packet we translate (other ethertype or protocol, IPv4 non-first
    /// fragment, IPv6 extension headers).
    Other,
}

/// Parses Ethernet + IPv4 (+ TCP/UDP ports, ICMP) by direct access.
#[inline(always)]
pub fn parse(data: usize, end: usize) -> Parsed {
    let Some(eth) = at::<[u16; 7]>(data, end, 0) else {
        return Parsed::Short;
    };
    // SAFETY: bounds-checked above.
    if unsafe { (*eth)[6] } != ETH_P_IP_BE {
        return Parsed::Other;
    }
    let Some(ip) = at::<[u32; 5]>(data, end, IP_OFF) else {
        return Parsed::Short;
    };
    // SAFETY: bounds-checked above; the header's bytes are read as raw network-order words.
    let (w0, w1, w2, saddr, daddr) = unsafe { ((*ip)[0], (*ip)[1], (*ip)[2], (*ip)[3], (*ip)[4]) };
    let vihl = w0 as u8;
    if vihl >> 4 != 4 {
        return Parsed::Other;
    }
    let ihl = ((vihl & 0x0f) as usize) * 4;
    if ihl < 20 {
        return Parsed::Other;
    }
    // Flags + fragment offset are bytes 6–7 (the high half of word 1 in memory order).
    let frag = u16::from_be((w1 >> 16) as u16);
    if frag & IP_OFFSET_MASK != 0 {
        // Non-first fragment: no L4 header to look at.
        return Parsed::Other;
    }
    let proto = (w2 >> 8) as u8;
    let l4 = IP_OFF + ihl;
    let (sport, dport, tcp_flags) = match parse_l4(data, end, l4, proto, PROTO_ICMP) {
        L4::Ports(sport, dport, flags) => (sport, dport, flags),
        L4::Short => return Parsed::Short,
        L4::Other => return Parsed::Other,
    };
    Parsed::Packet(Packet {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        tcp_flags,
        l4,
    })
}

/// What [`parse_l4`] found after an IP header.
pub enum L4 {
    /// Source port, destination port (network order; 0 for ICMP) and TCP flags (0 for others).
    Ports(u16, u16, u8),
    /// The L4 header ends beyond `data_end`.
    Short,
    /// Not TCP, UDP or the family's ICMP.
    Other,
}

/// Parses the L4 header of protocol `proto` at offset `l4` (both families: `icmp` is the
/// family's ICMP protocol number, whose 8-byte header must be present).
#[inline(always)]
pub fn parse_l4(data: usize, end: usize, l4: usize, proto: u8, icmp: u8) -> L4 {
    match proto {
        PROTO_TCP => {
            let Some(t) = at::<[u16; 7]>(data, end, l4) else {
                return L4::Short;
            };
            // SAFETY: bounds-checked above.
            unsafe { L4::Ports((*t)[0], (*t)[1], ((*t)[6] >> 8) as u8) }
        }
        PROTO_UDP => {
            let Some(u) = at::<[u16; 4]>(data, end, l4) else {
                return L4::Short;
            };
            // SAFETY: bounds-checked above.
            unsafe { L4::Ports((*u)[0], (*u)[1], 0) }
        }
        _ if proto == icmp => {
            if at::<[u16; 4]>(data, end, l4).is_none() {
                return L4::Short;
            }
            L4::Ports(0, 0, 0)
        }
        _ => L4::Other,
    }
}

/// Folds a 32-bit one's-complement sum to 16 bits.
#[inline(always)]
pub fn fold(mut s: u32) -> u16 {
    s = (s & 0xffff) + (s >> 16);
    s = (s & 0xffff) + (s >> 16);
    s as u16
}

/// The checksum field `check` after a 16-bit word of the data it covers changed from `old` to
/// `new` (RFC 1624 eq. 3; raw memory words as in [`csum_replace4`]).
#[inline(always)]
pub fn csum_replace2(check: u16, old: u16, new: u16) -> u16 {
    !fold(u32::from(!check) + u32::from(!old) + u32::from(new))
}

/// The checksum field `check` after a 32-bit word of the data it covers changed from `old`
/// to `new` (RFC 1624 eq. 3, `HC' = ~(~HC + ~m + m')`). Every value is the raw memory word
/// (network order read natively); one's-complement sums do not depend on byte order as long
/// as all words are read the same way.
#[inline(always)]
pub fn csum_replace4(check: u16, old: u32, new: u32) -> u16 {
    let s = u32::from(!check)
        + u32::from(!(old as u16))
        + u32::from(!((old >> 16) as u16))
        + (new & 0xffff)
        + (new >> 16);
    !fold(s)
}

/// The L4 (TCP/UDP) checksum field `check` after the packet's address words changed from
/// `old` to `new` (one word for IPv4, four for IPv6; part of the pseudo header) and its port
/// `ports` (old, new), computed in place — for any skb but a `CHECKSUM_COMPLETE` one
/// ([`crate::skb_csum`]). `partial`: the skb is `CHECKSUM_PARTIAL`, so the field holds the
/// folded pseudo-header sum (not complemented) the device completes: only the addresses
/// enter it. `udp`: a zero field means "no checksum" and stays zero, and a computed zero is
/// sent as 0xffff (RFC 768), as the kernel's `BPF_F_MARK_MANGLED_0` does.
#[inline(always)]
pub fn l4_check_in_place(
    check: u16,
    udp: bool,
    partial: bool,
    old: &[u32],
    new: &[u32],
    ports: Option<(u16, u16)>,
) -> u16 {
    if udp && check == 0 {
        return 0;
    }
    let mut v = check;
    for (&old, &new) in old.iter().zip(new) {
        if old != new {
            v = l4_check_word(v, partial, old, new);
        }
    }
    if let Some((old, new)) = ports
        && !partial
    {
        v = csum_replace2(v, old, new);
    }
    if udp && v == 0 { 0xffff } else { v }
}

/// One 32-bit pseudo-header word of an L4 checksum changed from `old` to `new`, in place
/// (see [`l4_check_in_place`] for `partial`).
#[inline(always)]
pub fn l4_check_word(check: u16, partial: bool, old: u32, new: u32) -> u16 {
    if partial {
        !csum_replace4(!check, old, new)
    } else {
        csum_replace4(check, old, new)
    }
}
