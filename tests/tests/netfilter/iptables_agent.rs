//! The real `kproxy` binary in iptables mode, in the node namespace of the shared topology:
//! an external `iptables -t nat -F` is repaired by the canary monitor, which asks the sync loop
//! for a (full) sync — without any service change and long before the sync period.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kproxy_tests::agentproc::{AgentProcess, ScratchDir};
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{NODE_IP, NODE_POD_CIDR, Probe, Topology, TopologySpec};

const NODE: &str = "ipt-agent-node";
const CLUSTER_IP: &str = "10.96.0.10";
/// The sync period the agent runs with: far longer than the test, so only the monitor's
/// request can trigger the repairing sync.
const SYNC_PERIOD: &str = "600s";

fn manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let http = [Port::tcp("http", 80, 8080)];
    let eps: Vec<_> = topo.local_pods().map(|p| (p.ip, NODE)).collect();
    yaml::write(
        dir,
        &[
            yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
            yaml::service("web", CLUSTER_IP, &http),
            yaml::slice("web", &http, &eps).yaml(),
        ],
    )
}

/// Waits until the ClusterIP answers from `ns`; returns how long that took.
fn wait_serving(agent: &mut AgentProcess, ns: &Netns, what: &str) -> Duration {
    let start = Instant::now();
    agent.wait_for(&format!("{CLUSTER_IP}:80 to answer ({what})"), || {
        Probe::tcp(format!("{CLUSTER_IP}:80"), 1)
            .timeout(Duration::from_millis(500))
            .run(ns, None)
            .ok()
            .filter(|r| r.total_answers() == 1)
    });
    start.elapsed()
}

fn nat_rules(ns: &Netns) -> Vec<String> {
    let o = ns
        .command("iptables-save")
        .args(["-t", "nat"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.starts_with("-A "))
        .map(String::from)
        .collect()
}

#[test]
fn external_nat_flush_is_repaired_by_the_canary_monitor() {
    if !require_root() {
        return;
    }
    let mut topo = TopologySpec::new("ipt-agent")
        .local_pods(2)
        .remote_pods(0)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    let scratch = ScratchDir::new("ipt-agent").unwrap();
    let m = manifests(&topo, &scratch.0);
    let args = [
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=iptables".into(),
        format!("--iptables-sync-period={SYNC_PERIOD}"),
        "--healthz-bind-address=".into(),
        "--metrics-bind-address=".into(),
    ];
    let mut agent = AgentProcess::start(&topo.node, &args, scratch.0.join("kproxy.log"));
    wait_serving(&mut agent, &topo.client, "initial sync");
    let before = nat_rules(&topo.node);
    assert!(
        before.iter().any(|l| l.contains("-j KUBE-SERVICES")),
        "`iptables` shows the agent's rules: {before:#?}\n{}",
        agent.log()
    );

    // An external flush of the whole nat table (chains stay, rules go).
    topo.node
        .exec("iptables", &["-t", "nat", "-F"])
        .expect("iptables -t nat -F");
    let flushed = nat_rules(&topo.node);
    assert!(
        !flushed.iter().any(|l| l.contains("KUBE-")),
        "the flush removed our rules: {flushed:#?}"
    );

    let took = wait_serving(&mut agent, &topo.client, "after iptables -t nat -F");
    let after = nat_rules(&topo.node);
    assert!(
        after.iter().any(|l| l.contains("-j KUBE-SERVICES")),
        "{after:#?}"
    );
    let log = agent.log();
    assert!(
        log.contains("iptables rules were flushed; forcing a full resync"),
        "the monitor noticed the flush:\n{log}"
    );
    eprintln!("traffic through the ClusterIP again {took:.1?} after the flush");
}
