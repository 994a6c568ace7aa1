//! The real kernel accepts every transaction kproxy's nftables proxier writes, in order, and
//! ends up with the table kproxy's in-memory model holds: the corpus cases below are synced
//! through the model, and each transaction it applied (stale-chain deletions included) is
//! run through `nft -f` in a private network namespace; then the kernel's table (`nft -j
//! list table`) is compared with the model's chains, rule counts and set/map elements.
//! Needs root; skips without it unless `KPROXY_TESTS_REQUIRE_KERNEL=1`.

use std::collections::BTreeMap;
use std::fs;
use std::path::PathBuf;
use std::time::Duration;

use kproxy::dataplane::nftables::{FakeTable, NftablesProxier, Transaction};
use kproxy::model::Tracker;
use kproxy_tests::fixtures::upstream;
use kproxy_tests::netns::{Netns, require_root, unique_name};
use kproxy_tests::nftables_corpus::{feed, load_input};
use serde_json::Value;

fn cases() -> PathBuf {
    upstream("nftables/cases")
}

fn nft_apply(ns: &Netns, text: &str, what: &str) {
    let path = std::env::temp_dir().join(format!("{}.nft", unique_name("nft-tx")));
    fs::write(&path, text).expect("write transaction");
    let res = ns.exec("nft", &["-f", path.to_str().expect("path")]);
    let _ = fs::remove_file(&path);
    if let Err(e) = res {
        panic!("{what}: the kernel refused the transaction: {e:#}\n{text}");
    }
}

/// (chain → rule count, set/map → element count) of a table.
type Shape = (BTreeMap<String, usize>, BTreeMap<String, usize>);

fn kernel_shape(ns: &Netns, family: &str) -> Shape {
    let out = ns
        .exec("nft", &["-j", "list", "table", family, "kube-proxy"])
        .expect("nft list table");
    let v: Value = serde_json::from_str(&out).expect("nft json");
    let (mut chains, mut sets) = (BTreeMap::new(), BTreeMap::new());
    for item in v["nftables"].as_array().expect("nftables array") {
        if let Some(c) = item.get("chain") {
            chains
                .entry(c["name"].as_str().expect("name").to_string())
                .or_insert(0);
        } else if let Some(r) = item.get("rule") {
            *chains
                .entry(r["chain"].as_str().expect("chain").to_string())
                .or_insert(0) += 1;
        } else if let Some(s) = item.get("set").or_else(|| item.get("map")) {
            let n = s["elem"].as_array().map_or(0, Vec::len);
            sets.insert(s["name"].as_str().expect("name").to_string(), n);
        }
    }
    (chains, sets)
}

fn model_shape(t: &FakeTable) -> Shape {
    (
        t.chains
            .iter()
            .map(|(n, c)| (n.clone(), c.rules.len()))
            .collect(),
        t.sets
            .iter()
            .map(|(n, s)| (n.clone(), s.elements.len()))
            .collect(),
    )
}

/// Applies every transaction the model applied since `from`, then compares the tables.
fn replay(ns: &Netns, t: &FakeTable, from: usize, what: &str) -> usize {
    let txs: &[Transaction] = &t.transactions[from..];
    for (i, tx) in txs.iter().enumerate() {
        nft_apply(ns, &tx.to_string(), &format!("{what} transaction {i}"));
    }
    assert_eq!(
        kernel_shape(ns, &t.family),
        model_shape(t),
        "{what}: kernel vs model"
    );
    t.transactions.len()
}

#[test]
fn kernel_accepts_every_transaction_of_the_corpus() {
    if !require_root() {
        return;
    }
    let mut replayed = 0;
    for case in [
        "overall-nftables-rules",
        "bad-ips",
        "node-ports/ipv6-multiple-nodeport-addresses",
        "internal-external-masquerade/masqueradeAll-no-LocalTrafficDetector",
        "terminating-endpoints-etp-local/only-terminating-endpoints-exist",
    ] {
        let ns = Netns::new("nft-case").expect("netns");
        let input = load_input(&cases().join(case).join("input.yaml"));
        let mut tracker = Tracker::new(&input.node_name);
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        let mut t = FakeTable::new(input.cfg.table_family(), "kube-proxy");
        let mut p = NftablesProxier::new(input.cfg.clone());
        p.sync(&snap, &changed, Duration::ZERO, &mut t)
            .expect("sync");
        replay(&ns, &t, 0, case);
        replayed += 1;
    }

    // The repeated-sync case: partial syncs, flushed chains, stale-chain deletions.
    let root = cases().join("sync-proxy-rules-repeated");
    let mut steps: Vec<PathBuf> = fs::read_dir(&root)
        .expect("steps")
        .map(|e| e.expect("entry").path())
        .collect();
    steps.sort();
    let ns = Netns::new("nft-repeated").expect("netns");
    let first = load_input(&steps[0].join("input.yaml"));
    let mut tracker = Tracker::new(&first.node_name);
    let mut t = FakeTable::new(first.cfg.table_family(), "kube-proxy");
    let mut p = NftablesProxier::new(first.cfg.clone());
    let (mut now, mut done) = (Duration::from_secs(100), 0);
    for step in &steps {
        let name = step.file_name().unwrap().to_string_lossy().to_string();
        if ["step-04", "step-08"].iter().any(|s| name.starts_with(s)) {
            now += Duration::from_secs(2);
        }
        if name.starts_with("step-11") {
            let empty = load_input(&steps[8].join("input.yaml"));
            let (snap, changed) = feed(&mut tracker, &empty.services, &empty.slices);
            p.sync(&snap, &changed, now, &mut t).expect("step 11 empty");
            now += Duration::from_secs(2);
        }
        let input = load_input(&step.join("input.yaml"));
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        p.sync(&snap, &changed, now, &mut t).expect("sync");
        done = replay(&ns, &t, done, &name);
        replayed += 1;
    }

    // Startup over a preexisting table.
    let dir = cases().join("sync-proxy-rules-startup");
    let ns = Netns::new("nft-startup").expect("netns");
    let pre = fs::read_to_string(dir.join("preexisting.nft")).expect("preexisting");
    nft_apply(&ns, &pre, "preexisting.nft");
    let input = load_input(&dir.join("input.yaml"));
    let mut t = FakeTable::new(input.cfg.table_family(), "kube-proxy");
    t.load(&pre).expect("load");
    let mut tracker = Tracker::new(&input.node_name);
    let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
    NftablesProxier::new(input.cfg.clone())
        .sync(&snap, &changed, Duration::ZERO, &mut t)
        .expect("sync");
    replay(&ns, &t, 0, "sync-proxy-rules-startup");
    replayed += 1;
    assert_eq!(replayed, 5 + 12 + 1, "cases replayed");
}

/// The kernel backend (`KernelTable`: `nft -f -`, `nft -j list`) against the in-memory model:
/// the same syncs give the same chains, sets and elements (element text included, so the
/// element storages compare key by key), and a restarted proxier over the kernel's table
/// writes exactly what it writes over the model's (the startup case: the elements read back
/// are recognised, nothing is rewritten twice).
#[test]
fn kernel_backend_reads_back_what_the_model_holds() {
    use kproxy::dataplane::nftables::NftBackend;
    use kproxy::dataplane::nftables::kernel::{KernelTable, NftRunner};
    if !require_root() {
        return;
    }
    let mut compared = 0;
    for case in [
        "overall-nftables-rules",
        "node-ports/ipv6-multiple-nodeport-addresses",
        "sync-proxy-rules-startup",
    ] {
        let ns = Netns::new("nft-backend").expect("netns");
        let dir = cases().join(case);
        let input = load_input(&dir.join("input.yaml"));
        let family = input.cfg.table_family();
        let mut fake = FakeTable::new(family, "kube-proxy");
        let mut kernel = KernelTable::new(
            family,
            NftRunner {
                netns: Some(ns.path()),
            },
        );
        if let Ok(pre) = fs::read_to_string(dir.join("preexisting.nft")) {
            fake.load(&pre).expect("load");
            nft_apply(&ns, &pre, "preexisting.nft");
        }
        let mut tracker = Tracker::new(&input.node_name);
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        let (mut pf, mut pk) = (
            NftablesProxier::new(input.cfg.clone()),
            NftablesProxier::new(input.cfg.clone()),
        );
        let sf = pf.sync(&snap, &changed, Duration::ZERO, &mut fake);
        let sk = pk.sync(&snap, &changed, Duration::ZERO, &mut kernel);
        assert_eq!(sk, sf, "{case}: same sync over kernel and model");
        let sorted = |mut v: Vec<String>| {
            v.sort();
            v
        };
        assert_eq!(
            sorted(kernel.list_chains().unwrap()),
            sorted(fake.list_chains()),
            "{case}"
        );
        assert_eq!(
            sorted(NftBackend::list_sets(&mut kernel).unwrap()),
            sorted(fake.list_sets()),
            "{case}"
        );
        for set in fake.sets.keys() {
            let mut k = kernel.list_elements(set).unwrap();
            let mut f = fake.list_elements(set);
            k.sort();
            f.sort();
            assert_eq!(k, f, "{case}: elements of {set}");
            compared += 1;
        }
        // A restart over the table: the same (small) transaction over both.
        let (mut pf, mut pk) = (
            NftablesProxier::new(input.cfg.clone()),
            NftablesProxier::new(input.cfg.clone()),
        );
        let sf = pf.sync(&snap, &changed, Duration::ZERO, &mut fake).unwrap();
        let sk = pk
            .sync(&snap, &changed, Duration::ZERO, &mut kernel)
            .unwrap();
        assert_eq!(sk.operations, sf.operations, "{case}: restart");
    }
    assert!(compared >= 10, "{compared} sets compared");
}
