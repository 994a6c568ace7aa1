//! EndpointSlice → [`Endpoint`]s, merged per service port like upstream's EndpointSliceCache
//! (pkg/proxy/endpointslicecache.go).
//!
//! - a slice belongs to the service named by its `kubernetes.io/service-name` label (missing:
//!   the slice is skipped with a warning); `addressType: FQDN` slices are ignored;
//! - ports are matched to service ports by name and protocol (unset name = unnamed port,
//!   unset protocol = TCP); the DNAT target is the slice's port;
//! - per endpoint only `addresses[0]` is used (parsed like Go's ParseIPSloppy); conditions
//!   default as upstream's code does: ready unset ⇒ true, serving unset ⇒ true, terminating
//!   unset ⇒ false (the API documents "serving unset ⇒ ready"; the two differ only for
//!   not-ready endpoints without a serving condition, where kproxy follows upstream's code);
//! - the same `IP:port` in several slices is kept once: the first in slice-name order, unless
//!   a later copy is local (upstream prefers a local copy).
//!
//! A parsed slice already holds its endpoints in that merged form (sorted, deduplicated) behind
//! an `Arc`, so a service port served by one slice — the usual case — shares one list between
//! the tracker and the snapshot instead of holding two copies.

use std::collections::BTreeMap;
use std::sync::Arc;

use k8s_openapi::api::discovery::v1::EndpointSlice;

use super::service::parse_ip_sloppy;
use super::types::{Endpoint, Hints, Protocol, ServicePortName};
use super::warning::ModelWarning;

/// Label naming a slice's service.
pub(crate) const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// `(namespace, name)` of an object, as the tracker keys services and slices (shared strings:
/// a service's key is held by several maps at once).
pub(crate) type ObjectKey = (Arc<str>, Arc<str>);

/// One slice, parsed: its service and endpoints per service port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SliceData {
    /// (namespace, service name)
    pub service: ObjectKey,
    /// Endpoints per port, in the slice's port order (a Vec, not a map: a slice has one or a
    /// few ports, and the tracker keeps one `SliceData` per slice in the cluster).
    pub ports: Vec<(ServicePortName, Arc<Vec<Endpoint>>)>,
}

/// Parses one slice; `None` when it cannot be attributed to a service (with a warning) or is
/// ignored by design (FQDN).
pub(crate) fn parse_slice(
    slice: &EndpointSlice,
    node_name: &str,
) -> (Option<SliceData>, Vec<ModelWarning>) {
    let ns = slice
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "default".into());
    let name = slice.metadata.name.clone().unwrap_or_default();
    let object = format!("EndpointSlice {ns}/{name}");
    let mut warnings = vec![];
    let mut warn =
        |field: String, reason: String| warnings.push(ModelWarning::new(&object, field, reason));
    let Some(service) = slice
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .filter(|s| !s.is_empty())
    else {
        warn(
            format!("metadata.labels[\"{SERVICE_NAME_LABEL}\"]"),
            "missing: the slice belongs to no service; skipped".into(),
        );
        return (None, warnings);
    };
    match slice.address_type.as_str() {
        "IPv4" | "IPv6" => {}
        "FQDN" => return (None, warnings),
        other => {
            warn(
                "addressType".into(),
                format!("unknown address type {other:?}; slice skipped"),
            );
            return (None, warnings);
        }
    }

    let mut endpoints = vec![];
    let mut names = Shared::default();
    for (i, ep) in slice.endpoints.iter().flatten().enumerate() {
        if let Some(e) = parse_endpoint(i, ep, node_name, &mut names, &mut warn) {
            endpoints.push(e);
        }
    }

    let mut ports = Vec::with_capacity(slice.ports.as_ref().map_or(0, Vec::len));
    for (i, p) in slice.ports.iter().flatten().enumerate() {
        let Some((protocol, port)) = parse_port(i, p, &mut warn) else {
            continue;
        };
        let spn = ServicePortName::new(
            ns.clone(),
            service.clone(),
            p.name.clone().unwrap_or_default(),
            protocol,
        );
        let eps = Arc::new(canonical(
            endpoints.iter().map(|e| Endpoint { port, ..e.clone() }),
        ));
        // A port listed twice keeps its last entry, as a map insert did.
        match ports.iter_mut().find(|(k, _)| *k == spn) {
            Some((_, old)) => *old = eps,
            None => ports.push((spn, eps)),
        }
    }
    (
        Some(SliceData {
            service: (Arc::from(ns), Arc::from(service.as_str())),
            ports,
        }),
        warnings,
    )
}

/// The node names and zones of one slice's endpoints so far: an endpoint on the same node or
/// zone as an earlier one shares its string.
#[derive(Default)]
struct Shared(Vec<Arc<str>>);

impl Shared {
    fn get(&mut self, s: Option<&String>) -> Option<Arc<str>> {
        let s = s?;
        if let Some(known) = self.0.iter().find(|k| ***k == **s) {
            return Some(known.clone());
        }
        let new: Arc<str> = Arc::from(s.as_str());
        // A slice holds up to 100 endpoints (1000 at most): a short list, searched linearly.
        self.0.push(new.clone());
        Some(new)
    }
}

/// `endpoints[i]` of a slice (its port set later); `None` when it has no usable address.
fn parse_endpoint(
    i: usize,
    ep: &k8s_openapi::api::discovery::v1::Endpoint,
    node_name: &str,
    names: &mut Shared,
    warn: &mut impl FnMut(String, String),
) -> Option<Endpoint> {
    // Upstream ignores endpoints without addresses.
    let raw = ep.addresses.first()?;
    let Some(ip) = parse_ip_sloppy(raw.trim()) else {
        warn(
            format!("endpoints[{i}].addresses[0]"),
            format!("invalid IP {raw:?}; endpoint skipped"),
        );
        return None;
    };
    let c = ep.conditions.as_ref();
    let ready = c.and_then(|c| c.ready).unwrap_or(true);
    let serving = c.and_then(|c| c.serving).unwrap_or(true);
    let terminating = c.and_then(|c| c.terminating).unwrap_or(false);
    let hints = ep.hints.as_ref();
    let zone_hints: Hints = hints
        .and_then(|h| h.for_zones.as_ref())
        .into_iter()
        .flatten()
        .map(|z| z.name.as_str())
        .collect();
    let node_hints: Hints = hints
        .and_then(|h| h.for_nodes.as_ref())
        .into_iter()
        .flatten()
        .map(|n| n.name.as_str())
        .collect();
    Some(Endpoint {
        ip,
        port: 0,
        ready,
        serving,
        terminating,
        is_local: ep.node_name.as_deref() == Some(node_name),
        node_name: names.get(ep.node_name.as_ref()),
        zone: names.get(ep.zone.as_ref()),
        zone_hints,
        node_hints,
    })
}

/// `ports[i]` of a slice: its protocol and port; `None` (port skipped) when either is unusable.
fn parse_port(
    i: usize,
    p: &k8s_openapi::api::discovery::v1::EndpointPort,
    warn: &mut impl FnMut(String, String),
) -> Option<(Protocol, u16)> {
    let Some(protocol) = Protocol::parse(p.protocol.as_deref()) else {
        warn(
            format!("ports[{i}].protocol"),
            format!(
                "unknown protocol {:?}; port skipped",
                p.protocol.as_deref().unwrap_or("")
            ),
        );
        return None;
    };
    let port = match p.port.map(u16::try_from) {
        Some(Ok(port)) if port != 0 => port,
        other => {
            let shown = p.port.map_or("unset".to_string(), |v| v.to_string());
            let _ = other;
            warn(
                format!("ports[{i}].port"),
                format!("{shown} is not a port in 1-65535; port skipped"),
            );
            return None;
        }
    };
    Some((protocol, port))
}

/// Endpoints (in slice-name order) deduplicated by `IP:port` and sorted: the first copy wins
/// unless a later one is local.
fn canonical(eps: impl IntoIterator<Item = Endpoint>) -> Vec<Endpoint> {
    let mut set: BTreeMap<(std::net::IpAddr, u16), Endpoint> = BTreeMap::new();
    for e in eps {
        let key = (e.ip, e.port);
        match set.get(&key) {
            Some(_) if !e.is_local => {}
            _ => {
                set.insert(key, e);
            }
        }
    }
    set.into_values().collect()
}

/// Merges the slices of one service (given in slice-name order) into endpoints per port,
/// deduplicated by `IP:port` and sorted. A port only one slice serves gets that slice's list
/// itself (shared, not copied).
pub(crate) fn merge<'a>(
    slices: impl IntoIterator<Item = &'a SliceData>,
) -> BTreeMap<ServicePortName, Arc<Vec<Endpoint>>> {
    let mut by_port: BTreeMap<&ServicePortName, Vec<&Arc<Vec<Endpoint>>>> = BTreeMap::new();
    for s in slices {
        for (spn, eps) in &s.ports {
            by_port.entry(spn).or_default().push(eps);
        }
    }
    by_port
        .into_iter()
        .map(|(spn, lists)| {
            let eps = match lists.as_slice() {
                [one] => Arc::clone(one),
                _ => Arc::new(canonical(lists.into_iter().flat_map(|l| l.iter().cloned()))),
            };
            (spn.clone(), eps)
        })
        .collect()
}
