//! Stale UDP sockets on this kernel (`kproxy::dataplane::ebpf::socket_lb::sock_destroy`): a pod in the
//! socket-LB cgroup holds a UDP socket connected (through socket LB) to a ClusterIP; the backend
//! it got is removed from the service; the next sync destroys that socket, so the client's next
//! `recv` fails with ECONNABORTED at once, and a new socket reaches a live backend. A socket
//! the client connected to the same pod address directly (not through a ClusterIP) is left
//! alone.
//!
//! The real `ServiceMaps` (pinned maps on a private bpffs, socket LB on a test cgroup) and
//! the shared topology: `pod-l0` is the client, `pod-l1`, `pod-l2` the backends.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::Stdio;

use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::model::{ChangedSet, Endpoint, Protocol, ServicePort, Snapshot, testing};
use kproxy_tests::netns::{Bpffs, TestCgroup, require_root};
use kproxy_tests::topology::{POD_PORT, Topology, TopologySpec};

const PORT: u16 = 53;
const VIP_V4: &str = "10.96.53.10";
const VIP_V6: &str = "fd00:96::53";
const CLIENT_POD: &str = "pod-l0";

/// `python3 -c CLIENT FAMILY VIP PORT`, driven line by line over stdin/stdout:
/// 1. connects a UDP socket to the VIP, exchanges one datagram, prints the answering backend;
/// 2. reads that backend's address, connects a second socket to it directly, exchanges one
///    datagram, prints `ready`;
/// 3. reads `go` (the backend has been removed meanwhile) and prints one JSON object: what the
///    first socket's next `recv` raised, what the direct socket got, and which backend a new
///    socket to the VIP reached.
const CLIENT: &str = r#"
import socket, sys, json, errno
fam, vip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
af = socket.AF_INET if fam == '4' else socket.AF_INET6
def name(s):
    return s.recv(256).decode().split(' ')[0]
lb = socket.socket(af, socket.SOCK_DGRAM); lb.settimeout(5); lb.connect((vip, port))
lb.send(b'x\n'); print(name(lb), flush=True)
ip, pport = sys.stdin.readline().split()
direct = socket.socket(af, socket.SOCK_DGRAM); direct.settimeout(5); direct.connect((ip, int(pport)))
direct.send(b'x\n'); name(direct); print('ready', flush=True)
sys.stdin.readline()
out = {}
try:
    lb.recv(256); out['lb_recv'] = 'no error'
except socket.timeout:
    out['lb_recv'] = 'timeout'
except OSError as e:
    out['lb_recv'] = errno.errorcode.get(e.errno, str(e.errno))
try:
    direct.send(b'x\n'); out['direct'] = name(direct)
except Exception as e:
    out['direct'] = 'error: %r' % e
s = socket.socket(af, socket.SOCK_DGRAM); s.settimeout(5); s.connect((vip, port))
s.send(b'x\n'); out['new'] = name(s)
print(json.dumps(out), flush=True)
"#;

fn service() -> ServicePort {
    testing::service_port("kube-system", "dns", "dns")
        .protocol(Protocol::Udp)
        .cluster_ip(VIP_V4)
        .cluster_ip(VIP_V6)
        .port(PORT)
        .build()
}

fn endpoint(ip: IpAddr) -> Endpoint {
    testing::endpoint(ip, POD_PORT)
        .local_on("node", "node2", true)
        .build()
}

/// The service with the endpoints of `pods` (both families).
fn snapshot(topo: &Topology, pods: &[&str]) -> Snapshot {
    let eps: Vec<Endpoint> = pods
        .iter()
        .flat_map(|n| {
            let p = topo.pod(n);
            [IpAddr::V4(p.ip), IpAddr::V6(p.ip6.unwrap())].map(endpoint)
        })
        .collect();
    testing::snapshot("node").service(service(), eps).build()
}

fn check(family: &str) {
    let test = format!("sockdestroy{family}");
    let mut topo = TopologySpec::new(&test)
        .local_pods(3)
        .ipv6(true)
        .build()
        .unwrap();
    let backends = ["pod-l1", "pod-l2"];
    for name in backends {
        topo.pod_mut(name).serve(&[]).unwrap();
    }
    let cgroup = TestCgroup::new(&format!("{test}-cg")).unwrap();
    let bpffs = Bpffs::new(&format!("{test}-fs")).unwrap();
    let cfg = ServiceMapsConfig {
        bpffs: bpffs.path().to_path_buf(),
        cgroup: Some(cgroup.path().to_path_buf()),
        map_sizes: MapSizes {
            services: 256,
            backend_slots: 256,
            backends: 256,
            affinity: 256,
            source_ranges: 16,
            sock_rev_nat: 1024,
            ..MapSizes::default()
        },
        ..ServiceMapsConfig::default()
    };
    let mut dp = ServiceMaps::new(cfg).unwrap();
    let report = dp
        .sync(&snapshot(&topo, &backends), &ChangedSet::default())
        .unwrap();
    assert_eq!(report.failed_services, 0);

    let vip = if family == "4" { VIP_V4 } else { VIP_V6 };
    let mut cmd = topo.pod(CLIENT_POD).ns.command("/usr/bin/python3");
    cmd.args(["-c", CLIENT, family, vip, &PORT.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    cgroup.enter_on_spawn(&mut cmd).unwrap();
    let mut child = cmd.spawn().unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut next = || {
        lines
            .next()
            .expect("the client exited early")
            .expect("reading the client's output")
    };

    let first = next();
    assert!(backends.contains(&first.as_str()), "first answer: {first}");
    let pod = topo.pod(&first);
    let ip = if family == "4" {
        IpAddr::V4(pod.ip)
    } else {
        IpAddr::V6(pod.ip6.unwrap())
    };
    writeln!(stdin, "{ip} {POD_PORT}").unwrap();
    assert_eq!(next(), "ready");

    // Remove the backend the client's socket is connected to (its pod keeps running: only
    // the endpoint goes, as when a pod turns not-ready).
    let live: Vec<&str> = backends.iter().copied().filter(|b| *b != first).collect();
    let report = dp
        .sync(&snapshot(&topo, &live), &ChangedSet::default())
        .unwrap();
    assert_eq!(report.failed_services, 0);
    writeln!(stdin, "go").unwrap();
    let result: BTreeMap<String, String> = serde_json::from_str(&next()).unwrap();
    let _ = child.wait();

    assert_eq!(
        result["lb_recv"], "ECONNABORTED",
        "the socket connected through socket LB to the removed backend: {result:?}"
    );
    assert_eq!(
        result["direct"], first,
        "a socket connected to the pod address itself is left alone: {result:?}"
    );
    assert_eq!(
        result["new"], live[0],
        "a new socket reaches the live backend: {result:?}"
    );
    dp.cleanup().unwrap();
}

#[test]
fn udp_socket_connected_to_a_removed_backend_is_aborted_v4() {
    if !require_root() {
        return;
    }
    check("4");
}

#[test]
fn udp_socket_connected_to_a_removed_backend_is_aborted_v6() {
    if !require_root() {
        return;
    }
    check("6");
}
