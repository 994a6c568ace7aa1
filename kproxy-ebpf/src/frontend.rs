//! The frontend lookups the node-device service path shares between its TC programs
//! ([`crate::tc`]) and its XDP program ([`crate::xdp`]), so both classify a packet the same
//! way:
//! 1. [`cluster_entry`] reads the cluster-scope `KP_SERVICES` entry of the destination. Every
//!    frontend has one (the external-scope entry of a NodePort/ExternalIP/LB has a
//!    cluster-scope twin), so `None` means "not for a service": one hash lookup.
//! 2. [`new_flow_entry`] reads the entry a *new* flow uses: a ClusterIP reached from outside the
//!    node its cluster entry, every other frontend its external-scope entry.
//! 3. [`source_allowed`] checks loadBalancerSourceRanges.

use aya_ebpf::maps::lpm_trie::Key;
use kproxy_common::service::{
    SCOPE_CLUSTER, SCOPE_EXTERNAL, SOURCE_RANGE_ID_BITS, SVC_F_CLUSTER_IP, SVC_F_SOURCE_RANGES,
    ServiceKey, ServiceValue, SourceRangeKey, v4_mapped,
};

use crate::packet::Packet;
use crate::service_maps::{KP_SERVICES, KP_SRC_RANGES};

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

/// The destination's cluster-scope frontend entry; `None`: not a frontend.
#[inline(always)]
pub fn cluster_entry(p: &Packet) -> Option<ServiceValue> {
    service_entry(v4_mapped(p.daddr), p.dport, p.proto, SCOPE_CLUSTER)
}

/// The entry a new flow to (`addr`, `port`, `proto`) is load-balanced by, given its cluster
/// entry (16-byte address as in [`service_entry`]).
#[inline(always)]
pub fn new_flow_entry_at(
    addr: [u32; 4],
    port: u16,
    proto: u8,
    cluster: &ServiceValue,
) -> Option<ServiceValue> {
    if cluster.flags & SVC_F_CLUSTER_IP != 0 {
        return Some(*cluster);
    }
    service_entry(addr, port, proto, SCOPE_EXTERNAL)
}

/// The entry a new flow to `p`'s destination is load-balanced by, given its cluster entry.
#[inline(always)]
pub fn new_flow_entry(p: &Packet, cluster: &ServiceValue) -> Option<ServiceValue> {
    new_flow_entry_at(v4_mapped(p.daddr), p.dport, p.proto, cluster)
}

/// Whether a client at `addr` (16-byte LPM form: IPv4 v4-mapped, IPv6 unmapped as the
/// planner stores IPv6 ranges) may open a flow to `svc`. The key's prefix covers `svc_id` and
/// all 128 address bits.
#[inline(always)]
pub fn source_allowed_at(svc: &ServiceValue, addr: [u32; 4]) -> bool {
    if svc.flags & SVC_F_SOURCE_RANGES == 0 {
        return true;
    }
    let k = Key::new(
        SOURCE_RANGE_ID_BITS + 128,
        SourceRangeKey {
            svc_id: svc.svc_id,
            addr,
        },
    );
    KP_SRC_RANGES.get(&k).is_some()
}

/// Whether a client at `saddr` (network order) may open a flow to `svc`.
#[inline(always)]
pub fn source_allowed(svc: &ServiceValue, saddr: u32) -> bool {
    source_allowed_at(svc, v4_mapped(saddr))
}
