//! Every map of the agent's object, declared once: the service maps (`kproxy_common::service`,
//! read by socket LB and the node-device programs alike), the connection tables and NAT state
//! of the node-device path (`kproxy_common::ct`, `ct6`), its counters, the XDP fast path's
//! device list and forwarding caches, and the per-CPU scratch the programs keep private.
//! Names, key and value types and sizes are `kproxy-common`'s (`kproxy_common::layout` lists
//! the pinned ones); a map's Rust name is its object name.
//!
//! Pinned maps (`<bpffs>/kproxy/<NAME>`) are shared by every program and survive a restart of
//! the agent; their sizes here are defaults, the agent sets the real `max_entries` at load
//! time. Unpinned ones are private to each loaded instance of the object. The bench object's
//! own maps (`KP_PKT_COUNT`, `KP_FLOOR_CT`) stay with their programs ([`crate`]'s `bench.rs`),
//! so the agent's object never carries them.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap, PerCpuArray},
};
use kproxy_common::ct::{
    BACKEND_FWD_ENTRIES, BackendFwd, CtEntry, CtKey, DEFAULT_CT_ENTRIES, FWD_GEN_WORDS,
    NODE_ADDR_ENTRIES, NatConfig, NodeAddr4, TC_STATS, XDP_FWD_DEVS_MAX, XDP_STATS,
};
use kproxy_common::ct6::{CtEntry6, CtKey6, NodeAddr6};
use kproxy_common::frontend_filter::{FILTER_MAP_FLAGS, FILTER_WORDS};
use kproxy_common::maglev::{
    DEFAULT_MAGLEV_ENTRIES, DEFAULT_MAGLEV_REF_MAX, IDS_PER_ELEM, MAGLEV_MAP_FLAGS, MaglevRef,
};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, DEFAULT_AFFINITY_MAX,
    DEFAULT_BACKEND_SLOTS_MAX, DEFAULT_BACKENDS_MAX, DEFAULT_SERVICES_MAX, DEFAULT_SOCK_FWD_MAX,
    DEFAULT_SOCK_REV_NAT_MAX, DEFAULT_SOCK_SENT_MAX, DEFAULT_SOURCE_RANGES_MAX, ServiceKey,
    ServiceValue, SlotValue, SockFwdKey, SockFwdValue, SockRevNatKey, SockRevNatValue,
    SockSentValue, SourceRangeKey,
};

use crate::family::{V4, V6};
use crate::flow::{CoarseClock, PortSearch};

// ---- service maps (socket LB and the node-device programs) --------------------------------

/// `kproxy_common::service::MAP_SERVICES`.
#[map]
pub(crate) static KP_SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

/// `kproxy_common::frontend_filter::MAP_FRONTEND_FILTER`.
#[map]
pub(crate) static KP_FE_FILTER: Array<u64> = Array::pinned(FILTER_WORDS, FILTER_MAP_FLAGS);

/// `kproxy_common::service::MAP_BACKEND_SLOTS`.
#[map]
pub(crate) static KP_BE_SLOTS: HashMap<BackendSlotKey, SlotValue> =
    HashMap::pinned(DEFAULT_BACKEND_SLOTS_MAX, 0);

/// `kproxy_common::service::MAP_BACKENDS`.
#[map]
pub(crate) static KP_BACKENDS: HashMap<u32, BackendValue> =
    HashMap::pinned(DEFAULT_BACKENDS_MAX, 0);

/// `kproxy_common::service::MAP_AFFINITY`.
#[map]
pub(crate) static KP_AFFINITY: LruHashMap<AffinityKey, AffinityValue> =
    LruHashMap::pinned(DEFAULT_AFFINITY_MAX, 0);

/// `kproxy_common::service::MAP_SOURCE_RANGES`.
#[map]
pub(crate) static KP_SRC_RANGES: LpmTrie<SourceRangeKey, u8> =
    LpmTrie::pinned(DEFAULT_SOURCE_RANGES_MAX, 0);

/// `kproxy_common::service::MAP_SOCK_REV_NAT`.
#[map]
pub(crate) static KP_SOCK_RNAT: LruHashMap<SockRevNatKey, SockRevNatValue> =
    LruHashMap::pinned(DEFAULT_SOCK_REV_NAT_MAX, 0);

/// `kproxy_common::service::MAP_SOCK_FWD`.
#[map]
pub(crate) static KP_SOCK_FWD: LruHashMap<SockFwdKey, SockFwdValue> =
    LruHashMap::pinned(DEFAULT_SOCK_FWD_MAX, 0);

/// `kproxy_common::service::MAP_SOCK_SENT`.
#[map]
pub(crate) static KP_SOCK_SENT: LruHashMap<u64, SockSentValue> =
    LruHashMap::pinned(DEFAULT_SOCK_SENT_MAX, 0);

/// `kproxy_common::maglev::MAP_MAGLEV`.
#[map]
pub(crate) static KP_MAGLEV: Array<[u32; IDS_PER_ELEM as usize]> =
    Array::pinned(DEFAULT_MAGLEV_ENTRIES, MAGLEV_MAP_FLAGS);

/// `kproxy_common::maglev::MAP_MAGLEV_REF`.
#[map]
pub(crate) static KP_MAGLEV_REF: HashMap<u32, MaglevRef> =
    HashMap::pinned(DEFAULT_MAGLEV_REF_MAX, 0);

// ---- connection tracking and NAT of the node-device path (TC and XDP) ---------------------

/// `kproxy_common::ct::MAP_CT`: the IPv4 connection table.
#[map]
pub(crate) static KP_CT: LruHashMap<CtKey, CtEntry> = LruHashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// `kproxy_common::ct6::MAP_CT6`: the IPv6 connection table.
#[map]
pub(crate) static KP_CT6: LruHashMap<CtKey6, CtEntry6> = LruHashMap::pinned(DEFAULT_CT_ENTRIES, 0);

/// `kproxy_common::ct::MAP_NAT_CONFIG`: the SNAT port range (both families).
#[map]
pub(crate) static KP_NAT_CFG: Array<NatConfig> = Array::pinned(1, 0);

/// `kproxy_common::ct::MAP_NODE_ADDR4`: the IPv4 SNAT source per device.
#[map]
pub(crate) static KP_NODE_ADDR4: HashMap<u32, NodeAddr4> = HashMap::pinned(NODE_ADDR_ENTRIES, 0);

/// `kproxy_common::ct6::MAP_NODE_ADDR6`: the IPv6 SNAT source per device.
#[map]
pub(crate) static KP_NODE_ADDR6: HashMap<u32, NodeAddr6> = HashMap::pinned(NODE_ADDR_ENTRIES, 0);

// ---- counters -------------------------------------------------------------------------------

/// `kproxy_common::ct::MAP_TC_STATS` (both families' TC programs).
#[map]
pub(crate) static KP_TC_STATS: PerCpuArray<u64> = PerCpuArray::pinned(TC_STATS, 0);

/// `kproxy_common::ct::MAP_XDP_STATS`.
#[map]
pub(crate) static KP_XDP_STATS: PerCpuArray<u64> = PerCpuArray::pinned(XDP_STATS, 0);

// ---- the XDP fast path (not pinned: the agent writes them when it attaches) ---------------

/// `kproxy_common::ct::MAP_XDP_FWD_DEVS`: the devices frames may come from and leave through
/// on the fast path, an array indexed by ifindex. An array lookup is a bounds check and an
/// address computation the verifier inlines; devices with an ifindex beyond it are never
/// fast-path devices.
#[map]
pub(crate) static KP_XDP_FWD_DEVS: Array<u32> = Array::with_max_entries(XDP_FWD_DEVS_MAX, 0);

/// `kproxy_common::ct::MAP_FWD_GEN`: the generation forwarding caches must match
/// ([`crate::xdp_fwd`]), and whether new flows may use the per-backend cache; written by the
/// agent, 0 (never written) = no caching.
#[map]
pub(crate) static KP_FWD_GEN: Array<u32> = Array::with_max_entries(FWD_GEN_WORDS, 0);

/// `kproxy_common::ct::MAP_BACKEND_FWD`: new flows' forwarding results per backend
/// ([`crate::xdp_fwd`]), per CPU.
#[map]
pub(crate) static KP_BE_FWD: PerCpuArray<BackendFwd> =
    PerCpuArray::with_max_entries(BACKEND_FWD_ENTRIES, 0);

// ---- per-CPU scratch (private to each loaded instance; not pinned, not in `kproxy-common`) --

/// [`crate::flow::now_coarse`]'s cache.
#[map]
pub(crate) static KP_CLOCK: PerCpuArray<CoarseClock> = PerCpuArray::with_max_entries(1, 0);

/// [`crate::family::Family::port_search`] of IPv4.
#[map]
pub(crate) static KP_PORT_SEARCH4: PerCpuArray<PortSearch<V4>> =
    PerCpuArray::with_max_entries(1, 0);

/// [`crate::family::Family::port_search`] of IPv6.
#[map]
pub(crate) static KP_PORT_SEARCH6: PerCpuArray<PortSearch<V6>> =
    PerCpuArray::with_max_entries(1, 0);
