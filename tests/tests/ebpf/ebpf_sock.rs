//! Socket-level load balancing on this kernel: the real `ServiceMaps` (pinned maps on a
//! private bpffs, socket-LB programs on pinned links attached to a test cgroup) programmed from
//! snapshots, and real clients in that cgroup connecting to service VIPs.
//!
//! Topology: the shared one (`kproxy_tests::topology`): pod `pod-l0` is the client, the other
//! local pods and the pods of the second node are the backends (their `kp-probe serve` answers
//! with the pod's name). Clients run inside `pod-l0`'s namespace and the test cgroup, so only
//! they are translated. VIPs need no route: socket LB rewrites the destination before routing.
//! The one check `kp-probe` cannot make (what `getpeername`/`recvfrom` report to the client) uses
//! a few lines of `/usr/bin/python3`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::dataplane::ebpf::service_maps::plan::decode_addr;
use kproxy::dataplane::ebpf::service_maps::plan::encode_addr;
use kproxy::model::{ChangedSet, Endpoint, Protocol, ServicePort, ServiceType, Snapshot, testing};
use kproxy_common::frontend_filter::{FILTER_WORDS, MAP_FRONTEND_FILTER, filter_slot};
use kproxy_common::service::{
    AffinityKey, AffinityValue, BackendSlotKey, BackendValue, MAP_AFFINITY, MAP_BACKEND_SLOTS,
    MAP_BACKENDS, MAP_SERVICES, MAP_SOCK_FWD, MAP_SOCK_REV_NAT, MAP_SOCK_SENT, ServiceKey,
    ServiceValue, SlotValue, SockFwdKey, SockFwdValue, SockRevNatKey, SockRevNatValue,
    SockSentValue,
};
use kproxy_common::sock::PROG_SOCK_RELEASE;
use kproxy_tests::netns::{Bpffs, TestCgroup, require_root};
use kproxy_tests::topology::{
    POD_PORT, Pod, PodNode, Probe, ProbeResult, Topology, TopologySpec, assert_spread,
};

const PORT: u16 = 80;
const VIP_V4: &str = "10.96.7.7";
const VIP_V6: &str = "fd00:96::7";
const CONNECTIONS: u32 = 300;
const CLIENT_POD: &str = "pod-l0";

/// `python3 -c PEERS FAMILY VIP PORT N`: N TCP connections and N UDP exchanges, each from a
/// new socket, then N datagrams from one unconnected UDP socket; prints the distinct addresses
/// `getpeername()` (TCP) and `recvfrom()` (UDP) reported and the backends that answered the
/// one socket, one JSON object.
const PEERS: &str = r#"
import socket, sys, json
fam, vip, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
af = socket.AF_INET if fam == '4' else socket.AF_INET6
tcp, udp = set(), set()
for i in range(n):
    s = socket.socket(af, socket.SOCK_STREAM); s.settimeout(5)
    s.connect((vip, port)); tcp.add('%s:%d' % s.getpeername()[:2]); s.recv(64); s.close()
    s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(5)
    s.sendto(b'x\n', (vip, port)); _, src = s.recvfrom(256); udp.add('%s:%d' % src[:2]); s.close()
s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(5); same = set()
for i in range(n):
    s.sendto(b'x\n', (vip, port)); data, _ = s.recvfrom(256); same.add(data.decode().split(' ')[0])
print(json.dumps({'tcp': sorted(tcp), 'udp': sorted(udp), 'same_socket': sorted(same)}))
"#;

/// The sandbox of one test: topology with servers, bpffs, cgroup.
struct Rig {
    topo: Topology,
    cgroup: TestCgroup,
    bpffs: Bpffs,
}

impl Rig {
    fn new(test: &str) -> Rig {
        let mut topo = TopologySpec::new(test)
            .local_pods(3)
            .remote_pods(2)
            .ipv6(true)
            .build()
            .unwrap();
        for pod in topo.pods.iter_mut().filter(|p| p.name != CLIENT_POD) {
            pod.serve(&[]).unwrap();
        }
        Rig {
            topo,
            cgroup: TestCgroup::new(&format!("{test}-cg")).unwrap(),
            bpffs: Bpffs::new(&format!("{test}-fs")).unwrap(),
        }
    }

    fn config(&self) -> ServiceMapsConfig {
        config(&self.bpffs, &self.cgroup)
    }

    fn backends(&self) -> Vec<&Pod> {
        self.topo
            .pods
            .iter()
            .filter(|p| p.name != CLIENT_POD)
            .collect()
    }

    fn backend_names(&self) -> Vec<&str> {
        self.backends().iter().map(|p| p.name.as_str()).collect()
    }

    /// Endpoints of every backend pod, both families.
    fn endpoints(&self) -> Vec<Endpoint> {
        self.backends()
            .iter()
            .flat_map(|p| {
                let local = p.on == PodNode::Local;
                [IpAddr::V4(p.ip), IpAddr::V6(p.ip6.unwrap())]
                    .into_iter()
                    .map(move |ip| endpoint(ip, local))
            })
            .collect()
    }

    fn client_ns(&self) -> &kproxy_tests::netns::Netns {
        &self.topo.pod(CLIENT_POD).ns
    }

    fn probe(&self, p: Probe) -> ProbeResult {
        p.timeout(Duration::from_secs(5))
            .run(self.client_ns(), Some(&self.cgroup))
            .unwrap()
    }

    fn pod_name(&self, ip: IpAddr) -> String {
        self.topo
            .pods
            .iter()
            .find(|p| IpAddr::V4(p.ip) == ip || p.ip6.map(IpAddr::V6) == Some(ip))
            .map(|p| p.name.clone())
            .unwrap_or_else(|| ip.to_string())
    }
}

fn config(bpffs: &Bpffs, cgroup: &TestCgroup) -> ServiceMapsConfig {
    ServiceMapsConfig {
        bpffs: bpffs.path().to_path_buf(),
        cgroup: Some(cgroup.path().to_path_buf()),
        map_sizes: MapSizes {
            services: 8192,
            backend_slots: 16384,
            backends: 8192,
            affinity: 1024,
            source_ranges: 256,
            sock_rev_nat: 4096,
            ..MapSizes::default()
        },
        ..ServiceMapsConfig::default()
    }
}

fn addr(vip: &str) -> String {
    if vip.contains(':') {
        format!("[{vip}]:{PORT}")
    } else {
        format!("{vip}:{PORT}")
    }
}

/// Every entry of a pinned hash map, keyed by the key's bytes.
fn dump_map<K: aya::Pod, V: aya::Pod>(bpffs: &Bpffs, name: &str) -> BTreeMap<Vec<u8>, V> {
    let data = MapData::from_pin(bpffs.path().join("kproxy").join(name)).unwrap();
    let map: BpfHashMap<MapData, K, V> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    map.iter()
        .map(|kv| {
            let (k, v) = kv.unwrap();
            (pod_bytes(&k), v)
        })
        .collect()
}

fn pod_bytes<T: Copy>(v: &T) -> Vec<u8> {
    // SAFETY: reading the bytes of a padding-free #[repr(C)] Pod value.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

fn service(name: &str, protocol: Protocol, vips: &[&str], affinity: Option<u32>) -> ServicePort {
    vips.iter()
        .fold(testing::service_port("default", name, "p"), |b, v| {
            b.cluster_ip(*v)
        })
        .protocol(protocol)
        .port(PORT)
        .affinity(affinity)
        .build()
}

fn endpoint(ip: IpAddr, is_local: bool) -> Endpoint {
    testing::endpoint(ip, POD_PORT)
        .local_on("node", "node2", is_local)
        .build()
}

fn snapshot(services: Vec<(ServicePort, Vec<Endpoint>)>) -> Snapshot {
    testing::snapshot("node").services(services).build()
}

fn sync(dp: &mut ServiceMaps, snap: &Snapshot) {
    let report = dp.sync(snap, &ChangedSet::default()).unwrap();
    assert_eq!(report.failed_services, 0, "{report:?}");
}

fn check_family(proto: Protocol, vip: &str) {
    let p = if proto == Protocol::Tcp { "tcp" } else { "udp" };
    let v = if vip.contains(':') { 6 } else { 4 };
    let rig = Rig::new(&format!("sock-{p}{v}"));
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let snap = snapshot(vec![(
        service("web", proto, &[VIP_V4, VIP_V6], None),
        rig.endpoints(),
    )]);
    sync(&mut dp, &snap);
    let probe = match proto {
        Protocol::Tcp => Probe::tcp(addr(vip), CONNECTIONS),
        _ => Probe::udp(addr(vip), CONNECTIONS),
    };
    let result = rig.probe(probe);
    assert_eq!(result.total_answers(), u64::from(CONNECTIONS), "{result:?}");
    assert_spread(&result, &rig.backend_names());
    dp.cleanup().unwrap();
}

#[test]
fn pod_to_cluster_ip_tcp_v4_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Tcp, VIP_V4);
}

#[test]
fn pod_to_cluster_ip_tcp_v6_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Tcp, VIP_V6);
}

#[test]
fn pod_to_cluster_ip_udp_v4_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Udp, VIP_V4);
}

#[test]
fn pod_to_cluster_ip_udp_v6_reaches_every_endpoint() {
    if !require_root() {
        return;
    }
    check_family(Protocol::Udp, VIP_V6);
}

#[test]
fn getpeername_and_recvfrom_report_the_vip_and_a_udp_socket_stays_on_one_backend() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-peer");
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let snap = snapshot(vec![
        (
            service("web", Protocol::Tcp, &[VIP_V4, VIP_V6], None),
            rig.endpoints(),
        ),
        (
            service("web", Protocol::Udp, &[VIP_V4, VIP_V6], None),
            rig.endpoints(),
        ),
    ]);
    sync(&mut dp, &snap);
    for (family, vip) in [("4", VIP_V4), ("6", VIP_V6)] {
        let mut cmd = rig.client_ns().command("/usr/bin/python3");
        cmd.args(["-c", PEERS, family, vip, &PORT.to_string(), "20"]);
        rig.cgroup.enter_on_spawn(&mut cmd).unwrap();
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "python client: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let seen: BTreeMap<String, Vec<String>> = serde_json::from_slice(&out.stdout).unwrap();
        let want = vec![format!("{vip}:{PORT}")];
        assert_eq!(seen["tcp"], want, "getpeername over IPv{family}");
        assert_eq!(seen["udp"], want, "recvfrom over IPv{family}");
        assert_eq!(
            seen["same_socket"].len(),
            1,
            "one unconnected UDP socket's datagrams went to several backends: {:?}",
            seen["same_socket"]
        );
    }
    dp.cleanup().unwrap();
}

/// Dumps `MAP_AFFINITY`.
fn affinity_entries(bpffs: &Bpffs) -> Vec<(AffinityKey, AffinityValue)> {
    let data = MapData::from_pin(bpffs.path().join("kproxy").join(MAP_AFFINITY)).unwrap();
    let map: BpfHashMap<MapData, AffinityKey, AffinityValue> =
        BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    map.iter().filter_map(Result::ok).collect()
}

/// Backend id → address, from `MAP_BACKENDS`.
fn backend_ids(bpffs: &Bpffs) -> BTreeMap<u32, IpAddr> {
    dump_map::<u32, BackendValue>(bpffs, MAP_BACKENDS)
        .into_iter()
        .map(|(k, b)| {
            (
                u32::from_ne_bytes(k[..4].try_into().unwrap()),
                decode_addr(b.addr),
            )
        })
        .collect()
}

#[test]
fn no_endpoints_refuses_connections_at_once() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-noep");
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
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
    for vip in [VIP_V4, VIP_V6] {
        for probe in [Probe::tcp(addr(vip), 3), Probe::udp(addr(vip), 3)] {
            let what = format!("{} {vip}", probe.proto);
            let result = rig.probe(probe);
            assert_eq!(result.total_answers(), 0, "{what}: {result:?}");
            assert_eq!(
                result.errors,
                BTreeMap::from([("ConnectionRefused".to_string(), 3)]),
                "{what}: {result:?}"
            );
        }
    }
    dp.cleanup().unwrap();
}

#[test]
fn affinity_holds_a_client_until_the_timeout() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-aff");
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let snap = snapshot(vec![(
        service("sticky", Protocol::Tcp, &[VIP_V4], Some(1)),
        rig.endpoints(),
    )]);
    sync(&mut dp, &snap);

    // Within the timeout every connection of the client lands on one backend.
    let result = rig.probe(Probe::tcp(addr(VIP_V4), 50));
    assert_eq!(result.total_errors(), 0, "{result:?}");
    assert_eq!(
        result.answers.len(),
        1,
        "affinity broken: {:?}",
        result.answers
    );
    let held = result.answers.keys().next().unwrap().clone();
    let entries = affinity_entries(&rig.bpffs);
    assert_eq!(entries.len(), 1, "{entries:?}");
    let ids = backend_ids(&rig.bpffs);
    assert_eq!(rig.pod_name(ids[&entries[0].1.backend_id]), held);

    // After the timeout the entry is expired: a sync removes it, and new connections are
    // balanced again (each round waits out the timeout, so each is a fresh choice).
    std::thread::sleep(Duration::from_millis(1500));
    sync(&mut dp, &snap);
    assert!(
        affinity_entries(&rig.bpffs).is_empty(),
        "expired entry left in the map"
    );
    let mut seen = BTreeSet::new();
    for _ in 0..15 {
        let r = rig.probe(Probe::tcp(addr(VIP_V4), 1));
        assert_eq!(r.total_errors(), 0, "{r:?}");
        seen.extend(r.answers.into_keys());
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
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let sticky = service("shrink", Protocol::Tcp, &[VIP_V4], Some(600));
    sync(&mut dp, &snapshot(vec![(sticky.clone(), rig.endpoints())]));
    let result = rig.probe(Probe::tcp(addr(VIP_V4), 5));
    assert_eq!(result.answers.len(), 1, "{result:?}");
    let victim = result.answers.keys().next().unwrap().clone();
    let entries = affinity_entries(&rig.bpffs);
    assert_eq!(entries.len(), 1);
    let victim_id = entries[0].1.backend_id;
    let victim_pod = rig.topo.pod(&victim);
    let remaining: Vec<Endpoint> = rig
        .endpoints()
        .into_iter()
        .filter(|e| {
            e.ip != IpAddr::V4(victim_pod.ip) && Some(e.ip) != victim_pod.ip6.map(IpAddr::V6)
        })
        .collect();

    // Remove the backend the client is held on: its affinity entry and backend go.
    sync(&mut dp, &snapshot(vec![(sticky, remaining.clone())]));
    assert!(
        affinity_entries(&rig.bpffs)
            .iter()
            .all(|(_, v)| v.backend_id != victim_id),
        "affinity entry of the removed backend survived"
    );
    assert!(!backend_ids(&rig.bpffs).contains_key(&victim_id));

    // New flows (affinity off, to see the spread) avoid it and reach every other backend.
    let plain = service("shrink", Protocol::Tcp, &[VIP_V4], None);
    sync(&mut dp, &snapshot(vec![(plain, remaining)]));
    let result = rig.probe(Probe::tcp(addr(VIP_V4), CONNECTIONS));
    assert!(!result.answers.contains_key(&victim), "{result:?}");
    let rest: Vec<&str> = rig
        .backend_names()
        .into_iter()
        .filter(|b| *b != victim)
        .collect();
    assert_spread(&result, &rest);
    dp.cleanup().unwrap();
}

type Dump = (
    BTreeMap<Vec<u8>, ServiceValue>,
    BTreeMap<Vec<u8>, SlotValue>,
    BTreeMap<Vec<u8>, BackendValue>,
);

fn dump(bpffs: &Bpffs) -> Dump {
    (
        dump_map::<ServiceKey, ServiceValue>(bpffs, MAP_SERVICES),
        dump_map::<BackendSlotKey, SlotValue>(bpffs, MAP_BACKEND_SLOTS),
        dump_map::<u32, BackendValue>(bpffs, MAP_BACKENDS),
    )
}

/// Checks the pinned frontend filter (`KP_FE_FILTER`, written by the agent through its shared
/// mapping) against the pinned frontends: exactly the bits of the frontends in `KP_SERVICES`
/// say "maybe" (clear), every other bit says "absent". Returns the number of clear bits.
fn assert_filter_matches_frontends(bpffs: &Bpffs) -> usize {
    let data = MapData::from_pin(bpffs.path().join("kproxy").join(MAP_FRONTEND_FILTER)).unwrap();
    let words: Array<MapData, u64> = Array::try_from(Map::from_map_data(data).unwrap()).unwrap();
    assert_eq!(words.len(), FILTER_WORDS);
    let mut maybe = BTreeSet::new();
    for w in 0..FILTER_WORDS {
        let word = words.get(&w, 0).unwrap();
        for b in 0..64 {
            if word & (1u64 << b) == 0 {
                maybe.insert((w, b));
            }
        }
    }
    let want: BTreeSet<(u32, u32)> = dump_map::<ServiceKey, ServiceValue>(bpffs, MAP_SERVICES)
        .keys()
        .map(|k| {
            // SAFETY: the bytes of a ServiceKey read from the map.
            let k: ServiceKey = unsafe { std::ptr::read_unaligned(k.as_ptr().cast()) };
            let (w, m) = filter_slot(&k.addr, k.port, k.proto, k.scope);
            (w, m.trailing_zeros())
        })
        .collect();
    assert_eq!(maybe, want, "filter bits differ from the frontends'");
    maybe.len()
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
    // Maps only: no traffic, so no topology.
    let bpffs = Bpffs::new("sock-1000-fs").unwrap();
    let cgroup = TestCgroup::new("sock-1000-cg").unwrap();
    let mut dp = ServiceMaps::new(config(&bpffs, &cgroup)).unwrap();
    let ip = |a: u8, i: u32| -> IpAddr {
        format!("10.{a}.{}.{}", i / 250, i % 250 + 1)
            .parse()
            .unwrap()
    };
    let make = |changed: bool| {
        let services = (0..1000u32)
            .map(|i| {
                let vip = ip(97, i).to_string();
                let svc = service(&format!("s{i}"), Protocol::Tcp, &[vip.as_str()], None);
                let mut eps = vec![endpoint(ip(211, i), true), endpoint(ip(212, i), false)];
                if changed && i == 500 {
                    eps[0] = endpoint("10.213.0.1".parse().unwrap(), true);
                }
                (svc, eps)
            })
            .collect();
        snapshot(services)
    };
    sync(&mut dp, &make(false));
    let before = dump(&bpffs);
    assert_eq!(before.0.len(), 1000);
    // 1000 frontends on 2 Mi bits: a few may share one.
    assert!(assert_filter_matches_frontends(&bpffs) > 990);
    assert_eq!(before.1.len(), 2000);
    assert_eq!(before.2.len(), 2000);
    sync(&mut dp, &make(true));
    let after = dump(&bpffs);

    // Service 500's frontend keeps its key and value (same set id, 2 slots); only its slots
    // changed; the old backend is gone and the new one is there. Nothing
    // else differs.
    let key = ServiceKey {
        addr: encode_addr(ip(97, 500)),
        port: PORT.to_be(),
        proto: 6,
        scope: 0,
    };
    let svc_id = after.0[&pod_bytes(&key)].svc_id;
    assert!(
        changed_keys(&before.0, &after.0).is_empty(),
        "frontends changed"
    );
    let slots = changed_keys(&before.1, &after.1);
    assert!(!slots.is_empty());
    for k in &slots {
        let id = u32::from_ne_bytes(k[0..4].try_into().unwrap());
        assert_eq!(id, svc_id, "a slot of another set changed: {k:?}");
    }
    let backends = changed_keys(&before.2, &after.2);
    let expected: BTreeSet<IpAddr> = [ip(211, 500), "10.213.0.1".parse().unwrap()].into();
    let changed: BTreeSet<IpAddr> = backends
        .iter()
        .map(|k| decode_addr(before.2.get(k).or(after.2.get(k)).unwrap().addr))
        .collect();
    assert_eq!(changed, expected);
    assert_eq!(backends.len(), 2);
    assert_filter_matches_frontends(&bpffs);

    // Removing services clears their bits (each bit is counted, so shared ones stay).
    let mut fewer = make(true);
    fewer.services.retain(|n, _| n.name.as_str() < "s5");
    sync(&mut dp, &fewer);
    let left = dump(&bpffs).0.len();
    assert!(left < 1000, "{left}");
    let bits = assert_filter_matches_frontends(&bpffs);
    assert!(
        bits <= left && bits > left - 10,
        "{bits} bits for {left} frontends"
    );
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
        rig.endpoints(),
    )]);
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    sync(&mut dp, &snap);
    let links: Vec<(&str, u32)> = dp.link_ids().to_vec();
    assert_eq!(links.len(), kproxy_common::sock::PROGRAMS.len());

    // A connection that exchanges a line every 100 ms for 4 s (exits 1 on any failure).
    let mut cmd = rig
        .client_ns()
        .command(kproxy_tests::topology::target_bin("kp-probe").unwrap());
    cmd.args([
        "hold",
        &addr(VIP_V4),
        "--seconds",
        "4",
        "--interval-ms",
        "100",
    ]);
    rig.cgroup.enter_on_spawn(&mut cmd).unwrap();
    let mut hold = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut lines = BufReader::new(hold.stdout.take().unwrap()).lines();
    let connected = lines.next().unwrap().unwrap();
    assert!(connected.contains("connected"), "{connected}");
    let before = dump(&rig.bpffs);

    // kill -9 of the agent: the object is dropped without cleanup; a new one starts.
    drop(dp);
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    assert_eq!(dp.link_ids(), links.as_slice(), "links were not reused");
    sync(&mut dp, &snap);
    assert_eq!(dump(&rig.bpffs), before, "the restart changed the maps");

    // New connections work, and the long-lived one kept exchanging throughout.
    let result = rig.probe(Probe::tcp(addr(VIP_V4), 30));
    assert_eq!(result.total_answers(), 30, "{result:?}");
    let status = hold.wait().unwrap();
    let last = lines.next().unwrap().unwrap();
    assert!(status.success(), "long-lived connection broke: {last}");
    assert!(last.contains("\"exchanges\""), "{last}");
    dp.cleanup().unwrap();
    assert!(
        !Path::new(&rig.bpffs.path().join("kproxy")).exists(),
        "cleanup left pins"
    );
}

#[test]
fn node_port_from_a_pod_uses_the_cluster_set_even_with_etp_local() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-np");
    let mut dp = ServiceMaps::new(ServiceMapsConfig {
        node_addresses: rig.topo.node_ips(),
        ..rig.config()
    })
    .unwrap();
    let mut port = service("np", Protocol::Tcp, &[VIP_V4, VIP_V6], None);
    port.service_type = ServiceType::NodePort;
    port.node_port = 30080;
    port.external_policy_local = true;
    port.external_ips = vec!["203.0.113.10".parse().unwrap()];
    sync(&mut dp, &snapshot(vec![(port, rig.endpoints())]));
    // Traffic from the node's pods to an external destination short-circuits to every
    // endpoint (local and remote), like upstream.
    for target in [
        format!("{}:30080", kproxy_tests::topology::NODE_IP),
        format!("[{}]:30080", kproxy_tests::topology::NODE_IP6),
        format!("203.0.113.10:{PORT}"),
    ] {
        let result = rig.probe(Probe::tcp(target.clone(), CONNECTIONS));
        assert_eq!(
            result.total_answers(),
            u64::from(CONNECTIONS),
            "{target}: {result:?}"
        );
        assert_spread(&result, &rig.backend_names());
    }
    dp.cleanup().unwrap();
}

#[test]
fn internal_traffic_policy_local_reaches_only_local_endpoints() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-itp");
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let mut port = service("itp", Protocol::Tcp, &[VIP_V4], None);
    port.internal_policy_local = true;
    sync(&mut dp, &snapshot(vec![(port, rig.endpoints())]));
    let local: Vec<&str> = rig
        .backends()
        .iter()
        .filter(|p| p.on == PodNode::Local)
        .map(|p| p.name.as_str())
        .collect();
    assert_eq!(local.len(), 2);
    let result = rig.probe(Probe::tcp(addr(VIP_V4), CONNECTIONS));
    assert_eq!(result.total_answers(), u64::from(CONNECTIONS), "{result:?}");
    assert_spread(&result, &local);
    dp.cleanup().unwrap();
}

/// `python3 -c HOLD FAMILY VIP PORT N`: opens N TCP connections, N connected UDP sockets and
/// N unconnected UDP sockets to the VIP (each exchanging once), prints `open`, waits for a
/// line on stdin, closes them all and prints `closed`.
const HOLD: &str = r#"
import socket, sys
fam, vip, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
af = socket.AF_INET if fam == '4' else socket.AF_INET6
socks = []
for i in range(n):
    s = socket.socket(af, socket.SOCK_STREAM); s.settimeout(5)
    s.connect((vip, port)); s.recv(64); socks.append(s)
    s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(5)
    s.connect((vip, port)); s.send(b'x\n'); s.recv(256); socks.append(s)
    s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(5)
    s.sendto(b'x\n', (vip, port)); s.recvfrom(256); socks.append(s)
print('open', flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print('closed', flush=True)
"#;

/// `python3 -c FLOOD VIP4 VIP6 PORT N`: per family, a connected and an unconnected UDP socket
/// exchange with the VIP; then, per family, N short TCP connections (asking `getpeername()`)
/// and N short connected UDP sockets (asking `recvfrom()`, like a DNS client checking the
/// reply's source) come and go; then the long-lived sockets exchange again. Prints the reply
/// sources `recvfrom()` reported to each long-lived socket before and after, one JSON object.
const FLOOD: &str = r#"
import socket, sys, json
vips, port, n = {'4': sys.argv[1], '6': sys.argv[2]}, int(sys.argv[3]), int(sys.argv[4])
afs = {'4': socket.AF_INET, '6': socket.AF_INET6}
def src(s):
    _, a = s.recvfrom(256); return '%s:%d' % a[:2]
live, seen = {}, {}
for f, vip in vips.items():
    a = socket.socket(afs[f], socket.SOCK_DGRAM); a.settimeout(5); a.connect((vip, port))
    b = socket.socket(afs[f], socket.SOCK_DGRAM); b.settimeout(5)
    a.send(b'x\n'); b.sendto(b'x\n', (vip, port))
    live[f] = (a, b); seen['v%s connected' % f] = [src(a)]; seen['v%s unconnected' % f] = [src(b)]
for f, vip in vips.items():
    for i in range(n):
        s = socket.socket(afs[f], socket.SOCK_STREAM); s.settimeout(5)
        s.connect((vip, port)); s.getpeername(); s.recv(64); s.close()
        s = socket.socket(afs[f], socket.SOCK_DGRAM); s.settimeout(5)
        s.connect((vip, port)); s.send(b'x\n'); src(s); s.close()
for f, vip in vips.items():
    a, b = live[f]
    a.send(b'x\n'); b.sendto(b'x\n', (vip, port))
    seen['v%s connected' % f].append(src(a)); seen['v%s unconnected' % f].append(src(b))
print(json.dumps(seen))
"#;

/// Entries of the per-socket maps: `KP_SOCK_RNAT`, `KP_SOCK_FWD`, `KP_SOCK_SENT`.
fn sock_entries(bpffs: &Bpffs) -> [usize; 3] {
    [
        dump_map::<SockRevNatKey, SockRevNatValue>(bpffs, MAP_SOCK_REV_NAT).len(),
        dump_map::<SockFwdKey, SockFwdValue>(bpffs, MAP_SOCK_FWD).len(),
        dump_map::<u64, SockSentValue>(bpffs, MAP_SOCK_SENT).len(),
    ]
}

/// Polls until the per-socket maps are empty (release runs when a socket's last reference
/// goes, which `close()` is here; the bound is only liveness) and returns what is left.
fn wait_sock_maps_empty(bpffs: &Bpffs) -> [usize; 3] {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = sock_entries(bpffs);
        if left == [0; 3] || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Both protocols on both VIPs of one service name.
fn tcp_and_udp(rig: &Rig) -> Snapshot {
    snapshot(vec![
        (
            service("web", Protocol::Tcp, &[VIP_V4, VIP_V6], None),
            rig.endpoints(),
        ),
        (
            service("web", Protocol::Udp, &[VIP_V4, VIP_V6], None),
            rig.endpoints(),
        ),
    ])
}

#[test]
fn released_sockets_leave_no_per_socket_entries() {
    if !require_root() {
        return;
    }
    const N: usize = 40;
    let rig = Rig::new("sock-rel");
    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    sync(&mut dp, &tcp_and_udp(&rig));
    for (family, vip) in [("4", VIP_V4), ("6", VIP_V6)] {
        let mut cmd = rig.client_ns().command("/usr/bin/python3");
        cmd.args(["-c", HOLD, family, vip, &PORT.to_string(), &N.to_string()]);
        rig.cgroup.enter_on_spawn(&mut cmd).unwrap();
        let mut client = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(client.stdout.take().unwrap()).lines();
        assert_eq!(lines.next().unwrap().unwrap(), "open", "IPv{family} client");
        // Open: one reverse entry per socket (TCP, connected UDP: connect; unconnected UDP:
        // sendmsg), and the unconnected sockets' forward choices and their lists.
        assert_eq!(
            sock_entries(&rig.bpffs),
            [3 * N, N, N],
            "IPv{family}: entries of the open sockets (RNAT, FWD, SENT)"
        );
        writeln!(client.stdin.take().unwrap()).unwrap();
        assert_eq!(lines.next().unwrap().unwrap(), "closed");
        assert!(client.wait().unwrap().success());
        assert_eq!(
            wait_sock_maps_empty(&rig.bpffs),
            [0; 3],
            "IPv{family}: entries left after every socket closed (RNAT, FWD, SENT)"
        );
    }
    dp.cleanup().unwrap();
}

#[test]
fn a_live_udp_socket_keeps_its_reverse_translation_while_short_connections_come_and_go() {
    if !require_root() {
        return;
    }
    // More short connections than `KP_SOCK_RNAT` holds: without deletes on release the LRU
    // evicts the idle long-lived sockets' entries. The short ones are looked up too
    // (getpeername, recvfrom), as real clients do: the kernel's LRU evicts entries never
    // looked up first, so only a flood of looked-up ones reaches the long-lived entries.
    const MAP: u32 = 1024;
    const SHORT: u32 = MAP;
    let rig = Rig::new("sock-flood");
    let mut cfg = rig.config();
    cfg.map_sizes.sock_rev_nat = MAP;
    let mut dp = ServiceMaps::new(cfg).unwrap();
    sync(&mut dp, &tcp_and_udp(&rig));
    let mut cmd = rig.client_ns().command("/usr/bin/python3");
    cmd.args([
        "-c",
        FLOOD,
        VIP_V4,
        VIP_V6,
        &PORT.to_string(),
        &SHORT.to_string(),
    ]);
    rig.cgroup.enter_on_spawn(&mut cmd).unwrap();
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "python client: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: BTreeMap<String, Vec<String>> = serde_json::from_slice(&out.stdout).unwrap();
    let want: BTreeMap<String, Vec<String>> = [("4", VIP_V4), ("6", VIP_V6)]
        .into_iter()
        .flat_map(|(family, vip)| {
            ["connected", "unconnected"].map(|kind| {
                (
                    format!("v{family} {kind}"),
                    vec![format!("{vip}:{PORT}"); 2],
                )
            })
        })
        .collect();
    assert_eq!(
        seen, want,
        "reply sources of the long-lived UDP sockets before and after {SHORT} short \
         connections per family"
    );
    dp.cleanup().unwrap();
}

#[test]
fn a_restart_over_pins_without_the_release_link_attaches_it_beside_the_others() {
    if !require_root() {
        return;
    }
    let rig = Rig::new("sock-relpin");
    let dp = ServiceMaps::new(rig.config()).unwrap();
    let links: BTreeMap<&str, u32> = dp.link_ids().iter().copied().collect();
    assert_eq!(links.len(), kproxy_common::sock::PROGRAMS.len());
    drop(dp);
    // The pins of a build before `kp_sk_release`: the same links without that one.
    std::fs::remove_file(
        rig.bpffs
            .path()
            .join("kproxy/links")
            .join(PROG_SOCK_RELEASE),
    )
    .unwrap();

    let mut dp = ServiceMaps::new(rig.config()).unwrap();
    let after: BTreeMap<&str, u32> = dp.link_ids().iter().copied().collect();
    for (name, id) in &links {
        if *name == PROG_SOCK_RELEASE {
            assert_ne!(after[name], *id, "{name}: the removed link came back");
        } else {
            assert_eq!(after[name], *id, "{name}: a pinned link was replaced");
        }
    }
    // The new link works: closed sockets leave nothing behind.
    sync(&mut dp, &tcp_and_udp(&rig));
    let tcp = rig.probe(Probe::tcp(addr(VIP_V4), 20));
    let udp = rig.probe(Probe::udp(addr(VIP_V4), 20));
    assert_eq!(
        tcp.total_answers() + udp.total_answers(),
        40,
        "{tcp:?} {udp:?}"
    );
    assert_eq!(wait_sock_maps_empty(&rig.bpffs), [0; 3]);
    dp.cleanup().unwrap();
}
