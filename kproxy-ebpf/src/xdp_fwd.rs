//! The XDP NodePort / ExternalIP / LB forwarding fast path (IPv4), called by [`crate::xdp`]:
//! flows to a backend on another node are translated and sent on from the driver, before the
//! kernel allocates an skb, with the same connection-table entries the TC programs use
//! ([`crate::flow`]), so a flow may start in either path and continue in the other.
//!
//! - **Client → backend** (`C:cp → F:fp`, the flow's `Service` entry exists or is created
//!   here with TC's own backend choice): dst := `B:bp`, src := `N:np` kept in the flow's
//!   `RevDnat` entry ([`snat_slot`], as TC egress finds it) — or, for a flow started here, in
//!   its `Service` entry. When it has no SNAT address yet (TC started the flow but none of its
//!   packets left through the stack, or the flow is new here), `N` is the node address of the
//!   FIB's egress device (`KP_NODE_ADDR4`, like TC egress) and `np` is claimed with TC's
//!   [`allocate_port`].
//! - **Backend → client** (`B:bp → N:np`, its `SnatIn` entry exists): dst := `C:cp`, src :=
//!   `F:fp` from the flow's `RevDnat` entry — or, for a flow started here, from beside the
//!   client in the `SnatIn` entry.
//!
//! **Two entries per new flow.** A SNATed flow to a remote backend that starts here gets its
//! `Service` and `SnatIn` entries only, marked `CT_F_NO_REV` (`kproxy_common::ct`): the
//! `RevDnat` entry serves TC egress alone, and each connection-table insert is the largest
//! part of a new flow's cost (kproxy-vs-Katran harness, 2026-11-27: 484–598 → 370–389 ns per
//! new flow in one A/B session). A TC program that meets such a flow (a packet the fast path
//! passed on, an ICMP error about it, XDP detached) creates the `RevDnat` entry then
//! (`crate::flow::adopt_xdp_flow`, `adopt_xdp_reply`). Flows to local backends and flows whose
//! fast path stops after the backend choice are recorded as TC records them.
//!
//! Then TTL − 1, the IPv4 and L4 checksums are updated by hand (RFC 1624; XDP has no skb
//! checksum helpers, and a frame here carries a complete checksum), `bpf_fib_lookup` gives
//! the egress device and MACs, and the frame goes out with `XDP_TX` (same device) or
//! `bpf_redirect(ifindex)` → `XDP_REDIRECT`. Entries are refreshed (`last_seen_ns`, the TCP
//! close state: FIN per direction, RST, SYN reopening) exactly like TC does, so the agent's
//! expiry and purge keep working.
//!
//! **Forwarding cache.** The FIB's answer (egress device, MTU, MACs) and the rewritten source
//! are kept in the entry looked up first for the direction (`Service`, `SnatIn`:
//! `kproxy_common::ct::FwdCache`), so an established flow's next packet costs one
//! connection-table lookup and no `bpf_fib_lookup` ([`cached`]). The cache is used while the
//! generation in `KP_FWD_GEN` is the one it was filled under (the agent changes it on every
//! rtnetlink announcement of a link, address, route, rule or neighbour change, and draws a
//! random one per loaded object; 0 = off), for a frame with the same ingress device and TOS
//! that fits the cached MTU, out of a device still enabled for the fast path. SYN, FIN and RST
//! take the full path, which refreshes every entry of the flow; a cached packet refreshes only
//! the entry it hit (the agent's expiry takes a flow's most recent entry, so flows live as
//! before; under LRU pressure the unrefreshed `RevDnat` entry ages first). A new flow fills
//! no flow cache: its FIB lookup uses the client's source (the SNAT source is chosen from its
//! answer), its second packet's lookup the SNAT source, as before, and fills it.
//!
//! **Per-backend cache of new flows.** A new flow's route (egress device, MTU, MACs) and the
//! egress device's node address (its SNAT source) are kept per CPU per backend
//! (`KP_BE_FWD`, `kproxy_common::ct::BackendFwd`, indexed by backend id, tagged with the
//! backend address), so the next new flow to the same backend skips `bpf_fib_lookup` and the
//! `KP_NODE_ADDR4` lookup (counted in `NewFlowCached`), under the checks of the flow cache:
//! the current generation, the same ingress device and TOS, within the MTU, out of a device
//! still enabled for the fast path. **Exactness**: that lookup uses the client's address as
//! source, so one answer serves every client only when routing ignores the source — the
//! kernel's default policy rules only (no source, iif or fwmark selectors) and no multipath
//! or TOS-keyed routes. The agent checks that on every route or rule announcement and allows the
//! cache (`KP_FWD_GEN[FWD_GEN_PER_BACKEND]` ≠ 0) only then; otherwise every new flow looks
//! its route up, as before. It also moves the generation after it rewrites `KP_NODE_ADDR4`.
//!
//! Everything else is passed (`XDP_PASS`) untouched, and TC handles it as if XDP were off:
//! flows to a local backend (their CT entries are created here when the flow starts here, so
//! TC sees an established flow), ICMP, IP options, fragments, TTL ≤ 1, frames longer than the
//! egress MTU (the FIB lookup checks the IP length), FIB results other than success (no
//! route, neighbour not resolved yet — the stack resolves it, and later packets take the
//! fast path), and flows whose state cannot be completed here. Each outcome is counted in
//! `KP_XDP_STATS` (`kproxy_common::ct::XdpStat`).

use core::ffi::c_void;
use core::mem::size_of;

use aya_ebpf::{
    bindings::xdp_action,
    helpers::{bpf_fib_lookup, bpf_redirect},
    programs::XdpContext,
};
use kproxy_common::ct::{
    BACKEND_FWD_ENTRIES, BackendFwd, CT_F_FIN_ORIG, CT_F_FIN_REPLY, CT_F_LOCAL_BACKEND,
    CT_F_NO_REV, CT_F_SNAT, CtEntry, CtKey, CtKind, FWD_GEN_CURRENT, FWD_GEN_PER_BACKEND, FwdCache,
    TCP_FIN, TCP_RST, TCP_SYN, XdpStat,
};
use kproxy_common::service::{PROTO_TCP, ServiceValue};

use crate::family::{Family, V4};
use crate::flow::{
    allocate_port, choose_backend, flow_entry, insert_flow, now, prandom, remix, snat_slot, touch,
};
use crate::maps::{KP_BE_FWD, KP_CT, KP_FWD_GEN, KP_NODE_ADDR4, KP_XDP_FWD_DEVS};
use crate::packet::{IP_OFF, Packet, at, csum_replace2, csum_replace4};
use crate::xdp::stat;

/// The current forwarding-cache generation (0: caching off).
#[inline(always)]
fn fwd_gen() -> u32 {
    KP_FWD_GEN.get(FWD_GEN_CURRENT).copied().unwrap_or(0)
}

/// This CPU's per-backend cache entry for `backend_id` when new flows may use one under
/// `generation` (module docs), else `None`.
#[inline(always)]
fn backend_slot(generation: u32, backend_id: u32) -> Option<*mut BackendFwd> {
    if generation == 0 || KP_FWD_GEN.get(FWD_GEN_PER_BACKEND).is_none_or(|v| *v == 0) {
        return None;
    }
    KP_BE_FWD.get_ptr_mut(backend_id & (BACKEND_FWD_ENTRIES - 1))
}

/// Whether the fast path may use device `ifindex`.
#[inline(always)]
fn fast_path_device(ifindex: u32) -> bool {
    KP_XDP_FWD_DEVS.get(ifindex).is_some_and(|v| *v != 0)
}

/// The L4 header's offset in a frame the fast path handles (IPv4 without options).
const L4: usize = IP_OFF + 20;
const AF_INET: u8 = 2;
/// `BPF_FIB_LKUP_RET_SUCCESS` / `BPF_FIB_LKUP_RET_FRAG_NEEDED`.
const FIB_SUCCESS: i64 = 0;
const FIB_FRAG_NEEDED: i64 = 8;
/// Flags + fragment offset: "more fragments" and the offset.
const IP_MF_OFFSET: u16 = 0x3fff;

/// `struct bpf_fib_lookup` (uapi `linux/bpf.h`, 64 bytes), IPv4 view: the unions are laid out
/// as the fields this program uses.
#[repr(C)]
struct FibParams {
    family: u8,
    l4_protocol: u8,
    sport: u16,
    dport: u16,
    /// In: IP total length (the kernel checks it against the egress MTU); out: that MTU.
    tot_len: u16,
    /// In: ingress device; out: egress device.
    ifindex: u32,
    /// `tos` in the low byte (union with flowinfo / rt_metric).
    tos: u32,
    src: [u32; 4],
    dst: [u32; 4],
    /// Out: VLAN proto/TCI (union with the input `tbid`).
    vlan: u32,
    /// In: the first 4 bytes are `mark`; out: source and destination MAC.
    smac: [u8; 6],
    dmac: [u8; 6],
}

/// The IPv4 header fields the fast path needs, for a frame it may forward.
pub(crate) struct Plain {
    /// Total length, network order.
    tot_len: u16,
    tos: u8,
}

/// `Ok` when `p` can be forwarded here: it came in on a fast-path device, has no IP
/// options, is not a fragment, has TTL > 1 and its L4 checksum field is inside the frame.
/// `Err`: why not (the counter to bump).
#[inline(always)]
pub(crate) fn plain(ctx: &XdpContext, p: &Packet) -> Result<Plain, XdpStat> {
    // SAFETY: reads the context's field.
    if !fast_path_device(unsafe { (*ctx.ctx).ingress_ifindex }) {
        return Err(XdpStat::PassDevice);
    }
    if p.l4 != L4 {
        return Err(XdpStat::PassHeader);
    }
    let (data, end) = (ctx.data(), ctx.data_end());
    let ip = at::<[u16; 10]>(data, end, IP_OFF).ok_or(XdpStat::PassHeader)?;
    // SAFETY: bounds-checked by `at`; read by value.
    let w = unsafe { *ip };
    if u16::from_be(w[3]) & IP_MF_OFFSET != 0 || (w[4] as u8) <= 1 {
        return Err(XdpStat::PassHeader);
    }
    let csum = if p.proto == PROTO_TCP {
        L4 + 16
    } else {
        L4 + 6
    };
    at::<u16>(data, end, csum).ok_or(XdpStat::PassHeader)?;
    Ok(Plain {
        tot_len: w[1],
        tos: (w[0] >> 8) as u8,
    })
}

/// The route of a frame to `dst` (from `src`, ports after translation): egress device (a
/// fast-path device) and MACs. `Err`: pass (counted).
#[inline(always)]
fn fib(
    ctx: &XdpContext,
    h: &Plain,
    proto: u8,
    src: (u32, u16),
    dst: (u32, u16),
) -> Result<FibParams, ()> {
    let mut f = FibParams {
        family: AF_INET,
        l4_protocol: proto,
        sport: src.1,
        dport: dst.1,
        tot_len: u16::from_be(h.tot_len),
        // SAFETY: reads the context's field.
        ifindex: unsafe { (*ctx.ctx).ingress_ifindex },
        tos: u32::from(h.tos),
        src: [src.0, 0, 0, 0],
        dst: [dst.0, 0, 0, 0],
        vlan: 0,
        smac: [0; 6],
        dmac: [0; 6],
    };
    // SAFETY: `f` is a valid `struct bpf_fib_lookup` of the size passed.
    let rc = unsafe {
        bpf_fib_lookup(
            ctx.ctx as *mut c_void,
            &mut f as *mut FibParams as *mut _,
            size_of::<FibParams>() as i32,
            0,
        )
    };
    match rc {
        FIB_SUCCESS if fast_path_device(f.ifindex) => Ok(f),
        FIB_SUCCESS => {
            stat(XdpStat::PassDevice);
            Err(())
        }
        FIB_FRAG_NEEDED => {
            stat(XdpStat::PassMtu);
            Err(())
        }
        _ => {
            stat(XdpStat::PassFib);
            Err(())
        }
    }
}

/// The frame's Ethernet addresses after a FIB answer `f`: destination, then source.
#[inline(always)]
fn eth_of(f: &FibParams) -> [u8; 12] {
    let mut m = [0u8; 12];
    let mut i = 0;
    while i < 6 {
        m[i] = f.dmac[i];
        m[6 + i] = f.smac[i];
        i += 1;
    }
    m
}

/// The ingress device of the frame.
#[inline(always)]
fn ingress(ctx: &XdpContext) -> u32 {
    // SAFETY: reads the context's field.
    unsafe { (*ctx.ctx).ingress_ifindex }
}

/// Whether forwarding answer `c` (a [`FwdCache`] inside a lookup result) holds for frames like
/// `h` arriving on `in_if` under generation `generation`: filled under that generation for the
/// same ingress device and TOS, the frame within its MTU, out of a device still enabled for
/// the fast path (module docs). The check of both caches, per flow and per backend.
#[inline(always)]
fn fwd_holds(c: *const FwdCache, generation: u32, in_if: u32, h: &Plain) -> bool {
    // SAFETY: points into a lookup result; fields read by value.
    let (c_gen, c_in, c_tos, c_mtu, c_out) = unsafe {
        (
            (*c).generation,
            (*c).in_ifindex,
            (*c).tos,
            (*c).mtu,
            (*c).out_ifindex,
        )
    };
    c_gen == generation
        && u32::from(c_in) == in_if
        && c_tos == h.tos
        && u16::from_be(h.tot_len) <= c_mtu
        && fast_path_device(u32::from(c_out))
}

/// Whether `e`'s forwarding cache holds the answer for packet `p` (headers `h`) arriving on
/// `in_if` under generation `generation` ([`fwd_holds`]; SYN, FIN and RST never use it).
#[inline(always)]
fn cached(e: *const CtEntry, generation: u32, in_if: u32, p: &Packet, h: &Plain) -> bool {
    if generation == 0 || p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) != 0 {
        return false;
    }
    // SAFETY: lookup result; a field's address.
    fwd_holds(unsafe { &raw const (*e).fwd }, generation, in_if, h)
}

/// Whether the per-backend entry `c` holds the answer for a new flow to `be_addr` (headers
/// `h`) arriving on `in_if` under generation `generation`: [`fwd_holds`], on the backend
/// instead of the flow (a new flow's SYN included).
#[inline(always)]
fn backend_cached(
    c: *const BackendFwd,
    generation: u32,
    in_if: u32,
    be_addr: u32,
    h: &Plain,
) -> bool {
    // SAFETY: lookup result (this CPU's); a field read by value, a field's address.
    unsafe { (*c).backend == be_addr && fwd_holds(&raw const (*c).fwd, generation, in_if, h) }
}

/// A new flow's route to a remote backend: egress device, node address (the SNAT source) and
/// Ethernet addresses.
struct NewRoute {
    out_if: u32,
    node: u32,
    eth: [u8; 12],
}

/// The route of new flow `p` (headers `h`) to backend `be` (`backend_id`): from this CPU's
/// per-backend cache when it holds the answer, else `bpf_fib_lookup` with the client's
/// source and `KP_NODE_ADDR4`, which then fill the cache if allowed (module docs). `Err`:
/// pass, with the counter to bump (`None`: `fib` counted it).
#[inline(always)]
fn new_flow_route(
    ctx: &XdpContext,
    p: &Packet,
    h: &Plain,
    backend_id: u32,
    be: (u32, u16),
) -> Result<NewRoute, Option<XdpStat>> {
    // Read before the lookups: a change after them moves it past what the fill records.
    let generation = fwd_gen();
    let in_if = ingress(ctx);
    let slot = backend_slot(generation, backend_id);
    if let Some(c) = slot
        && backend_cached(c, generation, in_if, be.0, h)
    {
        stat(XdpStat::NewFlowCached);
        // SAFETY: lookup result (this CPU's), read by value.
        return Ok(unsafe {
            NewRoute {
                out_if: u32::from((*c).fwd.out_ifindex),
                node: (*c).snat_addr,
                eth: (*c).fwd.eth,
            }
        });
    }
    let f = fib(ctx, h, p.proto, (p.saddr, p.sport), be).map_err(|()| None)?;
    // SAFETY: read by value right away.
    let node = (unsafe { KP_NODE_ADDR4.get(f.ifindex) })
        .copied()
        .ok_or(Some(XdpStat::PassState))?;
    let eth = eth_of(&f);
    if let Some(c) = slot {
        // SAFETY: this CPU's entry: no other writer, and no reader while this program runs.
        // Both devices are fast-path devices, so their ifindex fits the cache's `u16`.
        unsafe {
            *c = BackendFwd {
                fwd: FwdCache {
                    generation,
                    in_ifindex: in_if as u16,
                    out_ifindex: f.ifindex as u16,
                    mtu: f.tot_len,
                    tos: h.tos,
                    _pad: 0,
                    eth,
                },
                backend: be.0,
                snat_addr: node.addr,
            };
        }
    }
    Ok(NewRoute {
        out_if: f.ifindex,
        node: node.addr,
        eth,
    })
}

/// Caches FIB answer `f` (and `eth`, from it) with the rewritten source `src` in `e` under
/// generation `generation` (read before the lookup), for frames like `h` from `in_if`. Both
/// devices are fast-path devices, so their ifindex fits the cache's `u16`.
#[inline(always)]
fn fill(
    e: *mut CtEntry,
    generation: u32,
    in_if: u32,
    h: &Plain,
    f: &FibParams,
    eth: &[u8; 12],
    src: (u32, u16),
) {
    // SAFETY: lookup result. The generation is written last (volatile), so a packet of the
    // flow on another CPU that finds it current finds the answer written before it. Not
    // guarded: two CPUs filling one entry at once (packets of one flow on two CPUs while its
    // cache is stale), which write the same answer unless their frames differ in ingress
    // device or TOS; a mix of both then lasts until the next routing change. RSS keeps a
    // flow's packets on one CPU.
    unsafe {
        (*e).snat_addr = src.0;
        (*e).snat_port = src.1;
        (*e).fwd = FwdCache {
            generation: 0,
            in_ifindex: in_if as u16,
            out_ifindex: f.ifindex as u16,
            mtu: f.tot_len,
            tos: h.tos,
            _pad: 0,
            eth: *eth,
        };
        core::ptr::write_volatile(&raw mut (*e).fwd.generation, generation);
    }
}

/// Rewrites source and destination (address + port), decrements the TTL with both checksums
/// updated, sets the Ethernet addresses to `eth` and sends the frame out of `out_if`.
#[inline(always)]
fn send(
    ctx: &XdpContext,
    p: &Packet,
    src: (u32, u16),
    dst: (u32, u16),
    out_if: u32,
    eth_new: &[u8; 12],
) -> u32 {
    let (data, end) = (ctx.data(), ctx.data_end());
    let Some(eth) = at::<[u8; 12]>(data, end, 0) else {
        return xdp_action::XDP_PASS;
    };
    let Some(ip) = at::<[u16; 10]>(data, end, IP_OFF) else {
        return xdp_action::XDP_PASS;
    };
    let Some(ports) = at::<[u16; 2]>(data, end, L4) else {
        return xdp_action::XDP_PASS;
    };
    let csum_off = if p.proto == PROTO_TCP {
        L4 + 16
    } else {
        L4 + 6
    };
    let Some(l4_csum) = at::<u16>(data, end, csum_off) else {
        return xdp_action::XDP_PASS;
    };
    // SAFETY: every pointer is bounds-checked by `at`, and no helper ran since.
    unsafe {
        let mut w = *ip;
        let ttl_old = w[4];
        // TTL is the first byte of the (TTL, protocol) word.
        let ttl_new = ttl_old.wrapping_sub(1);
        let mut check = csum_replace2(w[5], ttl_old, ttl_new);
        check = csum_replace4(check, p.saddr, src.0);
        check = csum_replace4(check, p.daddr, dst.0);
        w[4] = ttl_new;
        w[5] = check;
        w[6] = src.0 as u16;
        w[7] = (src.0 >> 16) as u16;
        w[8] = dst.0 as u16;
        w[9] = (dst.0 >> 16) as u16;
        *ip = w;
        let old = *l4_csum;
        // A UDP checksum of 0 means "none" and stays so; a computed 0 is sent as 0xffff.
        if p.proto == PROTO_TCP || old != 0 {
            let mut c = csum_replace4(old, p.saddr, src.0);
            c = csum_replace4(c, p.daddr, dst.0);
            c = csum_replace2(c, p.sport, src.1);
            c = csum_replace2(c, p.dport, dst.1);
            if c == 0 && p.proto != PROTO_TCP {
                c = 0xffff;
            }
            *l4_csum = c;
        }
        *ports = [src.1, dst.1];
        *eth = *eth_new;
        if out_if == (*ctx.ctx).ingress_ifindex {
            xdp_action::XDP_TX
        } else {
            bpf_redirect(out_if, 0) as u32
        }
    }
}

/// Client → backend for the flow `p` (`C:cp → F:fp`) whose `Service` entry says backend
/// `be` with `flags`; `svc_entry` (that entry) is refreshed when the frame is sent, and holds
/// the flow's forwarding cache.
#[inline(always)]
pub(crate) fn forward(
    ctx: &XdpContext,
    p: &Packet,
    h: &Plain,
    be: (u32, u16),
    flags: u16,
    svc_entry: *mut CtEntry,
) -> u32 {
    if flags & CT_F_SNAT == 0 || flags & CT_F_LOCAL_BACKEND != 0 {
        stat(XdpStat::PassLocal);
        return xdp_action::XDP_PASS;
    }
    let generation = fwd_gen();
    let in_if = ingress(ctx);
    if cached(svc_entry, generation, in_if, p, h) {
        // SAFETY: lookup result, read by value; `eth` read in place by `send`.
        let (src, out_if) = unsafe {
            (
                ((*svc_entry).snat_addr, (*svc_entry).snat_port),
                u32::from((*svc_entry).fwd.out_ifindex),
            )
        };
        touch::<V4>(svc_entry, p.tcp_flags, CT_F_FIN_ORIG);
        stat(XdpStat::Forward);
        // SAFETY: lookup result, a field address.
        return send(ctx, p, src, be, out_if, unsafe { &(*svc_entry).fwd.eth });
    }
    // The flow as it leaves (after DNAT), the tuple TC egress and `allocate_port` see.
    let out_pkt = Packet {
        saddr: p.saddr,
        daddr: be.0,
        sport: p.sport,
        dport: be.1,
        proto: p.proto,
        tcp_flags: p.tcp_flags,
        l4: p.l4,
    };
    // The SNAT source: in the `Service` entry itself when the flow has no `RevDnat` entry
    // (started here), else where TC egress finds it.
    let no_rev = flags & CT_F_NO_REV != 0;
    let (out, n_slot, np_slot) = if no_rev {
        let (addr, port) = V4::snat_slot(svc_entry);
        (svc_entry, addr, port)
    } else {
        let Some(slot) = snat_slot::<V4>(
            out_pkt.saddr,
            out_pkt.daddr,
            out_pkt.sport,
            out_pkt.dport,
            out_pkt.proto,
        ) else {
            stat(XdpStat::PassState);
            return xdp_action::XDP_PASS;
        };
        slot
    };
    // SAFETY: fields of a lookup result, read by value.
    let (mut n_addr, mut n_port) = unsafe { (*n_slot, *np_slot) };
    // The SNAT source is known (every packet but a TC-started flow's first one here): the
    // answer for it can be cached.
    let known = n_addr != 0;
    let src = if known {
        (n_addr, n_port)
    } else {
        (p.saddr, p.sport)
    };
    let Ok(f) = fib(ctx, h, p.proto, src, be) else {
        return xdp_action::XDP_PASS;
    };
    if !known {
        // SAFETY: read by value right away.
        let Some(node) = (unsafe { KP_NODE_ADDR4.get(f.ifindex) }).copied() else {
            stat(XdpStat::PassState);
            return xdp_action::XDP_PASS;
        };
        // SAFETY: lookup result, read in place (a copy would cost stack).
        let template = unsafe { &*out };
        let Some(port) = allocate_port::<V4>(
            out_pkt.saddr,
            out_pkt.daddr,
            out_pkt.sport,
            out_pkt.dport,
            out_pkt.proto,
            node.addr,
            template,
            None,
        ) else {
            stat(XdpStat::PassState);
            return xdp_action::XDP_PASS;
        };
        n_addr = node.addr;
        n_port = port;
        // SAFETY: lookup result; a racing TC egress allocating for the same flow leaves one
        // of the two `SnatIn` entries unused until it expires (replies to both work).
        unsafe {
            *n_slot = n_addr;
            *np_slot = n_port;
        }
    }
    let eth = eth_of(&f);
    if known && generation != 0 {
        fill(svc_entry, generation, in_if, h, &f, &eth, (n_addr, n_port));
    }
    touch::<V4>(svc_entry, p.tcp_flags, CT_F_FIN_ORIG);
    if !no_rev {
        touch::<V4>(out, p.tcp_flags, CT_F_FIN_ORIG);
    }
    stat(XdpStat::Forward);
    send(ctx, p, (n_addr, n_port), be, f.ifindex, &eth)
}

/// A new flow `p` of `svc` (source range and endpoints already checked): the backend is
/// chosen as TC would; remote → its `SnatIn` entry (the SNAT port claim, with the frontend
/// beside the client) and its `Service` entry (with the SNAT source), no `RevDnat` entry
/// (`CT_F_NO_REV`, module docs), and forwarded; local → recorded as TC records a flow and
/// passed (TC then sees an established flow). The FIB lookup and the port claim come before
/// the `Service` insert, so it is written once, complete; one random number serves the
/// backend slot and the port. Whatever stops the fast path after the backend is chosen still
/// records the flow as TC would (without a SNAT source), and passes it to TC.
#[inline(always)]
pub(crate) fn new_flow(ctx: &XdpContext, p: &Packet, h: &Plain, svc: &ServiceValue) -> u32 {
    let ts = now();
    let rnd = prandom();
    let Some((backend_id, be)) = choose_backend::<V4>(svc, p, ts, Some(rnd)) else {
        stat(XdpStat::PassState);
        return xdp_action::XDP_PASS;
    };
    let (be_addr, flags, mut entry) = flow_entry::<V4>(p, svc, backend_id, &be, ts);
    let be_port = be.port;
    if flags & CT_F_SNAT == 0 || flags & CT_F_LOCAL_BACKEND != 0 {
        return record_and_pass(p, be_addr, be_port, &entry, Some(XdpStat::PassLocal));
    }
    let route = match new_flow_route(ctx, p, h, backend_id, (be_addr, be_port)) {
        Ok(r) => r,
        Err(why) => return record_and_pass(p, be_addr, be_port, &entry, why),
    };
    // The flow as it leaves (after DNAT), the tuple TC egress and `allocate_port` see.
    let out_pkt = Packet {
        saddr: p.saddr,
        daddr: be_addr,
        sport: p.sport,
        dport: be_port,
        proto: p.proto,
        tcp_flags: p.tcp_flags,
        l4: p.l4,
    };
    // No `RevDnat` entry (`CT_F_NO_REV`): the `SnatIn` entry is the template with the client
    // as NAT address and the frontend beside it, the `Service` entry holds the SNAT source.
    let snat_in = CtEntry {
        flags: entry.flags | CT_F_NO_REV,
        snat_addr: p.daddr,
        snat_port: p.dport,
        ..entry
    };
    let Some(port) = allocate_port::<V4>(
        out_pkt.saddr,
        out_pkt.daddr,
        out_pkt.sport,
        out_pkt.dport,
        out_pkt.proto,
        route.node,
        &snat_in,
        Some(remix(rnd)),
    ) else {
        return record_and_pass(p, be_addr, be_port, &entry, Some(XdpStat::PassState));
    };
    entry.flags |= CT_F_NO_REV;
    entry.snat_addr = route.node;
    entry.snat_port = port;
    if KP_CT
        .insert(&V4::key_of(p, CtKind::Service), &entry, 0)
        .is_err()
    {
        let k = V4::key(be_addr, route.node, be_port, port, p.proto, CtKind::SnatIn);
        let _ = KP_CT.remove(&k);
        stat(XdpStat::PassState);
        return xdp_action::XDP_PASS;
    }
    stat(XdpStat::NewFlow);
    stat(XdpStat::Forward);
    send(
        ctx,
        p,
        (route.node, port),
        (be_addr, be_port),
        route.out_if,
        &route.eth,
    )
}

/// Records new flow `p` (entries without a SNAT source), counts it and `why` (if not counted
/// already), and passes it.
#[inline(always)]
fn record_and_pass(
    p: &Packet,
    be_addr: u32,
    be_port: u16,
    entry: &CtEntry,
    why: Option<XdpStat>,
) -> u32 {
    if insert_flow::<V4>(p, be_addr, be_port, *entry).is_err() {
        stat(XdpStat::PassState);
        return xdp_action::XDP_PASS;
    }
    stat(XdpStat::NewFlow);
    if let Some(s) = why {
        stat(s);
    }
    xdp_action::XDP_PASS
}

/// Backend → client for `p` (`B:bp → N:np`) whose `SnatIn` entry is `snat_in` (which holds
/// the reply direction's forwarding cache, with the frontend beside it).
#[inline(always)]
pub(crate) fn reply(ctx: &XdpContext, p: &Packet, h: &Plain, snat_in: *mut CtEntry) -> u32 {
    // SAFETY: lookup result, read by value.
    let client = unsafe { ((*snat_in).nat_addr, (*snat_in).nat_port) };
    let generation = fwd_gen();
    let in_if = ingress(ctx);
    if cached(snat_in, generation, in_if, p, h) {
        // SAFETY: lookup result, read by value; `eth` read in place by `send`.
        let (frontend, out_if) = unsafe {
            (
                ((*snat_in).snat_addr, (*snat_in).snat_port),
                u32::from((*snat_in).fwd.out_ifindex),
            )
        };
        touch::<V4>(snat_in, p.tcp_flags, CT_F_FIN_REPLY);
        stat(XdpStat::Reply);
        // SAFETY: lookup result, a field address.
        return send(ctx, p, frontend, client, out_if, unsafe {
            &(*snat_in).fwd.eth
        });
    }
    // The frontend: beside the client in the `SnatIn` entry when the flow has no `RevDnat`
    // entry (started here), else the `RevDnat` entry's NAT address.
    // SAFETY: lookup result, read by value.
    let (flags, beside) = unsafe {
        (
            (*snat_in).flags,
            ((*snat_in).snat_addr, (*snat_in).snat_port),
        )
    };
    let (frontend, rev) = if flags & CT_F_NO_REV != 0 {
        (beside, None)
    } else {
        let k = CtKey {
            saddr: p.saddr,
            daddr: client.0,
            sport: p.sport,
            dport: client.1,
            proto: p.proto,
            kind: CtKind::RevDnat as u8,
            _pad: [0; 2],
        };
        let Some(r) = KP_CT.get_ptr_mut(k) else {
            stat(XdpStat::PassState);
            return xdp_action::XDP_PASS;
        };
        // SAFETY: lookup result, read by value.
        (unsafe { ((*r).nat_addr, (*r).nat_port) }, Some(r))
    };
    let Ok(f) = fib(ctx, h, p.proto, frontend, client) else {
        return xdp_action::XDP_PASS;
    };
    let eth = eth_of(&f);
    if generation != 0 {
        fill(snat_in, generation, in_if, h, &f, &eth, frontend);
    }
    touch::<V4>(snat_in, p.tcp_flags, CT_F_FIN_REPLY);
    if let Some(r) = rev {
        touch::<V4>(r, p.tcp_flags, CT_F_FIN_REPLY);
    }
    stat(XdpStat::Reply);
    send(ctx, p, frontend, client, f.ifindex, &eth)
}
