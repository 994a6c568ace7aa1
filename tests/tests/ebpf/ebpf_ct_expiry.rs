//! Expiry of the eBPF connection tables (`KP_CT`, `KP_CT6`) with real traffic (issue #22):
//! the agent's ebpf mode (`EbpfDataplane`, TC programs on the node devices of the shared topology,
//! socket LB off, XDP off unless a test says so) with timeouts of seconds, so the tests take
//! seconds:
//!
//! - closed flows leave the tables after the TIME_WAIT timeout, by the expiry timer alone (no
//!   sync after they closed): NodePort (IPv4 and IPv6) and ClusterIP routed from outside;
//! - a half-closed flow (FIN from the client only) keeps working while the short TIME_WAIT /
//!   CLOSE timeouts pass: it lives for the close-wait timeout;
//! - a long-lived idle flow survives a flood of short flows that, left unexpired, would fill a
//!   deliberately small table (LRU eviction would take the idle flow first);
//! - a client port reused toward another frontend of the same backend (the pattern behind the
//!   soak's leftover entries and connect timeouts, issue #22): both flows close and leave, and
//!   a later connection from that port to the first frontend connects (IPv4 and IPv6, local
//!   and SNATed remote backend; TC and XDP);
//! - endpoint changes while a client connects over and over from a few ports: every
//!   connection succeeds, and every one started after a change reaches a current endpoint
//!   (IPv4 and IPv6; TC and XDP).
//!
//! Timeouts are set as the agent sets them from `conntrack.tcpCloseWaitTimeout` and the
//! `bpf.conntrack` extension (`kproxy::dataplane::ebpf::face::config`).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
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
use kproxy::dataplane::ebpf::node_path::xdp::XdpPolicy;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, Endpoint, IpFamily, Protocol, ServicePort, Snapshot, testing};
use kproxy_common::ct::{MAP_XDP_STATS, XdpStat};
use kproxy_common::ct6::{CtEntry6, CtKey6, MAP_CT6};
use kproxy_common::service::PROTO_TCP;
use kproxy_tests::netns::{Bpffs, require_root};
use kproxy_tests::topology::{
    NODE_CLIENT_IF, NODE_IP, NODE_IP6, NODE_LINK_IP, NODE_LINK_IP6, POD_PORT, Probe, Topology,
    TopologySpec,
};

const VIP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 10);
const SERVICE_CIDR: &str = "10.96.0.0/12";
const WEB_NODE_PORT: u16 = 30080;
const IDLE_NODE_PORT: u16 = 30081;
const WEB6_NODE_PORT: u16 = 30082;
const HALF_NODE_PORT: u16 = 30090;
const HALF_POD_PORT: u16 = 9090;
const FLIP_NODE_PORT: u16 = 30089;
const FLIP6_NODE_PORT: u16 = 30079;
/// Twin NodePorts (two services with the same single backend): `(first, second, backend)`
/// per case of [`a_client_port_reused_toward_another_frontend_of_the_same_backend`].
const TWINS: [(u16, u16, Twin); 3] = [
    (30083, 30084, Twin::Local),
    (30085, 30086, Twin::Local6),
    (30087, 30088, Twin::Remote),
];
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

/// The backend of a pair of [`TWINS`].
#[derive(Clone, Copy, Debug)]
enum Twin {
    /// pod-l0 over IPv4 (not SNATed).
    Local,
    /// pod-l0 over IPv6.
    Local6,
    /// pod-r0 over IPv4 (SNATed).
    Remote,
}

/// The services of [`TWINS`]: each pair's two NodePorts lead to the same single backend.
fn twins(topo: &Topology) -> Vec<(ServicePort, Vec<Endpoint>)> {
    let (l0, r0) = (topo.pod("pod-l0"), topo.pod("pod-r0"));
    let mut out = vec![];
    for (i, (a, b, twin)) in TWINS.into_iter().enumerate() {
        let (ip, cluster, local): (IpAddr, IpAddr, bool) = match twin {
            Twin::Local => (l0.ip.into(), Ipv4Addr::new(10, 96, 1, 0).into(), true),
            Twin::Local6 => (
                l0.ip6.unwrap().into(),
                "fd00:96::1:0".parse().unwrap(),
                true,
            ),
            Twin::Remote => (r0.ip.into(), Ipv4Addr::new(10, 96, 1, 0).into(), false),
        };
        for (j, node_port) in [a, b].into_iter().enumerate() {
            let cluster_ip = match cluster {
                IpAddr::V4(c) => IpAddr::V4((u32::from(c) + (2 * i + j) as u32).into()),
                IpAddr::V6(c) => IpAddr::V6((u128::from(c) + (2 * i + j) as u128).into()),
            };
            let svc = testing::service_port("default", &format!("twin-{node_port}"), "p")
                .protocol(Protocol::Tcp)
                .cluster_ip(cluster_ip)
                .port(80)
                .node_port(node_port)
                .build();
            out.push((svc, vec![endpoint(ip, POD_PORT, local)]));
        }
    }
    out
}

/// `web` (NodePort + ClusterIP, both pods), `web6` (the same over IPv6), `idle` (NodePort to the remote pod
/// only, so its flows are SNATed and break if their entries go), `half` (NodePort to the
/// test's own half-close server on the remote pod), the [`TWINS`] and `flip` (NodePort to
/// pod-l0; `flip6` the same over IPv6; see [`snapshot_with`]).
fn snapshot(topo: &Topology) -> Snapshot {
    snapshot_with(topo, &["pod-l0"])
}

/// [`snapshot`] with `flip`'s and `flip6`'s endpoints on the pods named (every pod stays an endpoint of
/// `web`, so it keeps its backend id and its flows are not purged).
fn snapshot_with(topo: &Topology, flip: &[&str]) -> Snapshot {
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
    let flip_eps = flip
        .iter()
        .map(|name| {
            endpoint(
                topo.pod(name).ip.into(),
                POD_PORT,
                name.starts_with("pod-l"),
            )
        })
        .collect();
    let flip6_eps = flip
        .iter()
        .map(|name| {
            let ip = topo.pod(name).ip6.unwrap();
            endpoint(ip.into(), POD_PORT, name.starts_with("pod-l"))
        })
        .collect();
    let flip6 = testing::service_port("default", "flip6", "p")
        .protocol(Protocol::Tcp)
        .cluster_ip("fd00:96::13".parse::<IpAddr>().unwrap())
        .port(80)
        .node_port(FLIP6_NODE_PORT)
        .build();
    let mut snap = testing::snapshot("node")
        .service(
            service("flip", FLIP_NODE_PORT, Ipv4Addr::new(10, 96, 0, 13)),
            flip_eps,
        )
        .service(flip6, flip6_eps);
    for (svc, eps) in twins(topo) {
        snap = snap.service(svc, eps);
    }
    snap.node_addresses([
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
    setup_with(hint, ct_entries, timeouts(), false)
}

/// With `xdp`, `kp_xdp` is attached natively to the node's devices and its fast path enabled
/// on the client's link only: new flows from the client are recorded by XDP (and, with a
/// remote backend, passed to TC at the FIB step, the node2 link being no fast-path device).
fn setup_with(hint: &str, ct_entries: u32, ct_timeouts: flows::Timeouts, xdp: bool) -> Setup {
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
        ct_timeouts,
        node_port_cidrs: vec![],
        xdp: if xdp {
            XdpPolicy::Native
        } else {
            XdpPolicy::Off
        },
    };
    let mut mode = topo
        .node
        .run(|| EbpfDataplane::new(cfg, None))
        .unwrap()
        .unwrap();
    if xdp {
        assert!(!mode.xdp_devices().is_empty(), "XDP attached");
        // Device names resolve in the calling thread's namespace.
        mode = topo
            .node
            .run(move || mode.set_xdp_fast_path(NODE_CLIENT_IF, true).map(|()| mode))
            .unwrap()
            .unwrap();
    }
    let report = mode.sync(&snapshot(&topo), &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0, "{report:?}");
    Setup { topo, bpffs, mode }
}

/// Waits (the suite's liveness bound) until neither connection table holds a TCP entry: the
/// expiry timer alone must remove every closed flow.
fn assert_tcp_entries_expire(bpffs: &Bpffs) {
    let mut last = (usize::MAX, usize::MAX);
    let gone = eventually(|| {
        last = tcp_entries(bpffs);
        last == (0, 0)
    });
    assert!(
        gone,
        "closed flows still hold {} KP_CT and {} KP_CT6 entries",
        last.0, last.1
    );
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

/// A TCP connection from the client namespace, from local port `port` (with `SO_REUSEADDR`:
/// the port may have TIME_WAIT connections to other destinations; one to `to` itself makes
/// `connect` fail with `EADDRNOTAVAIL` until `tcp_tw_reuse` lets it go, which is retried) to
/// `to`, connected within [`LIVENESS`].
fn connect_from(topo: &Topology, port: u16, to: SocketAddr) -> std::io::Result<TcpStream> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrStorage, bind, connect, setsockopt, socket,
        sockopt,
    };
    use nix::sys::time::TimeVal;
    use std::os::fd::AsRawFd;
    let deadline = Instant::now() + LIVENESS;
    topo.client
        .run(|| {
            loop {
                let (family, local) = match to {
                    SocketAddr::V4(_) => (
                        AddressFamily::Inet,
                        SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
                    ),
                    SocketAddr::V6(_) => (
                        AddressFamily::Inet6,
                        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, port)),
                    ),
                };
                let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)?;
                setsockopt(&fd, sockopt::ReuseAddr, &true)?;
                let bound = deadline.saturating_duration_since(Instant::now()).as_secs();
                setsockopt(
                    &fd,
                    sockopt::SendTimeout,
                    &TimeVal::new(bound.max(1) as i64, 0),
                )?;
                bind(fd.as_raw_fd(), &SockaddrStorage::from(local))?;
                match connect(fd.as_raw_fd(), &SockaddrStorage::from(to)) {
                    Ok(()) => return Ok(TcpStream::from(fd)),
                    Err(nix::errno::Errno::EADDRNOTAVAIL) if Instant::now() < deadline => {
                        thread::sleep(Duration::from_millis(100));
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        })
        .map_err(std::io::Error::other)?
}

/// Reads the backend's greeting, then closes the way `kp-probe tcp` does (the client's FIN,
/// then the backend's on EOF), waiting for the backend's FIN. Returns the greeting.
fn greet_and_close(conn: TcpStream) -> std::io::Result<String> {
    conn.set_read_timeout(Some(LIVENESS))?;
    let mut reader = BufReader::new(&conn);
    let mut greeting = String::new();
    reader.read_line(&mut greeting)?;
    conn.shutdown(Shutdown::Write)?;
    let mut rest = vec![];
    reader.read_to_end(&mut rest)?;
    Ok(greeting)
}

/// `kp_xdp`'s counters (`KP_XDP_STATS`, summed over CPUs), by [`XdpStat`] index.
fn xdp_stats(bpffs: &Bpffs) -> Vec<u64> {
    use aya::maps::PerCpuArray;
    let pin = bpffs.path().join("kproxy").join(MAP_XDP_STATS);
    let map = Map::from_map_data(MapData::from_pin(pin).unwrap()).unwrap();
    let stats: PerCpuArray<MapData, u64> = PerCpuArray::try_from(map).unwrap();
    XdpStat::ALL
        .iter()
        .map(|s| stats.get(&s.index(), 0).unwrap().iter().sum())
        .collect()
}

/// Asserts `kp_xdp` recorded at least `n` new flows.
fn assert_xdp_new_flows(bpffs: &Bpffs, n: u64) {
    let stats = xdp_stats(bpffs);
    assert!(
        stats[XdpStat::NewFlow.index() as usize] >= n,
        "fewer than {n} flows started in XDP: {:?}",
        XdpStat::ALL.iter().zip(&stats).collect::<Vec<_>>()
    );
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
    assert_tcp_entries_expire(&s.bpffs);
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

/// The soak's leftover entries and connect timeouts (issue #22): a client connects from port
/// `cp` to NodePort A, closes, then from the same port to NodePort B of another service with
/// the same backend (the client may: the destinations differ). Both flows have the reply
/// tuple `B:bp → C:cp`. Then it connects from `cp` to A again (its TIME_WAIT reused).
///
/// Every connection must reach the backend, and every entry must leave after the TIME_WAIT
/// timeout. Before the fix, the second flow's `RevDnat` entry replaced the first's, whose
/// `Service` entry stayed behind with the client's FIN only (half-closed: held for the
/// close-wait timeout) and sent the third connection's replies out untranslated (it timed
/// out). IPv4 and IPv6 with a local backend, IPv4 with a SNATed remote one.
#[test]
fn a_client_port_reused_toward_another_frontend_of_the_same_backend() {
    if require_root() {
        client_port_reused_toward_another_frontend("ct-twins", false);
    }
}

/// [`a_client_port_reused_toward_another_frontend_of_the_same_backend`] with the flows
/// recorded by XDP.
#[test]
fn a_client_port_reused_toward_another_frontend_of_the_same_backend_xdp() {
    if require_root() {
        client_port_reused_toward_another_frontend("ct-twins-x", true);
    }
}

fn client_port_reused_toward_another_frontend(hint: &str, xdp: bool) {
    let mut s = setup_with(hint, 8192, timeouts(), xdp);
    // Connecting from a port with a TIME_WAIT connection to the same destination (the third
    // connection) needs this; the kernel allows it a second after that connection's last
    // segment.
    s.topo
        .client
        .run(|| std::fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1"))
        .unwrap()
        .unwrap();
    for (i, (a, b, twin)) in TWINS.into_iter().enumerate() {
        let node: IpAddr = match twin {
            Twin::Local6 => NODE_IP6.into(),
            Twin::Local | Twin::Remote => NODE_IP.into(),
        };
        let pod = match twin {
            Twin::Local | Twin::Local6 => "pod-l0 ",
            Twin::Remote => "pod-r0 ",
        };
        let port = 41_000 + i as u16;
        for (step, node_port) in [a, b, a].into_iter().enumerate() {
            let to = SocketAddr::new(node, node_port);
            let greeting = connect_from(&s.topo, port, to)
                .and_then(greet_and_close)
                .unwrap_or_else(|e| {
                    panic!("{twin:?}: connection {step} from port {port} to {to}: {e}")
                });
            assert!(greeting.starts_with(pod), "{twin:?} {to}: {greeting:?}");
        }
    }
    if xdp {
        // The IPv4 ones (XDP has no IPv6 path).
        assert_xdp_new_flows(&s.bpffs, 6);
    }
    assert_tcp_entries_expire(&s.bpffs);
    s.mode.cleanup().unwrap();
}

/// A connection attempt of [`new_connects_after_an_endpoint_change_reach_a_current_endpoint`]:
/// when it started and the greeting (the pod's name first) or the error.
type Attempt = (Instant, Result<String, String>);

/// Endpoint changes while a client connects over and over from 8 ports (so new connections
/// reuse the tuples of closed ones, whose entries a long TIME_WAIT timeout keeps), as the
/// soak's prober does toward NodePorts whose pods change (issue #22): every connection
/// succeeds, and every one started after a change reaches an endpoint of the service as
/// changed. Before the fix a SYN on a closed flow's tuple reopened that flow, to its old
/// backend; upstream's conntrack takes a SYN on a closed connection as a new connection,
/// which the rules load-balance afresh, and so does kproxy now.
#[test]
fn new_connects_after_an_endpoint_change_reach_a_current_endpoint() {
    if require_root() {
        new_connects_after_endpoint_changes("ct-flip", false, false);
    }
}

/// [`new_connects_after_an_endpoint_change_reach_a_current_endpoint`] over IPv6.
#[test]
fn new_connects_after_an_endpoint_change_reach_a_current_endpoint_ipv6() {
    if require_root() {
        new_connects_after_endpoint_changes("ct-flip6", false, true);
    }
}

/// [`new_connects_after_an_endpoint_change_reach_a_current_endpoint`] with XDP on the
/// client's link (it sees the reopening SYN first).
#[test]
fn new_connects_after_an_endpoint_change_reach_a_current_endpoint_xdp() {
    if require_root() {
        new_connects_after_endpoint_changes("ct-flip-x", true, false);
    }
}

fn new_connects_after_endpoint_changes(hint: &str, xdp: bool, v6: bool) {
    let t = flows::Timeouts {
        tcp_time_wait: Duration::from_secs(300),
        ..timeouts()
    };
    let mut s = setup_with(hint, 8192, t, xdp);
    s.topo
        .client
        .run(|| {
            std::fs::write("/proc/sys/net/ipv4/tcp_tw_reuse", "1")?;
            std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", "42000 42007")
        })
        .unwrap()
        .unwrap();
    let sets: [&[&str]; 5] = [
        &["pod-r0"],
        &["pod-l0", "pod-r0"],
        &["pod-l0"],
        &["pod-r0"],
        &["pod-l0"],
    ];
    let stop = std::sync::atomic::AtomicBool::new(false);
    let to = if v6 {
        SocketAddr::new(NODE_IP6.into(), FLIP6_NODE_PORT)
    } else {
        SocketAddr::new(NODE_IP.into(), FLIP_NODE_PORT)
    };
    // (begin, end, set) of each change: connections started in [end, next begin) must reach
    // the set.
    let mut changes: Vec<(Instant, Instant, &[&str])> = vec![];
    let attempts: Vec<Attempt> = thread::scope(|scope| {
        let client = scope.spawn(|| {
            let mut attempts = vec![];
            s.topo
                .client
                .run(|| {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let started = Instant::now();
                        let r = match TcpStream::connect_timeout(&to, LIVENESS) {
                            // All 8 ports busy (TIME_WAIT younger than a second): not an attempt.
                            Err(e) if e.raw_os_error() == Some(libc::EADDRNOTAVAIL) => {
                                thread::sleep(Duration::from_millis(20));
                                continue;
                            }
                            Err(e) => Err(format!("connect: {e}")),
                            Ok(c) => greet_and_close(c).map_err(|e| format!("greeting: {e}")),
                        };
                        attempts.push((started, r));
                    }
                })
                .unwrap();
            attempts
        });
        for set in sets {
            let begin = Instant::now();
            let report = s
                .mode
                .sync(&snapshot_with(&s.topo, set), &ChangedSet::default());
            assert_eq!(report.unwrap().failed_services, 0);
            changes.push((begin, Instant::now(), set));
            // Connections run against this state for a while (each port is reused after its
            // TIME_WAIT is a second old).
            thread::sleep(Duration::from_secs(3));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        client.join().unwrap()
    });
    let failed: Vec<_> = attempts.iter().filter(|(_, r)| r.is_err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} connections failed: {failed:?}",
        failed.len(),
        attempts.len()
    );
    for (i, (_, end, set)) in changes.iter().enumerate() {
        let next = changes.get(i + 1).map(|c| c.0);
        let during: Vec<&String> = attempts
            .iter()
            .filter(|(at, _)| at >= end && next.is_none_or(|n| *at < n))
            .filter_map(|(_, r)| r.as_ref().ok())
            .collect();
        assert!(
            during.len() >= 8,
            "change {i} ({set:?}): only {} connections",
            during.len()
        );
        let stale: Vec<_> = during
            .iter()
            .filter(|g| !set.iter().any(|p| g.starts_with(&format!("{p} "))))
            .collect();
        assert!(
            stale.is_empty(),
            "change {i} to {set:?}: {} of {} new connections reached another pod: {stale:?}",
            stale.len(),
            during.len()
        );
    }
    if xdp {
        assert_xdp_new_flows(&s.bpffs, attempts.len() as u64 / 2);
    }
    s.mode.cleanup().unwrap();
}
