//! The real `kproxy` binary in nftables mode, in the node namespace of the shared topology
//! (tests/src/topology.rs), with real traffic, for two of upstream's nftables options:
//!
//! - `nodePortAddresses` unset ⇒ `primary` (upstream's nftables default): a NodePort answers on
//!   the Node object's primary IP and not on a secondary address of the same interface (which
//!   answers once `--nodeport-addresses=0.0.0.0/0` is given); a change of the Node's IP makes
//!   the agent exit to be restarted, as upstream's;
//! - the service CIDRs of `cluster-ips-check`: an unallocated address of a service CIDR is
//!   DROPped (connects time out, no RST) while an unused port of an active ClusterIP is
//!   REJECTed — with the CIDRs from kproxy's `--service-cidrs` (standalone: no API server), and
//!   from a `ServiceCIDR` object served by the fake API server.
//!
//! The unallocated address 10.96.0.99 is also an address of the client namespace (which the
//! node's default route leads to): were it not dropped, the client's kernel would answer the
//! SYN with a RST, so a timeout shows the drop rule and nothing else.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kproxy_tests::agentns::NsFakeApi;
use kproxy_tests::agentproc::{AgentProcess, ScratchDir};
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{
    CLIENT_IP, NODE_IP, NODE_POD_CIDR, Probe, ProbeResult, Topology, TopologySpec,
};

const NODE: &str = "nft-opts-node";
const CLUSTER_IP: &str = "10.96.0.10";
const SERVICE_CIDR: &str = "10.96.0.0/12";
/// In [`SERVICE_CIDR`], no Service has it.
const UNALLOCATED: &str = "10.96.0.99";
const NODE_PORT: u16 = 30080;
/// A second address on the node's client-side interface: not the Node object's IP.
const SECONDARY_IP: &str = "192.168.77.50";

/// The Node, a NodePort Service on [`CLUSTER_IP`] and its EndpointSlice (the local pods), as
/// YAML documents.
fn cluster_yaml(topo: &Topology) -> String {
    let http = [Port::tcp("http", 80, 8080).node_port(NODE_PORT)];
    let eps: Vec<_> = topo.local_pods().map(|p| (p.ip, NODE)).collect();
    yaml::documents(&[
        yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
        yaml::service("web", CLUSTER_IP, &http),
        yaml::slice("web", &http, &eps).yaml(),
    ])
}

fn write_manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, cluster_yaml(topo)).unwrap();
    path
}

fn topology(hint: &str) -> Topology {
    let mut topo = TopologySpec::new(hint)
        .local_pods(1)
        .remote_pods(0)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    // Like a real node: traffic that is not DNATed is routed on (and meets the filter chains).
    topo.node
        .ip(&["route", "add", "default", "via", &CLIENT_IP.to_string()])
        .unwrap();
    topo
}

fn agent_args(extra: &[String]) -> Vec<String> {
    let mut args = vec![
        format!("--hostname-override={NODE}"),
        "--proxy-mode=nftables".into(),
        "--healthz-bind-address=".into(),
        "--metrics-bind-address=".into(),
    ];
    args.extend_from_slice(extra);
    args
}

fn tcp(ns: &Netns, addr: &str, count: u32, timeout: Duration) -> ProbeResult {
    Probe::tcp(addr, count)
        .timeout(timeout)
        .run(ns, None)
        .expect("probe")
}

/// Waits until `addr` answers from `ns`.
fn wait_answering(agent: &mut AgentProcess, ns: &Netns, addr: &str) {
    agent.wait_for(&format!("{addr} to answer"), || {
        (tcp(ns, addr, 1, Duration::from_millis(500)).total_answers() == 1).then_some(())
    });
}

#[test]
fn node_port_defaults_to_the_primary_ip_in_nftables_mode() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-npa");
    topo.node
        .ip(&["addr", "add", &format!("{SECONDARY_IP}/24"), "dev", "eth0"])
        .unwrap();
    let scratch = ScratchDir::new("nft-npa").unwrap();
    let m = write_manifests(&topo, &scratch.0);
    let manifests = format!("--manifests={}", m.display());

    let mut agent = AgentProcess::start(
        &topo.node,
        &agent_args(std::slice::from_ref(&manifests)),
        scratch.0.join("kproxy.log"),
    );
    let primary = format!("{NODE_IP}:{NODE_PORT}");
    wait_answering(&mut agent, &topo.client, &primary);
    let ok = tcp(&topo.client, &primary, 20, Duration::from_secs(2));
    assert_eq!(ok.total_answers(), 20, "{ok:?}");
    // The secondary address is the node's too, but not a NodePort address: the SYN reaches
    // the node's own stack, where nothing listens on the port.
    let secondary = format!("{SECONDARY_IP}:{NODE_PORT}");
    let off = tcp(&topo.client, &secondary, 5, Duration::from_secs(2));
    assert_eq!(off.total_answers(), 0, "{off:?}\n{}", agent.log());
    assert_eq!(off.errors.get("ConnectionRefused"), Some(&5), "{off:?}");
    let set = topo
        .node
        .exec("nft", &["list", "set", "ip", "kube-proxy", "nodeport-ips"])
        .unwrap();
    assert!(
        set.contains(&NODE_IP.to_string()) && !set.contains(SECONDARY_IP),
        "{set}"
    );
    agent.kill();

    // The same node with every address: the secondary one answers too (so the refusal above
    // was the default at work, not the topology).
    let mut agent = AgentProcess::start(
        &topo.node,
        &agent_args(&[manifests, "--nodeport-addresses=0.0.0.0/0".into()]),
        scratch.0.join("kproxy-all.log"),
    );
    wait_answering(&mut agent, &topo.client, &secondary);
    let all = tcp(&topo.client, &secondary, 20, Duration::from_secs(2));
    assert_eq!(all.total_answers(), 20, "{all:?}");
}

#[test]
fn a_node_ip_change_restarts_the_agent_under_primary() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-npip");
    let scratch = ScratchDir::new("nft-npip").unwrap();
    let m = write_manifests(&topo, &scratch.0);
    let mut agent = AgentProcess::start(
        &topo.node,
        &agent_args(&[format!("--manifests={}", m.display())]),
        scratch.0.join("kproxy.log"),
    );
    wait_answering(&mut agent, &topo.client, &format!("{NODE_IP}:{NODE_PORT}"));
    // The Node now lists another IP: the NodePort addresses of `primary` are stale, so the
    // agent exits to be restarted (upstream's NodeManager).
    let moved = cluster_yaml(&topo).replace(
        &format!("address: {NODE_IP}}}"),
        &format!("address: {SECONDARY_IP}}}"),
    );
    assert_ne!(moved, cluster_yaml(&topo));
    std::fs::write(&m, moved).unwrap();
    let deadline = std::time::Instant::now() + kproxy_tests::agentproc::LIVENESS;
    let status = loop {
        if let Some(st) = agent.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "kproxy kept running after the Node's IP changed:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(status.code(), Some(1), "{}", agent.log());
    assert!(
        agent.log().contains("NodeIPs changed for the node"),
        "{}",
        agent.log()
    );
}

/// The unallocated address is dropped from the node (OUTPUT) and from a pod (FORWARD); an
/// unused port of the active ClusterIP is rejected; the ClusterIP's port answers.
fn assert_drop_and_reject(topo: &Topology, agent: &mut AgentProcess) {
    wait_answering(agent, &topo.client, &format!("{CLUSTER_IP}:80"));
    let pod = &topo.pod("pod-l0").ns;
    for (from, ns) in [("node", &topo.node), ("pod", pod)] {
        let r = tcp(ns, &format!("{UNALLOCATED}:80"), 3, Duration::from_secs(2));
        assert_eq!(r.total_answers(), 0, "from the {from}: {r:?}");
        assert_eq!(
            r.errors.get("TimedOut"),
            Some(&3),
            "from the {from}: dropped (a timeout, no RST): {r:?}\n{}\n{}",
            agent.log(),
            topo.node
                .exec("nft", &["list", "table", "ip", "kube-proxy"])
                .unwrap_or_default()
        );
    }
    topo.assert_connects_refused(&format!("{CLUSTER_IP}:81"));
}

/// Makes [`UNALLOCATED`] an address of the client namespace (see the module docs), and checks
/// that without kproxy's rules it answers with a RST.
fn unallocated_answers_without_rules(topo: &Topology) {
    topo.client
        .ip(&["addr", "add", &format!("{UNALLOCATED}/32"), "dev", "lo"])
        .unwrap();
    let r = tcp(
        &topo.node,
        &format!("{UNALLOCATED}:80"),
        1,
        Duration::from_secs(2),
    );
    assert_eq!(
        r.errors.get("ConnectionRefused"),
        Some(&1),
        "refused before kproxy runs: {r:?}"
    );
}

#[test]
fn unallocated_service_cidr_addresses_are_dropped_with_the_configured_cidrs() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-scidr");
    unallocated_answers_without_rules(&topo);
    let scratch = ScratchDir::new("nft-scidr").unwrap();
    let m = write_manifests(&topo, &scratch.0);
    let mut agent = AgentProcess::start(
        &topo.node,
        &agent_args(&[
            format!("--manifests={}", m.display()),
            format!("--service-cidrs={SERVICE_CIDR}"),
        ]),
        scratch.0.join("kproxy.log"),
    );
    assert_drop_and_reject(&topo, &mut agent);
    let log = agent.log();
    assert!(
        log.contains("service CIDRs from the configuration"),
        "the log says where the CIDRs come from:\n{log}"
    );
}

#[test]
fn unallocated_service_cidr_addresses_are_dropped_with_service_cidr_objects() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-scapi");
    unallocated_answers_without_rules(&topo);
    let api = NsFakeApi::start(&topo.node);
    for doc in cluster_yaml(&topo).split("\n---\n") {
        let v: serde_yaml::Value = serde_yaml::from_str(doc).unwrap();
        match v["kind"].as_str() {
            Some("Node") => {
                api.api
                    .create(&serde_yaml::from_value::<Node>(v).unwrap())
                    .unwrap();
            }
            Some("Service") => {
                api.api
                    .create(&serde_yaml::from_value::<Service>(v).unwrap())
                    .unwrap();
            }
            Some("EndpointSlice") => {
                let s = serde_yaml::from_value::<EndpointSlice>(v).unwrap();
                api.api.create(&s).unwrap();
            }
            other => panic!("unexpected document {other:?}"),
        }
    }
    let cidr: ServiceCIDR = serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": [SERVICE_CIDR]},
    }))
    .unwrap();
    api.api.create(&cidr).unwrap();
    let scratch = ScratchDir::new("nft-scapi").unwrap();
    let kubeconfig = api.kubeconfig(&scratch.0);
    let mut agent = AgentProcess::start(
        &topo.node,
        // A configured CIDR that does not hold the address: the API's must win.
        &agent_args(&[
            format!("--kubeconfig={}", kubeconfig.display()),
            "--service-cidrs=172.30.0.0/16".into(),
        ]),
        scratch.0.join("kproxy.log"),
    );
    agent.wait_for("the ServiceCIDR object's CIDR in cluster-ips-check", || {
        topo.node
            .exec(
                "nft",
                &["list", "chain", "ip", "kube-proxy", "cluster-ips-check"],
            )
            .ok()
            .filter(|c| c.contains(SERVICE_CIDR))
    });
    assert_drop_and_reject(&topo, &mut agent);
    let log = agent.log();
    assert!(
        log.contains("service CIDRs from the ServiceCIDR objects"),
        "the log says where the CIDRs come from:\n{log}"
    );
}
