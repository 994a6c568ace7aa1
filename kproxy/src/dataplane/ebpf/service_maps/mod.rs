//! The service maps programmed from snapshots, and the socket-LB programs that read them.
//!
//! - [`plan`](mod@plan) (pure): [`Snapshot`] + [`ServiceMapsConfig`] → [`plan::MapsPlan`], the exact entries
//!   of the service maps (`kproxy_common::service` documents the layout and who reads what);
//!   [`render`] prints it (`kproxy render --proxy-mode ebpf`).
//! - `ids`: stable backend and set ids across syncs and restarts.
//! - [`maglev`] (pure): the Maglev table of a set (`--bpf-lb-algorithm maglev`).
//! - `apply`: diffs a plan against the maps and writes backends → slots → frontends →
//!   deletes stale, failing only the service port whose write failed.
//! - `filter` (pure): the frontend filter's bits, kept in step with the frontends so the
//!   node-device programs skip service-map lookups that would miss.
//! - `tables`: one map as the applier sees it (kernel or in-memory).
//!
//! [`ServiceMaps`] ties them together with the loaded object (`loader`: pins, the
//! socket-LB links) and UDP socket destruction (`super::socket_lb::sock_destroy`). It is a
//! [`Dataplane`] of its own (socket LB without the node path, as some tests run it); the mode's
//! `Dataplane` is [`super::EbpfDataplane`], which adds the TC/XDP node path reading the same
//! maps.
//!
//! ## Incremental syncs
//!
//! A sync costs O(changed service ports), not O(all): with 10k service ports one endpoint
//! change re-plans and writes one service port.
//!
//! - What is cached: the `Planner` keeps the current [`MapsPlan`] per service port (each
//!   [`plan::ServicePlan`] remembers the `Arc`s of the snapshot parts it was made from), who
//!   claims which frontend, and how many slots reference each backend; the `Applier` keeps
//!   what it believes the agent-written maps hold (it is their only writer) and the plan each
//!   service port has in them.
//! - Which service ports are re-planned: the `changed` set when the snapshot is the tracker's
//!   next one (`generation` = last synced + 1, so the set covers everything since); otherwise
//!   (a caller building snapshots itself) those whose `Arc`s or values differ from what was
//!   planned (`Planner::changed_in`); plus every service port whose last apply failed. A
//!   frontend that changes owner (two service ports want it; the first by name gets it)
//!   re-plans every claimant.
//! - Full syncs (every service port re-planned, every cached entry compared, stale entries
//!   found by scanning the cache): the first sync, the sync after a failed one (the cache is
//!   first re-read from the maps), a change of the node (labels, addresses) or of the
//!   NodePort addresses or configuration, and at least once per `syncPeriod`
//!   ([`ServiceMapsConfig::full_sync_period`]), as upstream's proxiers resync periodically. The maps
//!   are also re-read before a full sync when the last read is older than
//!   `MAP_REREAD_PERIOD`.
//! - Why readers never see a half-programmed service: an incremental apply writes the changed
//!   service ports' entries in the same order as a full one (backends → slots, Maglev tables,
//!   source ranges → frontends → stale entries), so a frontend only ever points at a complete
//!   set; stale entries are only those the changed service ports had and no longer have.

pub(crate) mod apply;
pub(crate) mod filter;
pub(crate) mod ids;
pub(crate) mod loader;
pub mod maglev;
pub mod plan;
pub(crate) mod tables;
#[cfg(test)]
mod tests;

use std::net::IpAddr;
use std::path::PathBuf;

use kproxy_common::service::{
    DEFAULT_AFFINITY_MAX, DEFAULT_BACKEND_SLOTS_MAX, DEFAULT_BACKENDS_MAX, DEFAULT_SERVICES_MAX,
    DEFAULT_SOCK_REV_NAT_MAX, DEFAULT_SOURCE_RANGES_MAX,
};

pub(crate) use apply::{Applier, ApplyOutcome, MapPressure};
use plan::Planner;
pub use plan::{MapsPlan, render};

use crate::dataplane::ebpf::socket_lb::sock_destroy;
use crate::dataplane::ebpf::{layout, pins};
use crate::dataplane::{CleanupError, Dataplane, ProxyMode, SyncError, SyncReport};
use std::collections::{BTreeMap, BTreeSet};

use crate::model::{ChangedSet, IpFamily, ServicePortName, Snapshot};

/// `max_entries` of each service map (`--bpf-map-sizes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapSizes {
    pub services: u32,
    pub backend_slots: u32,
    pub backends: u32,
    pub affinity: u32,
    pub source_ranges: u32,
    /// Socket-LB per-socket maps (`KP_SOCK_RNAT`, `KP_SOCK_FWD` and `KP_SOCK_SENT`, LRU).
    pub sock_rev_nat: u32,
    /// Maglev tables (`--bpf-map-sizes maglev=N`, maglev mode only): `KP_MAGLEV` holds
    /// `N × table size` entries, `KP_MAGLEV_REF` `N`.
    pub maglev: u32,
    /// Each TC connection table, `KP_CT` and `KP_CT6` (`bpf.mapSizes.ct`). The socket-LB
    /// object loads and pins them first, so this is where their size is set; a later TC
    /// object ([`crate::dataplane::ebpf::node_path`]) reuses the pins.
    pub ct: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            services: DEFAULT_SERVICES_MAX,
            backend_slots: DEFAULT_BACKEND_SLOTS_MAX,
            backends: DEFAULT_BACKENDS_MAX,
            affinity: DEFAULT_AFFINITY_MAX,
            source_ranges: DEFAULT_SOURCE_RANGES_MAX,
            sock_rev_nat: DEFAULT_SOCK_REV_NAT_MAX,
            maglev: kproxy_common::maglev::DEFAULT_MAGLEV_TABLES,
            ct: kproxy_common::ct::DEFAULT_CT_ENTRIES,
        }
    }
}

pub use crate::dataplane::settings::LbAlgorithm;

/// What the eBPF datapath needs from the resolved configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceMapsConfig {
    /// Addresses NodePorts are programmed on (`--nodeport-addresses` resolved to this node's
    /// addresses). Empty: the Node object's addresses from the snapshot.
    pub node_addresses: Vec<IpAddr>,
    /// IP families to program (the node's families; both for dual-stack).
    pub families: Vec<IpFamily>,
    pub map_sizes: MapSizes,
    pub lb_algorithm: LbAlgorithm,
    /// Entries per Maglev table (`--bpf-lb-maglev-table-size`, a prime).
    pub maglev_table_size: u32,
    /// bpffs mount (`--bpffs`, default `/sys/fs/bpf`, mounted if absent); pins go to
    /// `<bpffs>/kproxy/`.
    pub bpffs: PathBuf,
    /// cgroup v2 directory socket LB attaches to (`--bpf-cgroup`); `None`: the cgroup2 root.
    pub cgroup: Option<PathBuf>,
    /// Attach the socket-LB programs (off: maps only, e.g. when only TC is wanted).
    pub socket_lb: bool,
    /// A sync re-plans every service port and compares every cached entry at least this often
    /// (`syncPeriod`); the syncs in between touch only the changed service ports.
    pub full_sync_period: std::time::Duration,
}

impl Default for ServiceMapsConfig {
    fn default() -> Self {
        ServiceMapsConfig {
            node_addresses: Vec::new(),
            families: vec![IpFamily::V4, IpFamily::V6],
            map_sizes: MapSizes::default(),
            lb_algorithm: LbAlgorithm::Random,
            maglev_table_size: kproxy_common::maglev::DEFAULT_TABLE_SIZE,
            bpffs: PathBuf::from("/sys/fs/bpf"),
            cgroup: None,
            socket_lb: true,
            full_sync_period: std::time::Duration::from_secs(30),
        }
    }
}

/// A full sync re-reads the maps into the applier's cache when its last read is older than
/// this (the agent is the maps' only writer; this only bounds how long an outside edit lasts).
pub(crate) const MAP_REREAD_PERIOD: std::time::Duration = std::time::Duration::from_secs(3600);

/// CLOCK_MONOTONIC in ns, the clock of `bpf_ktime_get_ns`.
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Inserts `batch` into `map`. A batch at least a quarter of the map's size is sorted and
/// merged in one pass ([`BTreeMap::append`]), which leaves the tree's nodes full; inserting
/// keys in ascending order one by one (a first sync: ids are handed out in order) leaves every
/// node about half full, i.e. nearly twice the memory for the agent's largest caches.
pub(crate) fn extend_packed<K: Ord, V>(map: &mut BTreeMap<K, V>, batch: Vec<(K, V)>) {
    if batch.len() < 16 || batch.len() < map.len() / 4 {
        map.extend(batch);
        return;
    }
    // `collect` sorts (stably: a key given twice keeps its last value, as inserts would) and
    // builds full nodes; `append` merges into full nodes too.
    let mut other: BTreeMap<K, V> = batch.into_iter().collect();
    map.append(&mut other);
}

/// Removes everything the eBPF datapath pinned under `<bpffs>/kproxy/` (socket-LB links first,
/// which detaches them, then the maps) without loading anything: `kproxy cleanup`. A missing
/// directory is not an error.
pub(crate) fn cleanup_pins(bpffs: &std::path::Path) -> Result<(), CleanupError> {
    let dir = bpffs.join("kproxy");
    pins::remove_pins(&dir).map_err(|e| CleanupError {
        mode: ProxyMode::Ebpf,
        reason: format!("removing {}: {e}", dir.display()),
    })
}

/// The service maps and socket LB as a [`Dataplane`] (see the module docs).
pub struct ServiceMaps {
    cfg: ServiceMapsConfig,
    planner: Planner,
    applier: Applier,
    kernel: loader::Kernel,
    sock_destroyer: sock_destroy::SockDestroyer,
    /// Generation of the last snapshot synced successfully (`None`: none yet, or the last
    /// sync failed).
    synced: Option<u64>,
    /// The applier's cache must be re-read from the maps before the next (full) sync.
    reload: bool,
    /// When the last full sync ran.
    last_full: Option<std::time::Instant>,
    /// When the maps were last read into the applier's cache.
    last_read: std::time::Instant,
    /// Backend ids the last sync deleted from the backends map.
    removed_backends: Vec<u32>,
}

impl ServiceMaps {
    /// Mounts bpffs if needed, loads the object reusing pinned maps and links, attaches socket
    /// LB and reads the maps' current content (a restart reconciles, nothing is flushed).
    pub fn new(cfg: ServiceMapsConfig) -> Result<Self, loader::LoaderError> {
        let (kernel, tables) = loader::load(&cfg)?;
        let applier = Applier::new(tables)?;
        let mut ids = ids::IdAllocator::new();
        let (services, backends) = applier.existing();
        for (key, value) in services {
            ids.hint_set(*key, value.svc_id);
        }
        for (id, b) in backends {
            ids.seed_backend((plan::decode_addr(b.addr), u16::from_be(b.port)), *id);
        }
        let sock_destroyer = sock_destroy::SockDestroyer::new(
            &pins::pin_dir(&cfg.bpffs).join(kproxy_common::service::MAP_SOCK_REV_NAT),
        );
        Ok(ServiceMaps {
            cfg,
            planner: Planner::new(ids),
            applier,
            kernel,
            sock_destroyer,
            synced: None,
            reload: false,
            last_full: None,
            last_read: std::time::Instant::now(),
            removed_backends: Vec::new(),
        })
    }

    /// Backend ids the last sync deleted from the backends map (their connection-table
    /// entries can go).
    pub(crate) fn removed_backends(&self) -> &[u32] {
        &self.removed_backends
    }

    /// `(program, link id)` of the attached socket-LB links.
    pub fn link_ids(&self) -> &[(&'static str, u32)] {
        &self.kernel.links
    }

    /// What was done at start with the maps a previous agent pinned.
    pub fn layout_report(&self) -> &layout::LayoutReport {
        &self.kernel.layout
    }

    /// Entries and capacity of each service map.
    pub fn map_pressure(&self) -> Vec<MapPressure> {
        self.applier.pressure()
    }

    /// The plan of the last sync.
    pub fn last_plan(&self) -> &MapsPlan {
        self.planner.plan()
    }

    /// The configuration this datapath runs with.
    pub fn config(&self) -> &ServiceMapsConfig {
        &self.cfg
    }

    /// Replaces the addresses NodePorts are programmed on (the node's addresses changed);
    /// takes effect at the next sync.
    pub(crate) fn set_node_addresses(&mut self, addrs: Vec<IpAddr>) {
        self.cfg.node_addresses = addrs;
    }
}

impl ServiceMaps {
    /// Re-plans everything and applies it comparing with every cached entry; first re-reads
    /// the maps when a failed sync left the cache in doubt.
    fn sync_full(&mut self, snap: &Snapshot) -> Result<ApplyOutcome, tables::TableError> {
        if self.reload || self.last_read.elapsed() >= MAP_REREAD_PERIOD {
            self.applier.reload()?;
            self.reload = false;
            self.last_read = std::time::Instant::now();
        }
        self.planner.full(snap, &self.cfg);
        self.applier.apply(self.planner.plan(), monotonic_ns())
    }
}

impl Dataplane for ServiceMaps {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn sync(&mut self, snap: &Snapshot, changed: &ChangedSet) -> Result<SyncReport, SyncError> {
        let now = std::time::Instant::now();
        let periodic = self
            .last_full
            .is_none_or(|t| now.duration_since(t) >= self.cfg.full_sync_period);
        let full = periodic
            || self.synced.is_none()
            || changed.node
            || self.planner.needs_full(snap, &self.cfg);
        let result = if full {
            self.sync_full(snap)
        } else {
            let mut dirty: BTreeSet<ServicePortName> = if self
                .synced
                .is_some_and(|g| snap.generation == g.wrapping_add(1))
            {
                changed.services.clone()
            } else {
                // Not the tracker's next snapshot (a test, a caller of its own): find the
                // changed service ports by comparing with what was planned.
                self.planner.changed_in(snap)
            };
            dirty.extend(self.applier.failing().iter().cloned());
            let changed = self.planner.update(snap, &self.cfg, &dirty);
            self.applier
                .apply_changes(self.planner.plan(), &changed, monotonic_ns())
        };
        let outcome = match result {
            Ok(o) => o,
            Err(e) => {
                self.synced = None;
                self.reload = true;
                return Err(SyncError::Kernel(e.to_string()));
            }
        };
        if full {
            self.last_full = Some(now);
        }
        self.synced = Some(snap.generation);
        if self.cfg.socket_lb {
            self.sock_destroyer.destroy(&outcome.removed_udp);
        }
        for (name, reason) in &outcome.failed {
            tracing::warn!(service = %name, "{reason}");
        }
        tracing::debug!(
            full,
            writes = outcome.writes,
            deletes = outcome.deletes,
            affinity_deleted = outcome.affinity_deleted,
            took_us = now.elapsed().as_micros() as u64,
            "eBPF service maps synced"
        );
        self.removed_backends = outcome.removed_backends;
        Ok(SyncReport {
            services: outcome.services,
            endpoints: outcome.backends,
            failed_services: self.applier.failed_count(),
        })
    }

    fn cleanup(&mut self) -> Result<(), CleanupError> {
        self.kernel.cleanup().map_err(|e| CleanupError {
            mode: ProxyMode::Ebpf,
            reason: format!("removing {}: {e}", pins::pin_dir(&self.cfg.bpffs).display()),
        })
    }
}
