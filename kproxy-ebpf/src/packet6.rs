//! Direct packet access for IPv6 on the TC service path ([`crate::tc`]): the Ethernet + IPv6
//! parser. Bounds-checked pointers, the L4 header parser and checksum folding come from
//! [`crate::packet`].
//!
//! Only packets whose IPv6 header is followed directly by TCP, UDP or ICMPv6 are parsed
//! (`next header` of the fixed header); packets with extension headers (hop-by-hop, routing,
//! fragment, destination options, …) are [`Parsed::Other`] and pass the TC programs
//! unchanged. Kubernetes service traffic carries none in practice; a fragmented datagram to a
//! frontend is therefore not translated (IPv6 fragments are rare: the sender does PMTU
//! discovery, and `Packet Too Big` errors about translated flows are translated, see
//! [`crate::tc_icmp`]).

use kproxy_common::ct6::PROTO_ICMPV6;

use crate::packet::{ETH_HLEN, L4, Parsed, at, parse_l4};

/// `ETH_P_IPV6` as the frame carries it (network order, read as a native `u16`).
pub const ETH_P_IPV6_BE: u16 = 0x86ddu16.to_be();
pub const IP6_OFF: usize = ETH_HLEN;
/// Length of the fixed IPv6 header.
pub const IP6_HLEN: usize = 40;
/// Offset of the payload length field.
pub const IP6_PLEN: usize = IP6_OFF + 4;
pub const IP6_SADDR: usize = IP6_OFF + 8;
pub const IP6_DADDR: usize = IP6_OFF + 24;
/// Offset of the L4 header (no extension headers).
pub const L4_OFF: usize = IP6_OFF + IP6_HLEN;
/// Bytes of every header the parser reads, at most: what a TC program pulls into the linear
/// area when it is short.
pub const PARSE6_LEN: u32 = (L4_OFF + 20) as u32;

/// An IPv6 packet's 5-tuple. Addresses (`ipv6hdr` words) and ports in network order.
pub struct Packet6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    /// TCP flags (0 for others).
    pub tcp_flags: u8,
}

impl Packet6 {
    /// Offset of the L4 header (fixed: extension headers are not parsed).
    pub const L4: usize = L4_OFF;
}

/// What [`parse6`] found (`Other`: not an IPv6 TCP/UDP/ICMPv6 packet without extension
/// headers).
pub type Parsed6 = Parsed<Packet6>;

/// Whether the frame at `data` is IPv6 (ethertype only; no bounds beyond the Ethernet header).
#[inline(always)]
pub fn is_ipv6(data: usize, end: usize) -> bool {
    match at::<[u16; 7]>(data, end, 0) {
        // SAFETY: bounds-checked by `at`.
        Some(eth) => (unsafe { (*eth)[6] }) == ETH_P_IPV6_BE,
        None => false,
    }
}

/// Parses Ethernet + IPv6 (+ TCP/UDP ports, ICMPv6) by direct access.
#[inline(always)]
pub fn parse6(data: usize, end: usize) -> Parsed6 {
    let Some(eth) = at::<[u16; 7]>(data, end, 0) else {
        return Parsed::Short;
    };
    // SAFETY: bounds-checked above.
    if unsafe { (*eth)[6] } != ETH_P_IPV6_BE {
        return Parsed::Other;
    }
    let Some(ip) = at::<[u32; 10]>(data, end, IP6_OFF) else {
        return Parsed::Short;
    };
    // SAFETY: bounds-checked above; raw network-order words.
    let w = unsafe { *ip };
    if (w[0] as u8) >> 4 != 6 {
        return Parsed::Other;
    }
    // Next header is byte 6 of the header: the third byte of word 1 in memory order.
    let proto = (w[1] >> 16) as u8;
    let saddr = [w[2], w[3], w[4], w[5]];
    let daddr = [w[6], w[7], w[8], w[9]];
    let (sport, dport, tcp_flags) = match parse_l4(data, end, L4_OFF, proto, PROTO_ICMPV6) {
        L4::Ports(sport, dport, flags) => (sport, dport, flags),
        L4::Short => return Parsed::Short,
        L4::Other => return Parsed::Other,
    };
    Parsed::Packet(Packet6 {
        saddr,
        daddr,
        sport,
        dport,
        proto,
        tcp_flags,
    })
}
