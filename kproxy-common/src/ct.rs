//! The TC service path's connection tracking and NAT state (IPv4): what the `kp_tc_in` /
//! `kp_tc_eg` programs on node devices write and the agent reads, purges and expires.
//! IPv6 flows follow the same model in their own maps ([`crate::ct6`]).
//!
//! One flow from an external client `C:cp` to a frontend `F:fp` (NodePort on a node address,
//! ExternalIP or LoadBalancer VIP) that is DNATed to backend `B:bp` — and, when upstream would
//! masquerade (externalTrafficPolicy=Cluster, backend not on this node), SNATed to `N:np` (`N` =
//! the node address of the device the packet leaves through, `np` from the SNAT port range) —
//! owns up to three entries in [`MAP_CT`], each keyed by the 5-tuple the packet carries where
//! the entry is used and saying which translation to apply there:
//!
//! | kind | where | key (as seen there) | translation |
//! |---|---|---|---|
//! | [`CtKind::Service`] | ingress | `C:cp → F:fp` | dst := `B:bp` (the flow's backend) |
//! | [`CtKind::RevDnat`] | egress | `B:bp → C:cp` | src := `F:fp`; and for `C:cp → B:bp` (looked up reversed), src := `N:np` ([`CtEntry::snat_addr`], allocated on the first packet) |
//! | [`CtKind::SnatIn`] | ingress | `B:bp → N:np` | dst := `C:cp` |
//!
//! The flow's two tuples between client and backend are one pair seen from either end, so one
//! entry serves both egress directions: a SNATed flow's SNAT source lives in its `RevDnat`
//! entry ([`CT_F_SNAT_HERE`]), which saves a new flow a third connection-table insert (each
//! costs a few cold cache lines; see `bench/src/tc_path.rs`). Flows created by builds
//! before that kept it in a separate [`CtKind::SnatOut`] entry (`C:cp → B:bp`); the programs
//! still read such an entry for a flow whose `RevDnat` entry lacks [`CT_F_SNAT_HERE`], so flows
//! survive an upgrade, but no longer create one.
//!
//! A `RevDnat` key names no frontend: a client `C:cp` reaching one backend through two
//! frontends (the same source port toward two NodePorts of services sharing a pod) gives two
//! flows one `RevDnat` key. The newer flow takes it over and deletes the older flow's other
//! entries, which without it would outlive the flow (`kproxy-ebpf/src/flow.rs`,
//! `release_reply_tuple`; netfilter would remap the second flow's source port instead). A SYN
//! that finds a closed flow's `Service` entry (FIN or RST seen) ends that flow and is
//! load-balanced afresh (`reopens`), as conntrack treats a SYN in TIME_WAIT / CLOSE.
//!
//! DNAT happens at ingress before routing and SNAT at egress after it, like netfilter's
//! PREROUTING/POSTROUTING, so every rewrite leaves a packet whose source is valid for the
//! device it crosses: the reverse DNAT of a reply (source becomes a node/VIP address) is done
//! at the egress toward the client, where `rp_filter` does not look (kernel facts:
//! TOOLCHAIN.md §2). ICMP errors (port unreachable, fragmentation needed) about a translated
//! flow are translated with the same entries, looked up by the quoted (inner) tuple reversed.
//!
//! The XDP program on node devices (`kp_xdp`, `--bpf-xdp`) reads and writes the same entries
//! for flows to remote backends: it creates a new flow's entries exactly like the TC ingress
//! program (shared BPF code), allocates the SNAT port like the TC egress program (with the FIB
//! egress device's node address), and translates both directions itself, so a flow may start
//! in either path and continue in the other. A SNATed flow the fast path forwards gets no
//! `RevDnat` entry until a TC program needs one ([`CT_F_NO_REV`]): XDP translates its replies
//! from the `SnatIn` entry, which then carries the frontend.
//!
//! Addresses are stored in network byte order (the raw bytes of the header, read as a `u32`),
//! ports likewise; the agent converts with `u32::from_ne_bytes(ip.octets())` /
//! `u16::to_be`. Every entry of a flow carries the flow's backend id, so
//! `purge_backends` removes all entries of flows to a removed backend.

/// LRU hash [`CtKey`] → [`CtEntry`]: the connection table. Every map of this module is pinned
/// by name (`<bpffs>/kproxy/<NAME>`), so a restarted agent keeps flows, SNAT sources and
/// counters.
pub const MAP_CT: &str = "KP_CT";
/// Array with one [`NatConfig`] (index 0): SNAT port range and timeouts.
pub const MAP_NAT_CONFIG: &str = "KP_NAT_CFG";
/// Hash ifindex (`u32`) → [`NodeAddr4`]: the IPv4 node address SNAT uses when a packet leaves
/// through that device. Filled by the agent's address tracker.
pub const MAP_NODE_ADDR4: &str = "KP_NODE_ADDR4";
/// Per-CPU array of `u64` counters indexed by [`TcStat`].
pub const MAP_TC_STATS: &str = "KP_TC_STATS";

/// TC classifier for the ingress of node devices (DNAT of new/established flows, reverse
/// SNAT of replies, source ranges, reject without endpoints).
pub const PROG_TC_INGRESS: &str = "kp_tc_in";
/// TC classifier for the egress of node devices (SNAT, reverse DNAT of replies).
pub const PROG_TC_EGRESS: &str = "kp_tc_eg";
/// XDP program on node devices (`--bpf-xdp`): drops, before the stack, new flows the TC
/// ingress program would drop anyway (loadBalancerSourceRanges denials, frontends without
/// endpoints whose packets are dropped rather than rejected), and forwards flows to remote
/// backends and their replies itself (same CT entries as TC); passes everything else to TC.
pub const PROG_XDP: &str = "kp_xdp";
/// Per-CPU array of `u64` counters indexed by [`XdpStat`].
pub const MAP_XDP_STATS: &str = "KP_XDP_STATS";
/// Array indexed by ifindex of `u32` (1: yes): the devices the XDP forwarding fast path may
/// take frames from and send frames out of (`XDP_TX` / `bpf_redirect`). Not pinned: written
/// by the agent instance that attaches `kp_xdp` (see `kproxy::dataplane::ebpf_tc::xdp`).
pub const MAP_XDP_FWD_DEVS: &str = "KP_XDP_FWD_DEVS";
/// Entries of [`MAP_XDP_FWD_DEVS`]: devices with a higher ifindex are never fast-path devices
/// (node NICs are created at boot and have small ones; pod veths, which churn ifindexes
/// upward, are no fast-path devices anyway).
pub const XDP_FWD_DEVS_MAX: u32 = 16_384;
/// `Array<u32>` of [`FWD_GEN_WORDS`] entries, not pinned (one per loaded object, like
/// [`MAP_XDP_FWD_DEVS`]): at [`FWD_GEN_CURRENT`] the generation of the routing state the XDP
/// fast path's forwarding caches ([`FwdCache`], [`BackendFwd`]) must match, 0 (never
/// written) turning them all off; at [`FWD_GEN_PER_BACKEND`] whether new flows may use the
/// per-backend cache ([`MAP_BACKEND_FWD`]): non-zero only while the agent has seen that the
/// node's IPv4 routing answers do not depend on the client's address.
pub const MAP_FWD_GEN: &str = "KP_FWD_GEN";
/// Index of [`MAP_FWD_GEN`]: the current generation.
pub const FWD_GEN_CURRENT: u32 = 0;
/// Index of [`MAP_FWD_GEN`]: non-zero when the per-backend cache of new flows is allowed.
pub const FWD_GEN_PER_BACKEND: u32 = 1;
/// Entries of [`MAP_FWD_GEN`].
pub const FWD_GEN_WORDS: u32 = 2;
/// Per-CPU array of [`BACKEND_FWD_ENTRIES`] [`BackendFwd`], not pinned, indexed by backend id
/// modulo its size (a direct-mapped cache tagged with the backend address): the forwarding
/// result of the last new flow to each backend, which the next new flow to it reuses instead
/// of `bpf_fib_lookup` (see [`BackendFwd`]).
pub const MAP_BACKEND_FWD: &str = "KP_BE_FWD";
/// Entries of [`MAP_BACKEND_FWD`] per CPU (a power of two: the index is a mask of the
/// backend id). 32 B each: 128 KiB per CPU.
pub const BACKEND_FWD_ENTRIES: u32 = 4096;
/// Every node-device service-path program.
pub const PROGRAMS: [&str; 3] = [PROG_TC_INGRESS, PROG_TC_EGRESS, PROG_XDP];
/// Fully closed TCP flows (FIN both ways) stay this long: the kernel's
/// `nf_conntrack_tcp_timeout_time_wait` default (`bpf.conntrack.tcpTimeWaitTimeout`).
pub const DEFAULT_CT_TCP_TIME_WAIT_SECS: u64 = 120;
/// Reset TCP flows stay this long: the kernel's `nf_conntrack_tcp_timeout_close` default
/// (`bpf.conntrack.tcpCloseTimeout`).
pub const DEFAULT_CT_TCP_CLOSE_SECS: u64 = 10;
/// Period of the agent's expiry of the connection tables (`bpf.conntrack.expiryInterval`).
pub const DEFAULT_CT_EXPIRY_INTERVAL_SECS: u64 = 15;

/// Every map the node-device service path owns.
pub const MAPS: [&str; 6] = [
    MAP_CT,
    MAP_NAT_CONFIG,
    MAP_NODE_ADDR4,
    MAP_TC_STATS,
    MAP_XDP_STATS,
    MAP_XDP_FWD_DEVS,
];

/// Default capacity of [`MAP_CT`] (entries; a SNATed flow uses up to three).
pub const DEFAULT_CT_ENTRIES: u32 = 262_144;
/// Capacity of [`MAP_NODE_ADDR4`] (devices).
pub const NODE_ADDR_ENTRIES: u32 = 256;

/// Default SNAT port range: above Linux's default ephemeral range (32768–60999), so SNAT ports
/// do not collide with the node's own outgoing connections.
pub const DEFAULT_SNAT_PORT_MIN: u16 = 61_000;
/// Upper end (inclusive) of the default SNAT port range.
pub const DEFAULT_SNAT_PORT_MAX: u16 = 65_535;
/// Random candidate ports a new SNAT flow tries (lookups) after its first random pick is taken,
/// before the programs sweep the whole range for a free one (`kproxy-ebpf/src/flow.rs`,
/// `allocate_port`). A flow finding no free port in the range is dropped and counted in
/// [`TcStat::SnatExhausted`].
pub const SNAT_PORT_TRIES: u32 = 32;

/// Seconds an idle TCP entry lives before the agent's expiry removes it (kube-proxy's
/// `--conntrack-tcp-timeout-established` default is 24 h; LRU eviction bounds memory anyway).
pub const DEFAULT_TCP_TIMEOUT_SECS: u32 = 86_400;
/// Seconds an idle UDP/ICMP entry lives (kube-proxy's `--conntrack-udp-timeout` default 30 s is
/// for unreplied streams; replied ones get 120 s there, which we use for all).
pub const DEFAULT_UDP_TIMEOUT_SECS: u32 = 120;

/// IANA protocol number of ICMP (TCP/UDP: `crate::service`).
pub const PROTO_ICMP: u8 = 1;

/// Which translation an entry applies (see the module table).
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CtKind {
    Service = 1,
    RevDnat = 2,
    /// Only in tables written by earlier builds (see the module docs).
    SnatOut = 3,
    SnatIn = 4,
}

impl CtKind {
    pub const fn from_u8(v: u8) -> Option<CtKind> {
        match v {
            1 => Some(CtKind::Service),
            2 => Some(CtKind::RevDnat),
            3 => Some(CtKind::SnatOut),
            4 => Some(CtKind::SnatIn),
            _ => None,
        }
    }
}

/// Key of [`MAP_CT`]: the IPv4 5-tuple as the packet carries it where the entry is used, plus
/// the entry's [`CtKind`]. For ICMP echo, `sport`/`dport` are unused (0).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CtKey {
    pub saddr: u32,
    pub daddr: u32,
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub kind: u8,
    pub _pad: [u8; 2],
}

/// The entry is part of a SNATed flow.
pub const CT_F_SNAT: u16 = 1 << 0;
/// The flow's backend is on this node.
pub const CT_F_LOCAL_BACKEND: u16 = 1 << 1;
/// A TCP FIN or RST was seen through this entry (kept for agents of earlier builds, which
/// expire such a flow after their close timeout; this build reads the bits below).
pub const CT_F_CLOSING: u16 = 1 << 2;
/// A FIN from the client (the flow's original direction, client → backend) passed this entry.
///
/// This bit, [`CT_F_FIN_REPLY`] and [`CT_F_RST`] were unused (zero) in entries of earlier
/// builds, and [`CT_F_CLOSING`] keeps its meaning, so the entry layout version stays
/// (`crate::layout`: nothing redefined); such entries read as [`TcpCloseState::Legacy`].
pub const CT_F_FIN_ORIG: u16 = 1 << 4;
/// A FIN from the backend (the reply direction) passed this entry.
pub const CT_F_FIN_REPLY: u16 = 1 << 5;
/// A RST (either direction) passed this entry: the connection is gone.
pub const CT_F_RST: u16 = 1 << 6;
/// The close-state bits, cleared when a SYN reuses the tuple for a new connection.
pub const CT_F_CLOSE_MASK: u16 = CT_F_CLOSING | CT_F_FIN_ORIG | CT_F_FIN_REPLY | CT_F_RST;

/// TCP header flag bits (byte 13 of the header) the programs read.
pub const TCP_FIN: u8 = 0x01;
pub const TCP_SYN: u8 = 0x02;
pub const TCP_RST: u8 = 0x04;
pub const TCP_ACK: u8 = 0x10;

/// An entry's flags after a packet with TCP flags `tcp_flags` passed it in the direction
/// whose FIN bit is `fin` ([`CT_F_FIN_ORIG`] or [`CT_F_FIN_REPLY`]); the programs call it only
/// when SYN, FIN or RST is set. A SYN starts a new connection on the tuple (a reused client
/// port, as the kernel reopens a TIME_WAIT/CLOSE entry): the close state is cleared. A FIN
/// marks its direction closed, a RST the whole connection.
#[inline(always)]
pub const fn close_state(flags: u16, tcp_flags: u8, fin: u16) -> u16 {
    let mut f = flags;
    if tcp_flags & TCP_SYN != 0 {
        f &= !CT_F_CLOSE_MASK;
    }
    if tcp_flags & TCP_FIN != 0 {
        f |= CT_F_CLOSING | fin;
    }
    if tcp_flags & TCP_RST != 0 {
        f |= CT_F_CLOSING | CT_F_RST;
    }
    f
}

/// TCP state of a flow, from the close bits of all its entries ORed (the agent's expiry;
/// each entry sees one or both directions, so only the union tells the flow's state).
/// Mirrors the kernel's nf_conntrack TCP states at the granularity expiry needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TcpCloseState {
    /// No FIN or RST: established (or still opening).
    Open,
    /// FIN in one direction only (kernel FIN_WAIT / CLOSE_WAIT): the other side may still
    /// send; kept for the close-wait timeout.
    HalfClosed,
    /// FIN in both directions (kernel LAST_ACK / TIME_WAIT).
    Closed,
    /// RST seen (kernel CLOSE).
    Reset,
    /// Only [`CT_F_CLOSING`]: an entry an earlier build marked (FIN or RST, direction
    /// unknown); treated like [`TcpCloseState::HalfClosed`], the longer of the two.
    Legacy,
}

impl TcpCloseState {
    /// The state told by `flags` (the union of a flow's entries' flags).
    pub const fn of(flags: u16) -> TcpCloseState {
        if flags & CT_F_RST != 0 {
            TcpCloseState::Reset
        } else if flags & CT_F_FIN_ORIG != 0 && flags & CT_F_FIN_REPLY != 0 {
            TcpCloseState::Closed
        } else if flags & (CT_F_FIN_ORIG | CT_F_FIN_REPLY) != 0 {
            TcpCloseState::HalfClosed
        } else if flags & CT_F_CLOSING != 0 {
            TcpCloseState::Legacy
        } else {
            TcpCloseState::Open
        }
    }
}
/// With [`CT_F_SNAT`]: the flow's SNAT source is in its [`CtKind::RevDnat`] entry's
/// `snat_addr`/`snat_port` (every flow this build creates); without, in its legacy
/// [`CtKind::SnatOut`] entry (see the module docs).
pub const CT_F_SNAT_HERE: u16 = 1 << 3;
/// The flow has no [`CtKind::RevDnat`] entry yet: the XDP fast path created it (a SNATed
/// flow to a remote backend) with its two other entries only, each holding what the missing
/// one would — the [`CtKind::Service`] entry its SNAT source `N:np` in `snat_addr`/`snat_port`,
/// the [`CtKind::SnatIn`] entry its frontend `F:fp` there — so XDP translates both directions
/// without it, and a new flow costs two connection-table inserts instead of three. A TC
/// program that hits such an entry (a packet of the flow the fast path passed on) creates the
/// `RevDnat` entry from it, which its egress needs, and clears the bit in that entry
/// (`kproxy-ebpf/src/flow.rs`, `adopt_xdp_flow`). Introduced with [`MAP_CT`]'s layout version 2.
pub const CT_F_NO_REV: u16 = 1 << 7;

/// Value of [`MAP_CT`]: the address/port written by this entry's translation, the flow's
/// backend and service, and when it was created/last used (`bpf_ktime_get_ns`, CLOCK_MONOTONIC
/// nanoseconds, the clock userspace reads with `clock_gettime(CLOCK_MONOTONIC)`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtEntry {
    /// New destination ([`CtKind::Service`], [`CtKind::SnatIn`]) or source ([`CtKind::RevDnat`],
    /// [`CtKind::SnatOut`]) address, network order. 0 in a legacy [`CtKind::SnatOut`] entry
    /// whose port is not allocated yet.
    pub nat_addr: u32,
    /// New port, network order (0 for ICMP echo).
    pub nat_port: u16,
    /// `CT_F_*`.
    pub flags: u16,
    /// The backend id (`BACKENDS` key) the flow goes to.
    pub backend_id: u32,
    /// The service id the flow was load-balanced by.
    pub svc_id: u32,
    pub created_ns: u64,
    pub last_seen_ns: u64,
    /// In the [`CtKind::RevDnat`] entry of a flow with [`CT_F_SNAT_HERE`]: the SNAT source
    /// `N` of the flow's packets to its backend (network order), 0 until the first one leaves
    /// and allocates it (the authoritative copy). Elsewhere a copy kept beside a forwarding
    /// cache ([`Self::fwd`], written by the XDP fast path only; 0 until then): in the
    /// [`CtKind::Service`] entry the same SNAT source, in the [`CtKind::SnatIn`] entry the
    /// flow's frontend `F` (the source a reply gets). With [`CT_F_NO_REV`] (no `RevDnat`
    /// entry) these two are the flow's own values, written when it is created.
    pub snat_addr: u32,
    /// The port beside [`Self::snat_addr`] (`np`, or `fp` in a `SnatIn` entry), network order.
    pub snat_port: u16,
    pub _pad: u16,
    /// The XDP fast path's forwarding result for the packets this entry translates
    /// ([`FwdCache`]; appended in 2026-11, zero in entries carried over from older pins).
    pub fwd: FwdCache,
}

/// What `bpf_fib_lookup` answered for a flow's packets in one direction, cached in the entry
/// the XDP fast path looks up first for them (the `Service` entry client → backend, the
/// `SnatIn` entry backend → client) so that later packets skip the lookup (and the second
/// connection-table lookup: the rewritten source sits beside it in
/// [`CtEntry::snat_addr`]).
///
/// Valid only while [`Self::generation`] equals the value in [`MAP_FWD_GEN`], which the agent sets
/// to a fresh random value when it loads the programs and changes on every routing,
/// neighbour, address, rule or link change it is told about (rtnetlink), and only for a
/// frame with the same ingress device and TOS and a length within [`Self::mtu`]. Packets
/// with SYN, FIN or RST always take the full path (they update every entry's close state).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FwdCache {
    /// [`MAP_FWD_GEN`]'s value when the lookup was made (read before it); 0: nothing cached.
    pub generation: u32,
    /// The lookup's ingress device (fast-path devices have ifindex < [`XDP_FWD_DEVS_MAX`]).
    pub in_ifindex: u16,
    /// The egress device it answered.
    pub out_ifindex: u16,
    /// The egress MTU it answered (a longer frame takes the full path, which passes it).
    pub mtu: u16,
    /// The lookup's TOS.
    pub tos: u8,
    pub _pad: u8,
    /// Destination then source MAC: the frame's first 12 bytes.
    pub eth: [u8; 12],
}

/// The XDP fast path's forwarding result for new flows to one backend ([`MAP_BACKEND_FWD`]):
/// what `bpf_fib_lookup` answered for a new flow to [`Self::backend`] and the node address
/// of the egress device (`KP_NODE_ADDR4`), the flow's SNAT source address.
///
/// A new flow's lookup uses the client's address as source, so its answer is one backend's
/// answer for every client only when routing does not look at the source: with the kernel's
/// default policy rules alone (local, main, default: no source, iif, fwmark selectors) and no
/// multipath (ECMP hashes the source) or TOS-keyed routes. The agent checks this on every
/// routing announcement and allows the cache ([`FWD_GEN_PER_BACKEND`]) only then. Valid, as
/// [`FwdCache`], while [`FwdCache::generation`] is [`MAP_FWD_GEN`]'s current one, for a frame
/// from the same device with the same TOS, within the MTU, out of a fast-path device; the
/// agent also moves the generation after it rewrites `KP_NODE_ADDR4`. Per CPU, so each
/// entry has one writer and no torn answer can be read.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendFwd {
    pub fwd: FwdCache,
    /// The backend address the answer is for (network order; several backend ids share an
    /// index).
    pub backend: u32,
    /// The node address of the egress device (network order).
    pub snat_addr: u32,
}

/// Value of [`MAP_NAT_CONFIG`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NatConfig {
    /// SNAT port range, host byte order, inclusive.
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    /// `NAT_CFG_F_*`.
    pub flags: u32,
}

impl Default for NatConfig {
    fn default() -> Self {
        NatConfig {
            snat_port_min: DEFAULT_SNAT_PORT_MIN,
            snat_port_max: DEFAULT_SNAT_PORT_MAX,
            flags: 0,
        }
    }
}

/// Value of [`MAP_NODE_ADDR4`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeAddr4 {
    /// Network order.
    pub addr: u32,
}

/// Counters in [`MAP_TC_STATS`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TcStat {
    /// New flows load-balanced (DNAT, CT entries created).
    NewFlow = 0,
    /// Packets of established flows translated from CT.
    Established = 1,
    /// Replies reverse-translated (reverse SNAT at ingress or reverse DNAT at egress).
    Reply = 2,
    /// Packets SNATed at egress.
    Snat = 3,
    /// New flows dropped because no SNAT port was free.
    SnatExhausted = 4,
    /// Packets dropped by `loadBalancerSourceRanges`.
    SourceRangeDrop = 5,
    /// New flows to a frontend without endpoints: TCP answered with a RST, UDP to an
    /// ExternalIP/LB VIP with ICMP port unreachable (to a NodePort: left to the node's stack,
    /// which answers the same), or dropped (eTP/iTP=Local without local endpoints).
    NoEndpoints = 6,
    /// ICMP errors translated.
    IcmpError = 7,
    /// New flows whose CT insert failed (map full and not LRU-evictable): dropped.
    CtInsertFailed = 8,
}

impl TcStat {
    pub const ALL: [TcStat; 9] = [
        TcStat::NewFlow,
        TcStat::Established,
        TcStat::Reply,
        TcStat::Snat,
        TcStat::SnatExhausted,
        TcStat::SourceRangeDrop,
        TcStat::NoEndpoints,
        TcStat::IcmpError,
        TcStat::CtInsertFailed,
    ];
    pub const fn index(self) -> u32 {
        self as u32
    }
}

/// Entries of [`MAP_TC_STATS`].
pub const TC_STATS: u32 = TcStat::ALL.len() as u32;

/// Counters in [`MAP_XDP_STATS`].
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum XdpStat {
    /// Packets dropped by `loadBalancerSourceRanges`.
    SourceRangeDrop = 0,
    /// Packets to a frontend without endpoints that is not rejected (eTP/iTP=Local without
    /// local endpoints), dropped.
    NoEndpointsDrop = 1,
    /// New flows load-balanced by XDP (backend chosen, CT entries created exactly like TC's).
    NewFlow = 2,
    /// Packets client → remote backend forwarded by XDP (DNAT + SNAT, `XDP_TX`/`XDP_REDIRECT`).
    Forward = 3,
    /// Replies remote backend → client forwarded by XDP (reverse SNAT + reverse DNAT).
    Reply = 4,
    /// Packets of flows whose backend is on this node (or that are not SNATed): passed to TC.
    PassLocal = 5,
    /// FIB lookup gave no next hop (no route, neighbour not resolved yet, forwarding off):
    /// passed to the stack, which resolves it.
    PassFib = 6,
    /// Longer than the egress device's MTU: passed (the stack fragments or answers
    /// "fragmentation needed").
    PassMtu = 7,
    /// IP options, a fragment, TTL ≤ 1, or a truncated L4 header: passed.
    PassHeader = 8,
    /// The flow's state could not be completed here (no node address for the egress device, no
    /// free SNAT port, a CT insert or an entry missing): passed to TC, which decides.
    PassState = 9,
    /// The ingress or the egress device is not a fast-path device (`MAP_XDP_FWD_DEVS`):
    /// passed.
    PassDevice = 10,
    /// New flows forwarded with their backend's cached forwarding result ([`BackendFwd`]),
    /// without a FIB lookup (also counted in `NewFlow` and `Forward`).
    NewFlowCached = 11,
}

impl XdpStat {
    pub const ALL: [XdpStat; 12] = [
        XdpStat::SourceRangeDrop,
        XdpStat::NoEndpointsDrop,
        XdpStat::NewFlow,
        XdpStat::Forward,
        XdpStat::Reply,
        XdpStat::PassLocal,
        XdpStat::PassFib,
        XdpStat::PassMtu,
        XdpStat::PassHeader,
        XdpStat::PassState,
        XdpStat::PassDevice,
        XdpStat::NewFlowCached,
    ];
    pub const fn index(self) -> u32 {
        self as u32
    }
}

/// Entries of [`MAP_XDP_STATS`].
pub const XDP_STATS: u32 = XdpStat::ALL.len() as u32;

// SAFETY (all five): `#[repr(C)]`, `Copy`, every bit pattern valid, and no implicit padding
// (explicit `_pad` fields; sizes checked by the tests below).
#[cfg(feature = "user")]
unsafe impl aya::Pod for CtKey {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for CtEntry {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for BackendFwd {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for NatConfig {}
#[cfg(feature = "user")]
unsafe impl aya::Pod for NodeAddr4 {}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn types_have_no_implicit_padding() {
        assert_eq!(size_of::<CtKey>(), 4 + 4 + 2 + 2 + 1 + 1 + 2);
        assert_eq!(size_of::<FwdCache>(), 4 + 2 + 2 + 2 + 1 + 1 + 12);
        assert_eq!(
            size_of::<CtEntry>(),
            4 + 2 + 2 + 4 + 4 + 8 + 8 + 4 + 2 + 2 + size_of::<FwdCache>()
        );
        assert_eq!(size_of::<BackendFwd>(), size_of::<FwdCache>() + 4 + 4);
        assert!(BACKEND_FWD_ENTRIES.is_power_of_two());
        assert_eq!(size_of::<NatConfig>(), 8);
        assert_eq!(size_of::<NodeAddr4>(), 4);
    }

    #[test]
    fn names_fit_the_kernel_object_name_limit() {
        for name in PROGRAMS.iter().chain(MAPS.iter()) {
            assert!(name.len() <= 15, "{name} is longer than 15 bytes");
        }
    }

    #[test]
    fn kinds_round_trip() {
        for k in [
            CtKind::Service,
            CtKind::RevDnat,
            CtKind::SnatOut,
            CtKind::SnatIn,
        ] {
            assert_eq!(CtKind::from_u8(k as u8), Some(k));
        }
        assert_eq!(CtKind::from_u8(0), None);
        assert_eq!(CtKind::from_u8(5), None);
    }

    #[test]
    fn stats_index_densely() {
        for (i, s) in TcStat::ALL.iter().enumerate() {
            assert_eq!(s.index() as usize, i);
        }
        for (i, s) in XdpStat::ALL.iter().enumerate() {
            assert_eq!(s.index() as usize, i);
        }
    }

    #[test]
    fn close_state_follows_fin_per_direction_rst_and_reopening_syn() {
        let open = CT_F_SNAT;
        // FIN from the client, then from the backend (seen in two entries, ORed by expiry).
        let a = close_state(open, TCP_FIN | TCP_ACK, CT_F_FIN_ORIG);
        assert_eq!(TcpCloseState::of(a), TcpCloseState::HalfClosed);
        assert_eq!(a & CT_F_SNAT, CT_F_SNAT, "other flags kept");
        let b = close_state(open, TCP_FIN | TCP_ACK, CT_F_FIN_REPLY);
        assert_eq!(TcpCloseState::of(b), TcpCloseState::HalfClosed);
        assert_eq!(TcpCloseState::of(a | b), TcpCloseState::Closed);
        // Both FINs through one entry (a RevDnat entry sees both directions).
        let c = close_state(a, TCP_FIN | TCP_ACK, CT_F_FIN_REPLY);
        assert_eq!(TcpCloseState::of(c), TcpCloseState::Closed);
        assert_eq!(
            TcpCloseState::of(close_state(open, TCP_RST, CT_F_FIN_REPLY)),
            TcpCloseState::Reset
        );
        assert_eq!(
            TcpCloseState::of(close_state(c, TCP_RST | TCP_ACK, CT_F_FIN_ORIG)),
            TcpCloseState::Reset
        );
        // A SYN on the tuple (client port reused) opens it again.
        let reopened = close_state(c | CT_F_RST, TCP_SYN, CT_F_FIN_ORIG);
        assert_eq!(TcpCloseState::of(reopened), TcpCloseState::Open);
        assert_eq!(reopened, open);
        assert_eq!(TcpCloseState::of(CT_F_CLOSING), TcpCloseState::Legacy);
    }

    #[test]
    fn default_snat_range_is_above_the_ephemeral_range() {
        let c = NatConfig::default();
        assert!(c.snat_port_min > 60_999 && c.snat_port_min <= c.snat_port_max);
    }
}
