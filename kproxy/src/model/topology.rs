//! Upstream `CategorizeEndpoints` (pkg/proxy/topology.go). Placeholder: filled by the model work.

use super::types::{Endpoint, NodeInfo, ServicePort};
use serde::Serialize;

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

pub fn categorize_endpoints(_endpoints: &[Endpoint], _svc: &ServicePort, _node: &NodeInfo) -> CategorizedEndpoints {
    unimplemented!("model work in progress")
}
