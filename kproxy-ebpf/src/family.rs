//! The address families of the node-device service path: what the code shared by the IPv4 and
//! IPv6 programs needs to know about one ([`Family`]: its addresses, parsed packet, connection
//! table key, entry and map, node addresses) and its two implementations, [`V4`] (`KP_CT`,
//! [`crate::packet`]) and [`V6`] (`KP_CT6`, [`crate::packet6`]).
//!
//! The connection-table logic ([`crate::flow`]), the frontend lookups ([`crate::frontend`]) and
//! the TC path ([`crate::tc`]) are written once, generic over it; the XDP fast path is IPv4
//! only and uses them with [`V4`]. Generic functions are `#[inline(always)]`, so each program
//! gets code specialized to its family: no run-time dispatch, no extra stack.

use aya_ebpf::maps::LruHashMap;
use kproxy_common::ct::{CT_F_NO_REV, CtEntry, CtKey, CtKind, FwdCache, PROTO_ICMP};
use kproxy_common::ct6::{CtEntry6, CtKey6, PROTO_ICMPV6};
use kproxy_common::service::{is_v4_mapped, v4_mapped};

use crate::flow::{PortSearch, adopt_xdp_flow, adopt_xdp_reply, maglev_backend};
use crate::maps::{KP_CT, KP_CT6, KP_NODE_ADDR4, KP_NODE_ADDR6, KP_PORT_SEARCH4, KP_PORT_SEARCH6};
use crate::packet::{PARSE_LEN, Packet, Parsed, parse};
use crate::packet6::{PARSE6_LEN, Packet6, parse6};

/// An address family (see the module docs).
pub(crate) trait Family: Sized {
    /// An address as the family's CT keys and entries hold it (network order words).
    type Addr: Copy + PartialEq + Default;
    type Key: 'static;
    type Entry: Copy + 'static;
    /// The family's parsed packet.
    type Packet;
    /// Whether Maglev tables may apply (IPv4 only: the planner builds none for IPv6).
    const MAGLEV: bool;
    /// The family's ICMP protocol number.
    const ICMP: u8;
    /// Bytes of every header [`Family::parse`] reads, at most: what a TC program pulls into
    /// the linear area when they are not all there.
    const PARSE_LEN: u32;

    /// Parses the frame `[data, end)` by direct access.
    fn parse(data: usize, end: usize) -> Parsed<Self::Packet>;
    /// A packet's `(saddr, daddr, sport, dport, proto)`, network order.
    fn tuple(p: &Self::Packet) -> (Self::Addr, Self::Addr, u16, u16, u8);
    /// A packet's source address (network order; the fields of [`Family::tuple`] one by
    /// one, for the per-packet paths: read where they are used, not kept live across calls).
    fn saddr(p: &Self::Packet) -> &Self::Addr;
    /// A packet's destination address.
    fn daddr(p: &Self::Packet) -> &Self::Addr;
    /// A packet's source port.
    fn sport(p: &Self::Packet) -> u16;
    /// A packet's destination port.
    fn dport(p: &Self::Packet) -> u16;
    /// A packet's L4 protocol.
    fn proto(p: &Self::Packet) -> u8;
    /// A packet's TCP flags (0 for other protocols).
    fn tcp_flags(p: &Self::Packet) -> u8;
    /// Offset of a packet's L4 header.
    fn l4(p: &Self::Packet) -> usize;
    /// An address as its 32-bit words (network order).
    fn words(a: &Self::Addr) -> &[u32];
    /// `addr` in the 16-byte form of the service maps (IPv4 v4-mapped).
    fn mapped(addr: Self::Addr) -> [u32; 4];
    /// Whether a backend address (16-byte form) belongs to the family.
    fn is_family(addr: &[u32; 4]) -> bool;
    /// A backend address of the family (see [`Family::is_family`]) in `Addr` form.
    fn backend_addr(addr: &[u32; 4]) -> Self::Addr;
    /// The Maglev backend of a flow (only called when [`Family::MAGLEV`]).
    fn maglev(
        svc_id: u32,
        saddr: Self::Addr,
        daddr: Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
    ) -> Option<u32>;
    /// The SNAT source of device `ifindex` (the family's node-address map).
    fn node_addr(ifindex: u32) -> Option<Self::Addr>;

    /// The family's connection table.
    fn ct() -> &'static LruHashMap<Self::Key, Self::Entry>;
    /// A CT key (addresses and ports in network order).
    fn key(
        saddr: Self::Addr,
        daddr: Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
        kind: CtKind,
    ) -> Self::Key;
    /// The CT key of kind `kind` of a packet's own tuple.
    #[inline(always)]
    fn key_of(p: &Self::Packet, kind: CtKind) -> Self::Key {
        let (saddr, daddr, sport, dport, proto) = Self::tuple(p);
        Self::key(saddr, daddr, sport, dport, proto, kind)
    }
    /// Writes the CT key [`Family::key`] makes into `out` (in place: no copy on the stack).
    #[allow(clippy::too_many_arguments)]
    fn write_key(
        out: &mut Self::Key,
        saddr: &Self::Addr,
        daddr: &Self::Addr,
        sport: u16,
        dport: u16,
        proto: u8,
        kind: CtKind,
    );
    /// A key's source address and port.
    fn key_src(k: &Self::Key) -> (&Self::Addr, u16);
    /// Sets a key's destination port (network order).
    fn set_dport(k: &mut Self::Key, port: u16);

    /// A new flow's CT entry.
    fn entry(
        nat_addr: Self::Addr,
        nat_port: u16,
        flags: u16,
        backend_id: u32,
        svc_id: u32,
        ts: u64,
    ) -> Self::Entry;
    /// `template` with its NAT address and port replaced.
    fn with_nat(template: &Self::Entry, addr: Self::Addr, port: u16) -> Self::Entry;
    /// Where an entry keeps `last_seen_ns` and `flags` (see [`crate::flow::touch`]).
    fn stamps(e: *mut Self::Entry) -> (*mut u64, *mut u16);
    /// An entry's `created_ns` (what every entry of one flow shares).
    fn created(e: *mut Self::Entry) -> u64;
    /// Where an entry keeps its NAT address and port.
    fn nat_slot(e: *mut Self::Entry) -> (*mut Self::Addr, *mut u16);
    /// An entry's NAT address and port (`e`: a lookup result).
    #[inline(always)]
    fn nat(e: *mut Self::Entry) -> (Self::Addr, u16) {
        let (addr, port) = Self::nat_slot(e);
        // SAFETY: field addresses of a lookup result, read by value.
        unsafe { (*addr, *port) }
    }
    /// Where an entry keeps its SNAT address and port (`snat_addr`, `snat_port`).
    fn snat_slot(e: *mut Self::Entry) -> (*mut Self::Addr, *mut u16);
    /// This CPU's [`PortSearch`] scratch of the family (a per-CPU array, not the stack: the
    /// IPv6 programs' stack has no room for it beside the sweep's callback frame).
    fn port_search() -> Option<*mut PortSearch<Self>>;

    /// A TC program hit the `Service` entry `svc` of the flow `p`: if the XDP fast path
    /// started it without its `RevDnat` entry ([`CT_F_NO_REV`]), creates that entry
    /// ([`adopt_xdp_flow`]), which the TC egress toward the backend needs. Nothing for a
    /// family without a fast path (IPv6).
    #[inline(always)]
    fn complete_xdp_flow(_svc: *mut Self::Entry, _p: &Self::Packet) {}
    /// [`Family::complete_xdp_flow`] for a TC program that hit the `SnatIn` entry `snat_in`
    /// at `k` (a reply, or an ICMP error about the flow): [`adopt_xdp_reply`], which the TC
    /// egress toward the client needs.
    #[inline(always)]
    fn complete_xdp_reply(_snat_in: *mut Self::Entry, _k: &Self::Key) {}
}

/// The [`Family`] methods whose code is the same for both families, written once: their CT
/// keys, CT entries and parsed packets have the same field names (`kproxy_common::ct` /
/// `ct6`, [`Packet`] / [`Packet6`]).
macro_rules! same_field_names {
    ($key:ident, $entry:ident) => {
        #[inline(always)]
        fn tuple(p: &Self::Packet) -> (Self::Addr, Self::Addr, u16, u16, u8) {
            (p.saddr, p.daddr, p.sport, p.dport, p.proto)
        }

        #[inline(always)]
        fn saddr(p: &Self::Packet) -> &Self::Addr {
            &p.saddr
        }

        #[inline(always)]
        fn daddr(p: &Self::Packet) -> &Self::Addr {
            &p.daddr
        }

        #[inline(always)]
        fn sport(p: &Self::Packet) -> u16 {
            p.sport
        }

        #[inline(always)]
        fn dport(p: &Self::Packet) -> u16 {
            p.dport
        }

        #[inline(always)]
        fn proto(p: &Self::Packet) -> u8 {
            p.proto
        }

        #[inline(always)]
        fn tcp_flags(p: &Self::Packet) -> u8 {
            p.tcp_flags
        }

        #[inline(always)]
        fn key(
            saddr: Self::Addr,
            daddr: Self::Addr,
            sport: u16,
            dport: u16,
            proto: u8,
            kind: CtKind,
        ) -> $key {
            $key {
                saddr,
                daddr,
                sport,
                dport,
                proto,
                kind: kind as u8,
                _pad: [0; 2],
            }
        }

        #[inline(always)]
        fn write_key(
            out: &mut $key,
            saddr: &Self::Addr,
            daddr: &Self::Addr,
            sport: u16,
            dport: u16,
            proto: u8,
            kind: CtKind,
        ) {
            out.saddr = *saddr;
            out.daddr = *daddr;
            out.sport = sport;
            out.dport = dport;
            out.proto = proto;
            out.kind = kind as u8;
            out._pad = [0; 2];
        }

        #[inline(always)]
        fn key_src(k: &$key) -> (&Self::Addr, u16) {
            (&k.saddr, k.sport)
        }

        #[inline(always)]
        fn set_dport(k: &mut $key, port: u16) {
            k.dport = port;
        }

        #[inline(always)]
        fn with_nat(template: &$entry, addr: Self::Addr, port: u16) -> $entry {
            $entry {
                nat_addr: addr,
                nat_port: port,
                ..*template
            }
        }

        #[inline(always)]
        fn stamps(e: *mut $entry) -> (*mut u64, *mut u16) {
            // SAFETY: field addresses of a valid entry pointer, no access.
            unsafe { (&raw mut (*e).last_seen_ns, &raw mut (*e).flags) }
        }

        #[inline(always)]
        fn created(e: *mut $entry) -> u64 {
            // SAFETY: a valid entry pointer (lookup result), read by value.
            unsafe { (*e).created_ns }
        }

        #[inline(always)]
        fn nat_slot(e: *mut $entry) -> (*mut Self::Addr, *mut u16) {
            // SAFETY: field addresses of a valid entry pointer, no access.
            unsafe { (&raw mut (*e).nat_addr, &raw mut (*e).nat_port) }
        }

        #[inline(always)]
        fn snat_slot(e: *mut $entry) -> (*mut Self::Addr, *mut u16) {
            // SAFETY: as above.
            unsafe { (&raw mut (*e).snat_addr, &raw mut (*e).snat_port) }
        }
    };
}

/// IPv4: `KP_CT`, `KP_NODE_ADDR4`, [`crate::packet`]; the only family of the XDP fast path.
pub(crate) struct V4;

impl Family for V4 {
    type Addr = u32;
    type Key = CtKey;
    type Entry = CtEntry;
    type Packet = Packet;
    const MAGLEV: bool = true;
    const ICMP: u8 = PROTO_ICMP;
    const PARSE_LEN: u32 = PARSE_LEN;
    same_field_names!(CtKey, CtEntry);

    #[inline(always)]
    fn parse(data: usize, end: usize) -> Parsed<Packet> {
        parse(data, end)
    }

    #[inline(always)]
    fn l4(p: &Packet) -> usize {
        p.l4
    }

    #[inline(always)]
    fn words(a: &u32) -> &[u32] {
        core::slice::from_ref(a)
    }

    #[inline(always)]
    fn mapped(addr: u32) -> [u32; 4] {
        v4_mapped(addr)
    }

    #[inline(always)]
    fn is_family(addr: &[u32; 4]) -> bool {
        is_v4_mapped(addr)
    }

    #[inline(always)]
    fn backend_addr(addr: &[u32; 4]) -> u32 {
        addr[3]
    }

    #[inline(always)]
    fn maglev(
        svc_id: u32,
        saddr: u32,
        daddr: u32,
        sport: u16,
        dport: u16,
        proto: u8,
    ) -> Option<u32> {
        maglev_backend(svc_id, saddr, daddr, sport, dport, proto)
    }

    #[inline(always)]
    fn node_addr(ifindex: u32) -> Option<u32> {
        // SAFETY: read by value right away.
        unsafe { KP_NODE_ADDR4.get(ifindex) }.map(|n| n.addr)
    }

    #[inline(always)]
    fn ct() -> &'static LruHashMap<CtKey, CtEntry> {
        &KP_CT
    }

    #[inline(always)]
    fn entry(
        nat_addr: u32,
        nat_port: u16,
        flags: u16,
        backend_id: u32,
        svc_id: u32,
        ts: u64,
    ) -> CtEntry {
        CtEntry {
            nat_addr,
            nat_port,
            flags,
            backend_id,
            svc_id,
            created_ns: ts,
            last_seen_ns: ts,
            snat_addr: 0,
            snat_port: 0,
            _pad: 0,
            fwd: FwdCache::default(),
        }
    }

    #[inline(always)]
    fn port_search() -> Option<*mut PortSearch<V4>> {
        KP_PORT_SEARCH4.get_ptr_mut(0)
    }

    #[inline(always)]
    fn complete_xdp_flow(svc: *mut CtEntry, p: &Packet) {
        // SAFETY: lookup result, read by value.
        if unsafe { (*svc).flags } & CT_F_NO_REV != 0 {
            adopt_xdp_flow(svc, p);
        }
    }

    #[inline(always)]
    fn complete_xdp_reply(snat_in: *mut CtEntry, k: &CtKey) {
        // SAFETY: lookup result, read by value.
        if unsafe { (*snat_in).flags } & CT_F_NO_REV != 0 {
            adopt_xdp_reply(snat_in, k);
        }
    }
}

/// IPv6: `KP_CT6`, `KP_NODE_ADDR6`, [`crate::packet6`]. Maglev does not apply (the planner
/// builds Maglev tables for IPv4 sets only, so IPv6 frontends never carry `SVC_F_MAGLEV`).
pub(crate) struct V6;

impl Family for V6 {
    type Addr = [u32; 4];
    type Key = CtKey6;
    type Entry = CtEntry6;
    type Packet = Packet6;
    const MAGLEV: bool = false;
    const ICMP: u8 = PROTO_ICMPV6;
    const PARSE_LEN: u32 = PARSE6_LEN;
    same_field_names!(CtKey6, CtEntry6);

    #[inline(always)]
    fn parse(data: usize, end: usize) -> Parsed<Packet6> {
        parse6(data, end)
    }

    #[inline(always)]
    fn l4(_: &Packet6) -> usize {
        Packet6::L4
    }

    #[inline(always)]
    fn words(a: &[u32; 4]) -> &[u32] {
        a
    }

    #[inline(always)]
    fn mapped(addr: [u32; 4]) -> [u32; 4] {
        // IPv6 addresses are stored as they are.
        addr
    }

    #[inline(always)]
    fn is_family(addr: &[u32; 4]) -> bool {
        !is_v4_mapped(addr)
    }

    #[inline(always)]
    fn backend_addr(addr: &[u32; 4]) -> [u32; 4] {
        *addr
    }

    #[inline(always)]
    fn maglev(_: u32, _: [u32; 4], _: [u32; 4], _: u16, _: u16, _: u8) -> Option<u32> {
        None
    }

    #[inline(always)]
    fn node_addr(ifindex: u32) -> Option<[u32; 4]> {
        // SAFETY: read by value right away.
        unsafe { KP_NODE_ADDR6.get(ifindex) }.map(|n| n.addr)
    }

    #[inline(always)]
    fn ct() -> &'static LruHashMap<CtKey6, CtEntry6> {
        &KP_CT6
    }

    #[inline(always)]
    fn entry(
        nat_addr: [u32; 4],
        nat_port: u16,
        flags: u16,
        backend_id: u32,
        svc_id: u32,
        ts: u64,
    ) -> CtEntry6 {
        CtEntry6 {
            nat_addr,
            nat_port,
            flags,
            backend_id,
            svc_id,
            _pad: 0,
            created_ns: ts,
            last_seen_ns: ts,
            snat_addr: [0; 4],
            snat_port: 0,
            _pad2: [0; 3],
        }
    }

    #[inline(always)]
    fn port_search() -> Option<*mut PortSearch<V6>> {
        KP_PORT_SEARCH6.get_ptr_mut(0)
    }
}
