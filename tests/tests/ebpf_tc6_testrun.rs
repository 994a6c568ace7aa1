//! The IPv6 TC programs (`kp_tc_in6` / `kp_tc_eg6`) on crafted frames through
//! `BPF_PROG_TEST_RUN`: a flow through DNAT, SNAT and both reverse translations, ICMPv6 errors
//! (packet too big, port unreachable) about it translated both ways, the TCP RST and ICMPv6
//! port unreachable for a frontend without endpoints, IPv4 frames passed untouched — each
//! checking the rewritten headers and that every checksum (with the IPv6 pseudo header) is
//! right.

mod ebpf_tc_support;

use std::net::{Ipv4Addr, Ipv6Addr};

use aya::Ebpf;
use aya::maps::HashMap as BpfHashMap;
use ebpf_tc_support::frames6::*;
use ebpf_tc_support::{TCP, UDP, load, node_port_service, tcp_frame};
use kproxy::dataplane::ebpf::node_path::CtKind;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6, PROG_TC6_EGRESS, PROG_TC6_INGRESS};
use kproxy_common::service::{SVC_F_EXTERNAL_IP, SVC_F_NODE_PORT, SVC_F_REJECT};
use kproxy_tests::bpf::testrun::TestRunOutcome;
use kproxy_tests::bpf::testrun::run;
use kproxy_tests::netns::{Bpffs, require_root};

const NEXT: i32 = -1;
const REDIRECT: i32 = 7;

const CLIENT: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x77, 0, 0, 0, 0, 7);
const CPORT: u16 = 40_000;
const NODE: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 10);
const NODE_PORT: u16 = 30_080;
/// The node address SNAT uses (test runs see ifindex 1).
const NODE_INNER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 1);
const BACKEND: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x244, 2, 0, 0, 0, 0, 5);
const ROUTER: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 1);
const BPORT: u16 = 8080;
const SNAT_PORTS: std::ops::RangeInclusive<u16> = 40_100..=40_109;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

/// A NodePort NODE:NODE_PORT/proto (svc 1, `flags`) with `backends` (remote ones), both scope
/// entries like the planner writes them; SNAT source NODE_INNER on ifindex 1.
fn fixture(test: &str, proto: u8, flags: u32, backends: &[(u32, Ipv6Addr)]) -> (Bpffs, Ebpf) {
    let bpffs = Bpffs::new(test).unwrap();
    let (mut ebpf, _tc) = load(
        &bpffs,
        TcConfig {
            snat_ports: SNAT_PORTS,
            ct_entries: 4096,
            ..TcConfig::default()
        },
    );
    let backends: Vec<_> = backends.iter().map(|&(id, addr)| (id, addr, 0)).collect();
    node_port_service(&mut ebpf, (NODE, NODE_PORT, proto), flags, BPORT, &backends);
    TcPath::set_node_addresses6(&mut ebpf, &[(1, NODE_INNER)]).unwrap();
    (bpffs, ebpf)
}

fn run_in(ebpf: &mut Ebpf, frame: &[u8]) -> TestRunOutcome {
    run(ebpf, PROG_TC6_INGRESS, frame, 1).unwrap()
}

fn run_eg(ebpf: &mut Ebpf, frame: &[u8]) -> TestRunOutcome {
    run(ebpf, PROG_TC6_EGRESS, frame, 1).unwrap()
}

fn ct6(ebpf: &Ebpf) -> Vec<(CtKey6, CtEntry6)> {
    let m: BpfHashMap<_, CtKey6, CtEntry6> =
        BpfHashMap::try_from(ebpf.map(MAP_CT6).unwrap()).unwrap();
    m.iter().map(Result::unwrap).collect()
}

/// Client → NodePort, through ingress (DNAT) and egress (SNAT): returns the SNAT port.
fn open_flow(ebpf: &mut Ebpf) -> u16 {
    let syn = tcp6_frame((CLIENT, CPORT), (NODE, NODE_PORT), 1000, 0, SYN, &[]);
    let out = run_in(ebpf, &syn);
    assert_eq!(out.verdict, NEXT);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.src, p.sport), (CLIENT, CPORT));
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT), "DNAT");
    let out = run_eg(ebpf, &out.frame);
    assert_eq!(out.verdict, NEXT);
    let p = parse6_checked(&out.frame);
    assert_eq!(p.src, NODE_INNER, "SNAT to the device's IPv6 node address");
    assert!(SNAT_PORTS.contains(&p.sport), "{}", p.sport);
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    p.sport
}

#[test]
fn ipv6_tcp_flow_through_dnat_snat_and_both_reverse_translations() {
    if !require_root() {
        return;
    }
    let (_fs, mut ebpf) = fixture("tc6tr-flow", TCP, SVC_F_NODE_PORT, &[(7, BACKEND)]);
    let np = open_flow(&mut ebpf);
    let mut kinds: Vec<u8> = ct6(&ebpf).iter().map(|(k, _)| k.kind).collect();
    kinds.sort();
    assert_eq!(
        kinds,
        [CtKind::Service, CtKind::RevDnat, CtKind::SnatIn].map(|k| k as u8)
    );
    // Backend's SYN-ACK: reverse SNAT at ingress, reverse DNAT at egress toward the client.
    let reply = tcp6_frame(
        (BACKEND, BPORT),
        (NODE_INNER, np),
        5000,
        1001,
        SYN | ACK,
        &[],
    );
    let out = run_in(&mut ebpf, &reply);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT), "reverse SNAT");
    let out = run_eg(&mut ebpf, &out.frame);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE, NODE_PORT), "reverse DNAT");
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT));
    // Established: the next client segment goes the same way without a new flow.
    let ack = tcp6_frame(
        (CLIENT, CPORT),
        (NODE, NODE_PORT),
        1001,
        5001,
        ACK,
        b"hello",
    );
    let p = parse6_checked(&run_in(&mut ebpf, &ack).frame);
    assert_eq!((p.dst, p.dport), (BACKEND, BPORT));
    let stats = TcPath::stats(&ebpf).unwrap();
    assert_eq!(
        (
            stats["new_flow"],
            stats["established"],
            stats["snat"],
            stats["reply"]
        ),
        (1, 1, 1, 2),
        "{stats:?}"
    );
}

#[test]
fn ipv6_icmp_errors_about_a_translated_flow_are_translated_both_ways() {
    if !require_root() {
        return;
    }
    let (_fs, mut ebpf) = fixture("tc6tr-icmp", TCP, SVC_F_NODE_PORT, &[(7, BACKEND)]);
    let np = open_flow(&mut ebpf);
    // A router between node and backend: Packet Too Big about the SNATed packet.
    let sent = tcp6_packet((NODE_INNER, np), (BACKEND, BPORT), 1001, 0, ACK, &[0; 64]);
    let ptb = icmp6_error_frame(ROUTER, NODE_INNER, 2, 0, 1280, &sent);
    let out = run_in(&mut ebpf, &ptb);
    assert_eq!(out.verdict, NEXT);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.src, p.dst), (ROUTER, CLIENT), "to the flow's client");
    assert_eq!(quoted6(&p.l4), ((CLIENT, CPORT), (BACKEND, BPORT)));
    assert_eq!(&p.l4[4..8], &1280u32.to_be_bytes(), "MTU kept");
    // …and at egress toward the client the quote names the NodePort.
    let out = run_eg(&mut ebpf, &out.frame);
    let p = parse6_checked(&out.frame);
    assert_eq!(
        (p.src, p.dst),
        (ROUTER, CLIENT),
        "a router's error keeps its source"
    );
    assert_eq!(quoted6(&p.l4), ((CLIENT, CPORT), (NODE, NODE_PORT)));

    // The backend itself answers port unreachable (UDP-style error about the DNATed packet,
    // as seen behind SNAT): it speaks as the frontend once it reaches the client.
    let sent = tcp6_packet((NODE_INNER, np), (BACKEND, BPORT), 1001, 0, ACK, &[]);
    let unreach = icmp6_error_frame(BACKEND, NODE_INNER, 1, 4, 0, &sent);
    let out = run_in(&mut ebpf, &unreach);
    let out = run_eg(&mut ebpf, &out.frame);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.src, p.dst), (NODE, CLIENT));
    assert_eq!(quoted6(&p.l4), ((CLIENT, CPORT), (NODE, NODE_PORT)));
    assert_eq!(TcPath::stats(&ebpf).unwrap()["icmp_error"], 4);

    // An error about no flow of ours passes untouched.
    let other = tcp6_packet((NODE_INNER, 1234), (BACKEND, BPORT), 1, 0, ACK, &[]);
    let frame = icmp6_error_frame(ROUTER, NODE_INNER, 2, 0, 1280, &other);
    assert_eq!(run_in(&mut ebpf, &frame).frame, frame);
}

#[test]
fn ipv6_tcp_without_endpoints_gets_a_reset() {
    if !require_root() {
        return;
    }
    let (_fs, mut ebpf) = fixture("tc6tr-rst", TCP, SVC_F_NODE_PORT | SVC_F_REJECT, &[]);
    let syn = tcp6_frame((CLIENT, CPORT), (NODE, NODE_PORT), 1000, 0, SYN, &[]);
    let out = run_in(&mut ebpf, &syn);
    assert_eq!(
        out.verdict, REDIRECT,
        "sent back out of the device it came in on"
    );
    assert_eq!(out.frame.len(), 14 + 40 + 20);
    let p = parse6_checked(&out.frame);
    assert_eq!((p.src, p.sport), (NODE, NODE_PORT));
    assert_eq!((p.dst, p.dport), (CLIENT, CPORT));
    assert_eq!(p.l4[13], RST | ACK);
    assert_eq!(&p.l4[8..12], &1001u32.to_be_bytes(), "acknowledges the SYN");
    assert!(ct6(&ebpf).is_empty());
}

#[test]
fn ipv6_udp_to_an_external_ip_without_endpoints_gets_port_unreachable() {
    if !require_root() {
        return;
    }
    let (_fs, mut ebpf) = fixture("tc6tr-unreach", UDP, SVC_F_EXTERNAL_IP | SVC_F_REJECT, &[]);
    for payload in [&b"x"[..], &[7u8; 300][..]] {
        let dgram = udp6_frame((CLIENT, CPORT), (NODE, NODE_PORT), payload);
        let out = run_in(&mut ebpf, &dgram);
        assert_eq!(out.verdict, REDIRECT);
        assert_eq!(out.frame.len(), 14 + 40 + 8 + 40 + 8);
        let p = parse6_checked(&out.frame);
        assert_eq!((p.src, p.dst, p.proto), (NODE, CLIENT, ICMPV6));
        assert_eq!(
            &p.l4[..2],
            &[1, 4],
            "destination unreachable / port unreachable"
        );
        assert_eq!(quoted6(&p.l4), ((CLIENT, CPORT), (NODE, NODE_PORT)));
    }
}

#[test]
fn ipv4_frames_pass_the_ipv6_programs_untouched() {
    if !require_root() {
        return;
    }
    let (_fs, mut ebpf) = fixture("tc6tr-v4", TCP, SVC_F_NODE_PORT, &[(7, BACKEND)]);
    let v4 = tcp_frame(
        (Ipv4Addr::new(198, 51, 100, 7), CPORT),
        (Ipv4Addr::new(192, 0, 2, 10), NODE_PORT),
        1,
        0,
        SYN,
        &[],
        &[],
    );
    for out in [run_in(&mut ebpf, &v4), run_eg(&mut ebpf, &v4)] {
        assert_eq!((out.verdict, &out.frame), (NEXT, &v4));
    }
}
