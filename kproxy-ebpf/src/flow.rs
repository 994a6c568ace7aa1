//! Flow state the node-device service path shares between its TC programs ([`crate::tc`]) and
//! its XDP fast path ([`crate::xdp_fwd`]), so a flow may start in either and continue in the
//! other: the connection table and NAT maps, the backend choice of a new flow (random slot,
//! ClientIP affinity, Maglev), the CT entries a new flow gets, SNAT port allocation and the
//! per-packet refresh of an entry (timestamps, TCP close). Entry kinds: `kproxy_common::ct`.
//!
//! Written once, generic over the address family ([`crate::family::Family`]): the TC programs
//! of both families and the XDP fast path (IPv4 only, with [`V4`]) call the same functions.
//!
//! Per-packet cost: a new flow's connection-table inserts are its most expensive part (each
//! touches a cold bucket, chain and element: the bench's `floor-ct-insert` figure, two
//! inserts, is ≈ 0.9 µs under `BPF_PROG_TEST_RUN` here, against ≈ 100 ns for the counter
//! program measured the same way), so a new flow through TC makes two at ingress (`Service`,
//! `RevDnat`) and keeps its SNAT source in the `RevDnat` entry ([`snat_slot`]) instead of a
//! third besides its `SnatIn` port claim; a new flow the XDP fast path forwards makes no
//! `RevDnat` entry at all until a TC program needs one ([`CT_F_NO_REV`], [`adopt_xdp_flow`]):
//! two inserts in all. The map type is not the lever: measured with the same bench (the table swapped for
//! one made with other flags), a per-CPU LRU (`BPF_F_NO_COMMON_LRU`) was no faster with one
//! service and slower with 100k, and a plain preallocated hash map (no LRU eviction) showed
//! no clear gain. In the kproxy-vs-Katran harness (2026-11-27) the per-CPU LRU made the XDP
//! new flow 787–793 ns against 407–424 ns with this one (harness pinned to one CPU).
//! What an insert costs depends mostly on whether the element it takes is in the CPU caches:
//! the same harness, which frees each block's flows right before the next block reuses their
//! elements, measured an XDP new flow at 354–376 ns, and at 586–594 ns with 512 MiB written
//! first (`bench/anchors/2026-11-27-00be049.md`).

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    cty::c_void,
    helpers::{
        bpf_get_prandom_u32, bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_ktime_get_ns, bpf_loop,
    },
};
use kproxy_common::ct::{
    CT_F_CLOSE_MASK, CT_F_LOCAL_BACKEND, CT_F_NO_REV, CT_F_SNAT, CT_F_SNAT_HERE, CtEntry, CtKey,
    CtKind, FwdCache, SNAT_PORT_TRIES, close_state,
};
use kproxy_common::maglev::{IDS_PER_ELEM, flow_hash};
use kproxy_common::service::{
    AFFINITY_CLIENT_IP, AffinityKey, AffinityValue, BE_F_LOCAL, BackendSlotKey, BackendValue,
    SVC_F_AFFINITY, SVC_F_LOCAL_ONLY, SVC_F_MAGLEV, ServiceValue,
};

use crate::family::{Family, V4};
use crate::maps::{
    KP_AFFINITY, KP_BACKENDS, KP_BE_SLOTS, KP_CLOCK, KP_CT, KP_MAGLEV, KP_MAGLEV_REF, KP_NAT_CFG,
};
use crate::packet::Packet;

pub(crate) use kproxy_common::ct::{TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
pub(crate) const NS_PER_SEC: u64 = 1_000_000_000;

/// CLOCK_MONOTONIC ns, precise: stamps new entries (their creation time also tells flows
/// apart, see `kproxy::dataplane::ebpf_tc::ct`).
#[inline(always)]
pub(crate) fn now() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// CLOCK_MONOTONIC ns at tick resolution: refreshes `last_seen_ns` on the per-packet path
/// (expiry works in seconds; the coarse clock changes once per tick, so most packets leave
/// the entry's cache line clean).
///
/// Read through a per-CPU cache keyed by `jiffies` (`bpf_jiffies64`, which the verifier
/// inlines to a load): the coarse clock changes only when jiffies do, so the helper runs once
/// per tick per CPU instead of per packet. A helper call cost ≈ 40 ns in the bench (issue
/// #3: this CPU's return-thunk mitigation makes every kernel call dear). The cached value may
/// lag the coarse clock by at most one tick (jiffies can advance just before the clock does).
#[inline(always)]
pub(crate) fn now_coarse() -> u64 {
    // SAFETY: helpers without arguments.
    let jiffies = unsafe { bpf_jiffies64() };
    match KP_CLOCK.get_ptr_mut(0) {
        // SAFETY: this CPU's value; programs are not preempted on a CPU.
        Some(c) => unsafe {
            if (*c).jiffies != jiffies {
                (*c).ns = bpf_ktime_get_coarse_ns();
                (*c).jiffies = jiffies;
            }
            (*c).ns
        },
        None => unsafe { bpf_ktime_get_coarse_ns() },
    }
}

/// One CPU's [`now_coarse`] cache.
#[repr(C)]
pub(crate) struct CoarseClock {
    jiffies: u64,
    ns: u64,
}

/// Refreshes an entry's timestamp and records the TCP close state the agent's expiry reads
/// (`kproxy_common::ct::CT_F_FIN_ORIG` …): `fin` is the bit a FIN sets for the direction the
/// packet travels (`CT_F_FIN_ORIG` client → backend, `CT_F_FIN_REPLY` backend → client).
///
/// Per-packet cost: one flags test on the packet (no SYN/FIN/RST: nothing more, so the
/// established path adds no load or store); a SYN, FIN or RST updates the entry's flags.
#[inline(always)]
pub(crate) fn touch<F: Family>(entry: *mut F::Entry, tcp_flags: u8, fin: u16) {
    let (last_seen_ns, flags) = F::stamps(entry);
    // SAFETY: pointer from a successful lookup; a racing writer can only make the timestamp
    // or flags stale, which the agent's expiry tolerates.
    unsafe {
        let t = now_coarse();
        if *last_seen_ns != t {
            *last_seen_ns = t;
        }
        if tcp_flags & (TCP_FIN | TCP_RST | TCP_SYN) != 0 {
            let f = close_state(*flags, tcp_flags, fin);
            if f != *flags {
                *flags = f;
            }
        }
    }
}

/// Whether a packet with TCP flags `tcp_flags` that found a flow's `Service` entry `svc` (a
/// packet `C:cp → F:fp`) opens a new connection on the tuple instead: a SYN without ACK after
/// the client sent a FIN or a RST on it (the client reused its port; a retransmitted SYN of
/// the connection itself comes before any FIN). The caller then ends the old flow
/// ([`end_flow`]) and load-balances the packet as a new flow, as netfilter does: conntrack
/// takes a SYN on a closed (TIME_WAIT / CLOSE) connection for a new one and the rules choose
/// its endpoint afresh (issue #22: before, the new connection went to the closed flow's
/// backend, even after that backend had left the service). Only the `Service` entry is read:
/// a reset sent by the backend alone is not seen here (the flow is then reopened to its old
/// backend, as before).
///
/// Per-packet cost: one test of the packet's flags; the entry is read only for a SYN.
#[inline(always)]
pub(crate) fn reopens<F: Family>(svc: *mut F::Entry, tcp_flags: u8) -> bool {
    if tcp_flags & (TCP_SYN | TCP_ACK | TCP_RST) != TCP_SYN {
        return false;
    }
    // SAFETY: lookup result, read by value.
    unsafe { *F::stamps(svc).1 & CT_F_CLOSE_MASK != 0 }
}

/// Deletes every entry of the flow whose `Service` entry `svc` a packet from `saddr:sport`
/// found (see [`reopens`]): its `RevDnat` entry (at the backend the `Service` entry names),
/// through it the `SnatIn` entry, and the `Service` entry itself; for a flow the XDP fast
/// path started ([`CT_F_NO_REV`] still set in its `Service` entry) its `SnatIn` entry, at the
/// SNAT source the `Service` entry holds, and its `RevDnat` entry if a reply through TC
/// created one (the `Service` entry is overwritten by the new flow). A BPF-to-BPF call with
/// its own small stack frame (the IPv6 programs' stack is tight), on the rare path only.
#[inline(never)]
pub(crate) fn end_flow<F: Family>(svc: *mut F::Entry, saddr: &F::Addr, sport: u16, proto: u8) {
    // SAFETY: lookup result, fields read by value.
    if unsafe { *F::stamps(svc).1 } & CT_F_NO_REV != 0 {
        // SAFETY: as above.
        let (k, rk, created) = unsafe {
            let (be, be_port) = F::nat_slot(svc);
            let (node, node_port) = F::snat_slot(svc);
            (
                F::key(*be, *node, *be_port, *node_port, proto, CtKind::SnatIn),
                F::key(*be, *saddr, *be_port, sport, proto, CtKind::RevDnat),
                F::created(svc),
            )
        };
        delete_if_of::<F>(&k, created);
        // A reply through TC may have created it ([`adopt_xdp_reply`]).
        delete_if_of::<F>(&rk, created);
        return;
    }
    // SAFETY: lookup result, fields read by value.
    let (k, created) = unsafe {
        let (be, be_port) = F::nat_slot(svc);
        (
            F::key(*be, *saddr, *be_port, sport, proto, CtKind::RevDnat),
            F::created(svc),
        )
    };
    match F::ct().get_ptr_mut(&k) {
        Some(rev) if F::created(rev) == created => {}
        _ => return,
    }
    release_reply_tuple::<F>(&k, saddr, sport, proto);
    let _ = F::ct().remove(&k);
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
/// when the service has ClientIP affinity and it is fresh, else (IPv4) the Maglev choice, else a
/// random slot. Records the choice for affinity. `None`: no backend (slot or backend entry
/// missing, or not of the family). The caller ensures `svc.count != 0`. `rnd`: a random
/// number the caller already drew for this flow (see [`prandom`]); `None`: drawn here when
/// needed.
#[inline(always)]
pub(crate) fn choose_backend<F: Family>(
    svc: &ServiceValue,
    p: &F::Packet,
    ts: u64,
    rnd: Option<u32>,
) -> Option<(u32, BackendValue)> {
    let (saddr, daddr, sport, dport, proto) = F::tuple(p);
    let aff_key = AffinityKey {
        client: F::mapped(saddr),
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
    if F::MAGLEV && backend.is_none() && svc.flags & SVC_F_MAGLEV != 0 {
        backend_id = F::maglev(svc.svc_id, saddr, daddr, sport, dport, proto).unwrap_or(0);
        // SAFETY: read by value right away.
        backend = unsafe { KP_BACKENDS.get(backend_id) }.copied();
    }
    if backend.is_none() {
        let slot = rnd.unwrap_or_else(prandom) % svc.count;
        let slot_key = BackendSlotKey {
            svc_id: svc.svc_id,
            slot,
        };
        // SAFETY: read by value right away. The slot holds the backend itself (one lookup).
        let s = unsafe { KP_BE_SLOTS.get(slot_key) }.copied()?;
        backend_id = s.backend_id;
        backend = Some(s.backend);
    }
    let be = backend?;
    if !F::is_family(&be.addr) {
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

/// The backend id the Maglev table of set `svc_id` gives an IPv4 5-tuple (network order), or
/// `None` when the set has no table yet (the caller falls back to a random slot). See
/// `kproxy_common::maglev`.
#[inline(always)]
pub(crate) fn maglev_backend(
    svc_id: u32,
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
) -> Option<u32> {
    // SAFETY: read by value right away.
    let r = unsafe { KP_MAGLEV_REF.get(svc_id) }.copied()?;
    if r.size == 0 {
        // Never written by the agent; also lets the compiler drop the division-by-zero panic
        // path, which the verifier would reject.
        return None;
    }
    let h = flow_hash(saddr, daddr, sport, dport, proto);
    let e = r.base.wrapping_add(h % r.size);
    let pair = KP_MAGLEV.get(e / IDS_PER_ELEM)?;
    let id = pair[(e % IDS_PER_ELEM) as usize];
    (id != 0).then_some(id)
}

/// `bpf_get_prandom_u32`.
#[inline(always)]
pub(crate) fn prandom() -> u32 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_prandom_u32() }
}

/// A second random number from one already used (MurmurHash3's 32-bit finalizer, a
/// bijection that spreads every input bit): one `bpf_get_prandom_u32` call serves both a new
/// flow's backend slot and its SNAT port, without tying the port to the slot (the slot is
/// the first number modulo the backend count, which may divide the port range).
#[inline(always)]
pub(crate) fn remix(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Records a new flow `p` (`C:cp → F:fp`) of `svc` to backend `backend_id`/`be`: its
/// [`CtKind::Service`] and [`CtKind::RevDnat`] entries; when it is SNATed, the latter holds its
/// SNAT source, still unset (zero; see [`snat_slot`], [`allocate_port`]).
/// Returns the backend address and the entries' `CT_F_*` flags. `Err`: an insert failed (map
/// full and not LRU-evictable). `be` is of the family ([`choose_backend`] checked).
#[inline(always)]
pub(crate) fn create_flow<F: Family>(
    p: &F::Packet,
    svc: &ServiceValue,
    backend_id: u32,
    be: &BackendValue,
    ts: u64,
) -> Result<(F::Addr, u16), ()> {
    let (be_addr, flags, entry) = flow_entry::<F>(p, svc, backend_id, be, ts);
    insert_flow::<F>(p, be_addr, be.port, entry)?;
    Ok((be_addr, flags))
}

/// A new flow's backend address, `CT_F_*` flags and `Service` entry (the template of its
/// other entries), as [`create_flow`] records them.
#[inline(always)]
pub(crate) fn flow_entry<F: Family>(
    p: &F::Packet,
    svc: &ServiceValue,
    backend_id: u32,
    be: &BackendValue,
    ts: u64,
) -> (F::Addr, u16, F::Entry) {
    let (saddr, _, _, _, _) = F::tuple(p);
    let be_addr = F::backend_addr(&be.addr);
    let local = be.flags & BE_F_LOCAL != 0;
    // Upstream masquerades external traffic with eTP=Cluster. A local backend answers
    // through this node anyway, so its flows keep the client address (like Cilium; upstream
    // iptables would SNAT them too). A pod reaching itself through a NodePort (hairpin) is
    // always SNATed: it would drop a packet with its own address as source.
    let snat = (svc.flags & SVC_F_LOCAL_ONLY == 0 && !local) || saddr == be_addr;
    let mut flags = 0u16;
    if snat {
        flags |= CT_F_SNAT | CT_F_SNAT_HERE;
    }
    if local {
        flags |= CT_F_LOCAL_BACKEND;
    }
    (
        be_addr,
        flags,
        F::entry(be_addr, be.port, flags, backend_id, svc.svc_id, ts),
    )
}

/// Inserts a new flow's `Service` entry `entry` (for `p`, to backend `be_addr:be_port`) and
/// its `RevDnat` entry (the same with the frontend as NAT address). `Err`: an insert failed.
#[inline(always)]
pub(crate) fn insert_flow<F: Family>(
    p: &F::Packet,
    be_addr: F::Addr,
    be_port: u16,
    mut entry: F::Entry,
) -> Result<(), ()> {
    let (saddr, daddr, sport, dport, proto) = F::tuple(p);
    // One key and one entry, rewritten for each insert (the IPv6 programs' stack is tight).
    let mut k = F::key(saddr, daddr, sport, dport, proto, CtKind::Service);
    let mut ok = F::ct().insert(&k, &entry, 0).is_ok();
    // Reply: B:bp → C:cp; forwarded packets C:cp → B:bp find it reversed and take their SNAT
    // source from it, allocated once the egress device is known.
    k = F::key(be_addr, saddr, be_port, sport, proto, CtKind::RevDnat);
    entry = F::with_nat(&entry, daddr, dport);
    // `BPF_NOEXIST` costs nothing more than the plain insert while the tuple is free (every
    // flow but a client port reused toward another frontend of the same backend).
    if F::ct().insert(&k, &entry, BPF_NOEXIST as u64).is_err() {
        release_reply_tuple::<F>(&k, &saddr, sport, proto);
        ok &= F::ct().insert(&k, &entry, 0).is_ok();
    }
    if ok { Ok(()) } else { Err(()) }
}

/// A new flow's reply tuple `B:bp → C:cp` (`k`, its `RevDnat` key) is another flow's: the
/// client `C:cp` reached the same backend through another frontend (another NodePort, node
/// address or VIP of a service with that backend; the key holds no frontend) or through the
/// same one after its `Service` entry went. The new flow takes the tuple over (the caller
/// overwrites the entry); here the old flow's other entries are deleted — its `Service`
/// entry `C:cp → F':fp'` (`F'` from the old entry's NAT address) and, when it was SNATed,
/// its `SnatIn` entry `B:bp → N:np` —, each only if it still belongs to that flow (same
/// creation time). Left behind, they outlived the flow (issue #22): without its `RevDnat`
/// entry the old flow's close state lacked the backend's FIN (read as half-closed, held for
/// the close-wait timeout), and a later connection from `C:cp` to `F'` found the `Service`
/// entry and sent its backend's replies out untranslated (connects timed out). `k` is left
/// as scratch.
///
/// Upstream (netfilter) keeps both flows: `nf_nat` gives the second one another source port
/// when its reply tuple is taken. kproxy does not remap client ports: when the old flow is
/// still open, it loses its translation (the backend sees both connections on one tuple
/// anyway). Documented in the user guide (`docs/src/differences.md`).
///
/// A BPF-to-BPF call whose state lives in this CPU's [`PortSearch`] scratch (free here: a
/// port search is over before a flow is inserted), so it adds only a small frame to its
/// caller's stack.
#[inline(never)]
fn release_reply_tuple<F: Family>(k: &F::Key, saddr: &F::Addr, sport: u16, proto: u8) {
    let Some(sp) = F::port_search() else {
        return;
    };
    let Some(old) = F::ct().get_ptr_mut(k) else {
        return;
    };
    // SAFETY: this CPU's scratch value (programs are not preempted on a CPU) and a lookup
    // result, copied; then fields of the copy.
    unsafe {
        let s = &mut *sp;
        s.entry = *old;
        let e = &raw mut s.entry;
        let created = F::created(e);
        let (snat, snat_port) = F::snat_slot(e);
        // The SNAT source is in the `RevDnat` entry (this build's flows) once allocated.
        if *F::stamps(e).1 & CT_F_SNAT_HERE != 0 && *snat_port != 0 {
            let (be, be_port) = F::key_src(k);
            F::write_key(
                &mut s.key,
                be,
                &*snat,
                be_port,
                *snat_port,
                proto,
                CtKind::SnatIn,
            );
            delete_if_of::<F>(&s.key, created);
        }
        let (front, front_port) = F::nat_slot(e);
        F::write_key(
            &mut s.key,
            saddr,
            &*front,
            sport,
            *front_port,
            proto,
            CtKind::Service,
        );
        delete_if_of::<F>(&s.key, created);
    }
}

/// A TC program hit the `Service` entry `svc` of the flow `p` (`C:cp → F:fp`), created by the
/// XDP fast path without its `RevDnat` entry ([`CT_F_NO_REV`]): the fast path passed one of
/// its packets on (or is gone), and the TC egress program will look for that entry. Creates
/// it — `B:bp → C:cp`, the frontend as NAT address, the SNAT source the `Service` entry holds —
/// and clears the bit in `svc`. On the rare path only (once per entry).
#[inline(never)]
pub(crate) fn adopt_xdp_flow(svc: *mut CtEntry, p: &Packet) {
    // SAFETY: lookup result, fields read by value.
    let (be, snat) = unsafe {
        (
            ((*svc).nat_addr, (*svc).nat_port),
            ((*svc).snat_addr, (*svc).snat_port),
        )
    };
    let k = V4::key(be.0, p.saddr, be.1, p.sport, p.proto, CtKind::RevDnat);
    install_rev_dnat(svc, &k, (p.daddr, p.dport), snat);
}

/// [`adopt_xdp_flow`] from the other end: a TC program hit the `SnatIn` entry `snat_in` (at
/// key `k`, `B:bp → N:np`: a reply, or an ICMP error about the flow) of a flow without a
/// `RevDnat` entry (its `snat_in` holds the client as NAT address and the frontend beside
/// it). Creates the `RevDnat` entry `B:bp → C:cp` with the frontend as NAT address and `N:np`
/// as SNAT source, and clears the bit.
#[inline(never)]
pub(crate) fn adopt_xdp_reply(snat_in: *mut CtEntry, k: &CtKey) {
    // SAFETY: lookup result, fields read by value.
    let (client, frontend) = unsafe {
        (
            ((*snat_in).nat_addr, (*snat_in).nat_port),
            ((*snat_in).snat_addr, (*snat_in).snat_port),
        )
    };
    let rk = V4::key(
        k.saddr,
        client.0,
        k.sport,
        client.1,
        k.proto,
        CtKind::RevDnat,
    );
    install_rev_dnat(snat_in, &rk, frontend, (k.daddr, k.dport));
}

/// Clears [`CT_F_NO_REV`] in `hit` (an entry of a flow the XDP fast path started) and inserts
/// the flow's `RevDnat` entry at `k` (`B:bp → C:cp`): `hit`'s copy with `frontend` as NAT
/// address and `snat` as SNAT source — unless the flow's own entry is there already (another
/// of its entries adopted it first). Another flow's entry on the tuple (the client port
/// toward the same backend through another frontend) is taken over as a new flow takes it
/// ([`release_reply_tuple`]).
#[inline(always)]
fn install_rev_dnat(hit: *mut CtEntry, k: &CtKey, frontend: (u32, u16), snat: (u32, u16)) {
    // SAFETY: lookup result: the flag cleared in place, then copied.
    let rev = unsafe {
        (*hit).flags &= !CT_F_NO_REV;
        CtEntry {
            nat_addr: frontend.0,
            nat_port: frontend.1,
            snat_addr: snat.0,
            snat_port: snat.1,
            fwd: FwdCache::default(),
            ..*hit
        }
    };
    if KP_CT.insert(k, &rev, BPF_NOEXIST as u64).is_ok() {
        return;
    }
    if let Some(old) = KP_CT.get_ptr(k)
        // SAFETY: lookup result, read by value.
        && unsafe { (*old).created_ns } == rev.created_ns
    {
        return;
    }
    release_reply_tuple::<V4>(k, &k.daddr, k.dport, k.proto);
    let _ = KP_CT.insert(k, &rev, 0);
}

/// Deletes the entry at `k` if it was created at `created` (belongs to that flow).
#[inline(always)]
fn delete_if_of<F: Family>(k: &F::Key, created: u64) {
    if let Some(e) = F::ct().get_ptr(k)
        && F::created(e.cast_mut()) == created
    {
        let _ = F::ct().remove(k);
    }
}

/// Where the SNAT source of a packet `C:cp → B:bp` leaving through a node device (network
/// order) is kept, if it belongs to a SNATed flow: the entry to refresh and its address and
/// port fields (zero until the flow's first packet allocates them with [`allocate_port`]).
/// That is the flow's `RevDnat` entry (`B:bp → C:cp`, the packet's tuple reversed) for flows of
/// this build ([`CT_F_SNAT_HERE`]), else the legacy `SnatOut` entry an earlier build created
/// (`kproxy_common::ct` module docs). One lookup for a flow of this build, whether SNATed or
/// not.
#[inline(always)]
pub(crate) fn snat_slot<F: Family>(
    saddr: F::Addr,
    daddr: F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
) -> Option<(*mut F::Entry, *mut F::Addr, *mut u16)> {
    let mut k = F::key(daddr, saddr, dport, sport, proto, CtKind::RevDnat);
    snat_slot_with::<F>(&mut k, saddr, daddr, sport, dport, proto)
}

/// [`snat_slot`] with the caller's key buffer (one key on the stack for all lookups: the
/// IPv6 programs' stack is tight).
#[inline(always)]
fn snat_slot_with<F: Family>(
    k: &mut F::Key,
    saddr: F::Addr,
    daddr: F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
) -> Option<(*mut F::Entry, *mut F::Addr, *mut u16)> {
    *k = F::key(daddr, saddr, dport, sport, proto, CtKind::RevDnat);
    let e = F::ct().get_ptr_mut(&*k)?;
    // SAFETY: lookup result.
    let flags = unsafe { *F::stamps(e).1 };
    if flags & CT_F_SNAT == 0 {
        return None;
    }
    if flags & CT_F_SNAT_HERE != 0 {
        let (addr, port) = F::snat_slot(e);
        return Some((e, addr, port));
    }
    *k = F::key(saddr, daddr, sport, dport, proto, CtKind::SnatOut);
    let o = F::ct().get_ptr_mut(&*k)?;
    let (addr, port) = F::nat_slot(o);
    Some((o, addr, port))
}

/// What a packet leaving through a node device is to the TC egress programs.
pub(crate) enum Egress<F: Family> {
    /// A backend's reply `B:bp → C:cp`: its flow's `RevDnat` entry (src := its NAT address).
    Reply(*mut F::Entry),
    /// A packet `C:cp → B:bp` of a SNATed flow: [`snat_slot`]'s entry and SNAT fields.
    Snat(*mut F::Entry, *mut F::Addr, *mut u16),
}

/// The entries a packet `saddr:sport → daddr:dport` leaving through a node device is
/// translated by (see [`Egress`]); `None`: not ours.
#[inline(always)]
pub(crate) fn egress_entry<F: Family>(
    saddr: F::Addr,
    daddr: F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
) -> Option<Egress<F>> {
    let mut k = F::key(saddr, daddr, sport, dport, proto, CtKind::RevDnat);
    if let Some(e) = F::ct().get_ptr_mut(&k) {
        return Some(Egress::Reply(e));
    }
    let (e, addr, port) = snat_slot_with::<F>(&mut k, saddr, daddr, sport, dport, proto)?;
    Some(Egress::Snat(e, addr, port))
}

/// Picks a free SNAT port for the flow `saddr:sport → daddr:dport` (`C:cp → B:bp`, network
/// order) on node address `node` and claims it by inserting the flow's [`CtKind::SnatIn`]
/// entry with `BPF_NOEXIST` (atomic against other CPUs). Returns it in network order; `None`
/// only when every port of the range is taken for this backend (issue #22: a new flow is
/// never dropped while a port is free).
///
/// 1. One insert at a random port: the whole cost while the range is mostly free (as before).
/// 2. Up to [`SNAT_PORT_TRIES`] more random ports (random start and stride, so taken ports
///    do not cluster the way consecutive probing makes them), each a lookup, inserting at
///    the first free one. A failed `BPF_NOEXIST` insert into the LRU table still takes a free
///    node first, which may evict a live entry when the table is full: lookups avoid that.
/// 3. Still none: a sweep of the whole range from a random port (`bpf_loop`, one lookup per
///    port, stopping at the first free one), so the last free port is found too. Bounded by
///    the range size; at load `a` it is reached with probability ≈ a^17 and costs ≈ 1/(1−a)
///    lookups when a port is free.
#[inline(always)]
pub(crate) fn allocate_port<F: Family>(
    saddr: F::Addr,
    daddr: F::Addr,
    sport: u16,
    dport: u16,
    proto: u8,
    node: F::Addr,
    template: &F::Entry,
    rnd: Option<u32>,
) -> Option<u16> {
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
    let rnd = rnd.unwrap_or_else(prandom);
    let sp = F::port_search()?;
    // SAFETY: this CPU's scratch value; programs are not preempted on a CPU, and a bpf_loop
    // callback runs on the same CPU before `bpf_loop` returns.
    let s = unsafe { &mut *sp };
    s.key = F::key(daddr, node, dport, 0, proto, CtKind::SnatIn);
    s.entry = F::with_nat(template, saddr, sport);
    s.min = min;
    s.range = range;
    s.start = rnd % range;
    s.port = 0;
    let port = ((min + s.start) as u16).to_be();
    F::set_dport(&mut s.key, port);
    if F::ct().insert(&s.key, &s.entry, BPF_NOEXIST as u64).is_ok() {
        return Some(port);
    }
    if range == 1 {
        return None;
    }
    // A stride in [1, range − 1].
    let stride = 1 + (rnd >> 16) % (range - 1);
    let mut i = 1;
    while i <= SNAT_PORT_TRIES {
        let idx = (s.start + i * stride) % range;
        if try_port::<F>(s, idx) {
            return Some(s.port);
        }
        i += 1;
    }
    // SAFETY: the callback is a static BPF function; it finds its state through
    // `F::port_search` (no context pointer).
    unsafe {
        bpf_loop(
            range,
            sweep_step::<F> as *mut c_void,
            core::ptr::null_mut(),
            0,
        );
    }
    if s.port != 0 { Some(s.port) } else { None }
}

/// [`allocate_port`]'s search state.
#[repr(C)]
pub(crate) struct PortSearch<F: Family> {
    key: F::Key,
    entry: F::Entry,
    min: u32,
    range: u32,
    start: u32,
    /// The claimed port (network order); 0: none yet.
    port: u16,
}

/// Tries port `min + idx` (`idx < range`): a lookup, then a `BPF_NOEXIST` insert if free.
#[inline(always)]
fn try_port<F: Family>(s: &mut PortSearch<F>, idx: u32) -> bool {
    let port = ((s.min + idx) as u16).to_be();
    F::set_dport(&mut s.key, port);
    if F::ct().get_ptr(&s.key).is_some() {
        return false;
    }
    if F::ct().insert(&s.key, &s.entry, BPF_NOEXIST as u64).is_ok() {
        s.port = port;
        return true;
    }
    false
}

/// One step of [`allocate_port`]'s sweep (`bpf_loop` callback): port `start + i` (mod
/// range); returns 1 (stop) once a port is claimed.
#[inline(never)]
extern "C" fn sweep_step<F: Family>(i: u64, _ctx: *mut c_void) -> i64 {
    let Some(sp) = F::port_search() else {
        return 1;
    };
    // SAFETY: this CPU's scratch value, filled by `allocate_port` (see there).
    let s = unsafe { &mut *sp };
    let range = s.range;
    if range == 0 || i >= u64::from(range) {
        return 1;
    }
    let mut idx = s.start % range + i as u32;
    if idx >= range {
        idx -= range;
    }
    i64::from(try_port::<F>(s, idx))
}
