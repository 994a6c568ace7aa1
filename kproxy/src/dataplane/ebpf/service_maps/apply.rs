//! The thin applier: makes the service maps hold a [`MapsPlan`], touching only what differs.
//!
//! It keeps a copy of what it believes the agent-written maps hold, seeded from a full dump
//! when it starts (so a restarted agent reconciles against the pinned maps instead of flushing
//! them), and per service port what it last programmed. One [`Applier::apply`]:
//!
//! 1. backends that are new or changed; the frontend filter's bits of every frontend about
//!    to be added ([`crate::dataplane::ebpf::service_maps::filter`]: before any frontend is written, so the node-device
//!    programs never skip one);
//! 2. per service port: its slots, source ranges and Maglev tables, then its frontends (so a
//!    frontend never
//!    points at a slot that is not there yet; a growing set gets its new slots before the
//!    larger `count`). A write that fails (e.g. a full map) fails that service port only: the
//!    frontends it had just added are removed again and it keeps what it had before;
//! 3. stale entries, in the reverse order: frontends, slots, source ranges and Maglev refs,
//!    backends; then the filter bits no frontend uses any more (deleted, or not written
//!    after all);
//! 4. affinity entries whose set is gone, whose backend left the set, or that expired.
//!
//! Affinity entries are written by the BPF programs; the applier only deletes.
//!
//! [`Applier::apply`] compares every service port and scans the whole cache for stale
//! entries (a full sync). [`Applier::apply_changes`] does the same steps for the changed
//! service ports only: it writes the backends they reference, their slots/tables/ranges and
//! frontends, and deletes as stale only entries their previous or new plan had and their
//! final plan lacks; a backend goes when no slot references it any more (slot references are
//! counted in the cache). The affinity map is dumped on every apply (one syscall when empty):
//! expired entries and those of gone sets always go, entries whose backend left the set only
//! for the changed service ports' sets (other sets did not change). Backends
//! that left every UDP service port (for [`crate::dataplane::ebpf::socket_lb::sock_destroy`]) come from counted references
//! of the UDP service ports' sets, so no sync walks every service.
//!
//! Maglev ([`SetPlan::maglev`](crate::dataplane::ebpf::service_maps::plan::SetPlan::maglev)): a set's table is built
//! ([`crate::dataplane::ebpf::service_maps::maglev::build`], from the backends' addresses) only when its backends differ from
//! the last build, i.e. only services whose backend set changed are rebuilt (after a restart
//! each table is rebuilt once, and writes nothing when the pinned one already matches). A new
//! set gets a free table, filled before its [`MaglevRef`] and before the frontends carrying
//! `SVC_F_MAGLEV`. A changed set's table is rewritten in place, entry by entry, only where it
//! differs: a reader meanwhile sees, per entry, the old or the new backend id, both in the
//! backends map (stale backends go in step 3), so only flows whose entry changes anyway can
//! see the old choice. No free table (`--bpf-map-sizes maglev=N`) fails that service port; a
//! table is freed in step 3 (after the frontends using it are gone), so it can be reused from
//! the next sync on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use kproxy_common::maglev::{MAP_MAGLEV, MAP_MAGLEV_REF, MaglevRef};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, MAP_AFFINITY, MAP_BACKEND_SLOTS,
    MAP_BACKENDS, MAP_SERVICES, MAP_SOURCE_RANGES, SOURCE_RANGE_ALLOW, SVC_F_AFFINITY, ServiceKey,
    ServiceValue, SlotValue,
};
use serde::Serialize;

use crate::dataplane::ebpf::service_maps::filter::FrontendFilter;
use crate::dataplane::ebpf::service_maps::ids::BackendAddr;
use crate::dataplane::ebpf::service_maps::plan::MapsPlan;
use crate::dataplane::ebpf::service_maps::plan::ServicePlan;
use crate::dataplane::ebpf::service_maps::plan::SourceRangeEntry;
use crate::dataplane::ebpf::service_maps::plan::decode_addr;
use crate::dataplane::ebpf::service_maps::plan::describe_key;
use crate::dataplane::ebpf::service_maps::tables::FilterStore;
use crate::dataplane::ebpf::service_maps::tables::MaglevStore;
use crate::dataplane::ebpf::service_maps::tables::Table;
use crate::dataplane::ebpf::service_maps::tables::TableError;
use crate::model::{Protocol, ServicePortName};

/// The maps the applier manages.
pub(crate) struct Tables {
    pub services: Box<dyn Table<ServiceKey, ServiceValue>>,
    pub slots: Box<dyn Table<BackendSlotKey, SlotValue>>,
    pub backends: Box<dyn Table<u32, BackendValue>>,
    pub source_ranges: Box<dyn Table<SourceRangeEntry, u8>>,
    pub affinity: Box<dyn Table<AffinityKey, AffinityValue>>,
    /// Set id → where its Maglev table is.
    pub maglev_refs: Box<dyn Table<u32, MaglevRef>>,
    /// The Maglev tables.
    pub maglev: Box<dyn MaglevStore>,
    /// The frontend filter's words (derived from `services`, see [`crate::dataplane::ebpf::service_maps::filter`]).
    pub filter: Box<dyn FilterStore>,
}

/// Fill level of one map (for metrics and `kproxy inspect`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MapPressure {
    pub map: &'static str,
    pub entries: usize,
    pub capacity: u32,
}

/// What one apply did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ApplyOutcome {
    /// Service ports that could not be (fully) programmed, with the reason.
    pub failed: BTreeMap<ServicePortName, String>,
    /// Service ports programmed.
    pub services: usize,
    /// Backends in the map after this apply.
    pub backends: usize,
    /// Map writes and deletes done.
    pub writes: usize,
    pub deletes: usize,
    /// Affinity entries deleted.
    pub affinity_deleted: usize,
    /// Maglev tables built (new or changed backend sets).
    pub maglev_rebuilt: usize,
    /// Backend ids deleted from the backends map.
    pub removed_backends: Vec<u32>,
    /// Backends that left every UDP service port (see [`crate::dataplane::ebpf::socket_lb::sock_destroy`]).
    pub removed_udp: Vec<std::net::SocketAddr>,
}

#[derive(Debug, Default)]
struct Cache {
    services: BTreeMap<ServiceKey, ServiceValue>,
    slots: BTreeMap<BackendSlotKey, SlotValue>,
    backends: BTreeMap<u32, BackendValue>,
    ranges: BTreeSet<SourceRangeEntry>,
    maglev_refs: BTreeMap<u32, MaglevRef>,
    /// Per set id, the `(address, id)` backends its table was last built from.
    maglev_built: BTreeMap<u32, Vec<(BackendAddr, u32)>>,
}

/// Applies plans to a set of [`Tables`].
pub(crate) struct Applier {
    tables: Tables,
    cache: Cache,
    /// The frontend filter of `cache.services` (and of frontends about to be written).
    filter: FrontendFilter,
    /// What each service port has in the maps (its last successfully applied plan).
    applied: BTreeMap<ServicePortName, Arc<ServicePlan>>,
    affinity_entries: usize,
    /// Slots in the cache pointing at each backend id.
    slot_refs: HashMap<u32, u32>,
    /// Slots of UDP service ports' sets in `applied` pointing at each backend id.
    udp_refs: HashMap<u32, u32>,
    /// Affinity timeout (ns) of every set an applied frontend with session affinity uses.
    affinity_timeouts: HashMap<u32, u64>,
    /// Service ports whose last apply failed, and those with any problem (with the reason).
    apply_failed: BTreeSet<ServicePortName>,
    failed: BTreeMap<ServicePortName, String>,
}

/// Decrements `id`'s count (removing it at zero); returns the count left.
fn dec(counts: &mut HashMap<u32, u32>, id: u32) -> u32 {
    match counts.get_mut(&id) {
        Some(n) if *n > 1 => {
            *n -= 1;
            *n
        }
        Some(_) => {
            counts.remove(&id);
            0
        }
        None => 0,
    }
}

fn backend_socket(b: &BackendValue) -> std::net::SocketAddr {
    std::net::SocketAddr::new(decode_addr(b.addr), u16::from_be(b.port))
}

/// Backend ids of the sets an owned frontend of `p` points at, once per slot.
fn udp_ids(p: &ServicePlan) -> impl Iterator<Item = u32> + '_ {
    let used: BTreeSet<u32> = p.frontends.values().map(|v| v.svc_id).collect();
    p.sets
        .iter()
        .filter(move |s| used.contains(&s.svc_id))
        .flat_map(|s| s.backends.iter().copied())
}

/// [`udp_ids`] counted over every UDP service port of `applied`.
fn udp_refs(applied: &BTreeMap<ServicePortName, Arc<ServicePlan>>) -> HashMap<u32, u32> {
    let mut refs = HashMap::new();
    for (name, p) in applied {
        if name.protocol == Protocol::Udp {
            for id in udp_ids(p) {
                *refs.entry(id).or_default() += 1;
            }
        }
    }
    refs
}

/// The slot keys of every set of `p`.
fn slot_keys(p: &ServicePlan) -> impl Iterator<Item = BackendSlotKey> + '_ {
    p.sets.iter().flat_map(|s| {
        (0..s.backends.len() as u32).map(move |slot| BackendSlotKey {
            svc_id: s.svc_id,
            slot,
        })
    })
}

/// The sets of `p` that have a Maglev table.
fn maglev_sets(p: &ServicePlan) -> impl Iterator<Item = u32> + '_ {
    p.sets
        .iter()
        .filter(|s| s.maglev && !s.backends.is_empty())
        .map(|s| s.svc_id)
}

/// The state one apply passes between its steps ([`Applier::apply_inner`]).
struct ApplyRun<'a> {
    plan: &'a MapsPlan,
    /// The service ports this apply compares (all of them in a full apply).
    names: &'a BTreeSet<ServicePortName>,
    full: bool,
    /// What each of `names` had in the maps before.
    olds: Vec<Option<Arc<ServicePlan>>>,
    /// What each of `names` has after step 2 (its plan, or the old one where it failed).
    finals: Vec<Option<Arc<ServicePlan>>>,
    /// The backends step 1 looked at.
    backend_ids: BTreeSet<u32>,
    /// Backends that could not be written, with the reason.
    failed_backends: BTreeMap<u32, String>,
    /// Frontends not in the maps before, given filter bits ahead of being written.
    adding: BTreeSet<ServiceKey>,
    /// Backends that left every UDP service port's slots in this apply.
    udp_dropped: BTreeMap<u32, std::net::SocketAddr>,
    out: ApplyOutcome,
}

/// The entries the service ports should have after an apply (step 3 keeps these).
struct Wanted {
    fronts: BTreeSet<ServiceKey>,
    slots: BTreeSet<BackendSlotKey>,
    ranges: BTreeSet<SourceRangeEntry>,
    maglev: BTreeSet<u32>,
}

impl Wanted {
    fn of(want: Vec<&Arc<ServicePlan>>) -> Self {
        Wanted {
            fronts: want
                .iter()
                .flat_map(|p| p.frontends.keys().copied())
                .collect(),
            slots: want.iter().flat_map(|p| slot_keys(p)).collect(),
            ranges: want
                .iter()
                .flat_map(|p| p.source_ranges.iter().copied())
                .collect(),
            maglev: want.iter().flat_map(|p| maglev_sets(p)).collect(),
        }
    }
}

impl Applier {
    /// Reads every agent-written map (the starting point of the diff).
    pub(crate) fn new(mut tables: Tables) -> Result<Self, TableError> {
        let (cache, slot_refs) = Self::read(&tables)?;
        let (filter, _) = FrontendFilter::new(cache.services.keys(), &mut *tables.filter);
        Ok(Applier {
            tables,
            cache,
            filter,
            applied: BTreeMap::new(),
            affinity_entries: 0,
            slot_refs,
            udp_refs: HashMap::new(),
            affinity_timeouts: HashMap::new(),
            apply_failed: BTreeSet::new(),
            failed: BTreeMap::new(),
        })
    }

    fn read(tables: &Tables) -> Result<(Cache, HashMap<u32, u32>), TableError> {
        let cache = Cache {
            services: tables.services.dump()?.into_iter().collect(),
            slots: tables.slots.dump()?.into_iter().collect(),
            backends: tables.backends.dump()?.into_iter().collect(),
            ranges: tables
                .source_ranges
                .dump()?
                .into_iter()
                .map(|(k, _)| k)
                .collect(),
            maglev_refs: tables.maglev_refs.dump()?.into_iter().collect(),
            maglev_built: BTreeMap::new(),
        };
        let mut slot_refs = HashMap::new();
        for s in cache.slots.values() {
            *slot_refs.entry(s.backend_id).or_default() += 1;
        }
        Ok((cache, slot_refs))
    }

    /// Re-reads every agent-written map into the cache (after a failed sync).
    pub(crate) fn reload(&mut self) -> Result<(), TableError> {
        let (mut cache, slot_refs) = Self::read(&self.tables)?;
        // The Maglev tables themselves were not re-read: what they were built from stands.
        cache.maglev_built = std::mem::take(&mut self.cache.maglev_built);
        (self.filter, _) = FrontendFilter::new(cache.services.keys(), &mut *self.tables.filter);
        self.cache = cache;
        self.slot_refs = slot_refs;
        Ok(())
    }

    /// Service ports with a problem after the last apply.
    pub(crate) fn failed_count(&self) -> usize {
        self.failed.len()
    }

    /// Frontends and backends found in the maps (to seed the id allocator after a restart).
    pub(crate) fn existing(
        &self,
    ) -> (
        &BTreeMap<ServiceKey, ServiceValue>,
        &BTreeMap<u32, BackendValue>,
    ) {
        (&self.cache.services, &self.cache.backends)
    }

    /// Backends some UDP frontend references, as the maps hold them now (see
    /// [`crate::dataplane::ebpf::socket_lb::sock_destroy`]).
    pub(crate) fn udp_backends(&self) -> BTreeSet<std::net::SocketAddr> {
        crate::dataplane::ebpf::socket_lb::sock_destroy::udp_backends(
            &self.cache.services,
            &self.cache.slots,
            &self.cache.backends,
        )
    }

    /// Entries and capacity of each map.
    pub(crate) fn pressure(&self) -> Vec<MapPressure> {
        vec![
            MapPressure {
                map: MAP_SERVICES,
                entries: self.cache.services.len(),
                capacity: self.tables.services.capacity(),
            },
            MapPressure {
                map: MAP_BACKEND_SLOTS,
                entries: self.cache.slots.len(),
                capacity: self.tables.slots.capacity(),
            },
            MapPressure {
                map: MAP_BACKENDS,
                entries: self.cache.backends.len(),
                capacity: self.tables.backends.capacity(),
            },
            MapPressure {
                map: MAP_SOURCE_RANGES,
                entries: self.cache.ranges.len(),
                capacity: self.tables.source_ranges.capacity(),
            },
            MapPressure {
                map: MAP_AFFINITY,
                entries: self.affinity_entries,
                capacity: self.tables.affinity.capacity(),
            },
            MapPressure {
                map: MAP_MAGLEV,
                entries: self.cache.maglev_refs.len() * self.tables.maglev.table_size() as usize,
                capacity: self.tables.maglev.entries(),
            },
            MapPressure {
                map: MAP_MAGLEV_REF,
                entries: self.cache.maglev_refs.len(),
                capacity: self.tables.maglev_refs.capacity(),
            },
        ]
    }

    /// Makes the maps hold `plan`, comparing every service port and scanning the whole cache
    /// for stale entries (see the module docs). `now_ns` is CLOCK_MONOTONIC (the BPF
    /// programs' `bpf_ktime_get_ns`), for affinity expiry. Errors only when a map cannot be
    /// read or an entry cannot be deleted; per-service write failures are in the outcome.
    pub(crate) fn apply(
        &mut self,
        plan: &MapsPlan,
        now_ns: u64,
    ) -> Result<ApplyOutcome, TableError> {
        let names: BTreeSet<ServicePortName> = plan
            .services
            .keys()
            .chain(self.applied.keys())
            .cloned()
            .collect();
        self.apply_inner(plan, &names, true, now_ns)
    }

    /// Makes the maps hold `plan` where it differs from the last apply only in the service
    /// ports `changed` (added, changed or removed): touches only their entries, the backends
    /// they reference or referenced, and their affinity entries (see the module docs).
    pub(crate) fn apply_changes(
        &mut self,
        plan: &MapsPlan,
        changed: &BTreeSet<ServicePortName>,
        now_ns: u64,
    ) -> Result<ApplyOutcome, TableError> {
        self.apply_inner(plan, changed, false, now_ns)
    }

    /// Service ports whose last apply failed (they keep what they had before).
    pub(crate) fn failing(&self) -> &BTreeSet<ServicePortName> {
        &self.apply_failed
    }

    fn cache_slot(&mut self, key: BackendSlotKey, value: SlotValue) {
        if let Some(old) = self.cache.slots.insert(key, value) {
            dec(&mut self.slot_refs, old.backend_id);
        }
        *self.slot_refs.entry(value.backend_id).or_default() += 1;
    }

    fn uncache_slot(&mut self, key: &BackendSlotKey) {
        if let Some(old) = self.cache.slots.remove(key) {
            dec(&mut self.slot_refs, old.backend_id);
        }
    }

    fn apply_inner(
        &mut self,
        plan: &MapsPlan,
        names: &BTreeSet<ServicePortName>,
        full: bool,
        now_ns: u64,
    ) -> Result<ApplyOutcome, TableError> {
        let udp_before = full.then(|| self.udp_backends());
        let mut run = ApplyRun {
            plan,
            names,
            full,
            olds: names.iter().map(|n| self.applied.get(n).cloned()).collect(),
            finals: Vec::with_capacity(names.len()),
            backend_ids: BTreeSet::new(),
            failed_backends: BTreeMap::new(),
            adding: BTreeSet::new(),
            udp_dropped: BTreeMap::new(),
            out: ApplyOutcome::default(),
        };
        // The order of the steps is the write order the datapath relies on (module docs).
        self.write_backends(&mut run)?;
        self.add_filter_bits(&mut run);
        self.apply_service_ports(&mut run);
        self.record_applied(&mut run);
        self.delete_stale(&mut run)?;
        run.out.removed_udp = match udp_before {
            Some(before) => {
                self.udp_refs = udp_refs(&self.applied);
                let after = self.udp_backends();
                before.difference(&after).copied().collect()
            }
            None => run
                .udp_dropped
                .iter()
                .filter(|(id, _)| self.udp_refs.get(id).is_none_or(|n| *n == 0))
                .map(|(_, a)| *a)
                .collect(),
        };
        self.clean_stale_affinity(&mut run, now_ns)?;

        let mut out = run.out;
        out.backends = self.cache.backends.len();
        let failing_applied = self
            .apply_failed
            .iter()
            .filter(|n| self.applied.contains_key(*n))
            .count();
        out.services = self.applied.len() - failing_applied;
        Ok(out)
    }

    /// Step 1. Backends: every one (full), or those the changed service ports reference;
    /// then the slots holding a copy of a backend whose value changed.
    fn write_backends(&mut self, run: &mut ApplyRun<'_>) -> Result<(), TableError> {
        let plan = run.plan;
        if run.full {
            run.backend_ids.extend(plan.backends.keys().copied());
        } else {
            for (name, old) in run.names.iter().zip(&run.olds) {
                if let Some(sp) = plan.services.get(name) {
                    run.backend_ids.extend(sp.backend_ids());
                }
                if let Some(old) = old {
                    run.backend_ids.extend(old.backend_ids());
                }
            }
        }
        let mut changed_values: BTreeSet<u32> = BTreeSet::new();
        // New entries go into the cache in one batch (see `extend_packed`).
        let mut added = Vec::new();
        for id in &run.backend_ids {
            let Some(value) = plan.backends.get(id) else {
                continue;
            };
            if self.cache.backends.get(id) == Some(value) {
                continue;
            }
            match self.tables.backends.put(id, value) {
                Ok(()) => {
                    match self.cache.backends.get_mut(id) {
                        Some(cached) => {
                            *cached = *value;
                            changed_values.insert(*id);
                        }
                        None => added.push((*id, *value)),
                    }
                    run.out.writes += 1;
                }
                Err(e) => {
                    run.failed_backends.insert(*id, e.to_string());
                }
            }
        }
        super::extend_packed(&mut self.cache.backends, added);
        self.recopy_slots(&changed_values, &mut run.out)
    }

    /// Slots hold a copy of their backend: where a backend's value changed, every slot
    /// holding it gets the new copy now, also in sets this apply does not otherwise touch.
    fn recopy_slots(
        &mut self,
        changed_values: &BTreeSet<u32>,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        if changed_values.is_empty() {
            return Ok(());
        }
        let recopy: Vec<(BackendSlotKey, SlotValue)> = self
            .cache
            .slots
            .iter()
            .filter(|(_, s)| changed_values.contains(&s.backend_id))
            .filter_map(|(k, s)| {
                let backend = *self.cache.backends.get(&s.backend_id)?;
                (s.backend != backend).then_some((
                    *k,
                    SlotValue {
                        backend_id: s.backend_id,
                        backend,
                    },
                ))
            })
            .collect();
        for (k, v) in recopy {
            self.tables.slots.put(&k, &v)?;
            self.cache_slot(k, v);
            out.writes += 1;
        }
        Ok(())
    }

    /// Frontends about to be written get their filter bits first (see
    /// `crate::dataplane::ebpf::service_maps::filter`); those not written after all are
    /// uncounted in [`Self::delete_stale_frontends`].
    fn add_filter_bits(&mut self, run: &mut ApplyRun<'_>) {
        run.adding = run
            .names
            .iter()
            .filter_map(|n| run.plan.services.get(n))
            .flat_map(|sp| sp.frontends.keys())
            .filter(|k| !self.cache.services.contains_key(k))
            .copied()
            .collect();
        for k in &run.adding {
            self.filter.add(k);
        }
        self.filter.flush(&mut *self.tables.filter);
    }

    /// Step 2. Per service port: slots, source ranges, frontends; fills `run.finals` with
    /// what each has in the maps now.
    fn apply_service_ports(&mut self, run: &mut ApplyRun<'_>) {
        // Slots not in the cache yet, cached in one batch at the end (see `extend_packed`;
        // a slot key belongs to one set, so no service port looks up another's).
        let mut new_slots = Vec::new();
        for (name, old) in run.names.iter().zip(&run.olds) {
            let Some(sp) = run.plan.services.get(name) else {
                self.apply_failed.remove(name);
                self.failed.remove(name);
                run.finals.push(None);
                continue;
            };
            let result = match sp.backend_ids().find_map(|id| run.failed_backends.get(&id)) {
                Some(err) => Err(err.clone()),
                None => self.apply_service(sp, run.plan, &mut new_slots, &mut run.out),
            };
            match result {
                Ok(()) => {
                    self.apply_failed.remove(name);
                    if sp.errors.is_empty() {
                        self.failed.remove(name);
                    } else {
                        let reason = sp.errors.join("; ");
                        run.out.failed.insert(name.clone(), reason.clone());
                        self.failed.insert(name.clone(), reason);
                    }
                    run.finals.push(Some(sp.clone()));
                }
                Err(reason) => {
                    tracing::error!(service = %name, "cannot program service port: {reason}");
                    run.out.failed.insert(name.clone(), reason.clone());
                    self.failed.insert(name.clone(), reason);
                    self.apply_failed.insert(name.clone());
                    run.finals.push(old.clone());
                }
            }
        }
        for (_, v) in &new_slots {
            *self.slot_refs.entry(v.backend_id).or_default() += 1;
        }
        super::extend_packed(&mut self.cache.slots, new_slots);
    }

    /// Records what each service port now has: `applied`, the UDP backend counts (noting
    /// backends that left every UDP service port) and the affinity timeouts.
    fn record_applied(&mut self, run: &mut ApplyRun<'_>) {
        for ((name, old), fin) in run.names.iter().zip(&run.olds).zip(&run.finals) {
            if name.protocol == Protocol::Udp {
                for id in old.iter().flat_map(|p| udp_ids(p)) {
                    if dec(&mut self.udp_refs, id) == 0
                        && let Some(b) = self.cache.backends.get(&id)
                    {
                        run.udp_dropped.insert(id, backend_socket(b));
                    }
                }
                for id in fin.iter().flat_map(|p| udp_ids(p)) {
                    *self.udp_refs.entry(id).or_default() += 1;
                }
            }
            for p in old.iter() {
                for v in p.frontends.values() {
                    self.affinity_timeouts.remove(&v.svc_id);
                }
            }
            for p in fin.iter() {
                for v in p.frontends.values() {
                    if v.flags & SVC_F_AFFINITY != 0 {
                        self.affinity_timeouts
                            .insert(v.svc_id, u64::from(v.affinity_timeout) * 1_000_000_000);
                    }
                }
            }
            match fin {
                Some(p) => self.applied.insert(name.clone(), p.clone()),
                None => self.applied.remove(name),
            };
        }
    }

    /// Step 3. Stale entries: anywhere in the cache (full), or among the entries the changed
    /// service ports had or were to get. Frontends first, then slots, source ranges, Maglev
    /// tables, and last the backends no slot points at.
    fn delete_stale(&mut self, run: &mut ApplyRun<'_>) -> Result<(), TableError> {
        let want = Wanted::of(if run.full {
            self.applied.values().collect()
        } else {
            run.finals.iter().flatten().collect()
        });
        let candidates: Vec<&ServicePlan> = if run.full {
            Vec::new()
        } else {
            run.names
                .iter()
                .zip(&run.olds)
                .flat_map(|(name, old)| {
                    old.iter()
                        .map(|p| &**p)
                        .chain(run.plan.services.get(name).map(|p| &**p))
                })
                .collect()
        };
        let out = &mut run.out;
        self.delete_stale_frontends(run.full, &candidates, &want, &run.adding, out)?;
        self.delete_stale_slots(run.full, &candidates, &want, out)?;
        self.delete_stale_ranges(run.full, &candidates, &want, out)?;
        self.delete_stale_maglev(run.full, &candidates, &want, out)?;
        self.delete_unreferenced_backends(run.full, &run.backend_ids, out)
    }

    fn delete_stale_frontends(
        &mut self,
        full: bool,
        candidates: &[&ServicePlan],
        want: &Wanted,
        adding: &BTreeSet<ServiceKey>,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let stale: Vec<ServiceKey> = if full {
            self.cache.services.keys().copied().collect()
        } else {
            candidates
                .iter()
                .flat_map(|p| p.frontends.keys().copied())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        for k in stale {
            if want.fronts.contains(&k) || !self.cache.services.contains_key(&k) {
                continue;
            }
            self.tables.services.delete(&k)?;
            self.cache.services.remove(&k);
            if !adding.contains(&k) {
                self.filter.remove(&k);
            }
            out.deletes += 1;
        }
        for k in adding
            .iter()
            .filter(|k| !self.cache.services.contains_key(k))
        {
            self.filter.remove(k);
        }
        self.filter.flush(&mut *self.tables.filter);
        Ok(())
    }

    fn delete_stale_slots(
        &mut self,
        full: bool,
        candidates: &[&ServicePlan],
        want: &Wanted,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let stale: Vec<BackendSlotKey> = if full {
            self.cache.slots.keys().copied().collect()
        } else {
            candidates.iter().flat_map(|p| slot_keys(p)).collect()
        };
        for k in stale {
            if want.slots.contains(&k) || !self.cache.slots.contains_key(&k) {
                continue;
            }
            self.tables.slots.delete(&k)?;
            self.uncache_slot(&k);
            out.deletes += 1;
        }
        Ok(())
    }

    fn delete_stale_ranges(
        &mut self,
        full: bool,
        candidates: &[&ServicePlan],
        want: &Wanted,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let stale: Vec<SourceRangeEntry> = if full {
            self.cache.ranges.iter().copied().collect()
        } else {
            candidates
                .iter()
                .flat_map(|p| p.source_ranges.iter().copied())
                .collect()
        };
        for k in stale {
            if want.ranges.contains(&k) || !self.cache.ranges.contains(&k) {
                continue;
            }
            self.tables.source_ranges.delete(&k)?;
            self.cache.ranges.remove(&k);
            out.deletes += 1;
        }
        Ok(())
    }

    fn delete_stale_maglev(
        &mut self,
        full: bool,
        candidates: &[&ServicePlan],
        want: &Wanted,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let stale: Vec<u32> = if full {
            self.cache.maglev_refs.keys().copied().collect()
        } else {
            candidates
                .iter()
                .flat_map(|p| p.sets.iter().map(|s| s.svc_id))
                .collect()
        };
        for k in stale {
            if want.maglev.contains(&k) || !self.cache.maglev_refs.contains_key(&k) {
                continue;
            }
            self.tables.maglev_refs.delete(&k)?;
            self.cache.maglev_refs.remove(&k);
            self.cache.maglev_built.remove(&k);
            out.deletes += 1;
        }
        Ok(())
    }

    /// Backends no remaining slot points at (a failed service's slots may already hold new
    /// backends).
    fn delete_unreferenced_backends(
        &mut self,
        full: bool,
        backend_ids: &BTreeSet<u32>,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let stale: Vec<u32> = if full {
            self.cache.backends.keys().copied().collect()
        } else {
            backend_ids.iter().copied().collect()
        };
        for k in stale {
            if self.slot_refs.get(&k).is_some_and(|n| *n > 0)
                || !self.cache.backends.contains_key(&k)
            {
                continue;
            }
            self.tables.backends.delete(&k)?;
            self.cache.backends.remove(&k);
            out.removed_backends.push(k);
            out.deletes += 1;
        }
        Ok(())
    }

    /// Step 4. Affinity: entries of sets that are gone or expired; for the sets of the
    /// changed service ports (all, in a full apply) also those whose backend left the set.
    fn clean_stale_affinity(
        &mut self,
        run: &mut ApplyRun<'_>,
        now_ns: u64,
    ) -> Result<(), TableError> {
        let checked: Vec<Arc<ServicePlan>> = if run.full {
            self.applied.values().cloned().collect()
        } else {
            run.finals.iter().flatten().cloned().collect()
        };
        let mut touched: BTreeSet<u32> = checked
            .iter()
            .flat_map(|p| p.sets.iter().map(|s| s.svc_id))
            .collect();
        touched.extend(
            run.olds
                .iter()
                .flatten()
                .flat_map(|p| p.sets.iter().map(|s| s.svc_id)),
        );
        let scope = if run.full { None } else { Some(&touched) };
        self.clean_affinity(&checked, scope, now_ns, &mut run.out)
    }

    /// Deletes affinity entries whose set is gone or that expired, and those of the sets in
    /// `members_of` (every set when `None`) whose backend left the set (`plans` hold those
    /// sets' current backends).
    fn clean_affinity(
        &mut self,
        plans: &[Arc<ServicePlan>],
        members_of: Option<&BTreeSet<u32>>,
        now_ns: u64,
        out: &mut ApplyOutcome,
    ) -> Result<(), TableError> {
        let mut members: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for p in plans {
            for s in &p.sets {
                members
                    .entry(s.svc_id)
                    .or_default()
                    .extend(s.backends.iter().copied());
            }
        }
        let entries = self.tables.affinity.dump()?;
        self.affinity_entries = entries.len();
        for (k, v) in entries {
            let checked = members_of.is_none_or(|m| m.contains(&k.svc_id));
            let keep = (!checked
                || members
                    .get(&k.svc_id)
                    .is_some_and(|m| m.contains(&v.backend_id)))
                && self
                    .affinity_timeouts
                    .get(&k.svc_id)
                    .is_some_and(|t| now_ns.saturating_sub(v.last_used_ns) <= *t);
            if !keep {
                self.tables.affinity.delete(&k)?;
                out.affinity_deleted += 1;
                self.affinity_entries -= 1;
            }
        }
        Ok(())
    }

    /// A ref that fits this build's table size and array (after a restart with another size the
    /// loader recreated the maps; this guards against anything else).
    fn valid_ref(&self, r: &MaglevRef) -> bool {
        let m = self.tables.maglev.table_size();
        r.size == m
            && r.base.is_multiple_of(m)
            && u64::from(r.base) + u64::from(m) <= u64::from(self.tables.maglev.entries())
    }

    /// Builds and writes the Maglev table of `set` if its backends changed (see the module
    /// docs), allocating a table for a new set.
    fn apply_maglev(
        &mut self,
        set: &crate::dataplane::ebpf::service_maps::plan::SetPlan,
        plan: &MapsPlan,
        out: &mut ApplyOutcome,
    ) -> Result<(), String> {
        if !set.maglev || set.backends.is_empty() {
            return Ok(());
        }
        let inputs: Vec<(BackendAddr, u32)> = set
            .backends
            .iter()
            .map(|id| {
                plan.backend_addr(*id)
                    .map(|a| (a, *id))
                    .ok_or_else(|| format!("backend {id} has no address in the plan"))
            })
            .collect::<Result<_, _>>()?;
        let current = self
            .cache
            .maglev_refs
            .get(&set.svc_id)
            .copied()
            .filter(|r| self.valid_ref(r));
        if current.is_some() && self.cache.maglev_built.get(&set.svc_id) == Some(&inputs) {
            return Ok(());
        }
        let m = self.tables.maglev.table_size();
        let r = match current {
            Some(r) => r,
            None => {
                let used: BTreeSet<u32> = self
                    .cache
                    .maglev_refs
                    .values()
                    .filter(|r| self.valid_ref(r))
                    .map(|r| r.base / m)
                    .collect();
                let tables = self.tables.maglev.tables();
                let index = (0..tables).find(|i| !used.contains(i)).ok_or_else(|| {
                    format!(
                        "Maglev table of set {}: all {tables} tables are in use (raise \
                         --bpf-map-sizes maglev=N)",
                        set.svc_id
                    )
                })?;
                MaglevRef {
                    base: index * m,
                    size: m,
                }
            }
        };
        let table = crate::dataplane::ebpf::service_maps::maglev::build(&inputs, m);
        let written = self
            .tables
            .maglev
            .write(r.base, &table)
            .map_err(|e| format!("Maglev table of set {}: {e}", set.svc_id))?;
        out.writes += written;
        if self.cache.maglev_refs.get(&set.svc_id) != Some(&r) {
            self.tables
                .maglev_refs
                .put(&set.svc_id, &r)
                .map_err(|e| format!("Maglev table of set {}: {e}", set.svc_id))?;
            self.cache.maglev_refs.insert(set.svc_id, r);
            out.writes += 1;
        }
        self.cache.maglev_built.insert(set.svc_id, inputs);
        out.maglev_rebuilt += 1;
        Ok(())
    }

    /// Writes one service port's slots (those new to the cache into `new_slots`), Maglev
    /// tables, source ranges and frontends.
    fn apply_service(
        &mut self,
        sp: &ServicePlan,
        plan: &MapsPlan,
        new_slots: &mut Vec<(BackendSlotKey, SlotValue)>,
        out: &mut ApplyOutcome,
    ) -> Result<(), String> {
        for set in &sp.sets {
            for (slot, id) in set.backends.iter().enumerate() {
                let key = BackendSlotKey {
                    svc_id: set.svc_id,
                    slot: slot as u32,
                };
                let Some(backend) = plan.backends.get(id) else {
                    return Err(format!(
                        "slot {slot} of set {}: backend {id} not planned",
                        set.svc_id
                    ));
                };
                let value = SlotValue {
                    backend_id: *id,
                    backend: *backend,
                };
                let cached = self.cache.slots.get(&key);
                if cached == Some(&value) {
                    continue;
                }
                let known = cached.is_some();
                self.tables
                    .slots
                    .put(&key, &value)
                    .map_err(|e| format!("slot {slot} of set {}: {e}", set.svc_id))?;
                if known {
                    self.cache_slot(key, value);
                } else {
                    new_slots.push((key, value));
                }
                out.writes += 1;
            }
        }
        for set in &sp.sets {
            self.apply_maglev(set, plan, out)?;
        }
        for range in &sp.source_ranges {
            if self.cache.ranges.contains(range) {
                continue;
            }
            self.tables
                .source_ranges
                .put(range, &SOURCE_RANGE_ALLOW)
                .map_err(|e| format!("source range of set {}: {e}", range.1.svc_id))?;
            self.cache.ranges.insert(*range);
            out.writes += 1;
        }
        // Frontends written so far with what they held before, to roll back on failure.
        let mut written: Vec<(ServiceKey, Option<ServiceValue>)> = Vec::new();
        for (key, value) in &sp.frontends {
            let old = self.cache.services.get(key).copied();
            if old == Some(*value) {
                continue;
            }
            if let Err(e) = self.tables.services.put(key, value) {
                // The service keeps exactly the frontends it had before this apply.
                for (k, before) in written.iter().rev() {
                    let restored = match before {
                        Some(v) => self.tables.services.put(k, v),
                        None => self.tables.services.delete(k),
                    };
                    if restored.is_ok() {
                        match before {
                            Some(v) => self.cache.services.insert(*k, *v),
                            None => self.cache.services.remove(k),
                        };
                    }
                }
                return Err(format!("frontend {}: {e}", describe_key(key)));
            }
            written.push((*key, old));
            self.cache.services.insert(*key, *value);
            out.writes += 1;
        }
        Ok(())
    }
}
