//! `/metrics` and `/proxyMode` over real HTTP against an in-process agent: every upstream
//! metric that applies to all modes (tests/fixtures/upstream/metrics/metrics.yaml) is exposed
//! with its type; the mode-specific ones exactly in their modes; values change with syncs; the
//! no-local-endpoints gauges match upstream's TestNoEndpointsMetric cases.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::SourceConfig;
use kproxy::dataplane::ProxyMode;
use kproxy::model::IpFamily;
use kproxy::sync::RunnerConfig;
use kproxy_tests::fixtures;
use kproxy_tests::http::{self, sample};
use kproxy_tests::recording::RecordingDataplane;
use serde_yaml::Value;
use tokio::sync::oneshot;

const LIVENESS: Duration = Duration::from_secs(20);

const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n";
/// A second service whose slice carries a change trigger time (`TRIGGER`).
const API: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: default}\nspec: {clusterIP: 10.96.0.11, ports: [{name: http, port: 81}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: api-1, namespace: default, labels: {kubernetes.io/service-name: api}, annotations: {endpoints.kubernetes.io/last-change-trigger-time: \"TRIGGER\"}}\naddressType: IPv4\nports: [{name: http, port: 8081}]\nendpoints: [{addresses: [10.0.0.2]}, {addresses: [10.0.0.3]}]\n";

fn temp_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kproxy-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// An upstream metric as listed in metrics.yaml.
struct UpstreamMetric {
    name: String,
    kind: String,
    registered_for: Option<Vec<String>>,
}

fn upstream_metrics() -> Vec<UpstreamMetric> {
    let text = std::fs::read_to_string(fixtures::upstream("metrics/metrics.yaml")).unwrap();
    let doc: Value = serde_yaml::from_str(&text).unwrap();
    doc["metrics"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| UpstreamMetric {
            name: m["name"].as_str().unwrap().to_owned(),
            kind: m["type"].as_str().unwrap().to_owned(),
            registered_for: m["registeredFor"]
                .as_sequence()
                .map(|s| s.iter().map(|v| v.as_str().unwrap().to_owned()).collect()),
        })
        .collect()
}

/// The `# TYPE` an upstream metric must have in kproxy's OpenMetrics text, and the family name
/// it is declared under (a counter's family drops the `_total` suffix of its samples; the
/// nfacct-backed "Custom" metrics are packet counters).
fn expected_type(m: &UpstreamMetric) -> (String, &'static str) {
    match m.kind.as_str() {
        "Counter" | "Custom" => (
            m.name
                .strip_suffix("_total")
                .expect("counters end in _total")
                .to_owned(),
            "counter",
        ),
        "Gauge" => (m.name.clone(), "gauge"),
        "Histogram" => (m.name.clone(), "histogram"),
        other => panic!("unknown metric type {other} of {}", m.name),
    }
}

fn declared_type(text: &str, family: &str) -> Option<String> {
    let prefix = format!("# TYPE {family} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
}

fn runner() -> RunnerConfig {
    RunnerConfig::new(Duration::from_millis(10), Duration::from_secs(3600))
}

#[tokio::test]
async fn metrics_server_exposes_upstream_metrics_and_follows_syncs() {
    let dir = temp_dir("metrics-e2e");
    write(&dir, "web.yaml", WEB);
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = AgentOptions {
        metrics_bind: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentOptions::new("node-a", SourceConfig::Manifests(dir.clone()), runner())
    };
    let agent = Agent::start(opts, Box::new(dp), async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    let addr = agent.metrics_addr().expect("metrics bound");
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;

    // /proxyMode: the datapath's mode as text.
    let r = http::get(addr, "/proxyMode").await.unwrap();
    assert_eq!((r.status, r.body.as_str()), (200, "ebpf"));

    let m = http::wait_for(addr, "/metrics", LIVENESS, "first sync in metrics", |r| {
        sample(&r.body, "kproxy_programmed_services") == Some(1.0)
    })
    .await;
    // Like upstream: Prometheus' text format unless the client asks for OpenMetrics.
    assert!(
        m.header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        m.headers
    );
    assert!(
        m.body
            .contains("# TYPE kubeproxy_sync_proxy_rules_service_changes_total counter\n"),
        "a 0.0.4 counter family is named with _total:\n{}",
        m.body
    );
    let m = http::get_accepting(
        addr,
        "/metrics",
        "application/openmetrics-text;version=1.0.0",
    )
    .await
    .unwrap();
    assert!(
        m.header("content-type")
            .is_some_and(|c| c.starts_with("application/openmetrics-text")),
        "{:?}",
        m.headers
    );

    // Every upstream metric registered in all modes is exposed with its type.
    let all_modes: Vec<UpstreamMetric> = upstream_metrics()
        .into_iter()
        .filter(|m| m.registered_for.is_none())
        .collect();
    for um in &all_modes {
        let (family, ty) = expected_type(um);
        assert_eq!(
            declared_type(&m.body, &family).as_deref(),
            Some(ty),
            "{} (declared as {family}) in\n{}",
            um.name,
            m.body
        );
    }
    assert_eq!(all_modes.len(), 13, "all-mode metrics checked");

    // Values after the first sync.
    let v =
        |text: &str, s: &str| sample(text, s).unwrap_or_else(|| panic!("{s} missing in\n{text}"));
    let body = &m.body;
    assert_eq!(v(body, "kproxy_programmed_endpoints"), 1.0);
    assert!(v(body, "kubeproxy_sync_proxy_rules_service_changes_total") >= 1.0);
    assert!(v(body, "kubeproxy_sync_proxy_rules_endpoint_changes_total") >= 1.0);
    assert_eq!(
        v(body, "kubeproxy_sync_proxy_rules_service_changes_pending"),
        0.0
    );
    for fam in ["IPv4", "IPv6"] {
        assert!(
            v(
                body,
                &format!(
                    "kubeproxy_sync_proxy_rules_duration_seconds_count{{ip_family=\"{fam}\"}}"
                )
            ) >= 1.0
        );
        let last = v(
            body,
            &format!("kubeproxy_sync_proxy_rules_last_timestamp_seconds{{ip_family=\"{fam}\"}}"),
        );
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(
            now - last < 600.0 && last <= now + 1.0,
            "last sync {last} vs now {now}"
        );
    }
    let syncs_before = v(
        body,
        "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}",
    );
    let changes_before = v(body, "kubeproxy_sync_proxy_rules_service_changes_total");

    assert_eq!(
        v(
            body,
            "kubeproxy_network_programming_duration_seconds_count{ip_family=\"IPv4\"}"
        ),
        0.0,
        "no trigger times yet"
    );

    // A second service: counters and gauges move, and its slice's trigger time is observed.
    let trigger = k8s_openapi::jiff::Timestamp::now().to_string();
    write(&dir, "api.yaml", &API.replace("TRIGGER", &trigger));
    let m = http::wait_for(
        addr,
        "/metrics",
        LIVENESS,
        "second service in metrics",
        |r| sample(&r.body, "kproxy_programmed_services") == Some(2.0),
    )
    .await;
    assert_eq!(v(&m.body, "kproxy_programmed_endpoints"), 3.0);
    assert!(v(&m.body, "kubeproxy_sync_proxy_rules_service_changes_total") > changes_before);
    assert!(
        v(
            &m.body,
            "kubeproxy_sync_proxy_rules_duration_seconds_count{ip_family=\"IPv4\"}"
        ) > syncs_before
    );
    let _ = stop.send(());
    agent.wait().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn mode_specific_metrics_exist_exactly_in_their_modes() {
    let upstream = upstream_metrics();
    let mut checked = 0;
    // Upstream's newer proxiers observe the full/partial sync histograms in nftables mode
    // too (metrics.yaml's note on them; its `registeredFor` is from an older metrics.go).
    let nft_also = [
        "kubeproxy_sync_full_proxy_rules_duration_seconds",
        "kubeproxy_sync_partial_proxy_rules_duration_seconds",
    ];
    for (mode, name) in [
        (ProxyMode::Iptables, "iptables"),
        (ProxyMode::Ipvs, "ipvs"),
        (ProxyMode::Ebpf, "ebpf"),
        (ProxyMode::Nftables, "nftables"),
    ] {
        let text = kproxy::app::registry::metrics(mode).encode();
        for um in &upstream {
            let Some(modes) = &um.registered_for else {
                continue;
            };
            let (family, ty) = expected_type(um);
            let registered = modes.iter().any(|m| m == name)
                || (name == "nftables" && nft_also.contains(&um.name.as_str()));
            assert_eq!(
                declared_type(&text, &family).as_deref(),
                registered.then_some(ty),
                "{} in {name} mode",
                um.name
            );
            checked += 1;
        }
    }
    // 10 mode-specific metrics (8 iptables/ipvs, 2 nftables), checked in each of the 4 modes.
    assert_eq!(checked, 40);
}

#[test]
fn no_local_endpoints_matches_upstream_cases() {
    let text =
        std::fs::read_to_string(fixtures::upstream("metrics/no-endpoints-metric.yaml")).unwrap();
    let doc: Value = serde_yaml::from_str(&text).unwrap();
    let dir = temp_dir("no-local-endpoints");
    let mut ran = 0;
    for case in doc["cases"].as_sequence().unwrap() {
        let name = case["name"].as_str().unwrap();
        let objects: Vec<String> = case["objects"]
            .as_sequence()
            .unwrap()
            .iter()
            .map(|o| serde_yaml::to_string(o).unwrap())
            .collect();
        let file = dir.join("objects.yaml");
        std::fs::write(&file, objects.join("---\n")).unwrap();
        let (snap, problems) =
            kproxy::app::agent::snapshot_from_manifests(&file, "test-node").unwrap();
        assert!(problems.is_empty(), "{name}: {problems:?}");
        let (internal, external) =
            kproxy::observe::metrics::no_local_endpoints(&snap, IpFamily::V4);
        let want = |policy: &str| {
            case["expected"][format!(
                "kubeproxy_sync_proxy_rules_no_local_endpoints_total{{traffic_policy=\"{policy}\"}}"
            )]
            .as_i64()
            .unwrap()
        };
        assert_eq!(
            (internal, external),
            (want("internal"), want("external")),
            "{name}"
        );
        assert_eq!(
            kproxy::observe::metrics::no_local_endpoints(&snap, IpFamily::V6),
            (0, 0),
            "{name}: no IPv6 services"
        );
        ran += 1;
    }
    assert_eq!(ran, 7, "upstream TestNoEndpointsMetric cases");
    let _ = std::fs::remove_dir_all(&dir);
}
