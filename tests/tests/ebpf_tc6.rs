//! The TC service path for IPv6 on this kernel, end to end: the dual-stack version of
//! `ebpf_tc`'s rig (same topology with its IPv6 addresses, both families programmed by the
//! real eBPF dataplane, `kp_tc_in`/`kp_tc_eg` on the node devices), an external IPv6 client
//! talking to IPv6 frontends with `kp-probe`.
//!
//! Services: NodePort 30080 on the node's IPv6 addresses (`fd00:77::1` toward the client,
//! `fd00:78::1` toward node2), externalIP `fd00:203::10`, LB VIP `fd00:203::20`; backends
//! pod-l0 (local, `fd00:244:1::2`) and pod-r0 (on node2, `fd00:244:2::2`), port 8080.

mod ebpf_tc_support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use ebpf_tc_support::rig::{NODE_PORT, Rig, denied_copy, endpoint, lb_vip, service, snapshot};
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::flows;
use kproxy::model::{Endpoint, Protocol, ServicePort, ServiceType};
use kproxy_common::ct::CtKind;
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::service::{BackendValue, MAP_BACKENDS};
use kproxy_tests::netns::require_root;
use kproxy_tests::topology::{CLIENT_IP6, NODE_IP, NODE_IP6, NODE_LINK_IP, NODE_LINK_IP6, Probe};

const EXTERNAL_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x203, 0, 0, 0, 0, 0, 0x10);
const LB_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x203, 0, 0, 0, 0, 0, 0x20);
const POD_L0: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 1, 0, 0, 0, 0, 2);
const POD_R0: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 2);

fn node_ips() -> Vec<IpAddr> {
    vec![
        IpAddr::V4(NODE_IP),
        IpAddr::V4(NODE_LINK_IP),
        IpAddr::V6(NODE_IP6),
        IpAddr::V6(NODE_LINK_IP6),
    ]
}

/// A dual-stack service port (IPv4 and IPv6 cluster IPs).
fn service6(name: &str, protocol: Protocol, n: u16) -> ServicePort {
    let mut s = service(name, protocol);
    s.cluster_ips = vec![
        format!("10.96.0.{}", 10 + n).parse().unwrap(),
        format!("fd00:96::{:x}", 0x10 + n).parse().unwrap(),
    ];
    s.node_port = NODE_PORT + n;
    s
}

fn both_pods() -> Vec<Endpoint> {
    vec![endpoint(POD_L0, true), endpoint(POD_R0, false)]
}

fn at(ip: Ipv6Addr, port: u16) -> String {
    format!("[{ip}]:{port}")
}

fn ct6_entries(ebpf: &Ebpf) -> Vec<(CtKey6, CtEntry6)> {
    let m: BpfHashMap<_, CtKey6, CtEntry6> =
        BpfHashMap::try_from(ebpf.map(MAP_CT6).unwrap()).unwrap();
    m.iter().map(Result::unwrap).collect()
}

#[test]
fn ipv6_nodeport_from_outside_reaches_local_and_remote_backends() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-np");
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (service6("web", Protocol::Tcp, 0), both_pods()),
            (service6("web", Protocol::Udp, 0), both_pods()),
        ],
    ));
    // eTP=Cluster: the remote backend sees the node's IPv6 address on the device toward it
    // (BPF SNAT), the local one the client.
    let flows = rig.assert_both_backends(
        &at(NODE_IP6, NODE_PORT),
        NODE_LINK_IP6.into(),
        CLIENT_IP6.into(),
    );
    // The second node address answers too.
    let r = rig.probe(Probe::tcp(at(NODE_LINK_IP6, NODE_PORT), 10));
    assert_eq!(r.total_answers(), 10, "{r:?}");
    // Every distinct flow was load-balanced as a new flow once. Not one per probe: the client
    // may reuse a source port, and a reused 4-tuple finds its (still live) flow established.
    let flows = flows + r.distinct_peers();
    let ebpf = rig.tc_ebpf.lock().unwrap();
    let stats = TcPath::stats(&ebpf).unwrap();
    assert!(
        stats["new_flow"] == flows && stats["snat"] > 0 && stats["reply"] > 0,
        "{flows} distinct flows: {stats:?}"
    );
    // The flows live in the IPv6 table, SNATed ones with the node's address as source.
    let entries = ct6_entries(&ebpf);
    let link = kproxy::dataplane::ebpf::node_path::tc::encode6(NODE_LINK_IP6);
    assert!(
        entries.iter().any(|(k, e)| k.kind == CtKind::RevDnat as u8
            && e.snat_addr == link
            && e.snat_port != 0),
        "a RevDnat entry holding the allocated node address: {entries:?}"
    );
    assert!(
        ebpf_tc_support::ct_entries(&ebpf).is_empty(),
        "no IPv4 flow"
    );
}

#[test]
fn ipv6_etp_local_keeps_the_client_address_and_drops_without_local_endpoints() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-local");
    let mut local = service6("local", Protocol::Tcp, 0);
    local.external_policy_local = true;
    let mut remote_only = service6("remote", Protocol::Tcp, 1);
    remote_only.external_policy_local = true;
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (local, both_pods()),
            (remote_only, vec![endpoint(POD_R0, false)]),
        ],
    ));
    let r = rig.probe(Probe::tcp(at(NODE_IP6, NODE_PORT), 20));
    assert_eq!(
        r.answers.get("pod-l0"),
        Some(&20),
        "only the local endpoint: {r:?}"
    );
    assert_eq!(
        r.peer_ips("pod-l0"),
        vec![CLIENT_IP6.to_string()],
        "client IP preserved"
    );
    // No local endpoint: dropped (upstream's "has no local endpoints"), nothing answers.
    let r =
        rig.probe(Probe::tcp(at(NODE_IP6, NODE_PORT + 1), 2).timeout(Duration::from_millis(700)));
    assert_eq!(r.total_answers(), 0, "{r:?}");
    assert_eq!(r.errors.get("TimedOut"), Some(&2), "{r:?}");
}

#[test]
fn ipv6_without_endpoints_is_refused_fast() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-noep");
    let mut tcp = service6("tcp", Protocol::Tcp, 0);
    tcp.external_ips = vec![IpAddr::V6(EXTERNAL_IP6)];
    let mut udp = service6("udp", Protocol::Udp, 1);
    udp.external_ips = vec![IpAddr::V6(EXTERNAL_IP6)];
    rig.sync(&snapshot(node_ips(), vec![(tcp, vec![]), (udp, vec![])]));
    // A generous timeout: the RST / ICMPv6 error must come long before it.
    for addr in [at(NODE_IP6, NODE_PORT), at(EXTERNAL_IP6, 80)] {
        let r = rig.probe(Probe::tcp(addr.clone(), 3).timeout(Duration::from_secs(5)));
        assert_eq!(
            r.errors.get("ConnectionRefused"),
            Some(&3),
            "tcp {addr}: {r:?}"
        );
    }
    // UDP: the ExternalIP gets ICMPv6 port unreachable from the TC program, the NodePort from
    // the node's stack; a connected UDP socket reports either as ECONNREFUSED.
    for addr in [at(EXTERNAL_IP6, 80), at(NODE_IP6, NODE_PORT + 1)] {
        let r = rig.probe(Probe::udp(addr.clone(), 3).timeout(Duration::from_secs(5)));
        assert_eq!(
            r.errors.get("ConnectionRefused"),
            Some(&3),
            "udp {addr}: {r:?}"
        );
    }
    assert!(TcPath::stats(&rig.tc_ebpf.lock().unwrap()).unwrap()["no_endpoints"] >= 9);
}

#[test]
fn ipv6_external_ip_and_lb_vip_with_source_ranges() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-vips");
    let mut ext = service6("ext", Protocol::Tcp, 0);
    ext.service_type = ServiceType::ClusterIp;
    ext.node_port = 0;
    ext.external_ips = vec![IpAddr::V6(EXTERNAL_IP6)];
    let mut lb = service6("lb", Protocol::Tcp, 1);
    lb_vip(&mut lb, IpAddr::V6(LB_IP6), "fd00:77::/64");
    let denied = denied_copy(&lb, &["10.96.0.30", "fd00:96::30"], "fd00:99::/64");
    rig.sync(&snapshot(
        node_ips(),
        vec![(ext, both_pods()), (lb, both_pods()), (denied, both_pods())],
    ));
    rig.assert_source_ranges(
        &[at(EXTERNAL_IP6, 80), at(LB_IP6, 80)],
        &at(LB_IP6, 81),
        NODE_LINK_IP6.into(),
    );
}

#[test]
fn ipv6_endpoint_removal_deletes_its_ct6_entries() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-purge");
    let svc = service6("web", Protocol::Udp, 0);
    rig.sync(&snapshot(node_ips(), vec![(svc.clone(), both_pods())]));
    let r = rig.probe(Probe::udp(at(NODE_IP6, NODE_PORT), 30));
    assert_eq!(r.total_answers(), 30, "{r:?}");
    assert_eq!(r.answers.len(), 2, "{r:?}");

    let backends = || -> BTreeSet<u32> {
        let map = aya::maps::MapData::from_pin(rig.bpffs.path().join("kproxy").join(MAP_BACKENDS))
            .unwrap();
        let m: BpfHashMap<_, u32, BackendValue> =
            BpfHashMap::try_from(aya::maps::Map::HashMap(map)).unwrap();
        m.keys().map(Result::unwrap).collect()
    };
    let before = backends();
    // pod-r0 goes away.
    rig.sync(&snapshot(
        node_ips(),
        vec![(svc, vec![endpoint(POD_L0, true)])],
    ));
    let removed: Vec<u32> = before.difference(&backends()).copied().collect();
    assert_eq!(removed.len(), 1, "{before:?}");

    let mut ebpf = rig.tc_ebpf.lock().unwrap();
    let of_removed = |e: &Ebpf| {
        ct6_entries(e)
            .iter()
            .filter(|(_, v)| v.backend_id == removed[0])
            .count()
    };
    let n = of_removed(&ebpf);
    assert!(
        n >= 3,
        "the removed remote backend's SNATed flows had 3 entries each: {n}"
    );
    let survivors = ct6_entries(&ebpf).len() - n;
    assert!(survivors > 0, "the local backend's flows have entries too");
    assert_eq!(flows::purge_backends(&mut ebpf, &removed).unwrap(), n);
    assert_eq!(of_removed(&ebpf), 0);
    assert_eq!(ct6_entries(&ebpf).len(), survivors, "other flows kept");
    // Idle expiry covers the IPv6 table too.
    let zero = flows::Timeouts {
        tcp: Duration::ZERO,
        tcp_closing: Duration::ZERO,
        udp: Duration::ZERO,
    };
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(flows::expire(&mut ebpf, &zero).unwrap(), survivors);
    assert!(ct6_entries(&ebpf).is_empty());
    drop(ebpf);
    // New flows go to the remaining backend only.
    let r = rig.probe(Probe::udp(at(NODE_IP6, NODE_PORT), 10));
    assert_eq!(r.answers.get("pod-l0"), Some(&10), "{r:?}");
}

#[test]
fn ipv6_hairpin_pod_reaches_its_own_service_through_the_nodeport() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-hairpin");
    rig.sync(&snapshot(
        node_ips(),
        vec![(service6("web", Protocol::Tcp, 0), both_pods())],
    ));
    // pod-l0's traffic enters the node through vpod0 (it holds the pod gateway's global IPv6
    // address, so it is a selected device); reaching itself, it is SNATed to that address.
    let r = Probe::tcp(at(NODE_IP6, NODE_PORT), 30)
        .run(&rig.topo.pod("pod-l0").ns, None)
        .unwrap();
    assert_eq!(r.total_errors(), 0, "{r:?}");
    assert_eq!(r.total_answers(), 30, "{r:?}");
    assert_eq!(r.answers.len(), 2, "itself and the remote pod: {r:?}");
}

/// IPv6 twin of `ebpf_tc::translated_checksums_hold_in_every_skb_state`: with TX checksum
/// offload off on the node (then on the client too), every translated packet's checksum is
/// finished in software from what TC left in it and verified by its receiver —
/// `CHECKSUM_PARTIAL` packets first, then ones the client finished itself.
#[test]
fn ipv6_translated_checksums_hold_in_every_skb_state() {
    if !require_root() {
        return;
    }
    let rig = Rig::dual_stack("tc6-csum");
    rig.sync(&snapshot(
        node_ips(),
        vec![
            (service6("web", Protocol::Tcp, 0), both_pods()),
            (service6("web", Protocol::Udp, 0), both_pods()),
        ],
    ));
    rig.assert_checksums_finished_in_software(
        &at(NODE_IP6, NODE_PORT),
        NODE_LINK_IP6.into(),
        CLIENT_IP6.into(),
    );
}
