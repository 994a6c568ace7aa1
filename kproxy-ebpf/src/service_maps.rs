//! The service maps (`kproxy_common::service`), declared once for every program of the object:
//! socket LB ([`crate::sock`]) and the TC programs read them through these statics. All are
//! pinned by name (`<bpffs>/kproxy/<NAME>`) so a restarted agent and every program share them.
//! Sizes here are defaults; the agent sets the real `max_entries` at load time.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LpmTrie, LruHashMap},
};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, DEFAULT_AFFINITY_MAX,
    DEFAULT_BACKEND_SLOTS_MAX, DEFAULT_BACKENDS_MAX, DEFAULT_SERVICES_MAX, DEFAULT_SOCK_FWD_MAX,
    DEFAULT_SOCK_REV_NAT_MAX, DEFAULT_SOURCE_RANGES_MAX, ServiceKey, ServiceValue, SockFwdKey,
    SockFwdValue, SockRevNatKey, SockRevNatValue, SourceRangeKey,
};

/// `kproxy_common::service::MAP_SERVICES`.
#[map]
pub(crate) static KP_SERVICES: HashMap<ServiceKey, ServiceValue> =
    HashMap::pinned(DEFAULT_SERVICES_MAX, 0);

/// `kproxy_common::service::MAP_BACKEND_SLOTS`.
#[map]
pub(crate) static KP_BE_SLOTS: HashMap<BackendSlotKey, u32> =
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
