//! Upstream's TestCategorizeEndpoints cases (tests/fixtures/upstream/topology/) against
//! `kproxy::model::topology::categorize_endpoints`.

use std::collections::BTreeSet;

use kproxy::model::topology::categorize_endpoints;
use kproxy::model::{Endpoint, NodeInfo, Protocol, ServicePort, ServicePortName, ServiceType};
use kproxy_tests::fixtures;
use serde::Deserialize;

#[derive(Deserialize)]
struct Corpus {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Case {
    name: String,
    #[serde(default)]
    node_labels: Option<std::collections::BTreeMap<String, String>>,
    service_port: Svc,
    #[serde(default)]
    endpoints: Vec<Ep>,
    expected: Expected,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Svc {
    internal_policy_local: bool,
    external_policy_local: bool,
    node_port: u16,
    externally_accessible: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Ep {
    endpoint: String,
    ready: bool,
    serving: bool,
    terminating: bool,
    is_local: bool,
    #[serde(default)]
    zone_hints: Vec<String>,
    #[serde(default)]
    node_hints: Vec<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Expected {
    cluster_endpoints: Option<Vec<String>>,
    local_endpoints: Option<Vec<String>>,
    all_reachable_endpoints: Vec<String>,
    has_any_endpoints: bool,
}

fn service_port(s: &Svc) -> ServicePort {
    let mut external_ips = vec![];
    if s.externally_accessible && s.node_port == 0 {
        external_ips.push("192.0.2.1".parse().unwrap());
    }
    ServicePort {
        name: ServicePortName::new("ns", "svc", "", Protocol::Tcp),
        service_type: if s.node_port != 0 {
            ServiceType::NodePort
        } else {
            ServiceType::ClusterIp
        },
        cluster_ips: vec!["172.30.0.1".parse().unwrap()],
        port: 80,
        protocol: Protocol::Tcp,
        node_port: s.node_port,
        external_ips,
        load_balancer_ingress: vec![],
        load_balancer_source_ranges: vec![],
        external_policy_local: s.external_policy_local,
        internal_policy_local: s.internal_policy_local,
        health_check_node_port: 0,
        session_affinity_timeout: None,
    }
}

fn endpoint(e: &Ep) -> Endpoint {
    let sa: std::net::SocketAddr = e.endpoint.parse().unwrap();
    Endpoint {
        ip: sa.ip(),
        port: sa.port(),
        ready: e.ready,
        serving: e.serving,
        terminating: e.terminating,
        is_local: e.is_local,
        node_name: None,
        zone: None,
        zone_hints: e.zone_hints.iter().cloned().collect(),
        node_hints: e.node_hints.iter().cloned().collect(),
    }
}

fn set(eps: &[Endpoint]) -> BTreeSet<String> {
    eps.iter().map(Endpoint::addr).collect()
}

#[test]
fn all_upstream_categorize_endpoints_cases_pass() {
    let path = fixtures::upstream("topology/categorize-endpoints.yaml");
    let corpus: Corpus = serde_yaml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let mut ran = 0;
    let mut failures = vec![];
    for case in &corpus.cases {
        let svc = service_port(&case.service_port);
        let eps: Vec<Endpoint> = case.endpoints.iter().map(endpoint).collect();
        let node = NodeInfo {
            name: "test-node".into(),
            labels: case.node_labels.clone().unwrap_or_default(),
            ..Default::default()
        };
        let got = categorize_endpoints(&eps, &svc, &node);
        let want_cluster = case
            .expected
            .cluster_endpoints
            .as_ref()
            .map(|v| v.iter().cloned().collect::<BTreeSet<_>>());
        let want_local = case
            .expected
            .local_endpoints
            .as_ref()
            .map(|v| v.iter().cloned().collect::<BTreeSet<_>>());
        let want_all: BTreeSet<String> = case
            .expected
            .all_reachable_endpoints
            .iter()
            .cloned()
            .collect();
        let got_cluster = got.cluster.as_deref().map(set);
        let got_local = got.local.as_deref().map(set);
        // upstream's test: hasAnyEndpoints == len(allReachable) > 0 || onlyRemoteEndpoints
        if got_cluster != want_cluster
            || got_local != want_local
            || set(&got.all_reachable) != want_all
            || got.has_any_endpoints != case.expected.has_any_endpoints
        {
            failures.push(format!(
                "{}: cluster {got_cluster:?} want {want_cluster:?}; local {got_local:?} want {want_local:?}; all {:?} want {want_all:?}; any {} want {}",
                case.name,
                set(&got.all_reachable),
                got.has_any_endpoints,
                case.expected.has_any_endpoints
            ));
        }
        ran += 1;
    }
    assert!(
        failures.is_empty(),
        "{} of {ran} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(ran, 26, "the corpus has 26 cases");
}
