//! Real traffic through the iptables proxier: the shared topology (tests/src/topology.rs)
//! with `IptablesDataplane` programming iptables inside the node namespace only.
//!
//! VIPs: ClusterIPs in 10.96.0.0/12, external IP 198.51.100.10, LB IP 203.0.113.10 (all
//! routed by the client via the node; the node has a default route like a real node so
//! traffic that is not DNATed is routed and meets the filter rules).

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::iptables::config::BackendChoice as Choice;
use kproxy::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::model::{ChangedSet, IpFamily, Tracker};
use kproxy_tests::iptables_corpus::feed;
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{
    CLIENT_IP, NODE_IP, Pod, Probe, Topology, TopologySpec, assert_spread,
};
use kproxy_tests::traffic::{self, NODE_NAME, service, tcp_port};
use serde_json::json;

/// The pods' IPv4 endpoints, TCP and UDP ports (tests/src/traffic.rs).
fn slice(service: &str, pods: &[&Pod]) -> EndpointSlice {
    traffic::slice(service, pods, IpFamily::V4)
}

struct Rig {
    topo: Topology,
    dp: IptablesDataplane,
    tracker: Tracker,
}

fn rig(hint: &str, local: usize, remote: usize, backend: Choice, monitor: Duration) -> Rig {
    let mut topo = TopologySpec::new(hint)
        .local_pods(local)
        .remote_pods(remote)
        .build()
        .expect("topology");
    topo.serve_all().expect("servers");
    topo.node
        .ip(&["route", "add", "default", "via", &CLIENT_IP.to_string()])
        .expect("default route");
    let mut cfg = IptablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap()),
    );
    cfg.node_ip = Some(NODE_IP.into());
    cfg.netns = Some(topo.node.path());
    cfg.backend = backend;
    cfg.sync_period = monitor;
    let dp = IptablesDataplane::new([cfg]).expect("dataplane");
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
}

#[test]
fn cluster_ip_tcp_and_udp_spread_over_endpoints() {
    if !require_root() {
        return;
    }
    for backend in [Choice::Nft, Choice::Legacy] {
        let mut r = rig("ipt-cip", 2, 0, backend, Duration::from_secs(3600));
        let svc = service(
            "web",
            json!({"clusterIP": "10.96.0.10", "ports": [tcp_port(80),
                   {"name": "udp", "port": 53, "protocol": "UDP"}]}),
            json!({}),
        );
        let sl = slice("web", &r.pods(&["pod-l0", "pod-l1"]));
        r.sync(&[svc], &[sl]);
        let tcp = Probe::tcp("10.96.0.10:80", 200)
            .run(&r.topo.client, None)
            .expect("tcp");
        assert_spread(&tcp, &["pod-l0", "pod-l1"]);
        let udp = Probe::udp("10.96.0.10:53", 200)
            .run(&r.topo.client, None)
            .expect("udp");
        assert_spread(&udp, &["pod-l0", "pod-l1"]);
        // From a pod too (not masqueraded: the pod's own address is seen).
        let from_pod = Probe::tcp("10.96.0.10:80", 50)
            .run(&r.topo.pod("pod-l0").ns, None)
            .expect("pod tcp");
        assert_eq!(from_pod.total_errors(), 0, "{from_pod:?}");
        assert_eq!(from_pod.total_answers(), 50);
    }
}

#[test]
fn node_port_with_local_and_remote_backend() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-np", 1, 1, Choice::Auto, Duration::from_secs(3600));
    let svc = service(
        "np",
        json!({"type": "NodePort", "clusterIP": "10.96.0.11",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30080}]}),
        json!({}),
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
fn external_ip_and_load_balancer_ip_with_source_ranges() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-lb", 2, 0, Choice::Auto, Duration::from_secs(3600));
    let allowed = service(
        "lb-allow",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.12",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30081}],
               "externalIPs": ["198.51.100.10"],
               "loadBalancerSourceRanges": ["192.168.77.0/24"]}),
        json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}),
    );
    let denied = service(
        "lb-deny",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.13",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30082}],
               "loadBalancerSourceRanges": ["10.1.0.0/16"]}),
        json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.11"}]}}),
    );
    let slices = [
        slice("lb-allow", &r.pods(&["pod-l0", "pod-l1"])),
        slice("lb-deny", &r.pods(&["pod-l0", "pod-l1"])),
    ];
    r.sync(&[allowed, denied], &slices);
    let ext = Probe::tcp("198.51.100.10:80", 100)
        .run(&r.topo.client, None)
        .expect("ext");
    assert_spread(&ext, &["pod-l0", "pod-l1"]);
    let lb = Probe::tcp("203.0.113.10:80", 100)
        .run(&r.topo.client, None)
        .expect("lb");
    assert_spread(&lb, &["pod-l0", "pod-l1"]);
    let deny = Probe::tcp("203.0.113.11:80", 3)
        .timeout(Duration::from_millis(500))
        .run(&r.topo.client, None)
        .expect("deny");
    assert_eq!(deny.total_answers(), 0, "source range must drop: {deny:?}");
    assert_eq!(
        deny.errors.get("TimedOut"),
        Some(&3),
        "dropped, not refused: {deny:?}"
    );
}

#[test]
fn external_traffic_policy_local_uses_local_endpoints_and_keeps_client_ip() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-etp", 1, 1, Choice::Auto, Duration::from_secs(3600));
    let svc = service(
        "etp",
        json!({"type": "NodePort", "clusterIP": "10.96.0.14", "externalTrafficPolicy": "Local",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30083}]}),
        json!({}),
    );
    let sl = slice("etp", &r.pods(&["pod-l0", "pod-r0"]));
    r.sync(&[svc], &[sl]);
    let res = Probe::tcp(format!("{NODE_IP}:30083"), 50)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(res.total_errors(), 0, "{res:?}");
    assert_eq!(
        res.answers.get("pod-l0"),
        Some(&50),
        "only the local endpoint: {res:?}"
    );
    assert_eq!(
        res.peer_ips("pod-l0"),
        vec![CLIENT_IP.to_string()],
        "client IP kept"
    );
    // The ClusterIP still uses every endpoint.
    let cip = Probe::tcp("10.96.0.14:80", 200)
        .run(&r.topo.client, None)
        .expect("cip");
    assert_spread(&cip, &["pod-l0", "pod-r0"]);
}

#[test]
fn client_ip_session_affinity_sticks() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-aff", 2, 0, Choice::Auto, Duration::from_secs(3600));
    let svc = service(
        "sticky",
        json!({"clusterIP": "10.96.0.15", "ports": [tcp_port(80)], "sessionAffinity": "ClientIP"}),
        json!({}),
    );
    let sl = slice("sticky", &r.pods(&["pod-l0", "pod-l1"]));
    r.sync(&[svc], &[sl]);
    let res = Probe::tcp("10.96.0.15:80", 60)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(res.total_errors(), 0, "{res:?}");
    assert_eq!(res.answers.len(), 1, "one backend for one client: {res:?}");
}

#[test]
fn no_endpoints_rejects_fast() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-rej", 1, 0, Choice::Auto, Duration::from_secs(3600));
    let svc = service(
        "empty",
        json!({"clusterIP": "10.96.0.16", "ports": [tcp_port(80)]}),
        json!({}),
    );
    r.sync(&[svc], &[]);
    r.topo.assert_connects_refused("10.96.0.16:80");
}

#[test]
fn external_nat_flush_is_repaired_after_the_monitor_fires() {
    if !require_root() {
        return;
    }
    let mut r = rig("ipt-mon", 1, 0, Choice::Auto, Duration::from_millis(300));
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    r.dp.set_resync_callback(Arc::new(move || {
        let _ = tx.lock().unwrap().send(());
    }));
    let svc = service(
        "mon",
        json!({"clusterIP": "10.96.0.17", "ports": [tcp_port(80)]}),
        json!({}),
    );
    let sl = slice("mon", &r.pods(&["pod-l0"]));
    r.sync(std::slice::from_ref(&svc), std::slice::from_ref(&sl));
    let ok = Probe::tcp("10.96.0.17:80", 5)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(ok.answers.get("pod-l0"), Some(&5), "{ok:?}");

    r.topo
        .node
        .exec("iptables", &["-t", "nat", "-F"])
        .expect("flush");
    let broken = Probe::tcp("10.96.0.17:80", 2)
        .timeout(Duration::from_millis(500))
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(broken.total_answers(), 0, "nat flushed: {broken:?}");

    rx.recv_timeout(Duration::from_secs(10))
        .expect("the canary monitor noticed the flush");
    let full_before = r.dp.proxiers()[0].stats.full_syncs;
    // What the sync runner does on the monitor's request: sync (nothing changed).
    let (snap, _) = feed(&mut r.tracker, &[svc], &[sl]);
    r.dp.sync(&snap, &ChangedSet::default()).expect("resync");
    assert_eq!(
        r.dp.proxiers()[0].stats.full_syncs,
        full_before + 1,
        "the resync is full"
    );
    let fixed = Probe::tcp("10.96.0.17:80", 5)
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(fixed.answers.get("pod-l0"), Some(&5), "{fixed:?}");
}
