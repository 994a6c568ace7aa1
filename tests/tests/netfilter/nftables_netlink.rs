//! The nf_tables netlink reader (`kproxy::kernel::nftables`) against the real kernel: it
//! reads exactly what `nft -j list` shows of a corpus table (chains, named sets and maps,
//! every element in `nft`'s text), the canary turns a partial sync full after
//! `nft flush table` and the table is restored, and (ignored, prints) the read-back at
//! 10k services × 5 endpoints through `nft -j list` and through netlink, same run.
//! Needs root; skips without it unless `KPROXY_TESTS_REQUIRE_KERNEL=1`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::dataplane::nftables::kernel::{KernelTable, NftRunner};
use kproxy::dataplane::nftables::{NftBackend, NftablesConfig, NftablesProxier};
use kproxy::kernel::nftables::{NFPROTO_IPV4, NftNetlink};
use kproxy::model::testing::{endpoint, service_port, snapshot};
use kproxy::model::{ChangedSet, IpFamily, Snapshot, Tracker};
use kproxy_tests::fixtures::upstream;
use kproxy_tests::netns::{Netns, require_root};
use kproxy_tests::nftables_corpus::{feed, load_input};
use serde_json::Value;

/// (chain names, set/map name → sorted element texts) as `nft -j list table` shows them.
fn nft_view(ns: &Netns, family: &str) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
    let out = ns
        .exec("nft", &["-j", "list", "table", family, "kube-proxy"])
        .expect("nft list table");
    let v: Value = serde_json::from_str(&out).expect("nft json");
    let (mut chains, mut sets) = (vec![], BTreeMap::new());
    for item in v["nftables"].as_array().expect("array") {
        if let Some(c) = item.get("chain") {
            chains.push(c["name"].as_str().expect("name").to_string());
        } else if let Some(s) = item.get("set").or_else(|| item.get("map")) {
            let mut elems: Vec<String> = s["elem"]
                .as_array()
                .into_iter()
                .flatten()
                .map(json_elem)
                .collect();
            elems.sort();
            sets.insert(s["name"].as_str().expect("name").to_string(), elems);
        }
    }
    chains.sort();
    (chains, sets)
}

/// One `nft -j` element as `key` or `key : verdict` text.
fn json_elem(e: &Value) -> String {
    fn key(v: &Value) -> String {
        match v {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            Value::Object(o) if o.contains_key("concat") => o["concat"]
                .as_array()
                .expect("concat")
                .iter()
                .map(key)
                .collect::<Vec<_>>()
                .join(" . "),
            Value::Object(o) if o.contains_key("elem") => key(&o["elem"]["val"]),
            other => panic!("unexpected element {other}"),
        }
    }
    match e.as_array() {
        Some(kv) => {
            let (verb, arg) = kv[1]
                .as_object()
                .and_then(|o| o.iter().next())
                .expect("verdict");
            match arg.get("target").and_then(Value::as_str) {
                Some(t) => format!("{} : {verb} {t}", key(&kv[0])),
                None => format!("{} : {verb}", key(&kv[0])),
            }
        }
        None => key(e),
    }
}

fn netlink_view(nl: &mut NftNetlink) -> (Vec<String>, BTreeMap<String, Vec<String>>) {
    let mut chains: Vec<String> = nl
        .chains("kube-proxy")
        .expect("chains")
        .into_iter()
        .map(|c| c.name)
        .collect();
    chains.sort();
    let mut sets = BTreeMap::new();
    for s in nl.sets("kube-proxy").expect("sets") {
        let mut elems: Vec<String> = nl
            .elements(&s)
            .expect("elements")
            .into_iter()
            .map(|(k, v)| v.map_or(k.clone(), |v| format!("{k} : {v}")))
            .collect();
        elems.sort();
        sets.insert(s.name, elems);
    }
    (chains, sets)
}

/// Every corpus table the kernel test loads, read both ways: the same chains, the same
/// named sets and maps (anonymous `numgen` maps left out by both), the same elements.
#[test]
fn netlink_reads_what_nft_lists() {
    if !require_root() {
        return;
    }
    let mut compared = 0;
    for case in [
        "overall-nftables-rules",
        "node-ports/ipv6-multiple-nodeport-addresses",
        "sync-proxy-rules-startup",
    ] {
        let ns = Netns::new("nft-nl").expect("netns");
        let input = load_input(&upstream("nftables/cases").join(case).join("input.yaml"));
        let family = input.cfg.table_family();
        let mut kernel = KernelTable::new(
            family,
            NftRunner {
                netns: Some(ns.path()),
            },
        );
        let mut tracker = Tracker::new(&input.node_name);
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        NftablesProxier::new(input.cfg.clone())
            .sync(&snap, &changed, Duration::ZERO, &mut kernel)
            .expect("sync");
        let want = nft_view(&ns, family);
        let got = netlink_view(kernel.netlink().expect("netlink"));
        assert_eq!(got, want, "{case}");
        assert!(
            want.1.values().any(|e| !e.is_empty()),
            "{case}: some elements"
        );
        compared += want.1.len();
        // A table that does not exist: nothing, not an error.
        let mut other = NftNetlink::open(NFPROTO_IPV4, Some(&ns.path())).expect("open");
        assert_eq!(other.table("no-such-table").expect("table"), None);
        assert!(other.chains("no-such-table").expect("chains").is_empty());
    }
    assert!(compared >= 15, "{compared} sets and maps compared");
}

fn cfg() -> NftablesConfig {
    NftablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.0.0.0/8".parse().unwrap()),
    )
}

/// `services` ClusterIP services (172.16.x.y:80) with `eps` endpoints each.
fn services(services: u32, eps: u32) -> Snapshot {
    snapshot("node")
        .services((0..services).map(|i| {
            let sp = service_port("ns", &format!("s{i}"), "p")
                .cluster_ip(format!("172.16.{}.{}", i / 250, i % 250 + 1).as_str())
                .build();
            let e = (0..eps)
                .map(|j| {
                    endpoint(
                        format!("10.{}.{}.{}", j + 1, i / 250, i % 250 + 1).as_str(),
                        8080,
                    )
                    .build()
                })
                .collect();
            (sp, e)
        }))
        .build()
}

/// The canary through the kernel: after `nft flush table ip kube-proxy` (every rule gone,
/// chains and maps kept) the next sync is full and the table is what it was. Without the
/// canary the partial sync writes nothing and the table stays empty of rules.
#[test]
fn a_table_flushed_from_outside_is_restored_by_the_next_sync() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("nft-canary").expect("netns");
    let mut kernel = KernelTable::new(
        "ip",
        NftRunner {
            netns: Some(ns.path()),
        },
    );
    let mut p = NftablesProxier::new(cfg());
    let snap = services(3, 2);
    p.sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut kernel)
        .expect("full");
    let rules = |ns: &Netns| {
        ns.exec("nft", &["list", "table", "ip", "kube-proxy"])
            .expect("list")
    };
    let want = rules(&ns);
    let s = p
        .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut kernel)
        .expect("partial");
    assert!(!s.full && s.operations == 0, "{s:?}");
    ns.exec("nft", &["flush", "table", "ip", "kube-proxy"])
        .expect("flush");
    assert_eq!(kernel.rule_count("nat-prerouting").unwrap(), Some(0));
    let s = p
        .sync(&snap, &ChangedSet::default(), Duration::ZERO, &mut kernel)
        .expect("repair");
    assert!(s.full, "{s:?}");
    assert_eq!(p.outside_changes, 1);
    assert_eq!(rules(&ns), want);
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Read-back at 10k services × 5 endpoints, what a full sync reads: the chain and set
/// listings and the six element storages. `nft -j` (kproxy's previous reader: three terse
/// listings and one `nft -j list set|map` per storage, JSON parsed) against netlink, in the
/// same run, plus `nft -j list table` for reference. Prints; asserts only that both read
/// the same element count. `cargo test … nftables_netlink::readback -- --ignored --nocapture`
#[test]
#[ignore = "benchmark: loads 10k services (minutes of kernel time); prints figures"]
fn readback_at_10k_services_nft_json_vs_netlink() {
    if !require_root() {
        return;
    }
    let ns = Netns::new("nft-bench").expect("netns");
    let mut kernel = KernelTable::new(
        "ip",
        NftRunner {
            netns: Some(ns.path()),
        },
    );
    let t = Instant::now();
    NftablesProxier::new(cfg())
        .sync(
            &services(10_000, 5),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut kernel,
        )
        .expect("load 10k services");
    println!("loaded 10k services × 5 endpoints in {:?}", t.elapsed());
    let storages = [
        ("set", "cluster-ips"),
        ("map", "service-ips"),
        ("map", "firewall-ips"),
        ("map", "no-endpoint-services"),
        ("map", "no-endpoint-nodeports"),
        ("map", "service-nodeports"),
    ];
    // `nft` runs (its output captured) and the JSON parse are timed apart: in a debug build
    // the parse is unoptimized serde_json, `nft` is the distribution's binary.
    let parse_time = std::cell::Cell::new(Duration::ZERO);
    let json = |args: &[&str]| -> Value {
        let out = ns.exec("nft", args).expect("nft");
        let t = Instant::now();
        let v = serde_json::from_str(&out).expect("json");
        parse_time.set(parse_time.get() + t.elapsed());
        v
    };
    let (mut t_json, mut t_parse, mut t_nl, mut t_table) = (vec![], vec![], vec![], vec![]);
    let (mut n_json, mut n_nl, mut chains) = (0, 0, 0);
    for _ in 0..3 {
        parse_time.set(Duration::ZERO);
        let t = Instant::now();
        let c = json(&["-t", "-j", "list", "chains", "ip"]);
        json(&["-t", "-j", "list", "sets", "ip"]);
        json(&["-t", "-j", "list", "maps", "ip"]);
        n_json = 0;
        for (kind, name) in storages {
            let v = json(&["-j", "list", kind, "ip", "kube-proxy", name]);
            n_json += v["nftables"][1][kind]["elem"]
                .as_array()
                .map_or(0, Vec::len);
        }
        t_json.push(t.elapsed());
        t_parse.push(parse_time.get());
        chains = c["nftables"].as_array().map_or(0, |a| a.len() - 1);

        let t = Instant::now();
        let nl = kernel.netlink().expect("netlink");
        let listed = nl.chains("kube-proxy").expect("chains").len();
        let sets = nl.sets("kube-proxy").expect("sets");
        n_nl = 0;
        for (_, name) in storages {
            let s = sets.iter().find(|s| s.name == name).expect("storage");
            n_nl += nl.elements(s).expect("elements").len();
        }
        t_nl.push(t.elapsed());
        assert_eq!(listed, chains);

        let t = Instant::now();
        ns.exec("nft", &["-j", "list", "table", "ip", "kube-proxy"])
            .expect("nft list table");
        t_table.push(t.elapsed());
    }
    assert_eq!(n_nl, n_json, "both read the same elements");
    println!(
        "read-back of {chains} chains and {n_nl} elements (median of 3): nft -j list {:?} \
         (of which JSON parsing {:?}), netlink {:?}; nft -j list table, not parsed \
         (reference) {:?}",
        median(t_json),
        median(t_parse),
        median(t_nl),
        median(t_table)
    );
}
