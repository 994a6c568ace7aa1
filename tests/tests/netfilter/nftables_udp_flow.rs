//! A long-lived UDP flow through the nftables proxier (real packets, the shared topology and
//! rig): a client keeps one socket (one 5-tuple) to a ClusterIP (or the NodePort); its
//! endpoint is removed from the service while its server keeps answering (IPv4 and IPv6, like
//! conntrack_cleanup.rs).
//!
//! - With the conntrack cleanup (`WithConntrackCleanup`, as the agent builds the mode): the
//!   flow's conntrack entry to the removed endpoint existed before the sync and is gone after
//!   it, and the flow's next datagrams reach the remaining endpoint.
//! - Without it (the bare `NftablesDataplane`): the entry stays and the flow keeps reaching
//!   the removed endpoint — what the cleanup is for.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::netfilter::with_conntrack::WithConntrackCleanup;
use kproxy::dataplane::nftables::kernel::NftRunner;
use kproxy::dataplane::nftables::{NftablesConfig, NftablesDataplane};
use kproxy::model::IpFamily;
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{NODE_IP, NODE_IP6, Pod};
use kproxy_tests::traffic::{Rig, UdpFlow, service, slice, topology};
use serde_json::json;

const PORT: u16 = 53;
const NODE_PORT: u16 = 30053;

fn vip(family: IpFamily) -> &'static str {
    match family {
        IpFamily::V4 => "10.96.0.30",
        IpFamily::V6 => "fd00:96::30",
    }
}

fn dns(family: IpFamily) -> Service {
    let family_name = match family {
        IpFamily::V4 => "IPv4",
        IpFamily::V6 => "IPv6",
    };
    service(
        "dns",
        json!({"type": "NodePort", "clusterIP": vip(family), "clusterIPs": [vip(family)],
               "ipFamilies": [family_name],
               "ports": [{"name": "udp", "port": PORT, "protocol": "UDP", "nodePort": NODE_PORT}]}),
        json!({}),
    )
}

fn pod_ip(p: &Pod, family: IpFamily) -> String {
    match family {
        IpFamily::V4 => p.ip.to_string(),
        IpFamily::V6 => p.ip6.expect("IPv6 topology").to_string(),
    }
}

/// The flow goes to the ClusterIP, or with `node_port` to the NodePort on the node address.
fn run(family: IpFamily, with_cleanup: bool, node_port: bool) {
    let v6 = family == IpFamily::V6;
    let hint = match (v6, with_cleanup, node_port) {
        (_, _, true) => "nft-udp-np",
        (false, true, _) => "nft-udp-ct",
        (true, true, _) => "nft-udp-ct6",
        (_, false, _) => "nft-udp-no",
    };
    let topo = topology(hint, 2, 0, v6);
    let (detector, node_ip) = match family {
        IpFamily::V4 => ("10.244.0.0/16", NODE_IP.into()),
        IpFamily::V6 => ("fd00:244::/32", NODE_IP6.into()),
    };
    let mut cfg = NftablesConfig::new(family, LocalDetector::Cidr(detector.parse().unwrap()));
    cfg.node_ip = Some(node_ip);
    let runner = NftRunner {
        netns: Some(topo.node.path()),
    };
    let nft = NftablesDataplane::new([cfg], runner, Duration::from_secs(3600)).expect("dataplane");
    if with_cleanup {
        let dp = WithConntrackCleanup::new(nft, &[family], None);
        flow_moves_or_sticks(Rig::new(topo, dp), family, true, node_port);
    } else {
        flow_moves_or_sticks(Rig::new(topo, nft), family, false, node_port);
    }
}

fn flow_moves_or_sticks<D: Dataplane + Send>(
    mut r: Rig<D>,
    family: IpFamily,
    with_cleanup: bool,
    node_port: bool,
) {
    let both = r.pods(&["pod-l0", "pod-l1"]);
    let sl = slice("dns", &both, family);
    r.sync(&[dns(family)], &[sl]);

    let (dst, port) = match (family, node_port) {
        (_, false) => (vip(family).to_string(), PORT),
        (IpFamily::V4, true) => (NODE_IP.to_string(), NODE_PORT),
        (IpFamily::V6, true) => (NODE_IP6.to_string(), NODE_PORT),
    };
    let addr = match family {
        IpFamily::V4 => format!("{dst}:{port}"),
        IpFamily::V6 => format!("[{dst}]:{port}"),
    };
    let flow = UdpFlow::connect(&r.topo.client, &addr);
    let first = flow.exchange();
    for _ in 0..5 {
        assert_eq!(flow.exchange(), first, "one flow, one backend (conntrack)");
    }
    let remaining = if first == "pod-l0" {
        "pod-l1"
    } else {
        "pod-l0"
    };
    let removed_ip = pod_ip(r.topo.pod(&first), family);
    let remaining_ip = pod_ip(r.topo.pod(remaining), family);
    let entries = |r: &Rig<D>, backend: &str| flow.entries(&r.topo.node, &dst, backend);
    assert_eq!(
        entries(&r, &removed_ip).len(),
        1,
        "the flow's conntrack entry to {first} before the removal"
    );

    // The endpoint the flow uses is removed from the service (its server keeps answering).
    let sl = slice("dns", &r.pods(&[remaining]), family);
    r.sync(&[dns(family)], &[sl]);

    if with_cleanup {
        assert_eq!(
            entries(&r, &removed_ip),
            Vec::<String>::new(),
            "the cleanup deleted the stale entry to {first}"
        );
        for _ in 0..5 {
            assert_eq!(
                flow.exchange(),
                remaining,
                "the flow moved to the remaining endpoint"
            );
        }
        assert_eq!(entries(&r, &remaining_ip).len(), 1);
    } else {
        assert_eq!(
            entries(&r, &removed_ip).len(),
            1,
            "without the cleanup the entry to {first} stays"
        );
        for _ in 0..5 {
            assert_eq!(
                flow.exchange(),
                first,
                "without the cleanup the flow sticks to the removed endpoint"
            );
        }
    }
}

#[test]
fn udp_flow_moves_after_the_conntrack_cleanup() {
    if !require_root() {
        return;
    }
    run(IpFamily::V4, true, false);
}

#[test]
fn udp_flow_moves_after_the_conntrack_cleanup_ipv6() {
    if !require_root() {
        return;
    }
    run(IpFamily::V6, true, false);
}

#[test]
fn udp_flow_sticks_to_a_removed_endpoint_without_the_cleanup() {
    if !require_root() {
        return;
    }
    run(IpFamily::V4, false, false);
}

#[test]
fn udp_node_port_flow_moves_after_the_conntrack_cleanup() {
    if !require_root() {
        return;
    }
    run(IpFamily::V4, true, true);
}
