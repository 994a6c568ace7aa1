//! Socket-level load balancing on this kernel: the real `EbpfDataplane` (pinned maps on a
//! private bpffs, socket-LB programs on pinned links attached to a test cgroup) programmed from
//! snapshots, and real client processes in that cgroup connecting to service VIPs.
//!
//! Layout: one network namespace `pods` whose `lo` holds the backend addresses
//! (10.210.0.{1,2,3}, fd10::{1,2,3}); a TCP and a UDP server per backend (threads of this test
//! process, outside the test cgroup) answer with the backend's name. Clients are `python3`
//! processes started inside the namespace and the test cgroup (so only they are translated);
//! they report who answered, the errors they saw and the peer addresses the kernel reported.
//! VIPs need no route: socket LB rewrites the destination before routing.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::{EbpfConfig, EbpfDataplane, MapSizes};
use kproxy::model::{
    ChangedSet, Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName, ServiceType, Snapshot,
};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, MAP_AFFINITY, MAP_BACKEND_SLOTS,
    MAP_BACKENDS, MAP_SERVICES, ServiceKey, ServiceValue,
};
use kproxy_tests::netns::{Bpffs, Netns, TestCgroup, require_root};
use serde::Deserialize;

const PORT: u16 = 8080;
const TARGET_PORT: u16 = 9090;
const BACKENDS_V4: [&str; 3] = ["10.210.0.1", "10.210.0.2", "10.210.0.3"];
const BACKENDS_V6: [&str; 3] = ["fd10::1", "fd10::2", "fd10::3"];
const VIP_V4: &str = "10.96.7.7";
const VIP_V6: &str = "fd00:96::7";
const CONNECTIONS: usize = 300;

/// The client: `python3 -c CLIENT MODE FAMILY VIP PORT N`. Modes: `tcp`/`udp` (N fresh
/// sockets, one request each; prints one JSON summary), `hold` (one TCP connection, then one
/// request per stdin line, each answer printed as a line).
const CLIENT: &str = r#"
import socket, sys, json, errno
mode, fam, vip, port, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
af = socket.AF_INET if fam == '4' else socket.AF_INET6
def name_of(ip):
    return ip
if mode == 'hold':
    s = socket.socket(af, socket.SOCK_STREAM); s.settimeout(10)
    s.connect((vip, port))
    print(s.recv(64).decode(), flush=True)
    for line in sys.stdin:
        s.sendall(b'ping')
        print(s.recv(64).decode(), flush=True)
    sys.exit(0)
counts, errors, peers, order = {}, {}, set(), []
for i in range(n):
    try:
        if mode == 'tcp':
            s = socket.socket(af, socket.SOCK_STREAM); s.settimeout(10)
            s.connect((vip, port)); peers.add(s.getpeername()[0]); name = s.recv(64).decode()
        else:
            s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(10)
            s.sendto(b'x', (vip, port)); data, src = s.recvfrom(64); peers.add(src[0]); name = data.decode()
        s.close()
        counts[name] = counts.get(name, 0) + 1
        order.append(name)
    except OSError as e:
        k = errno.errorcode.get(e.errno, str(e.errno)); errors[k] = errors.get(k, 0) + 1
print(json.dumps({'counts': counts, 'errors': errors, 'peers': sorted(peers), 'order': order}))
"#;

#[derive(Debug, Deserialize)]
struct Summary {
    counts: BTreeMap<String, usize>,
    errors: BTreeMap<String, usize>,
    peers: Vec<String>,
    order: Vec<String>,
}

/// The sandbox of one test: namespace, servers, bpffs, cgroup.
struct Rig {
    pods: Netns,
    cgroup: TestCgroup,
    bpffs: Bpffs,
}

impl Rig {
    fn new(test: &str) -> Rig {
        let pods = Netns::new(&format!("{test}-pods")).unwrap();
        for ip in BACKENDS_V4 {
            pods.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"])
                .unwrap();
        }
        for ip in BACKENDS_V6 {
            pods.ip(&[
                "-6",
                "addr",
                "add",
                &format!("{ip}/128"),
                "dev",
                "lo",
                "nodad",
            ])
            .unwrap();
        }
        for ip in BACKENDS_V4.iter().chain(BACKENDS_V6.iter()) {
            let addr = SocketAddr::new(ip.parse().unwrap(), TARGET_PORT);
            let name = ip.to_string();
            let tcp = pods.run(move || TcpListener::bind(addr)).unwrap().unwrap();
            let udp = pods.run(move || UdpSocket::bind(addr)).unwrap().unwrap();
            serve_tcp(tcp, name.clone());
            serve_udp(udp, name);
        }
        Rig {
            pods,
            cgroup: TestCgroup::new(&format!("{test}-cg")).unwrap(),
            bpffs: Bpffs::new(&format!("{test}-fs")).unwrap(),
        }
    }

    fn config(&self) -> EbpfConfig {
        EbpfConfig {
            bpffs: self.bpffs.path().to_path_buf(),
            cgroup: Some(self.cgroup.path().to_path_buf()),
            map_sizes: MapSizes {
                services: 8192,
                backend_slots: 16384,
                backends: 8192,
                affinity: 1024,
                source_ranges: 256,
                sock_rev_nat: 4096,
            },
            ..EbpfConfig::default()
        }
    }

    fn client(&self, mode: &str, vip: &str, port: u16, n: usize) -> Command {
        let family = if vip.contains(':') { "6" } else { "4" };
        let mut cmd = self.pods.command("/usr/bin/python3");
        cmd.args([
            "-c",
            CLIENT,
            mode,
            family,
            vip,
            &port.to_string(),
            &n.to_string(),
        ]);
        self.cgroup.enter_on_spawn(&mut cmd).unwrap();
        cmd
    }

    fn run_client(&self, mode: &str, vip: &str, n: usize) -> Summary {
        let out = self.client(mode, vip, PORT, n).output().unwrap();
        assert!(
            out.status.success(),
            "client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "client output {:?}: {e}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    }

    fn map<K: aya::Pod, V: aya::Pod>(&self, name: &str) -> BTreeMap<Vec<u8>, V>
    where
        K: Copy,
    {
        let data = MapData::from_pin(self.bpffs.path().join("kproxy").join(name)).unwrap();
        let map: BpfHashMap<MapData, K, V> =
            BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
        map.iter()
            .map(|kv| {
                let (k, v) = kv.unwrap();
                (pod_bytes(&k), v)
            })
            .collect()
    }
}

fn pod_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: reading the bytes of a padding-free #[repr(C)] Pod value.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

fn serve_tcp(listener: TcpListener, name: String) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let name = name.clone();
            std::thread::spawn(move || {
                if conn.write_all(name.as_bytes()).is_err() {
                    return;
                }
                let mut buf = [0u8; 64];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(name.as_bytes()).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

fn serve_udp(socket: UdpSocket, name: String) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok((_, from)) = socket.recv_from(&mut buf) {
            let _ = socket.send_to(name.as_bytes(), from);
        }
    });
}

fn port_name(name: &str, protocol: Protocol) -> ServicePortName {
    ServicePortName {
        namespace: "default".into(),
        name: name.into(),
        port: "p".into(),
        protocol,
    }
}

fn service(name: &str, protocol: Protocol, vips: &[&str], affinity: Option<u32>) -> ServicePort {
    ServicePort {
        name: port_name(name, protocol),
        service_type: ServiceType::ClusterIp,
        cluster_ips: vips.iter().map(|v| v.parse().unwrap()).collect(),
        port: PORT,
        protocol,
        node_port: 0,
        external_ips: vec![],
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        external_policy_local: false,
        internal_policy_local: false,
        health_check_node_port: 0,
        session_affinity_timeout: affinity,
    }
}

fn endpoint(ip: &str) -> Endpoint {
    Endpoint {
        ip: ip.parse().unwrap(),
        port: TARGET_PORT,
        ready: true,
        serving: true,
        terminating: false,
        is_local: true,
        node_name: Some("node".into()),
        zone: None,
        zone_hints: BTreeSet::new(),
        node_hints: BTreeSet::new(),
    }
}

fn snapshot(services: Vec<(ServicePort, Vec<Endpoint>)>) -> Snapshot {
    let mut snap = Snapshot {
        generation: 1,
        node: NodeInfo {
            name: "node".into(),
            ..NodeInfo::default()
        },
        ..Snapshot::default()
    };
    for (svc, eps) in services {
        snap.endpoints.insert(svc.name.clone(), Arc::new(eps));
        snap.services.insert(svc.name.clone(), Arc::new(svc));
    }
    snap
}

fn all_backends() -> Vec<Endpoint> {
    BACKENDS_V4
        .iter()
        .chain(BACKENDS_V6.iter())
        .map(|ip| endpoint(ip))
        .collect()
}

fn sync(dp: &mut EbpfDataplane, snap: &Snapshot) {
    let report = dp.sync(snap, &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0, "{report:?}");
}

/// Each backend of `backends` answered between half and twice its fair share of `total`.
fn assert_spread(summary: &Summary, backends: &[&str], total: usize) {
    assert!(summary.errors.is_empty(), "errors: {:?}", summary.errors);
    let fair = total / backends.len();
    for b in backends {
        let got = summary.counts.get(*b).copied().unwrap_or(0);
        assert!(
            got >= fair / 2 && got <= fair * 2,
            "backend {b} answered {got} of {total} (fair share {fair}): {:?}",
            summary.counts
        );
    }
    assert_eq!(
        summary.counts.values().sum::<usize>(),
        total,
        "{:?}",
        summary.counts
    );
    let known: BTreeSet<&str> = backends.iter().copied().collect();
    assert!(
        summary.counts.keys().all(|k| known.contains(k.as_str())),
        "{:?}",
        summary.counts
    );
}

fn check_family(proto: Protocol, mode: &str, vip: &str, backends: &[&str]) {
    let test = format!("sock-{mode}-{}", if vip.contains(':') { 6 } else { 4 });
    let rig = Rig::new(&test);
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    let snap = snapshot(vec![(
        service("web", proto, &[VIP_V4, VIP_V6], None),
        all_backends(),
    )]);
    sync(&mut dp, &snap);
    let summary = rig.run_client(mode, vip, CONNECTIONS);
    assert_spread(&summary, backends, CONNECTIONS);
    // getpeername (TCP) / recvfrom (UDP) report the VIP, never a backend.
    let vip_ip: IpAddr = vip.parse().unwrap();
    assert_eq!(summary.peers, vec![vip_ip.to_string()], "{summary:?}");
    dp.cleanup().unwrap();
}

#[test]
fn pod_to_cluster_ip_tcp_v4_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Tcp, "tcp", VIP_V4, &BACKENDS_V4);
}

#[test]
fn pod_to_cluster_ip_tcp_v6_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Tcp, "tcp", VIP_V6, &BACKENDS_V6);
}

#[test]
fn pod_to_cluster_ip_udp_v4_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Udp, "udp", VIP_V4, &BACKENDS_V4);
}

#[test]
fn pod_to_cluster_ip_udp_v6_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Udp, "udp", VIP_V6, &BACKENDS_V6);
}

/// Dumps `MAP_AFFINITY` as (svc_id, backend id, last used).
fn affinity_entries(rig: &Rig) -> Vec<(AffinityKey, AffinityValue)> {
    let data = MapData::from_pin(rig.bpffs.path().join("kproxy").join(MAP_AFFINITY)).unwrap();
    let map: BpfHashMap<MapData, AffinityKey, AffinityValue> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    map.iter().filter_map(Result::ok).collect()
}

/// Backend id → address, from `MAP_BACKENDS`.
fn backend_ids(rig: &Rig) -> BTreeMap<u32, IpAddr> {
    let data = MapData::from_pin(rig.bpffs.path().join("kproxy").join(MAP_BACKENDS)).unwrap();
    let map: BpfHashMap<MapData, u32, BackendValue> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    map.iter()
        .map(|kv| {
            let (id, b) = kv.unwrap();
            (id, kproxy::dataplane::ebpf::planner::decode_addr(b.addr))
        })
        .collect()
}

#[test]
fn no_endpoints_refuses_connections_at_once() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-noep");
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    let snap = snapshot(vec![
        (
            service("empty", Protocol::Tcp, &[VIP_V4, VIP_V6], None),
            vec![],
        ),
        (
            service("empty", Protocol::Udp, &[VIP_V4, VIP_V6], None),
            vec![],
        ),
    ]);
    sync(&mut dp, &snap);
    for (mode, vip) in [
        ("tcp", VIP_V4),
        ("tcp", VIP_V6),
        ("udp", VIP_V4),
        ("udp", VIP_V6),
    ] {
        let summary = rig.run_client(mode, vip, 3);
        assert!(summary.counts.is_empty(), "{mode} {vip}: {summary:?}");
        assert_eq!(
            summary.errors,
            BTreeMap::from([("ECONNREFUSED".to_string(), 3)]),
            "{mode} {vip}"
        );
    }
    dp.cleanup().unwrap();
}

#[test]
fn affinity_holds_a_client_until_the_timeout() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-aff");
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    let snap = snapshot(vec![(
        service("sticky", Protocol::Tcp, &[VIP_V4], Some(1)),
        all_backends(),
    )]);
    sync(&mut dp, &snap);

    // Within the timeout every connection of the client lands on one backend.
    let summary = rig.run_client("tcp", VIP_V4, 50);
    assert!(summary.errors.is_empty(), "{summary:?}");
    assert_eq!(
        summary.counts.len(),
        1,
        "affinity broken: {:?}",
        summary.counts
    );
    let first = summary.order[0].clone();
    let entries = affinity_entries(&rig);
    assert_eq!(entries.len(), 1, "{entries:?}");
    let ids = backend_ids(&rig);
    assert_eq!(ids[&entries[0].1.backend_id].to_string(), first);

    // After the timeout the entry is expired: a sync removes it, and new connections are
    // balanced again (each round waits out the timeout, so each is a fresh choice).
    std::thread::sleep(Duration::from_millis(1500));
    sync(&mut dp, &snap);
    assert!(
        affinity_entries(&rig).is_empty(),
        "expired entry left in the map"
    );
    let mut seen = BTreeSet::new();
    for _ in 0..15 {
        let s = rig.run_client("tcp", VIP_V4, 1);
        assert!(s.errors.is_empty(), "{s:?}");
        seen.extend(s.counts.into_keys());
        if seen.len() >= 2 {
            break;
        }
        std::thread::sleep(Duration::from_millis(1100));
    }
    assert!(seen.len() >= 2, "only {seen:?} after expiries");
    dp.cleanup().unwrap();
}

#[test]
fn removed_endpoint_gets_no_new_flows_and_loses_its_affinity_entries() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-rm");
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    let svc = service("shrink", Protocol::Tcp, &[VIP_V4], Some(600));
    sync(&mut dp, &snapshot(vec![(svc.clone(), all_backends())]));
    let summary = rig.run_client("tcp", VIP_V4, 5);
    assert_eq!(summary.counts.len(), 1, "{summary:?}");
    let victim = summary.order[0].clone();
    let entries = affinity_entries(&rig);
    assert_eq!(entries.len(), 1);
    let victim_id = entries[0].1.backend_id;

    // Remove the backend the client is held on.
    let remaining: Vec<Endpoint> = all_backends()
        .into_iter()
        .filter(|e| e.ip.to_string() != victim)
        .collect();
    sync(&mut dp, &snapshot(vec![(svc.clone(), remaining)]));
    assert!(
        affinity_entries(&rig)
            .iter()
            .all(|(_, v)| v.backend_id != victim_id),
        "affinity entry of the removed backend survived"
    );
    assert!(!backend_ids(&rig).contains_key(&victim_id));

    // Without affinity to compare fairly: new flows spread over the rest, never the victim.
    let plain = service("shrink", Protocol::Tcp, &[VIP_V4], None);
    let rest: Vec<&str> = BACKENDS_V4
        .iter()
        .copied()
        .filter(|b| *b != victim)
        .collect();
    let remaining: Vec<Endpoint> = all_backends()
        .into_iter()
        .filter(|e| e.ip.to_string() != victim)
        .collect();
    sync(&mut dp, &snapshot(vec![(plain, remaining)]));
    let summary = rig.run_client("tcp", VIP_V4, CONNECTIONS);
    assert!(!summary.counts.contains_key(&victim), "{summary:?}");
    assert_spread(&summary, &rest, CONNECTIONS);
    dp.cleanup().unwrap();
}

type Dump = (
    BTreeMap<Vec<u8>, ServiceValue>,
    BTreeMap<Vec<u8>, u32>,
    BTreeMap<Vec<u8>, BackendValue>,
);

fn dump(rig: &Rig) -> Dump {
    (
        rig.map::<ServiceKey, ServiceValue>(MAP_SERVICES),
        rig.map::<BackendSlotKey, u32>(MAP_BACKEND_SLOTS),
        rig.map::<u32, BackendValue>(MAP_BACKENDS),
    )
}

fn changed_keys<V: PartialEq>(a: &BTreeMap<Vec<u8>, V>, b: &BTreeMap<Vec<u8>, V>) -> Vec<Vec<u8>> {
    a.keys()
        .chain(b.keys())
        .filter(|k| a.get(*k) != b.get(*k))
        .cloned()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[test]
fn changing_one_of_1000_services_touches_only_its_entries() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-1000");
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    let make = |changed: bool| {
        let services = (0..1000u32)
            .map(|i| {
                let vip = format!("10.97.{}.{}", i / 250, i % 250 + 1);
                let svc = service(&format!("s{i}"), Protocol::Tcp, &[vip.as_str()], None);
                let mut eps = vec![
                    endpoint(&format!("10.211.{}.{}", i / 250, i % 250 + 1)),
                    endpoint(&format!("10.212.{}.{}", i / 250, i % 250 + 1)),
                ];
                if changed && i == 500 {
                    eps.push(endpoint("10.213.0.1"));
                    eps.remove(0);
                }
                (svc, eps)
            })
            .collect();
        snapshot(services)
    };
    sync(&mut dp, &make(false));
    let before = dump(&rig);
    assert_eq!(before.0.len(), 1000);
    assert_eq!(before.1.len(), 2000);
    assert_eq!(before.2.len(), 2000);
    sync(&mut dp, &make(true));
    let after = dump(&rig);

    // The service's frontend (same key, same value: still 2 slots), two slots (new backend
    // ids), and the backends (one gone, one new) changed; nothing else.
    let svc_id = {
        let key = ServiceKey {
            addr: kproxy::dataplane::ebpf::planner::encode_addr("10.97.2.1".parse().unwrap()),
            port: PORT.to_be(),
            proto: 6,
            scope: 0,
        };
        after.0[&pod_bytes(&key)].svc_id
    };
    assert!(
        changed_keys(&before.0, &after.0).is_empty(),
        "frontends changed"
    );
    let slots = changed_keys(&before.1, &after.1);
    assert!(!slots.is_empty());
    for k in &slots {
        let id = u32::from_ne_bytes(k[0..4].try_into().unwrap());
        assert_eq!(id, svc_id, "slot of another set changed: {k:?}");
    }
    let backends = changed_keys(&before.2, &after.2);
    let gone: BTreeSet<IpAddr> =
        ["10.211.2.1".parse().unwrap(), "10.213.0.1".parse().unwrap()].into();
    assert_eq!(backends.len(), 2, "{backends:?}");
    for k in &backends {
        let v = before.2.get(k).or(after.2.get(k)).unwrap();
        let ip = kproxy::dataplane::ebpf::planner::decode_addr(v.addr);
        assert!(gone.contains(&ip), "backend {ip} changed");
    }
    dp.cleanup().unwrap();
}

#[test]
fn restarted_agent_reuses_pinned_links_and_keeps_connections() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-restart");
    let snap = snapshot(vec![(
        service("web", Protocol::Tcp, &[VIP_V4], None),
        all_backends(),
    )]);
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    sync(&mut dp, &snap);
    let links: Vec<(&str, u32)> = dp.link_ids().to_vec();
    assert_eq!(links.len(), kproxy_common::sock::PROGRAMS.len());

    let mut hold = rig
        .client("hold", VIP_V4, PORT, 0)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = hold.stdin.take().unwrap();
    let mut lines = BufReader::new(hold.stdout.take().unwrap()).lines();
    let backend = lines.next().unwrap().unwrap();
    assert!(BACKENDS_V4.contains(&backend.as_str()), "{backend}");
    let before = dump(&rig);

    // kill -9 of the agent: the object is dropped without cleanup.
    drop(dp);
    let mut dp = EbpfDataplane::new(rig.config()).unwrap();
    assert_eq!(dp.link_ids(), links.as_slice(), "links were not reused");
    sync(&mut dp, &snap);
    assert_eq!(dump(&rig), before, "the restart changed the maps");

    // The long-lived connection still talks to the same backend; new ones work.
    writeln!(stdin, "again").unwrap();
    assert_eq!(lines.next().unwrap().unwrap(), backend);
    let summary = rig.run_client("tcp", VIP_V4, 30);
    assert!(summary.errors.is_empty(), "{summary:?}");
    assert_eq!(summary.counts.values().sum::<usize>(), 30);
    drop(stdin);
    finish(hold);
    dp.cleanup().unwrap();
    assert!(
        !Path::new(&rig.bpffs.path().join("kproxy")).exists(),
        "cleanup left pins"
    );
}

fn finish(mut child: Child) {
    let status = child.wait().unwrap();
    assert!(status.success(), "client exited with {status}");
}
