//! Addresses as the BPF maps hold them: IPv4 v4-mapped into IPv6, four words in network order
//! (`kproxy_common`'s `[u32; 4]` address fields).

use std::net::IpAddr;

/// An address in the maps' encoding (v4-mapped for IPv4, network order words).
pub fn encode_addr(ip: IpAddr) -> [u32; 4] {
    let v6 = match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let o = v6.octets();
    std::array::from_fn(|i| {
        u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
    })
}

/// The inverse of [`encode_addr`].
pub fn decode_addr(addr: [u32; 4]) -> IpAddr {
    let mut o = [0u8; 16];
    for (i, w) in addr.iter().enumerate() {
        o[4 * i..4 * i + 4].copy_from_slice(&w.to_ne_bytes());
    }
    let v6 = std::net::Ipv6Addr::from(o);
    match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    }
}
