//! The proxy's view of a service port and its endpoints (upstream `ServicePort` / `Endpoint`).
//!
//! These are plain data: everything is already validated and defaulted by the builders in
//! [`super::service`] and [`super::endpoints`]. Both IP families live in one value; a
//! per-family datapath selects its family with the `*_for` helpers (upstream runs one proxier
//! per family and filters the same way).

use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;
use serde::Serialize;

/// IP family of an address or of a per-family datapath instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    /// `IPv4` / `IPv6`, as upstream names families in messages and health output.
    pub(crate) fn name(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    pub(crate) fn of(ip: &IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
    pub fn matches(self, ip: &IpAddr) -> bool {
        IpFamily::of(ip) == self
    }
}

/// L4 protocol of a service port (the three Kubernetes supports).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Protocol {
    Tcp,
    Udp,
    Sctp,
}

impl Protocol {
    /// Parses the Kubernetes spelling (`TCP`, `UDP`, `SCTP`); an unset protocol means TCP.
    pub(crate) fn parse(s: Option<&str>) -> Option<Self> {
        match s {
            None | Some("TCP") => Some(Protocol::Tcp),
            Some("UDP") => Some(Protocol::Udp),
            Some("SCTP") => Some(Protocol::Sctp),
            _ => None,
        }
    }
    /// Lower-case name as used in iptables rules and chain-name hashes.
    pub(crate) fn lower(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Sctp => "sctp",
        }
    }
    /// IANA protocol number.
    pub(crate) fn number(self) -> u8 {
        match self {
            Protocol::Tcp => 6,
            Protocol::Udp => 17,
            Protocol::Sctp => 132,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// Upstream's `ServicePortName`: namespace/name, the port's name (may be empty) and protocol.
/// Displays as `ns/name:port` (or `ns/name` when the port is unnamed), like upstream, and
/// serializes as that string (so it can key JSON maps; port names are unique per service).
///
/// The parts are shared behind an `Arc` ([`PortNameParts`], read through `Deref`): a name keys
/// a dozen maps at once (tracker, snapshot, change sets, planner, id allocator, applier), so a
/// clone is a reference count, not three string allocations (≈ 170 bytes × 10k service ports
/// per copy). Ordering, equality and hashing are the parts'.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePortName(Arc<PortNameParts>);

/// What a [`ServicePortName`] is made of.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PortNameParts {
    pub namespace: String,
    pub name: String,
    pub port: String,
    pub protocol: Protocol,
}

impl std::ops::Deref for ServicePortName {
    type Target = PortNameParts;
    fn deref(&self) -> &PortNameParts {
        &self.0
    }
}

impl fmt::Debug for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServicePortName")
            .field("namespace", &self.namespace)
            .field("name", &self.name)
            .field("port", &self.port)
            .field("protocol", &self.protocol)
            .finish()
    }
}

impl ServicePortName {
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        port: impl Into<String>,
        protocol: Protocol,
    ) -> Self {
        ServicePortName(Arc::new(PortNameParts {
            namespace: namespace.into(),
            name: name.into(),
            port: port.into(),
            protocol,
        }))
    }

    /// `namespace/name`, the service this port belongs to.
    pub(crate) fn service(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

impl Serialize for ServicePortName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl fmt::Display for ServicePortName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.port.is_empty() {
            write!(f, "{}/{}", self.namespace, self.name)
        } else {
            write!(f, "{}/{}:{}", self.namespace, self.name, self.port)
        }
    }
}

/// `status.loadBalancer.ingress[].ipMode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum IpMode {
    /// Traffic to the IP is delivered to the node with the IP as destination (default).
    Vip,
    /// The load balancer rewrites the destination; the proxy must not capture the IP.
    Proxy,
}

/// One load-balancer ingress IP.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct LoadBalancerIngress {
    pub ip: IpAddr,
    pub ip_mode: IpMode,
}

/// `spec.type` of the proxied service (ExternalName services are never proxied).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum ServiceType {
    ClusterIp,
    NodePort,
    LoadBalancer,
}

/// One port of one proxied service: upstream's `ServicePort` interface as data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ServicePort {
    pub name: ServicePortName,
    pub service_type: ServiceType,
    /// The service's cluster IPs, primary family first, at most one per family.
    pub cluster_ips: Vec<IpAddr>,
    pub port: u16,
    pub protocol: Protocol,
    /// 0 when the port has no node port.
    pub node_port: u16,
    pub external_ips: Vec<IpAddr>,
    /// All LB ingress IPs with their ipMode (see `ServicePort::load_balancer_vips`).
    pub load_balancer_ingress: Vec<LoadBalancerIngress>,
    pub load_balancer_source_ranges: Vec<IpNet>,
    /// externalTrafficPolicy=Local on an externally accessible service.
    pub external_policy_local: bool,
    /// internalTrafficPolicy=Local.
    pub internal_policy_local: bool,
    /// 0 when unset.
    pub health_check_node_port: u16,
    /// `Some(timeout seconds)` for sessionAffinity=ClientIP (default 10800).
    pub session_affinity_timeout: Option<u32>,
}

impl ServicePort {
    /// The endpoints of `family` among `eps`, sorted by "IP:port" as upstream's rule writers
    /// order them.
    pub(crate) fn family_endpoints(eps: &[Endpoint], family: IpFamily) -> Vec<Endpoint> {
        let mut out: Vec<Endpoint> = eps
            .iter()
            .filter(|e| family.matches(&e.ip))
            .cloned()
            .collect();
        out.sort_by_cached_key(|e| e.addr());
        out
    }

    /// The view of one IP family (upstream's per-family service maps): only this family's
    /// external IPs, LB ingress IPs and source ranges.
    pub(crate) fn for_family(&self, family: IpFamily) -> ServicePort {
        let mut s = self.clone();
        s.external_ips.retain(|ip| family.matches(ip));
        s.load_balancer_ingress.retain(|i| family.matches(&i.ip));
        s.load_balancer_source_ranges
            .retain(|n| family.matches(&n.addr()));
        s
    }

    /// The cluster IP of `family`, if the service has one.
    pub(crate) fn cluster_ip(&self, family: IpFamily) -> Option<IpAddr> {
        self.cluster_ips
            .iter()
            .copied()
            .find(|ip| family.matches(ip))
    }
    /// External IPs of `family`.
    pub(crate) fn external_ips_for(&self, family: IpFamily) -> impl Iterator<Item = IpAddr> + '_ {
        self.external_ips
            .iter()
            .copied()
            .filter(move |ip| family.matches(ip))
    }
    /// LB ingress IPs the proxy captures (ipMode VIP, upstream's `IsVIPMode`) of `family`.
    pub(crate) fn load_balancer_vips(&self, family: IpFamily) -> impl Iterator<Item = IpAddr> + '_ {
        self.load_balancer_ingress
            .iter()
            .filter(move |i| i.ip_mode == IpMode::Vip && family.matches(&i.ip))
            .map(|i| i.ip)
    }
    /// Source ranges of `family`.
    pub(crate) fn source_ranges_for(&self, family: IpFamily) -> impl Iterator<Item = IpNet> + '_ {
        self.load_balancer_source_ranges
            .iter()
            .copied()
            .filter(move |n| match family {
                IpFamily::V4 => matches!(n, IpNet::V4(_)),
                IpFamily::V6 => matches!(n, IpNet::V6(_)),
            })
    }
    /// Upstream `ExternallyAccessible`: nodePort, LB VIPs or external IPs.
    pub(crate) fn externally_accessible(&self) -> bool {
        self.node_port != 0
            || self
                .load_balancer_ingress
                .iter()
                .any(|i| i.ip_mode == IpMode::Vip)
            || !self.external_ips.is_empty()
    }
    /// Upstream `UsesClusterEndpoints`.
    pub(crate) fn uses_cluster_endpoints(&self) -> bool {
        !self.internal_policy_local || self.externally_accessible()
    }
    /// Upstream `UsesLocalEndpoints`.
    pub(crate) fn uses_local_endpoints(&self) -> bool {
        self.internal_policy_local || (self.external_policy_local && self.externally_accessible())
    }
}

/// One endpoint of one service port (upstream `BaseEndpointInfo`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Endpoint {
    pub ip: IpAddr,
    pub port: u16,
    pub ready: bool,
    pub serving: bool,
    pub terminating: bool,
    /// `nodeName == this node` (upstream `IsLocal`).
    pub is_local: bool,
    /// `nodeName` and `zone`, shared by the endpoints of a slice on the same node or zone (and
    /// by the copies of an endpoint for each port of its slice) instead of one string each.
    pub node_name: Option<Arc<str>>,
    pub zone: Option<Arc<str>>,
    pub zone_hints: Hints,
    pub node_hints: Hints,
}

/// An endpoint's `hints.forZones` / `hints.forNodes` names: sorted, without duplicates, in a
/// boxed slice (16 bytes when empty, the usual case, where a `BTreeSet` takes 24 — per
/// endpoint, twice). Serializes as the list of names.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Hints(Box<[Arc<str>]>);

impl Hints {
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.0.binary_search_by(|h| (**h).cmp(name)).is_ok()
    }
    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        self.0.iter().map(|h| &**h)
    }
}

impl<S: AsRef<str>> FromIterator<S> for Hints {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        let mut v: Vec<Arc<str>> = iter.into_iter().map(|s| Arc::from(s.as_ref())).collect();
        v.sort();
        v.dedup();
        Hints(v.into_boxed_slice())
    }
}

impl Serialize for Hints {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl Endpoint {
    /// `IP:port` (IPv6 bracketed), upstream's `Endpoint.String()`, the identity of an endpoint.
    pub fn addr(&self) -> String {
        std::net::SocketAddr::new(self.ip, self.port).to_string()
    }
}

/// What the proxy knows of its own node.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct NodeInfo {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    /// `status.addresses` of type InternalIP/ExternalIP, as parsed.
    pub addresses: Vec<IpAddr>,
    /// `spec.podCIDRs`.
    pub pod_cidrs: Vec<IpNet>,
}

impl NodeInfo {
    /// The zone label (`topology.kubernetes.io/zone`), if any.
    pub(crate) fn zone(&self) -> Option<&str> {
        self.labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str)
    }
}
