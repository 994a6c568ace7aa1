//! Loading upstream's iptables corpus (`tests/fixtures/upstream/iptables/cases`): a case's
//! `ProxierTestSettings` become an [`IptablesConfig`], its Services and EndpointSlices are fed
//! through a [`Tracker`] like a source would.

use std::net::IpAddr;
use std::path::Path;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::iptables::IptablesConfig;
use kproxy::dataplane::iptables::config::NfacctCounters;
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::model::input::{Delta, Event};
use kproxy::model::{ChangedSet, IpFamily, Snapshot, Tracker};
use serde::Deserialize;
use serde_yaml::Value;

/// One case input: settings + API objects.
pub struct CaseInput {
    pub cfg: IptablesConfig,
    /// `addrtypeLocalIPs`: what the tracer treats as `--src-type/--dst-type LOCAL`.
    pub local_ips: Vec<IpAddr>,
    pub node_name: String,
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
}

fn strip_prefix_len(s: &str) -> &str {
    s.split('/').next().unwrap_or(s)
}

/// The IP family and local-traffic detector of a `ProxierTestSettings` document (upstream's
/// iptables and nftables corpora write them alike).
pub fn family_and_detector(s: &Value) -> (IpFamily, LocalDetector) {
    let family = match s["ipFamily"].as_str() {
        Some("IPv6") => IpFamily::V6,
        _ => IpFamily::V4,
    };
    let det = &s["localDetector"];
    let detector = match det["mode"].as_str() {
        Some("ClusterCIDR") => LocalDetector::Cidr(
            det["clusterCIDR"]
                .as_str()
                .expect("clusterCIDR")
                .parse()
                .expect("cidr"),
        ),
        Some(m) if m.starts_with("NoOp") => LocalDetector::None,
        other => panic!("unknown localDetector mode {other:?}"),
    };
    (family, detector)
}

/// Builds the proxier settings of a `ProxierTestSettings` document.
pub fn settings_to_config(s: &Value) -> (IptablesConfig, Vec<IpAddr>, String) {
    let (family, detector) = family_and_detector(s);
    let mut cfg = IptablesConfig::new(family, detector);
    cfg.node_ip = s["nodeIP"]
        .as_str()
        .and_then(|i| i.parse::<IpAddr>().ok())
        .filter(|ip| family.matches(ip));
    cfg.masquerade_bit = s["masqueradeBit"].as_u64().unwrap_or(14) as u8;
    cfg.masquerade_all = s["masqueradeAll"].as_bool().unwrap_or(false);
    cfg.localhost_node_ports = s["localhostNodePorts"].as_bool().unwrap_or(true);
    cfg.node_port_addresses = s["nodePortAddresses"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|v| v.as_str().expect("cidr").parse().expect("cidr"))
        .collect();
    cfg.local_addresses = s["interfaces"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|i| i["addresses"].as_sequence().cloned().unwrap_or_default())
        .map(|a| {
            strip_prefix_len(a.as_str().expect("addr"))
                .parse()
                .expect("ip")
        })
        .collect();
    cfg.conntrack_tcp_liberal = s["conntrackTCPLiberal"].as_bool().unwrap_or(false);
    cfg.random_fully = s["iptablesHasRandomFully"].as_bool().unwrap_or(false);
    let n = &s["nfacctCounters"];
    cfg.nfacct_counters = NfacctCounters {
        ct_state_invalid_dropped_pkts: n["ct_state_invalid_dropped_pkts"]
            .as_bool()
            .unwrap_or(false),
        localhost_nps_accepted_pkts: n["localhost_nps_accepted_pkts"].as_bool().unwrap_or(false),
    };
    cfg.large_cluster_threshold =
        s["largeClusterEndpointsThreshold"].as_u64().unwrap_or(1000) as usize;
    let local_ips = s["addrtypeLocalIPs"]
        .as_sequence()
        .into_iter()
        .flatten()
        .map(|v| v.as_str().expect("ip").parse().expect("ip"))
        .collect();
    let node = s["nodeName"].as_str().unwrap_or("test-node").to_string();
    (cfg, local_ips, node)
}

/// Splits API objects into Services and EndpointSlices.
pub fn objects(docs: impl IntoIterator<Item = Value>) -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = vec![];
    let mut slices = vec![];
    for d in docs {
        match d["kind"].as_str() {
            Some("Service") => services.push(Service::deserialize(d).expect("Service")),
            Some("EndpointSlice") => {
                slices.push(EndpointSlice::deserialize(d).expect("EndpointSlice"))
            }
            Some("ProxierTestSettings") | None => {}
            Some(k) => panic!("unexpected kind {k}"),
        }
    }
    (services, slices)
}

/// Reads a case's `input.yaml`.
pub fn load_input(path: &Path) -> CaseInput {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let docs: Vec<Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).expect("yaml"))
        .filter(|v| !v.is_null())
        .collect();
    assert_eq!(
        docs[0]["kind"].as_str(),
        Some("ProxierTestSettings"),
        "{}",
        path.display()
    );
    let (cfg, local_ips, node_name) = settings_to_config(&docs[0]);
    let (services, slices) = objects(docs.into_iter().skip(1));
    CaseInput {
        cfg,
        local_ips,
        node_name,
        services,
        slices,
    }
}

/// Replaces the tracker's whole state with these objects (like a relist) and snapshots.
pub fn feed(
    tracker: &mut Tracker,
    services: &[Service],
    slices: &[EndpointSlice],
) -> (std::sync::Arc<Snapshot>, ChangedSet) {
    tracker.apply(Event::Service(Delta::Replace(services.to_vec())));
    tracker.apply(Event::EndpointSlice(Delta::Replace(slices.to_vec())));
    tracker.snapshot()
}
