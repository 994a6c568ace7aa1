//! The TC service path programs (`kp_tc_in` / `kp_tc_eg`) on crafted frames through
//! `BPF_PROG_TEST_RUN`: DNAT of a new flow, SNAT at egress, reverse SNAT and reverse DNAT of
//! replies, ICMP errors about translated flows, TCP RST / ICMP port unreachable for a service
//! without endpoints, source ranges, eTP=Local, CT purge, and the XDP early drop — each
//! checking the rewritten headers and that every checksum (IP, TCP/UDP with pseudo header,
//! ICMP, quoted IP) is right.

mod ebpf_tc_support;

use std::net::Ipv4Addr;

use aya::Ebpf;
use aya::maps::{Array, HashMap as BpfHashMap};
use ebpf_tc_support::*;
use kproxy::dataplane::ebpf::node_path::CtKind;
use kproxy::dataplane::ebpf::node_path::PROG_TC_EGRESS;
use kproxy::dataplane::ebpf::node_path::PROG_TC_INGRESS;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::flows;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPath;
use kproxy_common::ct::{CT_F_SNAT, CT_F_SNAT_HERE, CtEntry, CtKey, MAP_CT, NodeAddr4};
use kproxy_common::frontend_filter::{MAP_FRONTEND_FILTER, filter_slot};
use kproxy_common::service::{
    BE_F_LOCAL, SCOPE_CLUSTER, SCOPE_EXTERNAL, SVC_F_AFFINITY, SVC_F_EXTERNAL_IP, SVC_F_LOCAL_ONLY,
    SVC_F_NODE_PORT, SVC_F_REJECT, SVC_F_SOURCE_RANGES, ServiceValue,
};
use kproxy_tests::bpf::testrun::TestRunOutcome;
use kproxy_tests::bpf::testrun::run;
use kproxy_tests::bpf::testrun::run_xdp;
use kproxy_tests::netns::{Bpffs, require_root};

const NEXT: i32 = -1;
const DROP: i32 = 2;
const REDIRECT: i32 = 7;

const CLIENT: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const CPORT: u16 = 40_000;
const NODE: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const NODE_PORT: u16 = 30_080;
/// The node address SNAT uses (test runs see ifindex 1).
const NODE_INNER: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
const BACKEND: Ipv4Addr = Ipv4Addr::new(10, 1, 0, 5);
const BPORT: u16 = 8080;
const SNAT_PORTS: std::ops::RangeInclusive<u16> = 40_100..=40_109;
const SYN: u8 = 0x02;
const ACK: u8 = 0x10;
const RST: u8 = 0x04;

struct Fixture {
    _bpffs: Bpffs,
    ebpf: Ebpf,
}

/// One NodePort frontend NODE:NODE_PORT/proto (svc 1, `flags`) with the given backends
/// (`(id, addr, flags)`, port BPORT): its external-scope entry and, like the eBPF planner
/// writes for every external frontend, its cluster-scope twin (read by socket LB). No
/// frontend filter is written (all zero: every lookup is made).
fn fixture(test: &str, proto: u8, flags: u32, backends: &[(u32, Ipv4Addr, u8)]) -> Fixture {
    let bpffs = Bpffs::new(test).unwrap();
    let (mut ebpf, _tc) = load(
        &bpffs,
        TcConfig {
            snat_ports: SNAT_PORTS,
            ct_entries: 4096,
            ..TcConfig::default()
        },
    );
    node_port_service(
        &mut ebpf,
        (NODE, NODE_PORT, proto),
        flags | SVC_F_NODE_PORT,
        BPORT,
        backends,
    );
    TcPath::set_node_addresses(&mut ebpf, &[(1, NODE_INNER)]).unwrap();
    Fixture {
        _bpffs: bpffs,
        ebpf,
    }
}

fn run_in(f: &mut Fixture, frame: &[u8]) -> TestRunOutcome {
    run(&mut f.ebpf, PROG_TC_INGRESS, frame, 1).unwrap()
}

fn run_eg(f: &mut Fixture, frame: &[u8]) -> TestRunOutcome {
    run(&mut f.ebpf, PROG_TC_EGRESS, frame, 1).unwrap()
}

fn syn(src: (Ipv4Addr, u16)) -> Vec<u8> {
    tcp_frame(src, (NODE, NODE_PORT), 1000, 0, SYN, &[], &[])
}

fn kinds(f: &Fixture) -> Vec<CtKind> {
    let mut k: Vec<CtKind> = ct_entries(&f.ebpf)
        .iter()
        .map(|(k, _)| CtKind::from_u8(k.kind).unwrap())
        .collect();
    k.sort_by_key(|k| *k as u8);
    k
}

#[test]
fn tcp_flow_through_dnat_snat_and_both_reverse_translations() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-flow", TCP, 0, &[(7, BACKEND, 0)]);

    // Client → NodePort at ingress: DNAT to the backend.
    let out = run_in(&mut f, &syn((CLIENT, CPORT)));
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (CLIENT, CPORT));
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    // Two entries; the reverse one will hold the SNAT source.
    assert_eq!(kinds(&f), vec![CtKind::Service, CtKind::RevDnat]);
    let rev = |f: &Fixture| {
        ct_entries(&f.ebpf)
            .into_iter()
            .find(|(k, _)| k.kind == CtKind::RevDnat as u8)
            .unwrap()
    };
    let (rev_key, rev_entry) = rev(&f);
    assert_eq!(
        (rev_key.saddr, rev_key.daddr),
        (ip4(BACKEND), ip4(CLIENT)),
        "keyed as the backend's reply"
    );
    assert_eq!(
        (rev_entry.snat_addr, rev_entry.snat_port),
        (0, 0),
        "SNAT source not allocated before egress"
    );
    assert_eq!(
        rev_entry.flags & (CT_F_SNAT | CT_F_SNAT_HERE),
        CT_F_SNAT | CT_F_SNAT_HERE
    );
    assert_eq!(rev_entry.backend_id, 7);

    // The DNATed packet leaving toward the remote backend: SNAT to the device's node address.
    let out = run_eg(&mut f, &out.frame);
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    assert_eq!(p.src, NODE_INNER);
    assert!(
        SNAT_PORTS.contains(&p.sport),
        "SNAT port {} outside the range",
        p.sport
    );
    let snat_port = p.sport;
    assert_eq!(
        kinds(&f),
        vec![CtKind::Service, CtKind::RevDnat, CtKind::SnatIn]
    );
    let (_, rev_entry) = rev(&f);
    assert_eq!(
        (rev_entry.snat_addr, rev_entry.snat_port),
        (ip4(NODE_INNER), snat_port.to_be()),
        "the allocated SNAT source is kept in the reverse entry"
    );

    // The backend's SYN-ACK arriving: reverse SNAT (destination back to the client).
    let reply = tcp_frame(
        (BACKEND, BPORT),
        (NODE_INNER, snat_port),
        5000,
        1001,
        SYN | ACK,
        &[],
        &[],
    );
    let out = run_in(&mut f, &reply);
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!(
        (p.src, p.sport),
        (BACKEND, BPORT),
        "source kept until egress (rp_filter)"
    );
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT));

    // …leaving toward the client: reverse DNAT (source becomes the NodePort).
    let out = run_eg(&mut f, &out.frame);
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE, NODE_PORT));
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT));

    // The client's next segment uses the established entry; SNAT reuses the same port.
    let ack_frame = tcp_frame(
        (CLIENT, CPORT),
        (NODE, NODE_PORT),
        1001,
        5001,
        ACK,
        &[],
        b"hello",
    );
    let out = run_in(&mut f, &ack_frame);
    let p = parse_checked(&out.frame);
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    let out = run_eg(&mut f, &out.frame);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE_INNER, snat_port));
    assert_eq!(&p.l4[20..], b"hello");
    let stats = TcPath::stats(&f.ebpf).unwrap();
    assert_eq!(stats["new_flow"], 1);
    assert_eq!(stats["established"], 1);
    assert_eq!(stats["snat"], 2);
    assert_eq!(stats["reply"], 2);
}

/// The frontend filter decides which service-map lookups the ingress program makes: with the
/// NodePort's external bit saying "absent", a new flow to it is not translated (the lookup was
/// skipped), while its established flow still is (the connection table comes first); with the
/// bit clear again, new flows are translated. An unwritten (zero) filter means "maybe
/// everywhere": the fixture writes no filter and every other test here relies on that.
#[test]
fn the_frontend_filter_gates_new_flows_not_established_ones() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-filter", TCP, 0, &[(7, BACKEND, BE_F_LOCAL)]);
    let out = run_in(&mut f, &syn((CLIENT, CPORT)));
    assert_eq!(
        parse_checked(&out.frame).dst,
        BACKEND,
        "zero filter: translated"
    );

    let node = kproxy_common::service::v4_mapped(ip4(NODE));
    let port = NODE_PORT.to_be();
    let (ext_word, ext_mask) = filter_slot(&node, port, TCP, SCOPE_EXTERNAL);
    let (cl_word, cl_mask) = filter_slot(&node, port, TCP, SCOPE_CLUSTER);
    let set = |f: &mut Fixture, word: u32, value: u64| {
        let mut a: Array<_, u64> =
            Array::try_from(f.ebpf.map_mut(MAP_FRONTEND_FILTER).unwrap()).unwrap();
        a.set(word, value, 0).unwrap();
    };
    // Both scopes "absent" (the cluster-scope twin must not stand in for the external entry).
    if ext_word == cl_word {
        set(&mut f, ext_word, ext_mask | cl_mask);
    } else {
        set(&mut f, ext_word, ext_mask);
        set(&mut f, cl_word, cl_mask);
    }
    let fresh = syn((CLIENT, CPORT + 1));
    let out = run_in(&mut f, &fresh);
    assert_eq!(out.verdict, NEXT);
    assert_eq!(
        out.frame, fresh,
        "a frontend the filter hides is not looked up"
    );
    let ack = tcp_frame((CLIENT, CPORT), (NODE, NODE_PORT), 1001, 1, ACK, &[], &[]);
    let out = run_in(&mut f, &ack);
    assert_eq!(
        parse_checked(&out.frame).dst,
        BACKEND,
        "an established flow does not depend on the filter"
    );
    // Only the external bit "absent": the cluster-scope twin (no ClusterIP flag) is found
    // but must not stand in for the external entry.
    if ext_word == cl_word {
        set(&mut f, ext_word, ext_mask);
    } else {
        set(&mut f, ext_word, ext_mask);
        set(&mut f, cl_word, 0);
    }
    let fresh = syn((CLIENT, CPORT + 2));
    assert_eq!(run_in(&mut f, &fresh).frame, fresh, "the twin stood in");
    // The external bit clear again: new flows translated.
    set(&mut f, ext_word, 0);
    if cl_word != ext_word {
        set(&mut f, cl_word, cl_mask);
    }
    let out = run_in(&mut f, &syn((CLIENT, CPORT + 3)));
    assert_eq!(parse_checked(&out.frame).dst, BACKEND);
}

/// A flow an earlier build created keeps its SNAT source in a separate `SnatOut` entry
/// (`kproxy_common::ct` module docs): after an upgrade its packets still leave with it.
#[test]
fn a_flow_of_an_earlier_build_keeps_its_snat_out_entry() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-legacy", TCP, 0, &[(7, BACKEND, 0)]);
    let dnat = run_in(&mut f, &syn((CLIENT, CPORT)));
    // Rewrite the flow's entries into the earlier layout: the reverse entry without the SNAT
    // source, a `SnatOut` entry holding an already allocated one.
    let legacy_port = *SNAT_PORTS.end();
    {
        let mut m: BpfHashMap<_, CtKey, CtEntry> =
            BpfHashMap::try_from(f.ebpf.map_mut(MAP_CT).unwrap()).unwrap();
        let (rev_key, rev) = m
            .iter()
            .map(Result::unwrap)
            .find(|(k, _)| k.kind == CtKind::RevDnat as u8)
            .unwrap();
        let old = CtEntry {
            flags: rev.flags & !CT_F_SNAT_HERE,
            ..rev
        };
        m.insert(rev_key, old, 0).unwrap();
        let out_key = CtKey {
            saddr: ip4(CLIENT),
            daddr: ip4(BACKEND),
            sport: CPORT.to_be(),
            dport: BPORT.to_be(),
            proto: TCP,
            kind: CtKind::SnatOut as u8,
            _pad: [0; 2],
        };
        let out = CtEntry {
            nat_addr: ip4(NODE_INNER),
            nat_port: legacy_port.to_be(),
            ..old
        };
        m.insert(out_key, out, 0).unwrap();
    }
    let out = run_eg(&mut f, &dnat.frame);
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE_INNER, legacy_port));
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    // Nothing allocated, the reverse entry left without a SNAT source.
    assert!(!kinds(&f).contains(&CtKind::SnatIn));
    assert!(ct_entries(&f.ebpf).iter().all(|(_, e)| e.snat_addr == 0));
}

#[test]
fn established_flows_keep_their_backend_and_new_flows_spread() {
    if !require_root() {
        return;
    }
    let b2 = Ipv4Addr::new(10, 1, 0, 6);
    let mut f = fixture(
        "tctr-spread",
        UDP,
        0,
        &[(1, BACKEND, BE_F_LOCAL), (2, b2, BE_F_LOCAL)],
    );
    let first =
        parse_checked(&run_in(&mut f, &udp_frame((CLIENT, CPORT), (NODE, NODE_PORT), b"x")).frame);
    for _ in 0..20 {
        let p = parse_checked(
            &run_in(&mut f, &udp_frame((CLIENT, CPORT), (NODE, NODE_PORT), b"x")).frame,
        );
        assert_eq!(p.dst, first.dst, "an established flow changed backend");
    }
    let mut seen = std::collections::BTreeSet::new();
    for port in 0..32u16 {
        let p = parse_checked(
            &run_in(
                &mut f,
                &udp_frame((CLIENT, 41_000 + port), (NODE, NODE_PORT), b"x"),
            )
            .frame,
        );
        seen.insert(p.dst);
    }
    assert_eq!(
        seen.len(),
        2,
        "32 new flows all went to one of two backends: {seen:?}"
    );
    // Local backends: no SNAT entries, no SNAT source.
    assert!(!kinds(&f).contains(&CtKind::SnatIn));
    assert!(
        ct_entries(&f.ebpf)
            .iter()
            .all(|(_, e)| e.flags & CT_F_SNAT == 0 && e.snat_addr == 0)
    );
}

#[test]
fn icmp_port_unreachable_from_the_backend_reaches_the_client_translated() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-icmp", UDP, 0, &[(3, BACKEND, 0)]);
    let out = run_in(
        &mut f,
        &udp_frame((CLIENT, CPORT), (NODE, NODE_PORT), b"ping"),
    );
    let out = run_eg(&mut f, &out.frame);
    let snatted = parse_checked(&out.frame);
    assert_eq!(snatted.src, NODE_INNER);

    // The backend answers "port unreachable" to the SNAT address, quoting what it received.
    let quoted = &out.frame[14..];
    let icmp = icmp_error_frame(BACKEND, NODE_INNER, 3, 3, quoted);
    let out = run_in(&mut f, &icmp);
    assert_eq!(out.verdict, NEXT);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.dst), (BACKEND, CLIENT));
    let inner = &p.l4[8..];
    assert_eq!(csum(&inner[..20]), 0, "quoted IP header checksum");
    assert_eq!(
        &inner[12..16],
        &CLIENT.octets(),
        "quoted source is the client"
    );
    assert_eq!(u16::from_be_bytes([inner[20], inner[21]]), CPORT);

    let out = run_eg(&mut f, &out.frame);
    let p = parse_checked(&out.frame);
    assert_eq!(
        (p.src, p.dst),
        (NODE, CLIENT),
        "sent by the backend: speaks as the NodePort"
    );
    let inner = &p.l4[8..];
    assert_eq!(csum(&inner[..20]), 0, "quoted IP header checksum");
    assert_eq!(
        &inner[16..20],
        &NODE.octets(),
        "quoted destination is the NodePort"
    );
    assert_eq!(u16::from_be_bytes([inner[22], inner[23]]), NODE_PORT);
    assert_eq!(TcPath::stats(&f.ebpf).unwrap()["icmp_error"], 2);
}

#[test]
fn no_endpoints_answers_a_syn_with_a_reset() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-rst", TCP, SVC_F_REJECT, &[]);
    // MSS, SACK-permitted, timestamps, NOP, window scale: 20 bytes of options.
    let options = [
        2, 4, 0x05, 0xb4, 4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7,
    ];
    let frame = tcp_frame(
        (CLIENT, CPORT),
        (NODE, NODE_PORT),
        0xdead_beef,
        0,
        SYN,
        &options,
        &[],
    );
    let out = run_in(&mut f, &frame);
    assert_eq!(
        out.verdict, REDIRECT,
        "sent back out of the device it came in on"
    );
    assert_eq!(out.frame.len(), 14 + 20 + 20);
    assert_eq!(&out.frame[0..6], &MAC_A, "destination MAC is the sender's");
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE, NODE_PORT));
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT));
    assert_eq!(p.l4[13], RST | ACK);
    assert_eq!(u32::from_be_bytes(p.l4[4..8].try_into().unwrap()), 0);
    assert_eq!(
        u32::from_be_bytes(p.l4[8..12].try_into().unwrap()),
        0xdead_bef0,
        "acknowledges the SYN"
    );
    assert!(ct_entries(&f.ebpf).is_empty());

    // Without the reject flag (eTP=Local with endpoints elsewhere): dropped, like upstream.
    let mut f = fixture("tctr-drop", TCP, 0, &[]);
    assert_eq!(run_in(&mut f, &syn((CLIENT, CPORT))).verdict, DROP);
}

#[test]
fn source_ranges_allow_and_deny() {
    if !require_root() {
        return;
    }
    let mut f = fixture(
        "tctr-ranges",
        TCP,
        SVC_F_SOURCE_RANGES,
        &[(1, BACKEND, BE_F_LOCAL)],
    );
    allow_range(&mut f.ebpf, 1, Ipv4Addr::new(203, 0, 113, 0), 24);
    let allowed = run_in(&mut f, &syn((Ipv4Addr::new(203, 0, 113, 9), CPORT)));
    assert_eq!(allowed.verdict, NEXT);
    assert_eq!(parse_checked(&allowed.frame).dst, BACKEND);
    let denied = run_in(&mut f, &syn((CLIENT, CPORT)));
    assert_eq!(denied.verdict, DROP);
    assert_eq!(TcPath::stats(&f.ebpf).unwrap()["source_range_drop"], 1);
}

#[test]
fn etp_local_keeps_the_client_address() {
    if !require_root() {
        return;
    }
    // A local-only set whose (remote-looking) backend is not marked local: no SNAT anyway.
    let mut f = fixture("tctr-local", TCP, SVC_F_LOCAL_ONLY, &[(1, BACKEND, 0)]);
    let out = run_in(&mut f, &syn((CLIENT, CPORT)));
    let out = run_eg(&mut f, &out.frame);
    let p = parse_checked(&out.frame);
    assert_eq!((p.src, p.sport), (CLIENT, CPORT));
    assert_eq!(kinds(&f), vec![CtKind::Service, CtKind::RevDnat]);
}

#[test]
fn snat_port_collisions_are_avoided_and_exhaustion_drops() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-ports", UDP, 0, &[(1, BACKEND, 0)]);
    let mut ports = std::collections::BTreeSet::new();
    // Ten clients, ten ports in the range: each gets its own.
    for i in 0..10u16 {
        let out = run_in(
            &mut f,
            &udp_frame((CLIENT, 50_000 + i), (NODE, NODE_PORT), b"x"),
        );
        let out = run_eg(&mut f, &out.frame);
        if out.verdict == NEXT {
            ports.insert(parse_checked(&out.frame).sport);
        }
    }
    // Random probing with 16 tries can miss a last free port; most must have been found.
    assert!(
        ports.len() >= 8,
        "only {} distinct SNAT ports: {ports:?}",
        ports.len()
    );
    assert!(ports.iter().all(|p| SNAT_PORTS.contains(p)));
    // The range is now (nearly) full: an eleventh flow finds no port and is dropped.
    let mut dropped = 0;
    for i in 0..3u16 {
        let out = run_in(
            &mut f,
            &udp_frame((CLIENT, 51_000 + i), (NODE, NODE_PORT), b"x"),
        );
        if run_eg(&mut f, &out.frame).verdict == DROP {
            dropped += 1;
        }
    }
    assert!(
        dropped >= 1,
        "no flow was dropped with the SNAT range exhausted"
    );
    assert!(TcPath::stats(&f.ebpf).unwrap()["snat_failed"] >= 1);
}

#[test]
fn purging_a_backend_deletes_its_flows_only() {
    if !require_root() {
        return;
    }
    let b2 = Ipv4Addr::new(10, 1, 0, 6);
    let mut f = fixture("tctr-purge", TCP, 0, &[(1, BACKEND, 0), (2, b2, 0)]);
    for i in 0..16u16 {
        let out = run_in(&mut f, &syn((CLIENT, 42_000 + i)));
        let _ = run_eg(&mut f, &out.frame);
    }
    let before = ct_entries(&f.ebpf);
    let of = |id: u32,
              e: &[(
        kproxy::dataplane::ebpf::node_path::CtKey,
        kproxy::dataplane::ebpf::node_path::CtEntry,
    )]| { e.iter().filter(|(_, v)| v.backend_id == id).count() };
    let (n1, n2) = (of(1, &before), of(2, &before));
    assert!(n1 > 0 && n2 > 0, "both backends got flows: {n1}/{n2}");
    let deleted = flows::purge_backends(&mut f.ebpf, &[1]).unwrap();
    assert_eq!(deleted, n1);
    let after = ct_entries(&f.ebpf);
    assert_eq!(of(1, &after), 0);
    assert_eq!(of(2, &after), n2);
}

#[test]
fn node_address_map_is_replaced_by_set_node_addresses() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-naddr", TCP, 0, &[]);
    TcPath::set_node_addresses(&mut f.ebpf, &[(5, NODE), (6, NODE_INNER)]).unwrap();
    TcPath::set_node_addresses(&mut f.ebpf, &[(6, NODE)]).unwrap();
    let m: BpfHashMap<_, u32, NodeAddr4> =
        BpfHashMap::try_from(f.ebpf.map(kproxy_common::ct::MAP_NODE_ADDR4).unwrap()).unwrap();
    let all: Vec<(u32, NodeAddr4)> = m.iter().map(Result::unwrap).collect();
    assert_eq!(all, vec![(6, NodeAddr4 { addr: ip4(NODE) })]);
}

#[test]
fn session_affinity_pins_a_client_to_one_backend() {
    if !require_root() {
        return;
    }
    let b2 = Ipv4Addr::new(10, 1, 0, 6);
    let mut f = fixture(
        "tctr-aff",
        TCP,
        0,
        &[(1, BACKEND, BE_F_LOCAL), (2, b2, BE_F_LOCAL)],
    );
    frontend(
        &mut f.ebpf,
        NODE,
        NODE_PORT,
        TCP,
        SCOPE_EXTERNAL,
        ServiceValue {
            svc_id: 1,
            count: 2,
            flags: SVC_F_NODE_PORT | SVC_F_AFFINITY,
            affinity_timeout: 3600,
        },
    );
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..24u16 {
        let out = run_in(&mut f, &syn((CLIENT, 43_000 + i)));
        seen.insert(parse_checked(&out.frame).dst);
    }
    assert_eq!(seen.len(), 1, "24 connections of one client: {seen:?}");
}

#[test]
fn expiry_removes_idle_flows_whole() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-expire", UDP, 0, &[(1, BACKEND, 0)]);
    let out = run_in(&mut f, &udp_frame((CLIENT, CPORT), (NODE, NODE_PORT), b"x"));
    let _ = run_eg(&mut f, &out.frame);
    // Service, RevDnat (with the SNAT source), SnatIn.
    assert_eq!(ct_entries(&f.ebpf).len(), 3);
    // Generous timeouts: nothing is idle yet.
    assert_eq!(
        flows::expire(&mut f.ebpf, &flows::Timeouts::default()).unwrap(),
        0
    );
    assert_eq!(ct_entries(&f.ebpf).len(), 3);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let zero = flows::Timeouts {
        tcp: std::time::Duration::ZERO,
        tcp_closing: std::time::Duration::ZERO,
        udp: std::time::Duration::ZERO,
    };
    assert_eq!(flows::expire(&mut f.ebpf, &zero).unwrap(), 3);
    assert!(ct_entries(&f.ebpf).is_empty());
}

#[test]
fn udp_to_an_external_ip_without_endpoints_gets_port_unreachable() {
    if !require_root() {
        return;
    }
    let mut f = fixture("tctr-unreach", UDP, SVC_F_REJECT, &[]);
    let ext = Ipv4Addr::new(203, 0, 113, 5);
    let value = ServiceValue {
        svc_id: 2,
        count: 0,
        flags: SVC_F_EXTERNAL_IP | SVC_F_REJECT,
        affinity_timeout: 0,
    };
    frontend(&mut f.ebpf, ext, 80, UDP, SCOPE_EXTERNAL, value);
    frontend(&mut f.ebpf, ext, 80, UDP, SCOPE_CLUSTER, value);
    // A short datagram (the frame grows into the reply) and a long one (it shrinks).
    for payload in [&b"hi"[..], &[7u8; 300][..]] {
        let frame = udp_frame((CLIENT, CPORT), (ext, 80), payload);
        let out = run_in(&mut f, &frame);
        assert_eq!(
            out.verdict, REDIRECT,
            "sent back out of the device it came in on"
        );
        assert_eq!(out.frame.len(), 14 + 20 + 8 + 20 + 8);
        assert_eq!(&out.frame[0..6], &MAC_A, "destination MAC is the sender's");
        assert_eq!(&out.frame[6..12], &MAC_B);
        // Verifies the IPv4 and ICMP checksums.
        let p = parse_checked(&out.frame);
        assert_eq!((p.src, p.dst, p.proto), (ext, CLIENT, ICMP));
        assert_eq!(
            &p.l4[..2],
            &[3, 3],
            "destination unreachable, port unreachable"
        );
        assert_eq!(&p.l4[4..8], &[0; 4], "unused word");
        assert_eq!(
            &p.l4[8..36],
            &frame[14..42],
            "quotes the datagram's IPv4 and UDP headers as they arrived"
        );
    }
    assert!(ct_entries(&f.ebpf).is_empty());

    // A UDP NodePort without endpoints is left to the node's stack (nothing listens there, so
    // it answers port unreachable itself).
    let frame = udp_frame((CLIENT, CPORT), (NODE, NODE_PORT), b"x");
    let out = run_in(&mut f, &frame);
    assert_eq!((out.verdict, &out.frame), (NEXT, &frame));
}

const XDP_DROP: i32 = 1;
const XDP_PASS: i32 = 2;

fn run_xdp_once(f: &mut Fixture, frame: &[u8]) -> i32 {
    let out = run_xdp(&mut f.ebpf, frame, 1).unwrap();
    assert_eq!(out.frame, frame, "XDP never rewrites");
    out.verdict
}

#[test]
fn xdp_drops_only_new_flows_tc_would_drop() {
    if !require_root() {
        return;
    }
    // A frontend with an established flow from CLIENT, then restricted to 203.0.113.0/24.
    let mut f = fixture("tctr-xdp", TCP, 0, &[(1, BACKEND, BE_F_LOCAL)]);
    XdpPath::load(&mut f.ebpf).unwrap();
    assert_eq!(run_in(&mut f, &syn((CLIENT, CPORT))).verdict, NEXT);
    let restricted = ServiceValue {
        svc_id: 1,
        count: 1,
        flags: SVC_F_NODE_PORT | SVC_F_SOURCE_RANGES,
        affinity_timeout: 0,
    };
    for scope in [SCOPE_EXTERNAL, SCOPE_CLUSTER] {
        frontend(&mut f.ebpf, NODE, NODE_PORT, TCP, scope, restricted);
    }
    allow_range(&mut f.ebpf, 1, Ipv4Addr::new(203, 0, 113, 0), 24);

    let ack = tcp_frame((CLIENT, CPORT), (NODE, NODE_PORT), 1001, 1, ACK, &[], &[]);
    assert_eq!(run_xdp_once(&mut f, &ack), XDP_PASS, "established flow");
    let denied = syn((CLIENT, CPORT + 1));
    assert_eq!(run_xdp_once(&mut f, &denied), XDP_DROP, "new flow, denied");
    assert_eq!(run_in(&mut f, &denied).verdict, DROP, "TC agrees");
    let allowed = syn((Ipv4Addr::new(203, 0, 113, 9), CPORT));
    assert_eq!(
        run_xdp_once(&mut f, &allowed),
        XDP_PASS,
        "new flow, allowed"
    );
    let miss = tcp_frame((CLIENT, CPORT), (NODE, 22), 1000, 0, SYN, &[], &[]);
    assert_eq!(run_xdp_once(&mut f, &miss), XDP_PASS, "not a frontend");
    let stats = XdpPath::stats(&f.ebpf).unwrap();
    assert_eq!(
        (stats["source_range_drop"], stats["no_endpoints_drop"]),
        (1, 0)
    );

    // No endpoints: dropped early unless the frontend rejects (TC answers with a RST).
    let mut f = fixture("tctr-xdp-noep", TCP, 0, &[]);
    XdpPath::load(&mut f.ebpf).unwrap();
    assert_eq!(run_xdp_once(&mut f, &syn((CLIENT, CPORT))), XDP_DROP);
    assert_eq!(XdpPath::stats(&f.ebpf).unwrap()["no_endpoints_drop"], 1);
    let mut f = fixture("tctr-xdp-rej", TCP, SVC_F_REJECT, &[]);
    XdpPath::load(&mut f.ebpf).unwrap();
    assert_eq!(run_xdp_once(&mut f, &syn((CLIENT, CPORT))), XDP_PASS);
    assert_eq!(run_in(&mut f, &syn((CLIENT, CPORT))).verdict, REDIRECT);
}
