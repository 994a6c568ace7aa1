//! The immutable desired state handed to a datapath on each sync.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use ipnet::IpNet;
use serde::Serialize;

use super::topology::{CategorizedEndpoints, categorize_endpoints};
use super::types::{Endpoint, NodeInfo, ServicePort, ServicePortName};

/// Everything a datapath needs for one sync. Cheap to clone (the maps hold `Arc`s), never
/// mutated after the tracker built it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Snapshot {
    /// Increases by one with every snapshot the tracker builds.
    pub generation: u64,
    pub node: NodeInfo,
    pub services: BTreeMap<ServicePortName, Arc<ServicePort>>,
    /// Merged endpoints per service port (all EndpointSlices of the service; duplicates
    /// removed). May hold entries for ports no service has (upstream keeps them too).
    pub endpoints: BTreeMap<ServicePortName, Arc<Vec<Endpoint>>>,
    /// The cluster's service CIDRs from `ServiceCIDR` objects (both families, sorted); `None`
    /// when the source delivers none (an API server without them, the manifests): datapaths
    /// then use their configured CIDRs.
    pub service_cidrs: Option<Vec<IpNet>>,
}

impl Snapshot {
    /// The endpoints of `name` (empty if none).
    pub(crate) fn endpoints_of(&self, name: &ServicePortName) -> &[Endpoint] {
        self.endpoints
            .get(name)
            .map(|v| v.as_slice())
            .unwrap_or(&[])
    }

    /// Upstream `CategorizeEndpoints` for one service port of this snapshot.
    pub(crate) fn categorize(&self, svc: &ServicePort) -> CategorizedEndpoints {
        categorize_endpoints(self.endpoints_of(&svc.name), svc, &self.node)
    }
}

/// What changed between the previous snapshot and this one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChangedSet {
    /// Service ports whose service or endpoints changed (added, updated or removed).
    pub services: BTreeSet<ServicePortName>,
    /// The node object (labels, addresses) changed.
    pub node: bool,
}

impl ChangedSet {
    pub fn is_empty(&self) -> bool {
        self.services.is_empty() && !self.node
    }
}
