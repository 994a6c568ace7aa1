//! `/healthz` and `/livez` over real HTTP against an in-process agent: upstream's status codes,
//! headers and JSON body; unhealthy once syncs stop succeeding for the health timeout
//! (2 × syncPeriod); node eligibility from the Node object (fake API server); the "Starting"
//! event on the Node.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeSpec, NodeStatus, Taint};
use k8s_openapi::api::events::v1::Event;
use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::SourceConfig;
use kproxy::sync::RunnerConfig;
use kproxy_tests::fakeapi::FakeApi;
use kproxy_tests::http::{self, sample};
use kproxy_tests::recording::RecordingDataplane;
use tokio::sync::oneshot;

/// Generous bound for anything the test waits for.
const LIVENESS: Duration = Duration::from_secs(20);

const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n";

fn temp_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kproxy-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// A 500 ms sync period: health timeout 1 s.
fn runner() -> RunnerConfig {
    RunnerConfig {
        retry_base: Duration::from_millis(100),
        ..RunnerConfig::new(Duration::from_millis(10), Duration::from_millis(500))
    }
}

fn options(source: SourceConfig) -> AgentOptions {
    AgentOptions {
        healthz_bind: Some("127.0.0.1:0".parse().unwrap()),
        metrics_bind: Some("127.0.0.1:0".parse().unwrap()),
        ..AgentOptions::new("node-a", source, runner())
    }
}

fn assert_upstream_headers(r: &http::Response) {
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("x-content-type-options"), Some("nosniff"));
}

#[tokio::test]
async fn healthz_turns_503_when_syncs_stop_succeeding_and_recovers() {
    let dir = temp_dir("health-fail");
    write(&dir, "web.yaml", WEB);
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let agent = Agent::start(
        options(SourceConfig::Manifests(dir.clone())),
        Box::new(dp),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    assert_eq!(agent.health.lock().timeout(), Duration::from_secs(1));
    let addr = agent.healthz_addr().expect("healthz bound");
    rec.wait_for(LIVENESS, "first sync", |c| c.iter().any(|r| r.ok))
        .await;

    let r = http::get(addr, "/healthz").await.unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert_upstream_headers(&r);
    let b = r.json();
    assert_eq!(b["healthy"], true);
    assert_eq!(b["nodeEligible"], true, "standalone: no node lifecycle");
    assert_eq!(b["status"]["IPv4"]["healthy"], true);
    assert_eq!(b["status"]["IPv6"]["healthy"], true);
    assert_eq!(
        b["lastUpdated"], b["currentTime"],
        "healthy: lastUpdated is the current time"
    );
    let r = http::get(addr, "/livez").await.unwrap();
    assert_eq!(r.status, 200);
    assert_upstream_headers(&r);
    assert!(
        r.json().get("nodeEligible").is_none(),
        "/livez has no nodeEligible"
    );

    // Every sync fails from now on: after the health timeout both endpoints answer 503.
    rec.fail_next(usize::MAX);
    let r = http::wait_for(addr, "/healthz", LIVENESS, "/healthz 503", |r| {
        r.status == 503
    })
    .await;
    assert_upstream_headers(&r);
    let b = r.json();
    assert_eq!(b["healthy"], false);
    assert_eq!(b["status"]["IPv4"]["healthy"], false);
    assert_ne!(
        b["lastUpdated"], b["currentTime"],
        "unhealthy: lastUpdated is the last successful sync"
    );
    let r = http::get(addr, "/livez").await.unwrap();
    assert_eq!(r.status, 503, "livez reflects the proxy's health");
    assert!(
        rec.calls().iter().filter(|c| !c.ok).count() >= 2,
        "failures were retried"
    );

    // Syncs succeed again: healthy again.
    rec.fail_next(0);
    http::wait_for(addr, "/healthz", LIVENESS, "/healthz 200 again", |r| {
        r.status == 200
    })
    .await;

    // The answers were counted.
    let m = http::get(agent.metrics_addr().unwrap(), "/metrics")
        .await
        .unwrap();
    for series in [
        "kubeproxy_proxy_healthz_total{code=\"200\"}",
        "kubeproxy_proxy_healthz_total{code=\"503\"}",
        "kubeproxy_proxy_livez_total{code=\"200\"}",
        "kubeproxy_proxy_livez_total{code=\"503\"}",
    ] {
        assert!(
            sample(&m.body, series).is_some_and(|v| v >= 1.0),
            "{series} missing or 0 in\n{}",
            m.body
        );
    }
    assert!(
        sample(&m.body, "kproxy_sync_errors_total{mode=\"ebpf\"}").is_some_and(|v| v >= 2.0),
        "sync errors counted"
    );
    let _ = stop.send(());
    agent.wait().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

fn node(taint: Option<&str>) -> Node {
    let mut n = Node::default();
    n.metadata.name = Some("node-a".into());
    n.spec = Some(NodeSpec {
        taints: taint.map(|key| {
            vec![Taint {
                key: key.into(),
                effect: "NoSchedule".into(),
                ..Default::default()
            }]
        }),
        ..Default::default()
    });
    n.status = Some(NodeStatus {
        addresses: Some(vec![
            NodeAddress {
                type_: "ExternalIP".into(),
                address: "203.0.113.7".into(),
            },
            NodeAddress {
                type_: "InternalIP".into(),
                address: "192.0.2.10".into(),
            },
        ]),
        ..Default::default()
    });
    n
}

#[tokio::test]
async fn healthz_follows_node_eligibility_livez_does_not() {
    let api = FakeApi::start().await.unwrap();
    api.create(&node(None)).unwrap();
    let dir = temp_dir("health-node");
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let source = SourceConfig::Kube {
        kubeconfig: Some(kubeconfig),
        master: None,
    };
    let agent = Agent::start(options(source), Box::new(dp), async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    let addr = agent.healthz_addr().unwrap();
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    http::wait_for(
        addr,
        "/healthz",
        LIVENESS,
        "/healthz 200 with the node known",
        |r| r.status == 200,
    )
    .await;

    // The node's IP comes from its status (InternalIP before ExternalIP).
    assert_eq!(
        agent.node_ips.borrow().primary(),
        "192.0.2.10".parse::<std::net::IpAddr>().unwrap()
    );

    // Tainted by some other controller: still eligible.
    api.update(&node(Some("other"))).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(http::get(addr, "/healthz").await.unwrap().status, 200);

    // Tainted for deletion: 503, with healthy=true and nodeEligible=false; livez unaffected.
    api.update(&node(Some("ToBeDeletedByClusterAutoscaler")))
        .unwrap();
    let r = http::wait_for(addr, "/healthz", LIVENESS, "/healthz 503 (tainted)", |r| {
        r.status == 503
    })
    .await;
    let b = r.json();
    assert_eq!(
        (b["healthy"].clone(), b["nodeEligible"].clone()),
        (true.into(), false.into())
    );
    assert_eq!(http::get(addr, "/livez").await.unwrap().status, 200);

    // Untainted, then deleted.
    api.update(&node(None)).unwrap();
    http::wait_for(
        addr,
        "/healthz",
        LIVENESS,
        "/healthz 200 (untainted)",
        |r| r.status == 200,
    )
    .await;
    api.delete::<Node>("", "node-a").unwrap();
    http::wait_for(
        addr,
        "/healthz",
        LIVENESS,
        "/healthz 503 (node deleted)",
        |r| r.status == 503 && r.json()["nodeEligible"] == false,
    )
    .await;
    assert_eq!(http::get(addr, "/livez").await.unwrap().status, 200);

    // The agent announced itself on its Node, as kube-proxy does.
    let events = api.list::<Event>();
    let starting: Vec<&Event> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("Starting"))
        .collect();
    assert_eq!(starting.len(), 1, "one Starting event: {events:?}");
    let e = starting[0];
    assert_eq!(e.type_.as_deref(), Some("Normal"));
    assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
    let regarding = e.regarding.as_ref().unwrap();
    assert_eq!(
        (regarding.kind.as_deref(), regarding.name.as_deref()),
        (Some("Node"), Some("node-a"))
    );
    let _ = stop.send(());
    agent.wait().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
