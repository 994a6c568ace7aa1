//! The Maglev scenario shared by the `ebpf_maglev` test and the `maglev` bench group: one
//! NodePort service on an IPv4 node whose backends are given by the caller, and the eBPF
//! datapath configuration that programs it (IPv4 only, no socket LB, a small Maglev outer map).

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;

use kproxy::dataplane::ebpf::{EbpfConfig, LbAlgorithm, MapSizes};
use kproxy::model::{
    Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName, ServiceType, Snapshot,
};

/// The node's address (the destination of NodePort flows).
pub const NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
/// The service's node port.
pub const NODE_PORT: u16 = 30_080;
/// The backends' port.
pub const BACKEND_PORT: u16 = 8080;

/// A snapshot of one NodePort TCP service (`maglev/web:http`, cluster IP 10.96.0.10 port 80,
/// node port [`NODE_PORT`]) with a ready backend at each of `backends`, port
/// [`BACKEND_PORT`], on another node.
pub fn node_port_snapshot(backends: impl IntoIterator<Item = Ipv4Addr>) -> Snapshot {
    let name = ServicePortName {
        namespace: "maglev".into(),
        name: "web".into(),
        port: "http".into(),
        protocol: Protocol::Tcp,
    };
    let sp = ServicePort {
        name: name.clone(),
        service_type: ServiceType::NodePort,
        cluster_ips: vec![IpAddr::V4(Ipv4Addr::new(10, 96, 0, 10))],
        port: 80,
        protocol: Protocol::Tcp,
        node_port: NODE_PORT,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: 0,
        session_affinity_timeout: None,
    };
    let eps = backends
        .into_iter()
        .map(|ip| Endpoint {
            ip: IpAddr::V4(ip),
            port: BACKEND_PORT,
            ready: true,
            serving: true,
            terminating: false,
            is_local: false,
            node_name: Some("node2".into()),
            zone: None,
            zone_hints: BTreeSet::new(),
            node_hints: BTreeSet::new(),
        })
        .collect();
    let mut snap = Snapshot {
        generation: 1,
        node: NodeInfo {
            name: "node1".into(),
            addresses: vec![IpAddr::V4(NODE)],
            ..NodeInfo::default()
        },
        ..Snapshot::default()
    };
    snap.endpoints.insert(name.clone(), Arc::new(eps));
    snap.services.insert(name, Arc::new(sp));
    snap
}

/// The eBPF datapath configuration over the private bpffs `bpffs`: IPv4, node address
/// [`NODE`], no socket LB, `algorithm` with Maglev tables of `table_size` (room for 4).
pub fn config(bpffs: &Path, algorithm: LbAlgorithm, table_size: u32) -> EbpfConfig {
    EbpfConfig {
        bpffs: bpffs.to_path_buf(),
        families: vec![kproxy::model::IpFamily::V4],
        socket_lb: false,
        node_addresses: vec![IpAddr::V4(NODE)],
        lb_algorithm: algorithm,
        maglev_table_size: table_size,
        map_sizes: MapSizes {
            maglev: 4,
            ..MapSizes::default()
        },
        ..EbpfConfig::default()
    }
}
