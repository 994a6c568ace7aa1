//! The IPVS proxier against a real kernel: these tests need IPVS, which the development hosts
//! lack, so `cargo xtask guest` (part of `cargo xtask test`) runs this binary (the ordinary host
//! build, with its shared libraries) inside a QEMU guest booting Debian's kernel (see
//! xtask/src/guest.rs), with `--include-ignored`: on the host they are `#[ignore]`d, so a
//! host run counts them as ignored rather than passed. On a host that has IPVS,
//! `cargo test --test ipvs_guest -- --include-ignored` runs them directly.
//!
//! Topology per test (namespaces, unique names):
//!
//! ```text
//!   pod1 10.244.1.2 ──veth── node ──veth── pod2 10.244.2.2
//!                             │ 192.168.77.1   (IPVS, kube-ipvs0, ipsets, iptables-legacy)
//!                           veth
//!                             │ 192.168.77.2
//!                           client
//! ```
//!
//! Each pod runs a TCP server on :8080 that sends its name, then echoes lines.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use kproxy::dataplane::Dataplane as _;
use kproxy::dataplane::ipvs::genl::{IpvsHandle, SVC_F_PERSISTENT, ServiceKey};
use kproxy::dataplane::ipvs::{IpvsConfig, IpvsDataplane};
use kproxy::model::{
    ChangedSet, Endpoint, IpFamily, Protocol, ServicePort, ServiceType, Snapshot, testing,
};
use kproxy_tests::netns::{Netns, Veth, VethEnd, require_root};

const NODE_IP: &str = "192.168.77.1";
const CLIENT_IP: &str = "192.168.77.2";
const CLUSTER_IP: &str = "10.96.0.10";
const NODE_IP6: &str = "fd00:77::1";
const CLUSTER_IP6: &str = "fd00:96::10";
const NODE_PORT: u16 = 30080;

/// True when the tests can run here (in the guest, or on a host with IPVS); else "skipped".
fn ipvs_available() -> bool {
    if !require_root() {
        return false;
    }
    if std::env::var("KPROXY_IN_GUEST").is_ok_and(|v| v == "1") {
        return true;
    }
    match kproxy::dataplane::ipvs::usable() {
        Ok(()) => true,
        Err(why) => {
            eprintln!(
                "skipped: IPVS is not usable on this host ({why}); `cargo xtask guest` runs \
                 these tests in a QEMU guest"
            );
            false
        }
    }
}

struct Topo {
    node: Netns,
    _pods: Vec<Netns>,
    client: Netns,
    _veths: Vec<Veth>,
}

fn pod_ip(i: usize) -> IpAddr {
    format!("10.244.{i}.2").parse().unwrap()
}

impl Topo {
    fn new(test: &str) -> anyhow::Result<Topo> {
        let node = Netns::new(&format!("{test}-node"))?;
        let client = Netns::new(&format!("{test}-cl"))?;
        let mut veths = vec![];
        let mut pods = vec![];
        for i in 1..=2 {
            let pod = Netns::new(&format!("{test}-pod{i}"))?;
            let node_side = format!("10.244.{i}.1/24");
            let pod_side = format!("10.244.{i}.2/24");
            let ifname = format!("pod{i}");
            veths.push(Veth::create(
                VethEnd::new(&node, &ifname).addr(&node_side),
                VethEnd::new(&pod, "eth0").addr(&pod_side),
            )?);
            pod.ip(&["route", "add", "default", "via", &format!("10.244.{i}.1")])?;
            // IPv6 too (nodad: usable at once).
            node.ip(&[
                "addr",
                "add",
                &format!("fd00:244:{i}::1/64"),
                "dev",
                &ifname,
                "nodad",
            ])?;
            pod.ip(&[
                "addr",
                "add",
                &format!("fd00:244:{i}::2/64"),
                "dev",
                "eth0",
                "nodad",
            ])?;
            pod.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &format!("fd00:244:{i}::1"),
            ])?;
            let name = format!("pod{i}");
            pod.spawn(move || serve(&name))?;
            let name = format!("pod{i}");
            pod.spawn(move || serve_udp(&name))?;
            pods.push(pod);
        }
        let node_cidr = format!("{NODE_IP}/24");
        let client_cidr = format!("{CLIENT_IP}/24");
        veths.push(Veth::create(
            VethEnd::new(&node, "cl0").addr(&node_cidr),
            VethEnd::new(&client, "eth0").addr(&client_cidr),
        )?);
        client.ip(&["route", "add", "default", "via", NODE_IP])?;
        node.ip(&[
            "addr",
            "add",
            &format!("{NODE_IP6}/64"),
            "dev",
            "cl0",
            "nodad",
        ])?;
        client.ip(&["addr", "add", "fd00:77::2/64", "dev", "eth0", "nodad"])?;
        client.ip(&["-6", "route", "add", "default", "via", NODE_IP6])?;
        Ok(Topo {
            node,
            _pods: pods,
            client,
            _veths: veths,
        })
    }

    fn config(&self) -> IpvsConfig {
        let mut cfg = IpvsConfig::new(IpFamily::V4, vec![NODE_IP.parse().unwrap()]);
        cfg.cluster_cidr = Some("10.244.0.0/16".parse().unwrap());
        cfg
    }

    fn dataplane(&self) -> anyhow::Result<IpvsDataplane> {
        let cfg = self.config();
        Ok(self.node.run(move || IpvsDataplane::new(cfg))??)
    }

    fn ipvs(&self) -> anyhow::Result<IpvsHandle> {
        Ok(self.node.run(IpvsHandle::open)??)
    }

    /// Connects from the client and returns who answered.
    fn ask(&self, addr: SocketAddr) -> anyhow::Result<String> {
        let (_stream, name) = self.connect(addr)?;
        Ok(name)
    }

    /// `n` connections from the client: answers counted per backend name.
    fn tally(&self, addr: SocketAddr, n: usize) -> anyhow::Result<BTreeMap<String, usize>> {
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            *counts.entry(self.ask(addr)?).or_insert(0) += 1;
        }
        Ok(counts)
    }

    /// A connection from the client that stays open, with the answering backend's name.
    fn connect(&self, addr: SocketAddr) -> anyhow::Result<(BufReader<TcpStream>, String)> {
        self.client.run(move || -> anyhow::Result<_> {
            let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                .with_context(|| format!("connecting to {addr}"))?;
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            let mut r = BufReader::new(s);
            let mut name = String::new();
            r.read_line(&mut name)
                .with_context(|| format!("reading the greeting of {addr}"))?;
            Ok((r, name.trim().to_string()))
        })?
    }
}

/// One datagram from a fresh client socket (a new IPVS "connection"); who answered.
fn ask_udp(client: &Netns, addr: SocketAddr) -> anyhow::Result<String> {
    client.run(move || -> anyhow::Result<String> {
        let bind = if addr.is_ipv6() {
            "[::]:0"
        } else {
            "0.0.0.0:0"
        };
        let s = UdpSocket::bind(bind)?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.send_to(b"who", addr)?;
        let mut buf = [0u8; 64];
        let (n, _) = s
            .recv_from(&mut buf)
            .with_context(|| format!("no UDP answer from {addr}"))?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })?
}

/// A UDP server on :5353 answering every datagram with `name`.
fn serve_udp(name: &str) -> anyhow::Result<()> {
    let s = UdpSocket::bind("[::]:5353")?;
    let mut buf = [0u8; 64];
    loop {
        let (_, from) = s.recv_from(&mut buf)?;
        s.send_to(name.as_bytes(), from)?;
    }
}

/// Echo check on an open connection.
fn echo(conn: &mut BufReader<TcpStream>) -> anyhow::Result<()> {
    conn.get_mut().write_all(b"ping\n")?;
    let mut line = String::new();
    conn.read_line(&mut line)?;
    ensure!(line == "ping\n", "echo returned {line:?}");
    Ok(())
}

/// `SO_LINGER {on, 0}`: `close` sends a RST.
fn set_linger_zero(s: &TcpStream) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd as _;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a linger struct of the size passed on a valid socket.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as u32,
        )
    };
    ensure!(rc == 0, "SO_LINGER: {}", std::io::Error::last_os_error());
    Ok(())
}

/// A TCP server on :8080 that greets with `name` and echoes lines (runs for the test's life).
fn serve(name: &str) -> anyhow::Result<()> {
    // [::] takes IPv4 too (bindv6only is 0).
    let listener = TcpListener::bind("[::]:8080")?;
    let name: Arc<str> = name.into();
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let name = name.clone();
        std::thread::spawn(move || {
            let _ = writeln!(conn, "{name}");
            let Ok(read) = conn.try_clone() else { return };
            for line in BufReader::new(read).lines() {
                let Ok(line) = line else { return };
                if writeln!(conn, "{line}").is_err() {
                    return;
                }
            }
        });
    }
    Ok(())
}

fn service(name: &str, node_port: u16, affinity: Option<u32>) -> ServicePort {
    let b = testing::service_port("default", name, "http")
        .cluster_ip(CLUSTER_IP)
        .affinity(affinity);
    if node_port != 0 {
        b.node_port(node_port)
    } else {
        b
    }
    .build()
}

fn endpoint(i: usize) -> Endpoint {
    testing::endpoint(pod_ip(i), 8080)
        .local_on("node", "node2", true)
        .build()
}

fn snapshot(svc: ServicePort, endpoints: Vec<Endpoint>) -> Snapshot {
    testing::snapshot("node")
        .node_addresses([NODE_IP])
        .service(svc, endpoints)
        .build()
}

fn vip() -> SocketAddr {
    SocketAddr::new(CLUSTER_IP.parse().unwrap(), 80)
}

fn cluster_key() -> ServiceKey {
    ServiceKey {
        addr: CLUSTER_IP.parse().unwrap(),
        protocol: Protocol::Tcp,
        port: 80,
    }
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn cluster_ip_balances_across_two_backends() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-cip")?;
    let mut dp = t.dataplane()?;
    let report = dp.sync(
        &snapshot(service("web", 0, None), vec![endpoint(1), endpoint(2)]),
        &ChangedSet::default(),
    )?;
    assert_eq!(
        (report.services, report.endpoints, report.failed_services),
        (1, 2, 0)
    );

    let counts = t.tally(vip(), 20)?;
    // rr alternates strictly between the two real servers.
    assert_eq!(
        counts,
        BTreeMap::from([("pod1".to_string(), 10), ("pod2".to_string(), 10)])
    );

    // The objects around it: the VIP on kube-ipvs0, the ipset entry, the iptables chains.
    let addrs = t.node.ip(&["-o", "addr", "show", "dev", "kube-ipvs0"])?;
    assert!(addrs.contains("10.96.0.10/32"), "{addrs}");
    let set = t.node.exec("ipset", &["list", "KUBE-CLUSTER-IP"])?;
    assert!(set.contains("10.96.0.10,tcp:80"), "{set}");
    let nat = t.node.exec("iptables-save", &["-t", "nat"])?;
    assert!(
        nat.contains(
            "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
        ),
        "{nat}"
    );
    assert!(
        nat.contains(
            "-A KUBE-SERVICES ! -s 10.244.0.0/16 -m comment --comment \"Kubernetes service cluster \
             ip + port for masquerade purpose\" -m set --match-set KUBE-CLUSTER-IP dst,dst -j \
             KUBE-MARK-MASQ"
        ),
        "{nat}"
    );
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn node_port_reaches_both_backends() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-np")?;
    let mut dp = t.dataplane()?;
    dp.sync(
        &snapshot(
            service("web", NODE_PORT, None),
            vec![endpoint(1), endpoint(2)],
        ),
        &ChangedSet::default(),
    )?;
    let np = SocketAddr::new(NODE_IP.parse().unwrap(), NODE_PORT);
    let counts = t.tally(np, 10)?;
    assert_eq!(counts.get("pod1"), Some(&5), "{counts:?}");
    assert_eq!(counts.get("pod2"), Some(&5), "{counts:?}");
    // The ClusterIP of the same service still works.
    assert!(t.ask(vip())?.starts_with("pod"));
    let set = t.node.exec("ipset", &["list", "KUBE-NODE-PORT-TCP"])?;
    assert!(set.contains("30080"), "{set}");
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn client_ip_affinity_pins_one_backend() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-aff")?;
    let mut dp = t.dataplane()?;
    dp.sync(
        &snapshot(service("web", 0, Some(600)), vec![endpoint(1), endpoint(2)]),
        &ChangedSet::default(),
    )?;
    let counts = t.tally(vip(), 10)?;
    assert_eq!(counts.len(), 1, "one backend for one client: {counts:?}");
    assert_eq!(counts.values().sum::<usize>(), 10);
    let svc = t
        .ipvs()?
        .services()?
        .into_iter()
        .find(|s| s.key == cluster_key())
        .context("cluster IP virtual service")?;
    assert_eq!(
        (svc.flags & SVC_F_PERSISTENT, svc.timeout),
        (SVC_F_PERSISTENT, 600)
    );
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn removed_endpoint_drains_then_disappears() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-drain")?;
    let mut dp = t.dataplane()?;
    let svc = service("web", 0, None);
    dp.sync(
        &snapshot(svc.clone(), vec![endpoint(1), endpoint(2)]),
        &ChangedSet::default(),
    )?;
    let (mut old, name) = t.connect(vip())?;
    let (gone, stays) = if name == "pod1" { (1, 2) } else { (2, 1) };

    // The endpoint goes away: weight 0, the open connection continues, new ones avoid it.
    dp.sync(
        &snapshot(svc.clone(), vec![endpoint(stays)]),
        &ChangedSet::default(),
    )?;
    let mut ipvs = t.ipvs()?;
    let dests = ipvs.destinations(&cluster_key())?;
    let draining = dests
        .iter()
        .find(|d| d.addr == pod_ip(gone))
        .context("the removed endpoint drains instead of vanishing")?;
    assert_eq!(draining.weight, 0);
    assert!(draining.active_conns >= 1, "{draining:?}");
    let counts = t.tally(vip(), 6)?;
    assert_eq!(counts, BTreeMap::from([(format!("pod{stays}"), 6)]));
    echo(&mut old)?;

    // Once its connection is closed (RST: IPVS keeps a closed TCP entry 10 s), a later sync
    // removes the real server.
    set_linger_zero(old.get_ref())?;
    drop(old);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        dp.sync(
            &snapshot(svc.clone(), vec![endpoint(stays)]),
            &ChangedSet::default(),
        )?;
        let dests = ipvs.destinations(&cluster_key())?;
        if !dests.iter().any(|d| d.addr == pod_ip(gone)) {
            assert_eq!(dests.len(), 1);
            break;
        }
        if Instant::now() > deadline {
            bail!("drained real server still present after 90 s: {dests:?}");
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    dp.cleanup()?;
    Ok(())
}

/// The bench's `change/ipvs` pattern: one service's single backend alternates between two
/// pods while a connection to the old one stays open (it drains), among many unchanged
/// services. Each change-driven sync lists the real servers of the changed service only
/// (one netlink dump, not one per virtual service), and new connections reach the new
/// backend every time.
#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn alternating_one_backend_lists_only_the_changed_services_real_servers() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    const FILLERS: usize = 40;
    let t = Topo::new("ipvs-flip")?;
    let mut dp = t.dataplane()?;
    let build = |target: usize| -> Snapshot {
        let mut b = testing::snapshot("node")
            .node_addresses([NODE_IP])
            .service(service("web", 0, None), vec![endpoint(target)]);
        for i in 0..FILLERS {
            let svc = testing::service_port("default", &format!("f{i}"), "http")
                .cluster_ip(&format!("10.96.1.{}", i + 1))
                .build();
            b = b.service(svc, vec![endpoint(1), endpoint(2)]);
        }
        b.build()
    };
    let started = Instant::now();
    dp.sync(&build(1), &ChangedSet::default())?;
    let (mut held, first) = t.connect(vip())?;
    assert_eq!(first, "pod1");
    let mut checked = 0;
    for (k, to) in [2, 1, 2, 1].into_iter().enumerate() {
        let before = dp.destination_listings();
        dp.sync(&build(to), &ChangedSet::default())?;
        let listed = dp.destination_listings() - before;
        // A full reconcile (every RECONCILE_EVERY) lists everything, on purpose.
        if started.elapsed() < kproxy::dataplane::ipvs::RECONCILE_EVERY {
            assert!(
                listed <= 1,
                "change {k}: {listed} real-server listings for one changed service"
            );
            checked += 1;
        }
        let counts = t.tally(vip(), 4)?;
        assert_eq!(
            counts,
            BTreeMap::from([(format!("pod{to}"), 4)]),
            "change {k}"
        );
    }
    assert!(
        checked >= 1,
        "no change was synced within the reconcile interval"
    );
    // The drained connection still works.
    echo(&mut held)?;
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn restart_reconciles_without_disturbing_live_connections() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-restart")?;
    let snap = snapshot(
        service("web", NODE_PORT, None),
        vec![endpoint(1), endpoint(2)],
    );
    let mut first = t.dataplane()?;
    first.sync(&snap, &ChangedSet::default())?;
    let mut ipvs = t.ipvs()?;
    let before = ipvs.services()?;
    let (mut conn, _) = t.connect(vip())?;
    drop(first); // a crash or restart: no cleanup

    let mut second = t.dataplane()?;
    let report = second.sync(&snap, &ChangedSet::default())?;
    assert_eq!(report.failed_services, 0);
    assert_eq!(ipvs.services()?, before);
    // Not re-created: the connection entry (and the connection) survived.
    let active: u32 = ipvs
        .destinations(&cluster_key())?
        .iter()
        .map(|d| d.active_conns)
        .sum();
    assert!(active >= 1, "live connection lost its IPVS entry");
    echo(&mut conn)?;

    // A stale virtual service (from an older run) is removed, the address unbound.
    let mut other = service("old", 0, None);
    other.cluster_ips = vec!["10.96.0.99".parse().unwrap()];
    let mut with_old = snap.clone();
    with_old
        .services
        .insert(other.name.clone(), Arc::new(other.clone()));
    second.sync(&with_old, &ChangedSet::default())?;
    assert!(
        t.node
            .ip(&["-o", "addr", "show", "dev", "kube-ipvs0"])?
            .contains("10.96.0.99")
    );
    second.sync(&snap, &ChangedSet::default())?;
    assert!(
        !ipvs
            .services()?
            .iter()
            .any(|s| s.key.addr.to_string() == "10.96.0.99")
    );
    assert!(
        !t.node
            .ip(&["-o", "addr", "show", "dev", "kube-ipvs0"])?
            .contains("10.96.0.99")
    );
    echo(&mut conn)?;
    second.cleanup()?;
    Ok(())
}

/// The members of ipset `name` in the node namespace, sorted.
fn set_members(t: &Topo, name: &str) -> anyhow::Result<Vec<String>> {
    let text = t.node.exec("ipset", &["list", name])?;
    let mut members: Vec<String> = text
        .lines()
        .skip_while(|l| !l.starts_with("Members:"))
        .skip(1)
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_string())
        .collect();
    members.sort();
    Ok(members)
}

/// Endpoint changes reach the ipsets by their difference (`KUBE-LOOP-BACK` holds one entry
/// per local endpoint): after each sync the sets hold exactly the planned entries, and
/// traffic follows every change.
#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn endpoint_changes_update_the_ipsets_by_their_difference() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-sets")?;
    let mut dp = t.dataplane()?;
    let loopback = |i: usize| format!("{ip},tcp:8080,{ip}", ip = pod_ip(i));
    for (k, pods) in [vec![1], vec![2], vec![1, 2], vec![1], vec![]]
        .into_iter()
        .enumerate()
    {
        let eps = pods.iter().map(|&i| endpoint(i)).collect();
        dp.sync(
            &snapshot(service("web", 0, None), eps),
            &ChangedSet::default(),
        )?;
        let want: Vec<String> = pods.iter().map(|&i| loopback(i)).collect();
        assert_eq!(set_members(&t, "KUBE-LOOP-BACK")?, want, "change {k}");
        assert_eq!(
            set_members(&t, "KUBE-CLUSTER-IP")?,
            [format!("{CLUSTER_IP},tcp:80")],
            "change {k}"
        );
        if let Some(&last) = pods.last() {
            let counts = t.tally(vip(), 2 * pods.len())?;
            assert_eq!(
                counts.get(&format!("pod{last}")).copied(),
                Some(2),
                "change {k}"
            );
        }
    }
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn cleanup_removes_everything() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-clean")?;
    let mut dp = t.dataplane()?;
    dp.sync(
        &snapshot(
            service("web", NODE_PORT, Some(60)),
            vec![endpoint(1), endpoint(2)],
        ),
        &ChangedSet::default(),
    )?;
    assert_eq!(t.ipvs()?.services()?.len(), 2, "ClusterIP + NodePort");
    dp.cleanup()?;
    assert_clean(&t)
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn cleanup_leftovers_removes_what_a_dead_instance_left() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-leftover")?;
    let mut dp = t.dataplane()?;
    dp.sync(
        &snapshot(
            service("web", NODE_PORT, None),
            vec![endpoint(1), endpoint(2)],
        ),
        &ChangedSet::default(),
    )?;
    drop(dp);
    assert_eq!(t.ipvs()?.services()?.len(), 2);
    let cfg = t.config();
    t.node
        .run(move || kproxy::dataplane::ipvs::cleanup_leftovers(cfg))??;
    assert_clean(&t)
}

/// No virtual service, dummy device, KUBE chain or set is left in the node namespace, and the
/// VIP no longer answers.
fn assert_clean(t: &Topo) -> anyhow::Result<()> {
    assert!(t.ipvs()?.services()?.is_empty());
    let links = t.node.ip(&["-o", "link", "show"])?;
    assert!(!links.contains("kube-ipvs0"), "{links}");
    for table in ["nat", "filter"] {
        let rules = t.node.exec("iptables-save", &["-t", table])?;
        assert!(!rules.contains("KUBE-"), "{table}: {rules}");
    }
    let sets = t.node.exec("ipset", &["list", "-n"])?;
    assert!(!sets.contains("KUBE-"), "{sets}");
    // The backends are untouched and the VIP no longer answers.
    assert!(
        t.client
            .run(|| TcpStream::connect_timeout(&vip(), Duration::from_secs(2)).is_err())?
    );
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn timeouts_and_sysctls_are_applied_at_creation() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-sysctl")?;
    let mut cfg = t.config();
    cfg.strict_arp = true;
    cfg.timeouts = kproxy::dataplane::ipvs::genl::Timeouts {
        tcp: 900,
        tcp_fin: 30,
        udp: 60,
    };
    let _dp = t.node.run(move || IpvsDataplane::new(cfg))??;
    assert_eq!(
        t.ipvs()?.timeouts()?,
        kproxy::dataplane::ipvs::genl::Timeouts {
            tcp: 900,
            tcp_fin: 30,
            udp: 60
        }
    );
    let read = |key: &'static str| -> anyhow::Result<String> {
        let path = format!("/proc/sys/{key}");
        Ok(t.node
            .run(move || std::fs::read_to_string(path))??
            .trim()
            .to_string())
    };
    for (key, want) in [
        ("net/ipv4/vs/conntrack", "1"),
        ("net/ipv4/vs/expire_nodest_conn", "1"),
        ("net/ipv4/vs/expire_quiescent_template", "1"),
        ("net/ipv4/ip_forward", "1"),
        ("net/ipv4/conf/all/arp_ignore", "1"),
        ("net/ipv4/conf/all/arp_announce", "2"),
    ] {
        assert_eq!(read(key)?, want, "{key}");
    }
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn bad_config_is_refused_before_touching_the_kernel() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-badcfg")?;
    let mut cfg = t.config();
    cfg.scheduler = "fastest".into();
    let err = t
        .node
        .run(move || IpvsDataplane::new(cfg).map(drop))?
        .unwrap_err()
        .to_string();
    assert!(err.contains("ipvs.scheduler \"fastest\""), "{err}");
    assert!(t.ipvs()?.services()?.is_empty());
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn ipv6_cluster_ip_and_node_port_balance_across_two_backends() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-v6")?;
    let mut cfg = IpvsConfig::new(IpFamily::V6, vec![NODE_IP6.parse().unwrap()]);
    cfg.cluster_cidr = Some("fd00:244::/32".parse().unwrap());
    let mut dp = t.node.run(move || IpvsDataplane::new(cfg))??;
    let mut svc = service("web6", NODE_PORT, None);
    svc.cluster_ips = vec![CLUSTER_IP6.parse().unwrap()];
    let eps = (1..=2)
        .map(|i| Endpoint {
            ip: format!("fd00:244:{i}::2").parse().unwrap(),
            ..endpoint(i)
        })
        .collect();
    let report = dp.sync(&snapshot(svc, eps), &ChangedSet::default())?;
    assert_eq!(
        (report.services, report.endpoints, report.failed_services),
        (1, 2, 0)
    );
    for addr in [
        SocketAddr::new(CLUSTER_IP6.parse().unwrap(), 80),
        SocketAddr::new(NODE_IP6.parse().unwrap(), NODE_PORT),
    ] {
        let counts = t.tally(addr, 6)?;
        assert_eq!(
            counts,
            BTreeMap::from([("pod1".to_string(), 3), ("pod2".to_string(), 3)]),
            "{addr}"
        );
    }
    let set = t.node.exec("ipset", &["list", "KUBE-6-CLUSTER-IP"])?;
    assert!(set.contains("fd00:96::10,tcp:80"), "{set}");
    let nat = t.node.exec("ip6tables-save", &["-t", "nat"])?;
    assert!(
        nat.contains("-A KUBE-SERVICES -s ::1/128 -j RETURN"),
        "{nat}"
    );
    dp.cleanup()?;
    assert!(t.ipvs()?.services()?.is_empty());
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn udp_service_balances_and_drops_removed_endpoints_at_once() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-udp")?;
    let mut dp = t.dataplane()?;
    let mut svc = service("dns", 0, None);
    svc.protocol = Protocol::Udp;
    svc.name = kproxy::model::ServicePortName::new(
        &*svc.name.namespace,
        &*svc.name.name,
        &*svc.name.port,
        Protocol::Udp,
    );
    svc.port = 53;
    let ep = |i| Endpoint {
        port: 5353,
        ..endpoint(i)
    };
    dp.sync(
        &snapshot(svc.clone(), vec![ep(1), ep(2)]),
        &ChangedSet::default(),
    )?;
    let vip = SocketAddr::new(CLUSTER_IP.parse().unwrap(), 53);
    let mut counts = BTreeMap::new();
    for _ in 0..6 {
        *counts.entry(ask_udp(&t.client, vip)?).or_insert(0) += 1;
    }
    assert_eq!(
        counts,
        BTreeMap::from([("pod1".to_string(), 3), ("pod2".to_string(), 3)])
    );

    // UDP real servers are removed at once (no draining), like upstream.
    dp.sync(&snapshot(svc.clone(), vec![ep(2)]), &ChangedSet::default())?;
    let key = ServiceKey {
        addr: CLUSTER_IP.parse().unwrap(),
        protocol: Protocol::Udp,
        port: 53,
    };
    let dests = t.ipvs()?.destinations(&key)?;
    assert_eq!(
        dests.iter().map(|d| (d.addr, d.weight)).collect::<Vec<_>>(),
        vec![(pod_ip(2), 1)]
    );
    for _ in 0..4 {
        assert_eq!(ask_udp(&t.client, vip)?, "pod2");
    }
    dp.cleanup()?;
    Ok(())
}

#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn load_balancer_source_ranges_admit_only_listed_clients() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    let t = Topo::new("ipvs-lbsr")?;
    let mut dp = t.dataplane()?;
    let lb_ip: IpAddr = "198.51.100.1".parse().unwrap();
    let mut svc = service("lb", NODE_PORT, None);
    svc.service_type = ServiceType::LoadBalancer;
    svc.load_balancer_ingress = vec![kproxy::model::LoadBalancerIngress {
        ip: lb_ip,
        ip_mode: kproxy::model::IpMode::Vip,
    }];
    let lb = SocketAddr::new(lb_ip, 80);

    // The client's range is listed: it gets through, balanced.
    svc.load_balancer_source_ranges = vec!["192.168.77.0/24".parse().unwrap()];
    dp.sync(
        &snapshot(svc.clone(), vec![endpoint(1), endpoint(2)]),
        &ChangedSet::default(),
    )?;
    let counts = t.tally(lb, 4)?;
    assert_eq!(
        counts,
        BTreeMap::from([("pod1".to_string(), 2), ("pod2".to_string(), 2)])
    );

    // Only another range is listed: the client's SYN is dropped (KUBE-SOURCE-RANGES-FIREWALL).
    svc.load_balancer_source_ranges = vec!["10.99.0.0/16".parse().unwrap()];
    dp.sync(
        &snapshot(svc.clone(), vec![endpoint(1), endpoint(2)]),
        &ChangedSet::default(),
    )?;
    let refused = t
        .client
        .run(move || TcpStream::connect_timeout(&lb, Duration::from_secs(3)))?;
    assert!(
        refused.is_err(),
        "connection from an unlisted range succeeded"
    );
    let sets = t
        .node
        .exec("ipset", &["list", "KUBE-LOAD-BALANCER-SOURCE-CIDR"])?;
    assert!(sets.contains("198.51.100.1,tcp:80,10.99.0.0/16"), "{sets}");
    dp.cleanup()?;
    Ok(())
}

/// The agent's path: `registry::build` constructs the IPVS mode from a resolved
/// `ProxyConfig` (flags), it balances a ClusterIP, and `registry::cleanup_all` (`kproxy
/// cleanup`) removes everything.
#[test]
#[ignore = "needs IPVS: `cargo xtask guest` (part of `cargo xtask test`) runs it in a QEMU guest"]
fn factory_builds_ipvs_from_the_config_and_cleanup_all_removes_it() -> anyhow::Result<()> {
    if !ipvs_available() {
        return Ok(());
    }
    use kproxy::app::registry;
    use kproxy::dataplane::ProxyMode;
    let t = Topo::new("ipvs-factory")?;
    let inv = kproxy::cli::parse(
        [
            "kproxy",
            "--proxy-mode=ipvs",
            "--cluster-cidr=10.244.0.0/16",
            "--ipvs-scheduler=rr",
            "--bpffs=/nonexistent/kproxy-bpffs",
        ]
        .map(std::ffi::OsString::from),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    let cfg = kproxy::cli::load(&inv, Some("n".into()))?.config;
    let snap = snapshot(
        service("web", NODE_PORT, None),
        vec![endpoint(1), endpoint(2)],
    );
    let c = cfg.clone();
    let dp = t.node.run(move || -> anyhow::Result<_> {
        let mut dp = registry::build(ProxyMode::Ipvs, &c, &[], None, None)?;
        let r = dp.sync(&snap, &ChangedSet::default())?;
        ensure!(r.services >= 1 && r.failed_services == 0, "{r:?}");
        Ok(dp)
    })??;
    assert_eq!(dp.mode(), ProxyMode::Ipvs);
    let counts = t.tally(vip(), 20)?;
    assert_eq!(
        counts,
        BTreeMap::from([("pod1".to_string(), 10), ("pod2".to_string(), 10)])
    );
    let c = cfg.clone();
    t.node.run(move || registry::cleanup_all(&c))??;
    drop(dp);
    assert_clean(&t)
}
