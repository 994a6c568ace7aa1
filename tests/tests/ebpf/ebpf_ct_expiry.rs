//! Expiry of the eBPF connection tables (`KP_CT`, `KP_CT6`) with real traffic (issue #22):
//! the agent's ebpf mode (`EbpfDataplane`, TC programs on the node devices of the shared topology,
//! socket LB off, XDP off) with timeouts of seconds, so the tests take seconds:
//!
//! - closed flows leave the tables after the TIME_WAIT timeout, by the expiry timer alone (no
//!   sync after they closed): NodePort (IPv4 and IPv6) and ClusterIP routed from outside;
//! - a half-closed flow (FIN from the client only) keeps working while the short TIME_WAIT /
//!   CLOSE timeouts pass: it lives for the close-wait timeout;
//! - a long-lived idle flow survives a flood of short flows that, left unexpired, would fill a
//!   deliberately small table (LRU eviction would take the idle flow first).
//!
//! Timeouts are set as the agent sets them from `conntrack.tcpCloseWaitTimeout` and the
//! `bpf.conntrack` extension (`kproxy::app::build::ebpf_config`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::EbpfConfig;
use kproxy::dataplane::ebpf::EbpfDataplane;
use kproxy::dataplane::ebpf::node_path::CtEntry;
use kproxy::dataplane::ebpf::node_path::CtKey;
use kproxy::dataplane::ebpf::node_path::MAP_CT;
use kproxy::dataplane::ebpf::node_path::flows;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, Endpoint, IpFamily, Protocol, ServicePort, Snapshot, testing};
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::service::PROTO_TCP;
use kproxy_tests::netns::{Bpffs, require_root};
use kproxy_tests::topology::{
    NODE_IP, NODE_IP6, NODE_LINK_IP, NODE_LINK_IP6, POD_PORT, Probe, Topology, TopologySpec,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const SERVICE_CIDR: &str = "10.96.0.0/12";
const WEB_NODE_PORT: u16 = 30080;
const IDLE_NODE_PORT: u16 = 30081;
const WEB6_NODE_PORT: u16 = 30082;
const HALF_NODE_PORT: u16 = 30090;
const HALF_POD_PORT: u16 = 9090;
/// Generous bound for anything that should happen within a few expiry periods.
const LIVENESS: Duration = Duration::from_secs(30);

/// Seconds-scale timeouts: closed flows go after 1 s, half-closed ones live 120 s.
fn timeouts() -> flows::Timeouts {
    flows::Timeouts {
        tcp_closing: Duration::from_secs(120),
        tcp_time_wait: Duration::from_secs(1),
        tcp_close: Duration::from_millis(500),
        interval: Duration::from_millis(200),
        ..flows::Timeouts::default()
    }
}

fn service(name: &str, node_port: u16, cluster_ip: Ipv4Addr) -> ServicePort {
    testing::service_port("default", name, "p")
        .protocol(Protocol::Tcp)
        .cluster_ip(cluster_ip)
        .port(80)
        .node_port(node_port)
        .build()
}

fn endpoint(ip: IpAddr, port: u16, local: bool) -> Endpoint {
    testing::endpoint(ip, port)
        .local_on("node", "node2", local)
        .build()
}

/// `web` (NodePort + ClusterIP, both pods), `web6` (the same over IPv6), `idle` (NodePort to the remote pod
/// only, so its flows are SNATed and break if their entries go) and `half` (NodePort to the
/// test's own half-close server on the remote pod).
fn snapshot(topo: &Topology) -> Snapshot {
    let (l0, r0) = (topo.pod("pod-l0"), topo.pod("pod-r0"));
    let web = vec![
        endpoint(l0.ip.into(), POD_PORT, true),
        endpoint(r0.ip.into(), POD_PORT, false),
    ];
    let web6 = testing::service_port("default", "web6", "p")
        .protocol(Protocol::Tcp)
        .cluster_ip("fd00:96::10".parse::<IpAddr>().unwrap())
        .port(80)
        .node_port(WEB6_NODE_PORT)
        .build();
    let web6_eps = vec![
        endpoint(l0.ip6.unwrap().into(), POD_PORT, true),
        endpoint(r0.ip6.unwrap().into(), POD_PORT, false),
    ];
    testing::snapshot("node")
        .node_addresses([
            IpAddr::V4(NODE_IP),
            IpAddr::V4(NODE_LINK_IP),
            IpAddr::V6(NODE_IP6),
            IpAddr::V6(NODE_LINK_IP6),
        ])
        .service(service("web", WEB_NODE_PORT, VIP), web)
        .service(web6, web6_eps)
        .service(
            service("idle", IDLE_NODE_PORT, Ipv4Addr::new(10, 96, 0, 11)),
            vec![endpoint(r0.ip.into(), POD_PORT, false)],
        )
        .service(
            service("half", HALF_NODE_PORT, Ipv4Addr::new(10, 96, 0, 12)),
            vec![endpoint(r0.ip.into(), HALF_POD_PORT, false)],
        )
        .build()
}

struct Setup {
    topo: Topology,
    bpffs: Bpffs,
    mode: EbpfDataplane,
}

fn setup(hint: &str, ct_entries: u32) -> Setup {
    let mut topo = TopologySpec::new(hint)
        .local_pods(1)
        .remote_pods(1)
        .ipv6(true)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    topo.client
        .ip(&["route", "add", SERVICE_CIDR, "via", &NODE_IP.to_string()])
        .unwrap();
    let bpffs = Bpffs::new(&format!("{hint}-fs")).unwrap();
    let cfg = EbpfConfig {
        ebpf: ServiceMapsConfig {
            bpffs: bpffs.path().to_path_buf(),
            families: vec![IpFamily::V4, IpFamily::V6],
            socket_lb: false,
            map_sizes: MapSizes {
                services: 256,
                backend_slots: 256,
                backends: 256,
                affinity: 256,
                source_ranges: 16,
                sock_rev_nat: 256,
                ct: ct_entries,
                ..MapSizes::default()
            },
            ..ServiceMapsConfig::default()
        },
        devices: None,
        tc: true,
        ct_timeouts: timeouts(),
        node_port_cidrs: vec![],
        xdp: kproxy::dataplane::ebpf::node_path::xdp::XdpPolicy::Off,
    };
    let mut mode = topo
        .node
        .run(|| EbpfDataplane::new(cfg, None))
        .unwrap()
        .unwrap();
    let report = mode.sync(&snapshot(&topo), &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0, "{report:?}");
    Setup { topo, bpffs, mode }
}

/// TCP entries in `KP_CT` and `KP_CT6` (every TCP flow of a test goes through these tables).
fn tcp_entries(bpffs: &Bpffs) -> (usize, usize) {
    let pin = |name: &str| {
        Map::from_map_data(MapData::from_pin(bpffs.path().join("kproxy").join(name)).unwrap())
            .unwrap()
    };
    let v4: BpfHashMap<MapData, CtKey, CtEntry> = BpfHashMap::try_from(pin(MAP_CT)).unwrap();
    let v6: BpfHashMap<MapData, CtKey6, CtEntry6> = BpfHashMap::try_from(pin(MAP_CT6)).unwrap();
    (
        v4.keys()
            .filter_map(Result::ok)
            .filter(|k| k.proto == PROTO_TCP)
            .count(),
        v6.keys()
            .filter_map(Result::ok)
            .filter(|k| k.proto == PROTO_TCP)
            .count(),
    )
}

/// Polls `f` until it holds or [`LIVENESS`] passes; returns whether it held.
fn eventually(mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + LIVENESS;
    while Instant::now() < deadline {
        if f() {
            return true;
        }
        thread::sleep(Duration::from_millis(100));
    }
    f()
}

#[test]
fn closed_flows_leave_the_connection_tables_by_the_expiry_timer() {
    if !require_root() {
        return;
    }
    let mut s = setup("ct-closed", 8192);
    const N: u32 = 30;
    // Each probe opens a connection, reads the backend's greeting and closes; the backend
    // closes on EOF: FIN both ways.
    for addr in [
        format!("{NODE_IP}:{WEB_NODE_PORT}"),
        format!("{VIP}:80"),
        format!("[{NODE_IP6}]:{WEB6_NODE_PORT}"),
    ] {
        let r = Probe::tcp(addr.clone(), N)
            .run(&s.topo.client, None)
            .unwrap();
        assert_eq!(r.total_answers(), u64::from(N), "{addr}: {r:?}");
        assert!(r.answers.len() == 2, "{addr}: both backends: {r:?}");
    }
    let (v4, v6) = tcp_entries(&s.bpffs);
    assert!(
        v4 >= 2 * 2 * N as usize && v6 >= 2 * N as usize,
        "the flows were tracked: {v4} IPv4, {v6} IPv6 entries"
    );
    // No sync from here on: only the expiry timer runs. Fully closed flows go after the
    // TIME_WAIT timeout (1 s), long before the close-wait one (120 s).
    let mut last = (v4, v6);
    let gone = eventually(|| {
        last = tcp_entries(&s.bpffs);
        last == (0, 0)
    });
    assert!(
        gone,
        "closed flows still hold {} KP_CT and {} KP_CT6 entries",
        last.0, last.1
    );
    s.mode.cleanup().unwrap();
}

#[test]
fn a_half_closed_flow_keeps_working_for_its_close_wait_timeout() {
    if !require_root() {
        return;
    }
    let mut s = setup("ct-half", 8192);
    // A server on the remote pod that, once the client has half-closed, still sends.
    let listener = s
        .topo
        .pod("pod-r0")
        .ns
        .run(|| TcpListener::bind(("0.0.0.0", HALF_POD_PORT)))
        .unwrap()
        .unwrap();
    let (saw_eof_tx, saw_eof) = mpsc::channel();
    let (send_late, send_late_rx) = mpsc::channel::<()>();
    let server = thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        let mut buf = [0u8; 64];
        while conn.read(&mut buf).unwrap() > 0 {}
        saw_eof_tx.send(()).unwrap();
        send_late_rx.recv().unwrap();
        conn.write_all(b"late\n").unwrap();
    });
    let mut client = s
        .topo
        .client
        .run(|| TcpStream::connect((NODE_IP, HALF_NODE_PORT)))
        .unwrap()
        .unwrap();
    client.write_all(b"hello").unwrap();
    client.shutdown(Shutdown::Write).unwrap();
    saw_eof
        .recv_timeout(LIVENESS)
        .expect("the server saw the client's FIN");
    // Many expiry periods and more than the TIME_WAIT and CLOSE timeouts pass idle.
    let t = timeouts();
    thread::sleep(t.tcp_time_wait + t.tcp_close + 10 * t.interval);
    send_late.send(()).unwrap();
    client.set_read_timeout(Some(LIVENESS)).unwrap();
    let mut line = String::new();
    BufReader::new(&client)
        .read_line(&mut line)
        .expect("the half-closed flow still delivers the backend's data");
    assert_eq!(line, "late\n");
    server.join().unwrap();
    drop(client);
    s.mode.cleanup().unwrap();
}

#[test]
fn an_idle_flow_survives_a_flood_of_short_flows_beyond_the_table_size() {
    if !require_root() {
        return;
    }
    const CT_ENTRIES: u32 = 1024;
    let mut s = setup("ct-flood", CT_ENTRIES);
    // The long-lived flow: SNATed to the remote pod, idle during the flood.
    let idle = s
        .topo
        .client
        .run(|| TcpStream::connect((NODE_IP, IDLE_NODE_PORT)))
        .unwrap()
        .unwrap();
    idle.set_read_timeout(Some(LIVENESS)).unwrap();
    let mut reader = BufReader::new(idle.try_clone().unwrap());
    let mut greeting = String::new();
    reader.read_line(&mut greeting).unwrap();
    assert!(greeting.starts_with("pod-r0 "), "{greeting:?}");
    // Bursts of short flows, each within the table; together several times its size (2–3
    // entries per flow). Between bursts, the closed flows of the last one expire.
    const BURSTS: u32 = 16;
    const PER_BURST: u32 = 60;
    let t = timeouts();
    for i in 0..BURSTS {
        let r = Probe::tcp(format!("{NODE_IP}:{WEB_NODE_PORT}"), PER_BURST)
            .run(&s.topo.client, None)
            .unwrap();
        assert_eq!(r.total_answers(), u64::from(PER_BURST), "burst {i}: {r:?}");
        thread::sleep(t.tcp_time_wait + 3 * t.interval);
    }
    // At least two entries per flow: the flood needed about twice the table.
    const _: () = assert!(BURSTS * PER_BURST * 2 > 2 * CT_ENTRIES - 200);
    // The idle flow still works: its entries were neither expired nor evicted.
    (&idle).write_all(b"ping\n").unwrap();
    let mut echo = String::new();
    reader
        .read_line(&mut echo)
        .expect("the idle flow survived the flood");
    assert_eq!(echo, "ping\n");
    drop((idle, reader));
    s.mode.cleanup().unwrap();
}
