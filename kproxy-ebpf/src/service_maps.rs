//! The service maps (`kproxy_common::service`), declared once for every program of the object:
//! socket LB ([`crate::sock`]) and the TC programs read them through these statics. All are
//! pinned by name (`<bpffs>/kproxy/<NAME>`) so a restarted agent and every program share them.
//! Sizes here are defaults; the agent sets the real `max_entries` at load time.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, LpmTrie, LruHashMap},
};
use kproxy_common::frontend_filter::{FILTER_MAP_FLAGS, FILTER_WORDS};
use kproxy_common::maglev::{
    DEFAULT_MAGLEV_ENTRIES, DEFAULT_MAGLEV_REF_MAX, IDS_PER_ELEM, MAGLEV_MAP_FLAGS, MaglevRef,
    flow_hash,
};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, DEFAULT_AFFINITY_MAX,
    DEFAULT_BACKEND_SLOTS_MAX, DEFAULT_BACKENDS_MAX, DEFAULT_SERVICES_MAX, DEFAULT_SOCK_FWD_MAX,
    DEFAULT_SOCK_REV_NAT_MAX, DEFAULT_SOCK_SENT_MAX, DEFAULT_SOURCE_RANGES_MAX, ServiceKey,
    ServiceValue, SlotValue, SockFwdKey, SockFwdValue, SockRevNatKey, SockRevNatValue,
    SockSentValue, SourceRangeKey,
};

/// `kproxy_common::service::MAP_SERVICES`.
#[map]
pub(crate) static KP_SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

/// `kproxy_common::frontend_filter::MAP_FRONTEND_FILTER`.
#[allow(dead_code)] // read by the node-device programs only
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
#[allow(dead_code)] // read by the TC programs only
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
static KP_MAGLEV: Array<[u32; IDS_PER_ELEM as usize]> =
    Array::pinned(DEFAULT_MAGLEV_ENTRIES, MAGLEV_MAP_FLAGS);

/// `kproxy_common::maglev::MAP_MAGLEV_REF`.
#[map]
static KP_MAGLEV_REF: HashMap<u32, MaglevRef> = HashMap::pinned(DEFAULT_MAGLEV_REF_MAX, 0);

/// The backend id the Maglev table of set `svc_id` gives an IPv4 5-tuple (network order), or
/// `None` when the set has no table yet (the caller falls back to a random slot). See
/// `kproxy_common::maglev`.
#[allow(dead_code)] // used by the TC programs only
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
