//! `kproxy::dataplane::netfilter::conntrack::Cleaner` against the real kernel, in test network namespaces:
//!
//! 1. entries created with `conntrack -I` (explicit tuples): after an endpoint was removed,
//!    exactly the stale UDP entries of the changed service are deleted (ClusterIP, externalIP
//!    and NodePort frontends, each family by its own cleaner); entries of other services, TCP,
//!    other ports and the still-serving endpoint stay. Checked by a netlink dump and by
//!    `conntrack -L`.
//! 2. real packets (IPv4 and IPv6): a UDP client that keeps its source port sticks to a
//!    removed endpoint through conntrack even after the DNAT rule changed, and moves to the
//!    remaining endpoint once the cleaner ran.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kproxy::dataplane::netfilter::conntrack::Cleaner;
use kproxy::dataplane::netfilter::conntrack::Entry;
use kproxy::model::{ChangedSet, IpFamily, Snapshot, Tracker};
use kproxy::source::manifests;
use kproxy_tests::netns::{Netns, Veth, VethEnd, require_root};

const NODE: &str = "node-a";

/// A dual-stack UDP+TCP service `ns/svc` (ClusterIP, externalIP, NodePort 32000 for UDP) and
/// a UDP-only service `ns/dns`, with the given endpoint IPs for `svc` (port 9090).
fn manifests(svc_endpoints_v4: &[&str], svc_endpoints_v6: &[&str]) -> String {
    let eps = |ips: &[&str]| {
        ips.iter()
            .map(|ip| format!("- addresses: [\"{ip}\"]\n"))
            .collect::<String>()
    };
    format!(
        r#"apiVersion: v1
kind: Service
metadata: {{name: svc, namespace: ns}}
spec:
  type: NodePort
  clusterIP: 172.30.1.1
  clusterIPs: [172.30.1.1, "fd00:30::1"]
  ipFamilies: [IPv4, IPv6]
  externalIPs: [192.168.99.100]
  ports:
  - {{name: udp, protocol: UDP, port: 8000, nodePort: 32000}}
  - {{name: tcp, protocol: TCP, port: 8000, nodePort: 32001}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-v4, namespace: ns, labels: {{kubernetes.io/service-name: svc}}}}
addressType: IPv4
endpoints:
{v4}ports:
- {{name: udp, protocol: UDP, port: 9090}}
- {{name: tcp, protocol: TCP, port: 9090}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: svc-v6, namespace: ns, labels: {{kubernetes.io/service-name: svc}}}}
addressType: IPv6
endpoints:
{v6}ports:
- {{name: udp, protocol: UDP, port: 9090}}
---
apiVersion: v1
kind: Service
metadata: {{name: dns, namespace: ns}}
spec:
  clusterIP: 172.30.2.2
  ports:
  - {{name: dns, protocol: UDP, port: 53}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {{name: dns-1, namespace: ns, labels: {{kubernetes.io/service-name: dns}}}}
addressType: IPv4
endpoints:
- addresses: [10.240.0.7]
ports:
- {{name: dns, protocol: UDP, port: 53}}
"#,
        v4 = eps(svc_endpoints_v4),
        v6 = eps(svc_endpoints_v6),
    )
}

/// Feeds `text` (the complete object set) to `tracker` and takes a snapshot.
fn step(tracker: &mut Tracker, text: &str) -> (Arc<Snapshot>, ChangedSet) {
    let mut m = manifests::Manifests::default();
    let mut errors = vec![];
    manifests::parse_into(Path::new("test.yaml"), text, &mut m, &mut errors);
    assert!(errors.is_empty(), "{errors:?}");
    for ev in manifests::events(m, NODE) {
        let warnings = tracker.apply(ev);
        assert!(warnings.is_empty(), "{warnings:?}");
    }
    tracker.snapshot()
}

/// `conntrack -I` of one UDP/TCP entry: orig `client:sport → dst:dport`, reply from
/// `reply_src:reply_sport`.
fn insert(ns: &Netns, proto: &str, dst: &str, dport: u16, reply_src: &str, reply_sport: u16) {
    let v6 = dst.contains(':');
    let client = if v6 { "fd00:1::2" } else { "10.0.1.2" };
    // A distinct client port per entry keeps both tuples unique.
    static NEXT_PORT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(40000);
    let sport = NEXT_PORT.fetch_add(1, Ordering::Relaxed).to_string();
    let (dport, reply_sport) = (dport.to_string(), reply_sport.to_string());
    let mut args = vec![
        "-I",
        "-p",
        proto,
        "-s",
        client,
        "-d",
        dst,
        "--sport",
        &sport,
        "--dport",
        &dport,
        "--reply-src",
        reply_src,
        "--reply-dst",
        client,
        "--reply-port-src",
        &reply_sport,
        "--reply-port-dst",
        &sport,
        "-t",
        "600",
    ];
    if proto == "tcp" {
        args.extend(["--state", "ESTABLISHED"]);
    }
    ns.exec("conntrack", &args).unwrap();
}

/// (proto, orig dst, orig dst port, reply src, reply src port) of an entry.
type Key = (u8, IpAddr, u16, IpAddr, u16);

fn key(e: &Entry) -> Key {
    (
        e.orig.proto,
        e.orig.dst,
        e.orig.dst_port,
        e.reply.src,
        e.reply.src_port,
    )
}

fn k(proto: u8, dst: &str, dport: u16, rsrc: &str, rsport: u16) -> Key {
    (
        proto,
        dst.parse().unwrap(),
        dport,
        rsrc.parse().unwrap(),
        rsport,
    )
}

fn netlink_keys(ns: &Netns) -> BTreeSet<Key> {
    let mut keys = BTreeSet::new();
    for family in [IpFamily::V4, IpFamily::V6] {
        let dump = ns
            .run(move || kproxy::dataplane::netfilter::conntrack::list(family))
            .unwrap()
            .unwrap();
        assert!(!dump.interrupted);
        keys.extend(dump.entries.iter().map(key));
    }
    keys
}

/// The same keys from `conntrack -L` text: the first `dst=`/`dport=` are the original
/// tuple's, the second `src=`/`sport=` the reply's.
fn conntrack_tool_keys(ns: &Netns) -> BTreeSet<Key> {
    let mut keys = BTreeSet::new();
    for family in ["ipv4", "ipv6"] {
        let out = ns.exec("conntrack", &["-L", "-f", family]).unwrap();
        for line in out.lines() {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let all = |name: &str| -> Vec<&str> {
                fields.iter().filter_map(|f| f.strip_prefix(name)).collect()
            };
            let proto: u8 = fields[1].parse().unwrap();
            let (dst, dport, src, sport) = (all("dst="), all("dport="), all("src="), all("sport="));
            keys.insert((
                proto,
                dst[0].parse().unwrap(),
                dport[0].parse().unwrap(),
                src[1].parse().unwrap(),
                sport[1].parse().unwrap(),
            ));
        }
    }
    keys
}

#[test]
fn exactly_the_stale_udp_entries_are_deleted() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ct-stale").unwrap();
    let mut tracker = Tracker::new(NODE);
    let (prev, _) = step(
        &mut tracker,
        &manifests(&["10.240.0.4", "10.240.0.5"], &["fd01::4", "fd01::5"]),
    );
    // 10.240.0.5 and fd01::5 are removed from svc.
    let (next, changed) = step(&mut tracker, &manifests(&["10.240.0.4"], &["fd01::4"]));

    let stale = [
        k(17, "172.30.1.1", 8000, "10.240.0.5", 9090), // ClusterIP → removed endpoint
        k(17, "192.168.99.100", 8000, "10.240.0.5", 9090), // externalIP → removed
        k(17, "10.0.1.1", 32000, "10.240.0.5", 9090),  // node IP:NodePort → removed
        k(17, "172.30.1.1", 8000, "10.240.0.4", 8080), // serving IP, old port
        k(17, "172.30.1.1", 8000, "172.30.1.1", 8000), // not DNATed
    ];
    let stale_v6 = [k(17, "fd00:30::1", 8000, "fd01::5", 9090)];
    let kept = [
        k(17, "172.30.1.1", 8000, "10.240.0.4", 9090), // serving endpoint
        k(17, "10.0.1.1", 32000, "10.240.0.4", 9090),  // NodePort, serving endpoint
        k(6, "172.30.1.1", 8000, "10.240.0.5", 9090),  // TCP
        k(17, "172.30.1.1", 8001, "10.240.0.5", 9090), // other port of the ClusterIP
        k(17, "172.30.2.2", 53, "10.240.0.7", 53),     // other service
        k(17, "fd00:30::1", 8000, "fd01::4", 9090),    // v6 serving endpoint
    ];
    for (proto, dst, dport, rsrc, rsport) in stale.iter().chain(&stale_v6).chain(&kept) {
        let proto = if *proto == 6 { "tcp" } else { "udp" };
        insert(
            &ns,
            proto,
            &dst.to_string(),
            *dport,
            &rsrc.to_string(),
            *rsport,
        );
    }
    let all: BTreeSet<Key> = stale
        .iter()
        .chain(&stale_v6)
        .chain(&kept)
        .copied()
        .collect();
    assert_eq!(
        netlink_keys(&ns),
        all,
        "netlink dump lists what conntrack -I created"
    );
    assert_eq!(conntrack_tool_keys(&ns), all, "conntrack -L agrees");

    // The IPv4 cleaner deletes the IPv4 stale entries only.
    let (prev4, next4, changed4) = (prev.clone(), next.clone(), changed.clone());
    let stats = ns
        .run(move || Cleaner::new(IpFamily::V4).after_sync(&prev4, &next4, &changed4))
        .unwrap()
        .unwrap();
    assert!(stats.ran);
    assert_eq!(
        (stats.stale, stats.deleted, stats.already_gone),
        (5, 5, 0),
        "{stats:?}"
    );
    assert_eq!(stats.listed, 5 + 5, "IPv4 entries only: {stats:?}");
    let want: BTreeSet<Key> = stale_v6.iter().chain(&kept).copied().collect();
    assert_eq!(netlink_keys(&ns), want);
    assert_eq!(conntrack_tool_keys(&ns), want);

    // The IPv6 cleaner deletes its one stale entry.
    let stats = ns
        .run(move || Cleaner::new(IpFamily::V6).after_sync(&prev, &next, &changed))
        .unwrap()
        .unwrap();
    assert_eq!(
        (stats.listed, stats.stale, stats.deleted),
        (2, 1, 1),
        "{stats:?}"
    );
    let want: BTreeSet<Key> = kept.iter().copied().collect();
    assert_eq!(netlink_keys(&ns), want);
    assert_eq!(conntrack_tool_keys(&ns), want);
}

#[test]
fn no_cleanup_without_a_udp_endpoint_change_and_gone_entries_are_tolerated() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ct-noop").unwrap();
    let mut tracker = Tracker::new(NODE);
    let (a, _) = step(&mut tracker, &manifests(&["10.240.0.4", "10.240.0.5"], &[]));
    insert(&ns, "udp", "172.30.1.1", 8000, "10.240.0.9", 9090);
    // Same objects again: nothing changed, nothing is even listed.
    let (b, changed) = step(&mut tracker, &manifests(&["10.240.0.4", "10.240.0.5"], &[]));
    assert!(changed.is_empty());
    let stats = ns
        .run(move || Cleaner::new(IpFamily::V4).after_sync(&a, &b, &changed))
        .unwrap()
        .unwrap();
    assert!(!stats.ran, "{stats:?}");
    assert_eq!(netlink_keys(&ns).len(), 1, "the stale entry is still there");

    // Deleting an entry that vanished in between counts as already gone, not as a failure.
    let (gone, outcome) = ns
        .run(|| {
            let mut sock =
                kproxy::dataplane::netfilter::conntrack::netlink::Socket::open().unwrap();
            let entries = sock.dump(IpFamily::V4).unwrap().entries;
            let first = sock.delete(&entries);
            let again = sock.delete(&entries);
            (first, again)
        })
        .unwrap();
    assert_eq!((gone.deleted, gone.already_gone), (1, 0));
    assert!(gone.failed.is_empty() && gone.aborted.is_none());
    assert_eq!((outcome.deleted, outcome.already_gone), (0, 1));
    assert!(outcome.failed.is_empty() && outcome.aborted.is_none());
}

/// A UDP server answering every datagram with its name, until `stop`. Returns once it is
/// bound (or fails with the bind error).
fn serve(ns: &Netns, addr: SocketAddr, name: &'static str, stop: Arc<AtomicBool>) {
    let (bound_tx, bound_rx) = std::sync::mpsc::channel();
    ns.spawn(move || {
        let sock = match UdpSocket::bind(addr) {
            Ok(s) => s,
            Err(e) => {
                let _ = bound_tx.send(Err(e.to_string()));
                return;
            }
        };
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let _ = bound_tx.send(Ok(()));
        let mut buf = [0u8; 64];
        while !stop.load(Ordering::SeqCst) {
            if let Ok((_, peer)) = sock.recv_from(&mut buf) {
                let _ = sock.send_to(name.as_bytes(), peer);
            }
        }
    })
    .unwrap();
    bound_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("server thread started")
        .unwrap_or_else(|e| panic!("binding {addr}: {e}"));
}

/// Addresses of the flow test, per family.
struct Net {
    family: IpFamily,
    client: &'static str,
    node_client_side: &'static str,
    node_pod_side: &'static str,
    ep_a: &'static str,
    ep_b: &'static str,
    prefix: &'static str,
    vip: &'static str,
    iptables: &'static str,
}

const NET_V4: Net = Net {
    family: IpFamily::V4,
    client: "10.0.1.2",
    node_client_side: "10.0.1.1",
    node_pod_side: "10.240.0.1",
    ep_a: "10.240.0.4",
    ep_b: "10.240.0.5",
    prefix: "24",
    vip: "172.30.1.1",
    iptables: "iptables",
};

const NET_V6: Net = Net {
    family: IpFamily::V6,
    client: "fd00:1::2",
    node_client_side: "fd00:1::1",
    node_pod_side: "fd01::1",
    ep_a: "fd01::4",
    ep_b: "fd01::5",
    prefix: "64",
    vip: "fd00:30::1",
    iptables: "ip6tables",
};

fn sa(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

/// Sends from the client's fixed source port to the ClusterIP; returns who answered.
fn ask(client: &Netns, net: &Net) -> String {
    let (from, vip) = (sa(net.client, 41000), sa(net.vip, 8000));
    client
        .run(move || {
            let sock = UdpSocket::bind(from).unwrap();
            sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            let mut buf = [0u8; 64];
            for _ in 0..5 {
                sock.send_to(b"who", vip).unwrap();
                if let Ok((n, answered)) = sock.recv_from(&mut buf) {
                    assert_eq!(answered, vip, "un-DNATed reply");
                    return String::from_utf8_lossy(&buf[..n]).into_owned();
                }
            }
            panic!("no answer from {vip} in 5 tries");
        })
        .unwrap()
}

/// client ─ node (DNAT of the ClusterIP, the cleaner) ─ pods (ep-a and ep-b, both alive).
fn udp_flow_moves(net: &Net) {
    let client = Netns::new("ct-move-client").unwrap();
    let node = Netns::new("ct-move-node").unwrap();
    let pods = Netns::new("ct-move-pods").unwrap();
    let _v1 = Veth::create(
        VethEnd::new(&client, "eth0"),
        VethEnd::new(&node, "n-client"),
    )
    .unwrap();
    let _v2 = Veth::create(VethEnd::new(&node, "n-pods"), VethEnd::new(&pods, "eth0")).unwrap();
    if net.family == IpFamily::V4 {
        for ns in [&client, &node, &pods] {
            ns.disable_ipv6().unwrap();
        }
        node.sysctl("net.ipv4.ip_forward", "1").unwrap();
    } else {
        node.sysctl("net.ipv6.conf.all.forwarding", "1").unwrap();
    }
    for (ns, dev, ip) in [
        (&client, "eth0", net.client),
        (&node, "n-client", net.node_client_side),
        (&node, "n-pods", net.node_pod_side),
        (&pods, "eth0", net.ep_a),
        (&pods, "eth0", net.ep_b),
    ] {
        let cidr = format!("{ip}/{}", net.prefix);
        let mut args = vec!["addr", "add", &cidr, "dev", dev];
        if net.family == IpFamily::V6 {
            // Usable at once: no duplicate address detection.
            args.push("nodad");
        }
        ns.ip(&args).unwrap();
    }
    client
        .ip(&["route", "add", "default", "via", net.node_client_side])
        .unwrap();
    pods.ip(&["route", "add", "default", "via", net.node_pod_side])
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    serve(&pods, sa(net.ep_a, 9090), "ep-a", stop.clone());
    serve(&pods, sa(net.ep_b, 9090), "ep-b", stop.clone());
    struct StopOnDrop(Arc<AtomicBool>);
    impl Drop for StopOnDrop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let _stop = StopOnDrop(stop);

    // `iptables -t nat <-A PREROUTING | -R PREROUTING 1> <DNAT of the ClusterIP to `to`>`.
    let vip = format!(
        "{}/{}",
        net.vip,
        if net.family == IpFamily::V4 { 32 } else { 128 }
    );
    let dnat = |op: &[&str], to: SocketAddr| {
        let to = to.to_string();
        let rule = [
            "-d",
            &vip,
            "-p",
            "udp",
            "--dport",
            "8000",
            "-j",
            "DNAT",
            "--to-destination",
            &to,
        ];
        let args: Vec<&str> = ["-t", "nat"]
            .iter()
            .chain(op)
            .chain(&rule)
            .copied()
            .collect();
        node.exec(net.iptables, &args).unwrap();
    };
    let endpoints = |eps: &[&str]| match net.family {
        IpFamily::V4 => manifests(eps, &[]),
        IpFamily::V6 => manifests(&[], eps),
    };

    // The datapath's rules while svc has both endpoints (it picked ep-b for this client).
    let mut tracker = Tracker::new(NODE);
    let (prev, _) = step(&mut tracker, &endpoints(&[net.ep_a, net.ep_b]));
    dnat(&["-A", "PREROUTING"], sa(net.ep_b, 9090));
    assert_eq!(ask(&client, net), "ep-b");

    // ep-b is removed: the rules now DNAT to ep-a only …
    let (next, changed) = step(&mut tracker, &endpoints(&[net.ep_a]));
    dnat(&["-R", "PREROUTING", "1"], sa(net.ep_a, 9090));
    // … but the client's flow still sticks to ep-b through its conntrack entry.
    assert_eq!(
        ask(&client, net),
        "ep-b",
        "without cleanup the flow stays on the removed endpoint"
    );

    let family = net.family;
    let stats = node
        .run(move || Cleaner::new(family).after_sync(&prev, &next, &changed))
        .unwrap()
        .unwrap();
    assert_eq!((stats.stale, stats.deleted), (1, 1), "{stats:?}");
    assert_eq!(
        ask(&client, net),
        "ep-a",
        "after cleanup the flow moved to the remaining endpoint"
    );
    assert_eq!(ask(&client, net), "ep-a");
}

#[test]
fn udp_flow_moves_to_the_remaining_endpoint_after_cleanup() {
    if !require_root() {
        return;
    }
    udp_flow_moves(&NET_V4);
}

#[test]
fn udp_flow_moves_to_the_remaining_endpoint_after_cleanup_ipv6() {
    if !require_root() {
        return;
    }
    udp_flow_moves(&NET_V6);
}

#[test]
fn large_tables_span_many_dump_datagrams_and_delete_batches() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("ct-many").unwrap();
    let mut tracker = Tracker::new(NODE);
    let (snap, _) = step(&mut tracker, &manifests(&["10.240.0.4"], &[]));
    // More stale entries than one delete batch holds (twice over), and more entries in all
    // than one dump datagram carries.
    let stale = 2 * kproxy::dataplane::netfilter::conntrack::netlink::DELETE_BATCH + 44;
    let kept = 20;
    // One `conntrack -I` per entry, batched through one shell per 100 entries.
    let lines: Vec<String> = (0..stale + kept)
        .map(|i| {
            let reply_src = if i < stale {
                "10.240.0.5"
            } else {
                "10.240.0.4"
            };
            let sport = 20000 + i;
            format!(
                "conntrack -I -p udp -s 10.0.1.2 -d 172.30.1.1 --sport {sport} --dport 8000 \
                 --reply-src {reply_src} --reply-dst 10.0.1.2 --reply-port-src 9090 \
                 --reply-port-dst {sport} -t 600 2>/dev/null || exit 1"
            )
        })
        .collect();
    for chunk in lines.chunks(100) {
        ns.exec("sh", &["-c", &chunk.join("\n")]).unwrap();
    }
    let listed = ns
        .run(|| kproxy::dataplane::netfilter::conntrack::list(IpFamily::V4))
        .unwrap()
        .unwrap()
        .entries
        .len();
    assert_eq!(listed, stale + kept);

    let stats = ns
        .run(move || Cleaner::new(IpFamily::V4).reconcile(&snap))
        .unwrap()
        .unwrap();
    eprintln!("cleanup of {} entries: {stats:?}", stale + kept);
    assert_eq!(
        (stats.listed, stats.stale, stats.deleted, stats.already_gone),
        (stale + kept, stale, stale, 0),
        "{stats:?}"
    );
    let left = netlink_keys(&ns);
    assert_eq!(left, [k(17, "172.30.1.1", 8000, "10.240.0.4", 9090)].into());
    let tool = ns.exec("conntrack", &["-L", "-f", "ipv4"]).unwrap();
    assert_eq!(tool.lines().count(), kept, "{tool}");
}
