//! The TC-path traffic rig shared by `ebpf_tc` (IPv4) and `ebpf_tc6` (IPv6): the real eBPF
//! dataplane (planner + applier, pinned maps on a private bpffs, socket LB off) programming
//! frontends from snapshots, `kp_tc_in`/`kp_tc_eg` attached (pinned TCX links) to the devices
//! the default rule selects inside the node namespace of the shared topology (one local pod
//! `pod-l0`, one remote pod `pod-r0`, both serving), and snapshot builders.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::netns::Bpffs;
use crate::topology::{NODE_CLIENT_IF, NODE_PEER_IF, Probe, Topology, TopologySpec};
use aya::Ebpf;
use aya::programs::links::{FdLink, PinnedLink};
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::ebpf::node_path::TcConfig;
use kproxy::dataplane::ebpf::node_path::TcPath;
use kproxy::dataplane::ebpf::node_path::devices;
use kproxy::dataplane::ebpf::node_path::tc::load_object;
use kproxy::dataplane::ebpf::service_maps::MapSizes;
use kproxy::dataplane::ebpf::service_maps::ServiceMaps;
use kproxy::dataplane::ebpf::service_maps::ServiceMapsConfig;
use kproxy::kernel::addresses::NodeAddresses;
use kproxy::kernel::addresses::scan;
use kproxy::model::{
    ChangedSet, Endpoint, IpFamily, IpMode, LoadBalancerIngress, Protocol, ServicePort,
    ServicePortName, ServiceType, Snapshot, testing,
};

pub const NODE_PORT: u16 = 30080;
pub const POD_PORT: u16 = 8080;

pub struct Rig {
    // Drop order: programs, dataplane, namespaces (devices and their links), bpffs.
    pub tc: TcPath,
    pub tc_ebpf: Arc<Mutex<Ebpf>>,
    pub dp: Arc<Mutex<ServiceMaps>>,
    pub topo: Topology,
    pub bpffs: Bpffs,
}

pub fn port_name(name: &str, protocol: Protocol) -> ServicePortName {
    testing::port_name("default", name, "p", protocol)
}

pub fn service(name: &str, protocol: Protocol) -> ServicePort {
    testing::service_port("default", name, "p")
        .protocol(protocol)
        .cluster_ip("10.96.0.10")
        .node_port(NODE_PORT)
        .build()
}

pub fn endpoint(ip: impl Into<IpAddr>, local: bool) -> Endpoint {
    testing::endpoint(ip.into(), POD_PORT)
        .local_on("node", "node2", local)
        .build()
}

pub fn snapshot(node_addrs: Vec<IpAddr>, services: Vec<(ServicePort, Vec<Endpoint>)>) -> Snapshot {
    testing::snapshot("node")
        .node_addresses(node_addrs)
        .services(services)
        .build()
}

/// Makes `lb` a LoadBalancer with the VIP `ip` that admits only clients in `range`.
pub fn lb_vip(lb: &mut ServicePort, ip: IpAddr, range: &str) {
    lb.service_type = ServiceType::LoadBalancer;
    lb.load_balancer_ingress = vec![LoadBalancerIngress {
        ip,
        ip_mode: IpMode::Vip,
    }];
    lb.load_balancer_source_ranges = vec![range.parse().unwrap()];
}

/// `denied`: the LoadBalancer `lb` again on port 81 (node port [`NODE_PORT`] + 3) with
/// `cluster_ips`, admitting only `range`, which the client is outside of.
pub fn denied_copy(lb: &ServicePort, cluster_ips: &[&str], range: &str) -> ServicePort {
    let mut denied = lb.clone();
    denied.name = port_name("denied", Protocol::Tcp);
    denied.cluster_ips = cluster_ips.iter().map(|ip| ip.parse().unwrap()).collect();
    denied.node_port = NODE_PORT + 3;
    denied.port = 81;
    denied.load_balancer_source_ranges = vec![range.parse().unwrap()];
    denied
}

/// A fresh object instance over the maps pinned in `bpffs` (links pinned too), its TC programs
/// loaded and attached to `devices` inside the node's namespace.
fn load_and_attach(bpffs: &Bpffs, topo: &Topology, devices: &[String]) -> (Ebpf, TcPath) {
    let pins = bpffs.path().join("kproxy");
    let config = TcConfig {
        pin_dir: Some(pins.join("links")),
        ct_entries: 8192,
        ..TcConfig::default()
    };
    let mut ebpf = load_object(&pins, &config).unwrap();
    let mut tc = TcPath::load(&mut ebpf, config).unwrap();
    topo.node
        .run(|| {
            for dev in devices {
                tc.attach(&mut ebpf, dev).unwrap();
            }
        })
        .unwrap();
    (ebpf, tc)
}

impl Rig {
    /// IPv4 only.
    pub fn new(test: &str) -> Rig {
        Rig::build(test, false)
    }

    /// Dual stack: the topology's IPv6 addresses too, both families programmed, both SNAT
    /// source maps written.
    pub fn dual_stack(test: &str) -> Rig {
        Rig::build(test, true)
    }

    fn build(test: &str, ipv6: bool) -> Rig {
        let mut topo = TopologySpec::new(test)
            .local_pods(1)
            .remote_pods(1)
            .ipv6(ipv6)
            .build()
            .unwrap();
        topo.serve_all().unwrap();
        let bpffs = Bpffs::new(&format!("{test}-fs")).unwrap();
        let cfg = ServiceMapsConfig {
            bpffs: bpffs.path().to_path_buf(),
            families: if ipv6 {
                vec![IpFamily::V4, IpFamily::V6]
            } else {
                vec![IpFamily::V4]
            },
            socket_lb: false,
            map_sizes: MapSizes {
                services: 1024,
                backend_slots: 1024,
                backends: 1024,
                affinity: 1024,
                source_ranges: 256,
                sock_rev_nat: 256,
                ..MapSizes::default()
            },
            ..ServiceMapsConfig::default()
        };
        let dp = ServiceMaps::new(cfg).unwrap();
        // Default device selection, inside the node's namespace.
        let ifaces = topo.node.run(scan).unwrap().unwrap();
        let selected = devices::select(None, &ifaces).unwrap();
        assert!(
            selected.contains(&NODE_CLIENT_IF.to_string())
                && selected.contains(&NODE_PEER_IF.to_string()),
            "selected {selected:?}"
        );
        let (mut ebpf, tc) = load_and_attach(&bpffs, &topo, &selected);
        let addrs = NodeAddresses::from_interfaces(&ifaces, Some(&selected));
        TcPath::set_node_addresses(&mut ebpf, &addrs.snat_v4()).unwrap();
        TcPath::set_node_addresses6(&mut ebpf, &addrs.snat_v6()).unwrap();
        Rig {
            tc,
            tc_ebpf: Arc::new(Mutex::new(ebpf)),
            dp: Arc::new(Mutex::new(dp)),
            topo,
            bpffs,
        }
    }

    /// An agent restart as the TC path sees it: a fresh object instance (reusing every pinned
    /// map), programs loaded and attached again through the pinned links, then the old
    /// instance dropped.
    pub fn restart_tc(&mut self) {
        let (ebpf, tc) = load_and_attach(&self.bpffs, &self.topo, &self.tc.attached());
        self.tc = tc;
        *self.tc_ebpf.lock().unwrap() = ebpf;
    }

    /// Ids of the pinned TC links.
    pub fn link_ids(&self) -> Vec<u32> {
        let dir = self.bpffs.path().join("kproxy/links");
        let mut ids = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path
                .file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("tc-")
            {
                let link = PinnedLink::from_pin(&path).unwrap();
                ids.push(FdLink::from(link).info().unwrap().id());
            }
        }
        ids.sort();
        ids
    }

    pub fn sync(&self, snap: &Snapshot) {
        let report = self
            .dp
            .lock()
            .unwrap()
            .sync(snap, &ChangedSet::default())
            .unwrap();
        assert_eq!(report.failed_services, 0, "{report:?}");
    }

    pub fn probe(&self, p: Probe) -> crate::topology::ProbeResult {
        p.run(&self.topo.client, None).unwrap()
    }

    /// TCP probes to each of `vips` (frontends of `both_pods`) answered by both backends, the
    /// remote one seeing `remote_peer`; none to `denied` (outside its source ranges), dropped
    /// and counted by the TC program.
    pub fn assert_source_ranges(&self, vips: &[String], denied: &str, remote_peer: IpAddr) {
        for vip in vips {
            let r = self.probe(Probe::tcp(vip.as_str(), 30));
            assert_eq!(r.total_answers(), 30, "{vip}: {r:?}");
            assert_eq!(r.answers.len(), 2, "{vip}: both backends: {r:?}");
            assert_eq!(r.peer_ips("pod-r0"), vec![remote_peer.to_string()], "{vip}");
        }
        let r = self.probe(Probe::tcp(denied, 2).timeout(Duration::from_millis(700)));
        assert_eq!(
            r.total_answers(),
            0,
            "client outside the source ranges: {r:?}"
        );
        assert!(TcPath::stats(&self.tc_ebpf.lock().unwrap()).unwrap()["source_range_drop"] >= 2);
    }

    /// 40 TCP then 40 UDP probes from the client to `addr` (an eTP=Cluster NodePort with
    /// `both_pods` as backends): every probe answered, both `pod-l0` and `pod-r0` answer, the
    /// remote backend sees `remote_peer` (the node's BPF SNAT address toward it) and the local
    /// one `local_peer` (the client).
    /// [`Rig::assert_both_backends`] with every translated checksum finished in software and
    /// verified by its receiver (through veth a receiver trusts a `CHECKSUM_PARTIAL` field
    /// unchecked): TX checksum offload off on node and node2, so the node finishes each packet
    /// it sends from what TC left in the field, while the client still sends
    /// `CHECKSUM_PARTIAL` packets; then off on the client too, which finishes its own
    /// (`CHECKSUM_NONE` on arrival).
    pub fn assert_checksums_finished_in_software(
        &self,
        addr: &str,
        remote_peer: IpAddr,
        local_peer: IpAddr,
    ) {
        self.topo.node.set_tx_checksum(false).unwrap();
        self.topo
            .node2
            .as_ref()
            .expect("the rig has a remote node")
            .set_tx_checksum(false)
            .unwrap();
        self.assert_both_backends(addr, remote_peer, local_peer);
        self.topo.client.set_tx_checksum(false).unwrap();
        self.assert_both_backends(addr, remote_peer, local_peer);
    }

    /// Returns the distinct flows the probes opened ([`crate::topology::ProbeResult::distinct_peers`]).
    pub fn assert_both_backends(&self, addr: &str, remote_peer: IpAddr, local_peer: IpAddr) -> u64 {
        let mut flows = 0;
        for proto in ["tcp", "udp"] {
            let p = if proto == "tcp" {
                Probe::tcp(addr, 40)
            } else {
                Probe::udp(addr, 40)
            };
            let r = self.probe(p);
            assert_eq!(r.total_errors(), 0, "{proto}: {r:?}");
            assert_eq!(r.total_answers(), 40, "{proto}: {r:?}");
            assert!(
                r.answers.get("pod-l0").copied().unwrap_or(0) > 0
                    && r.answers.get("pod-r0").copied().unwrap_or(0) > 0,
                "{proto}: both backends answer: {r:?}"
            );
            assert_eq!(
                r.peer_ips("pod-r0"),
                vec![remote_peer.to_string()],
                "{proto}"
            );
            assert_eq!(
                r.peer_ips("pod-l0"),
                vec![local_peer.to_string()],
                "{proto}"
            );
            flows += r.distinct_peers();
        }
        flows
    }
}
