//! The real `kproxy` binary in iptables mode, in the node namespace of the shared topology:
//! an external `iptables -t nat -F` is repaired by the canary monitor, which asks the sync loop
//! for a (full) sync — without any service change and long before the sync period.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kproxy_tests::netns::{Netns, require_root, unique_name};
use kproxy_tests::topology::{NODE_IP, NODE_POD_CIDR, Probe, Topology, TopologySpec, kproxy_bin};

const NODE: &str = "ipt-agent-node";
const CLUSTER_IP: &str = "10.96.0.10";
/// Generous liveness bound for "traffic works (again)".
const LIVENESS: Duration = Duration::from_secs(30);
/// The sync period the agent runs with: far longer than the test, so only the monitor's
/// request can trigger the repairing sync.
const SYNC_PERIOD: &str = "600s";

fn manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let eps: String = topo
        .local_pods()
        .map(|p| {
            format!(
                "  - addresses: [\"{}\"]\n    conditions: {{ready: true}}\n    nodeName: {NODE}\n",
                p.ip
            )
        })
        .collect();
    let yaml = format!(
        r#"apiVersion: v1
kind: Node
metadata: {{name: {NODE}}}
spec: {{podCIDRs: ["{NODE_POD_CIDR}"]}}
status:
  addresses: [{{type: InternalIP, address: {NODE_IP}}}]
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  type: ClusterIP
  clusterIP: {CLUSTER_IP}
  clusterIPs: ["{CLUSTER_IP}"]
  ipFamilies: ["IPv4"]
  ports:
    - {{name: http, protocol: TCP, port: 80, targetPort: 8080}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  namespace: default
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{{name: http, protocol: TCP, port: 8080}}]
endpoints:
{eps}"#
    );
    let path = dir.join("cluster.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

struct Scratch(PathBuf);
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The agent process; killed on drop.
struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the ClusterIP answers from `ns`; panics with the agent's log otherwise.
fn wait_serving(agent: &mut Agent, ns: &Netns, what: &str) -> Duration {
    let start = Instant::now();
    loop {
        if let Ok(Some(st)) = agent.child.try_wait() {
            panic!("kproxy exited ({st}):\n{}", agent.log());
        }
        let r = Probe::tcp(format!("{CLUSTER_IP}:80"), 1)
            .timeout(Duration::from_millis(500))
            .run(ns, None);
        if r.is_ok_and(|r| r.total_answers() == 1) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < LIVENESS,
            "{what}: {CLUSTER_IP}:80 never answered; kproxy log:\n{}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
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
    let dir = std::env::temp_dir().join(unique_name("ipt-agent"));
    std::fs::create_dir_all(&dir).unwrap();
    let scratch = Scratch(dir);
    let m = manifests(&topo, &scratch.0);
    let log = scratch.0.join("kproxy.log");
    let f = File::create(&log).unwrap();
    let mut cmd: Command = topo.node.command(kproxy_bin().unwrap());
    cmd.args([
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=iptables".into(),
        format!("--iptables-sync-period={SYNC_PERIOD}"),
        "--healthz-bind-address=".into(),
        "--metrics-bind-address=".into(),
    ])
    .stdin(Stdio::null())
    .stdout(f.try_clone().unwrap())
    .stderr(f);
    let mut agent = Agent {
        child: cmd.spawn().expect("spawning kproxy"),
        log,
    };
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
