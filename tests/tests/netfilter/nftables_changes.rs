//! Real traffic through the nftables proxier while services change: a sequence of partial
//! syncs (endpoints come and go, a port moves, affinity is switched on and off), and a new
//! proxier over the table an earlier one left (what an agent restart meets) after the
//! services changed in between. Same topology and rig as nftables_services.rs.

use std::time::Duration;

use k8s_openapi::api::core::v1::Service;
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::nftables::kernel::NftRunner;
use kproxy::dataplane::nftables::{NftablesConfig, NftablesDataplane};
use kproxy::model::IpFamily;
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::topology::{NODE_IP, Probe, ProbeResult, Topology, assert_spread};
use kproxy_tests::traffic::{Rig, service, slice, tcp_port, topology};
use serde_json::{Value, json};

fn dataplane(topo: &Topology) -> NftablesDataplane {
    let mut cfg = NftablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.244.0.0/16".parse().unwrap()),
    );
    cfg.node_ip = Some(NODE_IP.into());
    let runner = NftRunner {
        netns: Some(topo.node.path()),
    };
    NftablesDataplane::new([cfg], runner, Duration::from_secs(3600)).expect("dataplane")
}

fn svc(name: &str, cip: &str, ports: Value, affinity: bool) -> Service {
    let mut spec = json!({"clusterIP": cip, "ports": ports});
    if affinity {
        spec["sessionAffinity"] = json!("ClientIP");
    }
    service(name, spec, json!({}))
}

fn tcp(ns: &Netns, addr: &str, n: u32) -> ProbeResult {
    Probe::tcp(addr, n).run(ns, None).expect("probe")
}

/// The per-service chains and sets (`service-`, `endpoint-`, `affinity-`, …) of the `ip
/// kube-proxy` table.
fn service_objects(ns: &Netns) -> Vec<String> {
    let mut out = vec![];
    for what in ["chains", "sets"] {
        let text = ns
            .exec("nft", &["-t", "list", what, "ip"])
            .expect("nft list");
        out.extend(
            text.lines()
                .filter_map(|l| {
                    let l = l.trim();
                    l.strip_prefix("chain ").or_else(|| l.strip_prefix("set "))
                })
                .map(|l| l.trim_end_matches(" {").to_string())
                // Per-service objects carry the service port's name: `…-ns/name/proto/port…`.
                .filter(|n| n.contains('/')),
        );
    }
    out.sort();
    out
}

#[test]
fn partial_syncs_follow_endpoint_port_and_affinity_changes() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-chg", 2, 0, false);
    let dp = dataplane(&topo);
    let mut r = Rig::new(topo, dp);
    let both = ["pod-l0", "pod-l1"];
    let slices = |r: &Rig<NftablesDataplane>, a: &[&str], b: &[&str]| {
        vec![
            slice("a", &r.pods(a), IpFamily::V4),
            slice("b", &r.pods(b), IpFamily::V4),
        ]
    };
    let (a80, b80) = (json!([tcp_port(80)]), json!([tcp_port(80)]));

    // a: two endpoints; b: none.
    let s = [
        svc("a", "10.96.0.50", a80.clone(), false),
        svc("b", "10.96.0.51", b80.clone(), false),
    ];
    let sl = slices(&r, &both, &[]);
    r.sync(&s, &sl);
    assert_spread(&tcp(&r.topo.client, "10.96.0.50:80", 100), &both);
    r.topo.assert_connects_refused("10.96.0.51:80");

    // b gets an endpoint, a loses all of its: a partial sync each way.
    let sl = slices(&r, &[], &["pod-l1"]);
    r.sync(&s, &sl);
    assert!(!r.dp.families()[0].proxier.stats.full, "a partial sync");
    let b = tcp(&r.topo.client, "10.96.0.51:80", 10);
    assert_eq!(b.answers.get("pod-l1"), Some(&10), "{b:?}");
    r.topo.assert_connects_refused("10.96.0.50:80");

    // a comes back with one endpoint and with ClientIP affinity on port 81 instead of 80.
    let s = [
        svc("a", "10.96.0.50", json!([tcp_port(81)]), true),
        svc("b", "10.96.0.51", b80.clone(), false),
    ];
    let sl = slices(&r, &both, &["pod-l1"]);
    r.sync(&s, &sl);
    assert!(!r.dp.families()[0].proxier.stats.full, "a partial sync");
    let a = tcp(&r.topo.client, "10.96.0.50:81", 40);
    assert_eq!(a.total_answers(), 40, "{a:?}");
    assert_eq!(
        a.answers.len(),
        1,
        "affinity: one backend for one client: {a:?}"
    );
    r.topo.assert_connects_refused("10.96.0.50:80");

    // Affinity off again: spread.
    let s = [
        svc("a", "10.96.0.50", json!([tcp_port(81)]), false),
        svc("b", "10.96.0.51", b80, false),
    ];
    r.sync(&s, &sl);
    assert!(!r.dp.families()[0].proxier.stats.full, "a partial sync");
    assert_spread(&tcp(&r.topo.client, "10.96.0.50:81", 100), &both);

    // b is deleted: its chains are flushed now and deleted by a sync more than a second
    // later; nothing of a's old port or affinity is left either.
    r.sync(&s[..1], &sl[..1]);
    std::thread::sleep(Duration::from_millis(1100));
    r.sync(&s[..1], &sl[..1]);
    let left = service_objects(&r.topo.node);
    assert!(
        left.iter().all(|o| o.contains("-default/a/tcp/")) && left.len() == 3,
        "only a's service chain and two endpoint chains are left: {left:#?}"
    );
    assert!(
        !left.iter().any(|o| o.starts_with("affinity-")),
        "{left:#?}"
    );
}

#[test]
fn a_new_proxier_over_an_old_table_serves_the_current_services_only() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-old", 2, 0, false);
    let dp = dataplane(&topo);
    let mut r = Rig::new(topo, dp);
    let both = ["pod-l0", "pod-l1"];
    // The old proxier: a (affinity, both endpoints), b (pod-l0), gone (pod-l0).
    let s = [
        svc("a", "10.96.0.60", json!([tcp_port(80)]), true),
        svc("b", "10.96.0.61", json!([tcp_port(80)]), false),
        svc("gone", "10.96.0.62", json!([tcp_port(80)]), false),
    ];
    let sl = vec![
        slice("a", &r.pods(&both), IpFamily::V4),
        slice("b", &r.pods(&["pod-l0"]), IpFamily::V4),
        slice("gone", &r.pods(&["pod-l0"]), IpFamily::V4),
    ];
    r.sync(&s, &sl);
    let gone = tcp(&r.topo.client, "10.96.0.62:80", 3);
    assert_eq!(gone.answers.get("pod-l0"), Some(&3), "{gone:?}");

    // "Restart": a new dataplane (and model) over the same table, with the services changed
    // in between: a without affinity, b moved to pod-l1, gone deleted, c new.
    let Rig { topo, tracker, .. } = r;
    drop(tracker);
    let dp = dataplane(&topo);
    let mut r = Rig::new(topo, dp);
    let s = [
        svc("a", "10.96.0.60", json!([tcp_port(80)]), false),
        svc("b", "10.96.0.61", json!([tcp_port(80)]), false),
        svc("c", "10.96.0.63", json!([tcp_port(80)]), false),
    ];
    let sl = vec![
        slice("a", &r.pods(&both), IpFamily::V4),
        slice("b", &r.pods(&["pod-l1"]), IpFamily::V4),
        slice("c", &r.pods(&["pod-l0"]), IpFamily::V4),
    ];
    r.sync(&s, &sl);
    assert!(
        r.dp.families()[0].proxier.stats.full,
        "the first sync is full"
    );
    assert_spread(&tcp(&r.topo.client, "10.96.0.60:80", 100), &both);
    let b = tcp(&r.topo.client, "10.96.0.61:80", 20);
    assert_eq!(b.answers.get("pod-l1"), Some(&20), "{b:?}");
    let c = tcp(&r.topo.client, "10.96.0.63:80", 5);
    assert_eq!(c.answers.get("pod-l0"), Some(&5), "{c:?}");
    let gone = Probe::tcp("10.96.0.62:80", 2)
        .timeout(Duration::from_millis(500))
        .run(&r.topo.client, None)
        .expect("probe");
    assert_eq!(
        gone.total_answers(),
        0,
        "a deleted service is not served: {gone:?}"
    );

    // A sync more than a second later deletes what the old proxier left.
    std::thread::sleep(Duration::from_millis(1100));
    r.sync(&s, &sl);
    let left = service_objects(&r.topo.node);
    assert!(
        !left
            .iter()
            .any(|o| o.contains("default/gone/") || o.starts_with("affinity-")),
        "{left:#?}"
    );
    assert!(
        !left
            .iter()
            .any(|o| o.contains("default/b/") && o.contains("10.244.1.2")),
        "b's old endpoint chain: {left:#?}"
    );
}

#[test]
fn an_endpoint_that_comes_back_across_a_restart_is_reached() {
    if !require_root() {
        return;
    }
    let topo = topology("nft-back", 2, 0, false);
    let dp = dataplane(&topo);
    let mut r = Rig::new(topo, dp);
    let both = ["pod-l0", "pod-l1"];
    let s = [svc("a", "10.96.0.70", json!([tcp_port(80)]), false)];
    let sl = [slice("a", &r.pods(&both), IpFamily::V4)];
    r.sync(&s, &sl);
    assert_spread(&tcp(&r.topo.client, "10.96.0.70:80", 100), &both);
    // pod-l1 goes away (not ready): its endpoint chain is flushed, to be deleted by a sync
    // more than a second later — which does not come before the agent restarts.
    let one = [slice("a", &r.pods(&["pod-l0"]), IpFamily::V4)];
    r.sync(&s, &one);
    let a = tcp(&r.topo.client, "10.96.0.70:80", 10);
    assert_eq!(a.answers.get("pod-l0"), Some(&10), "{a:?}");

    // The new agent's first (full) sync finds pod-l1 ready again.
    let Rig { topo, .. } = r;
    let dp = dataplane(&topo);
    let mut r = Rig::new(topo, dp);
    r.sync(&s, &sl);
    assert!(
        r.dp.families()[0].proxier.stats.full,
        "the first sync is full"
    );
    // The kernel told the new proxier which endpoint chain is empty: pod-l1's is rewritten,
    // pod-l0's (intact) kept as it is.
    let tx = r.dp.families()[0]
        .proxier
        .last_transaction
        .as_ref()
        .expect("a transaction")
        .to_string();
    let (l0, l1) = (r.topo.pod("pod-l0").ip, r.topo.pod("pod-l1").ip);
    assert!(tx.contains(&format!("dnat to {l1}:8080")), "{tx}");
    assert!(!tx.contains(&format!("dnat to {l0}:8080")), "{tx}");
    assert_spread(&tcp(&r.topo.client, "10.96.0.70:80", 100), &both);
}
