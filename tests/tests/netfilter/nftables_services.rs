//! Real traffic through the nftables proxier, service type by service type: the shared
//! topology (tests/src/topology.rs) and rig (tests/src/traffic.rs) with `NftablesDataplane`
//! (wrapped in the conntrack cleanup, as the agent builds it) programming the `ip` (and `ip6`)
//! `kube-proxy` tables inside the node namespace only.
//!
//! VIPs: ClusterIPs in 10.96.0.0/12 (fd00:96::/64), external IP 198.51.100.10, LB IPs
//! 203.0.113.0/24 (fd00:203::/64), all routed by the client via the node.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::netfilter::with_conntrack::WithConntrackCleanup;
use kproxy::dataplane::nftables::kernel::NftRunner;
use kproxy::dataplane::nftables::{NftablesConfig, NftablesDataplane};
use kproxy::model::IpFamily;
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{
    CLIENT_IP, CLIENT_IP6, NODE_IP, NODE_IP6, Probe, ProbeResult, Server, assert_spread, target_bin,
};
use kproxy_tests::traffic::{Rig, service, slice, tcp_port, topology, udp_port};
use serde_json::{Value, json};

type NftRig = Rig<WithConntrackCleanup<NftablesDataplane>>;

/// The topology with `local` and `remote` pods and the nftables datapath for IPv4 (and IPv6
/// when `ipv6`) in its node namespace.
fn rig(hint: &str, local: usize, remote: usize, ipv6: bool) -> NftRig {
    let topo = topology(hint, local, remote, ipv6);
    let mut v4 = NftablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap()),
    );
    v4.node_ip = Some(NODE_IP.into());
    let mut cfgs = vec![v4];
    if ipv6 {
        let mut v6 = NftablesConfig::new(
            IpFamily::V6,
            LocalDetector::Cidr("fd00:244::/32".parse().unwrap()),
        );
        v6.node_ip = Some(NODE_IP6.into());
        cfgs.push(v6);
    }
    let families: Vec<IpFamily> = cfgs.iter().map(|c| c.family).collect();
    let runner = NftRunner {
        netns: Some(topo.node.path()),
    };
    let dp = NftablesDataplane::new(cfgs, runner, Duration::from_secs(3600)).expect("dataplane");
    Rig::new(topo, WithConntrackCleanup::new(dp, &families, None))
}

fn svc(name: &str, spec: Value) -> Service {
    service(name, spec, json!({}))
}

fn v4_slice(r: &NftRig, name: &str, pods: &[&str]) -> EndpointSlice {
    slice(name, &r.pods(pods), IpFamily::V4)
}

fn tcp(r: &NftRig, addr: impl Into<String>, n: u32) -> ProbeResult {
    Probe::tcp(addr, n)
        .run(&r.topo.client, None)
        .expect("probe")
}

/// Three connects from `ns` that must all go unanswered (dropped, so timed out).
fn assert_dropped(ns: &Netns, addr: &str) {
    let res = Probe::tcp(addr, 3)
        .timeout(Duration::from_millis(500))
        .run(ns, None)
        .expect("probe");
    assert_eq!(res.total_answers(), 0, "{addr} must be dropped: {res:?}");
    assert_eq!(
        res.errors.get("TimedOut"),
        Some(&3),
        "{addr}: dropped, not refused: {res:?}"
    );
}

#[test]
fn cluster_ip_tcp_and_udp_spread_over_endpoints() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-spread", 2, 0, false);
    let s = svc(
        "web",
        json!({"clusterIP": "10.96.0.10", "ports": [tcp_port(80), udp_port(53)]}),
    );
    let sl = v4_slice(&r, "web", &["pod-l0", "pod-l1"]);
    r.sync(&[s], &[sl]);
    assert_spread(&tcp(&r, "10.96.0.10:80", 200), &["pod-l0", "pod-l1"]);
    let udp = Probe::udp("10.96.0.10:53", 200)
        .run(&r.topo.client, None)
        .expect("udp");
    assert_spread(&udp, &["pod-l0", "pod-l1"]);
    // From a pod too (hairpin included): every connect is answered.
    let from_pod = Probe::tcp("10.96.0.10:80", 50)
        .run(&r.topo.pod("pod-l0").ns, None)
        .expect("pod tcp");
    assert_eq!(from_pod.total_errors(), 0, "{from_pod:?}");
    assert_eq!(from_pod.total_answers(), 50);
    // And from the node itself (the output path).
    let from_node = Probe::tcp("10.96.0.10:80", 50)
        .run(&r.topo.node, None)
        .expect("node tcp");
    assert_spread(&from_node, &["pod-l0", "pod-l1"]);
}

#[test]
fn cluster_ip_unused_port_is_rejected() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-port", 1, 0, false);
    let s = svc(
        "web",
        json!({"clusterIP": "10.96.0.18", "ports": [tcp_port(80)]}),
    );
    let sl = v4_slice(&r, "web", &["pod-l0"]);
    r.sync(&[s], &[sl]);
    let ok = tcp(&r, "10.96.0.18:80", 5);
    assert_eq!(ok.answers.get("pod-l0"), Some(&5), "{ok:?}");
    // Port 81 is no port of the service: REJECTed (refused at once), not left to time out.
    r.topo.assert_connects_refused("10.96.0.18:81");
}

#[test]
fn node_port_to_a_local_and_to_a_remote_endpoint() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-nplr", 1, 1, false);
    let np = |name: &str, cip: &str, node_port: u16| {
        svc(
            name,
            json!({"type": "NodePort", "clusterIP": cip,
                   "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": node_port}]}),
        )
    };
    let services = [
        np("local", "10.96.0.21", 30091),
        np("remote", "10.96.0.22", 30092),
    ];
    let slices = [
        v4_slice(&r, "local", &["pod-l0"]),
        v4_slice(&r, "remote", &["pod-r0"]),
    ];
    r.sync(&services, &slices);
    for (port, pod) in [(30091, "pod-l0"), (30092, "pod-r0")] {
        let res = tcp(&r, format!("{NODE_IP}:{port}"), 20);
        assert_eq!(res.total_errors(), 0, "{res:?}");
        assert_eq!(res.answers.get(pod), Some(&20), "NodePort {port}: {res:?}");
        // eTP=Cluster masquerades: the backend sees a node address, not the client.
        assert!(
            !res.peer_ips(pod).contains(&CLIENT_IP.to_string()),
            "{pod} saw the client address: {res:?}"
        );
    }
}

#[test]
fn external_ip_and_load_balancer_ip() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-ext", 2, 0, false);
    let s = service(
        "lb",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.12",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30081}],
               "externalIPs": ["198.51.100.10"]}),
        json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.10"}]}}),
    );
    let sl = v4_slice(&r, "lb", &["pod-l0", "pod-l1"]);
    r.sync(&[s], &[sl]);
    assert_spread(&tcp(&r, "198.51.100.10:80", 100), &["pod-l0", "pod-l1"]);
    assert_spread(&tcp(&r, "203.0.113.10:80", 100), &["pod-l0", "pod-l1"]);
    // Another port of those addresses is no service: not DNATed (no answer).
    let other = Probe::tcp("203.0.113.10:81", 2)
        .timeout(Duration::from_millis(500))
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(other.total_answers(), 0, "{other:?}");
}

#[test]
fn load_balancer_source_ranges_allow_one_source_and_drop_another() {
    if !require_root() {
        return;
    }
    // pod-r0 (10.244.2.2, behind node2) is a second source outside the allowed range.
    let mut r = rig("nft-lbsr", 1, 1, false);
    let s = service(
        "lb",
        json!({"type": "LoadBalancer", "clusterIP": "10.96.0.13",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30082}],
               "loadBalancerSourceRanges": ["192.168.77.0/24"]}),
        json!({"loadBalancer": {"ingress": [{"ip": "203.0.113.11"}]}}),
    );
    let sl = v4_slice(&r, "lb", &["pod-l0"]);
    r.sync(&[s], &[sl]);
    let allowed = tcp(&r, "203.0.113.11:80", 20);
    assert_eq!(allowed.answers.get("pod-l0"), Some(&20), "{allowed:?}");
    assert_dropped(&r.topo.pod("pod-r0").ns, "203.0.113.11:80");
    // The ClusterIP is not subject to the source ranges.
    let cip = Probe::tcp("10.96.0.13:80", 5)
        .run(&r.topo.pod("pod-r0").ns, None)
        .expect("probe");
    assert_eq!(cip.answers.get("pod-l0"), Some(&5), "{cip:?}");
}

fn etp_local(name: &str, cip: &str, node_port: u16, lb_ip: &str) -> Service {
    service(
        name,
        json!({"type": "LoadBalancer", "clusterIP": cip, "externalTrafficPolicy": "Local",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": node_port}]}),
        json!({"loadBalancer": {"ingress": [{"ip": lb_ip}]}}),
    )
}

#[test]
fn external_traffic_policy_local_without_a_local_endpoint_drops() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-etpd", 1, 1, false);
    let s = etp_local("etp", "10.96.0.14", 30083, "203.0.113.14");
    let sl = v4_slice(&r, "etp", &["pod-r0"]);
    r.sync(&[s], &[sl]);
    assert_dropped(&r.topo.client, &format!("{NODE_IP}:30083"));
    assert_dropped(&r.topo.client, "203.0.113.14:80");
    // The ClusterIP (internal policy Cluster) still reaches the remote endpoint.
    let cip = tcp(&r, "10.96.0.14:80", 5);
    assert_eq!(cip.answers.get("pod-r0"), Some(&5), "{cip:?}");
    // Upstream's short-circuits: a pod on this node and the node itself reach the remote
    // endpoint through the LB IP and the NodePort (they are not external clients).
    for (ns, addr) in [
        (&r.topo.pod("pod-l0").ns, "203.0.113.14:80".to_string()),
        (&r.topo.node, format!("{NODE_IP}:30083")),
    ] {
        let res = Probe::tcp(&addr, 5).run(ns, None).expect("probe");
        assert_eq!(res.answers.get("pod-r0"), Some(&5), "{addr}: {res:?}");
    }
}

#[test]
fn external_traffic_policy_local_keeps_the_client_ip() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-etpk", 1, 1, false);
    let s = etp_local("etp", "10.96.0.15", 30084, "203.0.113.15");
    let sl = v4_slice(&r, "etp", &["pod-l0", "pod-r0"]);
    r.sync(&[s], &[sl]);
    for addr in [format!("{NODE_IP}:30084"), "203.0.113.15:80".to_string()] {
        let res = tcp(&r, &addr, 30);
        assert_eq!(res.total_errors(), 0, "{addr}: {res:?}");
        assert_eq!(
            res.answers.get("pod-l0"),
            Some(&30),
            "{addr}: only the local endpoint: {res:?}"
        );
        assert_eq!(
            res.peer_ips("pod-l0"),
            vec![CLIENT_IP.to_string()],
            "{addr}: the backend sees the client's address"
        );
    }
    // The ClusterIP still uses every endpoint.
    assert_spread(&tcp(&r, "10.96.0.15:80", 200), &["pod-l0", "pod-r0"]);
}

#[test]
fn client_ip_session_affinity_sticks() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-aff", 2, 1, false);
    let s = svc(
        "sticky",
        json!({"clusterIP": "10.96.0.16", "ports": [tcp_port(80)], "sessionAffinity": "ClientIP"}),
    );
    let sl = v4_slice(&r, "sticky", &["pod-l0", "pod-l1"]);
    r.sync(&[s], &[sl]);
    // Each client keeps its backend: 60 connects from one source, 60 from another.
    for ns in [&r.topo.client, &r.topo.pod("pod-r0").ns] {
        let res = Probe::tcp("10.96.0.16:80", 60)
            .run(ns, None)
            .expect("probe");
        assert_eq!(res.total_errors(), 0, "{res:?}");
        assert_eq!(res.answers.len(), 1, "one backend for one client: {res:?}");
        assert_eq!(res.total_answers(), 60);
    }
}

/// A dual-stack service of `ports` with the given VIPs and both families' endpoints.
fn dual_stack(
    r: &NftRig,
    name: &str,
    cips: [&str; 2],
    ports: Value,
    pods: &[&str],
) -> (Service, [EndpointSlice; 2]) {
    let kind = if ports.to_string().contains("nodePort") {
        "NodePort"
    } else {
        "ClusterIP"
    };
    let s = svc(
        name,
        json!({"type": kind, "clusterIP": cips[0], "clusterIPs": cips,
               "ipFamilies": ["IPv4", "IPv6"], "ipFamilyPolicy": "RequireDualStack",
               "ports": ports}),
    );
    let pods = r.pods(pods);
    (
        s,
        [
            slice(name, &pods, IpFamily::V4),
            slice(name, &pods, IpFamily::V6),
        ],
    )
}

#[test]
fn ipv6_cluster_ip_tcp_and_udp_spread_and_node_port() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-v6", 1, 1, true);
    let ports = json!([{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30085},
                       {"name": "udp", "port": 53, "protocol": "UDP", "nodePort": 30085}]);
    let (s, slices) = dual_stack(
        &r,
        "web",
        ["10.96.0.19", "fd00:96::19"],
        ports,
        &["pod-l0", "pod-r0"],
    );
    r.sync(&[s], &slices);
    let both = ["pod-l0", "pod-r0"];
    assert_spread(&tcp(&r, "[fd00:96::19]:80", 200), &both);
    let udp = Probe::udp("[fd00:96::19]:53", 200)
        .run(&r.topo.client, None)
        .expect("udp");
    assert_spread(&udp, &both);
    let np = tcp(&r, format!("[{NODE_IP6}]:30085"), 200);
    assert_spread(&np, &both);
    for pod in both {
        assert!(
            !np.peer_ips(pod).contains(&CLIENT_IP6.to_string()),
            "eTP=Cluster masquerades: {pod} saw the client: {np:?}"
        );
    }
    // The IPv4 side of the same service works alongside.
    assert_spread(&tcp(&r, "10.96.0.19:80", 100), &both);
}

#[test]
fn ipv6_cluster_ip_unused_port_and_no_endpoints_are_rejected() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-v6rej", 1, 0, true);
    let (s, slices) = dual_stack(
        &r,
        "web",
        ["10.96.0.23", "fd00:96::23"],
        json!([tcp_port(80)]),
        &["pod-l0"],
    );
    let (empty, _) = dual_stack(
        &r,
        "empty",
        ["10.96.0.24", "fd00:96::24"],
        json!([tcp_port(80)]),
        &[],
    );
    r.sync(&[s, empty], &slices);
    let ok = tcp(&r, "[fd00:96::23]:80", 5);
    assert_eq!(ok.answers.get("pod-l0"), Some(&5), "{ok:?}");
    r.topo.assert_connects_refused("[fd00:96::23]:81");
    r.topo.assert_connects_refused("[fd00:96::24]:80");
}

#[test]
fn node_port_without_endpoints_is_rejected() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-nprej", 1, 0, false);
    let s = svc(
        "np",
        json!({"type": "NodePort", "clusterIP": "10.96.0.25",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30093}]}),
    );
    r.sync(&[s], &[]);
    // Something listens on the node at that port: only the REJECT keeps it from answering.
    let mut cmd = r
        .topo
        .node
        .command(target_bin("kp-probe").expect("kp-probe"));
    cmd.args(["serve", "node", "--tcp", "30093"]);
    let _server = Server::start(cmd, "a server on the node").expect("server");
    r.topo.assert_connects_refused(&format!("{NODE_IP}:30093"));
}

#[test]
fn ipv6_external_traffic_policy_local_keeps_the_client_ip() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-v6etp", 1, 1, true);
    let s = service(
        "etp",
        json!({"type": "LoadBalancer", "clusterIP": "fd00:96::26", "clusterIPs": ["fd00:96::26"],
               "ipFamilies": ["IPv6"], "externalTrafficPolicy": "Local",
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": 30094}]}),
        json!({"loadBalancer": {"ingress": [{"ip": "fd00:203::26"}]}}),
    );
    let sl = slice("etp", &r.pods(&["pod-l0", "pod-r0"]), IpFamily::V6);
    r.sync(&[s], &[sl]);
    for addr in [
        format!("[{NODE_IP6}]:30094"),
        "[fd00:203::26]:80".to_string(),
    ] {
        let res = tcp(&r, &addr, 30);
        assert_eq!(res.total_errors(), 0, "{addr}: {res:?}");
        assert_eq!(
            res.answers.get("pod-l0"),
            Some(&30),
            "{addr}: only the local endpoint: {res:?}"
        );
        assert_eq!(
            res.peer_ips("pod-l0"),
            vec![CLIENT_IP6.to_string()],
            "{addr}: the backend sees the client's address"
        );
    }
}

#[test]
fn ipv6_external_ip_load_balancer_ip_source_ranges_and_affinity() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-v6lb", 2, 1, true);
    let lb = |name: &str, cip: &str, node_port: u16, lb_ip: &str, extra: Value| {
        let mut spec = json!({"type": "LoadBalancer", "clusterIP": cip, "clusterIPs": [cip],
               "ipFamilies": ["IPv6"],
               "ports": [{"name": "", "port": 80, "protocol": "TCP", "nodePort": node_port}]});
        spec.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        service(
            name,
            spec,
            json!({"loadBalancer": {"ingress": [{"ip": lb_ip}]}}),
        )
    };
    let services = [
        lb(
            "open",
            "fd00:96::27",
            30095,
            "fd00:203::27",
            json!({"externalIPs": ["fd00:198::27"]}),
        ),
        lb(
            "ranged",
            "fd00:96::28",
            30096,
            "fd00:203::28",
            json!({"loadBalancerSourceRanges": ["fd00:77::/64"]}),
        ),
        lb(
            "sticky",
            "fd00:96::29",
            30097,
            "fd00:203::29",
            json!({"sessionAffinity": "ClientIP"}),
        ),
    ];
    let both = ["pod-l0", "pod-l1"];
    let slices: Vec<EndpointSlice> = ["open", "ranged", "sticky"]
        .iter()
        .map(|n| slice(n, &r.pods(&both), IpFamily::V6))
        .collect();
    r.sync(&services, &slices);
    assert_spread(&tcp(&r, "[fd00:198::27]:80", 100), &both);
    assert_spread(&tcp(&r, "[fd00:203::27]:80", 100), &both);
    // Source ranges: the client (fd00:77::2) reaches, pod-r0 (behind node2) is dropped.
    let allowed = tcp(&r, "[fd00:203::28]:80", 20);
    assert_eq!(allowed.total_answers(), 20, "{allowed:?}");
    assert_dropped(&r.topo.pod("pod-r0").ns, "[fd00:203::28]:80");
    // Affinity: each client keeps its backend.
    for ns in [&r.topo.client, &r.topo.pod("pod-r0").ns] {
        let res = Probe::tcp("[fd00:96::29]:80", 60)
            .run(ns, None)
            .expect("probe");
        assert_eq!(res.total_answers(), 60, "{res:?}");
        assert_eq!(res.answers.len(), 1, "one backend for one client: {res:?}");
    }
}

#[test]
fn internal_traffic_policy_local_uses_local_endpoints_or_drops() {
    if !require_root() {
        return;
    }
    let mut r = rig("nft-itp", 1, 1, false);
    let itp = |name: &str, cip: &str| {
        svc(
            name,
            json!({"clusterIP": cip, "internalTrafficPolicy": "Local", "ports": [tcp_port(80)]}),
        )
    };
    let services = [itp("both", "10.96.0.31"), itp("remote", "10.96.0.32")];
    let slices = [
        v4_slice(&r, "both", &["pod-l0", "pod-r0"]),
        v4_slice(&r, "remote", &["pod-r0"]),
    ];
    r.sync(&services, &slices);
    let res = tcp(&r, "10.96.0.31:80", 30);
    assert_eq!(
        res.answers.get("pod-l0"),
        Some(&30),
        "only the local endpoint: {res:?}"
    );
    assert_dropped(&r.topo.client, "10.96.0.32:80");
}
