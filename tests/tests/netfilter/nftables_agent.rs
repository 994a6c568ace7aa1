//! The real `kproxy` binary in nftables mode, in the node namespace of the shared topology, is
//! killed with SIGKILL (`kill -9`) and started again while two long-lived TCP connections run:
//!
//! - the external client → NodePort on the node address → a backend on node2 (DNAT and
//!   masquerade through the `ip kube-proxy` table, the reply path through conntrack);
//! - a pod → ClusterIP → another local pod;
//!
//! and a UDP flow (one socket) from the client to a ClusterIP with two endpoints.
//!
//! Asserted: both connections keep exchanging data across the kill, the restart and the new
//! agent's first (full) sync — each `kp-probe hold` is still running once the new agent has
//! synced, then finishes without an error; the UDP flow keeps its backend; the flows'
//! conntrack entries are the same before and after (not deleted and re-created: the new
//! agent's first conntrack cleanup leaves live flows alone); new connections through both
//! services work after the restart.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kproxy_tests::agentproc::{AgentProcess, ScratchDir, http_get};
use kproxy_tests::http::sample;
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{NODE_IP, NODE_POD_CIDR, Probe, Topology};
use kproxy_tests::traffic::{Hold, UdpFlow, topology};

const NODE: &str = "nft-agent-node";
const CLUSTER_IP: &str = "10.96.0.40";
const NODE_PORT: u16 = 30090;
/// A UDP service with two endpoints (pod-l0, pod-l1).
const DNS_IP: &str = "10.96.0.42";
/// How long each long-lived connection runs: the kill, the restart and the first sync of the
/// new agent happen well inside it (asserted, not assumed).
const HOLD_SECONDS: u64 = 20;

fn manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let local = topo.pod("pod-l1").ip;
    let other = topo.pod("pod-l0").ip;
    let remote = topo.pod("pod-r0").ip;
    let web = [Port::tcp("http", 80, 8080).node_port(NODE_PORT)];
    let api = [Port::tcp("http", 80, 8080)];
    let dns = [Port::udp("dns", 53, 8080)];
    yaml::write(
        dir,
        &[
            yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
            yaml::service("web", "10.96.0.41", &web),
            yaml::slice("web", &web, &[(remote, "node2")]).yaml(),
            yaml::service("api", CLUSTER_IP, &api),
            yaml::slice("api", &api, &[(local, NODE)]).yaml(),
            yaml::service("dns", DNS_IP, &dns),
            yaml::slice("dns", &dns, &[(local, NODE), (other, NODE)]).yaml(),
        ],
    )
}

/// Waits for the agent's first full nftables sync (its metrics server counts it).
fn wait_full_sync(agent: &mut AgentProcess, ns: &Netns) {
    agent.wait_for("the first full sync", || {
        http_get(ns, 10249, "/metrics").filter(|(_, body)| {
            body.lines().any(|l| {
                l.starts_with("kubeproxy_sync_full_proxy_rules_duration_seconds_count")
                    && l.contains("IPv4")
                    && sample(body, l.split(' ').next().unwrap_or_default())
                        .is_some_and(|n| n >= 1.0)
            })
        })
    });
}

/// The `proto` conntrack entries (`conntrack -L -o id`, in `ns`) to `vip` (TCP: established
/// ones), sorted, without their timeouts (which tick). The id tells a re-created entry.
fn ct_entries(ns: &Netns, proto: &str, vip: &str) -> Vec<String> {
    let out = ns
        .command("conntrack")
        .args(["-L", "-p", proto, "--orig-dst", vip, "-o", "id"])
        .output()
        .expect("conntrack -L");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| proto != "tcp" || l.contains("ESTABLISHED"))
        .map(|l| {
            l.split_whitespace()
                .enumerate()
                .filter(|(i, _)| *i != 2) // <proto> <number> <timeout> …
                .map(|(_, w)| w)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    lines.sort();
    lines
}

/// The conntrack entries of the three long-lived flows.
fn flows(ns: &Netns) -> [Vec<String>; 3] {
    [
        ct_entries(ns, "tcp", &NODE_IP.to_string()),
        ct_entries(ns, "tcp", CLUSTER_IP),
        ct_entries(ns, "udp", DNS_IP),
    ]
}

#[test]
fn kill_9_and_restart_keeps_live_tcp_connections() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-agent", 2, 1, false);
    let scratch = ScratchDir::new("nft-agent").unwrap();
    let m = manifests(&topo, &scratch.0);
    let args = vec![
        "--proxy-mode=nftables".to_string(),
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
        "--healthz-bind-address=".to_string(),
        // nf_conntrack_max cannot be set from a test namespace: leave it as it is.
        "--conntrack-max-per-core=0".to_string(),
        "--cluster-cidr=10.244.0.0/16".to_string(),
    ];
    let mut agent = AgentProcess::start(&topo.node, &args, scratch.0.join("kproxy-1.log"));
    wait_full_sync(&mut agent, &topo.node);
    let nodeport = format!("{NODE_IP}:{NODE_PORT}");
    let cluster_ip = format!("{CLUSTER_IP}:80");
    let pod0 = &topo.pod("pod-l0").ns;
    agent.wait_for("the NodePort to answer", || {
        Probe::tcp(&nodeport, 1)
            .timeout(Duration::from_millis(500))
            .run(&topo.client, None)
            .ok()
            .filter(|r| r.total_answers() == 1)
    });

    let mut ext = Hold::start(
        &topo.client,
        None,
        &nodeport,
        HOLD_SECONDS,
        "client → NodePort",
    );
    let mut int = Hold::start(pod0, None, &cluster_ip, HOLD_SECONDS, "pod → ClusterIP");
    assert_eq!(ext.backend, "pod-r0");
    assert_eq!(int.backend, "pod-l1");
    // Let both exchange a few lines, so their conntrack entries are established ones.
    std::thread::sleep(Duration::from_millis(500));
    // A UDP flow (one socket) keeps its backend through its conntrack entry.
    let udp = UdpFlow::connect(&topo.client, &format!("{DNS_IP}:53"));
    let udp_backend = udp.exchange();
    let ct_before = flows(&topo.node);
    assert_eq!(
        ct_before.each_ref().map(Vec::len),
        [1, 1, 1],
        "one entry per flow: {ct_before:#?}"
    );

    agent.kill();
    // Service traffic never depended on the agent process: the connections are still up.
    std::thread::sleep(Duration::from_secs(1));
    ext.assert_running();
    int.assert_running();

    let mut agent = AgentProcess::start(&topo.node, &args, scratch.0.join("kproxy-2.log"));
    wait_full_sync(&mut agent, &topo.node);
    // Let the connections exchange lines after the new agent's sync (and its conntrack cleanup).
    std::thread::sleep(Duration::from_secs(1));
    ext.assert_running();
    int.assert_running();
    let ct_after = flows(&topo.node);
    assert_eq!(
        ct_after, ct_before,
        "the flows' conntrack entries changed across the restart"
    );
    for _ in 0..5 {
        assert_eq!(
            udp.exchange(),
            udp_backend,
            "the UDP flow keeps its backend"
        );
    }

    // New connections through both services.
    let r = Probe::tcp(&nodeport, 10).run(&topo.client, None).unwrap();
    assert_eq!(r.answers.get("pod-r0"), Some(&10), "{r:?}");
    let r = Probe::tcp(&cluster_ip, 10).run(pod0, None).unwrap();
    assert_eq!(r.answers.get("pod-l1"), Some(&10), "{r:?}");

    // Both long-lived connections ran to their end, echoing all along (100 ms interval).
    ext.finish();
    int.finish();
    assert!(
        !agent.log().contains("ERROR"),
        "errors after the restart:\n{}",
        agent.log()
    );
}
