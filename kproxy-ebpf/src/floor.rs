//! Floor programs of the bench (`kproxy_common::counter::FLOOR_PROGRAMS`): the least a
//! connection-tracking datapath does per packet, so `cargo xtask bench` can show how far the
//! TC service path is above it, not only above the counter program. They parse the packet and
//! build keys exactly as [`crate::tc`] does and touch a table of the same types and size;
//! nothing else (no rewrite, timestamps or counters; one frontend lookup in
//! [`kp_floor_new_flow`] only). Never attached.

use aya_ebpf::{
    bindings::{TC_ACT_OK, TC_ACT_UNSPEC},
    macros::{classifier, map},
    maps::LruHashMap,
    programs::TcContext,
};
use kproxy_common::counter::FLOOR_CT_OBJECT_ENTRIES;
use kproxy_common::ct::{CtEntry, CtKind};

use kproxy_common::service::{SCOPE_EXTERNAL, v4_mapped};

use crate::family::{Family, V4};
use crate::frontend::service_entry;
use crate::packet::Packet;
use crate::tc::parse;

/// `kproxy_common::counter::MAP_FLOOR_CT` (small as declared; the bench sizes it).
#[map]
static KP_FLOOR_CT: LruHashMap<kproxy_common::ct::CtKey, CtEntry> =
    LruHashMap::with_max_entries(FLOOR_CT_OBJECT_ENTRIES, 0);

/// `kproxy_common::counter::PROG_FLOOR_CT_LOOKUP`.
#[classifier]
pub fn kp_floor_ct_lookup(ctx: TcContext) -> i32 {
    let Some(p) = parse::<V4>(&ctx) else {
        return TC_ACT_UNSPEC;
    };
    if KP_FLOOR_CT
        .get_ptr_mut(V4::key_of(&p, CtKind::Service))
        .is_some()
    {
        TC_ACT_OK
    } else {
        TC_ACT_UNSPEC
    }
}

/// `kproxy_common::counter::PROG_FLOOR_CT_INSERT`.
#[classifier]
pub fn kp_floor_ct_insert(ctx: TcContext) -> i32 {
    let Some(p) = parse::<V4>(&ctx) else {
        return TC_ACT_UNSPEC;
    };
    insert_flow(&p)
}

/// `kproxy_common::counter::PROG_FLOOR_NEW_FLOW`.
#[classifier]
pub fn kp_floor_new_flow(ctx: TcContext) -> i32 {
    let Some(p) = parse::<V4>(&ctx) else {
        return TC_ACT_UNSPEC;
    };
    // A packet is only known to open a flow once its lookup missed.
    if KP_FLOOR_CT
        .get_ptr_mut(V4::key_of(&p, CtKind::Service))
        .is_some()
        || service_entry(v4_mapped(p.daddr), p.dport, p.proto, SCOPE_EXTERNAL).is_none()
    {
        return TC_ACT_UNSPEC;
    }
    insert_flow(&p)
}

/// The two entries of a new flow, as [`crate::flow::create_flow`] inserts them.
#[inline(always)]
fn insert_flow(p: &Packet) -> i32 {
    // SAFETY: plain-old-data entry of integers; all zero is a valid value.
    let entry: CtEntry = unsafe { core::mem::zeroed() };
    let forward = V4::key_of(p, CtKind::Service);
    let reverse = V4::key(p.daddr, p.saddr, p.dport, p.sport, p.proto, CtKind::RevDnat);
    if KP_FLOOR_CT.insert(forward, entry, 0).is_ok()
        && KP_FLOOR_CT.insert(reverse, entry, 0).is_ok()
    {
        TC_ACT_OK
    } else {
        TC_ACT_UNSPEC
    }
}
