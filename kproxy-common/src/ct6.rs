//! The IPv6 half of the TC service path's connection tracking and NAT state: what the IPv6
//! programs `kp_tc_in6` / `kp_tc_eg6` write (`kproxy-ebpf/src/tc.rs`, the same code as the
//! IPv4 programs, generic over the family) and the agent reads, purges and expires.
//!
//! The model is exactly the IPv4 one of [`crate::ct`] (same four [`CtKind`]s per flow, same
//! `CT_F_*` flags, DNAT at ingress and SNAT at egress, the SNAT port range and timeouts of
//! [`crate::ct::NatConfig`], the counters of [`crate::ct::TcStat`]); only the addresses are
//! 16 bytes, so IPv6 flows live in their own maps: [`MAP_CT6`] and [`MAP_NODE_ADDR6`].
//!
//! Addresses are `[u32; 4]` holding the 16 address bytes in network order (each `u32` is
//! `from_ne_bytes` of four bytes, as `ipv6hdr.saddr` holds them; the same encoding as
//! [`crate::service`] keys). Ports are network order.

pub use crate::ct::{CT_F_CLOSING, CT_F_LOCAL_BACKEND, CT_F_SNAT, CtKind};

/// LRU hash [`CtKey6`] → [`CtEntry6`]: the IPv6 connection table (pinned by name like every
/// TC map).
pub const MAP_CT6: &str = "KP_CT6";
/// Hash ifindex (`u32`) → [`NodeAddr6`]: the IPv6 node address SNAT uses when a packet leaves
/// through that device. Filled by the agent's address tracker.
pub const MAP_NODE_ADDR6: &str = "KP_NODE_ADDR6";

/// TC classifier for the ingress of node devices, IPv6 frames (attached beside
/// [`crate::ct::PROG_TC_INGRESS`], which passes them on).
pub const PROG_TC6_INGRESS: &str = "kp_tc_in6";
/// TC classifier for the egress of node devices, IPv6 frames.
pub const PROG_TC6_EGRESS: &str = "kp_tc_eg6";
/// Every program the IPv6 service path adds.
pub const PROGRAMS: [&str; 2] = [PROG_TC6_INGRESS, PROG_TC6_EGRESS];

/// Every map the IPv6 service path adds.
pub const MAPS: [&str; 2] = [MAP_CT6, MAP_NODE_ADDR6];

/// IANA protocol number of ICMPv6.
pub const PROTO_ICMPV6: u8 = 58;

/// Key of [`MAP_CT6`]: the IPv6 5-tuple as the packet carries it where the entry is used, plus
/// the entry's [`CtKind`] (see the table in [`crate::ct`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey6 {
    pub saddr: [u32; 4],
    pub daddr: [u32; 4],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub kind: u8,
    pub _pad: [u8; 2],
}

/// Value of [`MAP_CT6`]; fields as in [`crate::ct::CtEntry`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry6 {
    /// New destination ([`CtKind::Service`], [`CtKind::SnatIn`]) or source ([`CtKind::RevDnat`],
    /// [`CtKind::SnatOut`]) address. All zero in a legacy [`CtKind::SnatOut`] entry whose port
    /// is not allocated yet.
    pub nat_addr: [u32; 4],
    /// New port, network order.
    pub nat_port: u16,
    /// `CT_F_*`.
    pub flags: u16,
    /// The backend id (`KP_BACKENDS` key) the flow goes to.
    pub backend_id: u32,
    /// The service id the flow was load-balanced by.
    pub svc_id: u32,
    pub _pad: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
    /// The flow's SNAT source in its [`CtKind::RevDnat`] entry (as
    /// [`crate::ct::CtEntry::snat_addr`]); all zero until allocated.
    pub snat_addr: [u32; 4],
    /// The SNAT port (network order).
    pub snat_port: u16,
    pub _pad2: [u16; 3],
}

/// Value of [`MAP_NODE_ADDR6`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeAddr6 {
    pub addr: [u32; 4],
}

// SAFETY (all three): `#[repr(C)]`, `Copy`, integers only, explicit `_pad` fields (sizes
// checked by the tests below), so every bit pattern is valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for CtKey6 {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for CtEntry6 {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for NodeAddr6 {}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn types_have_no_implicit_padding() {
        assert_eq!(size_of::<CtKey6>(), 16 + 16 + 2 + 2 + 1 + 1 + 2);
        assert_eq!(
            size_of::<CtEntry6>(),
            16 + 2 + 2 + 4 + 4 + 4 + 8 + 8 + 16 + 2 + 6
        );
        assert_eq!(size_of::<NodeAddr6>(), 16);
    }

    #[test]
    fn names_fit_the_kernel_object_name_limit_and_differ_from_v4() {
        for name in MAPS {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
            assert!(!crate::ct::MAPS.contains(&name), "{name}");
        }
        for name in PROGRAMS {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
            assert!(!crate::ct::PROGRAMS.contains(&name), "{name}");
        }
    }
}
