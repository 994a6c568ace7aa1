//! Real traffic through the nftables proxier: the shared topology (tests/src/topology.rs)
//! with `NftablesDataplane` programming the `ip kube-proxy` table inside the node namespace
//! only (through `nsenter --net=…` `nft`).
//!
//! VIPs: ClusterIPs in 10.96.0.0/12, routed by the client via the node; the node has a
//! default route like a real node, so traffic that is not DNATed is routed and meets the
//! filter chains.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::nftables::kernel::NftRunner;
use kproxy::dataplane::nftables::{NftablesConfig, NftablesDataplane};
use kproxy::model::{IpFamily, Tracker};
use kproxy_tests::iptables_corpus::feed;
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{
    CLIENT_IP, NODE_IP, POD_PORT, Pod, PodNode, Probe, Topology, TopologySpec, assert_spread,
};
use serde::Deserialize;
use serde_json::{Value, json};

const NODE_NAME: &str = "node";

fn service(name: &str, spec: Value) -> Service {
    Service::deserialize(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }))
    .expect("service")
}

fn slice(service: &str, pods: &[&Pod]) -> EndpointSlice {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|p| {
            json!({
                "addresses": [p.ip.to_string()],
                "conditions": {"ready": true},
                "nodeName": if p.on == PodNode::Local { NODE_NAME } else { "node2" },
            })
        })
        .collect();
    EndpointSlice::deserialize(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-1"), "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "", "port": POD_PORT, "protocol": "TCP"}],
    }))
    .expect("slice")
}

fn tcp_port(port: u16) -> Value {
    json!({"name": "", "port": port, "protocol": "TCP"})
}

struct Rig {
    topo: Topology,
    dp: NftablesDataplane,
    tracker: Tracker,
}

fn rig(hint: &str, local: usize, remote: usize) -> Rig {
    let mut topo = TopologySpec::new(hint)
        .local_pods(local)
        .remote_pods(remote)
        .build()
        .expect("topology");
    topo.serve_all().expect("servers");
    topo.node
        .ip(&["route", "add", "default", "via", &CLIENT_IP.to_string()])
        .expect("default route");
    let mut cfg = NftablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap()),
    );
    cfg.node_ip = Some(NODE_IP.into());
    let runner = NftRunner {
        netns: Some(topo.node.path()),
    };
    let dp = NftablesDataplane::new([cfg], runner, Duration::from_secs(3600)).expect("dataplane");
    Rig {
        topo,
        dp,
        tracker: Tracker::new(NODE_NAME),
    }
}

impl Rig {
    fn sync(&mut self, services: &[Service], slices: &[EndpointSlice]) {
        let (snap, changed) = feed(&mut self.tracker, services, slices);
        self.dp.sync(&snap, &changed).expect("sync");
    }
    fn pods(&self, names: &[&str]) -> Vec<&Pod> {
        names.iter().map(|n| self.topo.pod(n)).collect()
    }
    fn table_exists(&self) -> bool {
        self.topo
            .node
            .exec("nft", &["list", "table", "ip", "kube-proxy"])
            .is_ok()
    }
}

#[test]
fn cluster_ip_tcp_spreads_over_endpoints() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-cip", 2, 0);
    let svc = service(
        "web",
        json!({"clusterIP": "10.96.0.10", "ports": [tcp_port(80)]}),
    );
    let sl = slice("web", &r.pods(&["pod-l0", "pod-l1"]));
    r.sync(&[svc], &[sl]);
    let tcp = Probe::tcp("10.96.0.10:80", 200)
        .run(&r.topo.client, None)
        .expect("tcp");
    assert_spread(&tcp, &["pod-l0", "pod-l1"]);
    // From a pod too.
    let from_pod = Probe::tcp("10.96.0.10:80", 50)
        .run(&r.topo.pod("pod-l0").ns, None)
        .expect("pod tcp");
    assert_eq!(from_pod.total_errors(), 0, "{from_pod:?}");
    assert_eq!(from_pod.total_answers(), 50);
    // A second, partial sync that adds an endpoint reaches it too.
    let svc = service(
        "web",
        json!({"clusterIP": "10.96.0.10", "ports": [tcp_port(80)]}),
    );
    let sl = slice("web", &r.pods(&["pod-l1"]));
    r.sync(&[svc], &[sl]);
    assert!(!r.dp.families()[0].proxier.stats.full, "a partial sync");
    let after = Probe::tcp("10.96.0.10:80", 40)
        .run(&r.topo.client, None)
        .expect("tcp");
    assert_eq!(after.answers.get("pod-l1"), Some(&40), "{after:?}");
}

#[test]
fn node_port_from_the_external_client() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-np", 1, 1);
    let svc = service(
        "np",
        json!({"type": "NodePort", "clusterIP": "10.96.0.11",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30080}]}),
    );
    let sl = slice("np", &r.pods(&["pod-l0", "pod-r0"]));
    r.sync(&[svc], &[sl]);
    let res = Probe::tcp(format!("{NODE_IP}:30080"), 200)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_spread(&res, &["pod-l0", "pod-r0"]);
    // eTP=Cluster masquerades: backends see a node address, not the client.
    for pod in ["pod-l0", "pod-r0"] {
        assert!(
            !res.peer_ips(pod).contains(&CLIENT_IP.to_string()),
            "{pod} saw the client address: {res:?}"
        );
    }
}

#[test]
fn no_endpoints_rejects() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-rej", 1, 0);
    let svc = service(
        "empty",
        json!({"clusterIP": "10.96.0.16", "ports": [tcp_port(80)]}),
    );
    r.sync(&[svc], &[]);
    r.topo.assert_connects_refused("10.96.0.16:80");
}

#[test]
fn an_external_table_deletion_is_repaired_by_the_next_sync() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-del", 1, 0);
    let svc = service(
        "del",
        json!({"clusterIP": "10.96.0.17", "ports": [tcp_port(80)]}),
    );
    let sl = slice("del", &r.pods(&["pod-l0"]));
    r.sync(std::slice::from_ref(&svc), std::slice::from_ref(&sl));
    let ok = Probe::tcp("10.96.0.17:80", 5)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(ok.answers.get("pod-l0"), Some(&5), "{ok:?}");

    r.topo
        .node
        .exec("nft", &["delete", "table", "ip", "kube-proxy"])
        .expect("delete table");
    assert!(!r.table_exists());
    let broken = Probe::tcp("10.96.0.17:80", 2)
        .timeout(Duration::from_millis(500))
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(broken.total_answers(), 0, "table deleted: {broken:?}");

    // The next sync (nothing changed in the model: the periodic resync) repairs it.
    let (snap, changed) = feed(&mut r.tracker, &[svc], &[sl]);
    r.dp.sync(&snap, &changed).expect("resync");
    assert!(r.table_exists());
    let fixed = Probe::tcp("10.96.0.17:80", 5)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(fixed.answers.get("pod-l0"), Some(&5), "{fixed:?}");

    // Cleanup deletes the table.
    r.dp.cleanup().expect("cleanup");
    assert!(!r.table_exists());
}
