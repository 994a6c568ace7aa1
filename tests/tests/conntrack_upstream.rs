//! Upstream's conntrack cleanup cases (tests/fixtures/upstream/conntrack/, from
//! pkg/proxy/conntrack/cleanup_test.go) against `kproxy::dataplane::netfilter::conntrack::StaleFilters`: every
//! entry's kept/deleted verdict must match, and the deleted count must equal upstream's
//! `kubeproxy_conntrack_reconciler_deleted_entries_total`.

use std::net::{IpAddr, Ipv4Addr};

use kproxy::dataplane::netfilter::conntrack::Entry;
use kproxy::dataplane::netfilter::conntrack::StaleFilters;
use kproxy::dataplane::netfilter::conntrack::Tuple;
use kproxy::dataplane::netfilter::conntrack::cleanup_required;
use kproxy::model::{ChangedSet, IpFamily, Snapshot};
use kproxy_tests::fixtures;
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entries {
    entries_before: usize,
    entries_after: usize,
    expected_deleted_entries_metric: std::collections::BTreeMap<String, usize>,
    entries: Vec<Flow>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Flow {
    protocol: String,
    orig_dst: Option<IpAddr>,
    orig_port_dst: u16,
    reply_src: IpAddr,
    reply_port_src: u16,
    expected: String,
}

/// A client address no case uses (upstream's entries leave the source unset).
const CLIENT: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 99, 0, 1));

fn entry(f: &Flow) -> Entry {
    let proto = match f.protocol.as_str() {
        "TCP" => 6,
        "UDP" => 17,
        "SCTP" => 132,
        p => panic!("unknown protocol {p}"),
    };
    // An unset --orig-dst (upstream's NodePort entries) never equals a service IP; the
    // unspecified address stands for it.
    let dst = f.orig_dst.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    Entry {
        orig: Tuple {
            src: CLIENT,
            dst,
            proto,
            src_port: 40000,
            dst_port: f.orig_port_dst,
        },
        reply: Tuple {
            src: f.reply_src,
            dst: CLIENT,
            proto,
            src_port: f.reply_port_src,
            dst_port: 40000,
        },
        zone: 0,
        status: 0,
        mark: 0,
        id: None,
    }
}

fn load(case: &str) -> (Snapshot, Entries) {
    let dir = fixtures::upstream(&format!("conntrack/{case}"));
    let (snap, problems) =
        kproxy::app::agent::snapshot_from_manifests(&dir.join("input.yaml"), "test-worker")
            .unwrap();
    // The only document the manifests reader rejects is upstream's settings header
    // (`kind: ProxierSettings`, no apiVersion).
    assert_eq!(problems.len(), 1, "{case}: {problems:?}");
    assert!(
        problems[0].contains("document 0: missing field `apiVersion`"),
        "{problems:?}"
    );
    let text = std::fs::read_to_string(dir.join("entries.yaml")).unwrap();
    (snap.as_ref().clone(), serde_yaml::from_str(&text).unwrap())
}

/// Runs one case; returns (entries checked, entries deleted).
fn run(case: &str) -> (usize, usize) {
    let (snap, data) = load(case);
    let filters = StaleFilters::build(&snap, IpFamily::V4);
    let mut mismatches = vec![];
    let mut deleted = 0;
    for f in &data.entries {
        let e = entry(f);
        let stale = filters.is_stale(&e);
        deleted += usize::from(stale);
        let want = match f.expected.as_str() {
            "deleted" => true,
            "kept" => false,
            other => panic!("{case}: expected {other:?}"),
        };
        if stale != want {
            mismatches.push(format!("{e}: want {}, got stale={stale}", f.expected));
        }
    }
    assert!(
        mismatches.is_empty(),
        "{case}: {} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    assert_eq!(data.entries.len(), data.entries_before, "{case}");
    assert_eq!(data.entries_before - deleted, data.entries_after, "{case}");
    let metric = data
        .expected_deleted_entries_metric
        .get("kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family=\"IPv4\"}")
        .copied()
        .unwrap();
    assert_eq!(deleted, metric, "{case}");
    // IPv6 cleaner: the case is IPv4-only, so nothing can be stale for it.
    assert!(
        StaleFilters::build(&snap, IpFamily::V6).is_empty(),
        "{case}"
    );
    (data.entries.len(), deleted)
}

#[test]
fn upstream_clean_stale_entries_cases() {
    let mut checked = 0;
    let mut cases = 0;
    for (case, want_entries, want_deleted) in [
        ("clean-stale-entries", 72, 14),
        ("service-without-endpoints", 2, 0),
    ] {
        let (n, deleted) = run(case);
        assert_eq!((n, deleted), (want_entries, want_deleted), "{case}");
        checked += n;
        cases += 1;
    }
    eprintln!("checked {cases} upstream cases, {checked} entries");
    assert_eq!((cases, checked), (2, 74));
}

#[test]
fn first_sync_of_the_upstream_service_requires_cleanup() {
    // At startup everything is new: the UDP service's endpoints went from none to some.
    let (snap, _) = load("clean-stale-entries");
    let changed = ChangedSet {
        services: snap.endpoints.keys().cloned().collect(),
        node: true,
    };
    assert!(cleanup_required(
        &Snapshot::default(),
        &snap,
        &changed,
        IpFamily::V4
    ));
    // Nothing changed since: no cleanup.
    assert!(!cleanup_required(&snap, &snap, &changed, IpFamily::V4));
    // The case has no IPv6 endpoints: nothing for the IPv6 cleaner.
    assert!(!cleanup_required(
        &Snapshot::default(),
        &snap,
        &changed,
        IpFamily::V6
    ));
}
