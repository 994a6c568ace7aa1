//! The frontend lookups the node-device service path shares between its TC programs
//! ([`crate::tc`], both families) and its XDP program ([`crate::xdp`]), so all classify a
//! packet the same way (generic over the address family, [`crate::family::Family`]):
//! 1. [`candidates`] asks the frontend filter (`kproxy_common::frontend_filter`, two inlined
//!    array reads, no hash lookup) which scopes may hold an entry for the destination. Most
//!    packets that are for no service stop here ([`Candidates::none`]).
//! 2. [`new_flow_entry`] reads the entry a *new* flow uses: the external-scope entry of a
//!    NodePort / ExternalIP / LoadBalancer frontend, else the cluster-scope entry of a
//!    ClusterIP reached from outside the node — each only where the filter says it may exist,
//!    so a new flow to an external frontend costs one `KP_SERVICES` lookup (until 2026-11 it
//!    cost two: the cluster-scope twin, read first to tell "not a frontend", then the
//!    external entry). `None`: not a frontend, the packet goes on untouched.
//! 3. [`source_allowed`] checks loadBalancerSourceRanges.
//!
//! One difference from the order before the filter: where an external-scope entry and a
//! ClusterIP's cluster-scope entry share an (address, port, protocol) — an ExternalIP equal to
//! another service's ClusterIP — the external entry now wins for traffic from outside.

use aya_ebpf::maps::lpm_trie::Key;
use kproxy_common::frontend_filter::filter_slot;
use kproxy_common::service::{
    SCOPE_CLUSTER, SCOPE_EXTERNAL, SOURCE_RANGE_ID_BITS, SVC_F_CLUSTER_IP, SVC_F_SOURCE_RANGES,
    ServiceKey, ServiceValue, SourceRangeKey,
};

use crate::family::Family;
use crate::maps::{KP_FE_FILTER, KP_SERVICES, KP_SRC_RANGES};

/// The frontend entry for a destination `addr` (16-byte service-map form: IPv4 v4-mapped,
/// IPv6 as is), `port` (network order), `proto` in `scope`. Shared by both families.
#[inline(always)]
pub fn service_entry(addr: [u32; 4], port: u16, proto: u8, scope: u8) -> Option<ServiceValue> {
    let k = ServiceKey {
        addr,
        port,
        proto,
        scope,
    };
    // SAFETY: read by value right away.
    unsafe { KP_SERVICES.get(k) }.copied()
}

/// Which scopes may hold a frontend entry at a destination, per the frontend filter.
#[derive(Clone, Copy)]
pub struct Candidates {
    external: bool,
    cluster: bool,
}

impl Candidates {
    /// No frontend of either scope is at the destination: not for a service.
    #[inline(always)]
    pub fn none(&self) -> bool {
        !self.external && !self.cluster
    }
}

/// Whether the filter allows an entry at (`addr`, `port`, `proto`, `scope`). A word that
/// cannot be read (never: the index is masked to the array) counts as "maybe".
#[inline(always)]
fn maybe(addr: &[u32; 4], port: u16, proto: u8, scope: u8) -> bool {
    let (word, mask) = filter_slot(addr, port, proto, scope);
    match KP_FE_FILTER.get(word) {
        Some(absent) => *absent & mask == 0,
        None => true,
    }
}

/// The scopes that may hold a frontend at `p`'s destination.
#[inline(always)]
pub fn candidates<F: Family>(p: &F::Packet) -> Candidates {
    let (_, daddr, _, port, proto) = F::tuple(p);
    let addr = F::mapped(daddr);
    Candidates {
        external: maybe(&addr, port, proto, SCOPE_EXTERNAL),
        cluster: maybe(&addr, port, proto, SCOPE_CLUSTER),
    }
}

/// The entry a new flow to `p`'s destination is load-balanced by (see the module docs),
/// reading only the scopes in `c`; `None`: not a frontend.
#[inline(always)]
pub fn new_flow_entry<F: Family>(p: &F::Packet, c: Candidates) -> Option<ServiceValue> {
    let (_, daddr, _, port, proto) = F::tuple(p);
    let addr = F::mapped(daddr);
    if c.external
        && let Some(v) = service_entry(addr, port, proto, SCOPE_EXTERNAL)
    {
        return Some(v);
    }
    if !c.cluster {
        return None;
    }
    // A cluster-scope entry without the ClusterIP flag is the twin of an external frontend
    // (for socket LB); traffic from outside uses the external entry, which is not there.
    let v = service_entry(addr, port, proto, SCOPE_CLUSTER)?;
    (v.flags & SVC_F_CLUSTER_IP != 0).then_some(v)
}

/// Whether a client at `saddr` may open a flow to `svc`. The LPM key holds the address in
/// 16-byte form (IPv4 v4-mapped, IPv6 as the planner stores IPv6 ranges); its prefix covers
/// `svc_id` and all 128 address bits.
#[inline(always)]
pub fn source_allowed<F: Family>(svc: &ServiceValue, saddr: F::Addr) -> bool {
    if svc.flags & SVC_F_SOURCE_RANGES == 0 {
        return true;
    }
    let k = Key::new(
        SOURCE_RANGE_ID_BITS + 128,
        SourceRangeKey {
            svc_id: svc.svc_id,
            addr: F::mapped(saddr),
        },
    );
    KP_SRC_RANGES.get(&k).is_some()
}
