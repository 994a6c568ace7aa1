//! The service maps: what a service frontend is, which backends it has, and the per-client state
//! of session affinity. Shared by every BPF program that load-balances (socket LB in
//! `kproxy-ebpf/src/sock.rs`, the TC programs) and the agent that writes them
//! (`kproxy::dataplane::ebpf`).
//!
//! # Who writes and reads what
//!
//! | map | kind | written by | read by |
//! |---|---|---|---|
//! | [`MAP_SERVICES`] | hash | agent (applier) | socket LB, TC |
//! | [`MAP_BACKEND_SLOTS`] | hash | agent | socket LB, TC |
//! | [`MAP_BACKENDS`] | hash | agent | socket LB, TC (and CT users: a CT entry holds a backend id) |
//! | [`MAP_AFFINITY`] | LRU hash | socket LB, TC (on selection); agent deletes entries of removed backends and expired ones | socket LB, TC |
//! | [`MAP_SOURCE_RANGES`] | LPM trie | agent | TC (frontends with [`SVC_F_SOURCE_RANGES`]) |
//! | [`MAP_SOCK_REV_NAT`] | LRU hash | socket LB (connect, sendmsg); deleted by socket LB (release) | socket LB (recvmsg, getpeername) |
//! | [`MAP_SOCK_FWD`] | LRU hash | socket LB (sendmsg); deleted by socket LB (release) | socket LB (sendmsg) |
//! | [`MAP_SOCK_SENT`] | LRU hash | socket LB (sendmsg); deleted by socket LB (release) | socket LB (release) |
//! | `KP_MAGLEV`, `KP_MAGLEV_REF` | array, hash | agent | TC (see [`crate::maglev`]) |
//!
//! Every map is pinned by name under `<bpffs>/kproxy/` (`PinningType::ByName`), so all programs
//! of the object and a restarted agent share them.
//!
//! # Encoding
//!
//! - Addresses are `[u32; 4]` holding the 16 bytes of an IPv6 address in network order (each
//!   `u32` is `from_ne_bytes` of four address bytes, exactly as `bpf_sock_addr.user_ip6` and
//!   `ipv6hdr.saddr` hold them). IPv4 addresses are stored **v4-mapped** (`::ffff:a.b.c.d`, see
//!   [`v4_mapped`]), so one key space holds both families and the family is
//!   [`is_v4_mapped`].
//! - Ports are `u16` in network byte order (as in `bpf_sock_addr.user_port` and L4 headers).
//! - Protocols are IANA numbers ([`PROTO_TCP`], [`PROTO_UDP`], [`PROTO_SCTP`]).
//!
//! # Lookup
//!
//! A program builds a [`ServiceKey`] from the destination (address, port, protocol) and the
//! traffic's [scope](SCOPE_CLUSTER), reads the [`ServiceValue`], then:
//! 1. `count == 0`: no usable endpoint: reject ([`SVC_F_REJECT`]: ECONNREFUSED / ICMP
//!    unreachable / TCP RST) or drop (flag clear: upstream's "has no local endpoints" DROP).
//! 2. with [`SVC_F_AFFINITY`]: [`AffinityKey`] `{svc_id, client}`; an entry younger than
//!    `affinity_timeout` seconds (compared with `bpf_ktime_get_ns`) whose backend still exists
//!    wins (refresh `last_used_ns`).
//! 3. TC with [`SVC_F_MAGLEV`]: the set's Maglev table entry for the flow's hash
//!    ([`crate::maglev`]);
//! 4. else slot `bpf_get_prandom_u32() % count`: [`BackendSlotKey`] `{svc_id, slot}` →
//!    [`SlotValue`], the backend's id and a copy of its [`BackendValue`] (one lookup; the
//!    affinity and Maglev paths, which have only an id, read [`MAP_BACKENDS`]); with affinity,
//!    record the choice.
//!
//! The agent writes backends → slots → service entry → deletes stale entries, so a reader never
//! finds a slot index `< count` without a backend behind it (growing: slots before count;
//! shrinking: count before deleting slots). A slot's copy of a backend is rewritten in the
//! same apply that changes the backend's value (`kproxy::dataplane::ebpf::applier`).
//!
//! `svc_id` names one (service port, endpoint set) pair: a service port has at most two sets,
//! the cluster set and the node-local set (eTP/iTP=Local), and each frontend entry points at the
//! set its scope uses. Ids are allocated by the agent and stay stable while the pair exists.

/// `HashMap<ServiceKey, ServiceValue>`: every frontend (VIP, port, protocol, scope).
pub const MAP_SERVICES: &str = "KP_SERVICES";
/// `HashMap<BackendSlotKey, SlotValue>`: slot `0..count` of a set → its backend.
pub const MAP_BACKEND_SLOTS: &str = "KP_BE_SLOTS";
/// `HashMap<u32, BackendValue>`: backend id → address.
pub const MAP_BACKENDS: &str = "KP_BACKENDS";
/// `LruHashMap<AffinityKey, AffinityValue>`: ClientIP session affinity.
pub const MAP_AFFINITY: &str = "KP_AFFINITY";
/// `LpmTrie<SourceRangeKey, u8>`: allowed client prefixes of frontends with
/// [`SVC_F_SOURCE_RANGES`] (value [`SOURCE_RANGE_ALLOW`]).
pub const MAP_SOURCE_RANGES: &str = "KP_SRC_RANGES";
/// `LruHashMap<SockRevNatKey, SockRevNatValue>`: UDP socket LB, the VIP a socket talked to
/// through a backend (restored on `recvmsg`, reported by `getpeername`).
pub const MAP_SOCK_REV_NAT: &str = "KP_SOCK_RNAT";

/// `LruHashMap<SockFwdKey, SockFwdValue>`: unconnected UDP socket LB, the backend a socket's
/// datagrams to one frontend go to (so one socket's datagrams stay on one backend, like a
/// conntrack entry would keep them).
pub const MAP_SOCK_FWD: &str = "KP_SOCK_FWD";

/// `LruHashMap<u64, SockSentValue>`: socket cookie → the (frontend, backend) pairs its
/// unconnected `sendmsg` translated, i.e. the keys of its [`MAP_SOCK_FWD`] and
/// [`MAP_SOCK_REV_NAT`] entries that its address at release does not give (an unconnected
/// socket has no peer). Read and deleted when the socket is released.
pub const MAP_SOCK_SENT: &str = "KP_SOCK_SENT";

/// Every service-map name, for checks that the object holds them all.
pub const MAPS: [&str; 11] = [
    MAP_SERVICES,
    crate::frontend_filter::MAP_FRONTEND_FILTER,
    MAP_BACKEND_SLOTS,
    MAP_BACKENDS,
    MAP_AFFINITY,
    MAP_SOURCE_RANGES,
    MAP_SOCK_REV_NAT,
    MAP_SOCK_FWD,
    MAP_SOCK_SENT,
    crate::maglev::MAP_MAGLEV,
    crate::maglev::MAP_MAGLEV_REF,
];

/// Default `max_entries` of each map (the agent overrides them from `--bpf-map-sizes`).
pub const DEFAULT_SERVICES_MAX: u32 = 65_536;
pub const DEFAULT_BACKEND_SLOTS_MAX: u32 = 262_144;
pub const DEFAULT_BACKENDS_MAX: u32 = 65_536;
pub const DEFAULT_AFFINITY_MAX: u32 = 65_536;
pub const DEFAULT_SOURCE_RANGES_MAX: u32 = 16_384;
pub const DEFAULT_SOCK_REV_NAT_MAX: u32 = 65_536;
pub const DEFAULT_SOCK_FWD_MAX: u32 = 65_536;
pub const DEFAULT_SOCK_SENT_MAX: u32 = 65_536;

pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_SCTP: u8 = 132;

/// Traffic from this node or its pods (socket LB; TC for pod-originated packets). ClusterIPs use
/// the internal set (local with iTP=Local); NodePort/ExternalIP/LB frontends use the cluster set
/// even with eTP=Local (upstream short-circuits local traffic to external destinations).
pub const SCOPE_CLUSTER: u8 = 0;
/// Traffic from outside the node (TC on node devices): the external set (local with
/// eTP=Local). ClusterIPs have no external entry; TC falls back to the [`SCOPE_CLUSTER`] one.
pub const SCOPE_EXTERNAL: u8 = 1;

/// sessionAffinity=ClientIP: use [`MAP_AFFINITY`] with `affinity_timeout` seconds.
pub const SVC_F_AFFINITY: u32 = 1 << 0;
/// The set holds only node-local endpoints (eTP/iTP=Local).
pub const SVC_F_LOCAL_ONLY: u32 = 1 << 1;
/// With `count == 0`: the service has no endpoints at all, reject (else drop).
pub const SVC_F_REJECT: u32 = 1 << 2;
/// Check the client address against [`MAP_SOURCE_RANGES`] (LB VIPs with
/// loadBalancerSourceRanges; scope external only).
pub const SVC_F_SOURCE_RANGES: u32 = 1 << 3;
/// Frontend kind: a ClusterIP.
pub const SVC_F_CLUSTER_IP: u32 = 1 << 4;
/// Frontend kind: a NodePort on one node address.
pub const SVC_F_NODE_PORT: u32 = 1 << 5;
/// Frontend kind: an externalIP.
pub const SVC_F_EXTERNAL_IP: u32 = 1 << 6;
/// Frontend kind: a LoadBalancer ingress IP (ipMode VIP).
pub const SVC_F_LOAD_BALANCER: u32 = 1 << 7;
/// TC picks new flows' backends from the set's Maglev table ([`crate::maglev`]) instead of a
/// random slot (`--bpf-lb-algorithm maglev`; external-scope frontends only).
pub const SVC_F_MAGLEV: u32 = 1 << 8;

/// The backend runs on this node.
pub const BE_F_LOCAL: u8 = 1 << 0;
/// The backend is terminating (serving-terminating fallback set).
pub const BE_F_TERMINATING: u8 = 1 << 1;

/// [`AffinityKey::kind`]: `client` is the client's address.
pub const AFFINITY_CLIENT_IP: u32 = 0;
/// [`AffinityKey::kind`]: `client[0..2]` is the client's netns cookie (socket LB: the source
/// address is unknown at connect time; one pod = one netns = one client IP).
pub const AFFINITY_NETNS_COOKIE: u32 = 1;

/// Value of an allowing [`MAP_SOURCE_RANGES`] entry.
pub const SOURCE_RANGE_ALLOW: u8 = 1;
/// Bits of [`SourceRangeKey`] before the address: `svc_id`.
pub const SOURCE_RANGE_ID_BITS: u32 = 32;

/// `::ffff:0:0/96` as the third `u32` of a v4-mapped address (bytes `00 00 ff ff`).
pub const V4_MAPPED_WORD: u32 = u32::from_ne_bytes([0, 0, 0xff, 0xff]);

/// The v4-mapped form of an IPv4 address given as its network-order `u32` (`user_ip4`,
/// `iphdr.daddr`).
#[inline(always)]
pub const fn v4_mapped(ip4: u32) -> [u32; 4] {
    [0, 0, V4_MAPPED_WORD, ip4]
}

/// Whether `addr` is an IPv4 address in v4-mapped form.
#[inline(always)]
pub const fn is_v4_mapped(addr: &[u32; 4]) -> bool {
    addr[0] == 0 && addr[1] == 0 && addr[2] == V4_MAPPED_WORD
}

/// Key of [`MAP_SERVICES`]: one frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    /// The VIP (v4-mapped for IPv4).
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    pub proto: u8,
    /// [`SCOPE_CLUSTER`] or [`SCOPE_EXTERNAL`].
    pub scope: u8,
}

/// Value of [`MAP_SERVICES`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    /// The endpoint set: key of [`MAP_BACKEND_SLOTS`], [`MAP_AFFINITY`], [`MAP_SOURCE_RANGES`].
    pub svc_id: u32,
    /// Number of slots `0..count` (0: no usable endpoint, see [`SVC_F_REJECT`]).
    pub count: u32,
    /// `SVC_F_*`.
    pub flags: u32,
    /// Session affinity timeout in seconds (with [`SVC_F_AFFINITY`]).
    pub affinity_timeout: u32,
}

/// Key of [`MAP_BACKEND_SLOTS`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub svc_id: u32,
    pub slot: u32,
}

/// Value of [`MAP_BACKEND_SLOTS`]: the backend in the slot, id and value, so choosing a
/// backend at random costs one lookup, not two (a new flow's service-map reads get slower as
/// the maps grow: issue #3, `bench/src/tc_path.rs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SlotValue {
    /// The backend's [`MAP_BACKENDS`] key.
    pub backend_id: u32,
    /// A copy of its [`MAP_BACKENDS`] value.
    pub backend: BackendValue,
}

/// Value of [`MAP_BACKENDS`] (key: backend id, `u32`, never 0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BackendValue {
    /// v4-mapped for IPv4.
    pub addr: [u32; 4],
    /// Network byte order.
    pub port: u16,
    /// `BE_F_*`.
    pub flags: u8,
    pub _pad: u8,
}

/// Key of [`MAP_AFFINITY`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AffinityKey {
    /// Client address (v4-mapped) or `[cookie as u32, (cookie >> 32) as u32, 0, 0]`.
    pub client: [u32; 4],
    pub svc_id: u32,
    /// [`AFFINITY_CLIENT_IP`] or [`AFFINITY_NETNS_COOKIE`].
    pub kind: u32,
}

impl AffinityKey {
    /// The key for a netns cookie (socket LB).
    #[inline(always)]
    pub const fn netns(svc_id: u32, cookie: u64) -> Self {
        AffinityKey {
            client: [cookie as u32, (cookie >> 32) as u32, 0, 0],
            svc_id,
            kind: AFFINITY_NETNS_COOKIE,
        }
    }
}

/// Value of [`MAP_AFFINITY`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AffinityValue {
    pub backend_id: u32,
    pub _pad: u32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) of the last use.
    pub last_used_ns: u64,
}

/// Data of a [`MAP_SOURCE_RANGES`] LPM key (prefix length =
/// [`SOURCE_RANGE_ID_BITS`] + 96 + v4 prefix, or + v6 prefix).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeKey {
    pub svc_id: u32,
    /// v4-mapped for IPv4.
    pub addr: [u32; 4],
}

/// Key of [`MAP_SOCK_REV_NAT`]: a socket and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatKey {
    /// `bpf_get_socket_cookie`.
    pub cookie: u64,
    /// Backend address (v4-mapped for IPv4).
    pub addr: [u32; 4],
    /// Backend port, network byte order.
    pub port: u16,
    pub _pad: [u8; 6],
}

/// Value of [`MAP_SOCK_REV_NAT`]: the frontend to report instead of the backend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockRevNatValue {
    /// VIP (v4-mapped for IPv4).
    pub addr: [u32; 4],
    /// VIP port, network byte order.
    pub port: u16,
    pub _pad: u16,
    pub svc_id: u32,
}

/// Key of [`MAP_SOCK_FWD`]: a socket and the frontend it sends to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFwdKey {
    /// `bpf_get_socket_cookie`.
    pub cookie: u64,
    /// Frontend address (v4-mapped for IPv4).
    pub addr: [u32; 4],
    /// Frontend port, network byte order.
    pub port: u16,
    pub _pad: [u8; 6],
}

/// Value of [`MAP_SOCK_FWD`]: the backend chosen for that socket and frontend.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockFwdValue {
    /// Backend id (re-checked in [`MAP_BACKENDS`] and the set's slots before use).
    pub backend_id: u32,
    /// The set it was chosen from and its slot there: reused only while that slot of that set
    /// still names this backend.
    pub svc_id: u32,
    pub slot: u32,
    pub _pad: u32,
}

/// Pairs one socket's [`MAP_SOCK_SENT`] entry holds. A socket that sends to more frontends
/// (or is moved to more backends) than this has its further entries deleted only by the LRU.
pub const SOCK_SENT_PAIRS: usize = 4;

/// One frontend an unconnected socket sent to and the backend it went to.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockSentPair {
    /// Frontend address (v4-mapped for IPv4): with `frontend_port`, a [`SockFwdKey`].
    pub frontend: [u32; 4],
    /// Backend address (v4-mapped for IPv4): with `backend_port`, a [`SockRevNatKey`].
    pub backend: [u32; 4],
    /// Network byte order; 0 = unused pair (a frontend port is never 0).
    pub frontend_port: u16,
    /// Network byte order.
    pub backend_port: u16,
}

/// Value of [`MAP_SOCK_SENT`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct SockSentValue {
    /// Used pairs first, in the order they were recorded.
    pub pairs: [SockSentPair; SOCK_SENT_PAIRS],
}

// SAFETY: each type is `#[repr(C)]`, `Copy`, made of integers only, with explicit padding
// fields (no implicit padding), so every bit pattern is valid.
#[cfg(feature = "user")]
mod pod {
    use super::*;
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for BackendSlotKey {}
    unsafe impl aya::Pod for SlotValue {}
    unsafe impl aya::Pod for BackendValue {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityValue {}
    unsafe impl aya::Pod for SourceRangeKey {}
    unsafe impl aya::Pod for SockRevNatKey {}
    unsafe impl aya::Pod for SockRevNatValue {}
    unsafe impl aya::Pod for SockFwdKey {}
    unsafe impl aya::Pod for SockFwdValue {}
    unsafe impl aya::Pod for SockSentValue {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn types_have_no_implicit_padding() {
        assert_eq!(size_of::<ServiceKey>(), 20);
        assert_eq!(size_of::<ServiceValue>(), 16);
        assert_eq!(size_of::<BackendSlotKey>(), 8);
        assert_eq!(size_of::<BackendValue>(), 20);
        assert_eq!(size_of::<SlotValue>(), 24);
        assert_eq!(size_of::<AffinityKey>(), 24);
        assert_eq!(size_of::<AffinityValue>(), 16);
        assert_eq!(size_of::<SourceRangeKey>(), 20);
        assert_eq!(size_of::<SockRevNatKey>(), 32);
        assert_eq!(size_of::<SockRevNatValue>(), 24);
        assert_eq!(size_of::<SockFwdKey>(), 32);
        assert_eq!(size_of::<SockFwdValue>(), 16);
        assert_eq!(size_of::<SockSentValue>(), 36 * SOCK_SENT_PAIRS);
    }

    #[test]
    fn names_fit_the_kernel_object_name_limit() {
        for name in MAPS {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }

    #[test]
    fn v4_mapped_matches_the_ipv6_representation() {
        let ip4 = u32::from_ne_bytes([10, 1, 2, 3]);
        let mapped = v4_mapped(ip4);
        let mut bytes = [0u8; 16];
        for (i, w) in mapped.iter().enumerate() {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&w.to_ne_bytes());
        }
        assert_eq!(
            bytes,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 1, 2, 3]
        );
        assert!(is_v4_mapped(&mapped));
        assert!(!is_v4_mapped(&[0, 0, 0, 1]));
    }

    #[test]
    fn netns_affinity_key_holds_the_whole_cookie() {
        let k = AffinityKey::netns(7, 0x1122_3344_5566_7788);
        assert_eq!(k.client, [0x5566_7788, 0x1122_3344, 0, 0]);
        assert_eq!(k.kind, AFFINITY_NETNS_COOKIE);
    }
}
