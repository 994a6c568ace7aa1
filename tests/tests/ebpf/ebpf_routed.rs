//! Routed ClusterIP traffic on this kernel: a client that never passes a socket hook (outside
//! the node, with a route to the service CIDR via the node) reaches a ClusterIP through the TC
//! service path of the node's devices: `kp_tc_in` finds no external-scope frontend for the VIP,
//! falls back to the ClusterIP's cluster-scope one, DNATs to a backend with the same
//! connection table as NodePorts, and replies are translated back (source = the VIP), for local
//! and remote backends. The same holds for a pod of the node outside the socket-LB cgroup.
//!
//! The agent's ebpf mode itself (`EbpfDataplane`: service maps, TC programs on the devices the
//! default rule selects, socket LB off) runs in the node namespace of the shared topology;
//! `kp-probe` in the external client namespace uses connected sockets, so an answer only counts
//! if it came back from the VIP.

use std::net::{IpAddr, Ipv4Addr};

use aya::maps::{HashMap as BpfHashMap, Map, MapData, MapInfo};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::EbpfConfig;
use kproxy::dataplane::ebpf::EbpfDataplane;
use kproxy::dataplane::ebpf::node_path::CtEntry;
use kproxy::dataplane::ebpf::node_path::CtKey;
use kproxy::dataplane::ebpf::node_path::CtKind;
use kproxy::dataplane::ebpf::node_path::MAP_CT;
use kproxy::dataplane::ebpf::node_path::flows;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, Endpoint, IpFamily, Protocol, ServicePort, Snapshot, testing};
use kproxy_common::ct6::MAP_CT6;
use kproxy_tests::netns::{Bpffs, require_root};
use kproxy_tests::topology::{
    CLIENT_IP, NODE_CLIENT_IF, NODE_IP, NODE_LINK_IP, NODE_PEER_IF, POD_PORT, Probe, TopologySpec,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const SERVICE_CIDR: &str = "10.96.0.0/12";
const PORT: u16 = 80;
const N: u32 = 40;

fn service(protocol: Protocol) -> ServicePort {
    testing::service_port("default", "web", "p")
        .protocol(protocol)
        .cluster_ip(VIP)
        .port(PORT)
        .build()
}

fn endpoint(ip: Ipv4Addr, local: bool) -> Endpoint {
    testing::endpoint(ip, POD_PORT)
        .local_on("node", "node2", local)
        .build()
}

fn snapshot(node_addrs: Vec<IpAddr>, endpoints: Vec<Endpoint>) -> Snapshot {
    testing::snapshot("node")
        .node_addresses(node_addrs)
        .services([Protocol::Tcp, Protocol::Udp].map(|proto| (service(proto), endpoints.clone())))
        .build()
}

#[test]
fn cluster_ip_routed_from_outside_reaches_local_and_remote_backends() {
    if !require_root() {
        return;
    }
    let mut topo = TopologySpec::new("routed")
        .local_pods(2)
        .remote_pods(1)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    // The client reaches the service CIDR through the node (as a router or a VM host would
    // send it), not through any socket hook.
    topo.client
        .ip(&["route", "add", SERVICE_CIDR, "via", &NODE_IP.to_string()])
        .unwrap();
    let bpffs = Bpffs::new("routed-fs").unwrap();
    let cfg = EbpfConfig {
        ebpf: ServiceMapsConfig {
            bpffs: bpffs.path().to_path_buf(),
            families: vec![IpFamily::V4],
            socket_lb: false,
            map_sizes: MapSizes {
                services: 256,
                backend_slots: 256,
                backends: 256,
                affinity: 256,
                source_ranges: 16,
                sock_rev_nat: 256,
                ct: 4096,
                ..MapSizes::default()
            },
            ..ServiceMapsConfig::default()
        },
        devices: None,
        tc: true,
        ct_timeouts: flows::Timeouts::default(),
        node_port_cidrs: vec![],
        xdp: kproxy::dataplane::ebpf::node_path::xdp::XdpPolicy::Off,
    };
    let mut mode = topo
        .node
        .run(|| EbpfDataplane::new(cfg, None))
        .unwrap()
        .unwrap();
    // `mapSizes.ct` sizes both connection tables (the socket-LB object creates their pins,
    // the TC object reuses them).
    for name in [MAP_CT, MAP_CT6] {
        let info = MapInfo::from_pin(bpffs.path().join("kproxy").join(name)).unwrap();
        assert_eq!(info.max_entries(), 4096, "{name} has the configured size");
    }
    let devices = mode.tc_devices();
    assert!(
        devices.contains(&NODE_CLIENT_IF.to_string())
            && devices.contains(&NODE_PEER_IF.to_string()),
        "{devices:?}"
    );
    let node_ips = vec![IpAddr::V4(NODE_IP), IpAddr::V4(NODE_LINK_IP)];
    let both = vec![
        endpoint(topo.pod("pod-l0").ip, true),
        endpoint(topo.pod("pod-r0").ip, false),
    ];
    let report = mode
        .sync(&snapshot(node_ips.clone(), both), &ChangedSet::default())
        .unwrap();
    assert_eq!(report.failed_services, 0, "{report:?}");

    for proto in ["tcp", "udp"] {
        let addr = format!("{VIP}:{PORT}");
        let p = if proto == "tcp" {
            Probe::tcp(addr, N)
        } else {
            Probe::udp(addr, N)
        };
        let r = p.run(&topo.client, None).unwrap();
        assert_eq!(r.total_errors(), 0, "{proto}: {r:?}");
        assert_eq!(r.total_answers(), u64::from(N), "{proto}: {r:?}");
        assert!(
            r.answers.get("pod-l0").copied().unwrap_or(0) > 0
                && r.answers.get("pod-r0").copied().unwrap_or(0) > 0,
            "{proto}: both backends answer: {r:?}"
        );
        // Same rules as NodePorts: the remote backend's flows are SNATed to the node's
        // address toward it (so replies return through this node), the local one sees the
        // client.
        assert_eq!(
            r.peer_ips("pod-r0"),
            vec![NODE_LINK_IP.to_string()],
            "{proto}"
        );
        assert_eq!(r.peer_ips("pod-l0"), vec![CLIENT_IP.to_string()], "{proto}");
    }

    // A pod of this node outside the socket-LB cgroup (no socket hook either): its packets
    // enter the node through its veth, which holds the pod gateway address and so carries the
    // TC programs too.
    let outsider = topo.pod("pod-l1");
    for proto in ["tcp", "udp"] {
        let addr = format!("{VIP}:{PORT}");
        let p = if proto == "tcp" {
            Probe::tcp(addr, N)
        } else {
            Probe::udp(addr, N)
        };
        let r = p.run(&outsider.ns, None).unwrap();
        assert_eq!(r.total_answers(), u64::from(N), "{proto} from a pod: {r:?}");
        assert!(
            r.answers.get("pod-l0").copied().unwrap_or(0) > 0
                && r.answers.get("pod-r0").copied().unwrap_or(0) > 0,
            "{proto} from a pod: both backends answer: {r:?}"
        );
        assert_eq!(
            r.peer_ips("pod-l0"),
            vec![outsider.ip.to_string()],
            "{proto} from a pod"
        );
    }

    // The flows went through the TC connection table: one service entry per flow from the
    // client to the VIP, for both protocols.
    let data = MapData::from_pin(bpffs.path().join("kproxy").join(MAP_CT)).unwrap();
    let table: BpfHashMap<MapData, CtKey, CtEntry> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    let vip_flows: Vec<CtKey> = table
        .keys()
        .filter_map(Result::ok)
        .filter(|k| {
            k.kind == CtKind::Service as u8
                && k.daddr == u32::from_ne_bytes(VIP.octets())
                && k.saddr == u32::from_ne_bytes(CLIENT_IP.octets())
        })
        .collect();
    for proto in [6u8, 17] {
        assert!(
            vip_flows.iter().any(|k| k.proto == proto),
            "no CT entry of protocol {proto} for client -> VIP: {vip_flows:?}"
        );
    }

    // Only the local backend left: every routed flow goes there.
    let local = vec![endpoint(topo.pod("pod-l0").ip, true)];
    mode.sync(&snapshot(node_ips, local), &ChangedSet::default())
        .unwrap();
    for p in [
        Probe::tcp(format!("{VIP}:{PORT}"), 10),
        Probe::udp(format!("{VIP}:{PORT}"), 10),
    ] {
        let r = p.run(&topo.client, None).unwrap();
        assert_eq!(r.answers.get("pod-l0").copied(), Some(10), "{r:?}");
    }
    mode.cleanup().unwrap();
}
