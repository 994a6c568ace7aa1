//! Unit and property tests of the model builders and the tracker.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use proptest::prelude::*;

use super::endpoints::{merge, parse_slice};
use super::service::{parse_ip_sloppy, service_ports};
use super::*;
use crate::model::input::{Delta, Event};

fn svc(yaml: &str) -> Service {
    serde_yaml::from_str(yaml).unwrap()
}

fn slice(yaml: &str) -> EndpointSlice {
    serde_yaml::from_str(yaml).unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

const META: &str = "metadata: {name: web, namespace: ns}\n";

#[test]
fn not_proxied_by_design_gives_no_ports_and_no_warning() {
    for spec in [
        "spec: {type: ExternalName, externalName: example.com, ports: [{port: 80}]}",
        "spec: {clusterIP: None, ports: [{port: 80}]}",
        "spec: {clusterIP: '', ports: [{port: 80}]}",
    ] {
        let (p, w) = service_ports(&svc(&format!("{META}{spec}")));
        assert!(p.is_empty() && w.is_empty(), "{spec}: {p:?} {w:?}");
    }
    let labelled = "metadata: {name: web, namespace: ns, labels: {service.kubernetes.io/service-proxy-name: other}}\nspec: {clusterIP: 10.0.0.1, ports: [{port: 80}]}";
    let (p, w) = service_ports(&svc(labelled));
    assert!(p.is_empty() && w.is_empty());
}

#[test]
fn dual_stack_cluster_ips_per_family() {
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, clusterIPs: [10.0.0.1, 'fd00::1'], ipFamilies: [IPv4, IPv6], ports: [{{port: 80, protocol: UDP, name: dns}}]}}"
    )));
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].cluster_ip(IpFamily::V4), Some(ip("10.0.0.1")));
    assert_eq!(p[0].cluster_ip(IpFamily::V6), Some(ip("fd00::1")));
    assert_eq!(p[0].protocol, Protocol::Udp);
    assert_eq!(p[0].name.to_string(), "ns/web:dns");
}

#[test]
fn invalid_cluster_ip_skips_the_service_naming_the_field() {
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.300, ports: [{{port: 80}}]}}"
    )));
    assert!(p.is_empty());
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].object, "Service ns/web");
    assert_eq!(w[0].field, "spec.clusterIP");
    assert!(w[0].reason.contains("invalid IP"), "{}", w[0].reason);
}

#[test]
fn bad_ports_are_skipped_and_the_rest_kept() {
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, ports: [{{name: a, port: 80}}, {{name: b, port: 70000}}, {{name: c, port: 81, protocol: ICMP}}, {{name: d, port: 0}}, {{name: e, port: 82, nodePort: 99999}}]}}"
    )));
    let names: Vec<_> = p.iter().map(|p| p.name.port.as_str()).collect();
    assert_eq!(names, ["a", "e"]);
    assert_eq!(p[1].node_port, 0);
    let fields: Vec<_> = w.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "spec.ports[1].port",
            "spec.ports[2].protocol",
            "spec.ports[3].port",
            "spec.ports[4].nodePort"
        ]
    );
}

#[test]
fn mismatched_ip_family_is_reported() {
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, clusterIPs: [10.0.0.1, 10.0.0.2], ipFamilies: [IPv4, IPv6], ports: [{{port: 80}}]}}"
    )));
    assert_eq!(p[0].cluster_ips, vec![ip("10.0.0.1")]);
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].field, "spec.clusterIPs[1]");
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, ipFamilies: [IPv6], ports: [{{port: 80}}]}}"
    )));
    assert!(p.is_empty());
    assert!(w[0].reason.contains("does not match"), "{}", w[0].reason);
}

#[test]
fn external_ips_lb_ingress_and_source_ranges() {
    let (p, w) = service_ports(&svc(&format!(
        "{META}spec:\n  type: LoadBalancer\n  clusterIP: 10.0.0.1\n  externalIPs: [192.168.99.11, bogus]\n  loadBalancerSourceRanges: [' 203.0.113.0/25 ', 300.0.0.0/8]\n  externalTrafficPolicy: Local\n  healthCheckNodePort: 30000\n  ports: [{{port: 80, nodePort: 3001}}]\nstatus:\n  loadBalancer:\n    ingress: [{{ip: 1.2.3.4}}, {{ip: 5.6.7.8, ipMode: Proxy}}, {{hostname: lb.example}}]"
    )));
    let p = &p[0];
    assert_eq!(p.external_ips, vec![ip("192.168.99.11")]);
    assert_eq!(
        p.load_balancer_vips(IpFamily::V4).collect::<Vec<_>>(),
        vec![ip("1.2.3.4")]
    );
    assert_eq!(p.load_balancer_ingress.len(), 2);
    assert_eq!(
        p.load_balancer_source_ranges,
        vec!["203.0.113.0/25".parse().unwrap()]
    );
    assert!(p.external_policy_local);
    assert_eq!(p.health_check_node_port, 30000);
    let fields: Vec<_> = w.iter().map(|w| w.field.as_str()).collect();
    assert_eq!(
        fields,
        ["spec.externalIPs[1]", "spec.loadBalancerSourceRanges[1]"]
    );
}

#[test]
fn external_policy_local_needs_external_access() {
    let (p, _) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, externalTrafficPolicy: Local, healthCheckNodePort: 30000, ports: [{{port: 80}}]}}"
    )));
    assert!(!p[0].external_policy_local);
    assert_eq!(p[0].health_check_node_port, 0);
    let (p, _) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, externalIPs: [1.1.1.1], externalTrafficPolicy: Local, internalTrafficPolicy: Local, ports: [{{port: 80}}]}}"
    )));
    assert!(p[0].external_policy_local && p[0].internal_policy_local);
}

#[test]
fn session_affinity_timeout_defaults_to_10800() {
    let (p, _) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, sessionAffinity: ClientIP, ports: [{{port: 80}}]}}"
    )));
    assert_eq!(p[0].session_affinity_timeout, Some(10800));
    let (p, _) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, sessionAffinity: ClientIP, sessionAffinityConfig: {{clientIP: {{timeoutSeconds: 60}}}}, ports: [{{port: 80}}]}}"
    )));
    assert_eq!(p[0].session_affinity_timeout, Some(60));
    let (p, _) = service_ports(&svc(&format!(
        "{META}spec: {{clusterIP: 10.0.0.1, ports: [{{port: 80}}]}}"
    )));
    assert_eq!(p[0].session_affinity_timeout, None);
}

#[test]
fn sloppy_ip_parsing_accepts_leading_zeros_like_go() {
    assert_eq!(parse_ip_sloppy("010.001.000.01"), Some(ip("10.1.0.1")));
    assert_eq!(parse_ip_sloppy("1.2.3"), None);
    assert_eq!(parse_ip_sloppy("1.2.3.256"), None);
    assert_eq!(parse_ip_sloppy("fd00::1"), Some(ip("fd00::1")));
}

const SLICE: &str = "metadata: {name: web-1, namespace: ns, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\n";

#[test]
fn slice_conditions_defaults_and_locality() {
    let (d, w) = parse_slice(
        &slice(&format!(
            "{SLICE}endpoints:\n- {{addresses: [10.0.0.1], nodeName: me, zone: z1, hints: {{forZones: [{{name: z1}}]}}}}\n- {{addresses: [10.0.0.2], conditions: {{ready: false, serving: true, terminating: true}}, nodeName: other}}\n- {{addresses: []}}\n- {{addresses: [not-an-ip]}}"
        )),
        "me",
    );
    let d = d.unwrap();
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].field, "endpoints[3].addresses[0]");
    assert_eq!(w[0].object, "EndpointSlice ns/web-1");
    let eps = &d.ports.first().unwrap().1;
    assert_eq!(eps.len(), 2);
    assert!(eps[0].ready && eps[0].serving && !eps[0].terminating && eps[0].is_local);
    assert_eq!(eps[0].port, 8080);
    assert!(eps[0].zone_hints.contains("z1"));
    assert!(!eps[1].ready && eps[1].serving && eps[1].terminating && !eps[1].is_local);
}

#[test]
fn slice_without_service_label_is_reported_and_fqdn_ignored() {
    let (d, w) = parse_slice(
        &slice("metadata: {name: x, namespace: ns}\naddressType: IPv4\nendpoints: []"),
        "me",
    );
    assert!(d.is_none());
    assert_eq!(
        w[0].field,
        "metadata.labels[\"kubernetes.io/service-name\"]"
    );
    let (d, w) = parse_slice(&slice(&SLICE.replace("IPv4", "FQDN")), "me");
    assert!(d.is_none() && w.is_empty());
}

#[test]
fn duplicates_across_slices_are_merged_preferring_local() {
    let a = parse_slice(&slice(&format!("{SLICE}endpoints: [{{addresses: [10.0.0.1], nodeName: other}}, {{addresses: [10.0.0.2]}}]")), "me").0.unwrap();
    let b = parse_slice(
        &slice(&format!(
            "{}endpoints: [{{addresses: [10.0.0.1], nodeName: me}}, {{addresses: [10.0.0.3]}}]",
            SLICE.replace("web-1", "web-2")
        )),
        "me",
    )
    .0
    .unwrap();
    let merged = merge([&a, &b]);
    let eps = merged.values().next().unwrap();
    let addrs: Vec<_> = eps.iter().map(Endpoint::addr).collect();
    assert_eq!(addrs, ["10.0.0.1:8080", "10.0.0.2:8080", "10.0.0.3:8080"]);
    assert!(eps[0].is_local, "the local copy wins");
}

fn web_service() -> Service {
    svc(
        "metadata: {name: web, namespace: ns}\nspec: {clusterIP: 10.0.0.1, ports: [{name: http, port: 80}]}",
    )
}

fn tracker_with_web() -> Tracker {
    let mut t = Tracker::new("me");
    t.apply(Event::Service(Delta::Replace(vec![web_service()])));
    t.apply(Event::EndpointSlice(Delta::Replace(vec![slice(&format!(
        "{SLICE}endpoints: [{{addresses: [10.0.0.1]}}]"
    ))])));
    t.apply(Event::Node(Delta::Replace(vec![])));
    t
}

#[test]
fn tracker_syncs_only_after_every_kind_replaced() {
    let mut t = Tracker::new("me");
    assert!(!t.is_synced());
    t.apply(Event::Service(Delta::Replace(vec![])));
    t.apply(Event::EndpointSlice(Delta::Replace(vec![])));
    assert!(!t.is_synced());
    t.apply(Event::Node(Delta::Replace(vec![])));
    assert!(t.is_synced());
}

#[test]
fn tracker_changed_set_names_exactly_what_changed() {
    let mut t = tracker_with_web();
    assert_eq!(
        t.pending(),
        tracker::Pending {
            services: 1,
            endpoints: 1
        }
    );
    let (s1, c1) = t.snapshot();
    assert_eq!(c1.services.len(), 1);
    assert_eq!(s1.endpoints.values().next().unwrap().len(), 1);
    assert_eq!(t.pending(), tracker::Pending::default());

    // Re-applying the same object changes nothing.
    t.apply(Event::Service(Delta::Apply(web_service())));
    let (s2, c2) = t.snapshot();
    assert!(c2.is_empty(), "{c2:?}");
    assert_eq!(s2.generation, s1.generation + 1);

    // Another service: only it changes; web's entries are shared, not rebuilt.
    t.apply(Event::Service(Delta::Apply(svc(
        "metadata: {name: api, namespace: ns}\nspec: {clusterIP: 10.0.0.2, ports: [{port: 81}]}",
    ))));
    let (s3, c3) = t.snapshot();
    assert_eq!(
        c3.services
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["ns/api"]
    );
    let web = s1.services.keys().next().unwrap();
    assert!(std::sync::Arc::ptr_eq(&s1.services[web], &s3.services[web]));

    // Endpoint change.
    t.apply(Event::EndpointSlice(Delta::Apply(slice(&format!(
        "{SLICE}endpoints: [{{addresses: [10.0.0.1]}}, {{addresses: [10.0.0.9]}}]"
    )))));
    assert_eq!(
        t.pending(),
        tracker::Pending {
            services: 0,
            endpoints: 1
        }
    );
    let (s4, c4) = t.snapshot();
    assert_eq!(
        c4.services
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>(),
        ["ns/web:http"]
    );
    assert_eq!(s4.endpoints_of(web).len(), 2);

    // Delete and Replace.
    t.apply(Event::Service(Delta::Delete(web_service())));
    let (s5, c5) = t.snapshot();
    assert!(c5.services.contains(web) && !s5.services.contains_key(web));
    t.apply(Event::EndpointSlice(Delta::Replace(vec![])));
    let (s6, c6) = t.snapshot();
    assert!(c6.services.contains(web) && s6.endpoints.is_empty());
}

#[test]
fn tracker_reports_node_changes_and_locality() {
    let mut t = tracker_with_web();
    t.snapshot();
    let node: k8s_openapi::api::core::v1::Node = serde_yaml::from_str(
        "metadata: {name: me, labels: {topology.kubernetes.io/zone: z1}}\nspec: {podCIDRs: [10.244.1.0/24]}\nstatus: {addresses: [{type: InternalIP, address: 192.168.0.2}, {type: Hostname, address: me}]}",
    )
    .unwrap();
    t.apply(Event::Node(Delta::Apply(node.clone())));
    let (s, c) = t.snapshot();
    assert!(c.node && c.services.is_empty());
    assert_eq!(s.node.zone(), Some("z1"));
    assert_eq!(s.node.addresses, vec![ip("192.168.0.2")]);
    assert_eq!(s.node.pod_cidrs, vec!["10.244.1.0/24".parse().unwrap()]);
    t.apply(Event::Node(Delta::Apply(node)));
    assert!(t.snapshot().1.is_empty());
}

fn arb_opt_string() -> impl Strategy<Value = Option<String>> {
    prop_oneof![
        Just(None),
        Just(Some("10.0.0.1".to_string())),
        Just(Some("fd00::1".to_string())),
        Just(Some("TCP".to_string())),
        Just(Some("UDP".to_string())),
        Just(Some("None".to_string())),
        "[a-zA-Z0-9:./ -]{0,12}".prop_map(Some),
    ]
}

prop_compose! {
    fn arb_service()(
        cluster_ip in arb_opt_string(),
        cluster_ips in proptest::option::of(proptest::collection::vec(arb_opt_string().prop_map(Option::unwrap_or_default), 0..3)),
        families in proptest::option::of(proptest::collection::vec(prop_oneof![Just("IPv4".to_string()), Just("IPv6".to_string()), "[a-z]{0,4}"], 0..3)),
        type_ in proptest::option::of(prop_oneof![Just("ClusterIP"), Just("NodePort"), Just("LoadBalancer"), Just("ExternalName"), Just("Bogus")]),
        ports in proptest::collection::vec((arb_opt_string(), any::<i32>(), proptest::option::of(any::<i32>()), arb_opt_string()), 0..5),
        external_ips in proptest::option::of(proptest::collection::vec(arb_opt_string().prop_map(Option::unwrap_or_default), 0..3)),
        ranges in proptest::option::of(proptest::collection::vec("[0-9./a-f:]{0,20}", 0..3)),
        affinity in proptest::option::of(prop_oneof![Just("ClientIP"), Just("None"), Just("x")]),
        timeout in proptest::option::of(any::<i32>()),
        etp in proptest::option::of(prop_oneof![Just("Local"), Just("Cluster")]),
        hc in proptest::option::of(any::<i32>()),
    ) -> Service {
        use k8s_openapi::api::core::v1 as v1;
        Service {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("s".into()), namespace: Some("ns".into()), ..Default::default()
            },
            spec: Some(v1::ServiceSpec {
                cluster_ip, cluster_ips, ip_families: families, type_: type_.map(String::from),
                ports: Some(ports.into_iter().map(|(name, port, node_port, protocol)| v1::ServicePort {
                    name, port, node_port, protocol, ..Default::default()
                }).collect()),
                external_ips, load_balancer_source_ranges: ranges,
                session_affinity: affinity.map(String::from),
                session_affinity_config: Some(v1::SessionAffinityConfig { client_ip: Some(v1::ClientIPConfig { timeout_seconds: timeout }) }),
                external_traffic_policy: etp.map(String::from),
                health_check_node_port: hc,
                ..Default::default()
            }),
            status: None,
        }
    }
}

proptest! {
    #[test]
    fn service_builder_never_panics_and_reports_every_skipped_port(s in arb_service()) {
        let (ports, warnings) = service_ports(&s);
        let n_in = s.spec.as_ref().and_then(|s| s.ports.as_ref()).map_or(0, Vec::len);
        if super::service::skip_reason(&s).is_some() {
            prop_assert!(ports.is_empty() && warnings.is_empty());
        } else if ports.is_empty() && warnings.iter().any(|w| w.reason.contains("service skipped")) {
            // the whole service was rejected, with a warning
        } else {
            let port_warnings = warnings.iter().filter(|w| w.field.starts_with("spec.ports[") && (w.field.ends_with("].port") || w.field.ends_with("].protocol"))).count();
            prop_assert_eq!(ports.len() + port_warnings, n_in, "{:?}", warnings);
        }
        for p in &ports {
            prop_assert!(p.port != 0);
            prop_assert!(!p.cluster_ips.is_empty());
        }
    }

    #[test]
    fn slice_builder_never_panics_and_reports_every_skipped_endpoint(
        addrs in proptest::collection::vec(proptest::collection::vec(arb_opt_string().prop_map(Option::unwrap_or_default), 0..2), 0..5),
        ports in proptest::collection::vec((arb_opt_string(), proptest::option::of(any::<i32>()), arb_opt_string()), 0..3),
    ) {
        use k8s_openapi::api::discovery::v1 as d;
        let n_with_addr = addrs.iter().filter(|a| !a.is_empty()).count();
        let s = EndpointSlice {
            metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                name: Some("x".into()), namespace: Some("ns".into()),
                labels: Some([("kubernetes.io/service-name".to_string(), "s".to_string())].into()), ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: Some(addrs.into_iter().map(|addresses| d::Endpoint { addresses, ..Default::default() }).collect()),
            ports: Some(ports.iter().cloned().map(|(name, port, protocol)| d::EndpointPort { name, port, protocol, ..Default::default() }).collect()),
        };
        let (data, warnings) = parse_slice(&s, "me");
        let data = data.unwrap();
        let ep_warnings = warnings.iter().filter(|w| w.field.starts_with("endpoints[")).count();
        let port_warnings = warnings.iter().filter(|w| w.field.starts_with("ports[")).count();
        prop_assert!(data.ports.len() + port_warnings >= 1 || ports.is_empty());
        for (_, eps) in &data.ports {
            prop_assert_eq!(eps.len() + ep_warnings, n_with_addr);
        }
    }
}

fn named_service(name: &str, ip: &str) -> Service {
    svc(&format!(
        "metadata: {{name: {name}, namespace: ns}}\nspec: {{clusterIP: {ip}, ports: [{{name: http, port: 80}}]}}"
    ))
}

fn service_names(t: &mut Tracker) -> Vec<String> {
    let (snap, _) = t.snapshot();
    snap.services.keys().map(|k| k.name.clone()).collect()
}

#[test]
fn streamed_list_removes_what_it_did_not_list_only_when_done() {
    let mut t = tracker_with_web();
    t.apply(Event::Service(Delta::Apply(named_service(
        "old", "10.0.0.9",
    ))));
    assert_eq!(service_names(&mut t), ["old", "web"]);

    t.apply(Event::Service(Delta::ListStart));
    t.apply(Event::Service(Delta::Listed(vec![named_service(
        "new", "10.0.0.8",
    )])));
    t.apply(Event::Service(Delta::Listed(vec![web_service()])));
    // Half-way: listed objects are in, unlisted ones not yet gone.
    assert_eq!(service_names(&mut t), ["new", "old", "web"]);
    t.apply(Event::Service(Delta::ListDone));
    assert_eq!(service_names(&mut t), ["new", "web"]);
}

#[test]
fn restarted_streamed_list_keeps_only_the_last_lists_objects() {
    let mut t = tracker_with_web();
    t.apply(Event::Service(Delta::ListStart));
    t.apply(Event::Service(Delta::Listed(vec![named_service(
        "a", "10.0.0.2",
    )])));
    // The list failed half-way and starts again without `a` (deleted meanwhile).
    t.apply(Event::Service(Delta::ListStart));
    t.apply(Event::Service(Delta::Listed(vec![web_service()])));
    t.apply(Event::Service(Delta::ListDone));
    assert_eq!(service_names(&mut t), ["web"]);
}

#[test]
fn streamed_lists_sync_the_tracker_like_replace() {
    let mut streamed = Tracker::new("me");
    streamed.apply(Event::Service(Delta::ListStart));
    streamed.apply(Event::Service(Delta::Listed(vec![web_service()])));
    streamed.apply(Event::EndpointSlice(Delta::ListStart));
    streamed.apply(Event::EndpointSlice(Delta::Listed(vec![slice(&format!(
        "{SLICE}endpoints: [{{addresses: [10.0.0.1]}}]"
    ))])));
    streamed.apply(Event::Node(Delta::ListStart));
    assert!(!streamed.is_synced(), "no list is done yet");
    streamed.apply(Event::Service(Delta::ListDone));
    streamed.apply(Event::EndpointSlice(Delta::ListDone));
    assert!(!streamed.is_synced(), "the Node list is not done");
    streamed.apply(Event::Node(Delta::ListDone));
    assert!(streamed.is_synced());
    let (a, _) = streamed.snapshot();
    let (b, _) = tracker_with_web().snapshot();
    assert_eq!(a.services, b.services);
    assert_eq!(a.endpoints, b.endpoints);
}
