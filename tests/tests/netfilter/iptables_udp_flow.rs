//! A long-lived UDP flow through the iptables proxier (real packets, the shared topology): a
//! client keeps one socket (one 5-tuple) to a ClusterIP; its endpoint is removed from the
//! service while its server keeps answering.
//!
//! - With the proxier's conntrack cleanup (`WithConntrackCleanup`, as the agent builds it):
//!   the conntrack entry to the removed endpoint existed before the sync and is gone after it,
//!   and the flow's next datagrams reach the remaining endpoint.
//! - Without it (the bare `IptablesDataplane`): the entry stays and the flow keeps reaching the
//!   removed endpoint — what the cleanup is for.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::netfilter::with_conntrack::WithConntrackCleanup;
use kproxy::model::{IpFamily, Tracker};
use kproxy_tests::iptables_corpus::feed;
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{NODE_IP, POD_PORT, Pod, TopologySpec};
use kproxy_tests::traffic::UdpFlow;
use serde::Deserialize;
use serde_json::json;

const NODE_NAME: &str = "node";
const CLUSTER_IP: &str = "10.96.0.20";
const PORT: u16 = 53;

fn service() -> Service {
    Service::deserialize(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "dns", "namespace": "default"},
        "spec": {"clusterIP": CLUSTER_IP,
                 "ports": [{"name": "udp", "port": PORT, "protocol": "UDP"}]},
    }))
    .expect("service")
}

fn slice(pods: &[&Pod]) -> EndpointSlice {
    let endpoints: Vec<_> = pods
        .iter()
        .map(|p| {
            json!({"addresses": [p.ip.to_string()], "conditions": {"ready": true},
                   "nodeName": NODE_NAME})
        })
        .collect();
    EndpointSlice::deserialize(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "dns-1", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "dns"}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "udp", "port": POD_PORT, "protocol": "UDP"}],
    }))
    .expect("slice")
}

fn run(with_cleanup: bool) {
    let hint = if with_cleanup {
        "ipt-udp-ct"
    } else {
        "ipt-udp-no"
    };
    let mut topo = TopologySpec::new(hint)
        .local_pods(2)
        .remote_pods(0)
        .ipv6(false)
        .build()
        .expect("topology");
    topo.serve_all().expect("servers");
    let mut cfg = IptablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap()),
    );
    cfg.node_ip = Some(NODE_IP.into());
    cfg.netns = Some(topo.node.path());
    cfg.sync_period = Duration::from_secs(3600);
    let ipt = IptablesDataplane::new([cfg]).expect("dataplane");
    let mut dp: Box<dyn Dataplane> = if with_cleanup {
        Box::new(WithConntrackCleanup::new(ipt, &[IpFamily::V4], None))
    } else {
        Box::new(ipt)
    };
    let mut tracker = Tracker::new(NODE_NAME);
    let both: Vec<&Pod> = topo.local_pods().collect();
    let (snap, changed) = feed(&mut tracker, &[service()], &[slice(&both)]);
    // Syncs run inside the node namespace: the conntrack cleanup talks netlink there.
    topo.node
        .run(|| dp.sync(&snap, &changed))
        .expect("netns")
        .expect("first sync");

    // The client's flow: one connected socket, so one source port for every datagram.
    let flow = UdpFlow::connect(&topo.client, &format!("{CLUSTER_IP}:{PORT}"));
    let first = flow.exchange();
    for _ in 0..5 {
        assert_eq!(flow.exchange(), first, "one flow, one backend (conntrack)");
    }
    let removed = topo.pod(&first);
    let remaining: &Pod = both
        .iter()
        .copied()
        .find(|p| p.name != first)
        .expect("the other pod");
    assert_eq!(
        flow.entries(&topo.node, CLUSTER_IP, &removed.ip.to_string())
            .len(),
        1,
        "the flow's conntrack entry to {first} before the removal"
    );

    // The endpoint the flow uses is removed from the service (its server keeps answering).
    let (snap, changed) = feed(&mut tracker, &[service()], &[slice(&[remaining])]);
    assert_eq!(changed.services.len(), 1);
    topo.node
        .run(|| dp.sync(&snap, &changed))
        .expect("netns")
        .expect("sync after the removal");

    if with_cleanup {
        assert_eq!(
            flow.entries(&topo.node, CLUSTER_IP, &removed.ip.to_string()),
            Vec::<String>::new(),
            "the cleanup deleted the stale entry to {first}"
        );
        for _ in 0..5 {
            assert_eq!(
                flow.exchange(),
                remaining.name,
                "the flow moved to the remaining endpoint"
            );
        }
        assert_eq!(
            flow.entries(&topo.node, CLUSTER_IP, &remaining.ip.to_string())
                .len(),
            1
        );
    } else {
        assert_eq!(
            flow.entries(&topo.node, CLUSTER_IP, &removed.ip.to_string())
                .len(),
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
    run(true);
}

#[test]
fn udp_flow_sticks_to_a_removed_endpoint_without_the_cleanup() {
    if !require_root() {
        return;
    }
    run(false);
}
