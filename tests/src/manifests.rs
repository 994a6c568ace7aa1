//! Kubernetes objects as YAML documents for the agent's `--manifests` directory: the Node, a
//! Service and its EndpointSlice, written the way the agent tests need them (IPv4, namespace
//! `default`, one slice per Service named `<service>-1`). Tests with unusual objects (dual
//! stack, traffic policies, hostile input) still write their YAML by hand.

use std::fmt::Display;
use std::path::{Path, PathBuf};

/// One Service port and the endpoint port it targets.
#[derive(Debug, Clone)]
pub struct Port {
    pub name: String,
    pub protocol: &'static str,
    pub port: u16,
    pub target_port: u16,
    pub node_port: Option<u16>,
}

impl Port {
    fn new(protocol: &'static str, name: &str, port: u16, target_port: u16) -> Self {
        Self {
            name: name.to_owned(),
            protocol,
            port,
            target_port,
            node_port: None,
        }
    }
    pub fn tcp(name: &str, port: u16, target_port: u16) -> Self {
        Self::new("TCP", name, port, target_port)
    }
    pub fn udp(name: &str, port: u16, target_port: u16) -> Self {
        Self::new("UDP", name, port, target_port)
    }
    pub fn sctp(name: &str, port: u16, target_port: u16) -> Self {
        Self::new("SCTP", name, port, target_port)
    }
    /// The port is also a NodePort (and the Service of type NodePort).
    pub fn node_port(mut self, node_port: u16) -> Self {
        self.node_port = Some(node_port);
        self
    }
}

/// The Node object: its InternalIP and pod CIDR.
pub fn node(name: &str, ip: impl Display, pod_cidr: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {name}}}\nspec: {{podCIDRs: [\"{pod_cidr}\"]}}\n\
         status:\n  addresses: [{{type: InternalIP, address: {ip}}}]\n"
    )
}

/// A single-stack IPv4 Service in `default`: of type NodePort when a port has one, else
/// ClusterIP.
pub fn service(name: &str, cluster_ip: impl Display, ports: &[Port]) -> String {
    let kind = if ports.iter().any(|p| p.node_port.is_some()) {
        "NodePort"
    } else {
        "ClusterIP"
    };
    let ports: String = ports
        .iter()
        .map(|p| {
            let node_port = p
                .node_port
                .map(|n| format!(", nodePort: {n}"))
                .unwrap_or_default();
            format!(
                "    - {{name: {}, protocol: {}, port: {}, targetPort: {}{node_port}}}\n",
                p.name, p.protocol, p.port, p.target_port
            )
        })
        .collect();
    format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         type: {kind}\n  clusterIP: {cluster_ip}\n  clusterIPs: [\"{cluster_ip}\"]\n  \
         ipFamilies: [\"IPv4\"]\n  ports:\n{ports}"
    )
}

/// The EndpointSlice `<service>-1` of `service`: ready endpoints (address, node name) serving
/// the target ports of `ports`.
pub fn slice(service: &str, ports: &[Port], endpoints: &[(impl Display, &str)]) -> Slice {
    Slice {
        service: service.to_owned(),
        ports: ports.to_vec(),
        endpoints: endpoints
            .iter()
            .map(|(ip, node)| (ip.to_string(), (*node).to_owned()))
            .collect(),
        trigger_time: None,
    }
}

/// An EndpointSlice document; see [`slice()`].
#[derive(Debug, Clone)]
pub struct Slice {
    service: String,
    ports: Vec<Port>,
    endpoints: Vec<(String, String)>,
    trigger_time: Option<String>,
}

impl Slice {
    /// With upstream's `endpoints.kubernetes.io/last-change-trigger-time` annotation.
    pub fn trigger_time(mut self, at: impl Display) -> Self {
        self.trigger_time = Some(at.to_string());
        self
    }

    pub fn yaml(&self) -> String {
        let annotations = self
            .trigger_time
            .as_ref()
            .map(|t| {
                format!(
                    "  annotations: {{endpoints.kubernetes.io/last-change-trigger-time: \"{t}\"}}\n"
                )
            })
            .unwrap_or_default();
        let ports: Vec<String> = self
            .ports
            .iter()
            .map(|p| {
                format!(
                    "{{name: {}, protocol: {}, port: {}}}",
                    p.name, p.protocol, p.target_port
                )
            })
            .collect();
        let endpoints: String = self
            .endpoints
            .iter()
            .map(|(ip, node)| {
                format!(
                    "  - addresses: [\"{ip}\"]\n    conditions: {{ready: true}}\n    nodeName: {node}\n"
                )
            })
            .collect();
        format!(
            "apiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {svc}-1\n  \
             namespace: default\n  labels: {{kubernetes.io/service-name: {svc}}}\n{annotations}\
             addressType: IPv4\nports: [{ports}]\nendpoints:\n{endpoints}",
            svc = self.service,
            ports = ports.join(", ")
        )
    }
}

/// `docs` joined into one multi-document YAML.
pub fn documents(docs: &[String]) -> String {
    docs.join("---\n")
}

/// Writes `docs` as `dir/cluster.yaml` (the manifests directory the agent reads) and returns
/// its path.
pub fn write(dir: &Path, docs: &[String]) -> PathBuf {
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, documents(docs)).expect("writing the manifests");
    path
}
