//! The incremental planner against the from-scratch planner: after every step of random
//! sequences of snapshot changes, both give the same plan (hence the same restore text).

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{
    ChangedSet, Endpoint, IpFamily, IpMode, LoadBalancerIngress, NodeInfo, Protocol, ServicePort,
    ServicePortName, ServiceType, Snapshot,
};

use super::super::IptablesConfig;
use super::super::plan::plan;
use super::IncrementalPlanner;
use crate::dataplane::netfilter::local_detect::LocalDetector;

/// xorshift64*: a small deterministic generator (every failure names its seed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn port_name(svc: usize, port: usize) -> ServicePortName {
    // Two namespaces, names that sort differently from their numbers.
    ServicePortName::new(
        format!("ns{}", svc % 2),
        format!("svc{svc}"),
        format!("p{port}"),
        if port == 1 {
            Protocol::Udp
        } else {
            Protocol::Tcp
        },
    )
}

fn random_service(r: &mut Rng, svc: usize, port: usize) -> ServicePort {
    let service_type = [
        ServiceType::ClusterIp,
        ServiceType::NodePort,
        ServiceType::LoadBalancer,
    ][r.below(3)];
    let mut cluster_ips = vec![];
    match r.below(4) {
        0 => cluster_ips.push(ip(&format!("10.96.0.{}", svc + 1))),
        1 => cluster_ips.push(ip(&format!("fd00::{}", svc + 1))),
        _ => {
            cluster_ips.push(ip(&format!("10.96.0.{}", svc + 1)));
            cluster_ips.push(ip(&format!("fd00::{}", svc + 1)));
        }
    }
    let external = service_type != ServiceType::ClusterIp;
    let lb = service_type == ServiceType::LoadBalancer;
    ServicePort {
        name: port_name(svc, port),
        service_type,
        cluster_ips,
        port: 80 + port as u16,
        protocol: port_name(svc, port).protocol,
        node_port: if external { 30000 + svc as u16 } else { 0 },
        external_ips: if r.chance(30) {
            vec![ip("192.0.2.1"), ip("2001:db8::1")]
        } else {
            vec![]
        },
        load_balancer_ingress: if lb {
            vec![
                LoadBalancerIngress {
                    ip: ip("198.51.100.1"),
                    ip_mode: if r.chance(20) {
                        IpMode::Proxy
                    } else {
                        IpMode::Vip
                    },
                },
                LoadBalancerIngress {
                    ip: ip("2001:db8::2"),
                    ip_mode: IpMode::Vip,
                },
            ]
        } else {
            vec![]
        },
        load_balancer_source_ranges: if lb && r.chance(50) {
            vec![
                "203.0.113.0/24".parse().expect("cidr"),
                "10.0.0.0/8".parse().expect("cidr"),
                "2001:db8::/32".parse().expect("cidr"),
            ]
        } else {
            vec![]
        },
        external_policy_local: external && r.chance(40),
        internal_policy_local: r.chance(25),
        health_check_node_port: if lb && r.chance(50) { 32000 } else { 0 },
        session_affinity_timeout: r.chance(25).then_some(10800),
    }
}

fn random_endpoints(r: &mut Rng, svc: usize) -> Vec<Endpoint> {
    let mut seen = BTreeSet::new();
    (0..r.below(5))
        .filter_map(|_| {
            let n = r.below(6) + 1;
            let addr = if r.chance(70) {
                ip(&format!("10.128.{svc}.{n}"))
            } else {
                ip(&format!("fd01::{svc}:{n}"))
            };
            if !seen.insert(addr) {
                return None;
            }
            let local = r.chance(40);
            let ready = r.chance(80);
            Some(Endpoint {
                ip: addr,
                port: 8080,
                ready,
                serving: ready || r.chance(50),
                terminating: !ready,
                is_local: local,
                node_name: Some(if local { "node" } else { "other" }.into()),
                zone: Some("a".into()),
                zone_hints: if r.chance(30) {
                    ["a"].into_iter().collect()
                } else {
                    Default::default()
                },
                node_hints: Default::default(),
            })
        })
        .collect()
}

/// One random change of `snap` (or of `cfg`).
fn mutate(r: &mut Rng, snap: &mut Snapshot, cfg: &mut IptablesConfig) {
    let svc = r.below(6);
    let port = r.below(2);
    let name = port_name(svc, port);
    match r.below(12) {
        0..=2 => {
            snap.services
                .insert(name.clone(), Arc::new(random_service(r, svc, port)));
        }
        3..=6 => {
            snap.endpoints
                .insert(name, Arc::new(random_endpoints(r, svc)));
        }
        7 => {
            snap.services.remove(&name);
        }
        8 => {
            snap.endpoints.remove(&name);
        }
        9 => {
            // Same values in new allocations: nothing changes.
            if let Some(s) = snap.services.get(&name) {
                let copy = Arc::new((**s).clone());
                snap.services.insert(name.clone(), copy);
            }
            if let Some(e) = snap.endpoints.get(&name) {
                let copy = Arc::new((**e).clone());
                snap.endpoints.insert(name, copy);
            }
        }
        10 => {
            snap.node.labels.insert(
                "topology.kubernetes.io/zone".into(),
                if r.chance(50) { "a" } else { "b" }.into(),
            );
        }
        _ => match r.below(4) {
            0 => cfg.masquerade_all = !cfg.masquerade_all,
            1 => cfg.large_cluster_threshold = r.below(12),
            2 => {
                cfg.local_detector = if r.chance(50) {
                    LocalDetector::None
                } else {
                    LocalDetector::InterfaceNamePrefix("veth".into())
                }
            }
            _ => cfg.nfacct_counters.localhost_nps_accepted_pkts ^= true,
        },
    }
}

/// The service ports whose service or endpoints differ between `a` and `b` (what the
/// tracker's `ChangedSet` names).
fn diff(a: &Snapshot, b: &Snapshot) -> ChangedSet {
    let mut services = std::collections::BTreeSet::new();
    for n in a.services.keys().chain(b.services.keys()) {
        if a.services.get(n) != b.services.get(n) {
            services.insert(n.clone());
        }
    }
    for n in a.endpoints.keys().chain(b.endpoints.keys()) {
        if a.endpoints.get(n) != b.endpoints.get(n) {
            services.insert(n.clone());
        }
    }
    ChangedSet {
        services,
        node: a.node != b.node,
    }
}

/// `update` (every port checked) or `update_changed` (only the ports the exact change set
/// names) after each random mutation gives the from-scratch plan.
fn check(seed: u64, family: IpFamily, use_changed: bool) {
    let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut cfg = IptablesConfig::new(
        family,
        LocalDetector::Cidr(if family == IpFamily::V4 {
            "10.128.0.0/16".parse().expect("cidr")
        } else {
            "fd01::/64".parse().expect("cidr")
        }),
    );
    cfg.large_cluster_threshold = 6;
    cfg.node_ip = Some(if family == IpFamily::V4 {
        ip("10.1.1.1")
    } else {
        ip("2001:db8::10")
    });
    let mut snap = Snapshot {
        node: NodeInfo {
            name: "node".into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut planner = IncrementalPlanner::new();
    for step in 0..60 {
        let before = snap.clone();
        mutate(&mut r, &mut snap, &mut cfg);
        if use_changed {
            planner.update_changed(&snap, &cfg, &diff(&before, &snap));
        } else {
            planner.update(&snap, &cfg);
        }
        let want = plan(&snap, &cfg);
        let got = planner.plan(&cfg);
        assert_eq!(
            got, want,
            "seed {seed} {family:?} step {step}: incremental plan differs from scratch"
        );
        let mut shared = want.clone();
        shared.services.clear();
        assert_eq!(
            planner.shared_plan(&cfg),
            &shared,
            "seed {seed} step {step}"
        );
        assert_eq!(planner.total_endpoints(), want.total_endpoints);
        for (key, t) in &want.services {
            let chains: Vec<_> = planner
                .service_ports(key)
                .flat_map(|p| p.chains.chains.iter().cloned())
                .collect();
            assert_eq!(
                chains, t.chains,
                "seed {seed} step {step}: chains of {key:?}"
            );
        }
    }
}

#[test]
fn incremental_plans_equal_plans_from_scratch() {
    for seed in 0..150 {
        check(seed, IpFamily::V4, false);
        check(seed, IpFamily::V6, false);
    }
}

#[test]
fn plans_from_the_change_set_equal_plans_from_scratch() {
    for seed in 0..150 {
        check(seed, IpFamily::V4, true);
        check(seed, IpFamily::V6, true);
    }
}

#[test]
fn a_change_the_set_missed_is_planned_by_the_next_full_update() {
    use crate::model::testing;
    let cfg = IptablesConfig::new(IpFamily::V4, LocalDetector::None);
    let ep = |a: &str| {
        testing::endpoint(ip(a), 8080)
            .ready(true)
            .serving(true)
            .build()
    };
    let mut snap = Snapshot::default();
    for svc in 0..3 {
        let p = testing::service_port("ns", &format!("s{svc}"), "")
            .cluster_ip(format!("10.96.0.{}", svc + 1).as_str())
            .port(80)
            .build();
        let name = p.name.clone();
        snap.services.insert(name.clone(), Arc::new(p));
        snap.endpoints
            .insert(name, Arc::new(vec![ep(&format!("10.128.0.{}", svc + 1))]));
    }
    let mut planner = IncrementalPlanner::new();
    planner.update(&snap, &cfg);
    // A second endpoint for s1, not named in the change set: a partial update keeps the old
    // plan (it trusts the set), the next full one catches up.
    let name = snap.services.keys().nth(1).expect("s1").clone();
    snap.endpoints
        .insert(name, Arc::new(vec![ep("10.128.0.2"), ep("10.128.0.9")]));
    let stats = planner.update_changed(&snap, &cfg, &ChangedSet::default());
    assert_eq!(stats.replanned, 0);
    assert_ne!(planner.plan(&cfg), plan(&snap, &cfg));
    let stats = planner.update(&snap, &cfg);
    assert_eq!(stats.replanned, 1);
    assert_eq!(planner.plan(&cfg), plan(&snap, &cfg));
}

#[test]
fn only_changed_ports_are_replanned() {
    let mut cfg = IptablesConfig::new(IpFamily::V4, LocalDetector::None);
    cfg.large_cluster_threshold = 1000;
    let mut r = Rng(7);
    let mut snap = Snapshot::default();
    for svc in 0..6 {
        snap.services
            .insert(port_name(svc, 0), Arc::new(random_service(&mut r, svc, 0)));
    }
    let mut planner = IncrementalPlanner::new();
    let first = planner.update(&snap, &cfg);
    assert!(first.from_scratch);
    let v4_ports = plan(&snap, &cfg).service_ports;
    assert_eq!(first.replanned, v4_ports);
    assert_eq!(planner.update(&snap, &cfg).replanned, 0, "nothing changed");
    let name = snap
        .services
        .values()
        .find(|s| s.cluster_ip(IpFamily::V4).is_some())
        .expect("a v4 service")
        .name
        .clone();
    let mut eps = vec![];
    let mut r = Rng(3);
    while eps.is_empty() {
        eps = random_endpoints(&mut r, 1);
    }
    snap.endpoints.insert(name, Arc::new(eps));
    let one = planner.update(&snap, &cfg);
    assert_eq!((one.replanned, one.from_scratch), (1, false));
    cfg.masquerade_all = true;
    let all = planner.update(&snap, &cfg);
    assert_eq!((all.replanned, all.from_scratch), (v4_ports, true));
}
