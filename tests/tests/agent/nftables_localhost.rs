//! Localhost NodePorts in nftables mode (feature gate `KubeProxyNFTablesLocalhostNodePorts`):
//! the real agent in the node namespace of the shared topology, `curl 127.0.0.1:<nodePort>`
//! from the node itself.
//!
//! - gate on: 127.0.0.1:<nodePort> reaches every endpoint, local and remote (the userspace
//!   proxy); a NodePort without endpoints is refused at once (like the table's REJECT); a
//!   NodePort change moves the listener (old port refused, new port answers); a connection
//!   opened before an endpoint change keeps working;
//! - gate off (the default): nothing answers on 127.0.0.1:<nodePort> (nftables cannot DNAT
//!   loopback), while the node's own address still serves the NodePort.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kproxy_tests::agentproc::{AgentProcess, ScratchDir};
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{
    NODE_IP, NODE_POD_CIDR, POD_PORT, Pod, PodNode, Probe, Topology, TopologySpec, assert_spread,
    kproxy_bin,
};

const NODE: &str = "kpt-node";
const GATE: &str = "KubeProxyNFTablesLocalhostNodePorts";

fn topology(hint: &str) -> Topology {
    let mut t = TopologySpec::new(hint)
        .local_pods(2)
        .remote_pods(1)
        .ipv6(false)
        .build()
        .unwrap();
    t.serve_all().unwrap();
    t
}

/// A NodePort service `name` (ClusterIP `vip`, node port `node_port`) over `pods`.
fn service_yaml(name: &str, vip: &str, node_port: u16, pods: &[&Pod]) -> String {
    let eps: String = pods
        .iter()
        .map(|p| {
            let node = if p.on == PodNode::Local {
                NODE
            } else {
                "node2"
            };
            format!(
                "  - addresses: [\"{}\"]\n    conditions: {{ready: true}}\n    nodeName: {node}\n",
                p.ip
            )
        })
        .collect();
    let eps = if eps.is_empty() {
        "  []\n".to_string()
    } else {
        eps
    };
    format!(
        r#"---
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  type: NodePort
  clusterIP: {vip}
  clusterIPs: ["{vip}"]
  ipFamilies: ["IPv4"]
  ports:
    - {{name: http, protocol: TCP, port: 80, targetPort: {POD_PORT}, nodePort: {node_port}}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports: [{{name: http, protocol: TCP, port: {POD_PORT}}}]
endpoints:
{eps}"#
    )
}

fn write_manifests(dir: &Path, services: &[String]) -> PathBuf {
    let node = format!(
        "apiVersion: v1\nkind: Node\nmetadata: {{name: {NODE}}}\nspec: {{podCIDRs: [\"{NODE_POD_CIDR}\"]}}\n\
         status:\n  addresses: [{{type: InternalIP, address: {NODE_IP}}}]\n"
    );
    let dir = dir.join("manifests");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cluster.yaml");
    // Write then rename, so the agent never reads half a file.
    let tmp = dir.join(".cluster.yaml.tmp");
    std::fs::write(&tmp, node + &services.concat()).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    dir
}

fn start(topo: &Topology, scratch: &Path, manifests: &Path, gate: bool, log: &str) -> AgentProcess {
    let mut cmd = topo.node.command(kproxy_bin().unwrap());
    cmd.args([
        format!("--manifests={}", manifests.display()),
        format!("--hostname-override={NODE}"),
        "--proxy-mode=nftables".to_string(),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
    ]);
    if gate {
        cmd.arg(format!("--feature-gates={GATE}=true"));
    }
    AgentProcess::spawn(cmd, scratch.join(log))
}

fn answers(ns: &Netns, addr: &str, n: u32) -> Option<kproxy_tests::topology::ProbeResult> {
    Probe::tcp(addr, n)
        .timeout(Duration::from_millis(800))
        .run(ns, None)
        .ok()
        .filter(|r| r.total_answers() == u64::from(n))
}

/// One line from `s` (the greeting or an echo), byte by byte so nothing is read ahead.
fn read_line(s: &mut TcpStream) -> String {
    let mut line = vec![];
    let mut b = [0u8; 1];
    while line.last() != Some(&b'\n') {
        assert_eq!(s.read(&mut b).expect("read"), 1, "closed after {line:?}");
        line.push(b[0]);
    }
    String::from_utf8(line).unwrap()
}

fn refused(ns: &Netns, addr: &str) -> bool {
    Probe::tcp(addr, 3)
        .timeout(Duration::from_secs(2))
        .run(ns, None)
        .is_ok_and(|r| r.total_answers() == 0 && r.errors.get("ConnectionRefused") == Some(&3))
}

#[test]
fn localhost_nodeports_are_served_by_the_proxy_when_the_gate_is_on() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-lh");
    let scratch = ScratchDir::new("nft-lh").unwrap();
    let all: Vec<&Pod> = topo.pods.iter().collect();
    let web = |port| service_yaml("web", "10.96.0.10", port, &all);
    let empty = service_yaml("empty", "10.96.0.11", 30081, &[]);
    let dir = write_manifests(&scratch.0, &[web(30080), empty.clone()]);
    let mut agent = start(&topo, &scratch.0, &dir, true, "kproxy.log");

    let r = agent.wait_for("127.0.0.1:30080 to answer", || {
        answers(&topo.node, "127.0.0.1:30080", 1)
    });
    assert_eq!(r.total_answers(), 1);
    // Every endpoint, local and remote, is reached from the node's loopback.
    let spread = Probe::tcp("127.0.0.1:30080", 90)
        .run(&topo.node, None)
        .unwrap();
    let names: Vec<&str> = all.iter().map(|p| p.name.as_str()).collect();
    assert_spread(&spread, &names);
    // No endpoints: refused at once, as the table REJECTs.
    assert!(refused(&topo.node, "127.0.0.1:30081"), "{}", agent.log());

    // A connection opened now (from the node's namespace) keeps working across the NodePort
    // move below: its listener closes, the connection does not.
    let mut held = topo
        .node
        .run(|| TcpStream::connect("127.0.0.1:30080"))
        .unwrap()
        .unwrap();
    held.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let greeting = read_line(&mut held);
    assert!(
        names.iter().any(|n| greeting.starts_with(n)),
        "{greeting:?}"
    );

    write_manifests(&scratch.0, &[web(30090), empty]);
    agent.wait_for("the NodePort to move to 30090", || {
        answers(&topo.node, "127.0.0.1:30090", 1)
    });
    agent.wait_for("127.0.0.1:30080 to be refused", || {
        refused(&topo.node, "127.0.0.1:30080").then_some(())
    });
    held.write_all(b"still here\n").unwrap();
    assert_eq!(
        read_line(&mut held),
        "still here\n",
        "the held connection broke"
    );
    agent.kill();
}

#[test]
fn without_the_gate_localhost_nodeports_are_not_served() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-lh0");
    let scratch = ScratchDir::new("nft-lh0").unwrap();
    let all: Vec<&Pod> = topo.pods.iter().collect();
    let dir = write_manifests(
        &scratch.0,
        &[service_yaml("web", "10.96.0.10", 30080, &all)],
    );
    let mut agent = start(&topo, &scratch.0, &dir, false, "kproxy.log");
    agent.wait_for("the NodePort on the node's address", || {
        answers(&topo.client, &format!("{NODE_IP}:30080"), 1)
    });
    assert!(
        refused(&topo.node, "127.0.0.1:30080"),
        "nothing may answer on loopback without the gate:\n{}",
        agent.log()
    );
    agent.kill();
}
