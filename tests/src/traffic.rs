//! What the netfilter traffic tests (iptables and nftables modes) share on top of the
//! [`topology`](crate::topology): Service and EndpointSlice objects for the topology's pods, a
//! rig that feeds them to any [`Dataplane`] programming the node namespace, a long-lived UDP
//! flow with its conntrack entries, and long-lived TCP connections (`kp-probe hold`).

use std::io::{BufRead as _, BufReader, Lines};
use std::net::UdpSocket;
use std::process::{Child, ChildStdout, Stdio};
use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::model::{IpFamily, Tracker};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::iptables_corpus::feed;
use crate::netns::{Netns, TestCgroup};
use crate::topology::{CLIENT_IP, CLIENT_IP6, POD_PORT, Pod, PodNode, Topology, TopologySpec};

/// The name of the topology's `node` in the objects (remote pods run on `node2`).
pub const NODE_NAME: &str = "node";

/// A Service `default/<name>` with `spec` and `status`.
pub fn service(name: &str, spec: Value, status: Value) -> Service {
    Service::deserialize(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec, "status": status,
    }))
    .expect("service")
}

/// A service port `{"name": "", "port": port, "protocol": "TCP"}`.
pub fn tcp_port(port: u16) -> Value {
    json!({"name": "", "port": port, "protocol": "TCP"})
}

/// A service port `{"name": "udp", "port": port, "protocol": "UDP"}` (the slices' UDP port).
pub fn udp_port(port: u16) -> Value {
    json!({"name": "udp", "port": port, "protocol": "UDP"})
}

/// The ready endpoints `pods` (their `family` address) of service `service`, with two ports:
/// `""` (TCP) and `"udp"` (UDP), both [`POD_PORT`]. Local pods run on [`NODE_NAME`].
pub fn slice(service: &str, pods: &[&Pod], family: IpFamily) -> EndpointSlice {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|p| {
            let ip = match family {
                IpFamily::V4 => p.ip.to_string(),
                IpFamily::V6 => p.ip6.expect("the topology has IPv6").to_string(),
            };
            json!({
                "addresses": [ip],
                "conditions": {"ready": true},
                "nodeName": if p.on == PodNode::Local { NODE_NAME } else { "node2" },
            })
        })
        .collect();
    let (suffix, address_type) = match family {
        IpFamily::V4 => ("v4", "IPv4"),
        IpFamily::V6 => ("v6", "IPv6"),
    };
    EndpointSlice::deserialize(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-{suffix}"), "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": "", "port": POD_PORT, "protocol": "TCP"},
                  {"name": "udp", "port": POD_PORT, "protocol": "UDP"}],
    }))
    .expect("slice")
}

/// The topology of a traffic test: every pod serving, and the node with a default route via
/// the client like a real node (so traffic that is not DNATed is routed and meets the
/// filter chains), for IPv6 too when `ipv6`.
pub fn topology(hint: &str, local: usize, remote: usize, ipv6: bool) -> Topology {
    let mut topo = TopologySpec::new(hint)
        .local_pods(local)
        .remote_pods(remote)
        .ipv6(ipv6)
        .build()
        .expect("topology");
    topo.serve_all().expect("servers");
    topo.node
        .ip(&["route", "add", "default", "via", &CLIENT_IP.to_string()])
        .expect("default route");
    if ipv6 {
        topo.node
            .ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &CLIENT_IP6.to_string(),
            ])
            .expect("default route");
    }
    topo
}

/// A datapath programming the node namespace of a topology, fed from objects like a relist.
pub struct Rig<D> {
    pub topo: Topology,
    pub dp: D,
    pub tracker: Tracker,
}

impl<D: Dataplane + Send> Rig<D> {
    pub fn new(topo: Topology, dp: D) -> Self {
        Rig {
            topo,
            dp,
            tracker: Tracker::new(NODE_NAME),
        }
    }

    /// Replaces the model's objects and syncs, inside the node namespace (where a conntrack
    /// cleanup talks netlink).
    pub fn sync(&mut self, services: &[Service], slices: &[EndpointSlice]) {
        let (snap, changed) = feed(&mut self.tracker, services, slices);
        let dp = &mut self.dp;
        self.topo
            .node
            .run(|| dp.sync(&snap, &changed))
            .expect("netns")
            .expect("sync");
    }

    pub fn pods(&self, names: &[&str]) -> Vec<&Pod> {
        names.iter().map(|n| self.topo.pod(n)).collect()
    }
}

/// One long-lived UDP flow: a connected socket in a namespace, so one source port (one
/// 5-tuple) for every datagram.
pub struct UdpFlow {
    pub sock: UdpSocket,
    pub sport: u16,
}

impl UdpFlow {
    /// A socket in `ns` connected to `addr` (`ip:port`, `[ip6]:port`).
    pub fn connect(ns: &Netns, addr: &str) -> UdpFlow {
        let sock = ns
            .run(|| {
                let any = if addr.starts_with('[') {
                    "[::]:0"
                } else {
                    "0.0.0.0:0"
                };
                let s = UdpSocket::bind(any).expect("bind");
                s.set_read_timeout(Some(Duration::from_secs(2)))
                    .expect("timeout");
                s.connect(addr).expect("connect");
                s
            })
            .expect("netns");
        let sport = sock.local_addr().expect("local addr").port();
        UdpFlow { sock, sport }
    }

    /// One datagram on the flow; the name of the pod that answered.
    pub fn exchange(&self) -> String {
        self.sock.send(b"hello\n").expect("send");
        let mut buf = [0u8; 512];
        let n = self.sock.recv(&mut buf).expect("an answer");
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        text.split_whitespace().next().unwrap_or("").to_string()
    }

    /// The `conntrack -L` lines (in `node`) of this flow to `vip` whose reply comes from
    /// `backend` (an address).
    pub fn entries(&self, node: &Netns, vip: &str, backend: &str) -> Vec<String> {
        let family = if vip.contains(':') { "ipv6" } else { "ipv4" };
        let out = node
            .command("conntrack")
            .args(["-L", "-f", family, "-p", "udp", "--orig-dst", vip])
            .output()
            .expect("conntrack -L");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| {
                l.contains(&format!("sport={} ", self.sport))
                    && l.contains(&format!("src={backend} "))
            })
            .map(String::from)
            .collect()
    }
}

/// A `kp-probe hold` connection running in the background: one TCP connection echoing a line
/// every `interval`, for `seconds`.
pub struct Hold {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    /// The backend that answered the greeting.
    pub backend: String,
    what: &'static str,
    seconds: u64,
}

impl Hold {
    /// Connects from `ns` (inside `cg` when given) to `addr`; returns once connected.
    pub fn start(
        ns: &Netns,
        cg: Option<&TestCgroup>,
        addr: &str,
        seconds: u64,
        what: &'static str,
    ) -> Hold {
        let mut cmd = ns.command(crate::topology::target_bin("kp-probe").unwrap());
        cmd.args([
            "hold",
            addr,
            "--seconds",
            &seconds.to_string(),
            "--interval-ms",
            "100",
        ]);
        if let Some(cg) = cg {
            cg.enter_on_spawn(&mut cmd).unwrap();
        }
        let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let connected = lines.next().unwrap().unwrap();
        let v: Value = serde_json::from_str(&connected).unwrap();
        let backend = v["connected"].as_str().unwrap_or_default().to_string();
        Hold {
            backend,
            child,
            lines,
            what,
            seconds,
        }
    }

    /// Panics when the connection already ended.
    pub fn assert_running(&mut self) {
        if let Some(st) = self.child.try_wait().unwrap() {
            let last = self.lines.next().and_then(Result::ok).unwrap_or_default();
            panic!(
                "{}: the connection ended ({st}) before the restart was over: {last}",
                self.what
            );
        }
    }

    /// Waits for the end of the hold period and asserts the connection echoed all along: it
    /// ended cleanly with more than half the exchanges its period allows (one per 100 ms).
    /// Returns the number of echoed exchanges.
    pub fn finish(mut self) -> u64 {
        let st = self.child.wait().unwrap();
        let last = self.lines.next().and_then(Result::ok).unwrap_or_default();
        assert!(
            st.success(),
            "{}: the long-lived connection broke: {last}",
            self.what
        );
        let v: Value = serde_json::from_str(&last).unwrap();
        let exchanges = v["exchanges"].as_u64().unwrap();
        assert!(
            exchanges > self.seconds * 5,
            "{}: {exchanges} exchanges in {} s",
            self.what,
            self.seconds
        );
        exchanges
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
