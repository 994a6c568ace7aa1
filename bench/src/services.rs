//! Synthetic cluster state for the benchmarks: N ClusterIP services × E endpoints, of which one
//! (the *target*, the last one created) points at real pods of the topology and the others at
//! addresses no host holds.

use std::net::Ipv4Addr;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy_tests::fakeapi::FakeApi;
use serde_json::{Value, json};

/// Node name the agent runs as in the benchmarks.
pub const NODE_NAME: &str = "bench-node";
/// Service port of every synthetic service.
pub const SERVICE_PORT: u16 = 80;

/// N services × E endpoints; service `N-1` is the target.
#[derive(Debug, Clone)]
pub struct ServiceSet {
    pub count: u32,
    pub endpoints_per_service: u32,
    /// Backends of the target service (real pods, port [`kproxy_tests::topology::POD_PORT`]).
    pub target_backends: Vec<Ipv4Addr>,
    /// The node's address (for the Node object).
    pub node_ip: Ipv4Addr,
}

impl ServiceSet {
    pub fn target_index(&self) -> u32 {
        self.count - 1
    }

    /// Cluster IP of service `i`: 10.96.0.100 + i (10.96.0.0/12 holds 100k).
    pub fn cluster_ip(i: u32) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 96, 0, 100)) + i)
    }

    pub fn target_addr(&self) -> String {
        format!("{}:{SERVICE_PORT}", Self::cluster_ip(self.target_index()))
    }

    fn name(i: u32) -> String {
        format!("svc-{i}")
    }

    /// Endpoint addresses of service `i`.
    pub fn endpoints(&self, i: u32) -> Vec<Ipv4Addr> {
        if i == self.target_index() {
            return self.target_backends.clone();
        }
        let base = u32::from(Ipv4Addr::new(10, 128, 0, 0)) + i * self.endpoints_per_service;
        (0..self.endpoints_per_service)
            .map(|j| Ipv4Addr::from(base + j))
            .collect()
    }

    pub fn service_json(&self, i: u32) -> Value {
        let ip = Self::cluster_ip(i).to_string();
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": Self::name(i), "namespace": "bench"},
            "spec": {"type": "ClusterIP", "clusterIP": ip, "clusterIPs": [ip],
                     "ipFamilies": ["IPv4"],
                     "ports": [{"name": "http", "protocol": "TCP", "port": SERVICE_PORT,
                                "targetPort": kproxy_tests::topology::POD_PORT}]}
        })
    }

    pub fn slice_json(&self, i: u32, backends: &[Ipv4Addr]) -> Value {
        let endpoints: Vec<Value> = backends
            .iter()
            .map(|ip| {
                json!({"addresses": [ip.to_string()], "conditions": {"ready": true},
                       "nodeName": NODE_NAME})
            })
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": format!("{}-1", Self::name(i)), "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": Self::name(i)}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": kproxy_tests::topology::POD_PORT}],
            "endpoints": endpoints
        })
    }

    pub fn node_json(&self) -> Value {
        json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}},
            "status": {"addresses": [{"type": "InternalIP", "address": self.node_ip.to_string()}]}
        })
    }

    /// Every object as one multi-document YAML (JSON is YAML), for `--manifests`.
    pub fn manifests(&self) -> String {
        let mut out = String::with_capacity(self.count as usize * 700);
        out.push_str(&self.node_json().to_string());
        for i in 0..self.count {
            out.push_str("\n---\n");
            out.push_str(&self.service_json(i).to_string());
            out.push_str("\n---\n");
            out.push_str(&self.slice_json(i, &self.endpoints(i)).to_string());
        }
        out.push('\n');
        out
    }

    /// Creates the Node and every service with its slice in the fake API server.
    pub fn create_all(&self, api: &FakeApi) -> anyhow::Result<()> {
        api.create(&self.node()?)?;
        for i in 0..self.count {
            api.create(&self.service(i)?)?;
            api.create(&self.slice(i, &self.endpoints(i))?)?;
        }
        Ok(())
    }

    pub fn node(&self) -> anyhow::Result<Node> {
        Ok(serde_json::from_value(self.node_json())?)
    }
    pub fn service(&self, i: u32) -> anyhow::Result<Service> {
        Ok(serde_json::from_value(self.service_json(i))?)
    }
    pub fn slice(&self, i: u32, backends: &[Ipv4Addr]) -> anyhow::Result<EndpointSlice> {
        Ok(serde_json::from_value(self.slice_json(i, backends))?)
    }
}
