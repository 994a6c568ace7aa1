//! Flow state the node-device service path shares between its TC programs ([`crate::tc`]) and
//! its XDP fast path ([`crate::xdp_fwd`]), so a flow may start in either and continue in the
//! other: the connection table and NAT maps, the backend choice of a new flow (random slot,
//! ClientIP affinity, Maglev), the CT entries a new flow gets, SNAT port allocation and the
//! per-packet refresh of an entry (timestamps, TCP close). Entry kinds: `kproxy_common::ct`.
//!
//! Moved out of `tc.rs` unchanged (IPv4); TC and XDP call the same functions.

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_prandom_u32, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns},
    macros::map,
    maps::{Array, HashMap, LruHashMap},
};
use kproxy_common::ct::{
    CT_F_CLOSING, CT_F_LOCAL_BACKEND, CT_F_SNAT, CtEntry, CtKey, CtKind, DEFAULT_CT_ENTRIES,
    NODE_ADDR_ENTRIES, NatConfig, NodeAddr4, SNAT_PORT_TRIES,
};
use kproxy_common::service::{
    AFFINITY_CLIENT_IP, AffinityKey, AffinityValue, BE_F_LOCAL, BackendSlotKey, BackendValue,
    SVC_F_AFFINITY, SVC_F_LOCAL_ONLY, SVC_F_MAGLEV, ServiceValue, is_v4_mapped, v4_mapped,
};

use crate::packet::Packet;
use crate::service_maps::{KP_AFFINITY, KP_BACKENDS, KP_BE_SLOTS, maglev_backend};

pub(crate) const TCP_FIN: u8 = 0x01;
pub(crate) const TCP_SYN: u8 = 0x02;
pub(crate) const TCP_RST: u8 = 0x04;
pub(crate) const TCP_ACK: u8 = 0x10;
pub(crate) const NS_PER_SEC: u64 = 1_000_000_000;

/// `kproxy_common::ct::MAP_CT`.
#[map]
pub(crate) static KP_CT: LruHashMap<CtKey, CtEntry> = LruHashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// `kproxy_common::ct::MAP_NAT_CONFIG`.
#[map]
pub(crate) static KP_NAT_CFG: Array<NatConfig> = Array::pinned(1, 0);

/// `kproxy_common::ct::MAP_NODE_ADDR4`.
#[map]
pub(crate) static KP_NODE_ADDR4: HashMap<u32, NodeAddr4> = HashMap::pinned(NODE_ADDR_ENTRIES, 0);

#[inline(always)]
pub(crate) fn key(p: &Packet, kind: CtKind) -> CtKey {
    CtKey {
        saddr: p.saddr,
        daddr: p.daddr,
        sport: p.sport,
        dport: p.dport,
        proto: p.proto,
        kind: kind as u8,
        _pad: [0; 2],
    }
}

/// CLOCK_MONOTONIC ns, precise: stamps new entries (their creation time also tells flows
/// apart, see `kproxy::dataplane::ebpf_tc::ct`).
#[inline(always)]
pub(crate) fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// CLOCK_MONOTONIC ns at tick resolution: refreshes `last_seen_ns` on the per-packet path
/// (expiry works in seconds; the coarse clock is cheaper and changes once per tick, so most
/// packets leave the entry's cache line clean).
#[inline(always)]
pub(crate) fn now_coarse() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_coarse_ns() }
}

/// Refreshes an entry's timestamp and records TCP close.
#[inline(always)]
pub(crate) fn touch(entry: *mut CtEntry, tcp_flags: u8) {
    // SAFETY: pointer from a successful lookup; a racing writer can only make the timestamp
    // or flags stale, which the agent's expiry tolerates.
    unsafe {
        let t = now_coarse();
        if (*entry).last_seen_ns != t {
            (*entry).last_seen_ns = t;
        }
        if tcp_flags & (TCP_FIN | TCP_RST) != 0 && (*entry).flags & CT_F_CLOSING == 0 {
            (*entry).flags |= CT_F_CLOSING;
        }
    }
}

/// Whether `port` (network order) lies in the SNAT port range, i.e. may be the destination of
/// a reply to a SNATed flow.
#[inline(always)]
pub(crate) fn in_snat_range(port: u16) -> bool {
    let Some(cfg) = KP_NAT_CFG.get(0) else {
        return false;
    };
    let port = u16::from_be(port);
    port >= cfg.snat_port_min && port <= cfg.snat_port_max
}

/// The backend a new flow of `svc` from `p`'s client goes to: the client's affinity entry
/// when the service has ClientIP affinity and it is fresh, else a random slot. Records the
/// choice for affinity. `None`: no backend (slot or backend entry missing, or not IPv4).
#[inline(always)]
pub(crate) fn choose_backend(
    svc: &ServiceValue,
    p: &Packet,
    ts: u64,
) -> Option<(u32, BackendValue)> {
    let aff_key = AffinityKey {
        client: v4_mapped(p.saddr),
        svc_id: svc.svc_id,
        kind: AFFINITY_CLIENT_IP,
    };
    let mut backend_id = 0u32;
    if svc.flags & SVC_F_AFFINITY != 0
        && let Some(a) = KP_AFFINITY.get_ptr_mut(aff_key)
    {
        // SAFETY: lookup result.
        unsafe {
            if ts.wrapping_sub((*a).last_used_ns) < u64::from(svc.affinity_timeout) * NS_PER_SEC {
                backend_id = (*a).backend_id;
            }
        }
    }
    // SAFETY: read by value right away.
    let mut backend = if backend_id != 0 {
        unsafe { KP_BACKENDS.get(backend_id) }.copied()
    } else {
        None
    };
    if backend.is_none() && svc.flags & SVC_F_MAGLEV != 0 {
        backend_id =
            maglev_backend(svc.svc_id, p.saddr, p.daddr, p.sport, p.dport, p.proto).unwrap_or(0);
        // SAFETY: read by value right away.
        backend = unsafe { KP_BACKENDS.get(backend_id) }.copied();
    }
    if backend.is_none() {
        // SAFETY: helper without arguments.
        let slot = unsafe { bpf_get_prandom_u32() } % svc.count;
        let slot_key = BackendSlotKey {
            svc_id: svc.svc_id,
            slot,
        };
        // SAFETY: read by value right away.
        backend_id = *unsafe { KP_BE_SLOTS.get(slot_key) }?;
        backend = unsafe { KP_BACKENDS.get(backend_id) }.copied();
    }
    let be = backend?;
    if !is_v4_mapped(&be.addr) {
        return None;
    }
    if svc.flags & SVC_F_AFFINITY != 0 {
        let v = AffinityValue {
            backend_id,
            _pad: 0,
            last_used_ns: ts,
        };
        let _ = KP_AFFINITY.insert(aff_key, v, 0);
    }
    Some((backend_id, be))
}

/// What [`create_flow`] recorded for a new flow.
pub(crate) struct NewFlow {
    /// The backend (network order).
    pub be_addr: u32,
    pub be_port: u16,
    /// `CT_F_*` of the flow's entries.
    pub flags: u16,
}

/// Records a new flow `p` (`C:cp → F:fp`) of `svc` to backend `backend_id`/`be`: its
/// [`CtKind::Service`] and [`CtKind::RevDnat`] entries and, when it is SNATed, its
/// [`CtKind::SnatOut`] entry with the SNAT address/port still unallocated (0; see
/// [`allocate_port`]). `Err`: an insert failed (map full and not LRU-evictable).
#[inline(always)]
pub(crate) fn create_flow(
    p: &Packet,
    svc: &ServiceValue,
    backend_id: u32,
    be: &BackendValue,
    ts: u64,
) -> Result<NewFlow, ()> {
    let be_addr = be.addr[3];
    let local = be.flags & BE_F_LOCAL != 0;
    // Upstream masquerades external traffic with eTP=Cluster. A local backend answers
    // through this node anyway, so its flows keep the client address (like Cilium; upstream
    // iptables would SNAT them too). A pod reaching itself through a NodePort (hairpin) is
    // always SNATed: it would drop a packet with its own address as source.
    let snat = (svc.flags & SVC_F_LOCAL_ONLY == 0 && !local) || p.saddr == be_addr;
    let mut flags = 0u16;
    if snat {
        flags |= CT_F_SNAT;
    }
    if local {
        flags |= CT_F_LOCAL_BACKEND;
    }
    let mut entry = CtEntry {
        nat_addr: be_addr,
        nat_port: be.port,
        flags,
        backend_id,
        svc_id: svc.svc_id,
        created_ns: ts,
        last_seen_ns: ts,
    };
    let fwd = key(p, CtKind::Service);
    let rev = CtKey {
        saddr: be_addr,
        daddr: p.saddr,
        sport: be.port,
        dport: p.sport,
        proto: p.proto,
        kind: CtKind::RevDnat as u8,
        _pad: [0; 2],
    };
    let mut ok = KP_CT.insert(fwd, entry, 0).is_ok();
    entry.nat_addr = p.daddr;
    entry.nat_port = p.dport;
    ok &= KP_CT.insert(rev, entry, 0).is_ok();
    if snat {
        let out = CtKey {
            saddr: p.saddr,
            daddr: be_addr,
            sport: p.sport,
            dport: be.port,
            proto: p.proto,
            kind: CtKind::SnatOut as u8,
            _pad: [0; 2],
        };
        // The SNAT address/port is allocated once the egress device is known.
        entry.nat_addr = 0;
        entry.nat_port = 0;
        ok &= KP_CT.insert(out, entry, 0).is_ok();
    }
    if !ok {
        return Err(());
    }
    Ok(NewFlow {
        be_addr,
        be_port: be.port,
        flags,
    })
}

/// Picks a free SNAT port for `p` (`C:cp → B:bp`) on node address `node` and claims it by
/// inserting the flow's [`CtKind::SnatIn`] entry with `BPF_NOEXIST` (atomic against other
/// CPUs). Returns it in network order.
#[inline(always)]
pub(crate) fn allocate_port(p: &Packet, node: u32, template: &CtEntry) -> Option<u16> {
    // SAFETY: lookup result, read by value.
    let cfg = KP_NAT_CFG.get(0).copied().unwrap_or_default();
    let (min, max) = (u32::from(cfg.snat_port_min), u32::from(cfg.snat_port_max));
    if min == 0 || max < min {
        return None;
    }
    let range = max - min + 1;
    if range == 0 {
        // Unreachable (u16 bounds); lets the compiler drop the division-by-zero panic path,
        // which the verifier would reject.
        return None;
    }
    let entry = CtEntry {
        nat_addr: p.saddr,
        nat_port: p.sport,
        ..*template
    };
    // SAFETY: helper without arguments.
    let start = unsafe { bpf_get_prandom_u32() } % range;
    let mut i = 0;
    while i < SNAT_PORT_TRIES {
        let port = ((min + (start + i) % range) as u16).to_be();
        let key = CtKey {
            saddr: p.daddr,
            daddr: node,
            sport: p.dport,
            dport: port,
            proto: p.proto,
            kind: CtKind::SnatIn as u8,
            _pad: [0; 2],
        };
        if KP_CT.insert(key, entry, BPF_NOEXIST as u64).is_ok() {
            return Some(port);
        }
        i += 1;
    }
    None
}
