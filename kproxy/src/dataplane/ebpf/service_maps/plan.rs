//! The pure planner: a [`Snapshot`] and an [`ServiceMapsConfig`] → the exact service-map entries
//! ([`MapsPlan`]). No I/O; the applier writes what this returns.
//!
//! Per service port and IP family (endpoints are filtered to the family first, then
//! categorized like upstream's per-family proxiers do):
//! - sets: the cluster set (`categorize().cluster`) and the local set (`.local`) each become a
//!   [`SetPlan`] with a stable `svc_id` and one slot per endpoint (sorted by address);
//! - frontends ([`ServiceKey`] → [`ServiceValue`]):
//!   - the ClusterIP, scope cluster → local set with iTP=Local, else the cluster set;
//!   - every NodePort (one per node address of the family), externalIP and LB VIP (ipMode VIP):
//!     scope cluster → the cluster set (upstream short-circuits traffic from the node and its
//!     pods to external destinations to the cluster endpoints, even with eTP=Local); scope
//!     external → the local set with eTP=Local, else the cluster set;
//!   - `count == 0` sets [`SVC_F_REJECT`] only when the family has no usable endpoint at all
//!     (upstream REJECT); otherwise an empty local set means DROP ("has no local endpoints").
//! - with `--bpf-lb-algorithm maglev`, IPv4 external-scope frontends get [`SVC_F_MAGLEV`] and
//!   the set they point at [`SetPlan::maglev`] (the applier builds its table; socket LB, i.e.
//!   the cluster-scope entries, keeps the random choice; IPv6 sets get no table: the TC
//!   path's IPv6 programs pick a random slot);
//! - LB VIPs of a service with loadBalancerSourceRanges get [`SVC_F_SOURCE_RANGES`] on their
//!   external-scope entry and one LPM entry per range of the family.
//!
//! Knowing differences from upstream: NodePorts are programmed on the configured node
//! addresses only (no `127.0.0.1:nodePort` "localnet" access); source ranges do not apply to
//! socket LB (a connecting socket has no source address yet), i.e. to clients on the node.
//!
//! A frontend claimed by two service ports (e.g. the same externalIP and port on two services)
//! goes to the first by name; the second keeps it in [`ServicePlan::contested`] (not
//! programmed) and is told in [`ServicePlan::errors`].
//!
//! A backend shared by several service ports is one entry; its `BE_F_LOCAL` /
//! `BE_F_TERMINATING` flags are set when any referencing endpoint has them (order-independent,
//! so an incremental plan equals a from-scratch one).
//!
//! `Planner` is incremental: it keeps the plan and re-plans only the service ports it is
//! given (`Planner::update`), keeping reference counts of backends (an id is released when
//! nothing references it) and the claimants of every frontend (when an owner stops wanting a
//! frontend, the next claimant gets it and is reported changed). `plan` is a from-scratch
//! plan through the same code; the unit tests check that random sequences of incremental
//! updates end in exactly the from-scratch plan.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use kproxy_common::service::{
    BE_F_LOCAL, BE_F_TERMINATING, BackendValue, SCOPE_CLUSTER, SCOPE_EXTERNAL,
    SOURCE_RANGE_ID_BITS, SVC_F_AFFINITY, SVC_F_CLUSTER_IP, SVC_F_EXTERNAL_IP, SVC_F_LOAD_BALANCER,
    SVC_F_LOCAL_ONLY, SVC_F_MAGLEV, SVC_F_NODE_PORT, SVC_F_REJECT, SVC_F_SOURCE_RANGES, ServiceKey,
    ServiceValue, SourceRangeKey, is_v4_mapped,
};

use crate::dataplane::ebpf::service_maps::LbAlgorithm;
use crate::dataplane::ebpf::service_maps::ServiceMapsConfig;
use crate::dataplane::ebpf::service_maps::ids::BackendAddr;
use crate::dataplane::ebpf::service_maps::ids::IdAllocator;
use crate::dataplane::ebpf::service_maps::ids::SetKey;
use crate::dataplane::ebpf::service_maps::ids::SetKind;
use crate::model::topology::{CategorizedEndpoints, categorize_endpoints};
use crate::model::vecmap::VecMap;
use crate::model::{Endpoint, IpFamily, NodeInfo, ServicePort, ServicePortName, Snapshot};

pub use crate::dataplane::ebpf::addr::{decode_addr, encode_addr};

/// A [`MAP_SOURCE_RANGES`](kproxy_common::service::MAP_SOURCE_RANGES) key: LPM prefix length
/// (bits, including the 32 of `svc_id`) and data.
pub(crate) type SourceRangeEntry = (u32, SourceRangeKey);

/// The LPM key allowing `net` for set `svc_id`.
pub(crate) fn source_range_entry(svc_id: u32, net: IpNet) -> SourceRangeEntry {
    let bits = match net {
        IpNet::V4(n) => 96 + u32::from(n.prefix_len()),
        IpNet::V6(n) => u32::from(n.prefix_len()),
    };
    (
        SOURCE_RANGE_ID_BITS + bits,
        SourceRangeKey {
            svc_id,
            addr: encode_addr(net.network()),
        },
    )
}

/// The slots of one endpoint set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetPlan {
    pub svc_id: u32,
    pub kind: SetKind,
    pub family: IpFamily,
    /// Backend id of slot `i`.
    pub backends: Vec<u32>,
    /// An external-scope frontend uses this set with `--bpf-lb-algorithm maglev`: the applier
    /// gives it a Maglev table (built from the backends' addresses, see [`crate::dataplane::ebpf::service_maps::maglev`]).
    pub maglev: bool,
}

/// The snapshot parts a [`ServicePlan`] was made from: the service port and its endpoints.
pub(crate) type PlanSource = (Arc<ServicePort>, Option<Arc<Vec<Endpoint>>>);

/// Everything one service port puts into the maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePlan {
    /// The frontends this service port owns (programmed).
    pub frontends: VecMap<ServiceKey, ServiceValue>,
    /// Frontends it wants that another service port owns (not programmed; see the module docs).
    pub contested: VecMap<ServiceKey, ServiceValue>,
    pub sets: Vec<SetPlan>,
    pub source_ranges: BTreeSet<SourceRangeEntry>,
    /// Problems planning this service port (what was left out and why).
    pub errors: Vec<String>,
    /// `(backend id, BE_F_* flags)` of every slot of every set: what this service port
    /// contributes to the shared backend entries.
    pub backend_flags: Vec<(u32, u8)>,
    /// The snapshot parts this was planned from (shared with the snapshot, not copied).
    pub source: Option<PlanSource>,
}

impl ServicePlan {
    /// Backend ids this service's slots reference.
    pub(crate) fn backend_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.sets.iter().flat_map(|s| s.backends.iter().copied())
    }
    /// Keys of every frontend this service port wants, owned or contested.
    pub fn wanted_keys(&self) -> impl Iterator<Item = ServiceKey> + '_ {
        self.frontends.keys().chain(self.contested.keys()).copied()
    }
    /// Every frontend this service port wants, owned or contested.
    fn wanted(&self) -> impl Iterator<Item = (&ServiceKey, &ServiceValue)> + '_ {
        self.frontends.iter().chain(self.contested.iter())
    }
}

/// The whole desired content of the service maps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MapsPlan {
    /// Per service port (shared with the applier, which keeps what it programmed).
    pub services: BTreeMap<ServicePortName, Arc<ServicePlan>>,
    /// Every backend any service references, by id (its address: [`MapsPlan::backend_addr`]).
    pub backends: BTreeMap<u32, BackendValue>,
}

/// The address a backend entry holds.
pub(crate) fn backend_addr(b: &BackendValue) -> BackendAddr {
    (decode_addr(b.addr), u16::from_be(b.port))
}

impl MapsPlan {
    /// Address of backend `id` (for logs, render and Maglev).
    pub fn backend_addr(&self, id: u32) -> Option<BackendAddr> {
        self.backends.get(&id).map(backend_addr)
    }

    /// Number of frontends, slots and source-range entries.
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        self.services.values().fold((0, 0, 0), |(f, s, r), p| {
            (
                f + p.frontends.len(),
                s + p.sets.iter().map(|s| s.backends.len()).sum::<usize>(),
                r + p.source_ranges.len(),
            )
        })
    }
}

fn endpoint_flags(ep: &Endpoint) -> u8 {
    let mut flags = 0;
    if ep.is_local {
        flags |= BE_F_LOCAL;
    }
    if ep.terminating {
        flags |= BE_F_TERMINATING;
    }
    flags
}

fn key(ip: IpAddr, port: u16, svc: &ServicePort, scope: u8) -> ServiceKey {
    ServiceKey {
        addr: encode_addr(ip),
        port: port.to_be(),
        proto: svc.protocol.number(),
        scope,
    }
}

/// Plans every service port of `snap` from scratch. `ids` keeps ids stable across calls (pass
/// the same allocator every time; `render` uses a fresh one).
pub(crate) fn plan(snap: &Snapshot, cfg: &ServiceMapsConfig, ids: &mut IdAllocator) -> MapsPlan {
    let mut planner = Planner::new(std::mem::take(ids));
    planner.full(snap, cfg);
    *ids = planner.ids;
    planner.plan
}

/// What a plan depends on besides the service ports: a change of any of these re-plans every
/// service port.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Inputs {
    node: NodeInfo,
    node_addrs: Vec<IpAddr>,
    families: Vec<IpFamily>,
    maglev: bool,
}

impl Inputs {
    fn of(snap: &Snapshot, cfg: &ServiceMapsConfig) -> Inputs {
        Inputs {
            node: snap.node.clone(),
            node_addrs: if cfg.node_addresses.is_empty() {
                snap.node.addresses.clone()
            } else {
                cfg.node_addresses.clone()
            },
            families: cfg.families.clone(),
            maglev: cfg.lb_algorithm == LbAlgorithm::Maglev,
        }
    }
}

/// References to one backend id from the planned sets (its address is in the plan's entry).
#[derive(Debug, Clone, Copy)]
struct BackendRefs {
    refs: u32,
    local: u32,
    terminating: u32,
}

impl BackendRefs {
    /// The entry's flags: the OR of what every referencing slot says.
    fn flags(&self) -> u8 {
        let mut flags = 0;
        if self.local > 0 {
            flags |= BE_F_LOCAL;
        }
        if self.terminating > 0 {
            flags |= BE_F_TERMINATING;
        }
        flags
    }
}

/// The incremental planner (see the module docs): the current [`MapsPlan`], the ids, who claims
/// which frontend and who references which backend.
#[derive(Debug, Default)]
pub(crate) struct Planner {
    ids: IdAllocator,
    plan: MapsPlan,
    /// Every service port wanting a frontend; the first (by name) owns it. (Nearly always one
    /// claimant: a `VecMap` holds it in ≈ 100 bytes where a B-tree set takes ≈ 900.)
    claims: HashMap<ServiceKey, VecMap<ServicePortName, ()>>,
    backend_refs: HashMap<u32, BackendRefs>,
    /// Backends first referenced during the running re-plan (entered into the plan at its
    /// end, in one sorted batch).
    fresh: Vec<(u32, BackendAddr)>,
    /// What the current plan was made from (`None`: nothing planned yet).
    inputs: Option<Inputs>,
}

impl Planner {
    /// A planner starting from `ids` (seeded from the pinned maps after a restart).
    pub(crate) fn new(ids: IdAllocator) -> Self {
        Planner {
            ids,
            ..Default::default()
        }
    }

    /// The current plan.
    pub(crate) fn plan(&self) -> &MapsPlan {
        &self.plan
    }

    /// The id allocator (a clone plans from scratch with the same ids).
    #[cfg(test)]
    pub fn ids(&self) -> &IdAllocator {
        &self.ids
    }

    /// Whether the next update must re-plan every service port: nothing planned yet, or the
    /// node, its addresses or the configuration changed.
    pub(crate) fn needs_full(&self, snap: &Snapshot, cfg: &ServiceMapsConfig) -> bool {
        self.inputs.as_ref() != Some(&Inputs::of(snap, cfg))
    }

    /// Service ports of `snap` that differ from what the current plan was made from (added,
    /// changed, removed): for snapshots that do not come with a trustworthy change set.
    pub(crate) fn changed_in(&self, snap: &Snapshot) -> BTreeSet<ServicePortName> {
        let mut out: BTreeSet<ServicePortName> = self
            .plan
            .services
            .keys()
            .filter(|n| !snap.services.contains_key(*n))
            .cloned()
            .collect();
        for (name, svc) in &snap.services {
            let eps = snap.endpoints.get(name);
            let same = self
                .plan
                .services
                .get(name)
                .and_then(|p| p.source.as_ref())
                .is_some_and(|(s, e)| {
                    (Arc::ptr_eq(s, svc) || **s == **svc)
                        && match (e, eps) {
                            (None, None) => true,
                            (Some(a), Some(b)) => Arc::ptr_eq(a, b) || **a == **b,
                            (Some(a), None) => a.is_empty(),
                            (None, Some(b)) => b.is_empty(),
                        }
                });
            if !same {
                out.insert(name.clone());
            }
        }
        out
    }

    /// Re-plans every service port of `snap` (ids stay stable). Returns the service ports
    /// whose plan was (re)made or removed: all of them.
    pub(crate) fn full(
        &mut self,
        snap: &Snapshot,
        cfg: &ServiceMapsConfig,
    ) -> BTreeSet<ServicePortName> {
        let all: BTreeSet<ServicePortName> = snap
            .services
            .keys()
            .chain(self.plan.services.keys())
            .cloned()
            .collect();
        self.inputs = Some(Inputs::of(snap, cfg));
        let changed = self.replan(snap, &all);
        // Forget ids nothing uses any more (and the startup hints, used once).
        let live_backends: BTreeSet<BackendAddr> =
            self.plan.backends.values().map(backend_addr).collect();
        let live_sets: BTreeSet<SetKey> = self
            .plan
            .services
            .iter()
            .flat_map(|(name, p)| {
                p.sets.iter().map(move |s| SetKey {
                    service: name.clone(),
                    kind: s.kind,
                    family: s.family,
                })
            })
            .collect();
        self.ids.retain(&live_backends, &live_sets);
        changed
    }

    /// Re-plans the service ports in `dirty` (added, changed or removed in `snap`), or every
    /// one when [`Planner::needs_full`]. Returns the service ports whose plan was (re)made or
    /// removed: `dirty` plus those whose frontends changed owner.
    pub(crate) fn update(
        &mut self,
        snap: &Snapshot,
        cfg: &ServiceMapsConfig,
        dirty: &BTreeSet<ServicePortName>,
    ) -> BTreeSet<ServicePortName> {
        if self.needs_full(snap, cfg) {
            return self.full(snap, cfg);
        }
        self.replan(snap, dirty)
    }

    fn replan(
        &mut self,
        snap: &Snapshot,
        dirty: &BTreeSet<ServicePortName>,
    ) -> BTreeSet<ServicePortName> {
        let inputs = self.inputs.clone().expect("inputs are set before planning");
        let mut touched_keys: BTreeSet<ServiceKey> = BTreeSet::new();
        let mut touched_backends: BTreeSet<u32> = BTreeSet::new();
        for name in dirty {
            let old = self.plan.services.remove(name);
            if let Some(old) = &old {
                for (k, _) in old.wanted() {
                    touched_keys.insert(*k);
                    if let Some(c) = self.claims.get_mut(k) {
                        c.remove(name);
                        if c.is_empty() {
                            self.claims.remove(k);
                        }
                    }
                }
                for (id, flags) in &old.backend_flags {
                    touched_backends.insert(*id);
                    if let Some(r) = self.backend_refs.get_mut(id) {
                        r.refs -= 1;
                        r.local -= u32::from(flags & BE_F_LOCAL != 0);
                        r.terminating -= u32::from(flags & BE_F_TERMINATING != 0);
                    }
                }
            }
            let new = snap
                .services
                .get(name)
                .map(|svc| self.plan_service(snap, svc, &inputs));
            if let Some(new) = &new {
                for (k, _) in new.wanted() {
                    touched_keys.insert(*k);
                    self.claims.entry(*k).or_default().insert(name.clone(), ());
                }
                touched_backends.extend(new.backend_flags.iter().map(|(id, _)| *id));
            }
            // Sets the service port no longer has give their ids back.
            if let Some(old) = &old {
                for s in &old.sets {
                    let gone = new.as_ref().is_none_or(|n| {
                        !n.sets
                            .iter()
                            .any(|x| x.kind == s.kind && x.family == s.family)
                    });
                    if gone {
                        self.ids.release_set(&SetKey {
                            service: name.clone(),
                            kind: s.kind,
                            family: s.family,
                        });
                    }
                }
            }
            if let Some(new) = new {
                self.plan.services.insert(name.clone(), Arc::new(new));
            }
        }
        // Backend entries: the OR of what every referencing slot says; unreferenced ones go.
        for id in touched_backends {
            let Some(r) = self.backend_refs.get(&id).copied() else {
                continue;
            };
            if r.refs == 0 {
                self.backend_refs.remove(&id);
                if let Some(b) = self.plan.backends.remove(&id) {
                    self.ids.release_backend(&backend_addr(&b));
                }
                continue;
            }
            if let Some(b) = self.plan.backends.get_mut(&id) {
                b.flags = r.flags();
            }
        }
        // Backends new in this re-plan, as one sorted batch (a first sync builds a packed
        // tree, not one of half-full nodes).
        let mut fresh = std::mem::take(&mut self.fresh);
        fresh.sort_unstable_by_key(|(id, _)| *id);
        let mut batch = Vec::with_capacity(fresh.len());
        for (id, addr) in fresh {
            match self.backend_refs.get(&id) {
                Some(r) => batch.push((
                    id,
                    BackendValue {
                        addr: encode_addr(addr.0),
                        port: addr.1.to_be(),
                        flags: r.flags(),
                        _pad: 0,
                    },
                )),
                None => self.ids.release_backend(&addr),
            }
        }
        super::extend_packed(&mut self.plan.backends, batch);
        // Frontend owners: every claimant of a touched frontend gets its share re-split.
        let mut changed: BTreeSet<ServicePortName> = dirty.clone();
        let mut affected: BTreeSet<ServicePortName> = dirty.clone();
        for k in &touched_keys {
            if let Some(c) = self.claims.get(k) {
                affected.extend(c.keys().cloned());
            }
        }
        for name in affected {
            let Some(sp) = self.plan.services.get(&name) else {
                continue;
            };
            let split = self.split(&name, sp);
            if split != **sp {
                self.plan.services.insert(name.clone(), Arc::new(split));
                changed.insert(name);
            }
        }
        changed
    }

    /// `sp` with its wanted frontends divided into owned and contested by the current claims.
    fn split(&self, name: &ServicePortName, sp: &ServicePlan) -> ServicePlan {
        let mut frontends = VecMap::new();
        let mut contested = VecMap::new();
        let mut errors = Vec::new();
        for (k, v) in sp.wanted() {
            let owner = self
                .claims
                .get(k)
                .and_then(|c| c.keys().next())
                .expect("a wanted frontend is claimed");
            if owner == name {
                frontends.insert(*k, *v);
            } else {
                errors.push(format!(
                    "frontend {} already belongs to service port {owner}; not programmed",
                    describe_key(k)
                ));
                contested.insert(*k, *v);
            }
        }
        ServicePlan {
            frontends,
            contested,
            errors,
            ..sp.clone()
        }
    }

    /// Plans one service port: every frontend it wants (in `frontends`, split later), its sets,
    /// and references to its backends.
    fn plan_service(
        &mut self,
        snap: &Snapshot,
        svc: &Arc<ServicePort>,
        inputs: &Inputs,
    ) -> ServicePlan {
        let mut sp = ServicePlan {
            source: Some((svc.clone(), snap.endpoints.get(&svc.name).cloned())),
            ..Default::default()
        };
        let all = snap.endpoints_of(&svc.name);
        for &family in &inputs.families {
            self.plan_family(snap, svc, all, family, inputs, &mut sp);
        }
        sp
    }

    fn add_ref(&mut self, id: u32, addr: BackendAddr, flags: u8) {
        let r = self.backend_refs.entry(id).or_insert_with(|| {
            self.fresh.push((id, addr));
            BackendRefs {
                refs: 0,
                local: 0,
                terminating: 0,
            }
        });
        r.refs += 1;
        r.local += u32::from(flags & BE_F_LOCAL != 0);
        r.terminating += u32::from(flags & BE_F_TERMINATING != 0);
    }

    fn plan_family(
        &mut self,
        snap: &Snapshot,
        svc: &ServicePort,
        all: &[Endpoint],
        family: IpFamily,
        inputs: &Inputs,
        sp: &mut ServicePlan,
    ) {
        // Frontends per set kind, gathered first so a restarted agent's set ids can be found
        // by any of them.
        let fronts = frontends(svc, family, inputs);
        if fronts.is_empty() {
            return;
        }
        let eps: Vec<Endpoint> = if all.iter().all(|e| family.matches(&e.ip)) {
            all.to_vec()
        } else {
            all.iter()
                .filter(|e| family.matches(&e.ip))
                .cloned()
                .collect()
        };
        let cat = categorize_endpoints(&eps, svc, &snap.node);
        let set_ids = self.plan_sets(svc, family, &fronts, &cat, sp);
        plan_frontends(svc, family, inputs, fronts, &set_ids, &cat, sp);
    }

    /// The backend sets (cluster, local) the frontends use: ids, backends (referenced),
    /// into `sp`. Returns each kind's set id and backend count.
    fn plan_sets(
        &mut self,
        svc: &ServicePort,
        family: IpFamily,
        fronts: &[(ServiceKey, SetKind, u32)],
        cat: &CategorizedEndpoints,
        sp: &mut ServicePlan,
    ) -> BTreeMap<SetKind, (u32, u32)> {
        let mut set_ids: BTreeMap<SetKind, (u32, u32)> = BTreeMap::new();
        for kind in [SetKind::Cluster, SetKind::Local] {
            let members: Vec<ServiceKey> = fronts
                .iter()
                .filter(|(_, k, _)| *k == kind)
                .map(|(f, _, _)| *f)
                .collect();
            if members.is_empty() {
                continue;
            }
            let mut endpoints = match kind {
                SetKind::Cluster => cat.cluster.clone().unwrap_or_default(),
                SetKind::Local => cat.local.clone().unwrap_or_default(),
            };
            let svc_id = self.ids.set(
                &SetKey {
                    service: svc.name.clone(),
                    kind,
                    family,
                },
                &members,
            );
            endpoints.sort_by_key(|a| (a.ip, a.port));
            endpoints.dedup_by(|a, b| (a.ip, a.port) == (b.ip, b.port));
            let backends: Vec<u32> = endpoints
                .iter()
                .map(|ep| {
                    let addr = (ep.ip, ep.port);
                    let id = self.ids.backend(addr);
                    let flags = endpoint_flags(ep);
                    self.add_ref(id, addr, flags);
                    sp.backend_flags.push((id, flags));
                    id
                })
                .collect();
            set_ids.insert(kind, (svc_id, backends.len() as u32));
            sp.sets.push(SetPlan {
                svc_id,
                kind,
                family,
                backends,
                maglev: false,
            });
        }
        set_ids
    }
}

/// The frontends of `svc` in `family` with the set kind each uses and its `SVC_F_*` kind
/// flag: the cluster IP, and (externally accessible) each node port, external IP and LB IP
/// in both scopes.
fn frontends(
    svc: &ServicePort,
    family: IpFamily,
    inputs: &Inputs,
) -> Vec<(ServiceKey, SetKind, u32)> {
    let mut fronts: Vec<(ServiceKey, SetKind, u32)> = Vec::new();
    if let Some(ip) = svc.cluster_ip(family) {
        let kind = if svc.internal_policy_local {
            SetKind::Local
        } else {
            SetKind::Cluster
        };
        fronts.push((
            key(ip, svc.port, svc, SCOPE_CLUSTER),
            kind,
            SVC_F_CLUSTER_IP,
        ));
    }
    if svc.externally_accessible() {
        let ext_kind = if svc.external_policy_local {
            SetKind::Local
        } else {
            SetKind::Cluster
        };
        let mut add = |ip: IpAddr, port: u16, flag: u32| {
            fronts.push((key(ip, port, svc, SCOPE_CLUSTER), SetKind::Cluster, flag));
            fronts.push((key(ip, port, svc, SCOPE_EXTERNAL), ext_kind, flag));
        };
        if svc.node_port != 0 {
            for ip in inputs.node_addrs.iter().filter(|ip| family.matches(ip)) {
                add(*ip, svc.node_port, SVC_F_NODE_PORT);
            }
        }
        for ip in svc.external_ips_for(family) {
            add(ip, svc.port, SVC_F_EXTERNAL_IP);
        }
        for ip in svc.load_balancer_vips(family) {
            add(ip, svc.port, SVC_F_LOAD_BALANCER);
        }
    }
    fronts
}

/// Each frontend's value (set, flags, affinity) into `sp`, with the Maglev marks and source
/// ranges of the sets it uses.
fn plan_frontends(
    svc: &ServicePort,
    family: IpFamily,
    inputs: &Inputs,
    fronts: Vec<(ServiceKey, SetKind, u32)>,
    set_ids: &BTreeMap<SetKind, (u32, u32)>,
    cat: &CategorizedEndpoints,
    sp: &mut ServicePlan,
) {
    let ranges: Vec<IpNet> = svc.source_ranges_for(family).collect();
    for (front, kind, kind_flag) in fronts {
        let (svc_id, count) = set_ids[&kind];
        let mut flags = kind_flag;
        if kind == SetKind::Local {
            flags |= SVC_F_LOCAL_ONLY;
        }
        if count == 0 && !cat.has_any_endpoints {
            flags |= SVC_F_REJECT;
        }
        let (timeout, aff) = match svc.session_affinity_timeout {
            Some(t) => (t, SVC_F_AFFINITY),
            None => (0, 0),
        };
        flags |= aff;
        if inputs.maglev && front.scope == SCOPE_EXTERNAL && family == IpFamily::V4 {
            flags |= SVC_F_MAGLEV;
            if let Some(set) = sp.sets.iter_mut().find(|s| s.svc_id == svc_id) {
                set.maglev = true;
            }
        }
        if kind_flag == SVC_F_LOAD_BALANCER && front.scope == SCOPE_EXTERNAL && !ranges.is_empty() {
            flags |= SVC_F_SOURCE_RANGES;
            for net in &ranges {
                sp.source_ranges.insert(source_range_entry(svc_id, *net));
            }
        }
        // The same frontend twice in one service port (e.g. an external IP that is also a
        // node address): the first wins.
        sp.frontends.insert_if_absent(
            front,
            ServiceValue {
                svc_id,
                count,
                flags,
                affinity_timeout: timeout,
            },
        );
    }
}

/// `1.2.3.4:80/TCP (cluster)`.
pub(crate) fn describe_key(k: &ServiceKey) -> String {
    let proto = match k.proto {
        6 => "TCP",
        17 => "UDP",
        132 => "SCTP",
        _ => "?",
    };
    let scope = if k.scope == SCOPE_EXTERNAL {
        "external"
    } else {
        "cluster"
    };
    format!(
        "{}/{proto} ({scope})",
        std::net::SocketAddr::new(decode_addr(k.addr), u16::from_be(k.port))
    )
}

fn describe_flags(flags: u32) -> String {
    let names = [
        (SVC_F_CLUSTER_IP, "clusterIP"),
        (SVC_F_NODE_PORT, "nodePort"),
        (SVC_F_EXTERNAL_IP, "externalIP"),
        (SVC_F_LOAD_BALANCER, "loadBalancer"),
        (SVC_F_LOCAL_ONLY, "local"),
        (SVC_F_AFFINITY, "affinity"),
        (SVC_F_REJECT, "reject"),
        (SVC_F_SOURCE_RANGES, "sourceRanges"),
        (SVC_F_MAGLEV, "maglev"),
    ];
    names
        .iter()
        .filter(|(f, _)| flags & f != 0)
        .map(|(_, n)| *n)
        .collect::<Vec<_>>()
        .join(",")
}

/// The planned map entries as text (`kproxy render --proxy-mode ebpf`), per service port.
pub fn render(snap: &Snapshot, cfg: &ServiceMapsConfig) -> String {
    let plan = plan(snap, cfg, &mut IdAllocator::new());
    render_plan(&plan)
}

/// [`render`] of an existing plan.
pub(crate) fn render_plan(plan: &MapsPlan) -> String {
    let mut s = String::new();
    let (f, sl, r) = plan.counts();
    let _ = writeln!(
        s,
        "# eBPF service maps: {} service ports, {f} frontends, {sl} slots, {} backends, {r} source ranges",
        plan.services.len(),
        plan.backends.len()
    );
    for (name, sp) in &plan.services {
        let _ = writeln!(s, "service {name}");
        for (k, v) in &sp.frontends {
            let _ = write!(
                s,
                "  frontend {} -> svc_id={} count={} flags=[{}]",
                describe_key(k),
                v.svc_id,
                v.count,
                describe_flags(v.flags)
            );
            if v.flags & SVC_F_AFFINITY != 0 {
                let _ = write!(s, " affinity_timeout={}s", v.affinity_timeout);
            }
            s.push('\n');
        }
        for set in &sp.sets {
            let _ = write!(
                s,
                "  set svc_id={} {:?}/{:?}:",
                set.svc_id, set.kind, set.family
            );
            for (slot, id) in set.backends.iter().enumerate() {
                let addr = plan
                    .backend_addr(*id)
                    .map(|(ip, port)| std::net::SocketAddr::new(ip, port).to_string())
                    .unwrap_or_default();
                let _ = write!(s, " [{slot}]={id}({addr})");
            }
            s.push('\n');
        }
        for (len, k) in &sp.source_ranges {
            let _ = writeln!(
                s,
                "  source-range svc_id={} {}/{}",
                k.svc_id,
                decode_addr(k.addr),
                len - SOURCE_RANGE_ID_BITS - if is_v4_mapped(&k.addr) { 96 } else { 0 }
            );
        }
        for e in &sp.errors {
            let _ = writeln!(s, "  error: {e}");
        }
    }
    for (id, b) in &plan.backends {
        let _ = writeln!(
            s,
            "backend {id} {} flags={}",
            std::net::SocketAddr::new(decode_addr(b.addr), u16::from_be(b.port)),
            b.flags
        );
    }
    s
}
