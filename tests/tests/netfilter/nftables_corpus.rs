//! Upstream kube-proxy's nftables corpus (tests/fixtures/upstream/nftables, from
//! kubernetes/kubernetes pkg/proxy/nftables/proxier_test.go @81810de6):
//! - the 15 full rulesets (`expected.nft`) equal the in-memory table after our syncs, compared
//!   after upstream's canonical sort: overall, bad IPs, the 12 steps of the repeated-sync case
//!   through ONE proxier (with `meta.yaml`'s operation counts), and the startup case over a
//!   preexisting table;
//! - the chain-name, service-CIDR, no-endpoints-metric and LB ipMode tables.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kproxy::dataplane::nftables::names::{endpoint_base_of, hash_and_truncate};
use kproxy::dataplane::nftables::{FakeTable, NftablesConfig, NftablesProxier, canonical_sort};
use kproxy::model::{ChangedSet, IpFamily, Protocol, ServicePortName, Tracker};
use kproxy_tests::fixtures::upstream;
use kproxy_tests::nftables_corpus::{default_settings, feed, load_input, objects};
use serde_yaml::Value;

fn cases() -> PathBuf {
    upstream("nftables/cases")
}

fn yaml(path: &Path) -> Value {
    serde_yaml::from_str(
        &fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn table_for(cfg: &NftablesConfig) -> FakeTable {
    FakeTable::new(cfg.table_family(), "kube-proxy")
}

fn expect_dump(name: &str, table: &FakeTable, expected_file: &Path) {
    let expected = canonical_sort(&fs::read_to_string(expected_file).expect("expected.nft"));
    let got = canonical_sort(&table.dump());
    if got != expected {
        let missing: Vec<&str> = expected.lines().filter(|l| !got.contains(l)).collect();
        let extra: Vec<&str> = got.lines().filter(|l| !expected.contains(l)).collect();
        panic!(
            "{name}: table differs from upstream's\nmissing:\n{}\nextra:\n{}\n--- got ---\n{got}",
            missing.join("\n"),
            extra.join("\n")
        );
    }
}

#[test]
fn single_sync_rulesets_match_upstream() {
    let mut compared = 0;
    for case in ["overall-nftables-rules", "bad-ips"] {
        let dir = cases().join(case);
        let input = load_input(&dir.join("input.yaml"));
        let mut tracker = Tracker::new(&input.node_name);
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        let mut table = table_for(&input.cfg);
        let mut p = NftablesProxier::new(input.cfg.clone());
        p.sync(&snap, &changed, Duration::ZERO, &mut table)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        expect_dump(case, &table, &dir.join("expected.nft"));
        compared += 1;
    }
    assert_eq!(compared, 2);
}

fn meta_ops(meta: &Value) -> Option<usize> {
    meta["expectedLastTransactionNumOperations"]
        .as_u64()
        .map(|v| v as usize)
}

/// Steps before whose sync upstream's test ages the stale chains (`ageStaleChains`).
const AGED_BEFORE: [&str; 2] = ["step-04", "step-08"];

#[test]
fn repeated_syncs_match_upstream_step_by_step() {
    let root = cases().join("sync-proxy-rules-repeated");
    let mut steps: Vec<PathBuf> = fs::read_dir(&root)
        .expect("steps")
        .map(|e| e.expect("entry").path())
        .collect();
    steps.sort();
    assert_eq!(steps.len(), 12);
    let first = load_input(&steps[0].join("input.yaml"));
    let mut tracker = Tracker::new(&first.node_name);
    let mut table = table_for(&first.cfg);
    let mut p = NftablesProxier::new(first.cfg.clone());
    let mut now = Duration::from_secs(100);
    let (mut compared, mut counted) = (0, 0);
    for (i, step) in steps.iter().enumerate() {
        let name = step.file_name().unwrap().to_string_lossy().to_string();
        let input = load_input(&step.join("input.yaml"));
        now += Duration::from_millis(10);
        if AGED_BEFORE.iter().any(|s| name.starts_with(s)) {
            now += Duration::from_secs(2);
        }
        if name.starts_with("step-11") {
            // Empty svc3's endpoints (step 09's objects) and sync, age, then restore.
            let empty = load_input(&steps[8].join("input.yaml"));
            let (snap, changed) = feed(&mut tracker, &empty.services, &empty.slices);
            p.sync(&snap, &changed, now, &mut table)
                .expect("step 11 empty");
            assert_eq!(p.stale_chains.len(), 3, "{name}: svc3's chains stale");
            now += Duration::from_secs(2);
        }
        let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
        assert_eq!(p.next_sync_is_full(), i == 0, "{name}: sync mode");
        let stats = p
            .sync(&snap, &changed, now, &mut table)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        expect_dump(&name, &table, &step.join("expected.nft"));
        compared += 1;
        if let Some(n) = meta_ops(&yaml(&step.join("meta.yaml"))) {
            assert_eq!(
                stats.operations,
                n,
                "{name}: operations in the last transaction:\n{}",
                p.last_transaction.as_ref().expect("tx")
            );
            counted += 1;
        }
        if name.starts_with("step-09") {
            let stale: Vec<&str> = p.stale_chains.keys().map(String::as_str).collect();
            assert_eq!(
                stale,
                [
                    "endpoint-SWWHDC7X-ns3/svc3/tcp/p80__10.0.3.2/80",
                    "endpoint-TQ2QKHCZ-ns3/svc3/tcp/p80__10.0.3.3/80",
                    "service-4AT6LBPK-ns3/svc3/tcp/p80",
                ]
            );
        }
        if name.starts_with("step-10") {
            assert!(
                p.stale_chains.is_empty(),
                "{name}: refilled chains un-staled"
            );
        }
    }
    assert_eq!(compared, 12, "rulesets compared");
    assert_eq!(counted, 10, "operation counts checked");
}

#[test]
fn startup_over_a_preexisting_table_matches_upstream() {
    let dir = cases().join("sync-proxy-rules-startup");
    let input = load_input(&dir.join("input.yaml"));
    // setupOps: a first sync of an empty proxier on an empty table.
    let mut empty_table = table_for(&input.cfg);
    let mut empty = NftablesProxier::new(input.cfg.clone());
    let setup_ops = empty
        .sync(
            &Default::default(),
            &ChangedSet::default(),
            Duration::ZERO,
            &mut empty_table,
        )
        .expect("empty sync")
        .operations;

    let mut table = table_for(&input.cfg);
    table
        .load(&fs::read_to_string(dir.join("preexisting.nft")).expect("preexisting"))
        .expect("load preexisting");
    let mut tracker = Tracker::new(&input.node_name);
    let (snap, changed) = feed(&mut tracker, &input.services, &input.slices);
    let mut p = NftablesProxier::new(input.cfg.clone());
    let stats = p
        .sync(&snap, &changed, Duration::ZERO, &mut table)
        .expect("sync");
    expect_dump(
        "sync-proxy-rules-startup",
        &table,
        &dir.join("expected.nft"),
    );
    assert_eq!(
        stats.operations,
        setup_ops + 14,
        "setup + 14 (meta.yaml); transaction:\n{}",
        p.last_transaction.as_ref().expect("tx")
    );
}

#[test]
fn chain_names_match_upstream() {
    let v = yaml(&cases().join("chain-names/cases.yaml"));
    let spn = |c: &Value| {
        ServicePortName::new(
            c["namespace"].as_str().expect("ns"),
            c["service"].as_str().expect("svc"),
            c["port"].as_str().expect("port"),
            match c["protocol"].as_str() {
                Some("sctp") => Protocol::Sctp,
                Some("udp") => Protocol::Udp,
                _ => Protocol::Tcp,
            },
        )
    };
    let mut n = 0;
    for c in v["servicePortChainNameBase"].as_sequence().expect("cases") {
        let s = spn(c);
        let got = hash_and_truncate(&format!(
            "{}/{}/{}/{}",
            s.namespace,
            s.name,
            c["protocol"].as_str().expect("proto"),
            s.port
        ));
        assert_eq!(got, c["expected"].as_str().expect("expected"), "{c:?}");
        assert_eq!(kproxy::dataplane::nftables::names::service_base(&s), got);
        n += 1;
    }
    for c in v["servicePortEndpointChainNameBase"]
        .as_sequence()
        .expect("cases")
    {
        // Upstream's function takes the endpoint string as given (net.SplitHostPort), so the
        // host part is used verbatim, not re-formatted.
        let ep = c["endpoint"].as_str().expect("ep");
        let (host, port) = ep.rsplit_once(':').expect("host:port");
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let got = endpoint_base_of(&spn(c), host, port.parse().expect("port"));
        assert_eq!(got, c["expected"].as_str().expect("expected"), "{c:?}");
        n += 1;
    }
    assert_eq!(n, 9, "naming cases");
}

#[test]
fn service_cidrs_match_upstream() {
    let v = yaml(&cases().join("service-cidrs/cases.yaml"));
    let mut n = 0;
    for c in v["cases"].as_sequence().expect("cases") {
        let family = match c["ipFamily"].as_str() {
            Some("IPv6") => IpFamily::V6,
            _ => IpFamily::V4,
        };
        let mut cfg = NftablesConfig::new(
            family,
            kproxy::dataplane::netfilter::local_detect::LocalDetector::None,
        );
        cfg.service_cidrs = c["input"]
            .as_sequence()
            .expect("input")
            .iter()
            .map(|x| x.as_str().expect("cidr").parse().expect("cidr"))
            .collect();
        let want = c["serviceCIDRs"].as_str().expect("want");
        assert_eq!(cfg.service_cidrs_text(), want);
        let rules = kproxy::dataplane::nftables::render(&Default::default(), &cfg).expect("render");
        let ip = if family == IpFamily::V6 { "ip6" } else { "ip" };
        let line = format!(
            "add rule {ip} kube-proxy cluster-ips-check {ip} daddr {{ {want} }} drop comment \"Drop traffic to unallocated ClusterIPs\""
        );
        assert!(rules.lines().any(|l| l == line), "{line} missing:\n{rules}");
        n += 1;
    }
    assert_eq!(n, 4, "service CIDR cases");
}

fn sync_objects(objs: &Value) -> (NftablesProxier, FakeTable) {
    let base = default_settings(&cases());
    let docs: Vec<Value> = objs.as_sequence().expect("objects").to_vec();
    let (services, slices) = objects(docs);
    let mut tracker = Tracker::new(&base.node_name);
    let (snap, changed) = feed(&mut tracker, &services, &slices);
    let mut table = table_for(&base.cfg);
    let mut p = NftablesProxier::new(base.cfg.clone());
    p.sync(&snap, &changed, Duration::ZERO, &mut table)
        .expect("sync");
    (p, table)
}

#[test]
fn no_endpoints_metric_matches_upstream() {
    let v = yaml(&cases().join("no-endpoints-metric/cases.yaml"));
    let mut n = 0;
    for c in v["cases"].as_sequence().expect("cases") {
        let (p, _) = sync_objects(&c["objects"]);
        let want = |policy: &str| {
            let key = format!(
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}}"
            );
            c["expected"][key.as_str()]
                .as_u64()
                .expect("expected value") as usize
        };
        let name = c["name"].as_str().unwrap_or("");
        assert_eq!(
            p.stats.no_local_internal,
            want("internal"),
            "{name}: internal"
        );
        assert_eq!(
            p.stats.no_local_external,
            want("external"),
            "{name}: external"
        );
        n += 1;
    }
    assert_eq!(n, 7, "metric cases");
}

#[test]
fn load_balancer_ip_mode_matches_upstream() {
    let v = yaml(&cases().join("load-balancer-ingress-ipmode/cases.yaml"));
    let mut n = 0;
    for c in v["cases"].as_sequence().expect("cases") {
        let (_, table) = sync_objects(&c["objects"]);
        let lb = c["objects"][0]["status"]["loadBalancer"]["ingress"][0]["ip"]
            .as_str()
            .expect("lb ip");
        let has = table
            .list_elements("service-ips")
            .iter()
            .any(|(k, _)| *k == format!("{lb} . tcp . 80"));
        assert_eq!(
            has,
            c["expectServiceIPsElement"].as_bool().expect("expect"),
            "{}",
            c["name"].as_str().unwrap_or("")
        );
        n += 1;
    }
    assert_eq!(n, 3, "ipMode cases");
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Flow {
    name: String,
    #[serde(rename = "sourceIP")]
    source_ip: String,
    protocol: Option<String>,
    #[serde(rename = "destIP")]
    dest_ip: String,
    dest_port: u16,
    expected_output: String,
    expected_masq: bool,
}

fn flows_of(v: &Value) -> Vec<Flow> {
    v.as_sequence()
        .into_iter()
        .flatten()
        .map(|f| serde::Deserialize::deserialize(f.clone()).expect("flow"))
        .collect()
}

/// Allow-listed flows: `case dir :: flow name :: reason`.
fn allow_list() -> std::collections::BTreeMap<(String, String), String> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/nftables-flows-allowlist.txt");
    fs::read_to_string(&path)
        .expect("allow-list")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let parts: Vec<&str> = l.splitn(3, " :: ").collect();
            assert_eq!(
                parts.len(),
                3,
                "allow-list line {l:?}: want `case :: flow :: reason`"
            );
            ((parts[0].into(), parts[1].into()), parts[2].into())
        })
        .collect()
}

#[derive(Default)]
struct FlowStats {
    run: usize,
    allowed: usize,
    failures: Vec<String>,
}

fn run_flows(
    case: &str,
    table: &FakeTable,
    local_ips: &[std::net::IpAddr],
    flows: &[Flow],
    allow: &std::collections::BTreeMap<(String, String), String>,
    stats: &mut FlowStats,
) {
    use kproxy_tests::nftables_tracer::{Packet, trace_packet};
    for f in flows {
        let proto = f.protocol.as_deref().unwrap_or("TCP").to_lowercase();
        let pkt = Packet {
            src: f.source_ip.parse().expect("source IP"),
            dst: f.dest_ip.parse().expect("dest IP"),
            proto: proto.clone(),
            dport: f.dest_port,
        };
        let t = trace_packet(table, local_ips, pkt)
            .unwrap_or_else(|e| panic!("{case} :: {}: tracer: {e}", f.name));
        let ok = t.output == f.expected_output && t.masq == f.expected_masq;
        stats.run += 1;
        if allow.contains_key(&(case.to_string(), f.name.clone())) {
            stats.allowed += 1;
            if ok {
                stats
                    .failures
                    .push(format!("{case} :: {}: allow-listed but passes", f.name));
            }
        } else if !ok {
            stats.failures.push(format!(
                "{case} :: {}: {proto} {} -> {}:{}: got {:?} masq={} want {:?} masq={}\nmatched:\n  {}",
                f.name,
                f.source_ip,
                f.dest_ip,
                f.dest_port,
                t.output,
                t.masq,
                f.expected_output,
                f.expected_masq,
                t.matches.join("\n  ")
            ));
        }
    }
}

fn flow_files() -> Vec<PathBuf> {
    fn walk(d: &Path, out: &mut Vec<PathBuf>) {
        for e in fs::read_dir(d).expect("dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.file_name().is_some_and(|n| n == "flows.yaml") {
                out.push(p);
            }
        }
    }
    let mut files = vec![];
    walk(&cases(), &mut files);
    files.sort();
    files
}

#[test]
fn packet_flows_match_upstream() {
    let allow = allow_list();
    let mut stats = FlowStats::default();
    let files = flow_files();
    for file in &files {
        let dir = file.parent().expect("dir");
        let case = dir
            .strip_prefix(cases())
            .expect("rel")
            .display()
            .to_string();
        let flows = yaml(file);
        let input = load_input(&dir.join("input.yaml"));
        let mut tracker = Tracker::new(&input.node_name);
        let mut table = table_for(&input.cfg);
        let mut p = NftablesProxier::new(input.cfg.clone());
        let mut services = input.services.clone();
        let mut slices = input.slices.clone();
        let mut now = Duration::from_secs(1);
        let (snap, changed) = feed(&mut tracker, &services, &slices);
        p.sync(&snap, &changed, now, &mut table).expect("sync");
        let phases: Vec<Value> = match flows["phases"].as_sequence() {
            Some(ph) => ph.clone(),
            None => vec![flows.clone()],
        };
        for (i, phase) in phases.iter().enumerate() {
            if i > 0 {
                let what = phase["phase"].as_str().unwrap_or("");
                if what.contains("OnEndpointSliceDelete") {
                    slices.clear();
                } else if what.contains("OnServiceDelete") {
                    services.clear();
                } else {
                    panic!("{case}: unknown phase {what:?}");
                }
                now += Duration::from_millis(10);
                let (snap, changed) = feed(&mut tracker, &services, &slices);
                p.sync(&snap, &changed, now, &mut table).expect("sync");
            }
            let flows = flows_of(&phase["flows"]);
            run_flows(&case, &table, &input.local_ips, &flows, &allow, &mut stats);
        }
    }
    assert!(
        stats.failures.is_empty(),
        "{} flow mismatches:\n{}",
        stats.failures.len(),
        stats.failures.join("\n\n")
    );
    assert_eq!(files.len(), 25, "flows.yaml files");
    assert_eq!(stats.run, 207, "flows run");
    assert_eq!(
        stats.allowed,
        allow.len(),
        "every allow-list entry names a flow"
    );
    eprintln!("{} flows run, {} allow-listed", stats.run, stats.allowed);
}
