//! Stable ids for backends and endpoint sets.
//!
//! A backend id lives in conntrack and affinity entries, a set id (`svc_id`) keys slots,
//! affinity and source ranges; both must stay the same while the thing they name exists, across
//! syncs and across agent restarts. [`IdAllocator`] hands out ids from a counter that only moves
//! forward (wrapping at `u32::MAX`, skipping 0 and ids in use), so a freed id is not handed out
//! again until the counter comes round, which keeps stale kernel entries from aliasing a new
//! backend. On restart it is seeded from the pinned maps ([`IdAllocator::seed_backend`],
//! [`IdAllocator::hint_set`]) so the first plan reuses every id still valid.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::Hash;
use std::net::IpAddr;

use kproxy_common::service::ServiceKey;

use crate::model::{IpFamily, ServicePortName};

/// Which endpoint set of a service port.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetKind {
    /// Upstream's cluster endpoints (ready, topology-narrowed, terminating fallback).
    Cluster,
    /// Upstream's local endpoints (eTP/iTP=Local).
    Local,
}

/// Identity of an endpoint set: one per service port, kind and family.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct SetKey {
    pub service: ServicePortName,
    pub kind: SetKind,
    pub family: IpFamily,
}

/// Identity of a backend: its address (shared by every service that has it).
pub(crate) type BackendAddr = (IpAddr, u16);

/// One id space. Hash tables, not B-trees: nothing iterates them in order, and at 50k backends
/// a B-tree filled in random order takes about twice the memory.
#[derive(Debug, Clone)]
struct Space<K: Hash + Eq + Clone> {
    ids: HashMap<K, u32>,
    used: HashSet<u32>,
    next: u32,
}

impl<K: Hash + Eq + Clone> Default for Space<K> {
    fn default() -> Self {
        Space {
            ids: HashMap::new(),
            used: HashSet::new(),
            next: 0,
        }
    }
}

impl<K: Hash + Eq + Clone + Ord> Space<K> {
    fn get_or_alloc(&mut self, key: &K, hint: Option<u32>) -> u32 {
        if let Some(id) = self.ids.get(key) {
            return *id;
        }
        let id = match hint {
            Some(h) if h != 0 && !self.used.contains(&h) => h,
            _ => loop {
                self.next = self.next.wrapping_add(1);
                if self.next != 0 && !self.used.contains(&self.next) {
                    break self.next;
                }
            },
        };
        self.ids.insert(key.clone(), id);
        self.used.insert(id);
        id
    }

    fn release(&mut self, key: &K) {
        if let Some(id) = self.ids.remove(key) {
            self.used.remove(&id);
        }
    }

    fn retain(&mut self, live: &BTreeSet<K>) {
        let used = &mut self.used;
        self.ids.retain(|k, id| {
            let keep = live.contains(k);
            if !keep {
                used.remove(id);
            }
            keep
        });
    }
}

/// Allocates backend ids and set ids (see the module docs).
#[derive(Debug, Default, Clone)]
pub(crate) struct IdAllocator {
    backends: Space<BackendAddr>,
    sets: Space<SetKey>,
    /// Backend ids found in the pinned maps at startup, by address.
    backend_hints: HashMap<BackendAddr, u32>,
    /// Set ids found in the pinned SERVICES map at startup, by frontend.
    set_hints: HashMap<ServiceKey, u32>,
}

impl IdAllocator {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// A backend found in the pinned maps: the next plan gives `addr` this id again.
    pub(crate) fn seed_backend(&mut self, addr: BackendAddr, id: u32) {
        self.backend_hints.insert(addr, id);
        self.backends.next = self.backends.next.max(id);
    }

    /// A frontend found in the pinned maps pointing at set `svc_id`: a set planned for this
    /// frontend gets that id again (first frontend wins).
    pub(crate) fn hint_set(&mut self, frontend: ServiceKey, svc_id: u32) {
        self.set_hints.insert(frontend, svc_id);
        self.sets.next = self.sets.next.max(svc_id);
    }

    /// The id of backend `addr`, allocated on first use.
    pub(crate) fn backend(&mut self, addr: BackendAddr) -> u32 {
        let hint = self.backend_hints.get(&addr).copied();
        self.backends.get_or_alloc(&addr, hint)
    }

    /// The id of set `key`, allocated on first use (preferring the id a pinned frontend in
    /// `frontends` had).
    pub(crate) fn set(&mut self, key: &SetKey, frontends: &[ServiceKey]) -> u32 {
        let hint = frontends
            .iter()
            .find_map(|f| self.set_hints.get(f).copied());
        self.sets.get_or_alloc(key, hint)
    }

    /// Forgets the id of backend `addr` (no set references it any more).
    pub(crate) fn release_backend(&mut self, addr: &BackendAddr) {
        self.backends.release(addr);
    }

    /// Forgets the id of set `key` (its service port no longer has it).
    pub(crate) fn release_set(&mut self, key: &SetKey) {
        self.sets.release(key);
    }

    /// Forgets ids of backends and sets not in a plan any more (after it was applied) and the
    /// startup hints (used once).
    pub(crate) fn retain(&mut self, backends: &BTreeSet<BackendAddr>, sets: &BTreeSet<SetKey>) {
        self.backends.retain(backends);
        self.sets.retain(sets);
        self.backend_hints.clear();
        self.set_hints.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn addr(last: u8) -> BackendAddr {
        (IpAddr::from([10, 0, 0, last]), 80)
    }

    fn set(name: &str) -> SetKey {
        SetKey {
            service: ServicePortName::new("ns", name, "", Protocol::Tcp),
            kind: SetKind::Cluster,
            family: IpFamily::V4,
        }
    }

    #[test]
    fn ids_are_stable_nonzero_and_not_reused_at_once() {
        let mut ids = IdAllocator::new();
        let a = ids.backend(addr(1));
        let b = ids.backend(addr(2));
        assert_ne!(a, 0);
        assert_ne!(a, b);
        assert_eq!(ids.backend(addr(1)), a);
        ids.retain(&[addr(1)].into(), &BTreeSet::new());
        assert_eq!(ids.backend(addr(1)), a, "a kept backend keeps its id");
        let c = ids.backend(addr(2));
        assert_ne!(c, b, "a freed id is not handed out again at once");
        assert_ne!(c, a);
    }

    #[test]
    fn seeds_from_pinned_maps_are_reused() {
        let mut ids = IdAllocator::new();
        ids.seed_backend(addr(1), 41);
        let front = ServiceKey {
            port: 80u16.to_be(),
            proto: 6,
            ..Default::default()
        };
        ids.hint_set(front, 9);
        assert_eq!(ids.backend(addr(1)), 41);
        assert_eq!(ids.set(&set("a"), &[front]), 9);
        // A new set never collides with a seeded id.
        let other = ids.set(&set("b"), &[]);
        assert_ne!(other, 9);
        let fresh = ids.backend(addr(2));
        assert!(fresh > 41, "counter moves past seeded ids: {fresh}");
    }
}
