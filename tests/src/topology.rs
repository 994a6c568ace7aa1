//! The shared traffic-test topology: a node (where the datapath under test runs), pods on it, a
//! second node with remote pods, and an external client — routed like a CNI (Calico/Cilium
//! style: one veth per pod, /32 (/128) pod addresses, the node as every pod's gateway).
//!
//! ```text
//!   pod-l0 10.244.1.2 ─┐                                  ┌─ pod-r0 10.244.2.2
//!   pod-l1 10.244.1.3 ─┤ vpodN            vpodN           ├─ pod-r1 10.244.2.3
//!                    node ──eth1────────eth0── node2
//!      192.168.77.1  │  192.168.78.1   192.168.78.2
//!                  eth0
//!                    │ 192.168.77.2
//!                  client (default route via node)
//! ```
//!
//! IPv6 (when [`TopologySpec::ipv6`]): the same shape with `fd00:77::/64`, `fd00:78::/64`,
//! `fd00:244:1::N`, `fd00:244:2::N`. Every pod gets address `.2 + i` (`::2 + i`) in its node's pod
//! CIDR; the node side of each pod veth holds the gateway `10.244.X.1/32` (`fd00:244:X::1/128`).
//! Forwarding is on in both nodes; `rp_filter` is left at the namespace default (0).
//!
//! Traffic: [`Pod::serve`] starts `kp-probe serve` (TCP and UDP, answering with the pod's name and
//! the peer address it saw); [`probe`] / [`Probe`] run `kp-probe` clients in any namespace,
//! optionally inside a [`TestCgroup`] (socket-LB tests), and parse their JSON. Everything is
//! removed on drop (servers killed, namespaces deleted).
//!
//! Binaries: [`target_bin`] finds `kp-probe` (this package) and `kproxy` (the agent; `cargo
//! xtask test` builds it before the tests) next to the running test executable.

use std::collections::BTreeMap;
use std::io::{BufRead as _, BufReader};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context as _, bail};
use serde::Deserialize;

use crate::netns::{Netns, TestCgroup, Veth, VethEnd, run_checked};

/// Node address on the client link.
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 1);
pub const NODE_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 1);
/// The external client.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 2);
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x77, 0, 0, 0, 0, 0, 2);
/// Node address on the node-to-node link.
pub const NODE_LINK_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 1);
pub const NODE_LINK_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 1);
/// The second node.
pub const NODE2_IP: Ipv4Addr = Ipv4Addr::new(192, 168, 78, 2);
pub const NODE2_IP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x78, 0, 0, 0, 0, 0, 2);
/// Interface names inside `node`.
pub const NODE_CLIENT_IF: &str = "eth0";
pub const NODE_PEER_IF: &str = "eth1";
/// Pod CIDRs of the two nodes (what a Node object's `podCIDRs` would say).
pub const NODE_POD_CIDR: &str = "10.244.1.0/24";
pub const NODE2_POD_CIDR: &str = "10.244.2.0/24";
pub const NODE_POD_CIDR6: &str = "fd00:244:1::/64";
pub const NODE2_POD_CIDR6: &str = "fd00:244:2::/64";
/// The port every `kp-probe serve` started by [`Pod::serve`] listens on (TCP and UDP).
pub const POD_PORT: u16 = 8080;

/// What to build.
#[derive(Debug, Clone)]
pub struct TopologySpec {
    /// Test name (becomes part of every namespace name).
    pub hint: String,
    /// Pods on `node`.
    pub local_pods: usize,
    /// Pods on `node2`; 0 means no second node at all.
    pub remote_pods: usize,
    /// Add IPv6 addresses and routes (otherwise IPv6 is disabled in every namespace).
    pub ipv6: bool,
}

impl TopologySpec {
    pub fn new(hint: &str) -> Self {
        TopologySpec {
            hint: hint.to_string(),
            local_pods: 2,
            remote_pods: 0,
            ipv6: false,
        }
    }
    pub fn local_pods(mut self, n: usize) -> Self {
        self.local_pods = n;
        self
    }
    pub fn remote_pods(mut self, n: usize) -> Self {
        self.remote_pods = n;
        self
    }
    pub fn ipv6(mut self, on: bool) -> Self {
        self.ipv6 = on;
        self
    }
    pub fn build(self) -> anyhow::Result<Topology> {
        Topology::build(self)
    }
}

/// Which node a pod runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PodNode {
    Local,
    Remote,
}

/// One pod: its namespace, addresses and (once started) its server.
#[derive(Debug)]
pub struct Pod {
    /// `pod-l0`, `pod-r1`, …: what its server answers with.
    pub name: String,
    pub on: PodNode,
    pub ip: Ipv4Addr,
    pub ip6: Option<Ipv6Addr>,
    /// The node's interface toward this pod (`vpodN` in `node` or `node2`).
    pub host_if: String,
    pub ns: Netns,
    server: Option<Server>,
}

impl Pod {
    /// Starts `kp-probe serve <name> --tcp 8080 --udp 8080` (plus `extra` ports, e.g.
    /// `["--tcp", "9090"]`) and waits until it listens. Killed when the pod is dropped.
    pub fn serve(&mut self, extra: &[&str]) -> anyhow::Result<()> {
        let port = POD_PORT.to_string();
        let mut cmd = self.ns.command(target_bin("kp-probe")?);
        cmd.args(["serve", &self.name, "--tcp", &port, "--udp", &port])
            .args(extra);
        self.server = Some(Server::start(cmd, &self.name)?);
        Ok(())
    }

    /// Stops the pod's server (e.g. to make an endpoint disappear for real).
    pub fn stop(&mut self) {
        self.server = None;
    }

    /// `ip:8080` of the given family.
    pub fn addr(&self, v6: bool) -> String {
        match (v6, self.ip6) {
            (true, Some(ip6)) => format!("[{ip6}]:{POD_PORT}"),
            _ => format!("{}:{POD_PORT}", self.ip),
        }
    }
}

/// A background process killed (and reaped) on drop.
#[derive(Debug)]
pub struct Server {
    child: Child,
}

impl Server {
    /// Spawns `cmd` with piped stdout and waits (≤ 10 s) for its first line, `ready`.
    pub fn start(mut cmd: Command, what: &str) -> anyhow::Result<Server> {
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {what}: {cmd:?}"))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let server = Server { child };
        match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) if line.trim() == "ready" => Ok(server),
            Ok(line) => bail!("{what} did not start: said {line:?}"),
            Err(_) => bail!("{what} did not report ready within 10 s"),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The whole topology; see the module docs.
#[derive(Debug)]
pub struct Topology {
    pub spec: TopologySpec,
    /// Local pods first (`pod-l*`), then remote ones (`pod-r*`).
    pub pods: Vec<Pod>,
    pub node: Netns,
    pub node2: Option<Netns>,
    pub client: Netns,
    // Dropped after the pods (their servers) but before the namespaces.
    _veths: Vec<Veth>,
}

impl Topology {
    /// Asserts that TCP connects to `addr` (a service without endpoints) are REJECTed, not
    /// dropped: from the node itself (OUTPUT) every connect is refused at once; through the
    /// node (FORWARD) none is answered and at least one is refused (the kernel rate-limits the
    /// ICMP errors of forwarded packets, so not every SYN gets its port-unreachable back).
    pub fn assert_connects_refused(&self, addr: &str) {
        let local = Probe::tcp(addr, 5)
            .timeout(Duration::from_secs(5))
            .run(&self.node, None)
            .expect("probe");
        assert_eq!(local.total_answers(), 0, "{local:?}");
        assert_eq!(
            local.errors.get("ConnectionRefused"),
            Some(&5),
            "REJECT answers at once (refused, not a timeout): {local:?}"
        );
        self.node
            .sysctl("net.ipv4.icmp_ratelimit", "0")
            .expect("sysctl");
        if self.spec.ipv6 {
            self.node
                .sysctl("net.ipv6.icmp.ratelimit", "0")
                .expect("sysctl");
        }
        let fwd = Probe::tcp(addr, 5)
            .timeout(Duration::from_secs(3))
            .run(&self.client, None)
            .expect("probe");
        assert_eq!(fwd.total_answers(), 0, "{fwd:?}");
        assert!(
            fwd.errors.get("ConnectionRefused").copied().unwrap_or(0) >= 1,
            "forwarded connects are refused: {fwd:?}"
        );
    }

    fn build(spec: TopologySpec) -> anyhow::Result<Topology> {
        let h = &spec.hint;
        let node = Netns::new(&format!("{h}-node"))?;
        let client = Netns::new(&format!("{h}-client"))?;
        let node2 = if spec.remote_pods > 0 {
            Some(Netns::new(&format!("{h}-node2"))?)
        } else {
            None
        };
        let six = spec.ipv6;
        let all_ns: Vec<&Netns> = [&node, &client].into_iter().chain(node2.as_ref()).collect();
        for ns in &all_ns {
            if !six {
                ns.disable_ipv6()?;
            } else {
                // No DAD delays and no router solicitations racing the tests.
                ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
                ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
            }
        }
        for ns in [&node].into_iter().chain(node2.as_ref()) {
            ns.sysctl("net.ipv4.ip_forward", "1")?;
            if six {
                ns.sysctl("net.ipv6.conf.all.forwarding", "1")?;
            }
        }
        let mut veths = Vec::new();

        // node <-> client
        let (n4, c4) = (format!("{NODE_IP}/24"), format!("{CLIENT_IP}/24"));
        veths.push(Veth::create(
            VethEnd::new(&node, NODE_CLIENT_IF).addr(&n4),
            VethEnd::new(&client, "eth0").addr(&c4),
        )?);
        client.ip(&["route", "add", "default", "via", &NODE_IP.to_string()])?;
        if six {
            add_addr6(&node, NODE_CLIENT_IF, &format!("{NODE_IP6}/64"))?;
            add_addr6(&client, "eth0", &format!("{CLIENT_IP6}/64"))?;
            client.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &NODE_IP6.to_string(),
            ])?;
        }

        // node <-> node2
        if let Some(node2) = &node2 {
            let (l4, r4) = (format!("{NODE_LINK_IP}/24"), format!("{NODE2_IP}/24"));
            veths.push(Veth::create(
                VethEnd::new(&node, NODE_PEER_IF).addr(&l4),
                VethEnd::new(node2, "eth0").addr(&r4),
            )?);
            node.add_route(NODE2_POD_CIDR, &NODE2_IP.to_string())?;
            node2.ip(&["route", "add", "default", "via", &NODE_LINK_IP.to_string()])?;
            if six {
                add_addr6(&node, NODE_PEER_IF, &format!("{NODE_LINK_IP6}/64"))?;
                add_addr6(node2, "eth0", &format!("{NODE2_IP6}/64"))?;
                node.ip(&[
                    "-6",
                    "route",
                    "add",
                    NODE2_POD_CIDR6,
                    "via",
                    &NODE2_IP6.to_string(),
                ])?;
                node2.ip(&[
                    "-6",
                    "route",
                    "add",
                    "default",
                    "via",
                    &NODE_LINK_IP6.to_string(),
                ])?;
            }
        }

        let mut pods = Vec::new();
        let plan = (0..spec.local_pods)
            .map(|i| (PodNode::Local, i))
            .chain((0..spec.remote_pods).map(|i| (PodNode::Remote, i)));
        for (on, i) in plan {
            let (host, subnet, tag) = match on {
                PodNode::Local => (&node, 1u8, "l"),
                PodNode::Remote => (node2.as_ref().expect("node2 exists"), 2u8, "r"),
            };
            let name = format!("pod-{tag}{i}");
            let ns = Netns::new(&format!("{h}-{name}"))?;
            if six {
                ns.sysctl("net.ipv6.conf.all.accept_dad", "0")?;
                ns.sysctl("net.ipv6.conf.default.accept_dad", "0")?;
            } else {
                ns.disable_ipv6()?;
            }
            let host_if = format!("vpod{i}");
            let octet = 2 + u8::try_from(i).context("too many pods")?;
            let ip = Ipv4Addr::new(10, 244, subnet, octet);
            let gw = Ipv4Addr::new(10, 244, subnet, 1);
            veths.push(Veth::create(
                VethEnd::new(host, &host_if),
                VethEnd::new(&ns, "eth0"),
            )?);
            host.ip(&["addr", "add", &format!("{gw}/32"), "dev", &host_if])?;
            host.ip(&["route", "add", &format!("{ip}/32"), "dev", &host_if])?;
            ns.ip(&["addr", "add", &format!("{ip}/32"), "dev", "eth0"])?;
            ns.ip(&["route", "add", &gw.to_string(), "dev", "eth0"])?;
            ns.ip(&[
                "route",
                "add",
                "default",
                "via",
                &gw.to_string(),
                "dev",
                "eth0",
            ])?;
            let ip6 = if six {
                let ip6 = Ipv6Addr::new(
                    0xfd00,
                    0x244,
                    u16::from(subnet),
                    0,
                    0,
                    0,
                    0,
                    u16::from(octet),
                );
                let gw6 = Ipv6Addr::new(0xfd00, 0x244, u16::from(subnet), 0, 0, 0, 0, 1);
                add_addr6(host, &host_if, &format!("{gw6}/128"))?;
                host.ip(&["-6", "route", "add", &format!("{ip6}/128"), "dev", &host_if])?;
                add_addr6(&ns, "eth0", &format!("{ip6}/128"))?;
                ns.ip(&["-6", "route", "add", &gw6.to_string(), "dev", "eth0"])?;
                ns.ip(&[
                    "-6",
                    "route",
                    "add",
                    "default",
                    "via",
                    &gw6.to_string(),
                    "dev",
                    "eth0",
                ])?;
                Some(ip6)
            } else {
                None
            };
            pods.push(Pod {
                name,
                on,
                ip,
                ip6,
                host_if,
                ns,
                server: None,
            });
        }
        Ok(Topology {
            spec,
            pods,
            node,
            node2,
            client,
            _veths: veths,
        })
    }

    /// Starts every pod's server (see [`Pod::serve`]).
    pub fn serve_all(&mut self) -> anyhow::Result<()> {
        for pod in &mut self.pods {
            pod.serve(&[])?;
        }
        Ok(())
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn pod_mut(&mut self, name: &str) -> &mut Pod {
        self.pods
            .iter_mut()
            .find(|p| p.name == name)
            .unwrap_or_else(|| panic!("no pod {name}"))
    }

    pub fn local_pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.iter().filter(|p| p.on == PodNode::Local)
    }

    pub fn remote_pods(&self) -> impl Iterator<Item = &Pod> {
        self.pods.iter().filter(|p| p.on == PodNode::Remote)
    }

    /// Node (`this node`) addresses a Node object would list: the client-link address first.
    pub fn node_ips(&self) -> Vec<IpAddr> {
        let mut ips = vec![IpAddr::V4(NODE_IP)];
        if self.node2.is_some() {
            ips.push(IpAddr::V4(NODE_LINK_IP));
        }
        if self.spec.ipv6 {
            ips.push(IpAddr::V6(NODE_IP6));
            if self.node2.is_some() {
                ips.push(IpAddr::V6(NODE_LINK_IP6));
            }
        }
        ips
    }
}

/// `ip -6 addr add CIDR dev IF nodad` (no duplicate-address detection delay).
fn add_addr6(ns: &Netns, ifname: &str, cidr: &str) -> anyhow::Result<()> {
    ns.ip(&["-6", "addr", "add", cidr, "dev", ifname, "nodad"])
        .map(drop)
}

/// What a `kp-probe tcp|udp` client reported.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct ProbeResult {
    /// Answers per backend name.
    pub answers: BTreeMap<String, u64>,
    /// Per backend, the distinct client addresses it saw (`ip:port`).
    pub peers: BTreeMap<String, Vec<String>>,
    /// Failures per `std::io::ErrorKind` name (`ConnectionRefused`, `TimedOut`, …).
    pub errors: BTreeMap<String, u64>,
    pub first_error: Option<String>,
}

impl ProbeResult {
    pub fn total_answers(&self) -> u64 {
        self.answers.values().sum()
    }
    pub fn total_errors(&self) -> u64 {
        self.errors.values().sum()
    }
    /// The distinct client addresses (`ip:port`) all backends saw: the distinct flows the
    /// probe opened (a client that reuses a source port for the same destination reopens the
    /// same flow).
    pub fn distinct_peers(&self) -> u64 {
        self.peers.values().map(|p| p.len() as u64).sum()
    }
    /// The distinct client IPs (without ports) backend `name` saw, sorted.
    pub fn peer_ips(&self, name: &str) -> Vec<String> {
        let ips: std::collections::BTreeSet<String> = self
            .peers
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(|p| p.parse::<std::net::SocketAddr>().ok())
            .map(|a| a.ip().to_string())
            .collect();
        ips.into_iter().collect()
    }
}

/// A `kp-probe` client invocation.
#[derive(Debug, Clone)]
pub struct Probe {
    /// `tcp` or `udp`.
    pub proto: &'static str,
    /// `ip:port` or `[ip6]:port`.
    pub addr: String,
    pub count: u32,
    pub timeout: Duration,
    /// UDP: reuse one connected socket for every exchange.
    pub same_socket: bool,
}

impl Probe {
    pub fn tcp(addr: impl Into<String>, count: u32) -> Probe {
        Probe {
            proto: "tcp",
            addr: addr.into(),
            count,
            timeout: Duration::from_secs(2),
            same_socket: false,
        }
    }
    pub fn udp(addr: impl Into<String>, count: u32) -> Probe {
        Probe {
            proto: "udp",
            ..Probe::tcp(addr, count)
        }
    }
    pub fn timeout(mut self, t: Duration) -> Probe {
        self.timeout = t;
        self
    }
    pub fn same_socket(mut self) -> Probe {
        self.same_socket = true;
        self
    }

    /// The command line (inside `ns`, and inside `cgroup` when given), ready to run.
    pub fn command(&self, ns: &Netns, cgroup: Option<&TestCgroup>) -> anyhow::Result<Command> {
        let mut cmd = ns.command(target_bin("kp-probe")?);
        cmd.args([self.proto, &self.addr])
            .args(["--count", &self.count.to_string()])
            .args(["--timeout-ms", &self.timeout.as_millis().to_string()]);
        if self.same_socket {
            cmd.arg("--same-socket");
        }
        if let Some(cg) = cgroup {
            cg.enter_on_spawn(&mut cmd)?;
        }
        Ok(cmd)
    }

    /// Runs the client in `ns` (inside `cgroup` when given) and parses its report.
    pub fn run(&self, ns: &Netns, cgroup: Option<&TestCgroup>) -> anyhow::Result<ProbeResult> {
        let out = run_checked(&mut self.command(ns, cgroup)?)?;
        serde_json::from_str(out.trim()).with_context(|| format!("parsing kp-probe output {out:?}"))
    }
}

/// Shorthand for `Probe::tcp|udp(addr, count).run(ns, cgroup)`.
pub fn probe(
    ns: &Netns,
    cgroup: Option<&TestCgroup>,
    proto: &str,
    addr: &str,
    count: u32,
) -> anyhow::Result<ProbeResult> {
    let p = match proto {
        "tcp" => Probe::tcp(addr, count),
        "udp" => Probe::udp(addr, count),
        other => bail!("probe: unknown protocol {other:?}"),
    };
    p.run(ns, cgroup)
}

/// Checks that every backend in `names` got a share of `result` that a fair, independent choice
/// per connection explains, and that there were no errors.
///
/// A backend passes when it got at least one answer and either between half and twice its fair
/// share (the traffic tests' historical criterion) or within five standard deviations of the
/// binomial mean. The second band only matters for small samples, where half the fair share
/// is not rare for a fair chooser (30 draws over 3 backends: 1.2 % per backend); five
/// deviations keep a fair chooser's false failure below 1e-6 per backend, while a backend that
/// is never or hardly ever chosen still fails.
pub fn assert_spread(result: &ProbeResult, names: &[&str]) {
    assert_eq!(result.total_errors(), 0, "errors: {result:?}");
    let total = result.total_answers() as f64;
    let fair = total / names.len() as f64;
    let p = 1.0 / names.len() as f64;
    let five_sd = 5.0 * (total * p * (1.0 - p)).sqrt();
    for name in names {
        let got = *result.answers.get(*name).unwrap_or(&0) as f64;
        let in_share = got >= fair / 2.0 && got <= fair * 2.0;
        let in_binomial = (got - fair).abs() <= five_sd;
        assert!(
            got >= 1.0 && (in_share || in_binomial),
            "{name} got {got} of {total} answers (fair share {fair:.0}, 5 sd {five_sd:.1}): {:?}",
            result.answers
        );
    }
    let unexpected: Vec<&String> = result
        .answers
        .keys()
        .filter(|k| !names.contains(&k.as_str()))
        .collect();
    assert!(unexpected.is_empty(), "unexpected backends {unexpected:?}");
}

/// A binary of this workspace's current profile: `target/<profile>/<name>`, found next to the
/// running executable (a test harness in `target/<profile>/deps/`, or a binary such as
/// `kp-bench` in `target/<profile>/`). `kp-probe` is built with
/// this package's tests, `kp-bench` with `kproxy-bench`'s; `kproxy` by `cargo xtask test` (or
/// `cargo build -p kproxy`).
pub fn target_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("current_exe")?;
    let dir = exe.parent().context("executable has no directory")?;
    // Test harnesses live in target/<profile>/deps, binaries (kp-bench) in target/<profile>.
    let profile_dir = if dir.ends_with("deps") {
        dir.parent().context("deps/ has no parent")?
    } else {
        dir
    };
    let path = profile_dir.join(name);
    if !path.is_file() {
        bail!(
            "{} does not exist: build it first (`cargo build -p {}`; `cargo xtask test` does)",
            path.display(),
            match name {
                "kproxy" => "kproxy",
                "kp-bench" => "kproxy-bench --bins",
                _ => "kproxy-tests --bins",
            }
        );
    }
    Ok(path)
}

/// The agent binary (see [`target_bin`]).
pub fn kproxy_bin() -> anyhow::Result<PathBuf> {
    target_bin("kproxy")
}
