//! Issue #3 test 6: the real `kproxy` binary in ebpf mode is killed with SIGKILL (`kill -9`)
//! and started again over the same pins, while two long-lived TCP connections run:
//!
//! - the external client → NodePort on the node address → a backend on node2 (DNAT, BPF SNAT
//!   and the reverse path, all through the TC programs and `KP_CT`);
//! - a pod inside the socket-LB cgroup → ClusterIP → a local pod (socket LB).
//!
//! Asserted: both connections keep exchanging data across the kill and the restart (each
//! `kp-probe hold` is still running once the new agent has synced, then finishes without an
//! error); every pinned link (9 socket-LB links: the 8 `sock_addr` hooks and `sock_release`,
//! which deletes a closed socket's reverse-NAT entries; 4 TC links per device) has the same id
//! before and after; the NodePort flow's `KP_CT` entries (read from the pinned map) are the same
//! before and after apart from their last-used time; new connections through both services
//! work after the restart. The agent's metrics server counts the one SCTP service port in
//! `kproxy_bpf_skipped_service_ports{protocol="SCTP"}` (the eBPF datapath does not translate
//! SCTP).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use aya::programs::links::{FdLink, PinnedLink};
use kproxy_common::ct::{CT_F_CLOSING, CtEntry, CtKey, CtKind, MAP_CT};
use kproxy_common::service::PROTO_TCP;
use kproxy_tests::agentproc::{AgentProcess, ScratchDir, http_get};
use kproxy_tests::http::sample;
use kproxy_tests::manifests::{self as yaml, Port};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, require_root};
use kproxy_tests::topology::{CLIENT_IP, NODE_IP, NODE_POD_CIDR, Probe, Topology, TopologySpec};
use kproxy_tests::traffic::Hold;

const NODE: &str = "kpt-node";
const CLUSTER_IP: &str = "10.96.0.20";
const NODE_PORT: u16 = 30081;
/// How long each long-lived connection runs: the kill, the restart and the first sync of the
/// new agent happen well inside it (asserted, not assumed).
const HOLD_SECONDS: u64 = 25;

fn manifests(topo: &Topology, dir: &Path) -> PathBuf {
    let local = topo.pod("pod-l1").ip;
    let remote = topo.pod("pod-r0").ip;
    let web = [Port::tcp("http", 80, 8080).node_port(NODE_PORT)];
    let api = [Port::tcp("http", 80, 8080)];
    let signalling = [Port::sctp("sctp", 3868, 3868), Port::tcp("tcp", 3869, 3869)];
    yaml::write(
        dir,
        &[
            yaml::node(NODE, NODE_IP, NODE_POD_CIDR),
            yaml::service("web", "10.96.0.21", &web),
            yaml::slice("web", &web, &[(remote, "node2")]).yaml(),
            yaml::service("api", CLUSTER_IP, &api),
            yaml::slice("api", &api, &[(local, NODE)]).yaml(),
            yaml::service("signalling", "10.96.0.22", &signalling),
        ],
    )
}

/// Waits until the agent reports a successful sync of every service port (the SCTP one
/// counted as skipped).
fn wait_synced(agent: &mut AgentProcess, ns: &Netns) {
    let m = agent.wait_for("a sync of every service port", || {
        let (_, m) = http_get(ns, 10249, "/metrics")?;
        (sample(&m, "kproxy_programmed_services") == Some(4.0)).then_some(m)
    });
    assert_eq!(
        sample(&m, "kproxy_bpf_skipped_service_ports{protocol=\"SCTP\"}"),
        Some(1.0),
        "one SCTP service port is skipped:\n{m}"
    );
}

/// Link id of every pin under `<bpffs>/kproxy/links`, by pin name.
fn link_ids(bpffs: &Bpffs) -> BTreeMap<String, u32> {
    let dir = bpffs.path().join("kproxy/links");
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let link = PinnedLink::from_pin(&path).unwrap();
            (name, FdLink::from(link).info().unwrap().id())
        })
        .collect()
}

/// The `KP_CT` entries of the open NodePort flow from the client (its `Service` entry and
/// every entry sharing its flow identity: reverse DNAT, SNAT out/in), keyed by key, with
/// `last_seen_ns` zeroed (it moves with every packet).
fn nodeport_flow(bpffs: &Bpffs) -> BTreeMap<(u32, u32, u16, u16, u8, u8), CtEntry> {
    let data = MapData::from_pin(bpffs.path().join("kproxy").join(MAP_CT)).unwrap();
    let map: BpfHashMap<MapData, CtKey, CtEntry> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    let all: Vec<(CtKey, CtEntry)> = map.iter().map(Result::unwrap).collect();
    let client = u32::from_ne_bytes(CLIENT_IP.octets());
    let open: Vec<&(CtKey, CtEntry)> = all
        .iter()
        .filter(|(k, e)| {
            k.kind == CtKind::Service as u8
                && k.proto == PROTO_TCP
                && k.saddr == client
                && k.dport == NODE_PORT.to_be()
                && e.flags & CT_F_CLOSING == 0
        })
        .collect();
    assert_eq!(
        open.len(),
        1,
        "exactly one open NodePort flow from the client: {all:#?}"
    );
    let (_, flow) = open[0];
    all.iter()
        .filter(|(k, e)| {
            k.proto == PROTO_TCP
                && e.svc_id == flow.svc_id
                && e.backend_id == flow.backend_id
                && e.created_ns == flow.created_ns
        })
        .map(|(k, e)| {
            (
                (k.saddr, k.daddr, k.sport, k.dport, k.proto, k.kind),
                CtEntry {
                    last_seen_ns: 0,
                    ..*e
                },
            )
        })
        .collect()
}

#[test]
fn kill_9_and_restart_keeps_connections_links_and_conntrack() {
    if !require_root() {
        return;
    }
    let mut topo = TopologySpec::new("ar-restart")
        .local_pods(2)
        .remote_pods(1)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    let scratch = ScratchDir::new("ar-restart").unwrap();
    let bpffs = Bpffs::new("ar-restart-fs").unwrap();
    let cg = TestCgroup::new("ar-restart-cg").unwrap();
    let m = manifests(&topo, &scratch.0);
    let args = vec![
        "--proxy-mode=ebpf".to_string(),
        format!("--manifests={}", m.display()),
        format!("--hostname-override={NODE}"),
        format!("--bpffs={}", bpffs.path().display()),
        format!("--bpf-cgroup={}", cg.path().display()),
        "--metrics-bind-address=127.0.0.1:10249".to_string(),
    ];
    let mut agent = AgentProcess::start(&topo.node, &args, scratch.0.join("kproxy-1.log"));
    wait_synced(&mut agent, &topo.node);

    let nodeport = format!("{NODE_IP}:{NODE_PORT}");
    let cluster_ip = format!("{CLUSTER_IP}:80");
    let pod0 = &topo.pod("pod-l0").ns;
    let ext = Hold::start(
        &topo.client,
        None,
        &nodeport,
        HOLD_SECONDS,
        "client → NodePort",
    );
    let int = Hold::start(
        pod0,
        Some(&cg),
        &cluster_ip,
        HOLD_SECONDS,
        "pod → ClusterIP",
    );
    assert_eq!(ext.backend, "pod-r0");
    assert_eq!(int.backend, "pod-l1");
    // Let both exchange a few lines, so the CT entries are established ones.
    std::thread::sleep(Duration::from_millis(500));

    let links_before = link_ids(&bpffs);
    let sock_links = links_before
        .keys()
        .filter(|n| !n.starts_with("tc-"))
        .count();
    let tc_links = links_before.keys().filter(|n| n.starts_with("tc-")).count();
    // connect4/6, sendmsg4/6, recvmsg4/6, getpeername4/6 and sock_release (issue #22: a
    // closed socket's KP_SOCK_RNAT/KP_SOCK_FWD entries are deleted).
    assert_eq!(sock_links, 9, "socket-LB links: {links_before:?}");
    assert!(tc_links >= 4, "TC links on eth0 and eth1: {links_before:?}");
    let ct_before = nodeport_flow(&bpffs);
    assert!(
        ct_before.len() >= 3,
        "the SNATed NodePort flow has service, reverse and SNAT entries: {ct_before:#?}"
    );

    agent.kill();
    // Service traffic never depended on the agent process: the connections are still up.
    std::thread::sleep(Duration::from_secs(1));
    let mut ext = ext;
    let mut int = int;
    ext.assert_running();
    int.assert_running();

    let mut agent = AgentProcess::start(&topo.node, &args, scratch.0.join("kproxy-2.log"));
    wait_synced(&mut agent, &topo.node);
    // A sync after the restart has run (and a CT maintenance pass after it).
    std::thread::sleep(Duration::from_secs(1));
    ext.assert_running();
    int.assert_running();

    assert_eq!(
        link_ids(&bpffs),
        links_before,
        "the restarted agent replaced pinned links; log:\n{}",
        agent.log()
    );
    assert_eq!(
        nodeport_flow(&bpffs),
        ct_before,
        "the NodePort flow's conntrack entries changed across the restart"
    );

    // New connections through both services.
    let r = Probe::tcp(&nodeport, 10)
        .timeout(Duration::from_secs(2))
        .run(&topo.client, None)
        .unwrap();
    assert_eq!(r.answers.get("pod-r0"), Some(&10), "{r:?}");
    let r = Probe::tcp(&cluster_ip, 10)
        .timeout(Duration::from_secs(2))
        .run(pod0, Some(&cg))
        .unwrap();
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
