//! Change tracking: folds source events into state and builds snapshots incrementally
//! (upstream's ServiceChangeTracker + EndpointsChangeTracker + EndpointSliceCache).
//!
//! State is kept per service (`namespace/name`): its built ports and its parsed slices. An
//! event marks its service dirty; [`Tracker::snapshot`] rebuilds only dirty services on top of
//! the previous snapshot — in place when nobody else holds it any more, else on a clone (maps
//! of `Arc`s) — and reports exactly the service ports whose `ServicePort` or endpoints differ.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::ops::Bound;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::endpoints::{ObjectKey, SliceData, merge, parse_slice};
use super::service::{parse_cidr_sloppy, parse_ip_sloppy, service_ports};
use super::service_cidrs::ServiceCidrTracker;
use super::types::{NodeInfo, Protocol, ServicePort, ServicePortName};
use super::{ChangedSet, ModelWarning, Snapshot};
use crate::model::input::{Delta, Event};
use crate::model::vecmap::VecMap;

/// Counts of changes not yet in a snapshot (upstream's `*_changes_pending` metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Pending {
    pub services: usize,
    pub endpoints: usize,
}

type SvcKey = ObjectKey;

/// Folds events into state; builds snapshots.
pub struct Tracker {
    node_name: String,
    /// Built ports per service (shared with the snapshots, not copied into them).
    services: HashMap<SvcKey, Box<[Arc<ServicePort>]>>,
    /// Parsed slices per (namespace, slice name).
    slices: HashMap<SvcKey, SliceData>,
    /// Slice names per service, in name order.
    slices_by_service: HashMap<SvcKey, VecMap<Arc<str>, ()>>,
    node: NodeInfo,
    dirty_services: BTreeSet<SvcKey>,
    dirty_endpoints: BTreeSet<SvcKey>,
    node_dirty: bool,
    synced: [bool; 3],
    /// Keys listed so far by a Service / EndpointSlice list in progress; the Node listed so
    /// far by a Node list in progress.
    listing_services: Option<HashSet<SvcKey>>,
    listing_slices: Option<HashSet<SvcKey>>,
    listing_node: Option<Option<Node>>,
    service_cidrs: ServiceCidrTracker,
    last: Arc<Snapshot>,
    /// The namespace of the last key made: objects arrive grouped by namespace (lists are
    /// sorted), so consecutive keys share one string.
    last_ns: Arc<str>,
}

/// The key of an object (`namespace` defaults to `default`), sharing `last_ns` when the
/// namespace is the same.
fn key(last_ns: &mut Arc<str>, ns: &Option<String>, name: &Option<String>) -> SvcKey {
    let ns = ns.as_deref().unwrap_or("default");
    if *ns != **last_ns {
        *last_ns = Arc::from(ns);
    }
    (
        last_ns.clone(),
        Arc::from(name.as_deref().unwrap_or_default()),
    )
}

/// Keys of `known` a finished list did not hold (`seen`).
fn unlisted<V>(known: &HashMap<SvcKey, V>, seen: &HashSet<SvcKey>) -> Vec<SvcKey> {
    known
        .keys()
        .filter(|k| !seen.contains(*k))
        .cloned()
        .collect()
}

/// The range of snapshot keys belonging to one service.
fn service_range(k: &SvcKey) -> (Bound<ServicePortName>, Bound<ServicePortName>) {
    let lo = ServicePortName::new(&*k.0, &*k.1, String::new(), Protocol::Tcp);
    // The next possible service name: the same name followed by '\0'.
    let hi = ServicePortName::new(&*k.0, format!("{}\0", k.1), String::new(), Protocol::Tcp);
    (Bound::Included(lo), Bound::Excluded(hi))
}

/// The proxy's view of a Node object.
pub(crate) fn node_info(node: &Node, name: &str) -> NodeInfo {
    let labels = node
        .metadata
        .labels
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let status = node.status.as_ref();
    let addresses = status
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
        .filter(|a| a.type_ == "InternalIP" || a.type_ == "ExternalIP")
        .filter_map(|a| parse_ip_sloppy(&a.address))
        .collect();
    let spec = node.spec.as_ref();
    let mut pod_cidrs: Vec<_> = spec
        .and_then(|s| s.pod_cidrs.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| parse_cidr_sloppy(c))
        .collect();
    if pod_cidrs.is_empty()
        && let Some(c) = spec
            .and_then(|s| s.pod_cidr.as_deref())
            .and_then(parse_cidr_sloppy)
    {
        pod_cidrs.push(c);
    }
    NodeInfo {
        name: name.to_owned(),
        labels,
        addresses,
        pod_cidrs,
    }
}

impl Tracker {
    pub fn new(node_name: impl Into<String>) -> Self {
        let node_name = node_name.into();
        let node = NodeInfo {
            name: node_name.clone(),
            ..Default::default()
        };
        Tracker {
            last: Arc::new(Snapshot {
                node: node.clone(),
                ..Default::default()
            }),
            node_name,
            services: HashMap::new(),
            slices: HashMap::new(),
            slices_by_service: HashMap::new(),
            node,
            dirty_services: BTreeSet::new(),
            dirty_endpoints: BTreeSet::new(),
            node_dirty: false,
            synced: [false; 3],
            listing_services: None,
            listing_slices: None,
            listing_node: None,
            service_cidrs: ServiceCidrTracker::default(),
            last_ns: Arc::from("default"),
        }
    }

    /// Folds one source event into state; returns warnings for skipped parts.
    ///
    /// A streamed list ([`Delta::ListStart`] … [`Delta::ListDone`]) is applied as it arrives:
    /// listed objects are upserted at once, and what was not listed is removed at `ListDone`.
    /// A snapshot taken half-way through a re-list therefore shows updated objects before
    /// removed ones disappear — the states a sequence of watch events passes through too.
    /// [`Delta::Replace`] is the same sequence delivered at once.
    pub fn apply(&mut self, event: Event) -> Vec<ModelWarning> {
        let mut warnings = vec![];
        match event {
            Event::Service(d) => match d {
                Delta::Apply(s) => self.upsert_service(&s, &mut warnings),
                Delta::Delete(s) => {
                    let k = key(&mut self.last_ns, &s.metadata.namespace, &s.metadata.name);
                    self.remove_service(k)
                }
                Delta::Replace(all) => {
                    self.listing_services = Some(HashSet::new());
                    for s in &all {
                        self.list_service(s, &mut warnings);
                    }
                    self.finish_service_list();
                }
                Delta::ListStart => self.listing_services = Some(HashSet::new()),
                Delta::Listed(page) => {
                    for s in &page {
                        self.list_service(s, &mut warnings);
                    }
                }
                Delta::ListDone => self.finish_service_list(),
            },
            Event::EndpointSlice(d) => match d {
                Delta::Apply(s) => self.upsert_slice(&s, &mut warnings),
                Delta::Delete(s) => {
                    let k = key(&mut self.last_ns, &s.metadata.namespace, &s.metadata.name);
                    self.remove_slice(&k)
                }
                Delta::Replace(all) => {
                    self.listing_slices = Some(HashSet::new());
                    for s in &all {
                        self.list_slice(s, &mut warnings);
                    }
                    self.finish_slice_list();
                }
                Delta::ListStart => self.listing_slices = Some(HashSet::new()),
                Delta::Listed(page) => {
                    for s in &page {
                        self.list_slice(s, &mut warnings);
                    }
                }
                Delta::ListDone => self.finish_slice_list(),
            },
            Event::ServiceCidr(d) => warnings.extend(self.service_cidrs.apply(d)),
            Event::Node(d) => {
                // `Some(state)`: the node's state is now known to be `state`.
                let node = match d {
                    Delta::Apply(n) => Some(Some(n)),
                    Delta::Delete(_) => Some(None),
                    Delta::Replace(all) => {
                        self.synced[2] = true;
                        Some(all.into_iter().find(|n| self.is_this_node(n)))
                    }
                    Delta::ListStart => {
                        self.listing_node = Some(None);
                        None
                    }
                    Delta::Listed(page) => {
                        if let Some(n) = page.into_iter().find(|n| self.is_this_node(n)) {
                            self.listing_node = Some(Some(n));
                        }
                        None
                    }
                    Delta::ListDone => {
                        self.synced[2] = true;
                        Some(self.listing_node.take().flatten())
                    }
                };
                let Some(node) = node else {
                    return warnings;
                };
                if let Some(n) = &node
                    && !self.is_this_node(n)
                {
                    return warnings; // not this node
                }
                let info = match node {
                    Some(n) => node_info(&n, &self.node_name),
                    None => NodeInfo {
                        name: self.node_name.clone(),
                        ..Default::default()
                    },
                };
                if info != self.node {
                    self.node = info;
                    self.node_dirty = true;
                }
            }
        }
        warnings
    }

    fn is_this_node(&self, n: &Node) -> bool {
        n.metadata.name.as_deref() == Some(self.node_name.as_str())
    }

    /// One object of a Service list: upserted, and remembered as still present.
    fn list_service(&mut self, s: &Service, warnings: &mut Vec<ModelWarning>) {
        if let Some(seen) = &mut self.listing_services {
            seen.insert(key(
                &mut self.last_ns,
                &s.metadata.namespace,
                &s.metadata.name,
            ));
        }
        self.upsert_service(s, warnings);
    }

    /// The Service list is complete: services it did not hold are gone.
    fn finish_service_list(&mut self) {
        let seen = self.listing_services.take().unwrap_or_default();
        for k in unlisted(&self.services, &seen) {
            self.remove_service(k);
        }
        self.synced[0] = true;
    }

    /// One object of an EndpointSlice list: upserted, and remembered as still present.
    fn list_slice(&mut self, s: &EndpointSlice, warnings: &mut Vec<ModelWarning>) {
        if let Some(seen) = &mut self.listing_slices {
            seen.insert(key(
                &mut self.last_ns,
                &s.metadata.namespace,
                &s.metadata.name,
            ));
        }
        self.upsert_slice(s, warnings);
    }

    /// The EndpointSlice list is complete: slices it did not hold are gone.
    fn finish_slice_list(&mut self) {
        let seen = self.listing_slices.take().unwrap_or_default();
        for k in unlisted(&self.slices, &seen) {
            self.remove_slice(&k);
        }
        self.synced[1] = true;
    }

    fn upsert_service(&mut self, s: &Service, warnings: &mut Vec<ModelWarning>) {
        let k = key(&mut self.last_ns, &s.metadata.namespace, &s.metadata.name);
        let (ports, w) = service_ports(s);
        warnings.extend(w);
        let old = self.services.get(&k).map(|v| &**v).unwrap_or(&[]);
        if old.len() == ports.len() && old.iter().zip(&ports).all(|(a, b)| **a == *b) {
            return;
        }
        self.dirty_services.insert(k.clone());
        if ports.is_empty() {
            self.services.remove(&k);
        } else {
            // A boxed slice: a Vec collected in place would keep the ServicePorts' capacity.
            let ports: Box<[Arc<ServicePort>]> = ports.into_iter().map(Arc::new).collect();
            self.services.insert(k, ports);
        }
    }

    fn remove_service(&mut self, k: SvcKey) {
        if self.services.remove(&k).is_some() {
            self.dirty_services.insert(k);
        }
    }

    fn upsert_slice(&mut self, s: &EndpointSlice, warnings: &mut Vec<ModelWarning>) {
        let sk = key(&mut self.last_ns, &s.metadata.namespace, &s.metadata.name);
        let (data, w) = parse_slice(s, &self.node_name);
        warnings.extend(w);
        match data {
            None => self.remove_slice(&sk),
            Some(mut data) => {
                // Share the strings of keys already held (the service's, the slice's).
                if let Some((k, _)) = self.services.get_key_value(&data.service) {
                    data.service = k.clone();
                } else if data.service.0 == sk.0 {
                    data.service.0 = sk.0.clone();
                }
                if self.slices.get(&sk) == Some(&data) {
                    return;
                }
                // A slice whose service label changed moves between services.
                if let Some(old) = self.slices.get(&sk)
                    && old.service != data.service
                {
                    self.remove_slice(&sk);
                }
                self.dirty_endpoints.insert(data.service.clone());
                self.slices_by_service
                    .entry(data.service.clone())
                    .or_default()
                    .insert(sk.1.clone(), ());
                self.slices.insert(sk, data);
            }
        }
    }

    fn remove_slice(&mut self, sk: &SvcKey) {
        if let Some(old) = self.slices.remove(sk) {
            if let Some(names) = self.slices_by_service.get_mut(&old.service) {
                names.remove(&sk.1);
                if names.is_empty() {
                    self.slices_by_service.remove(&old.service);
                }
            }
            self.dirty_endpoints.insert(old.service);
        }
    }

    /// True once Services, EndpointSlices and Node each received their first `Delta::Replace`.
    pub(crate) fn is_synced(&self) -> bool {
        self.synced.iter().all(|s| *s)
    }

    /// The service CIDRs changed and no snapshot has them yet.
    pub(crate) fn service_cidrs_pending(&self) -> bool {
        self.service_cidrs.is_changed()
    }

    /// Service/endpoint changes not yet in a snapshot.
    pub(crate) fn pending(&self) -> Pending {
        Pending {
            services: self.dirty_services.len(),
            endpoints: self.dirty_endpoints.len(),
        }
    }

    /// Builds the next snapshot and the set of service ports that differ from the previous one.
    pub fn snapshot(&mut self) -> (Arc<Snapshot>, ChangedSet) {
        // In place when nothing else holds the last snapshot (the runner drops its copy before
        // asking): copying 10k-entry maps costs more than a one-change sync.
        let mut arc = std::mem::take(&mut self.last);
        let next: &mut Snapshot = Arc::make_mut(&mut arc);
        next.generation += 1;
        let mut changed = ChangedSet::default();
        if self.node_dirty {
            next.node = self.node.clone();
            changed.node = true;
        }
        if self.service_cidrs.take_changed() {
            next.service_cidrs = self.service_cidrs.cidrs();
        }
        let dirty: BTreeSet<SvcKey> = std::mem::take(&mut self.dirty_services)
            .into_iter()
            .chain(std::mem::take(&mut self.dirty_endpoints))
            .collect();
        for k in &dirty {
            let range = service_range(k);
            let old_svcs: BTreeMap<ServicePortName, Arc<ServicePort>> = next
                .services
                .range(range.clone())
                .map(|(a, b)| (a.clone(), b.clone()))
                .collect();
            let old_eps: BTreeMap<ServicePortName, Arc<Vec<super::Endpoint>>> = next
                .endpoints
                .range(range)
                .map(|(a, b)| (a.clone(), b.clone()))
                .collect();
            for n in old_svcs.keys() {
                next.services.remove(n);
            }
            for n in old_eps.keys() {
                next.endpoints.remove(n);
            }
            for p in self.services.get(k).map(|v| v.iter()).into_iter().flatten() {
                let arc = match old_svcs.get(&p.name) {
                    Some(old) if Arc::ptr_eq(old, p) || **old == **p => old.clone(),
                    _ => {
                        changed.services.insert(p.name.clone());
                        p.clone()
                    }
                };
                next.services.insert(p.name.clone(), arc);
            }
            let slices = self
                .slices_by_service
                .get(k)
                .into_iter()
                .flat_map(VecMap::keys)
                .filter_map(|n| self.slices.get(&(k.0.clone(), n.clone())));
            for (n, eps) in merge(slices) {
                let arc = match old_eps.get(&n) {
                    Some(old) if **old == *eps => old.clone(),
                    _ => {
                        changed.services.insert(n.clone());
                        eps
                    }
                };
                next.endpoints.insert(n, arc);
            }
            for n in old_svcs.keys() {
                if !next.services.contains_key(n) {
                    changed.services.insert(n.clone());
                }
            }
            for n in old_eps.keys() {
                if !next.endpoints.contains_key(n) {
                    changed.services.insert(n.clone());
                }
            }
        }
        self.node_dirty = false;
        self.last = arc;
        (self.last.clone(), changed)
    }
}
