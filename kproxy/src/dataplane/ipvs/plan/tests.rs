//! Unit tests of the IPVS planner: every service type and traffic policy.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::*;
use crate::dataplane::ipvs::genl::SVC_F_PERSISTENT;
use crate::model::{IpMode, LoadBalancerIngress, ServiceType, testing};

const NODE_IP: &str = "192.168.0.10";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn svc(name: &str, cluster_ip: &str, protocol: Protocol) -> ServicePort {
    testing::service_port("ns", name, "p")
        .protocol(protocol)
        .cluster_ip(cluster_ip)
        .build()
}

fn ep(addr: &str, local: bool) -> Endpoint {
    testing::endpoint(addr, 8080)
        .local_on("node", "other", local)
        .build()
}

fn terminating(mut e: Endpoint, serving: bool) -> Endpoint {
    e.ready = false;
    e.serving = serving;
    e.terminating = true;
    e
}

fn snap(items: Vec<(ServicePort, Vec<Endpoint>)>) -> Snapshot {
    testing::snapshot("node")
        .generation(0)
        .node_addresses([NODE_IP])
        .services(items)
        .build()
}

fn cfg() -> IpvsConfig {
    IpvsConfig::new(IpFamily::V4, vec![ip(NODE_IP)])
}

fn key(addr: &str, protocol: Protocol, port: u16) -> ServiceKey {
    ServiceKey {
        addr: ip(addr),
        protocol,
        port,
    }
}

fn rs(p: &IpvsPlan, k: &ServiceKey) -> BTreeMap<(IpAddr, u16), u32> {
    p.services[k].real_servers.clone()
}

fn entries(p: &IpvsPlan, set: &str) -> Vec<String> {
    p.sets[set].entries.iter().cloned().collect()
}

#[test]
fn cluster_ip_becomes_a_bound_virtual_service_with_its_set_entry() {
    let p = plan(
        &snap(vec![(
            svc("web", "10.96.0.10", Protocol::Tcp),
            vec![ep("10.244.1.2", true), ep("10.244.2.2", false)],
        )]),
        &cfg(),
    );
    assert_eq!(p.service_ports, 1);
    assert!(p.errors.is_empty());
    let k = key("10.96.0.10", Protocol::Tcp, 80);
    let vs = &p.services[&k];
    assert_eq!(vs.kind, VsKind::ClusterIp);
    assert_eq!(vs.service.scheduler, "rr");
    assert_eq!((vs.service.flags, vs.service.timeout), (0, 0));
    assert_eq!(
        rs(&p, &k),
        BTreeMap::from([((ip("10.244.1.2"), 8080), 1), ((ip("10.244.2.2"), 8080), 1)])
    );
    assert_eq!(
        p.bound.iter().copied().collect::<Vec<_>>(),
        vec![ip("10.96.0.10")]
    );
    assert_eq!(entries(&p, CLUSTER_IP), vec!["10.96.0.10,tcp:80"]);
    // Hairpin entries only for endpoints on this node.
    assert_eq!(
        entries(&p, LOOP_BACK),
        vec!["10.244.1.2,tcp:8080,10.244.1.2"]
    );
    assert_eq!(entries(&p, IPVS_IPS), vec!["10.96.0.10"]);
    assert_eq!(p.active_real_servers(), 2);
    assert_eq!(p.active_endpoints(), 2);
}

#[test]
fn internal_traffic_policy_local_uses_only_local_endpoints() {
    let mut s = svc("web", "10.96.0.10", Protocol::Tcp);
    s.internal_policy_local = true;
    let p = plan(
        &snap(vec![(
            s,
            vec![ep("10.244.1.2", true), ep("10.244.2.2", false)],
        )]),
        &cfg(),
    );
    assert_eq!(
        rs(&p, &key("10.96.0.10", Protocol::Tcp, 80)),
        BTreeMap::from([((ip("10.244.1.2"), 8080), 1)])
    );
}

#[test]
fn service_without_endpoints_still_gets_its_virtual_service() {
    let p = plan(
        &snap(vec![(svc("web", "10.96.0.10", Protocol::Udp), vec![])]),
        &cfg(),
    );
    assert!(rs(&p, &key("10.96.0.10", Protocol::Udp, 80)).is_empty());
    assert_eq!(entries(&p, CLUSTER_IP), vec!["10.96.0.10,udp:80"]);
}

#[test]
fn node_port_has_one_unbound_virtual_service_per_node_address() {
    let mut s = svc("web", "10.96.0.10", Protocol::Tcp);
    s.service_type = ServiceType::NodePort;
    s.node_port = 30080;
    let mut c = cfg();
    c.node_ips = vec![ip(NODE_IP), ip("10.0.0.5")];
    let p = plan(&snap(vec![(s, vec![ep("10.244.1.2", false)])]), &c);
    for addr in [NODE_IP, "10.0.0.5"] {
        let k = key(addr, Protocol::Tcp, 30080);
        assert_eq!(p.services[&k].kind, VsKind::NodePort);
        assert_eq!(rs(&p, &k), BTreeMap::from([((ip("10.244.1.2"), 8080), 1)]));
        assert!(
            !p.bound.contains(&ip(addr)),
            "node addresses are never bound"
        );
    }
    assert_eq!(entries(&p, NODE_PORT_TCP), vec!["30080"]);
    assert!(entries(&p, NODE_PORT_LOCAL_TCP).is_empty());
    assert!(
        p.rules
            .nat
            .iter()
            .any(|r| r.contains("-p tcp") && r.contains("KUBE-NODE-PORT-TCP dst -j KUBE-MARK-MASQ"))
    );
}

#[test]
fn node_port_sets_per_protocol_and_policy() {
    let mut udp = svc("dns", "10.96.0.53", Protocol::Udp);
    udp.node_port = 30053;
    udp.external_policy_local = true;
    let mut sctp = svc("sig", "10.96.0.70", Protocol::Sctp);
    sctp.node_port = 30070;
    let mut sctp_local = svc("sig2", "10.96.0.71", Protocol::Sctp);
    sctp_local.node_port = 30071;
    sctp_local.external_policy_local = true;
    let p = plan(
        &snap(vec![
            (udp, vec![ep("10.244.1.2", true), ep("10.244.2.2", false)]),
            (sctp, vec![]),
            (sctp_local, vec![]),
        ]),
        &cfg(),
    );
    assert_eq!(entries(&p, NODE_PORT_LOCAL_UDP), vec!["30053"]);
    assert!(entries(&p, NODE_PORT_UDP).is_empty());
    assert_eq!(
        entries(&p, NODE_PORT_SCTP),
        vec![format!("{NODE_IP},sctp:30070")]
    );
    assert_eq!(
        entries(&p, NODE_PORT_LOCAL_SCTP),
        vec![format!("{NODE_IP},sctp:30071")]
    );
    // externalTrafficPolicy=Local: the NodePort only reaches local endpoints, the ClusterIP all.
    assert_eq!(
        rs(&p, &key(NODE_IP, Protocol::Udp, 30053)),
        BTreeMap::from([((ip("10.244.1.2"), 8080), 1)])
    );
    assert_eq!(rs(&p, &key("10.96.0.53", Protocol::Udp, 80)).len(), 2);
    let local_rule = p
        .rules
        .nat
        .iter()
        .position(|r| r.contains("KUBE-NODE-PORT-LOCAL-UDP dst -j RETURN"))
        .expect("local UDP return rule");
    let masq_rule = p
        .rules
        .nat
        .iter()
        .position(|r| r.contains("KUBE-NODE-PORT-UDP dst"));
    assert!(masq_rule.is_none(), "no rule for an empty set");
    assert!(local_rule > 0);
}

#[test]
fn external_ips_are_bound_and_listed_by_policy() {
    let mut s = svc("web", "10.96.0.10", Protocol::Tcp);
    s.external_ips = vec![ip("203.0.113.7"), ip("2001:db8::7")];
    let mut l = svc("local", "10.96.0.11", Protocol::Tcp);
    l.external_ips = vec![ip("203.0.113.8")];
    l.external_policy_local = true;
    let p = plan(
        &snap(vec![
            (s, vec![ep("10.244.1.2", false)]),
            (l, vec![ep("10.244.1.3", true), ep("10.244.2.3", false)]),
        ]),
        &cfg(),
    );
    let k = key("203.0.113.7", Protocol::Tcp, 80);
    assert_eq!(p.services[&k].kind, VsKind::ExternalIp);
    assert!(p.bound.contains(&ip("203.0.113.7")));
    assert!(
        !p.bound.contains(&ip("2001:db8::7")),
        "other family ignored"
    );
    assert_eq!(entries(&p, EXTERNAL_IP), vec!["203.0.113.7,tcp:80"]);
    assert_eq!(entries(&p, EXTERNAL_IP_LOCAL), vec!["203.0.113.8,tcp:80"]);
    assert_eq!(
        rs(&p, &key("203.0.113.8", Protocol::Tcp, 80)),
        BTreeMap::from([((ip("10.244.1.3"), 8080), 1)])
    );
    let ext_rules: Vec<&String> = p
        .rules
        .nat
        .iter()
        .filter(|r| r.contains("KUBE-EXTERNAL-IP "))
        .collect();
    assert_eq!(
        ext_rules.len(),
        3,
        "masquerade + two accepts: {ext_rules:?}"
    );
}

#[test]
fn load_balancer_ips_with_source_ranges_and_local_policy() {
    let mut s = svc("lb", "10.96.0.20", Protocol::Tcp);
    s.service_type = ServiceType::LoadBalancer;
    s.node_port = 31000;
    s.external_policy_local = true;
    s.health_check_node_port = 32000;
    s.load_balancer_ingress = vec![
        LoadBalancerIngress {
            ip: ip("198.51.100.1"),
            ip_mode: IpMode::Vip,
        },
        LoadBalancerIngress {
            ip: ip("198.51.100.2"),
            ip_mode: IpMode::Proxy,
        },
    ];
    s.load_balancer_source_ranges = vec!["192.168.0.0/24".parse().unwrap()];
    let mut closed = svc("closed", "10.96.0.21", Protocol::Tcp);
    closed.load_balancer_ingress = vec![LoadBalancerIngress {
        ip: ip("198.51.100.3"),
        ip_mode: IpMode::Vip,
    }];
    closed.load_balancer_source_ranges = vec!["172.16.0.0/12".parse().unwrap()];
    let p = plan(
        &snap(vec![(s, vec![ep("10.244.1.2", true)]), (closed, vec![])]),
        &cfg(),
    );
    let k = key("198.51.100.1", Protocol::Tcp, 80);
    assert_eq!(p.services[&k].kind, VsKind::LoadBalancer);
    assert!(p.bound.contains(&ip("198.51.100.1")));
    assert!(
        !p.services
            .contains_key(&key("198.51.100.2", Protocol::Tcp, 80)),
        "ipMode Proxy is not captured"
    );
    assert_eq!(
        entries(&p, LOAD_BALANCER),
        vec!["198.51.100.1,tcp:80", "198.51.100.3,tcp:80"]
    );
    assert_eq!(
        entries(&p, LOAD_BALANCER_LOCAL),
        vec!["198.51.100.1,tcp:80"]
    );
    assert_eq!(
        entries(&p, LOAD_BALANCER_FW),
        vec!["198.51.100.1,tcp:80", "198.51.100.3,tcp:80"]
    );
    assert_eq!(
        entries(&p, LOAD_BALANCER_SOURCE_CIDR),
        vec![
            "198.51.100.1,tcp:80,192.168.0.0/24",
            "198.51.100.3,tcp:80,172.16.0.0/12"
        ]
    );
    // The node (192.168.0.10) is inside the first range only.
    assert_eq!(
        entries(&p, LOAD_BALANCER_SOURCE_IP),
        vec!["198.51.100.1,tcp:80,198.51.100.1"]
    );
    assert_eq!(
        p.rules
            .filter
            .iter()
            .filter(|r| r.starts_with("-A KUBE-IPVS-OUT-FILTER"))
            .cloned()
            .collect::<Vec<_>>(),
        vec![
            "-A KUBE-IPVS-OUT-FILTER -s 198.51.100.3 -m ipvs --vaddr 198.51.100.3 --vproto 6 --vport 80 -j DROP"
        ]
    );
    assert_eq!(entries(&p, HEALTH_CHECK_NODE_PORT), vec!["32000"]);
    assert_eq!(entries(&p, NODE_PORT_LOCAL_TCP), vec!["31000"]);
    assert!(p.rules.filter.iter().any(|r| r.contains(
        "-A KUBE-PROXY-FIREWALL -m comment --comment \"Kubernetes service load balancer ip + port for load balancer with sourceRange\" -m set --match-set KUBE-LOAD-BALANCER-FW dst,dst -j KUBE-SOURCE-RANGES-FIREWALL"
    )));
}

#[test]
fn client_ip_affinity_makes_the_service_persistent() {
    let mut s = svc("web", "10.96.0.10", Protocol::Tcp);
    s.session_affinity_timeout = Some(10800);
    s.node_port = 30001;
    let p = plan(&snap(vec![(s, vec![ep("10.244.1.2", false)])]), &cfg());
    for k in [
        key("10.96.0.10", Protocol::Tcp, 80),
        key(NODE_IP, Protocol::Tcp, 30001),
    ] {
        let v = &p.services[&k].service;
        assert_eq!((v.flags, v.timeout), (SVC_F_PERSISTENT, 10800), "{k}");
    }
}

#[test]
fn terminating_endpoints_drain_with_weight_zero_or_serve_as_fallback() {
    let s = svc("web", "10.96.0.10", Protocol::Tcp);
    let k = key("10.96.0.10", Protocol::Tcp, 80);
    let p = plan(
        &snap(vec![(
            s.clone(),
            vec![
                ep("10.244.1.2", false),
                terminating(ep("10.244.1.3", false), true),
                terminating(ep("10.244.1.4", false), false),
            ],
        )]),
        &cfg(),
    );
    assert_eq!(
        rs(&p, &k),
        BTreeMap::from([
            ((ip("10.244.1.2"), 8080), 1),
            ((ip("10.244.1.3"), 8080), 0),
            ((ip("10.244.1.4"), 8080), 0)
        ])
    );
    assert_eq!(p.active_real_servers(), 1);
    // No ready endpoint: the serving terminating ones take traffic (upstream's fallback).
    let p = plan(
        &snap(vec![(
            s,
            vec![
                terminating(ep("10.244.1.3", false), true),
                terminating(ep("10.244.1.4", false), false),
            ],
        )]),
        &cfg(),
    );
    assert_eq!(
        rs(&p, &k),
        BTreeMap::from([((ip("10.244.1.3"), 8080), 1), ((ip("10.244.1.4"), 8080), 0)])
    );
}

#[test]
fn scheduler_comes_from_the_config_and_is_validated() {
    let mut c = cfg();
    c.scheduler = "wrr".into();
    let p = plan(
        &snap(vec![(svc("web", "10.96.0.10", Protocol::Tcp), vec![])]),
        &c,
    );
    assert_eq!(
        p.services[&key("10.96.0.10", Protocol::Tcp, 80)]
            .service
            .scheduler,
        "wrr"
    );
    assert!(c.validate().is_ok());
    c.scheduler = String::new();
    assert_eq!(c.scheduler(), "rr");
    c.scheduler = "fastest".into();
    let err = c.validate().unwrap_err();
    assert!(err.contains("ipvs.scheduler \"fastest\""), "{err}");
    let mut c = cfg();
    c.node_ips = vec![ip("fd00::1")];
    assert!(c.validate().unwrap_err().contains("fd00::1"));
    c.node_ips = vec![];
    c.masquerade_bit = 32;
    assert!(c.validate().unwrap_err().contains("masqueradeBit"));
}

#[test]
fn ipv6_plan_uses_kube_6_sets_and_skips_ipv4_services() {
    let mut c = IpvsConfig::new(IpFamily::V6, vec![ip("fd00::10")]);
    c.cluster_cidr = Some("fd00:244::/64".parse().unwrap());
    let mut dual = svc("dual", "10.96.0.10", Protocol::Tcp);
    dual.cluster_ips.push(ip("fd00:96::10"));
    dual.node_port = 30080;
    let v4only = svc("v4", "10.96.0.11", Protocol::Tcp);
    let p = plan(
        &snap(vec![
            (
                dual,
                vec![ep("10.244.1.2", false), ep("fd00:244::2", false)],
            ),
            (v4only, vec![]),
        ]),
        &c,
    );
    assert_eq!(p.service_ports, 1);
    let k = key("fd00:96::10", Protocol::Tcp, 80);
    assert_eq!(rs(&p, &k), BTreeMap::from([((ip("fd00:244::2"), 8080), 1)]));
    // The endpoint serves the ClusterIP and the NodePort: two real servers, one endpoint.
    assert_eq!((p.active_real_servers(), p.active_endpoints()), (2, 1));
    assert!(
        p.services
            .contains_key(&key("fd00::10", Protocol::Tcp, 30080))
    );
    assert_eq!(p.sets[CLUSTER_IP].name, "KUBE-6-CLUSTER-IP");
    assert_eq!(entries(&p, CLUSTER_IP), vec!["fd00:96::10,tcp:80"]);
    let long = &p.sets[LOAD_BALANCER_SOURCE_CIDR].name;
    assert_eq!(long, "KUBE-6-LOAD-BALANCER-SOURCE-CID");
    assert!(p.sets.values().all(|s| s.name.len() <= 31));
    assert!(
        p.rules
            .nat
            .iter()
            .any(|r| r == "-A KUBE-SERVICES -s ::1/128 -j RETURN")
    );
}

#[test]
fn conflicting_virtual_services_fail_only_the_later_service() {
    let mut a = svc("a", "10.96.0.10", Protocol::Tcp);
    a.external_ips = vec![ip("203.0.113.7")];
    let mut b = svc("b", "10.96.0.11", Protocol::Tcp);
    b.external_ips = vec![ip("203.0.113.7")];
    let p = plan(
        &snap(vec![
            (a, vec![]),
            (b, vec![]),
            (svc("c", "10.96.0.12", Protocol::Tcp), vec![]),
        ]),
        &cfg(),
    );
    assert_eq!(p.service_ports, 2);
    assert_eq!(p.errors.len(), 1);
    assert_eq!(p.errors[0].0.name, "b");
    assert!(
        p.errors[0]
            .1
            .contains("tcp:203.0.113.7:80 is already used by ns/a:p"),
        "{:?}",
        p.errors
    );
    // Nothing of b was planned, not even its own cluster IP.
    assert!(!p.bound.contains(&ip("10.96.0.11")));
    assert!(!entries(&p, CLUSTER_IP).contains(&"10.96.0.11,tcp:80".to_string()));
    assert!(
        p.services
            .contains_key(&key("10.96.0.12", Protocol::Tcp, 80))
    );
}

#[test]
fn cluster_ip_masquerade_rule_follows_the_local_traffic_config() {
    let s = || snap(vec![(svc("web", "10.96.0.10", Protocol::Tcp), vec![])]);
    let rule = |c: &IpvsConfig| {
        plan(&s(), c)
            .rules
            .nat
            .into_iter()
            .find(|r| r.contains("KUBE-CLUSTER-IP") && r.ends_with("-j KUBE-MARK-MASQ"))
            .unwrap()
    };
    let mut c = cfg();
    assert!(rule(&c).contains("KUBE-CLUSTER-IP src,dst"), "{}", rule(&c));
    c.cluster_cidr = Some("10.244.0.0/16".parse().unwrap());
    assert!(rule(&c).starts_with("-A KUBE-SERVICES ! -s 10.244.0.0/16 -m comment"));
    c.masquerade_all = true;
    let r = rule(&c);
    assert!(
        r.contains("KUBE-CLUSTER-IP dst,dst -j") && !r.contains("! -s"),
        "{r}"
    );
    c.masquerade_bit = 3;
    let p = plan(&s(), &c);
    assert!(
        p.rules
            .nat
            .contains(&"-A KUBE-MARK-MASQ -j MARK --or-mark 0x8".to_string())
    );
}

#[test]
fn restore_input_declares_every_owned_chain_and_render_lists_objects() {
    let mut s = svc("web", "10.96.0.10", Protocol::Tcp);
    s.node_port = 30080;
    let snapshot = snap(vec![(s, vec![ep("10.244.1.2", true)])]);
    let p = plan(&snapshot, &cfg());
    let text = iptables_restore_input(&p.rules);
    for c in NAT_CHAINS.iter().chain(FILTER_CHAINS) {
        assert!(text.contains(&format!(":{c} - [0:0]\n")), "{c}");
    }
    assert_eq!(text.matches("COMMIT\n").count(), 2);
    assert!(text.starts_with("*filter\n"));
    let out = render(&snapshot, &cfg());
    assert!(
        out.contains("tcp:10.96.0.10:80 ClusterIp rr (ns/web:p)"),
        "{out}"
    );
    assert!(
        out.contains(&format!("tcp:{NODE_IP}:30080 NodePort rr")),
        "{out}"
    );
    assert!(out.contains("  -> 10.244.1.2:8080 masq weight 1"), "{out}");
    assert!(
        out.contains("## addresses on kube-ipvs0\n10.96.0.10\n"),
        "{out}"
    );
    assert!(
        out.contains("KUBE-NODE-PORT-TCP bitmap:port (1 entries)\n  30080"),
        "{out}"
    );
}
