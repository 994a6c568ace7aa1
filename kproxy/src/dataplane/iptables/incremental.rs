//! The incremental planner: [`plan`](super::plan::plan)'s output without re-planning every
//! service port on every sync.
//!
//! ## Why
//! Planning a service port formats its rules and hashes its chain names (sha256 + base32 per
//! service port and per endpoint). At 10,000 services × 5 endpoints that is ~70k hashes and
//! ~160k formatted lines: most of a partial sync's CPU when one endpoint changed.
//!
//! ## The cache
//! One [`PortPlan`] per service port of the proxier's family, keyed by [`ServicePortName`]:
//! the port's rules in the shared chains (filter KUBE-SERVICES / KUBE-EXTERNAL-SERVICES /
//! KUBE-NODEPORTS / KUBE-PROXY-FIREWALL, nat KUBE-SERVICES / KUBE-NODEPORTS) and its own
//! SVC/SVL/EXT/FW/SEP chains. Each entry remembers the inputs it was planned from: the
//! snapshot's `Arc<ServicePort>` and `Arc<Vec<Endpoint>>`. A port plan is a pure function of
//! those two plus the *global* inputs: the [`IptablesConfig`], the node
//! ([`NodeInfo`]: topology labels) and large-cluster mode.
//!
//! [`IncrementalPlanner::update`] walks the snapshot's service ports and re-plans a port only
//! when its service or endpoints differ from the remembered ones (same `Arc`, or equal
//! values: so it does not rely on the tracker's [`ChangedSet`] being
//! complete); entries of ports no longer in the snapshot are dropped. Partial syncs call
//! [`IncrementalPlanner::update_changed`] instead, which looks only at the ports the change
//! set names (the walk over every port costs ≈ 10 ms at 10,000 services); the next full sync's
//! `update` catches anything the set missed. Everything is re-planned
//! (the cache is rebuilt) when a global input differs from the one the cache was built with:
//! - the config (any field: e.g. the masquerade bit, the local-traffic detector, nfacct
//!   counters, `--nodeport-addresses` and the detected local addresses),
//! - the node object,
//! - large-cluster mode flipping (the total endpoint count crossing the threshold: every SEP
//!   and SVC rule gains or loses its comment).
//!
//! ## Why the output is still upstream's
//! The cache stores exactly what [`plan_port`] returns, and [`plan`](super::plan::plan) is
//! itself "plan every port with [`plan_port`], then [`assemble`]": the from-scratch planner
//! and the incremental one share every line of rule-writing code and differ only in *which*
//! port plans are recomputed. Assembly concatenates the shared-chain rules in snapshot order
//! (the order upstream's loop over services uses) between the fixed head and tail rules, so
//! the restore text is byte-identical. The property test below checks
//! `IncrementalPlanner::plan() == plan(snapshot)` after random sequences of snapshot changes
//! (services and endpoints added, changed and removed, node and config changes, crossing the
//! large-cluster threshold).

use std::collections::{BTreeMap, HashSet};
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{ChangedSet, Endpoint, NodeInfo, ServicePort, ServicePortName, Snapshot};

use super::config::IptablesConfig;
use super::plan::{
    PortContext, PortPlan, RulesPlan, ServiceKey, add_port_shared, family_endpoint_count,
    is_large_cluster, plan_head, plan_port, plan_tail,
};
use crate::model::Protocol;

/// One cached service port.
#[derive(Debug, Clone)]
struct Cached {
    svc: Arc<ServicePort>,
    eps: Option<Arc<Vec<Endpoint>>>,
    plan: PortPlan,
}

fn same_arc<T: PartialEq>(a: &Arc<T>, b: &Arc<T>) -> bool {
    Arc::ptr_eq(a, b) || **a == **b
}

fn same_eps(a: Option<&Arc<Vec<Endpoint>>>, b: Option<&Arc<Vec<Endpoint>>>) -> bool {
    match (a, b) {
        (None, None) => true,
        (Some(a), Some(b)) => same_arc(a, b),
        // No entry and an empty entry plan the same.
        (None, Some(e)) | (Some(e), None) => e.is_empty(),
    }
}

/// Whether two plans of one port put the same rules into the shared chains (so the assembled
/// shared chains do not change when one replaces the other; the counters are summed again on
/// every [`IncrementalPlanner::refresh_shared`]).
fn same_shared_rules(a: &PortPlan, b: &PortPlan) -> bool {
    a.filter == b.filter && a.nat == b.nat
}

/// Advances the sorted `it` past the keys before `key` and returns the value at `key`, if any.
fn seek<'a, V>(
    it: &mut std::iter::Peekable<impl Iterator<Item = (&'a ServicePortName, &'a V)>>,
    key: &ServicePortName,
) -> Option<&'a V> {
    while it.next_if(|(k, _)| *k < key).is_some() {}
    it.next_if(|(k, _)| *k == key).map(|(_, v)| v)
}

/// What the last [`IncrementalPlanner::update`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UpdateStats {
    /// Service ports planned (again).
    pub replanned: usize,
    /// Every port was planned (first run or a global input changed).
    pub from_scratch: bool,
}

/// Cached per-service-port plans of one family (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct IncrementalPlanner {
    /// The global inputs the cache was built with (`None`: empty cache).
    cfg: Option<IptablesConfig>,
    node: NodeInfo,
    large_cluster: bool,
    total_endpoints: usize,
    ports: BTreeMap<ServicePortName, Cached>,
    /// The shared chains assembled from `ports` ([`Self::shared`]); `None` when a port's
    /// shared rules or counters changed since they were assembled.
    shared: Option<RulesPlan>,
}

/// A port to (re)plan.
struct Todo<'a> {
    svc: &'a Arc<ServicePort>,
    cluster_ip: IpAddr,
    eps: Option<&'a Arc<Vec<Endpoint>>>,
}

impl IncrementalPlanner {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Brings the cache up to date with `snap` under `cfg`.
    pub(crate) fn update(&mut self, snap: &Snapshot, cfg: &IptablesConfig) -> UpdateStats {
        let globals_same = self.cfg.as_ref() == Some(cfg) && self.node == snap.node;
        let (mut todo, mut total, matched) = self.classify(snap, cfg, !globals_same);
        let large = is_large_cluster(total, cfg);
        let mut from_scratch = !globals_same;
        if !from_scratch && large != self.large_cluster {
            (todo, total, _) = self.classify(snap, cfg, true);
            from_scratch = true;
        }
        if from_scratch {
            self.ports.clear();
            self.shared = None;
        } else if matched < self.ports.len() {
            self.shared = None;
            let family = cfg.family;
            self.ports.retain(|name, _| {
                snap.services
                    .get(name)
                    .is_some_and(|s| s.cluster_ip(family).is_some())
            });
        }
        self.plan_todo(snap, cfg, large, &todo);
        if !globals_same {
            self.cfg = Some(cfg.clone());
            self.node = snap.node.clone();
        }
        self.large_cluster = large;
        self.total_endpoints = total;
        UpdateStats {
            replanned: todo.len(),
            from_scratch,
        }
    }

    /// [`Self::update`] for a partial sync: looks only at the service ports `changed` names
    /// instead of walking every port (≈ 10 ms at 10,000 services, most of a partial sync's
    /// planning). Exact when `changed` names every service port changed since the previous
    /// update, the contract the proxier's partial syncs already rely on to choose the chains
    /// they rewrite; a full sync calls [`Self::update`], which checks every port, so a change
    /// the set missed is planned by the next full sync at the latest (as upstream's full
    /// syncs repair what partial ones skipped). Falls back to [`Self::update`] when a global
    /// input changed or large-cluster mode would flip.
    pub(crate) fn update_changed(
        &mut self,
        snap: &Snapshot,
        cfg: &IptablesConfig,
        changed: &ChangedSet,
    ) -> UpdateStats {
        if self.cfg.as_ref() != Some(cfg) || self.node != snap.node {
            return self.update(snap, cfg);
        }
        let family = cfg.family;
        let mut total = self.total_endpoints;
        let mut todo = vec![];
        let mut removed = vec![];
        for name in &changed.services {
            let svc = snap
                .services
                .get(name)
                .and_then(|s| Some((s, s.cluster_ip(family)?)));
            let cached = self.ports.get(name);
            let Some((svc, cluster_ip)) = svc else {
                if let Some(c) = cached {
                    total -= c.plan.endpoints;
                    removed.push(name);
                }
                continue;
            };
            let eps = snap.endpoints.get(name);
            if let Some(c) = cached {
                if same_arc(&c.svc, svc) && same_eps(c.eps.as_ref(), eps) {
                    continue;
                }
                total -= c.plan.endpoints;
            }
            let eps_slice = eps.map(|e| e.as_slice()).unwrap_or(&[]);
            total += family_endpoint_count(eps_slice, family);
            todo.push(Todo {
                svc,
                cluster_ip,
                eps,
            });
        }
        let large = is_large_cluster(total, cfg);
        if large != self.large_cluster {
            return self.update(snap, cfg);
        }
        if !removed.is_empty() {
            self.shared = None;
            for name in removed {
                self.ports.remove(name);
            }
        }
        self.plan_todo(snap, cfg, large, &todo);
        self.total_endpoints = total;
        UpdateStats {
            replanned: todo.len(),
            from_scratch: false,
        }
    }

    /// Plans `todo` into the cache (dropping the shared chains when a port's part changed).
    fn plan_todo(&mut self, snap: &Snapshot, cfg: &IptablesConfig, large: bool, todo: &[Todo]) {
        let ctx = PortContext {
            cfg,
            node: &snap.node,
            large_cluster: large,
        };
        for t in todo {
            let eps = t.eps.map(|e| e.as_slice()).unwrap_or(&[]);
            let plan = plan_port(&ctx, t.svc, t.cluster_ip, eps);
            let old = self.ports.insert(
                t.svc.name.clone(),
                Cached {
                    svc: t.svc.clone(),
                    eps: t.eps.cloned(),
                    plan,
                },
            );
            let new = &self.ports[&t.svc.name].plan;
            if !old.is_some_and(|o| same_shared_rules(&o.plan, new)) {
                self.shared = None;
            }
        }
    }

    /// The family's ports of `snap` that need planning (all if `all`), the total endpoint
    /// count, and how many cache entries are still in the snapshot.
    fn classify<'a>(
        &self,
        snap: &'a Snapshot,
        cfg: &IptablesConfig,
        all: bool,
    ) -> (Vec<Todo<'a>>, usize, usize) {
        let mut todo = vec![];
        let mut total = 0;
        let mut matched = 0;
        // The snapshot's services, its endpoints and the cache are all sorted by service port
        // name: walk them side by side (one pass) instead of two map lookups per port (a
        // third of a partial sync's planning time at 10,000 services).
        let mut endpoints = snap.endpoints.iter().peekable();
        let mut cache = self.ports.iter().peekable();
        for (name, svc) in &snap.services {
            let Some(cluster_ip) = svc.cluster_ip(cfg.family) else {
                continue;
            };
            debug_assert_eq!(name, &svc.name, "snapshot keyed by service port name");
            let eps = seek(&mut endpoints, name);
            let eps_slice = eps.map(|e| e.as_slice()).unwrap_or(&[]);
            let cached = seek(&mut cache, name).filter(|_| !all);
            if cached.is_some() {
                matched += 1;
            }
            match cached {
                Some(c) if same_arc(&c.svc, svc) && same_eps(c.eps.as_ref(), eps) => {
                    total += c.plan.endpoints;
                }
                _ => {
                    total += family_endpoint_count(eps_slice, cfg.family);
                    todo.push(Todo {
                        svc,
                        cluster_ip,
                        eps,
                    });
                }
            }
        }
        (todo, total, matched)
    }

    /// Endpoints of the family's service ports as of the last update.
    #[cfg(test)]
    pub fn total_endpoints(&self) -> usize {
        self.total_endpoints
    }

    /// Every cached port plan, in snapshot order.
    pub(crate) fn ports(&self) -> impl Iterator<Item = (&ServicePortName, &PortPlan)> {
        self.ports.iter().map(|(n, c)| (n, &c.plan))
    }

    /// The port plans of one service, in snapshot order.
    pub(crate) fn service_ports<'a>(
        &'a self,
        key: &ServiceKey,
    ) -> impl Iterator<Item = &'a PortPlan> + 'a {
        // The smallest name of the service: empty port name, the first protocol.
        let start =
            ServicePortName::new(key.0.clone(), key.1.clone(), String::new(), Protocol::Tcp);
        let (ns, name) = (key.0.clone(), key.1.clone());
        self.ports
            .range(start..)
            .take_while(move |(n, _)| n.namespace == ns && n.name == name)
            .map(|(_, c)| &c.plan)
    }

    /// Every per-service chain of the cached plans.
    pub(crate) fn active_chains(&self) -> HashSet<&str> {
        self.ports
            .values()
            .flat_map(|c| c.plan.chains.chains.iter().map(|ch| ch.name.as_str()))
            .collect()
    }

    /// The shared chains (filter table and nat KUBE-SERVICES & co.) with their complete rules
    /// and the counters, as [`Self::shared`] after [`Self::refresh_shared`].
    #[cfg(test)]
    pub fn shared_plan(&mut self, cfg: &IptablesConfig) -> &RulesPlan {
        self.refresh_shared(cfg);
        self.shared()
    }

    /// Assembles the shared chains again if a port's part of them changed since the last
    /// assembly. Assembling copies every port's KUBE-SERVICES rules (≈ 10 ms at 10,000
    /// services), so a sync that changed only endpoints behind existing services reuses the
    /// previous assembly: a port's shared rules are a function of its own plan, and the
    /// head and tail ones of `cfg`, which an [`Self::update`] with a different config
    /// re-plans from scratch.
    pub(crate) fn refresh_shared(&mut self, cfg: &IptablesConfig) {
        if self.cfg.as_ref() == Some(cfg)
            && let Some(p) = &mut self.shared
        {
            // The rules are still right; the counters are cheap to sum again.
            (
                p.total_endpoints,
                p.service_ports,
                p.no_local_endpoints_internal,
                p.no_local_endpoints_external,
            ) = (0, 0, 0, 0);
            for c in self.ports.values() {
                p.total_endpoints += c.plan.endpoints;
                p.service_ports += 1;
                p.no_local_endpoints_internal += usize::from(c.plan.no_local_internal);
                p.no_local_endpoints_external += usize::from(c.plan.no_local_external);
            }
            return;
        }
        let mut p = plan_head(cfg);
        p.large_cluster = self.large_cluster;
        for c in self.ports.values() {
            add_port_shared(&mut p, &c.plan);
        }
        plan_tail(&mut p, cfg);
        self.shared = Some(p);
    }

    /// The shared chains as of the last [`Self::refresh_shared`] ([`RulesPlan::services`] is left
    /// empty: the per-service chains are read from [`Self::ports`] /
    /// [`Self::service_ports`]).
    ///
    /// # Panics
    /// Before the first [`Self::refresh_shared`] or after an [`Self::update`] that changed
    /// the shared part without a refresh.
    pub(crate) fn shared(&self) -> &RulesPlan {
        self.shared
            .as_ref()
            .expect("refresh_shared after update, before shared")
    }

    /// The complete plan (what [`plan`](super::plan::plan) gives for the last snapshot).
    #[cfg(test)]
    pub fn plan(&self, cfg: &IptablesConfig) -> RulesPlan {
        super::plan::assemble(cfg, self.large_cluster, self.ports())
    }
}

#[cfg(test)]
mod tests;
