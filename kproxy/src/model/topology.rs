//! Upstream `CategorizeEndpoints` (pkg/proxy/topology.go): which endpoints serve cluster
//! traffic, which serve node-local traffic, and which are reachable at all.
//!
//! Rules (upstream's newest topology.go):
//! - cluster endpoints (when the service uses them, `ServicePort::uses_cluster_endpoints`):
//!   the ready endpoints, narrowed by topology hints when every ready endpoint has a hint and
//!   some hint matches this node (PreferSameNode, gated by `PREFER_SAME_TRAFFIC_DISTRIBUTION`)
//!   or this node's zone (PreferSameZone); if none is ready, the serving+terminating ones
//!   (topology ignored);
//! - local endpoints (when `ServicePort::uses_local_endpoints`): the local ready ones, else
//!   the local serving+terminating ones; topology never applies;
//! - all reachable: the cluster set when it is a superset of the local one (no topology, no
//!   terminating fallback), else their union.

use std::collections::BTreeMap;

use serde::Serialize;

use super::types::{Endpoint, NodeInfo, ServicePort};

/// Upstream's `PreferSameTrafficDistribution` feature gate (GA, on by default since v1.34):
/// node hints select same-node endpoints.
pub(crate) const PREFER_SAME_TRAFFIC_DISTRIBUTION: bool = true;

/// Result of [`categorize_endpoints`], upstream's four return values.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CategorizedEndpoints {
    /// `None`: the service never uses cluster endpoints; `Some(empty)`: uses them, none usable.
    pub cluster: Option<Vec<Endpoint>>,
    /// `None`: the service never uses local endpoints; `Some(empty)`: uses them, none usable.
    pub local: Option<Vec<Endpoint>>,
    /// Every endpoint any traffic to the service may reach (per-endpoint rules are made for these).
    pub all_reachable: Vec<Endpoint>,
    /// Whether the service has any usable endpoint at all (else: reject).
    pub has_any_endpoints: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TopologyMode {
    None,
    PreferSameZone,
    PreferSameNode,
}

fn topology_mode(endpoints: &[Endpoint], node: &NodeInfo) -> TopologyMode {
    let ready: Vec<&Endpoint> = endpoints.iter().filter(|e| e.ready).collect();
    if ready.is_empty() {
        return TopologyMode::None;
    }
    if PREFER_SAME_TRAFFIC_DISTRIBUTION
        && ready.iter().all(|e| !e.node_hints.is_empty())
        && ready.iter().any(|e| e.node_hints.contains(&node.name))
    {
        return TopologyMode::PreferSameNode;
    }
    if let Some(zone) = node.zone()
        && ready.iter().all(|e| !e.zone_hints.is_empty())
        && ready.iter().any(|e| e.zone_hints.contains(zone))
    {
        return TopologyMode::PreferSameZone;
    }
    TopologyMode::None
}

/// Upstream `CategorizeEndpoints(endpoints, svcInfo, nodeName, nodeLabels)`.
pub fn categorize_endpoints(
    endpoints: &[Endpoint],
    svc: &ServicePort,
    node: &NodeInfo,
) -> CategorizedEndpoints {
    let mut mode = TopologyMode::None;
    let mut cluster: Option<Vec<Endpoint>> = None;
    let mut has_any = false;
    if svc.uses_cluster_endpoints() {
        mode = topology_mode(endpoints, node);
        let available = |e: &&Endpoint| match mode {
            TopologyMode::None => true,
            TopologyMode::PreferSameZone => node.zone().is_some_and(|z| e.zone_hints.contains(z)),
            TopologyMode::PreferSameNode => e.node_hints.contains(&node.name),
        };
        let mut c: Vec<Endpoint> = endpoints
            .iter()
            .filter(|e| e.ready)
            .filter(available)
            .cloned()
            .collect();
        if c.is_empty() {
            c = endpoints
                .iter()
                .filter(|e| e.serving && e.terminating)
                .cloned()
                .collect();
        }
        has_any = !c.is_empty();
        cluster = Some(c);
    }
    if !svc.uses_local_endpoints() {
        let all = cluster.clone().unwrap_or_default();
        return CategorizedEndpoints {
            cluster,
            local: None,
            all_reachable: all,
            has_any_endpoints: has_any,
        };
    }
    let mut has_local_ready = false;
    let mut has_local_serving_terminating = false;
    for e in endpoints {
        if e.ready {
            has_any = true;
            has_local_ready |= e.is_local;
        } else if e.serving && e.terminating {
            has_any = true;
            has_local_serving_terminating |= e.is_local;
        }
    }
    let mut use_serving_terminating = false;
    let local: Vec<Endpoint> = if has_local_ready {
        endpoints
            .iter()
            .filter(|e| e.is_local && e.ready)
            .cloned()
            .collect()
    } else if has_local_serving_terminating {
        use_serving_terminating = true;
        endpoints
            .iter()
            .filter(|e| e.is_local && e.serving && e.terminating)
            .cloned()
            .collect()
    } else {
        vec![]
    };
    let Some(cluster_eps) = cluster.as_ref() else {
        return CategorizedEndpoints {
            cluster: None,
            all_reachable: local.clone(),
            local: Some(local),
            has_any_endpoints: has_any,
        };
    };
    let all_reachable = if mode == TopologyMode::None && !use_serving_terminating {
        cluster_eps.clone()
    } else {
        let mut by_addr: BTreeMap<String, Endpoint> = BTreeMap::new();
        for e in cluster_eps.iter().chain(local.iter()) {
            by_addr.entry(e.addr()).or_insert_with(|| e.clone());
        }
        by_addr.into_values().collect()
    };
    CategorizedEndpoints {
        cluster,
        local: Some(local),
        all_reachable,
        has_any_endpoints: has_any,
    }
}
