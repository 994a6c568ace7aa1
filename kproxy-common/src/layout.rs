//! Map layouts: what each pinned map of this build looks like, so an agent started over pins
//! left by another build (an upgrade, a downgrade) can tell whether it may reuse them.
//!
//! A layout is the map's type, key and value sizes (derived from the shared types, so they
//! follow any change) and a **version** number kept by hand. The agent records the version of
//! every map it pins in [`MAP_LAYOUT`], a small pinned hash map beside them (bpffs holds no
//! regular files): key = the map name NUL-padded to [`LAYOUT_NAME_LEN`] bytes, value =
//! [`LayoutRecord`]. `kproxy::dataplane::ebpf::layout` compares pins, records and this table at
//! start and reuses, carries over or replaces each map.
//!
//! # Rules for changing a map type
//!
//! - Appending a field to a value (old values are a prefix of new ones, and a zero new field
//!   means "unset"): nothing to do; entries are carried over with the new bytes zeroed when
//!   [`MapLayout::carry_from`] allows it.
//! - Any other change of meaning — a field reordered, resized or reinterpreted, a flag bit
//!   redefined, a key changed — bump [`MapLayout::version`] **and** set `carry_from` to the new
//!   version (or `None`): older entries are then replaced, never reinterpreted.
//!
//! `carry_from` is `Some` only for maps holding state the agent cannot rebuild (connections,
//! affinity, socket reverse NAT); the agent-written service maps are simply replaced and
//! reprogrammed by the next sync.

use core::mem::size_of;

use crate::ct::{
    CtEntry, CtKey, MAP_CT, MAP_NAT_CONFIG, MAP_NODE_ADDR4, MAP_TC_STATS, MAP_XDP_STATS, NatConfig,
    NodeAddr4,
};
use crate::ct6::{CtEntry6, CtKey6, MAP_CT6, MAP_NODE_ADDR6, NodeAddr6};
use crate::frontend_filter::MAP_FRONTEND_FILTER;
use crate::maglev::{IDS_PER_ELEM, MAP_MAGLEV, MAP_MAGLEV_REF, MaglevRef};
use crate::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, MAP_AFFINITY, MAP_BACKEND_SLOTS,
    MAP_BACKENDS, MAP_SERVICES, MAP_SOCK_FWD, MAP_SOCK_REV_NAT, MAP_SOCK_SENT, MAP_SOURCE_RANGES,
    ServiceKey, ServiceValue, SlotValue, SockFwdKey, SockFwdValue, SockRevNatKey, SockRevNatValue,
    SockSentValue, SourceRangeKey,
};

/// `HashMap<[u8; LAYOUT_NAME_LEN], LayoutRecord>`: the layout each pinned map was created with.
/// Created and written by the agent only (not part of the BPF object).
pub const MAP_LAYOUT: &str = "KP_LAYOUT";
/// Key length of [`MAP_LAYOUT`] (the kernel's object-name length).
pub const LAYOUT_NAME_LEN: usize = 16;
/// `max_entries` of [`MAP_LAYOUT`].
pub const LAYOUT_ENTRIES: u32 = 64;
/// The version of a pinned map that has no record: pins from before records existed, which
/// had the version-1 layouts.
pub const UNRECORDED_VERSION: u32 = 1;

/// `bpf_map_type` values used here.
pub const MAP_TYPE_HASH: u32 = 1;
pub const MAP_TYPE_ARRAY: u32 = 2;
pub const MAP_TYPE_PERCPU_ARRAY: u32 = 6;
pub const MAP_TYPE_LRU_HASH: u32 = 9;
pub const MAP_TYPE_LPM_TRIE: u32 = 11;

/// One pinned map's layout in this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLayout {
    pub name: &'static str,
    /// `bpf_map_type`.
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    /// Bumped by hand when the meaning of the bytes changes (see the module docs).
    pub version: u32,
    /// Entries of a pinned map with the same type and key size, a value no longer than this
    /// one's and a version `>= carry_from` (and not newer than [`Self::version`]) are copied
    /// into the new map, zero-extended. `None`: never carried over.
    pub carry_from: Option<u32>,
}

/// Value of [`MAP_LAYOUT`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayoutRecord {
    pub version: u32,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
}

/// The [`MAP_LAYOUT`] key of `name`.
pub fn layout_key(name: &str) -> [u8; LAYOUT_NAME_LEN] {
    let mut k = [0u8; LAYOUT_NAME_LEN];
    let n = name.len().min(LAYOUT_NAME_LEN - 1);
    k[..n].copy_from_slice(&name.as_bytes()[..n]);
    k
}

const fn layout(
    name: &'static str,
    map_type: u32,
    key_size: usize,
    value_size: usize,
    version: u32,
    carry_from: Option<u32>,
) -> MapLayout {
    MapLayout {
        name,
        map_type,
        key_size: key_size as u32,
        value_size: value_size as u32,
        version,
        carry_from,
    }
}

/// Every map the BPF object pins, with its layout.
pub const LAYOUTS: [MapLayout; 18] = [
    layout(
        MAP_SERVICES,
        MAP_TYPE_HASH,
        size_of::<ServiceKey>(),
        size_of::<ServiceValue>(),
        1,
        None,
    ),
    // 2: the value holds the backend itself (`SlotValue`), not only its id.
    layout(
        MAP_BACKEND_SLOTS,
        MAP_TYPE_HASH,
        size_of::<BackendSlotKey>(),
        size_of::<SlotValue>(),
        2,
        None,
    ),
    layout(
        MAP_BACKENDS,
        MAP_TYPE_HASH,
        size_of::<u32>(),
        size_of::<BackendValue>(),
        1,
        None,
    ),
    layout(
        MAP_AFFINITY,
        MAP_TYPE_LRU_HASH,
        size_of::<AffinityKey>(),
        size_of::<AffinityValue>(),
        1,
        Some(1),
    ),
    // LPM trie keys carry a 4-byte prefix length before the data.
    layout(
        MAP_SOURCE_RANGES,
        MAP_TYPE_LPM_TRIE,
        4 + size_of::<SourceRangeKey>(),
        size_of::<u8>(),
        1,
        None,
    ),
    // Maglev tables are rebuilt by the agent from the snapshot: replaced, never carried.
    layout(
        MAP_MAGLEV,
        MAP_TYPE_ARRAY,
        size_of::<u32>(),
        size_of::<[u32; IDS_PER_ELEM as usize]>(),
        1,
        None,
    ),
    layout(
        MAP_MAGLEV_REF,
        MAP_TYPE_HASH,
        size_of::<u32>(),
        size_of::<MaglevRef>(),
        1,
        None,
    ),
    layout(
        MAP_SOCK_REV_NAT,
        MAP_TYPE_LRU_HASH,
        size_of::<SockRevNatKey>(),
        size_of::<SockRevNatValue>(),
        1,
        Some(1),
    ),
    layout(
        MAP_SOCK_FWD,
        MAP_TYPE_LRU_HASH,
        size_of::<SockFwdKey>(),
        size_of::<SockFwdValue>(),
        1,
        Some(1),
    ),
    layout(
        MAP_SOCK_SENT,
        MAP_TYPE_LRU_HASH,
        size_of::<u64>(),
        size_of::<SockSentValue>(),
        1,
        Some(1),
    ),
    layout(
        MAP_CT,
        MAP_TYPE_LRU_HASH,
        size_of::<CtKey>(),
        size_of::<CtEntry>(),
        // 2: flows may lack their `RevDnat` entry (`ct::CT_F_NO_REV`), which builds before
        // it would not create; version-1 entries never carry the bit, so they are carried.
        2,
        Some(1),
    ),
    layout(
        MAP_NAT_CONFIG,
        MAP_TYPE_ARRAY,
        size_of::<u32>(),
        size_of::<NatConfig>(),
        1,
        None,
    ),
    layout(
        MAP_NODE_ADDR4,
        MAP_TYPE_HASH,
        size_of::<u32>(),
        size_of::<NodeAddr4>(),
        1,
        None,
    ),
    layout(
        MAP_TC_STATS,
        MAP_TYPE_PERCPU_ARRAY,
        size_of::<u32>(),
        size_of::<u64>(),
        1,
        None,
    ),
    layout(
        MAP_XDP_STATS,
        MAP_TYPE_PERCPU_ARRAY,
        size_of::<u32>(),
        size_of::<u64>(),
        // 2: the forwarding fast path's counters appended (eleven instead of two).
        2,
        None,
    ),
    layout(
        MAP_CT6,
        MAP_TYPE_LRU_HASH,
        size_of::<CtKey6>(),
        size_of::<CtEntry6>(),
        1,
        Some(1),
    ),
    layout(
        MAP_NODE_ADDR6,
        MAP_TYPE_HASH,
        size_of::<u32>(),
        size_of::<NodeAddr6>(),
        1,
        None,
    ),
    // Rewritten by the agent from the frontends at start (reused across restarts); a new
    // size or hash (`frontend_filter`) needs a new version: replaced, never carried.
    layout(
        MAP_FRONTEND_FILTER,
        MAP_TYPE_ARRAY,
        size_of::<u32>(),
        size_of::<u64>(),
        1,
        None,
    ),
];

impl MapLayout {
    /// A hash-like map (hash, LRU hash, LPM trie): its fill is a key count, and a probe may
    /// create it small.
    pub const fn is_keyed(&self) -> bool {
        matches!(
            self.map_type,
            MAP_TYPE_HASH | MAP_TYPE_LRU_HASH | MAP_TYPE_LPM_TRIE
        )
    }
}

/// The layout of map `name` in this build.
pub fn find(name: &str) -> Option<&'static MapLayout> {
    LAYOUTS.iter().find(|l| l.name == name)
}

// SAFETY: `#[repr(C)]`, `Copy`, four `u32`s: no padding, every bit pattern valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for LayoutRecord {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_fit_the_key() {
        for (i, l) in LAYOUTS.iter().enumerate() {
            assert!(l.name.len() < LAYOUT_NAME_LEN, "{}", l.name);
            assert!(LAYOUTS[..i].iter().all(|o| o.name != l.name), "{}", l.name);
            assert!(l.carry_from.is_none_or(|c| c <= l.version), "{}", l.name);
        }
        assert_eq!(&layout_key("KP_CT")[..6], b"KP_CT\0");
        assert_eq!(size_of::<LayoutRecord>(), 16);
    }
}
