//! The Maglev scenario shared by the `ebpf_maglev` test and the `maglev` bench group: one
//! NodePort service on an IPv4 node whose backends are given by the caller, and the eBPF
//! datapath configuration that programs it (IPv4 only, no socket LB, a small Maglev outer map).

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use kproxy::dataplane::ebpf::service_maps::LbAlgorithm;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{Snapshot, testing};

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
    let sp = testing::service_port("maglev", "web", "http")
        .cluster_ip(Ipv4Addr::new(10, 96, 0, 10))
        .node_port(NODE_PORT)
        .build();
    let eps = backends
        .into_iter()
        .map(|ip| testing::endpoint(ip, BACKEND_PORT).node("node2").build())
        .collect();
    testing::snapshot("node1")
        .node_addresses([NODE])
        .service(sp, eps)
        .build()
}

/// The eBPF datapath configuration over the private bpffs `bpffs`: IPv4, node address
/// [`NODE`], no socket LB, `algorithm` with Maglev tables of `table_size` (room for 4).
pub fn config(bpffs: &Path, algorithm: LbAlgorithm, table_size: u32) -> ServiceMapsConfig {
    ServiceMapsConfig {
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
        ..ServiceMapsConfig::default()
    }
}
