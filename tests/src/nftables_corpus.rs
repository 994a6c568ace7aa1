//! Loading upstream's nftables corpus (`tests/fixtures/upstream/nftables/cases`): a case's
//! `ProxierTestSettings` become an [`NftablesConfig`]; its Services and EndpointSlices are fed
//! through a [`kproxy::model::Tracker`] like a source would (see [`crate::iptables_corpus`]).

use std::net::IpAddr;
use std::path::Path;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::nftables::NftablesConfig;
use serde::Deserialize;
use serde_yaml::Value;

pub use crate::iptables_corpus::{feed, objects};

/// One case input: settings + API objects.
pub struct NftCaseInput {
    pub cfg: NftablesConfig,
    /// `fibLocalIPs (tracer)`: what the tracer treats as `fib … type local`.
    pub local_ips: Vec<IpAddr>,
    pub node_name: String,
    pub services: Vec<Service>,
    pub slices: Vec<EndpointSlice>,
}

fn strs(v: &Value) -> Vec<String> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .map(|x| x.as_str().expect("string").to_string())
        .collect()
}

/// Builds the proxier settings of a `ProxierTestSettings` document.
pub fn settings_to_config(s: &Value) -> (NftablesConfig, Vec<IpAddr>, String) {
    let (family, detector) = crate::iptables_corpus::family_and_detector(s);
    let mut cfg = NftablesConfig::new(family, detector);
    cfg.node_ip = s["nodeIP"]
        .as_str()
        .and_then(|i| i.parse::<IpAddr>().ok())
        .filter(|ip| family.matches(ip));
    cfg.masquerade_all = s["masqueradeAll"].as_bool().unwrap_or(false);
    let mark = s["masqueradeMark"].as_str().unwrap_or("0x4000");
    let mark = u64::from_str_radix(mark.trim_start_matches("0x"), 16).expect("mark");
    cfg.masquerade_bit = mark.trailing_zeros() as u8;
    cfg.node_port_addresses = strs(&s["nodePortAddresses"])
        .iter()
        .map(|c| c.parse().expect("cidr"))
        .collect();
    cfg.local_addresses = s["interfaces"]
        .as_sequence()
        .into_iter()
        .flatten()
        .flat_map(|i| strs(&i["addresses"]))
        .map(|a| a.split('/').next().unwrap_or("").parse().expect("ip"))
        .collect();
    cfg.service_cidrs = s["serviceCIDRs"]
        .as_str()
        .unwrap_or("")
        .split(',')
        .filter(|c| !c.is_empty())
        .map(|c| c.parse().expect("cidr"))
        .collect();
    let local_ips = strs(&s["fibLocalIPs (tracer)"])
        .iter()
        .map(|i| i.parse().expect("ip"))
        .collect();
    let node = s["nodeName"].as_str().unwrap_or("test-node").to_string();
    (cfg, local_ips, node)
}

/// Reads a case's `input.yaml`.
pub fn load_input(path: &Path) -> NftCaseInput {
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
    NftCaseInput {
        cfg,
        local_ips,
        node_name,
        services,
        slices,
    }
}

/// The default settings of upstream's nftables fake proxier (for the table tests, whose
/// cases carry only API objects): those of `overall-nftables-rules`.
pub fn default_settings(cases: &Path) -> NftCaseInput {
    load_input(&cases.join("overall-nftables-rules/input.yaml"))
}
