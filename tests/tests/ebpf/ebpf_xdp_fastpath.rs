//! The XDP NodePort fast path (`kp_xdp` → `kproxy-ebpf/src/xdp_fwd.rs`) with real packets: the
//! shared topology (client ─ node ─ node2), `kp_tc_in`/`kp_tc_eg` on the node's two devices
//! and `kp_xdp` attached natively beside them; NodePort frontends written into the service
//! maps directly (the `kproxy_tests::tc` encoding): 30080 TCP/UDP → pod-r0 on node2 (remote,
//! SNATed), 30081 TCP → pod-l0 (local). The client talks through in-process sockets created in
//! its namespace, so one connection can outlive attaching and detaching XDP.
//!
//! veth specifics (see `kproxy/src/dataplane/ebpf_tc/xdp.rs`): a frame sent by `XDP_TX` /
//! `XDP_REDIRECT` into a veth is only received when the peer end runs an XDP program (here the
//! object's counter program, which passes everything, on the client's and node2's ends), and
//! XDP only sees complete checksums when the sender does not offload them (a veth peer hands
//! over CHECKSUM_PARTIAL frames; transmit checksum offload is turned off on those two ends,
//! as a physical NIC's received frames always are complete).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, SocketAddrV4, TcpStream, UdpSocket};
use std::time::Duration;

use aya::Ebpf;
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray};
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPath;
use kproxy::dataplane::ebpf::node_path::xdp::XdpPolicy;
use kproxy::dataplane::ebpf::node_path::xdp::driver;
use kproxy::kernel::addresses::NodeAddresses;
use kproxy::kernel::addresses::scan;
use kproxy_common::counter::CounterSlot;
use kproxy_common::ct::{
    BACKEND_FWD_ENTRIES, BackendFwd, CT_F_NO_REV, CT_F_SNAT_HERE, CtEntry, CtKey, CtKind,
    FWD_GEN_PER_BACKEND, MAP_BACKEND_FWD, MAP_CT, MAP_FWD_GEN,
};
use kproxy_common::service::{
    BE_F_LOCAL, PROTO_TCP, PROTO_UDP, SCOPE_CLUSTER, SCOPE_EXTERNAL, SVC_F_NODE_PORT, ServiceValue,
};
use kproxy_tests::bpf::PacketCounter;
use kproxy_tests::netns::{Bpffs, Netns, require_root};
use kproxy_tests::tc::{backend, frontend, load, slots};
use kproxy_tests::topology::{
    CLIENT_IP, NODE_CLIENT_IF, NODE_IP, NODE_LINK_IP, NODE_PEER_IF, NODE2_IP, NODE2_POD_CIDR,
    Topology, TopologySpec,
};

const REMOTE_PORT: u16 = 30080;
const LOCAL_PORT: u16 = 30081;
const POD_PORT: u16 = 8080;
const SNAT_MIN: u16 = 61_000;
const LIVENESS: Duration = Duration::from_secs(10);
/// The peer ends' device name (client side and node2 side of the node's links).
const PEER_IF: &str = "eth0";

struct Rig {
    // Drop order: programs, peers' programs, namespaces, bpffs.
    xdp: XdpPath,
    _tc: TcPath,
    ebpf: Ebpf,
    _peers: PacketCounter,
    topo: Topology,
    _bpffs: Bpffs,
}

/// `ethtool -K IF tx off` (SIOCETHTOOL / ETHTOOL_STXCSUM) in the calling thread's netns.
fn tx_checksum_off(ifname: &str) -> std::io::Result<()> {
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        data: *mut EthtoolValue,
        _pad: [u8; 16],
    }
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_STXCSUM: u32 = 0x17;
    let mut value = EthtoolValue {
        cmd: ETHTOOL_STXCSUM,
        data: 0,
    };
    let mut req = IfReq {
        name: [0; 16],
        data: &mut value,
        _pad: [0; 16],
    };
    req.name[..ifname.len()].copy_from_slice(ifname.as_bytes());
    // SAFETY: plain socket + ioctl with a request that outlives the call; fd closed below.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rc = libc::ioctl(fd, SIOCETHTOOL, &mut req);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if rc != 0 {
            return Err(err);
        }
    }
    Ok(())
}

fn service(flags: u32, svc_id: u32, count: u32) -> ServiceValue {
    ServiceValue {
        svc_id,
        count,
        flags: flags | SVC_F_NODE_PORT,
        affinity_timeout: 0,
    }
}

impl Rig {
    fn new(test: &str) -> Rig {
        let mut topo = TopologySpec::new(test)
            .local_pods(1)
            .remote_pods(1)
            .ipv6(false)
            .build()
            .unwrap();
        topo.serve_all().unwrap();
        let bpffs = Bpffs::new(&format!("{test}-fs")).unwrap();
        let (mut ebpf, mut tc) = load(
            &bpffs,
            TcConfig {
                ct_entries: 8192,
                ..TcConfig::default()
            },
        );
        let local = topo.pod("pod-l0").ip;
        let remote = topo.pod("pod-r0").ip;
        backend(&mut ebpf, 1, remote, POD_PORT, 0);
        backend(&mut ebpf, 2, local, POD_PORT, BE_F_LOCAL);
        slots(&mut ebpf, 1, &[1]);
        slots(&mut ebpf, 2, &[2]);
        for addr in [NODE_IP, NODE_LINK_IP] {
            for scope in [SCOPE_CLUSTER, SCOPE_EXTERNAL] {
                for proto in [PROTO_TCP, PROTO_UDP] {
                    frontend(&mut ebpf, addr, REMOTE_PORT, proto, scope, service(0, 1, 1));
                }
                frontend(
                    &mut ebpf,
                    addr,
                    LOCAL_PORT,
                    PROTO_TCP,
                    scope,
                    service(0, 2, 1),
                );
            }
        }
        let devices = vec![NODE_CLIENT_IF.to_string(), NODE_PEER_IF.to_string()];
        let ifaces = topo.node.run(scan).unwrap().unwrap();
        let addrs = NodeAddresses::from_interfaces(&ifaces, Some(&devices));
        TcPath::set_node_addresses(&mut ebpf, &addrs.snat_v4()).unwrap();
        topo.node
            .run(|| {
                for dev in &devices {
                    tc.attach(&mut ebpf, dev).unwrap();
                }
            })
            .unwrap();
        let xdp = XdpPath::load(&mut ebpf).unwrap();
        // The peers: a passing XDP program (so redirected frames are received) and complete
        // checksums on what they send.
        let peer_pins = bpffs.path().join("peers");
        std::fs::create_dir_all(&peer_pins).unwrap();
        let mut peers = PacketCounter::load_with_pins(&peer_pins).unwrap();
        let node2 = topo.node2.as_ref().unwrap();
        for ns in [&topo.client, node2] {
            ns.run(|| {
                tx_checksum_off(PEER_IF).unwrap();
                peers.attach(PEER_IF, CounterSlot::Xdp).unwrap();
            })
            .unwrap();
        }
        Rig {
            xdp,
            _tc: tc,
            ebpf,
            _peers: peers,
            topo,
            _bpffs: bpffs,
        }
    }

    /// Attaches `kp_xdp` natively to both node devices. They are veths, which are no
    /// fast-path devices by default; their peers are prepared (see [`Rig::new`]), so the test
    /// opts in.
    fn attach_xdp(&mut self) {
        let both = [NODE_CLIENT_IF, NODE_PEER_IF];
        self.attach_xdp_to(&both, &both);
    }

    /// Attaches `kp_xdp` natively to the node devices `attached` (veths) and enables the
    /// devices `fast_path` as fast-path devices.
    fn attach_xdp_to(&mut self, attached: &[&str], fast_path: &[&str]) {
        let (xdp, ebpf) = (&mut self.xdp, &mut self.ebpf);
        self.topo
            .node
            .run(|| {
                for &dev in attached {
                    assert!(xdp.attach(ebpf, dev, XdpPolicy::Native).unwrap());
                    assert_eq!(driver(dev).unwrap(), "veth");
                }
                for &dev in fast_path {
                    XdpPath::set_fast_path(ebpf, dev, true).unwrap();
                }
            })
            .unwrap();
    }

    fn detach_xdp(&mut self) {
        let (xdp, ebpf) = (&mut self.xdp, &mut self.ebpf);
        self.topo
            .node
            .run(|| {
                for dev in [NODE_CLIENT_IF, NODE_PEER_IF] {
                    xdp.detach(ebpf, dev).unwrap();
                }
            })
            .unwrap();
        assert!(self.xdp.attached().is_empty());
    }

    fn stats(&self) -> Stats {
        Stats {
            tc: TcPath::stats(&self.ebpf).unwrap(),
            xdp: XdpPath::stats(&self.ebpf).unwrap(),
        }
    }

    /// The counters once no packet moves them any more (two reads 200 ms apart agree, within
    /// a 5 s liveness bound): a closed connection's last segments (the server's FIN, the
    /// client's final ACK) may still be on their way when its socket is dropped, and would
    /// land in the next part's deltas.
    fn settled_stats(&self) -> Stats {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut last = self.stats();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            let now = self.stats();
            if now == last || std::time::Instant::now() > deadline {
                return now;
            }
            last = now;
        }
    }

    /// Resolves the node's neighbours (client, node2) with one flow through TC, so the FIB
    /// lookups of later flows succeed from their first packet.
    fn warm_neighbours(&self) {
        let mut c = Conn::open(&self.topo.client, REMOTE_PORT);
        c.exchange(1);
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Stats {
    tc: BTreeMap<&'static str, u64>,
    xdp: BTreeMap<&'static str, u64>,
}

impl Stats {
    fn tc_delta(&self, before: &Stats, name: &str) -> u64 {
        self.tc[name] - before.tc[name]
    }
    fn xdp_delta(&self, before: &Stats, name: &str) -> u64 {
        self.xdp[name] - before.xdp[name]
    }
    /// TC counters of translated packets (any direction).
    fn tc_translated(&self, before: &Stats) -> u64 {
        ["new_flow", "established", "reply", "snat"]
            .iter()
            .map(|n| self.tc_delta(before, n))
            .sum()
    }
}

/// A TCP connection from the client to a NodePort on `NODE_IP`, to a `kp-probe serve`
/// backend: its greeting names the backend and the peer it saw; then it echoes.
struct Conn {
    stream: BufReader<TcpStream>,
    backend: String,
    peer_seen: SocketAddrV4,
}

impl Conn {
    fn open(client: &Netns, port: u16) -> Conn {
        let dst = SocketAddr::from((NODE_IP, port));
        let stream = client
            .run(move || TcpStream::connect_timeout(&dst, LIVENESS))
            .unwrap()
            .unwrap_or_else(|e| panic!("connecting to {dst}: {e}"));
        assert_eq!(stream.peer_addr().unwrap(), dst);
        Conn::greeted(stream)
    }

    /// A connected stream, once the backend's greeting is read.
    fn greeted(stream: TcpStream) -> Conn {
        stream.set_read_timeout(Some(LIVENESS)).unwrap();
        let mut stream = BufReader::new(stream);
        let mut greeting = String::new();
        stream.read_line(&mut greeting).unwrap();
        let (backend, peer) = greeting.trim().split_once(' ').expect("greeting");
        Conn {
            backend: backend.to_string(),
            peer_seen: peer.parse().unwrap(),
            stream,
        }
    }

    /// [`Conn::open`] from client port `cport` (bound first, `SO_REUSEADDR`).
    fn open_from(client: &Netns, cport: u16, port: u16) -> Conn {
        use nix::sys::socket::{
            AddressFamily, SockFlag, SockType, SockaddrIn, bind, connect, setsockopt, socket,
            sockopt,
        };
        use std::os::fd::AsRawFd;
        let stream = client
            .run(move || -> nix::Result<TcpStream> {
                let fd = socket(
                    AddressFamily::Inet,
                    SockType::Stream,
                    SockFlag::SOCK_CLOEXEC,
                    None,
                )?;
                setsockopt(&fd, sockopt::ReuseAddr, &true)?;
                bind(
                    fd.as_raw_fd(),
                    &SockaddrIn::from(SocketAddrV4::new(CLIENT_IP, cport)),
                )?;
                connect(
                    fd.as_raw_fd(),
                    &SockaddrIn::from(SocketAddrV4::new(NODE_IP, port)),
                )?;
                Ok(TcpStream::from(fd))
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("connecting from port {cport}: {e}"));
        Conn::greeted(stream)
    }

    /// Closes with a RST (`SO_LINGER` 0).
    fn reset(self) {
        use nix::sys::socket::{setsockopt, sockopt};
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        setsockopt(self.stream.get_ref(), sockopt::Linger, &linger).unwrap();
    }

    /// `n` request/echo round trips (one data segment each way per trip).
    fn exchange(&mut self, n: usize) {
        for i in 0..n {
            let msg = format!("message {i:04}\n");
            self.stream.get_mut().write_all(msg.as_bytes()).unwrap();
            let mut echo = vec![0u8; msg.len()];
            self.stream.read_exact(&mut echo).unwrap();
            assert_eq!(echo, msg.as_bytes());
        }
    }
}

/// `n` datagrams from one client socket to the UDP NodePort; returns (answer, source) pairs.
fn udp_exchange(client: &Netns, n: usize) -> Vec<(String, SocketAddr)> {
    let sock = client
        .run(|| UdpSocket::bind((CLIENT_IP, 0)))
        .unwrap()
        .unwrap();
    sock.set_read_timeout(Some(LIVENESS)).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 512];
    for _ in 0..n {
        sock.send_to(b"ping", (NODE_IP, REMOTE_PORT)).unwrap();
        let (len, from) = sock.recv_from(&mut buf).unwrap();
        out.push((
            String::from_utf8_lossy(&buf[..len]).trim().to_string(),
            from,
        ));
    }
    out
}

/// The backend saw the node's address on the link to node2 and a port from the SNAT range.
fn assert_snat(c: &Conn) {
    assert_eq!(c.backend, "pod-r0");
    assert_eq!(
        *c.peer_seen.ip(),
        NODE_LINK_IP,
        "SNAT source: {}",
        c.peer_seen
    );
    assert!(c.peer_seen.port() >= SNAT_MIN, "SNAT port: {}", c.peer_seen);
}

#[test]
fn remote_backend_flows_take_the_xdp_fast_path_both_ways() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-fast");
    rig.attach_xdp();
    rig.warm_neighbours();
    let before = rig.settled_stats();

    // TCP: 20 round trips on a flow that starts in XDP.
    let mut c = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&c);
    c.exchange(20);
    drop(c);
    // UDP: the client sees the NodePort as the source of every answer.
    let answers = udp_exchange(&rig.topo.client, 10);
    for (answer, from) in &answers {
        assert_eq!(*from, SocketAddr::from((NODE_IP, REMOTE_PORT)), "{answer}");
        let (name, peer) = answer.split_once(' ').unwrap();
        assert_eq!(name, "pod-r0");
        let peer: SocketAddrV4 = peer.parse().unwrap();
        assert_eq!(*peer.ip(), NODE_LINK_IP, "UDP SNAT source: {answer}");
    }
    let after = rig.stats();
    // SYN + ACK + 20 data segments, and 10 datagrams, at least.
    assert!(
        after.xdp_delta(&before, "forward") >= 22 + 10,
        "XDP forward: {after:?} vs {before:?}"
    );
    // SYN-ACK + 20 echoes, and 10 answers, at least.
    assert!(
        after.xdp_delta(&before, "reply") >= 21 + 10,
        "XDP reply: {after:?} vs {before:?}"
    );
    assert!(after.xdp_delta(&before, "new_flow") >= 2, "{after:?}");
    assert_eq!(
        after.tc_translated(&before),
        0,
        "TC translated none of these packets: {after:?} vs {before:?}"
    );

    // A flow to the local backend is passed to TC, which translates it (no SNAT).
    let before = rig.settled_stats();
    let mut c = Conn::open(&rig.topo.client, LOCAL_PORT);
    assert_eq!(c.backend, "pod-l0");
    assert_eq!(
        *c.peer_seen.ip(),
        CLIENT_IP,
        "local backend sees the client"
    );
    c.exchange(5);
    let after = rig.stats();
    assert!(after.xdp_delta(&before, "pass_local") >= 7, "{after:?}");
    assert!(after.tc_delta(&before, "established") >= 7, "{after:?}");
    assert_eq!(after.xdp_delta(&before, "forward"), 0, "{after:?}");
}

/// The `Service` entry of the client's flow from port `cport` (its forwarding cache).
fn service_entry(ebpf: &Ebpf, cport: u16) -> CtEntry {
    let ct: BpfHashMap<&MapData, CtKey, CtEntry> =
        BpfHashMap::try_from(ebpf.map(MAP_CT).expect("KP_CT")).unwrap();
    ct.iter()
        .map(Result::unwrap)
        .find(|(k, _)| {
            k.kind == CtKind::Service as u8
                && k.saddr == u32::from_ne_bytes(CLIENT_IP.octets())
                && k.sport == cport.to_be()
        })
        .map(|(_, e)| e)
        .unwrap_or_else(|| panic!("no Service entry for client port {cport}"))
}

/// `KP_FWD_GEN`: the generation caches must match.
fn fwd_gen(ebpf: &Ebpf) -> u32 {
    let a: Array<&MapData, u32> =
        Array::try_from(ebpf.map(MAP_FWD_GEN).expect("KP_FWD_GEN")).unwrap();
    a.get(&0, 0).unwrap()
}

/// How long a routing change may take to reach the generation (rtnetlink → the watcher).
const NOTIFIED: Duration = Duration::from_secs(2);

/// The generation once the watcher moved it past `old`, or (not asserted here: the packets
/// tell) after [`NOTIFIED`].
fn wait_gen_moved(ebpf: &Ebpf, old: u32) -> u32 {
    let t0 = std::time::Instant::now();
    loop {
        let g = fwd_gen(ebpf);
        if g != old || t0.elapsed() > NOTIFIED {
            return g;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn mac_str(m: &[u8]) -> String {
    m.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A flow's cached forwarding result (next hop MAC, egress device) follows the node's routing
/// state: after node2's neighbour entry changes, the flow's next packet leaves with the new
/// MAC (and is lost, as the kernel's own forwarding would lose it); after the route to the
/// pods is removed, the next packet is passed to the stack (`pass_fib`) instead of forwarded
/// by a stale cache; with both restored, the same connection carries on. Without
/// revalidation the cached MAC would stay and the packet after the route removal would be
/// forwarded.
#[test]
fn cached_forwarding_follows_neighbour_and_route_changes() {
    if !require_root() {
        return;
    }
    const BOGUS_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x99];
    let mut rig = Rig::new("xdp-cache");
    rig.attach_xdp();
    rig.warm_neighbours();
    let mut c = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&c);
    let cport = c.stream.get_ref().local_addr().unwrap().port();
    let before = rig.stats();
    c.exchange(5);
    let after = rig.stats();
    assert!(after.xdp_delta(&before, "forward") >= 5, "{after:?}");
    let e = service_entry(&rig.ebpf, cport);
    let generation = fwd_gen(&rig.ebpf);
    assert_ne!(generation, 0, "caching is on once XDP is attached");
    assert_eq!(
        e.fwd.generation, generation,
        "the established flow's route is cached: {e:?}"
    );
    assert_eq!(e.snat_addr, u32::from_ne_bytes(NODE_LINK_IP.octets()));
    let node2_mac = e.fwd.eth[..6].to_vec();
    assert_ne!(node2_mac, BOGUS_MAC);
    let node = &rig.topo.node;
    let (node2_ip, peer) = (NODE2_IP.to_string(), NODE_PEER_IF);

    // node2's neighbour entry changes: the next packet is sent with the new MAC.
    node.ip(&[
        "neigh",
        "replace",
        &node2_ip,
        "lladdr",
        &mac_str(&BOGUS_MAC),
        "dev",
        peer,
        "nud",
        "permanent",
    ])
    .unwrap();
    let gen2 = wait_gen_moved(&rig.ebpf, generation);
    c.stream
        .get_mut()
        .write_all(b"after the neighbour change\n")
        .unwrap();
    let t0 = std::time::Instant::now();
    let e = loop {
        let e = service_entry(&rig.ebpf, cport);
        if e.fwd.eth[..6] == BOGUS_MAC || t0.elapsed() > NOTIFIED {
            break e;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(
        e.fwd.eth[..6],
        BOGUS_MAC,
        "the new neighbour MAC is used: {e:?}"
    );
    assert_eq!(
        e.fwd.generation, gen2,
        "refilled under the new generation: {e:?}"
    );
    // Restored: the retransmission reaches the backend, the echo comes back.
    node.ip(&[
        "neigh",
        "replace",
        &node2_ip,
        "lladdr",
        &mac_str(&node2_mac),
        "dev",
        peer,
        "nud",
        "permanent",
    ])
    .unwrap();
    let mut echo = String::new();
    c.stream.read_line(&mut echo).unwrap();
    assert_eq!(echo, "after the neighbour change\n");
    c.exchange(3);
    assert_eq!(service_entry(&rig.ebpf, cport).fwd.eth[..6], node2_mac[..]);

    // The route to the pods goes: the next packet is passed, not forwarded by the cache.
    let gen3 = fwd_gen(&rig.ebpf);
    node.ip(&["route", "del", NODE2_POD_CIDR]).unwrap();
    wait_gen_moved(&rig.ebpf, gen3);
    let before = rig.stats();
    c.stream
        .get_mut()
        .write_all(b"after the route change\n")
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let after = rig.stats();
    assert!(
        after.xdp_delta(&before, "pass_fib") >= 1,
        "{after:?} vs {before:?}"
    );
    assert_eq!(
        after.xdp_delta(&before, "forward"),
        0,
        "{after:?} vs {before:?}"
    );
    node.add_route(NODE2_POD_CIDR, &node2_ip).unwrap();
    let mut echo = String::new();
    c.stream.read_line(&mut echo).unwrap();
    assert_eq!(echo, "after the route change\n");
    let before = rig.stats();
    c.exchange(3);
    assert!(rig.stats().xdp_delta(&before, "forward") >= 3);
}

#[test]
fn flows_continue_across_xdp_attach_and_detach() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-move");
    rig.warm_neighbours();

    // Started by TC alone.
    let mut tc_flow = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&tc_flow);
    tc_flow.exchange(3);
    let before = rig.stats();
    assert!(
        before.tc["snat"] > 0 && before.xdp["forward"] == 0,
        "{before:?}"
    );

    // XDP attached: the same flow continues in XDP, from TC's CT entries.
    rig.attach_xdp();
    let before = rig.stats();
    tc_flow.exchange(10);
    let after = rig.stats();
    assert!(after.xdp_delta(&before, "forward") >= 10, "{after:?}");
    assert!(after.xdp_delta(&before, "reply") >= 10, "{after:?}");
    assert_eq!(after.xdp_delta(&before, "new_flow"), 0, "{after:?}");
    assert_eq!(after.tc_translated(&before), 0, "{after:?} vs {before:?}");

    // Started in XDP …
    let mut xdp_flow = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&xdp_flow);
    xdp_flow.exchange(3);
    assert!(rig.stats().xdp_delta(&after, "new_flow") >= 1);

    // … continues in TC once XDP is gone (and so does the first flow).
    rig.detach_xdp();
    let before = rig.stats();
    xdp_flow.exchange(10);
    tc_flow.exchange(10);
    let after = rig.stats();
    assert_eq!(after.xdp_delta(&before, "forward"), 0, "{after:?}");
    assert!(after.tc_delta(&before, "established") >= 20, "{after:?}");
    assert!(after.tc_delta(&before, "snat") >= 20, "{after:?}");
    assert!(after.tc_delta(&before, "reply") >= 40, "{after:?}");
    assert_eq!(after.tc_delta(&before, "new_flow"), 0, "{after:?}");
}

#[test]
fn veth_devices_are_not_fast_path_devices_unless_enabled() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-veth");
    rig.attach_xdp_to(&[NODE_CLIENT_IF, NODE_PEER_IF], &[]);
    let before = rig.stats();
    let mut c = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&c);
    c.exchange(5);
    let after = rig.stats();
    assert_eq!(after.xdp_delta(&before, "forward"), 0, "{after:?}");
    assert_eq!(after.xdp_delta(&before, "reply"), 0, "{after:?}");
    assert!(after.xdp_delta(&before, "pass_device") >= 7, "{after:?}");
    assert!(after.tc_delta(&before, "snat") >= 7, "{after:?}");
}

/// What the fast path leaves to TC, on crafted frames through `BPF_PROG_TEST_RUN` in the
/// node's namespace (the FIB lookup of a test run uses the caller's netns; its ingress is the
/// namespace's `lo`, enabled as a fast-path device here): a plain SYN is forwarded, TTL 1, a
/// fragment, IP options and a frame over the egress MTU are passed, each counted.
#[test]
fn frames_the_fast_path_cannot_forward_are_passed() {
    if !require_root() {
        return;
    }
    use kproxy_tests::bpf::testrun::run_xdp;
    use kproxy_tests::tc::{csum, ipv4_header, tcp_frame, tcp_segment};
    const XDP_PASS: i32 = 2;
    const XDP_REDIRECT: i32 = 4;
    const SYN: u8 = 0x02;
    let mut rig = Rig::new("xdp-pass");
    rig.warm_neighbours();
    let remote = rig.topo.pod("pod-r0").ip;
    let dst = (NODE_IP, REMOTE_PORT);
    let syn =
        |sport: u16, payload: &[u8]| tcp_frame((CLIENT_IP, sport), dst, 1, 0, SYN, &[], payload);
    let mut ttl1 = syn(40_002, &[]);
    ttl1[14 + 8] = 1;
    let mut fragment = syn(40_003, &[]);
    fragment[14 + 6] = 0x20; // MF
    let options = {
        let seg = tcp_segment((CLIENT_IP, 40_004), dst, 1, 0, SYN, &[], &[]);
        let mut ip = ipv4_header(CLIENT_IP, NODE_IP, PROTO_TCP, seg.len() + 4);
        ip[0] = 0x46;
        ip.extend_from_slice(&[1, 1, 1, 1]); // four NOP options
        ip[10..12].copy_from_slice(&[0, 0]);
        let c = csum(&ip);
        ip[10..12].copy_from_slice(&c.to_be_bytes());
        ip.extend_from_slice(&seg);
        let mut f = syn(40_004, &[])[..14].to_vec();
        f.extend_from_slice(&ip);
        f
    };
    let oversized = syn(40_005, &[0u8; 1600]);
    let (node, ebpf) = (&rig.topo.node, &mut rig.ebpf);
    let results = node
        .run(|| {
            XdpPath::set_fast_path(ebpf, "lo", true).unwrap();
            for dev in [NODE_CLIENT_IF, NODE_PEER_IF] {
                XdpPath::set_fast_path(ebpf, dev, true).unwrap();
            }
            let mut out = vec![];
            for (name, frame) in [
                ("plain", syn(40_001, &[])),
                ("ttl1", ttl1),
                ("fragment", fragment),
                ("options", options),
                ("oversized", oversized),
            ] {
                let before = XdpPath::stats(ebpf).unwrap();
                let r = run_xdp(ebpf, &frame, 1).unwrap();
                let after = XdpPath::stats(ebpf).unwrap();
                let bumped: Vec<&str> = after
                    .iter()
                    .filter(|(k, v)| before[*k] != **v)
                    .map(|(k, _)| *k)
                    .collect();
                out.push((name, r, bumped));
            }
            out
        })
        .unwrap();
    for (name, r, bumped) in results {
        match name {
            "plain" => {
                assert_eq!(r.verdict, XDP_REDIRECT, "{name}: {bumped:?}");
                let ip = &r.frame[14..34];
                assert_eq!(csum(ip), 0, "IPv4 checksum after the rewrite");
                assert_eq!(ip[8], 63, "TTL decremented");
                assert_eq!(&ip[12..16], &NODE_LINK_IP.octets(), "SNAT source");
                assert_eq!(&ip[16..20], &remote.octets(), "backend");
                assert_eq!(bumped, ["forward", "new_flow"], "{name}");
            }
            "oversized" => {
                assert_eq!(r.verdict, XDP_PASS, "{name}");
                assert_eq!(bumped, ["new_flow", "pass_mtu"], "{name}");
            }
            _ => {
                assert_eq!(r.verdict, XDP_PASS, "{name}");
                assert_eq!(bumped, ["pass_header"], "{name}");
            }
        }
    }
}

/// The per-backend forwarding cache of new flows (`KP_BE_FWD`) of backend `id`: the entries
/// of the CPUs that filled one.
fn backend_fwd(ebpf: &Ebpf, id: u32) -> Vec<BackendFwd> {
    let a: PerCpuArray<&MapData, BackendFwd> =
        PerCpuArray::try_from(ebpf.map(MAP_BACKEND_FWD).expect("KP_BE_FWD")).unwrap();
    let values = a.get(&(id & (BACKEND_FWD_ENTRIES - 1)), 0).unwrap();
    values
        .iter()
        .filter(|e| e.fwd.generation != 0)
        .copied()
        .collect()
}

/// `KP_FWD_GEN[FWD_GEN_PER_BACKEND]`: whether new flows may use the per-backend cache.
fn per_backend_allowed(ebpf: &Ebpf) -> bool {
    let a: Array<&MapData, u32> =
        Array::try_from(ebpf.map(MAP_FWD_GEN).expect("KP_FWD_GEN")).unwrap();
    a.get(&FWD_GEN_PER_BACKEND, 0).unwrap() != 0
}

/// Waits (at most [`NOTIFIED`]) for `cond`; returns its last value.
fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t0.elapsed() > NOTIFIED {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Opens `n` connections to the remote backend (new flows, from `n` client ports), each
/// SNATed and echoing; returns them.
fn open_remote(rig: &Rig, n: usize) -> Vec<Conn> {
    (0..n)
        .map(|_| {
            let mut c = Conn::open(&rig.topo.client, REMOTE_PORT);
            assert_snat(&c);
            c.exchange(1);
            c
        })
        .collect()
}

/// Backend id of pod-r0 in [`Rig::new`].
const REMOTE_BACKEND_ID: u32 = 1;
/// New flows per batch in the per-backend cache tests.
const BATCH: usize = 8;

/// New flows to one backend from many client ports: after the first on each CPU looked its
/// route up, the others are forwarded by XDP from the backend's cached route (counted in
/// `new_flow_cached`), leave toward node2's MAC from the node's link device with the node's
/// link address as SNAT source, and reach the backend. Without the per-backend cache every
/// new flow looks its route up and `new_flow_cached` stays 0.
#[test]
fn new_flows_to_one_backend_reuse_its_cached_route() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-befwd");
    rig.attach_xdp();
    rig.warm_neighbours();
    assert!(
        per_backend_allowed(&rig.ebpf),
        "default routing policy: the per-backend cache is allowed"
    );
    let gen0 = fwd_gen(&rig.ebpf);
    let before = rig.stats();
    let conns = open_remote(&rig, BATCH);
    let after = rig.stats();
    let moved = fwd_gen(&rig.ebpf) != gen0;
    assert_eq!(after.tc_translated(&before), 0, "{after:?} vs {before:?}");
    assert!(
        after.xdp_delta(&before, "new_flow") >= BATCH as u64,
        "{after:?}"
    );
    let cached = after.xdp_delta(&before, "new_flow_cached");
    let cpus = aya::util::nr_cpus().unwrap();
    // One lookup per CPU (per generation, if a neighbour announcement moved it meanwhile).
    let least = if moved {
        1
    } else {
        BATCH.saturating_sub(cpus).max(1)
    };
    assert!(
        cached >= least as u64,
        "new flows cached: {cached} of {BATCH} ({cpus} CPUs, generation moved: {moved}): {after:?}"
    );
    let (peer_ifindex, node2_mac) = rig
        .topo
        .node
        .run(|| {
            let idx = nix::net::if_::if_nametoindex(NODE_PEER_IF).unwrap();
            let neigh = std::process::Command::new("ip")
                .args(["neigh", "show", &NODE2_IP.to_string(), "dev", NODE_PEER_IF])
                .output()
                .unwrap();
            (idx, String::from_utf8_lossy(&neigh.stdout).to_string())
        })
        .unwrap();
    let entries = backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID);
    assert!(!entries.is_empty(), "a CPU cached the backend's route");
    for e in &entries {
        assert_eq!(
            e.backend,
            u32::from_ne_bytes(rig.topo.pod("pod-r0").ip.octets())
        );
        assert_eq!(u32::from(e.fwd.out_ifindex), peer_ifindex, "{e:?}");
        assert_eq!(e.snat_addr, u32::from_ne_bytes(NODE_LINK_IP.octets()));
        assert!(
            node2_mac.contains(&mac_str(&e.fwd.eth[..6])),
            "next hop MAC {} is node2's ({node2_mac})",
            mac_str(&e.fwd.eth[..6])
        );
    }
    drop(conns);
}

/// A neighbour change moves the generation: the next new flow to the backend looks its route
/// up again and leaves with the new next-hop MAC (and is lost, as the kernel's forwarding
/// would lose it, until the neighbour is restored and its SYN is retransmitted), instead of
/// the cached one.
#[test]
fn new_flows_look_their_route_up_again_after_a_neighbour_change() {
    if !require_root() {
        return;
    }
    const BOGUS_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x98];
    let mut rig = Rig::new("xdp-beneigh");
    rig.attach_xdp();
    rig.warm_neighbours();
    let _conns = open_remote(&rig, 2);
    let entries = backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID);
    assert!(!entries.is_empty(), "the backend's route is cached");
    let node2_mac = entries[0].fwd.eth[..6].to_vec();
    let node = &rig.topo.node;
    let node2_ip = NODE2_IP.to_string();
    let neigh = |mac: &[u8]| {
        node.ip(&[
            "neigh",
            "replace",
            &node2_ip,
            "lladdr",
            &mac_str(mac),
            "dev",
            NODE_PEER_IF,
            "nud",
            "permanent",
        ])
        .unwrap();
    };
    let generation = fwd_gen(&rig.ebpf);
    neigh(&BOGUS_MAC);
    let gen2 = wait_gen_moved(&rig.ebpf, generation);
    assert_ne!(
        gen2, generation,
        "the neighbour change moved the generation"
    );
    std::thread::scope(|s| {
        let client = &rig.topo.client;
        let opened = s.spawn(move || Conn::open(client, REMOTE_PORT));
        let refilled = eventually(|| {
            backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID)
                .iter()
                .any(|e| e.fwd.eth[..6] == BOGUS_MAC)
        });
        let entries = backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID);
        neigh(&node2_mac);
        assert!(
            refilled,
            "the new flow looked its route up under the new generation: {entries:?}"
        );
        // Restored: the SYN's retransmission reaches the backend.
        let c = opened.join().unwrap();
        assert_snat(&c);
    });
    // And the next new flow's lookup finds node2 again (filled after the restore).
    wait_gen_moved(&rig.ebpf, gen2);
    let _more = open_remote(&rig, 1);
    let entries = backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID);
    assert!(
        entries.iter().any(|e| e.fwd.eth[..6] == node2_mac[..]
            && e.fwd.generation != generation
            && e.fwd.generation != gen2),
        "{entries:?}"
    );
}

/// With a policy rule that selects by source (routing may then depend on the client), the
/// per-backend cache is off: every new flow looks its route up (`new_flow_cached` stays 0)
/// and is still forwarded by XDP; with the rule gone, the cache is on again; a multipath
/// route turns it off as well.
#[test]
fn a_source_policy_rule_turns_the_per_backend_cache_off() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-berule");
    rig.attach_xdp();
    rig.warm_neighbours();
    assert!(per_backend_allowed(&rig.ebpf));
    let node = &rig.topo.node;
    let client = CLIENT_IP.to_string();
    node.ip(&[
        "rule", "add", "from", &client, "lookup", "main", "pref", "100",
    ])
    .unwrap();
    assert!(
        eventually(|| !per_backend_allowed(&rig.ebpf)),
        "a source rule turns the per-backend cache off"
    );
    let before = rig.stats();
    let _conns = open_remote(&rig, BATCH);
    let after = rig.stats();
    assert!(
        after.xdp_delta(&before, "new_flow") >= BATCH as u64,
        "{after:?}"
    );
    assert!(
        after.xdp_delta(&before, "forward") >= BATCH as u64,
        "{after:?}"
    );
    assert_eq!(
        after.xdp_delta(&before, "new_flow_cached"),
        0,
        "{after:?} vs {before:?}"
    );
    node.ip(&["rule", "del", "pref", "100"]).unwrap();
    assert!(
        eventually(|| per_backend_allowed(&rig.ebpf)),
        "default rules again: the cache is allowed"
    );
    let before = rig.stats();
    let _more = open_remote(&rig, BATCH);
    let after = rig.stats();
    assert!(
        after.xdp_delta(&before, "new_flow_cached") >= 1,
        "{after:?} vs {before:?}"
    );
    // A multipath route anywhere (its next hop is hashed from the source): off again.
    let (node2_ip, client) = (NODE2_IP.to_string(), CLIENT_IP.to_string());
    node.ip(&[
        "route",
        "add",
        "10.99.0.0/24",
        "nexthop",
        "via",
        &node2_ip,
        "nexthop",
        "via",
        &client,
    ])
    .unwrap();
    assert!(
        eventually(|| !per_backend_allowed(&rig.ebpf)),
        "a multipath route turns the per-backend cache off"
    );
    node.ip(&["route", "del", "10.99.0.0/24"]).unwrap();
    assert!(eventually(|| per_backend_allowed(&rig.ebpf)));
}

/// Rewriting the node addresses (`KP_NODE_ADDR4`, the SNAT source per device; the agent's
/// address watcher polls, so this may come after the announcement) moves the generation: the
/// next new flow takes its SNAT source from the new table, not from the backend's cached
/// route. (The new source is no address of the node; node2 reaches it through a permanent
/// neighbour entry toward the node, whose XDP translates the replies from the flow's
/// `SnatIn` entry.)
#[test]
fn new_flows_take_a_rewritten_node_address() {
    if !require_root() {
        return;
    }
    const OTHER: std::net::Ipv4Addr = std::net::Ipv4Addr::new(192, 168, 78, 77);
    // One CPU sends (and so runs the node's XDP for) every client packet: the flows below
    // share one per-CPU cache entry.
    let mut cpu = nix::sched::CpuSet::new();
    cpu.set(0).unwrap();
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &cpu).unwrap();
    let mut rig = Rig::new("xdp-beaddr");
    rig.attach_xdp();
    rig.warm_neighbours();
    let before = rig.stats();
    let _conns = open_remote(&rig, 2);
    assert!(
        rig.stats().xdp_delta(&before, "new_flow_cached") >= 1,
        "the second flow used the first one's route"
    );
    let entries = backend_fwd(&rig.ebpf, REMOTE_BACKEND_ID);
    assert_eq!(entries.len(), 1, "one CPU cached the route: {entries:?}");
    assert_eq!(
        entries[0].snat_addr,
        u32::from_ne_bytes(NODE_LINK_IP.octets())
    );
    let node_mac = mac_str(&entries[0].fwd.eth[6..]);
    let node2 = rig.topo.node2.as_ref().unwrap();
    node2
        .ip(&[
            "neigh",
            "replace",
            &OTHER.to_string(),
            "lladdr",
            &node_mac,
            "dev",
            PEER_IF,
            "nud",
            "permanent",
        ])
        .unwrap();
    let (client_if, peer_if) = rig
        .topo
        .node
        .run(|| {
            (
                nix::net::if_::if_nametoindex(NODE_CLIENT_IF).unwrap(),
                nix::net::if_::if_nametoindex(NODE_PEER_IF).unwrap(),
            )
        })
        .unwrap();
    TcPath::set_node_addresses(&mut rig.ebpf, &[(client_if, NODE_IP), (peer_if, OTHER)]).unwrap();
    let c = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_eq!(c.backend, "pod-r0");
    assert_eq!(*c.peer_seen.ip(), OTHER, "SNAT source: {}", c.peer_seen);
}

/// Every entry of the flow whose `Service` entry is the client's from port `cport`: the
/// entries sharing its creation time and backend (how the agent's expiry groups a flow).
fn flow_entries(ebpf: &Ebpf, cport: u16) -> Vec<(CtKey, CtEntry)> {
    let svc = service_entry(ebpf, cport);
    let mut v = entries_created_at(ebpf, svc.created_ns);
    v.retain(|(_, e)| e.backend_id == svc.backend_id);
    v.sort_by_key(|(k, _)| k.kind);
    v
}

/// Every connection-table entry created at `created` (the entries of one flow).
fn entries_created_at(ebpf: &Ebpf, created: u64) -> Vec<(CtKey, CtEntry)> {
    let ct: BpfHashMap<&MapData, CtKey, CtEntry> =
        BpfHashMap::try_from(ebpf.map(MAP_CT).expect("KP_CT")).unwrap();
    ct.iter()
        .map(Result::unwrap)
        .filter(|(_, e)| e.created_ns == created)
        .collect()
}

fn kinds(entries: &[(CtKey, CtEntry)]) -> Vec<u8> {
    entries.iter().map(|(k, _)| k.kind).collect()
}

fn be32(ip: std::net::Ipv4Addr) -> u32 {
    u32::from_ne_bytes(ip.octets())
}

/// A flow the fast path starts gets two connection-table entries, not three
/// (`kproxy_common::ct::CT_F_NO_REV`): its `Service` entry holds the SNAT source, its `SnatIn`
/// entry the frontend, and both directions are translated from them. Once XDP is gone, the
/// first packets through TC create the `RevDnat` entry TC egress needs — from the `Service`
/// entry going out, from the `SnatIn` entry coming back — with the same translation.
#[test]
fn an_xdp_flow_gets_its_reverse_entry_only_when_tc_needs_it() {
    if !require_root() {
        return;
    }
    let mut rig = Rig::new("xdp-norev");
    rig.warm_neighbours();
    rig.attach_xdp();
    let before = rig.stats();
    let mut c = Conn::open(&rig.topo.client, REMOTE_PORT);
    assert_snat(&c);
    c.exchange(3);
    let after = rig.stats();
    assert_eq!(after.xdp_delta(&before, "new_flow"), 1, "{after:?}");
    assert_eq!(after.tc_translated(&before), 0, "{after:?}");
    let cport = c.stream.get_ref().local_addr().unwrap().port();
    let (snat, np) = (*c.peer_seen.ip(), c.peer_seen.port());
    let remote = rig.topo.pod("pod-r0").ip;

    let e = flow_entries(&rig.ebpf, cport);
    let (svc, snat_in) = (CtKind::Service as u8, CtKind::SnatIn as u8);
    assert_eq!(kinds(&e), [svc, snat_in], "{e:?}");
    let (_, s) = e[0];
    assert_ne!(s.flags & CT_F_NO_REV, 0, "{s:?}");
    assert_eq!((s.nat_addr, s.nat_port), (be32(remote), POD_PORT.to_be()));
    assert_eq!((s.snat_addr, s.snat_port), (be32(snat), np.to_be()));
    let (k, i) = e[1];
    assert_eq!((k.saddr, k.sport), (be32(remote), POD_PORT.to_be()));
    assert_eq!((k.daddr, k.dport), (be32(snat), np.to_be()));
    assert_eq!((i.nat_addr, i.nat_port), (be32(CLIENT_IP), cport.to_be()));
    assert_eq!(
        (i.snat_addr, i.snat_port),
        (be32(NODE_IP), REMOTE_PORT.to_be())
    );
    assert_ne!(i.flags & CT_F_NO_REV, 0, "{i:?}");

    rig.detach_xdp();
    let before = rig.stats();
    c.exchange(3);
    let after = rig.stats();
    assert!(after.tc_delta(&before, "snat") >= 3, "{after:?}");
    assert!(after.tc_delta(&before, "reply") >= 6, "{after:?}");
    let e = flow_entries(&rig.ebpf, cport);
    let rev = CtKind::RevDnat as u8;
    assert_eq!(kinds(&e), [svc, rev, snat_in], "{e:?}");
    let (k, r) = e[1];
    assert_eq!((k.saddr, k.sport), (be32(remote), POD_PORT.to_be()));
    assert_eq!((k.daddr, k.dport), (be32(CLIENT_IP), cport.to_be()));
    assert_eq!(
        (r.nat_addr, r.nat_port),
        (be32(NODE_IP), REMOTE_PORT.to_be())
    );
    assert_eq!((r.snat_addr, r.snat_port), (be32(snat), np.to_be()));
    assert_eq!(
        r.flags & (CT_F_SNAT_HERE | CT_F_NO_REV),
        CT_F_SNAT_HERE,
        "{r:?}"
    );
    for (k, x) in [e[0], e[2]] {
        assert_eq!(x.flags & CT_F_NO_REV, 0, "cleared in {k:?}: {x:?}");
    }
}

/// An ICMP error about a flow the fast path started (no `RevDnat` entry yet) reaches the
/// client translated: a datagram to a NodePort whose backend has nothing listening on its
/// port is forwarded by XDP; the backend's port unreachable comes back to the SNAT source,
/// XDP passes it (ICMP), TC ingress gives it back its client through the `SnatIn` entry and
/// creates the `RevDnat` entry from it, with which TC egress names the frontend in the quote
/// and as sender — so the client's connected socket sees "connection refused".
#[test]
fn icmp_errors_about_an_xdp_started_flow_reach_the_client_translated() {
    if !require_root() {
        return;
    }
    const CLOSED_PORT: u16 = 30082;
    const NOBODY: u16 = 9;
    let mut rig = Rig::new("xdp-icmp");
    let remote = rig.topo.pod("pod-r0").ip;
    backend(&mut rig.ebpf, 3, remote, NOBODY, 0);
    slots(&mut rig.ebpf, 3, &[3]);
    for scope in [SCOPE_CLUSTER, SCOPE_EXTERNAL] {
        frontend(
            &mut rig.ebpf,
            NODE_IP,
            CLOSED_PORT,
            PROTO_UDP,
            scope,
            service(0, 3, 1),
        );
    }
    rig.warm_neighbours();
    rig.attach_xdp();
    let before = rig.stats();
    let refused = rig
        .topo
        .client
        .run(|| {
            let sock = UdpSocket::bind((CLIENT_IP, 0)).unwrap();
            sock.connect((NODE_IP, CLOSED_PORT)).unwrap();
            sock.set_read_timeout(Some(LIVENESS)).unwrap();
            sock.send(b"anyone?").unwrap();
            let mut buf = [0u8; 64];
            (sock.recv(&mut buf), sock.local_addr().unwrap().port())
        })
        .unwrap();
    let after = rig.stats();
    let (result, cport) = refused;
    assert_eq!(
        result.map_err(|e| e.kind()),
        Err(std::io::ErrorKind::ConnectionRefused),
        "{after:?}"
    );
    assert_eq!(after.xdp_delta(&before, "new_flow"), 1, "{after:?}");
    assert_eq!(after.xdp_delta(&before, "forward"), 1, "{after:?}");
    assert!(after.tc_delta(&before, "icmp_error") >= 2, "{after:?}");
    let e = flow_entries(&rig.ebpf, cport);
    assert!(
        e.iter().any(|(k, _)| k.kind == CtKind::RevDnat as u8),
        "adopted: {e:?}"
    );
}

/// A client reusing its port after a reset gets a new flow, and the old flow started by the
/// fast path (no `RevDnat` entry) leaves nothing behind: its `SnatIn` entry, found through the
/// SNAT source its `Service` entry holds, goes with it (`crate::flow::end_flow`).
#[test]
fn a_reopened_xdp_flow_leaves_no_entry_behind() {
    if !require_root() {
        return;
    }
    const CPORT: u16 = 43_210;
    let mut rig = Rig::new("xdp-reopen");
    rig.warm_neighbours();
    rig.attach_xdp();
    let mut old = Conn::open_from(&rig.topo.client, CPORT, REMOTE_PORT);
    assert_snat(&old);
    old.exchange(1);
    let created = service_entry(&rig.ebpf, CPORT).created_ns;
    assert_eq!(flow_entries(&rig.ebpf, CPORT).len(), 2);
    old.reset();
    let before = rig.settled_stats();
    let mut new = Conn::open_from(&rig.topo.client, CPORT, REMOTE_PORT);
    assert_snat(&new);
    new.exchange(1);
    let after = rig.stats();
    assert_eq!(after.xdp_delta(&before, "new_flow"), 1, "{after:?}");
    let left = entries_created_at(&rig.ebpf, created);
    assert!(left.is_empty(), "the old flow's entries: {left:?}");
    let e = flow_entries(&rig.ebpf, CPORT);
    assert_eq!(
        kinds(&e),
        [CtKind::Service as u8, CtKind::SnatIn as u8],
        "{e:?}"
    );
}

/// [`a_reopened_xdp_flow_leaves_no_entry_behind`] when only the replies went through TC: XDP
/// on the client's link alone (node2's link a fast-path device for the frames it sends out,
/// but without `kp_xdp`), so the flow starts in XDP, its replies reach TC ingress, which
/// creates its `RevDnat` entry from the `SnatIn` entry, while its `Service` entry keeps
/// `CT_F_NO_REV`. Reopening the tuple (toward another backend) must delete that `RevDnat`
/// entry too.
#[test]
fn a_reopened_xdp_flow_whose_replies_took_tc_leaves_no_entry_behind() {
    if !require_root() {
        return;
    }
    const CPORT: u16 = 43_211;
    let mut rig = Rig::new("xdp-reopen-tc");
    rig.warm_neighbours();
    rig.attach_xdp_to(&[NODE_CLIENT_IF], &[NODE_CLIENT_IF, NODE_PEER_IF]);
    let before = rig.stats();
    let mut old = Conn::open_from(&rig.topo.client, CPORT, REMOTE_PORT);
    assert_snat(&old);
    old.exchange(2);
    let after = rig.stats();
    assert_eq!(after.xdp_delta(&before, "new_flow"), 1, "{after:?}");
    assert!(after.tc_delta(&before, "reply") >= 3, "{after:?}");
    let created = service_entry(&rig.ebpf, CPORT).created_ns;
    let e = flow_entries(&rig.ebpf, CPORT);
    let rev = CtKind::RevDnat as u8;
    assert_eq!(
        kinds(&e),
        [CtKind::Service as u8, rev, CtKind::SnatIn as u8],
        "the replies' RevDnat entry: {e:?}"
    );
    assert_ne!(e[0].1.flags & CT_F_NO_REV, 0, "{e:?}");
    old.reset();
    rig.settled_stats();
    // The service now goes to the local pod: the new flow's entries have other keys than the
    // old flow's, so none of them can hide a leftover by overwriting it.
    slots(&mut rig.ebpf, 1, &[2]);
    let mut new = Conn::open_from(&rig.topo.client, CPORT, REMOTE_PORT);
    assert_eq!(new.backend, "pod-l0");
    new.exchange(1);
    let left = entries_created_at(&rig.ebpf, created);
    assert!(left.is_empty(), "the old flow's entries: {left:?}");
}
