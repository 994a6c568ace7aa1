//! One conntrack entry as kproxy sees it: the two tuples plus the few fields a delete or a
//! log line needs.

use std::fmt;
use std::net::IpAddr;

/// One direction of a connection: addresses, L4 protocol number and ports (0 for protocols
/// without ports, e.g. ICMP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tuple {
    pub src: IpAddr,
    pub dst: IpAddr,
    /// IANA protocol number (6 TCP, 17 UDP, 132 SCTP, …).
    pub proto: u8,
    pub src_port: u16,
    pub dst_port: u16,
}

impl fmt::Display for Tuple {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let proto = match self.proto {
            6 => "tcp".to_string(),
            17 => "udp".to_string(),
            132 => "sctp".to_string(),
            n => format!("proto {n}"),
        };
        write!(
            f,
            "{proto} {} -> {}",
            std::net::SocketAddr::new(self.src, self.src_port),
            std::net::SocketAddr::new(self.dst, self.dst_port)
        )
    }
}

/// One conntrack table entry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Entry {
    /// `CTA_TUPLE_ORIG`: the packet as the client sent it (destination = frontend).
    pub orig: Tuple,
    /// `CTA_TUPLE_REPLY`: the answer as the kernel expects it (source = DNAT target).
    pub reply: Tuple,
    /// `CTA_ZONE` (0 when absent).
    pub zone: u16,
    /// `CTA_STATUS` bits (`IPS_*`).
    pub status: u32,
    /// `CTA_MARK`.
    pub mark: u32,
    /// `CTA_ID`: the kernel's id of the entry; a delete that names it removes this very entry
    /// and not a newer one with the same tuple. `None` when the kernel did not report one.
    pub id: Option<u32>,
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (reply {} -> {})",
            self.orig,
            std::net::SocketAddr::new(self.reply.src, self.reply.src_port),
            std::net::SocketAddr::new(self.reply.dst, self.reply.dst_port)
        )
    }
}
