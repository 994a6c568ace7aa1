//! `cargo bench -p kproxy-bench --bench iptables_scale` (root): the iptables proxier at
//! 10,000 ClusterIP services × 5 endpoints in a private network namespace, per backend:
//! cold start (first, full sync), a partial sync after one endpoint change, and a forced full
//! resync. Prints the timings; asserts nothing about them.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::iptables::config::BackendChoice as Choice;
use kproxy::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::model::{IpFamily, Tracker};
use kproxy_tests::iptables_corpus::feed;
use kproxy_tests::netns::Netns;
use serde::Deserialize;
use serde_json::json;

const SERVICES: usize = 10_000;
const ENDPOINTS: usize = 5;

fn objects(change: bool) -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = vec![];
    let mut slices = vec![];
    for i in 0..SERVICES {
        let name = format!("svc{i}");
        services.push(
            Service::deserialize(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "bench"},
                "spec": {"clusterIP": format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256),
                         "ports": [{"name": "p", "port": 80, "protocol": "TCP"}]},
            }))
            .expect("service"),
        );
        let eps: Vec<_> = (0..ENDPOINTS)
            .map(|e| {
                let last = if change && i == 0 && e == 0 { 250 } else { e + 1 };
                json!({"addresses": [format!("10.{}.{}.{}", 128 + i / 256 / 256, (i / 256) % 256, (i % 256) / 51 * 50 + last)]})
            })
            .collect();
        slices.push(
            EndpointSlice::deserialize(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-1"), "namespace": "bench",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "endpoints": eps,
                "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}],
            }))
            .expect("slice"),
        );
    }
    (services, slices)
}

fn run(choice: Choice) {
    let ns = Netns::new("ipt-bench").expect("netns");
    let mut cfg = IptablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.128.0.0/9".parse().unwrap()),
    );
    cfg.netns = Some(ns.path());
    cfg.backend = choice;
    cfg.sync_period = Duration::from_secs(3600);
    let mut dp = IptablesDataplane::new([cfg]).expect("dataplane");
    let mut tracker = Tracker::new("node");
    let (services, slices) = objects(false);
    let (snap, changed) = feed(&mut tracker, &services, &slices);
    let t = Instant::now();
    dp.sync(&snap, &changed).expect("cold start");
    let cold = t.elapsed();
    println!("{choice:?}: cold start {cold:.2?}");
    let (services2, slices2) = objects(true);
    let (snap2, changed2) = feed(&mut tracker, &services2, &slices2);
    let t = Instant::now();
    dp.sync(&snap2, &changed2).expect("partial");
    let partial = t.elapsed();
    println!("{choice:?}: partial sync {partial:.2?}");
    let t = Instant::now();
    // A forced full resync (what the monitor or a failure triggers).
    let (snap3, _) = feed(&mut tracker, &services2, &slices2);
    let changed3 = kproxy::model::ChangedSet {
        node: true,
        ..Default::default()
    };
    dp.sync(&snap3, &changed3).expect("full");
    let full = t.elapsed();
    let rules = ns
        .exec("iptables-save", &["-t", "nat"])
        .map(|s| s.lines().filter(|l| l.starts_with("-A")).count())
        .unwrap_or(0);
    println!(
        "{choice:?}: {SERVICES} services x {ENDPOINTS} endpoints: cold start {cold:.2?}, partial (1 endpoint changed) {partial:.2?}, full resync {full:.2?}; nat rules in the kernel (via iptables-save, nft view) {rules}"
    );
    dp.cleanup().expect("cleanup");
}

fn main() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: iptables_scale needs root");
        return;
    }
    for choice in [Choice::Nft, Choice::Legacy] {
        run(choice);
    }
}
