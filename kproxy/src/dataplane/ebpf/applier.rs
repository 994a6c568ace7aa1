//! The thin applier: makes the service maps hold a [`Plan`], touching only what differs.
//!
//! It keeps a copy of what it believes the agent-written maps hold, seeded from a full dump
//! when it starts (so a restarted agent reconciles against the pinned maps instead of flushing
//! them), and per service port what it last programmed. One [`Applier::apply`]:
//!
//! 1. backends that are new or changed;
//! 2. per service port: its slots, source ranges and Maglev tables, then its frontends (so a
//!    frontend never
//!    points at a slot that is not there yet; a growing set gets its new slots before the
//!    larger `count`). A write that fails (e.g. a full map) fails that service port only: the
//!    frontends it had just added are removed again and it keeps what it had before;
//! 3. stale entries, in the reverse order: frontends, slots, source ranges and Maglev refs,
//!    backends;
//! 4. affinity entries whose set is gone, whose backend left the set, or that expired.
//!
//! Affinity entries are written by the BPF programs; the applier only deletes.
//!
//! Maglev ([`SetPlan::maglev`](super::planner::SetPlan::maglev)): a set's table is built
//! ([`super::maglev::build`], from the backends' addresses) only when its backends differ from
//! the last build, i.e. only services whose backend set changed are rebuilt (after a restart
//! each table is rebuilt once, and writes nothing when the pinned one already matches). A new
//! set gets a free table, filled before its [`MaglevRef`] and before the frontends carrying
//! `SVC_F_MAGLEV`. A changed set's table is rewritten in place, entry by entry, only where it
//! differs: a reader meanwhile sees, per entry, the old or the new backend id, both in the
//! backends map (stale backends go in step 3), so only flows whose entry changes anyway can
//! see the old choice. No free table (`--bpf-map-sizes maglev=N`) fails that service port; a
//! table is freed in step 3 (after the frontends using it are gone), so it can be reused from
//! the next sync on.

use std::collections::{BTreeMap, BTreeSet};

use kproxy_common::maglev::{MAP_MAGLEV, MAP_MAGLEV_REF, MaglevRef};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, MAP_AFFINITY, MAP_BACKEND_SLOTS,
    MAP_BACKENDS, MAP_SERVICES, MAP_SOURCE_RANGES, SOURCE_RANGE_ALLOW, SVC_F_AFFINITY, ServiceKey,
    ServiceValue,
};
use serde::Serialize;

use super::ids::BackendAddr;
use super::planner::{Plan, ServicePlan, SourceRangeEntry, describe_key};
use super::tables::{MaglevStore, Table, TableError};
use crate::model::ServicePortName;

/// The five maps the applier manages.
pub struct Tables {
    pub services: Box<dyn Table<ServiceKey, ServiceValue>>,
    pub slots: Box<dyn Table<BackendSlotKey, u32>>,
    pub backends: Box<dyn Table<u32, BackendValue>>,
    pub source_ranges: Box<dyn Table<SourceRangeEntry, u8>>,
    pub affinity: Box<dyn Table<AffinityKey, AffinityValue>>,
    /// Set id → where its Maglev table is.
    pub maglev_refs: Box<dyn Table<u32, MaglevRef>>,
    /// The Maglev tables.
    pub maglev: Box<dyn MaglevStore>,
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
pub struct ApplyOutcome {
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
}

#[derive(Debug, Default)]
struct Cache {
    services: BTreeMap<ServiceKey, ServiceValue>,
    slots: BTreeMap<BackendSlotKey, u32>,
    backends: BTreeMap<u32, BackendValue>,
    ranges: BTreeSet<SourceRangeEntry>,
    maglev_refs: BTreeMap<u32, MaglevRef>,
    /// Per set id, the `(address, id)` backends its table was last built from.
    maglev_built: BTreeMap<u32, Vec<(BackendAddr, u32)>>,
}

/// Applies plans to a set of [`Tables`].
pub struct Applier {
    tables: Tables,
    cache: Cache,
    applied: BTreeMap<ServicePortName, ServicePlan>,
    affinity_entries: usize,
}

impl Applier {
    /// Reads every agent-written map (the starting point of the diff).
    pub fn new(tables: Tables) -> Result<Self, TableError> {
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
        Ok(Applier {
            tables,
            cache,
            applied: BTreeMap::new(),
            affinity_entries: 0,
        })
    }

    /// Frontends and backends found in the maps (to seed the id allocator after a restart).
    pub fn existing(
        &self,
    ) -> (
        &BTreeMap<ServiceKey, ServiceValue>,
        &BTreeMap<u32, BackendValue>,
    ) {
        (&self.cache.services, &self.cache.backends)
    }

    /// Backends some UDP frontend references, as the maps hold them now (see
    /// [`super::sockdestroy`]).
    pub fn udp_backends(&self) -> BTreeSet<std::net::SocketAddr> {
        super::sockdestroy::udp_backends(
            &self.cache.services,
            &self.cache.slots,
            &self.cache.backends,
        )
    }

    /// Entries and capacity of each map.
    pub fn pressure(&self) -> Vec<MapPressure> {
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

    /// Makes the maps hold `plan` (see the module docs). `now_ns` is CLOCK_MONOTONIC (the
    /// BPF programs' `bpf_ktime_get_ns`), for affinity expiry. Errors only when a map cannot
    /// be read or an entry cannot be deleted; per-service write failures are in the outcome.
    pub fn apply(&mut self, plan: &Plan, now_ns: u64) -> Result<ApplyOutcome, TableError> {
        let mut out = ApplyOutcome::default();

        // 1. Backends.
        let mut failed_backends: BTreeMap<u32, String> = BTreeMap::new();
        for (id, value) in &plan.backends {
            if self.cache.backends.get(id) == Some(value) {
                continue;
            }
            match self.tables.backends.put(id, value) {
                Ok(()) => {
                    self.cache.backends.insert(*id, *value);
                    out.writes += 1;
                }
                Err(e) => {
                    failed_backends.insert(*id, e.to_string());
                }
            }
        }

        // 2. Per service port: slots, source ranges, frontends.
        let mut final_state: BTreeMap<ServicePortName, ServicePlan> = BTreeMap::new();
        for (name, sp) in &plan.services {
            let result = match sp.backend_ids().find_map(|id| failed_backends.get(&id)) {
                Some(err) => Err(err.clone()),
                None => self.apply_service(sp, &plan.backend_addrs, &mut out),
            };
            match result {
                Ok(()) => {
                    if !sp.errors.is_empty() {
                        out.failed.insert(name.clone(), sp.errors.join("; "));
                    }
                    out.services += 1;
                    final_state.insert(name.clone(), sp.clone());
                }
                Err(reason) => {
                    tracing::error!(service = %name, "cannot program service port: {reason}");
                    out.failed.insert(name.clone(), reason);
                    if let Some(old) = self.applied.get(name) {
                        final_state.insert(name.clone(), old.clone());
                    }
                }
            }
        }

        // 3. Stale entries.
        let want_fronts: BTreeSet<ServiceKey> = final_state
            .values()
            .flat_map(|p| p.frontends.keys().copied())
            .collect();
        let want_slots: BTreeSet<BackendSlotKey> = final_state
            .values()
            .flat_map(|p| p.sets.iter())
            .flat_map(|s| {
                (0..s.backends.len() as u32).map(move |slot| BackendSlotKey {
                    svc_id: s.svc_id,
                    slot,
                })
            })
            .collect();
        let want_ranges: BTreeSet<SourceRangeEntry> = final_state
            .values()
            .flat_map(|p| p.source_ranges.iter().copied())
            .collect();
        let stale: Vec<ServiceKey> = self
            .cache
            .services
            .keys()
            .filter(|k| !want_fronts.contains(k))
            .copied()
            .collect();
        for k in stale {
            self.tables.services.delete(&k)?;
            self.cache.services.remove(&k);
            out.deletes += 1;
        }
        let stale: Vec<BackendSlotKey> = self
            .cache
            .slots
            .keys()
            .filter(|k| !want_slots.contains(k))
            .copied()
            .collect();
        for k in stale {
            self.tables.slots.delete(&k)?;
            self.cache.slots.remove(&k);
            out.deletes += 1;
        }
        let stale: Vec<SourceRangeEntry> = self
            .cache
            .ranges
            .iter()
            .filter(|k| !want_ranges.contains(k))
            .copied()
            .collect();
        for k in stale {
            self.tables.source_ranges.delete(&k)?;
            self.cache.ranges.remove(&k);
            out.deletes += 1;
        }
        let want_maglev: BTreeSet<u32> = final_state
            .values()
            .flat_map(|p| p.sets.iter())
            .filter(|s| s.maglev && !s.backends.is_empty())
            .map(|s| s.svc_id)
            .collect();
        let stale: Vec<u32> = self
            .cache
            .maglev_refs
            .keys()
            .filter(|k| !want_maglev.contains(k))
            .copied()
            .collect();
        for k in stale {
            self.tables.maglev_refs.delete(&k)?;
            self.cache.maglev_refs.remove(&k);
            self.cache.maglev_built.remove(&k);
            out.deletes += 1;
        }
        // Every backend a remaining slot points at (a failed service's slots may already hold
        // new backends).
        let want_backends: BTreeSet<u32> = self.cache.slots.values().copied().collect();
        let stale: Vec<u32> = self
            .cache
            .backends
            .keys()
            .filter(|k| !want_backends.contains(k))
            .copied()
            .collect();
        for k in stale {
            self.tables.backends.delete(&k)?;
            self.cache.backends.remove(&k);
            out.deletes += 1;
        }

        // 4. Affinity.
        let mut members: BTreeMap<u32, BTreeSet<u32>> = BTreeMap::new();
        for p in final_state.values() {
            for s in &p.sets {
                members
                    .entry(s.svc_id)
                    .or_default()
                    .extend(s.backends.iter().copied());
            }
        }
        let mut timeouts: BTreeMap<u32, u64> = BTreeMap::new();
        for v in self.cache.services.values() {
            if v.flags & SVC_F_AFFINITY != 0 {
                timeouts.insert(v.svc_id, u64::from(v.affinity_timeout) * 1_000_000_000);
            }
        }
        let entries = self.tables.affinity.dump()?;
        self.affinity_entries = entries.len();
        for (k, v) in entries {
            let keep = members
                .get(&k.svc_id)
                .is_some_and(|m| m.contains(&v.backend_id))
                && timeouts
                    .get(&k.svc_id)
                    .is_some_and(|t| now_ns.saturating_sub(v.last_used_ns) <= *t);
            if !keep {
                self.tables.affinity.delete(&k)?;
                out.affinity_deleted += 1;
                self.affinity_entries -= 1;
            }
        }

        out.backends = self.cache.backends.len();
        self.applied = final_state;
        Ok(out)
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
        set: &super::planner::SetPlan,
        addrs: &BTreeMap<u32, BackendAddr>,
        out: &mut ApplyOutcome,
    ) -> Result<(), String> {
        if !set.maglev || set.backends.is_empty() {
            return Ok(());
        }
        let inputs: Vec<(BackendAddr, u32)> = set
            .backends
            .iter()
            .map(|id| {
                addrs
                    .get(id)
                    .map(|a| (*a, *id))
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
        let table = super::maglev::build(&inputs, m);
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

    fn apply_service(
        &mut self,
        sp: &ServicePlan,
        addrs: &BTreeMap<u32, BackendAddr>,
        out: &mut ApplyOutcome,
    ) -> Result<(), String> {
        for set in &sp.sets {
            for (slot, id) in set.backends.iter().enumerate() {
                let key = BackendSlotKey {
                    svc_id: set.svc_id,
                    slot: slot as u32,
                };
                if self.cache.slots.get(&key) == Some(id) {
                    continue;
                }
                self.tables
                    .slots
                    .put(&key, id)
                    .map_err(|e| format!("slot {slot} of set {}: {e}", set.svc_id))?;
                self.cache.slots.insert(key, *id);
                out.writes += 1;
            }
        }
        for set in &sp.sets {
            self.apply_maglev(set, addrs, out)?;
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
