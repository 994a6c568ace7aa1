//! The TC service path on this kernel, end to end: the real eBPF dataplane (planner + applier,
//! pinned maps on a private bpffs, socket LB off) programs NodePort / ExternalIP / LB
//! frontends from snapshots; `kp_tc_in`/`kp_tc_eg` are attached (pinned TCX links) to the
//! devices the default rule selects inside the node namespace of the shared topology; the
//! external client and pods talk through them with `kp-probe`, which reports who answered
//! and the peer address each backend saw.
//!
//! Services: NodePort 30080 (TCP and UDP) on the node addresses, externalIP 203.0.113.10,
//! LB VIP 203.0.113.20; backends pod-l0 (local, 10.244.1.2) and pod-r0 (on node2,
//! 10.244.2.2), port 8080.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::flows;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPath;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPolicy;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::kernel::addresses::AddressWatcher;
use kproxy::model::{ChangedSet, Endpoint, Protocol, ServiceType};
use kproxy_common::service::{BackendValue, MAP_BACKENDS};
use kproxy_tests::netns::{Bpffs, require_root};
use kproxy_tests::tc::ct_entries;
use kproxy_tests::tc::rig::{NODE_PORT, Rig, denied_copy, endpoint, lb_vip, service, snapshot};
use kproxy_tests::topology::{
    CLIENT_IP, NODE_CLIENT_IF, NODE_IP, NODE_LINK_IP, NODE_PEER_IF, Probe,
};

const EXTERNAL_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
const LB_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 20);
const LIVENESS: Duration = Duration::from_secs(10);

fn node_ips() -> Vec<IpAddr> {
    vec![IpAddr::V4(NODE_IP), IpAddr::V4(NODE_LINK_IP)]
}

fn both_pods() -> Vec<Endpoint> {
    vec![
        endpoint(Ipv4Addr::new(10, 244, 1, 2), true),
        endpoint(Ipv4Addr::new(10, 244, 2, 2), false),
    ]
}

#[test]
fn nodeport_from_outside_reaches_local_and_remote_backends() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-np");
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (service("web", Protocol::Tcp), both_pods()),
            (service("web", Protocol::Udp), both_pods()),
        ],
    ));
    // eTP=Cluster: the remote backend's flows are SNATed to the node's address toward it
    // (its replies come back through BPF reverse SNAT); the local one sees the client.
    let flows = rig.assert_both_backends(
        &format!("{NODE_IP}:{NODE_PORT}"),
        NODE_LINK_IP.into(),
        CLIENT_IP.into(),
    );
    // Attached to both node devices through pinned TCX links.
    let attached = rig.tc.attached();
    for dev in [NODE_CLIENT_IF, NODE_PEER_IF] {
        assert!(attached.contains(&dev.to_string()), "{attached:?}");
        for dir in ["in", "eg", "in6", "eg6"] {
            let pin = rig
                .bpffs
                .path()
                .join(format!("kproxy/links/tc-{dev}-{dir}"));
            assert!(pin.exists(), "{} is not pinned", pin.display());
        }
    }
    // The second node address answers too.
    let r = rig.probe(Probe::tcp(format!("{NODE_LINK_IP}:{NODE_PORT}"), 10));
    assert_eq!(r.total_answers(), 10, "{r:?}");
    // Every distinct flow was load-balanced as a new flow once. Not one per probe: the client
    // may reuse a source port, and a reused 4-tuple finds its (still live) flow established.
    let flows = flows + r.distinct_peers();
    let stats = TcPath::stats(&rig.tc_ebpf.lock().unwrap()).unwrap();
    assert!(
        stats["new_flow"] == flows && stats["snat"] > 0 && stats["reply"] > 0,
        "{flows} distinct flows: {stats:?}"
    );
}

#[test]
fn etp_local_keeps_the_client_address_and_drops_without_local_endpoints() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-local");
    let mut local = service("local", Protocol::Tcp);
    local.external_policy_local = true;
    let mut remote_only = service("remote", Protocol::Tcp);
    remote_only.external_policy_local = true;
    remote_only.node_port = NODE_PORT + 1;
    remote_only.cluster_ips = vec!["10.96.0.13".parse().unwrap()];
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (local, both_pods()),
            (
                remote_only,
                vec![endpoint(Ipv4Addr::new(10, 244, 2, 2), false)],
            ),
        ],
    ));
    let r = rig.probe(Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 20));
    assert_eq!(
        r.answers.get("pod-l0"),
        Some(&20),
        "only the local endpoint: {r:?}"
    );
    assert_eq!(
        r.peer_ips("pod-l0"),
        vec![CLIENT_IP.to_string()],
        "client IP preserved"
    );

    // No local endpoint: upstream drops (the client times out; nothing answers).
    let r = rig.probe(
        Probe::tcp(format!("{NODE_IP}:{}", NODE_PORT + 1), 2).timeout(Duration::from_millis(700)),
    );
    assert_eq!(r.total_answers(), 0, "{r:?}");
    assert_eq!(r.errors.get("TimedOut"), Some(&2), "{r:?}");
}

#[test]
fn external_ip_and_lb_vip_with_source_ranges() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-vips");
    let mut ext = service("ext", Protocol::Tcp);
    ext.service_type = ServiceType::ClusterIp;
    ext.node_port = 0;
    ext.external_ips = vec![IpAddr::V4(EXTERNAL_IP)];
    let mut lb = service("lb", Protocol::Tcp);
    lb.cluster_ips = vec!["10.96.0.11".parse().unwrap()];
    lb.node_port = NODE_PORT + 2;
    lb_vip(&mut lb, IpAddr::V4(LB_IP), "192.168.77.0/24");
    let denied = denied_copy(&lb, &["10.96.0.12"], "10.0.0.0/8");
    rig.sync(&snapshot(
        node_ips(),
        vec![(ext, both_pods()), (lb, both_pods()), (denied, both_pods())],
    ));
    rig.assert_source_ranges(
        &[format!("{EXTERNAL_IP}:80"), format!("{LB_IP}:80")],
        &format!("{LB_IP}:81"),
        NODE_LINK_IP.into(),
    );
}

#[test]
fn xdp_drops_source_range_denials_before_tc() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-xdp");
    let mut lb = service("lb", Protocol::Tcp);
    lb_vip(&mut lb, IpAddr::V4(LB_IP), "192.168.77.0/24");
    let denied = denied_copy(&lb, &["10.96.0.12"], "10.0.0.0/8");
    rig.sync(&snapshot(
        node_ips(),
        vec![(lb, both_pods()), (denied, both_pods())],
    ));
    let devices = rig.tc.attached();
    let mut xdp = XdpPath::load(&mut rig.tc_ebpf.lock().unwrap()).unwrap();
    rig.topo
        .node
        .run(|| {
            let mut ebpf = rig.tc_ebpf.lock().unwrap();
            for dev in &devices {
                // veth takes native XDP.
                assert!(xdp.attach(&mut ebpf, dev, XdpPolicy::Native).unwrap());
            }
        })
        .unwrap();
    assert_eq!(xdp.attached(), devices);
    // Allowed: passed by XDP, translated by TC.
    let r = rig.probe(Probe::tcp(format!("{LB_IP}:80"), 20));
    assert_eq!(r.total_answers(), 20, "{r:?}");
    assert_eq!(r.answers.len(), 2, "both backends: {r:?}");
    // Denied: dropped by XDP, so TC never sees the SYNs.
    let r = rig.probe(Probe::tcp(format!("{LB_IP}:81"), 2).timeout(Duration::from_millis(700)));
    assert_eq!(
        r.total_answers(),
        0,
        "client outside the source ranges: {r:?}"
    );
    let ebpf = rig.tc_ebpf.lock().unwrap();
    assert!(XdpPath::stats(&ebpf).unwrap()["source_range_drop"] >= 2);
    assert_eq!(TcPath::stats(&ebpf).unwrap()["source_range_drop"], 0);
}

#[test]
fn no_endpoints_is_refused_fast() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-noep");
    let mut ext = service("ext", Protocol::Tcp);
    ext.external_ips = vec![IpAddr::V4(EXTERNAL_IP)];
    rig.sync(&snapshot(node_ips(), vec![(ext, vec![])]));
    for addr in [
        format!("{NODE_IP}:{NODE_PORT}"),
        format!("{EXTERNAL_IP}:80"),
    ] {
        // A generous timeout: a RST must come long before it.
        let r = rig.probe(Probe::tcp(addr.clone(), 3).timeout(Duration::from_secs(5)));
        assert_eq!(r.errors.get("ConnectionRefused"), Some(&3), "{addr}: {r:?}");
    }
    assert!(TcPath::stats(&rig.tc_ebpf.lock().unwrap()).unwrap()["no_endpoints"] >= 2);
}

#[test]
fn udp_without_endpoints_is_refused_fast() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-noep-udp");
    let mut ext = service("ext", Protocol::Udp);
    ext.external_ips = vec![IpAddr::V4(EXTERNAL_IP)];
    rig.sync(&snapshot(node_ips(), vec![(ext, vec![])]));
    // The ExternalIP gets ICMP port unreachable from the TC program, the NodePort from the
    // node's stack; a connected UDP socket reports either as ECONNREFUSED. A generous
    // timeout: the error must come long before it.
    for addr in [
        format!("{EXTERNAL_IP}:80"),
        format!("{NODE_IP}:{NODE_PORT}"),
    ] {
        let r = rig.probe(Probe::udp(addr.clone(), 3).timeout(Duration::from_secs(5)));
        assert_eq!(r.errors.get("ConnectionRefused"), Some(&3), "{addr}: {r:?}");
    }
    assert!(TcPath::stats(&rig.tc_ebpf.lock().unwrap()).unwrap()["no_endpoints"] >= 3);
}

#[test]
fn hairpin_pod_reaches_its_own_service_through_the_nodeport() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-hairpin");
    rig.sync(&snapshot(
        node_ips(),
        vec![(service("web", Protocol::Tcp), both_pods())],
    ));
    // pod-l0's traffic enters the node through vpod0, which holds the pod gateway address and
    // is therefore a selected device.
    let r = Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 30)
        .run(&rig.topo.pod("pod-l0").ns, None)
        .unwrap();
    assert_eq!(r.total_errors(), 0, "{r:?}");
    assert_eq!(r.total_answers(), 30, "{r:?}");
    assert_eq!(r.answers.len(), 2, "itself and the remote pod: {r:?}");
}

#[test]
fn a_node_address_added_at_run_time_answers_nodeports() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-addr");
    let services = vec![(service("web", Protocol::Tcp), both_pods())];
    rig.sync(&snapshot(node_ips(), services.clone()));
    let new_ip = Ipv4Addr::new(192, 168, 77, 100);

    // The agent's wiring: node addresses → NodePort frontends (planner) and SNAT sources.
    let dp = Arc::clone(&rig.dp);
    let ebpf = Arc::clone(&rig.tc_ebpf);
    let _watcher = rig
        .topo
        .node
        .run(move || {
            AddressWatcher::spawn(None, Duration::from_millis(200), move |addrs| {
                let snap = snapshot(addrs.all(), services.clone());
                dp.lock()
                    .unwrap()
                    .sync(&snap, &ChangedSet::default())
                    .unwrap();
                TcPath::set_node_addresses(&mut ebpf.lock().unwrap(), &addrs.snat_v4()).unwrap();
            })
        })
        .unwrap();

    let quick =
        |addr: &str| rig.probe(Probe::tcp(addr.to_string(), 1).timeout(Duration::from_millis(500)));
    let target = format!("{new_ip}:{NODE_PORT}");
    assert_eq!(quick(&target).total_answers(), 0, "not a node address yet");
    rig.topo
        .node
        .ip(&[
            "addr",
            "add",
            &format!("{new_ip}/24"),
            "dev",
            NODE_CLIENT_IF,
        ])
        .unwrap();
    let start = Instant::now();
    loop {
        if quick(&target).total_answers() == 1 {
            break;
        }
        assert!(start.elapsed() < LIVENESS, "{target} never answered");
    }
    let r = rig.probe(Probe::tcp(target, 10));
    assert_eq!(r.total_answers(), 10, "{r:?}");
}

#[test]
fn endpoint_removal_deletes_its_ct_entries() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-purge");
    let svc = service("web", Protocol::Udp);
    rig.sync(&snapshot(node_ips(), vec![(svc.clone(), both_pods())]));
    let r = rig.probe(Probe::udp(format!("{NODE_IP}:{NODE_PORT}"), 30));
    assert_eq!(r.total_answers(), 30, "{r:?}");
    assert_eq!(r.answers.len(), 2, "{r:?}");

    let backends = |dp: &Arc<Mutex<ServiceMaps>>, bpffs: &Bpffs| -> BTreeSet<u32> {
        let _ = dp;
        let map =
            aya::maps::MapData::from_pin(bpffs.path().join("kproxy").join(MAP_BACKENDS)).unwrap();
        let m: BpfHashMap<_, u32, BackendValue> =
            BpfHashMap::try_from(aya::maps::Map::HashMap(map)).unwrap();
        m.keys().map(Result::unwrap).collect()
    };
    let before = backends(&rig.dp, &rig.bpffs);
    // pod-r0 goes away.
    rig.sync(&snapshot(
        node_ips(),
        vec![(svc, vec![endpoint(Ipv4Addr::new(10, 244, 1, 2), true)])],
    ));
    let after = backends(&rig.dp, &rig.bpffs);
    let removed: Vec<u32> = before.difference(&after).copied().collect();
    assert_eq!(removed.len(), 1, "before {before:?} after {after:?}");

    let mut ebpf = rig.tc_ebpf.lock().unwrap();
    let of_removed = |e: &Ebpf| {
        ct_entries(e)
            .iter()
            .filter(|(_, v)| v.backend_id == removed[0])
            .count()
    };
    let n = of_removed(&ebpf);
    assert!(n > 0, "the removed backend had CT entries");
    let survivors = ct_entries(&ebpf).len() - n;
    assert_eq!(flows::purge_backends(&mut ebpf, &removed).unwrap(), n);
    assert_eq!(of_removed(&ebpf), 0);
    assert_eq!(ct_entries(&ebpf).len(), survivors, "other flows kept");
    drop(ebpf);
    // New flows go to the remaining backend only.
    let r = rig.probe(Probe::udp(format!("{NODE_IP}:{NODE_PORT}"), 10));
    assert_eq!(r.answers.get("pod-l0"), Some(&10), "{r:?}");
}

#[test]
fn restart_reuses_pinned_links_and_keeps_established_flows() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("tc-restart");
    // Remote backend only: the long-lived flow is DNATed, SNATed and reverse-translated.
    rig.sync(&snapshot(
        node_ips(),
        vec![(
            service("web", Protocol::Tcp),
            vec![endpoint(Ipv4Addr::new(10, 244, 2, 2), false)],
        )],
    ));
    let mut cmd = rig
        .topo
        .client
        .command(kproxy_tests::topology::target_bin("kp-probe").unwrap());
    cmd.args([
        "hold",
        &format!("{NODE_IP}:{NODE_PORT}"),
        "--seconds",
        "3",
        "--interval-ms",
        "100",
    ]);
    let mut hold = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(hold.stdout.take().unwrap()).lines();
    let connected = lines.next().unwrap().unwrap();
    assert!(connected.contains("pod-r0"), "{connected}");
    let links = rig.link_ids();
    assert_eq!(
        links.len(),
        kproxy::dataplane::ebpf::node_path::tc::HOOKS.len() * rig.tc.attached().len(),
        "IPv4 and IPv6 ingress and egress links per device"
    );

    rig.restart_tc();
    assert_eq!(rig.link_ids(), links, "the restart replaced the links");

    let r = rig.probe(Probe::tcp(format!("{NODE_IP}:{NODE_PORT}"), 10));
    assert_eq!(
        r.total_answers(),
        10,
        "new connections after the restart: {r:?}"
    );
    let status = hold.wait().unwrap();
    let last = lines.next().unwrap().unwrap();
    assert!(status.success(), "long-lived connection broke: {last}");
    assert!(last.contains("\"exchanges\""), "{last}");
}

/// Translated checksums are right whatever state the skb is in (`kproxy-ebpf/src/skb_csum.rs`
/// updates them in place unless the skb is `CHECKSUM_COMPLETE`). Through veth, packets keep
/// the sender's state and receivers trust a `CHECKSUM_PARTIAL` field without checking it, so
/// the test makes the node finish checksums in software: with TX checksum offload off on its
/// devices, every translated packet leaving the node gets its final checksum computed from
/// what TC left in the field, and the pods and the client verify it (a wrong one is dropped
/// and the probe fails).
/// 1. The client sends `CHECKSUM_PARTIAL` packets (offload on): TC updates only the
///    pseudo-header part.
/// 2. The client finishes its checksums too (offload off): TC updates the whole checksum.
#[test]
fn translated_checksums_hold_in_every_skb_state() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("tc-csum");
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (service("web", Protocol::Tcp), both_pods()),
            (service("web", Protocol::Udp), both_pods()),
        ],
    ));
    rig.assert_checksums_finished_in_software(
        &format!("{NODE_IP}:{NODE_PORT}"),
        NODE_LINK_IP.into(),
        CLIENT_IP.into(),
    );
}
