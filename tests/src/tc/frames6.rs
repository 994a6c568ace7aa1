//! IPv6 for the `ebpf_tc6*` tests (the service-map writers in `super` take either family):
//! Ethernet + IPv6 + TCP/UDP/ICMPv6 frames with valid checksums (pseudo header included),
//! and a parser that verifies them.

use std::net::Ipv6Addr;

use super::{MAC_A, MAC_B, TCP, UDP, csum, l4_ports};

pub const ICMPV6: u8 = 58;

fn pseudo6(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::new();
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, proto]);
    p
}

/// An IPv6 header (40 bytes, no extension headers).
pub fn ipv6_header(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, payload_len: usize) -> Vec<u8> {
    let mut h = vec![0x60, 0, 0, 0];
    h.extend_from_slice(&(payload_len as u16).to_be_bytes());
    h.extend_from_slice(&[proto, 64]);
    h.extend_from_slice(&src.octets());
    h.extend_from_slice(&dst.octets());
    h
}

fn eth6(ip_packet: &[u8]) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&MAC_B);
    f.extend_from_slice(&MAC_A);
    f.extend_from_slice(&[0x86, 0xdd]);
    f.extend_from_slice(ip_packet);
    f
}

/// The L4 bytes with their checksum (at `csum_at`) filled in over the pseudo header.
fn with_csum(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, mut l4: Vec<u8>, csum_at: usize) -> Vec<u8> {
    let mut all = pseudo6(src, dst, proto, l4.len());
    all.extend_from_slice(&l4);
    let c = csum(&all);
    let c = if proto == UDP && c == 0 { 0xffff } else { c };
    l4[csum_at..csum_at + 2].copy_from_slice(&c.to_be_bytes());
    l4
}

/// An IPv6 packet (no Ethernet) carrying a TCP segment without options.
pub fn tcp6_packet(
    src: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    let mut t = Vec::new();
    t.extend_from_slice(&src.1.to_be_bytes());
    t.extend_from_slice(&dst.1.to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    t.extend_from_slice(&[5 << 4, flags]);
    t.extend_from_slice(&64240u16.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]);
    t.extend_from_slice(payload);
    let t = with_csum(src.0, dst.0, TCP, t, 16);
    let mut ip = ipv6_header(src.0, dst.0, TCP, t.len());
    ip.extend_from_slice(&t);
    ip
}

pub fn tcp6_frame(
    src: (Ipv6Addr, u16),
    dst: (Ipv6Addr, u16),
    seq: u32,
    ack: u32,
    flags: u8,
    payload: &[u8],
) -> Vec<u8> {
    eth6(&tcp6_packet(src, dst, seq, ack, flags, payload))
}

pub fn udp6_frame(src: (Ipv6Addr, u16), dst: (Ipv6Addr, u16), payload: &[u8]) -> Vec<u8> {
    let mut u = Vec::new();
    u.extend_from_slice(&src.1.to_be_bytes());
    u.extend_from_slice(&dst.1.to_be_bytes());
    u.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
    u.extend_from_slice(&[0, 0]);
    u.extend_from_slice(payload);
    let u = with_csum(src.0, dst.0, UDP, u, 6);
    let mut ip = ipv6_header(src.0, dst.0, UDP, u.len());
    ip.extend_from_slice(&u);
    eth6(&ip)
}

/// An ICMPv6 error (`ty`/`code`, 4-byte field `mtu`) from `src` to `dst` quoting `quoted`
/// (an IPv6 packet, quoted whole).
pub fn icmp6_error_frame(
    src: Ipv6Addr,
    dst: Ipv6Addr,
    ty: u8,
    code: u8,
    mtu: u32,
    quoted: &[u8],
) -> Vec<u8> {
    let mut i = vec![ty, code, 0, 0];
    i.extend_from_slice(&mtu.to_be_bytes());
    i.extend_from_slice(quoted);
    let i = with_csum(src, dst, ICMPV6, i, 2);
    let mut ip = ipv6_header(src, dst, ICMPV6, i.len());
    ip.extend_from_slice(&i);
    eth6(&ip)
}

/// A parsed IPv6 frame, with its L4 checksum (TCP/UDP/ICMPv6, pseudo header) verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub proto: u8,
    pub sport: u16,
    pub dport: u16,
    /// The IPv6 payload.
    pub l4: Vec<u8>,
}

fn addr(b: &[u8]) -> Ipv6Addr {
    Ipv6Addr::from(<[u8; 16]>::try_from(&b[..16]).unwrap())
}

/// Parses an Ethernet + IPv6 frame and asserts its L4 checksum holds.
pub fn parse6_checked(frame: &[u8]) -> Parsed6 {
    assert!(frame.len() >= 54, "frame too short: {}", frame.len());
    assert_eq!(&frame[12..14], &[0x86, 0xdd], "not IPv6");
    let ip = &frame[14..];
    assert_eq!(ip[0] >> 4, 6);
    let plen = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    assert!(
        40 + plen <= ip.len(),
        "payload length {plen} > bytes present"
    );
    let (src, dst, proto) = (addr(&ip[8..]), addr(&ip[24..]), ip[6]);
    let l4 = ip[40..40 + plen].to_vec();
    let mut all = pseudo6(src, dst, proto, l4.len());
    all.extend_from_slice(&l4);
    assert_eq!(csum(&all), 0, "proto {proto} checksum is wrong");
    let (sport, dport) = l4_ports(proto, &l4);
    Parsed6 {
        src,
        dst,
        proto,
        sport,
        dport,
        l4,
    }
}

/// The (source, destination) addresses and ports of the IPv6 packet an ICMPv6 error quotes.
pub fn quoted6(icmp: &[u8]) -> ((Ipv6Addr, u16), (Ipv6Addr, u16)) {
    let q = &icmp[8..];
    (
        (addr(&q[8..]), u16::from_be_bytes([q[40], q[41]])),
        (addr(&q[24..]), u16::from_be_bytes([q[42], q[43]])),
    )
}
