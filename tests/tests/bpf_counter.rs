//! The embedded BPF object on this kernel: load the per-CPU packet counter, attach it to a veth
//! in a test namespace, send real UDP packets from a peer namespace, and check that it counted
//! them (and nothing before), that it passed every packet on, and that each hook counts into
//! its own slot.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;

use kproxy_common::counter::CounterSlot;
use kproxy_common::counter::PacketCount;
use kproxy_tests::bpf::PacketCounter;
use kproxy_tests::netns::{Bpffs, Netns, Veth, VethEnd, require_root};

const PACKETS: u64 = 25;
const PAYLOAD: [u8; 64] = [0xab; 64];
/// Ethernet + IPv4 + UDP headers + payload: the smallest frame length of one datagram.
const FRAME_BYTES: u64 = 14 + 20 + 8 + PAYLOAD.len() as u64;
const NODE_IP: &str = "10.201.0.1";
const CLIENT_IP: &str = "10.201.0.2";
const PORT: u16 = 7777;
const LIVENESS: Duration = Duration::from_secs(5);

/// `client` ──veth── `node` (eth0 on both sides), IPv6 off so the link is silent.
struct Topology {
    _veth: Veth,
    node: Netns,
    client: Netns,
}

fn topology(test: &str) -> Topology {
    let node = Netns::new(&format!("{test}-node")).unwrap();
    let client = Netns::new(&format!("{test}-cl")).unwrap();
    node.disable_ipv6().unwrap();
    client.disable_ipv6().unwrap();
    let veth = Veth::create(
        VethEnd::new(&node, "eth0").addr(&format!("{NODE_IP}/24")),
        VethEnd::new(&client, "eth0").addr(&format!("{CLIENT_IP}/24")),
    )
    .unwrap();
    Topology {
        _veth: veth,
        node,
        client,
    }
}

fn udp_socket(ns: &Netns, ip: &str) -> UdpSocket {
    let addr: SocketAddr = format!("{ip}:{PORT}").parse().unwrap();
    let socket = ns.run(|| UdpSocket::bind(addr)).unwrap().unwrap();
    socket.set_read_timeout(Some(LIVENESS)).unwrap();
    socket
}

fn send(from: &UdpSocket, to: &str) {
    let to: SocketAddr = format!("{to}:{PORT}").parse().unwrap();
    for _ in 0..PACKETS {
        from.send_to(&PAYLOAD, to).unwrap();
    }
}

/// Receives the `PACKETS` datagrams (each with `PAYLOAD`); returns how many arrived.
fn receive_all(socket: &UdpSocket) -> u64 {
    let mut buf = [0u8; 256];
    let mut received = 0;
    while received < PACKETS {
        match socket.recv(&mut buf) {
            Ok(n) => {
                assert_eq!(&buf[..n], &PAYLOAD[..]);
                received += 1;
            }
            Err(err) => panic!("after {received} of {PACKETS} datagrams: {err}"),
        }
    }
    received
}

fn assert_counted_at_least(count: PacketCount, packets: u64, what: &str) {
    assert!(
        count.packets >= packets,
        "{what}: counted {count:?}, sent {packets} packets"
    );
    assert!(
        count.bytes >= packets * FRAME_BYTES,
        "{what}: counted {count:?}, sent {packets} frames of at least {FRAME_BYTES} bytes"
    );
}

#[test]
fn xdp_counter_counts_every_packet_arriving_on_a_veth() {
    if !require_root() {
        return;
    }
    let topo = topology("bpfcnt-xdp");
    // The object's other maps are pinned: keep them on a private bpffs.
    let bpffs = Bpffs::new(&format!("{}-fs", topo.node.name())).unwrap();
    let mut counter = PacketCounter::load_with_pins(bpffs.path()).unwrap();
    topo.node
        .run(|| counter.attach("eth0", CounterSlot::Xdp))
        .unwrap()
        .unwrap();
    assert_eq!(
        counter.total().unwrap(),
        PacketCount::default(),
        "nothing was sent yet"
    );

    let server = udp_socket(&topo.node, NODE_IP);
    let client = udp_socket(&topo.client, CLIENT_IP);
    send(&client, NODE_IP);
    assert_eq!(
        receive_all(&server),
        PACKETS,
        "XDP_PASS lets every packet through"
    );

    assert_counted_at_least(counter.count(CounterSlot::Xdp).unwrap(), PACKETS, "XDP");
    assert_eq!(
        counter.count(CounterSlot::TcIngress).unwrap(),
        PacketCount::default()
    );
    assert_eq!(
        counter.count(CounterSlot::TcEgress).unwrap(),
        PacketCount::default()
    );
}

#[test]
fn tc_counters_count_ingress_and_egress_separately() {
    if !require_root() {
        return;
    }
    let topo = topology("bpfcnt-tc");
    // The object's other maps are pinned: keep them on a private bpffs.
    let bpffs = Bpffs::new(&format!("{}-fs", topo.node.name())).unwrap();
    let mut counter = PacketCounter::load_with_pins(bpffs.path()).unwrap();
    topo.node
        .run(|| {
            counter.attach("eth0", CounterSlot::TcIngress)?;
            counter.attach("eth0", CounterSlot::TcEgress)
        })
        .unwrap()
        .unwrap();
    assert_eq!(
        counter.total().unwrap(),
        PacketCount::default(),
        "nothing was sent yet"
    );

    let server = udp_socket(&topo.node, NODE_IP);
    let client = udp_socket(&topo.client, CLIENT_IP);
    send(&client, NODE_IP);
    assert_eq!(receive_all(&server), PACKETS);
    let ingress_after_requests = counter.count(CounterSlot::TcIngress).unwrap();
    assert_counted_at_least(ingress_after_requests, PACKETS, "TC ingress");

    // The node answers every datagram: those leave through eth0's egress hook.
    send(&server, CLIENT_IP);
    assert_eq!(
        receive_all(&client),
        PACKETS,
        "TC_ACT_UNSPEC lets every packet through"
    );
    assert_counted_at_least(
        counter.count(CounterSlot::TcEgress).unwrap(),
        PACKETS,
        "TC egress",
    );
    assert_eq!(
        counter.count(CounterSlot::Xdp).unwrap(),
        PacketCount::default()
    );
    let total = counter.total().unwrap();
    assert_counted_at_least(total, 2 * PACKETS, "total");
}
