//! Partial syncs at scale against the real kernel, on both backends: N ClusterIP services × 5
//! endpoints (N = 1000, or `KPROXY_IPT_SERVICES`) in a private network namespace. A cold full
//! sync, then one endpoint change (a partial sync) and one service removal: after each, the
//! kernel's nat table equals what a plain restore of upstream's full ruleset gives, and the
//! partial syncs applied only the chains that changed. Prints how long each sync took (no
//! timing is asserted). For figures: `KPROXY_IPT_SERVICES=10000 … -- --test-threads=1
//! --nocapture` (CPU times are per process, so one test at a time), ideally `--release`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::dataplane::Dataplane;
use kproxy::dataplane::iptables::config::BackendChoice as Choice;
use kproxy::dataplane::iptables::{IptablesConfig, IptablesDataplane};
use kproxy::dataplane::netfilter::local_detect::LocalDetector;
use kproxy::model::{IpFamily, Tracker};
use kproxy_tests::iptables_corpus::feed;
use kproxy_tests::netns::{Netns, require_root};
use serde::Deserialize;
use serde_json::json;

const ENDPOINTS: usize = 5;

/// CPU time (user + system) of this process and of its waited-for children so far: the wall
/// time of a sync on a loaded machine says little, its CPU time does.
fn cpu() -> (Duration, Duration) {
    let get = |who| {
        // SAFETY: getrusage fills the struct it is given.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(who, &mut u) };
        let tv = |t: libc::timeval| {
            Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
        };
        tv(u.ru_utime) + tv(u.ru_stime)
    };
    (get(libc::RUSAGE_SELF), get(libc::RUSAGE_CHILDREN))
}

/// Times `f`: wall, own CPU, children's CPU (the iptables binaries).
fn timed<T>(f: impl FnOnce() -> T) -> (T, [Duration; 3]) {
    let (s0, c0) = cpu();
    let t = Instant::now();
    let r = f();
    let wall = t.elapsed();
    let (s1, c1) = cpu();
    (r, [wall, s1 - s0, c1 - c0])
}

fn services() -> usize {
    std::env::var("KPROXY_IPT_SERVICES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

fn cluster_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 96 + i / 65536, (i / 256) % 256, i % 256)
}

fn endpoint(i: usize, e: usize) -> String {
    let n = i * ENDPOINTS + e + 1;
    format!("10.{}.{}.{}", 128 + n / 65536, (n / 256) % 256, n % 256)
}

/// `n` services; service `moved` has its first endpoint replaced.
fn objects(n: usize, moved: Option<usize>) -> (Vec<Service>, Vec<EndpointSlice>) {
    let mut services = vec![];
    let mut slices = vec![];
    for i in 0..n {
        let name = format!("svc{i}");
        services.push(
            Service::deserialize(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "scale"},
                "spec": {"clusterIP": cluster_ip(i),
                         "ports": [{"name": "p", "port": 80, "protocol": "TCP"}]},
            }))
            .expect("service"),
        );
        let eps: Vec<_> = (0..ENDPOINTS)
            .map(|e| {
                let ip = if moved == Some(i) && e == 0 {
                    "10.127.0.1".to_string()
                } else {
                    endpoint(i, e)
                };
                json!({"addresses": [ip]})
            })
            .collect();
        slices.push(
            EndpointSlice::deserialize(json!({
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": format!("{name}-1"), "namespace": "scale",
                             "labels": {"kubernetes.io/service-name": name}},
                "addressType": "IPv4", "endpoints": eps,
                "ports": [{"name": "p", "port": 8080, "protocol": "TCP"}],
            }))
            .expect("slice"),
        );
    }
    (services, slices)
}

/// Chain → its rule lines (from an iptables-save dump; KUBE-* chains only, counters dropped).
fn chains(dump: &str) -> BTreeMap<String, Vec<String>> {
    let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for l in dump.lines() {
        if let Some(c) = l.strip_prefix(':') {
            let name = c.split_whitespace().next().unwrap_or("");
            if name.starts_with("KUBE-") && name != "KUBE-PROXY-CANARY" {
                m.entry(name.to_string()).or_default();
            }
        } else if let Some(r) = l.strip_prefix("-A ") {
            let name = r.split_whitespace().next().unwrap_or("");
            if name.starts_with("KUBE-") {
                m.entry(name.to_string()).or_default().push(l.to_string());
            }
        }
    }
    m
}

fn restore(ns: &Netns, tool: &str, input: &str) {
    let mut child = ns
        .command(tool)
        .stdin(Stdio::piped())
        .spawn()
        .expect("restore");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write");
    assert!(child.wait().expect("wait").success(), "{tool} failed");
}

/// The nat chains a plain restore of `planned` gives (a fresh namespace, same backend).
fn reference(flavor: &str, planned: &str) -> BTreeMap<String, Vec<String>> {
    let ns = Netns::new("ipt-part-ref").expect("netns");
    restore(&ns, &format!("iptables-{flavor}-restore"), planned);
    chains(
        &ns.exec(&format!("iptables-{flavor}-save"), &["-t", "nat"])
            .expect("save"),
    )
}

fn assert_kernel_matches(
    what: &str,
    got: &BTreeMap<String, Vec<String>>,
    want: &BTreeMap<String, Vec<String>>,
) {
    let missing: Vec<&String> = want.keys().filter(|c| !got.contains_key(*c)).collect();
    let extra: Vec<&String> = got.keys().filter(|c| !want.contains_key(*c)).collect();
    let differ: Vec<&String> = want
        .iter()
        .filter(|(c, r)| got.get(*c).is_some_and(|g| g != *r))
        .map(|(c, _)| c)
        .take(5)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty() && differ.is_empty(),
        "{what}: chains missing {:?}, extra {:?}, with other rules {:?}",
        &missing[..missing.len().min(5)],
        &extra[..extra.len().min(5)],
        differ
    );
}

fn run(choice: Choice, flavor: &str) {
    let n = services();
    let ns = Netns::new(&format!("ipt-part-{flavor}")).expect("netns");
    let mut cfg = IptablesConfig::new(
        IpFamily::V4,
        LocalDetector::Cidr("10.128.0.0/9".parse().unwrap()),
    );
    cfg.netns = Some(ns.path());
    cfg.backend = choice;
    cfg.sync_period = Duration::from_secs(3600);
    let mut dp = IptablesDataplane::new([cfg.clone()]).expect("dataplane");
    let mut expected_cfg = cfg.clone();
    expected_cfg.random_fully = dp.proxiers()[0].cfg.random_fully;
    let save = || {
        chains(
            &ns.exec(&format!("iptables-{flavor}-save"), &["-t", "nat"])
                .expect("save"),
        )
    };
    let mut tracker = Tracker::new("node");
    let mut figures = vec![];

    let (services, slices) = objects(n, None);
    let (snap, changed) = feed(&mut tracker, &services, &slices);
    let (r, d) = timed(|| dp.sync(&snap, &changed));
    r.expect("cold full sync");
    figures.push(("cold full sync", d));
    let want = reference(
        flavor,
        &kproxy::dataplane::iptables::render(&snap, &expected_cfg),
    );
    assert!(want.len() > n * (ENDPOINTS + 1), "{} chains", want.len());
    assert_kernel_matches("after the cold sync", &save(), &want);

    // One endpoint of one service replaced: its SVC chain, the new SEP chain, the old one's
    // deletion (large-cluster mode: at the next cleanup) — nothing else.
    let moved = n / 2;
    let (services, slices) = objects(n, Some(moved));
    let (snap, changed) = feed(&mut tracker, &services, &slices);
    assert_eq!(changed.services.len(), 1);
    let (r, d) = timed(|| dp.sync(&snap, &changed));
    r.expect("partial sync");
    figures.push(("one endpoint changed", d));
    let stats = dp.proxiers()[0].stats;
    assert_eq!(stats.partial_syncs, 1, "{stats:?}");
    assert!(
        stats.chains_written_last <= 3 && stats.chains_omitted_last > 0,
        "only the changed service's chains are applied: {stats:?}"
    );
    let got = save();
    let mut want = reference(
        flavor,
        &kproxy::dataplane::iptables::render(&snap, &expected_cfg),
    );
    // Large-cluster mode keeps stale chains until the next cleanup, like upstream: the old
    // endpoint's chain may still be there, unreferenced.
    for c in got.keys().filter(|c| !want.contains_key(*c)) {
        assert!(c.starts_with("KUBE-SEP-"), "unexpected chain {c}");
        assert!(
            !got.values()
                .flatten()
                .any(|r| r.ends_with(&format!("-j {c}"))),
            "stale {c} still referenced"
        );
    }
    want.extend(
        got.iter()
            .filter(|(c, _)| !want.contains_key(*c))
            .map(|(c, r)| (c.clone(), r.clone()))
            .collect::<Vec<_>>(),
    );
    assert_kernel_matches("after one endpoint change", &got, &want);

    // One service removed: KUBE-SERVICES changes too (and the stale chains go once a cleanup is
    // due: force it with a full sync afterwards).
    let (services, slices) = objects(n - 1, Some(moved));
    let (snap, changed) = feed(&mut tracker, &services, &slices);
    let (r, d) = timed(|| dp.sync(&snap, &changed));
    r.expect("partial sync (service removed)");
    figures.push(("one service removed", d));
    let stats = dp.proxiers()[0].stats;
    assert_eq!(stats.partial_syncs, 2, "{stats:?}");
    let got = save();
    let svc_rules = |m: &BTreeMap<String, Vec<String>>| m.get("KUBE-SERVICES").cloned();
    let want = reference(
        flavor,
        &kproxy::dataplane::iptables::render(&snap, &expected_cfg),
    );
    assert_eq!(
        svc_rules(&got),
        svc_rules(&want),
        "KUBE-SERVICES after the removal"
    );

    let changed = kproxy::model::ChangedSet {
        node: true,
        ..Default::default()
    };
    let (r, d) = timed(|| dp.sync(&snap, &changed));
    r.expect("forced full sync");
    figures.push(("forced full resync", d));
    assert_kernel_matches("after a full resync", &save(), &want);

    let line: Vec<String> = figures
        .iter()
        .map(|(what, [wall, own, children])| {
            format!(
                "{what} {:.3} s (CPU: kproxy {:.3} s, iptables {:.3} s)",
                wall.as_secs_f64(),
                own.as_secs_f64(),
                children.as_secs_f64()
            )
        })
        .collect();
    println!(
        "iptables-{flavor}: {n} services x {ENDPOINTS} endpoints: {}",
        line.join(", ")
    );
    dp.cleanup().expect("cleanup");
}

#[test]
fn nft_partial_syncs_apply_only_changed_chains() {
    if !require_root() {
        return;
    }
    run(Choice::Nft, "nft");
}

#[test]
fn legacy_partial_syncs_apply_only_changed_chains() {
    if !require_root() {
        return;
    }
    run(Choice::Legacy, "legacy");
}
