//! Test fixtures: a small fluent builder for [`ServicePort`]s, [`Endpoint`]s and [`Snapshot`]s,
//! shared by kproxy's unit tests, the integration tests and the bench (`kproxy-tests`). Not
//! used by the agent; compiled always (it is pure data) so that other crates' tests can use it.
//!
//! ```
//! use kproxy::model::Protocol;
//! use kproxy::model::testing::{endpoint, service_port, snapshot};
//!
//! let sp = service_port("default", "web", "p")
//!     .protocol(Protocol::Udp)
//!     .cluster_ip("10.96.0.10")
//!     .node_port(30080)
//!     .build();
//! let snap = snapshot("node")
//!     .service(sp, vec![endpoint("10.0.0.1", 8080).local_on("node", "node2", true).build()])
//!     .build();
//! assert_eq!(snap.services.len(), 1);
//! ```

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::{Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName, ServiceType, Snapshot};

/// Anything a test names an address with: an `IpAddr`, `Ipv4Addr`, `Ipv6Addr` or a string
/// (parsed; panics on a bad literal, this is test code).
pub trait TestIp {
    fn test_ip(self) -> IpAddr;
}

impl TestIp for IpAddr {
    fn test_ip(self) -> IpAddr {
        self
    }
}

impl TestIp for Ipv4Addr {
    fn test_ip(self) -> IpAddr {
        self.into()
    }
}

impl TestIp for Ipv6Addr {
    fn test_ip(self) -> IpAddr {
        self.into()
    }
}

impl TestIp for &str {
    fn test_ip(self) -> IpAddr {
        self.parse()
            .unwrap_or_else(|e| panic!("test IP {self:?}: {e}"))
    }
}

impl TestIp for &String {
    fn test_ip(self) -> IpAddr {
        self.as_str().test_ip()
    }
}

/// `namespace/name:port` over `protocol`.
pub fn port_name(namespace: &str, name: &str, port: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName::new(namespace, name, port, protocol)
}

/// A ClusterIP TCP port 80 named `namespace/name:port`, without any address, node port,
/// policy or affinity until set.
pub fn service_port(namespace: &str, name: &str, port: &str) -> ServicePortBuilder {
    ServicePortBuilder(ServicePort {
        name: port_name(namespace, name, port, Protocol::Tcp),
        service_type: ServiceType::ClusterIp,
        cluster_ips: vec![],
        port: 80,
        protocol: Protocol::Tcp,
        node_port: 0,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: 0,
        session_affinity_timeout: None,
    })
}

/// Builds a [`ServicePort`]; see [`service_port`].
#[derive(Debug, Clone)]
pub struct ServicePortBuilder(ServicePort);

impl ServicePortBuilder {
    /// The protocol of the port and of its name.
    pub fn protocol(mut self, protocol: Protocol) -> Self {
        self.0.protocol = protocol;
        let n = &self.0.name;
        self.0.name = ServicePortName::new(&*n.namespace, &*n.name, &*n.port, protocol);
        self
    }
    /// The service port (default 80).
    pub fn port(mut self, port: u16) -> Self {
        self.0.port = port;
        self
    }
    /// Adds a cluster IP (call once per family, primary first).
    pub fn cluster_ip(mut self, ip: impl TestIp) -> Self {
        self.0.cluster_ips.push(ip.test_ip());
        self
    }
    /// Adds an external IP.
    pub fn external_ip(mut self, ip: impl TestIp) -> Self {
        self.0.external_ips.push(ip.test_ip());
        self
    }
    /// `spec.type`.
    pub fn service_type(mut self, service_type: ServiceType) -> Self {
        self.0.service_type = service_type;
        self
    }
    /// A NodePort service with node port `node_port` (0: allocated none).
    pub fn node_port(mut self, node_port: u16) -> Self {
        self.0.service_type = ServiceType::NodePort;
        self.0.node_port = node_port;
        self
    }
    /// externalTrafficPolicy=Local.
    pub fn external_policy_local(mut self, local: bool) -> Self {
        self.0.external_policy_local = local;
        self
    }
    /// internalTrafficPolicy=Local.
    pub fn internal_policy_local(mut self, local: bool) -> Self {
        self.0.internal_policy_local = local;
        self
    }
    /// sessionAffinity=ClientIP with this timeout (`None`: no affinity).
    pub fn affinity(mut self, timeout: Option<u32>) -> Self {
        self.0.session_affinity_timeout = timeout;
        self
    }
    pub fn build(self) -> ServicePort {
        self.0
    }
}

/// A ready, serving, non-local endpoint `ip:port` without a node name until set.
pub fn endpoint(ip: impl TestIp, port: u16) -> EndpointBuilder {
    EndpointBuilder(Endpoint {
        ip: ip.test_ip(),
        port,
        ready: true,
        serving: true,
        terminating: false,
        is_local: false,
        node_name: None,
        zone: None,
        zone_hints: Default::default(),
        node_hints: Default::default(),
    })
}

/// Builds an [`Endpoint`]; see [`endpoint`].
#[derive(Debug, Clone)]
pub struct EndpointBuilder(Endpoint);

impl EndpointBuilder {
    /// `nodeName`.
    pub fn node(mut self, node: &str) -> Self {
        self.0.node_name = Some(node.into());
        self
    }
    /// On this node (`this_node`) when `local`, else on `other_node`.
    pub fn local_on(self, this_node: &str, other_node: &str, local: bool) -> Self {
        let mut b = self.node(if local { this_node } else { other_node });
        b.0.is_local = local;
        b
    }
    /// The ready condition.
    pub fn ready(mut self, ready: bool) -> Self {
        self.0.ready = ready;
        self
    }
    /// The serving condition.
    pub fn serving(mut self, serving: bool) -> Self {
        self.0.serving = serving;
        self
    }
    /// The terminating condition.
    pub fn terminating(mut self, terminating: bool) -> Self {
        self.0.terminating = terminating;
        self
    }
    pub fn build(self) -> Endpoint {
        self.0
    }
}

/// A snapshot (generation 1) of node `node` without addresses or services until set.
pub fn snapshot(node: &str) -> SnapshotBuilder {
    SnapshotBuilder(Snapshot {
        generation: 1,
        node: NodeInfo {
            name: node.into(),
            ..NodeInfo::default()
        },
        ..Snapshot::default()
    })
}

/// Builds a [`Snapshot`]; see [`snapshot`]. `SnapshotBuilder::default()` starts from
/// `Snapshot::default()` (generation 0, unnamed node).
#[derive(Debug, Clone, Default)]
pub struct SnapshotBuilder(Snapshot);

impl SnapshotBuilder {
    pub fn generation(mut self, generation: u64) -> Self {
        self.0.generation = generation;
        self
    }
    /// The node's addresses.
    pub fn node_addresses(mut self, addresses: impl IntoIterator<Item = impl TestIp>) -> Self {
        self.0.node.addresses = addresses.into_iter().map(TestIp::test_ip).collect();
        self
    }
    /// Adds (or replaces) `port` with its endpoints.
    pub fn service(mut self, port: ServicePort, endpoints: Vec<Endpoint>) -> Self {
        self.0
            .endpoints
            .insert(port.name.clone(), Arc::new(endpoints));
        self.0.services.insert(port.name.clone(), Arc::new(port));
        self
    }
    /// Adds every `(port, endpoints)`.
    pub fn services(self, items: impl IntoIterator<Item = (ServicePort, Vec<Endpoint>)>) -> Self {
        items
            .into_iter()
            .fold(self, |b, (port, eps)| b.service(port, eps))
    }
    pub fn build(self) -> Snapshot {
        self.0
    }
}
