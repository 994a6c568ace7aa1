//! The sync runner with the real tracker and a recording datapath: initial-sync gating,
//! change sets, retries, periodic syncs, and the manifests source end to end.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::SourceConfig;
use kproxy::model::Tracker;
use kproxy::model::input::{Delta, Event};
use kproxy::sync::{Runner, RunnerConfig};
use kproxy_tests::recording::{Recorded, RecordingDataplane};
use tokio::sync::{mpsc, oneshot};

const LIVENESS: Duration = Duration::from_secs(10);

fn service(name: &str, ip: &str) -> Service {
    serde_yaml::from_str(&format!(
        "metadata: {{name: {name}, namespace: default}}\nspec: {{type: ClusterIP, clusterIP: {ip}, ports: [{{name: http, port: 80, protocol: TCP}}]}}"
    ))
    .unwrap()
}

fn slice(svc: &str, ips: &[&str]) -> EndpointSlice {
    let eps: Vec<String> = ips
        .iter()
        .map(|ip| format!("{{addresses: [{ip}], nodeName: node-a}}"))
        .collect();
    serde_yaml::from_str(&format!(
        "metadata: {{name: {svc}-1, namespace: default, labels: {{kubernetes.io/service-name: {svc}}}}}\naddressType: IPv4\nports: [{{name: http, port: 8080, protocol: TCP}}]\nendpoints: [{}]",
        eps.join(", ")
    ))
    .unwrap()
}

fn node() -> Node {
    serde_yaml::from_str("metadata: {name: node-a}").unwrap()
}

fn fast() -> RunnerConfig {
    RunnerConfig::new(Duration::from_millis(10), Duration::from_secs(3600))
}

struct Harness {
    tx: mpsc::Sender<Event>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Box<dyn kproxy::dataplane::Dataplane>>,
}

fn start(cfg: RunnerConfig) -> (Harness, kproxy_tests::recording::Recorder) {
    let (dp, rec) = RecordingDataplane::new();
    let (tx, rx) = mpsc::channel(64);
    let (stop, stopped) = oneshot::channel::<()>();
    let runner = Runner::new(cfg, Tracker::new("node-a"), Box::new(dp));
    let task = tokio::spawn(runner.run(rx, async move {
        let _ = stopped.await;
    }));
    (
        Harness {
            tx,
            stop: Some(stop),
            task,
        },
        rec,
    )
}

impl Harness {
    async fn send(&self, ev: Event) {
        self.tx.send(ev).await.unwrap();
    }
    async fn initial(&self, services: Vec<Service>, slices: Vec<EndpointSlice>) {
        self.send(Event::Service(Delta::Replace(services))).await;
        self.send(Event::EndpointSlice(Delta::Replace(slices)))
            .await;
        self.send(Event::Node(Delta::Replace(vec![node()]))).await;
    }
    async fn stop(mut self) {
        self.stop.take().unwrap().send(()).unwrap();
        self.task.await.unwrap();
    }
}

fn names(r: &Recorded) -> Vec<String> {
    r.snapshot.services.keys().map(|k| k.to_string()).collect()
}

#[tokio::test]
async fn never_syncs_before_every_source_reported_its_initial_sync() {
    let (h, rec) = start(fast());
    h.send(Event::Service(Delta::Replace(vec![service(
        "web",
        "10.96.0.10",
    )])))
    .await;
    h.send(Event::EndpointSlice(Delta::Replace(vec![slice(
        "web",
        &["10.0.0.1"],
    )])))
    .await;
    h.send(Event::Service(Delta::Apply(service("api", "10.96.0.11"))))
        .await;
    // Node has not reported: give the runner ample opportunity to (wrongly) sync.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        rec.calls().is_empty(),
        "synced before the node source reported"
    );
    h.send(Event::Node(Delta::Replace(vec![node()]))).await;
    let calls = rec
        .wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    assert_eq!(names(&calls[0]), ["default/api:http", "default/web:http"]);
    let eps = calls[0].snapshot.endpoints.values().next().unwrap();
    assert_eq!(eps.len(), 1);
    assert!(eps[0].is_local, "nodeName node-a is this node");
    h.stop().await;
}

#[tokio::test]
async fn a_change_syncs_with_exactly_the_changed_service_port() {
    let (h, rec) = start(fast());
    h.initial(
        vec![service("web", "10.96.0.10"), service("api", "10.96.0.11")],
        vec![slice("web", &["10.0.0.1"])],
    )
    .await;
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    h.send(Event::EndpointSlice(Delta::Apply(slice(
        "web",
        &["10.0.0.1", "10.0.0.2"],
    ))))
    .await;
    let calls = rec
        .wait_for(LIVENESS, "second sync", |c| c.len() >= 2)
        .await;
    let changed: Vec<String> = calls[1]
        .changed
        .services
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(changed, ["default/web:http"]);
    let web = calls[1]
        .snapshot
        .endpoints
        .iter()
        .find(|(k, _)| k.name == "web")
        .unwrap()
        .1;
    assert_eq!(web.len(), 2);
    h.stop().await;
}

/// Changes queued while the runner was busy go into one sync, not one sync each (with no
/// rate limit, taking one event per sync fell behind for good when syncs were slower than the
/// changes arrived: the soak in `cargo xtask bench --only soak` saw iptables mode minutes
/// behind).
#[tokio::test]
async fn changes_queued_during_a_sync_go_into_the_next_one_together() {
    let (h, rec) = start(RunnerConfig::new(Duration::ZERO, Duration::from_secs(3600)));
    let names: Vec<String> = (0..20).map(|i| format!("s{i}")).collect();
    h.initial(
        names
            .iter()
            .enumerate()
            .map(|(i, n)| service(n, &format!("10.96.0.{}", i + 10)))
            .collect(),
        vec![],
    )
    .await;
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    // Queued without yielding to the runner: all 20 are waiting when it next looks.
    for (i, n) in names.iter().enumerate() {
        let ip = format!("10.0.0.{}", i + 1);
        h.tx.try_send(Event::EndpointSlice(Delta::Apply(slice(n, &[ip.as_str()]))))
            .unwrap();
    }
    let calls = rec
        .wait_for(LIVENESS, "every change synced", |c| {
            c.last().is_some_and(|r| {
                r.snapshot
                    .endpoints
                    .values()
                    .filter(|e| !e.is_empty())
                    .count()
                    == 20
            })
        })
        .await;
    let after_first: Vec<usize> = calls[1..]
        .iter()
        .map(|r| r.changed.services.len())
        .collect();
    assert!(
        after_first.len() <= 2,
        "the 20 queued changes took {} syncs (changed per sync: {after_first:?})",
        after_first.len()
    );
    h.stop().await;
}

#[tokio::test]
async fn a_failed_sync_is_retried_with_its_changes() {
    let cfg = RunnerConfig {
        retry_base: Duration::from_millis(50),
        ..fast()
    };
    let (h, rec) = start(cfg);
    h.initial(vec![service("web", "10.96.0.10")], vec![]).await;
    rec.wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    rec.fail_next(2);
    h.send(Event::Service(Delta::Apply(service("api", "10.96.0.11"))))
        .await;
    let calls = rec
        .wait_for(LIVENESS, "two failures then a success", |c| c.len() >= 4)
        .await;
    assert!(
        !calls[1].ok && !calls[2].ok && calls[3].ok,
        "{:?}",
        calls.iter().map(|c| c.ok).collect::<Vec<_>>()
    );
    for c in &calls[1..4] {
        let changed: Vec<String> = c.changed.services.iter().map(|s| s.to_string()).collect();
        assert_eq!(
            changed,
            ["default/api:http"],
            "changes of a failed sync are handed to the retry"
        );
    }
    h.stop().await;
}

#[tokio::test]
async fn syncs_periodically_without_changes() {
    let (h, rec) = start(RunnerConfig::new(
        Duration::ZERO,
        Duration::from_millis(100),
    ));
    h.initial(vec![service("web", "10.96.0.10")], vec![]).await;
    let calls = rec
        .wait_for(LIVENESS, "three syncs", |c| c.len() >= 3)
        .await;
    assert!(calls[1].changed.is_empty() && calls[2].changed.is_empty());
    assert_eq!(
        calls[2].snapshot.services.len(),
        1,
        "a periodic sync still carries the full state"
    );
    h.stop().await;
}

#[tokio::test]
async fn changes_after_sources_close_are_synced_before_the_runner_returns() {
    let (h, rec) = start(fast());
    h.initial(vec![service("web", "10.96.0.10")], vec![]).await;
    h.send(Event::Service(Delta::Delete(service("web", "10.96.0.10"))))
        .await;
    let Harness { tx, stop, task } = h;
    drop(tx);
    let _dp = tokio::time::timeout(LIVENESS, task)
        .await
        .expect("runner stopped")
        .unwrap();
    drop(stop);
    let last = rec.calls().pop().expect("synced");
    assert!(last.snapshot.services.is_empty(), "the delete was synced");
}

/// A runner whose datapath is still being built folds the lists meanwhile (its status says
/// every source synced) and syncs nothing; once the datapath arrives, its first sync holds
/// everything listed.
#[tokio::test]
async fn a_datapath_still_being_built_gets_one_first_sync_of_everything_listed_meanwhile() {
    let (dp, rec) = RecordingDataplane::new();
    let (built, building) = oneshot::channel::<Box<dyn kproxy::dataplane::Dataplane>>();
    let (tx, rx) = mpsc::channel(64);
    let (stop, stopped) = oneshot::channel::<()>();
    let runner = Runner::deferred(fast(), Tracker::new("node-a"), building);
    let mut status = runner.status();
    let task = tokio::spawn(runner.run_deferred(rx, async move {
        let _ = stopped.await;
    }));
    tx.send(Event::Service(Delta::Replace(vec![
        service("web", "10.96.0.10"),
        service("api", "10.96.0.11"),
    ])))
    .await
    .unwrap();
    tx.send(Event::EndpointSlice(Delta::Replace(vec![slice(
        "web",
        &["10.0.0.1"],
    )])))
    .await
    .unwrap();
    tx.send(Event::Node(Delta::Replace(vec![node()])))
        .await
        .unwrap();
    tokio::time::timeout(LIVENESS, status.wait_for(|s| s.synced))
        .await
        .expect("the lists were folded while the datapath was being built")
        .unwrap();
    assert_eq!(status.borrow().syncs, 0, "no sync without a datapath");
    built.send(Box::new(dp)).ok().unwrap();
    let calls = rec
        .wait_for(LIVENESS, "first sync", |c| !c.is_empty())
        .await;
    assert_eq!(names(&calls[0]), ["default/api:http", "default/web:http"]);
    assert_eq!(calls[0].snapshot.endpoints.len(), 1);
    stop.send(()).unwrap();
    let dp = tokio::time::timeout(LIVENESS, task).await.unwrap().unwrap();
    assert!(dp.is_some(), "the runner returns the datapath it got");
}

/// A build that fails (its sender dropped) ends the runner without a datapath.
#[tokio::test]
async fn a_datapath_whose_build_failed_ends_the_runner_without_one() {
    let (built, building) = oneshot::channel::<Box<dyn kproxy::dataplane::Dataplane>>();
    let (tx, rx) = mpsc::channel(64);
    let runner = Runner::deferred(fast(), Tracker::new("node-a"), building);
    let task = tokio::spawn(runner.run_deferred(rx, std::future::pending()));
    tx.send(Event::Node(Delta::Replace(vec![node()])))
        .await
        .unwrap();
    drop(built);
    let dp = tokio::time::timeout(LIVENESS, task)
        .await
        .expect("the runner stopped")
        .unwrap();
    assert!(dp.is_none());
    drop(tx);
}

fn write(dir: &std::path::Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn manifests_dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kproxy-{test}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const WEB: &str = "apiVersion: v1\nkind: Service\nmetadata: {name: web, namespace: default}\nspec: {clusterIP: 10.96.0.10, ports: [{name: http, port: 80}]}\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}\naddressType: IPv4\nports: [{name: http, port: 8080}]\nendpoints: [{addresses: [10.0.0.1]}]\n";

#[tokio::test]
async fn manifests_source_drives_syncs_and_rereads_changes() {
    let dir = manifests_dir("manifests-e2e");
    write(&dir, "web.yaml", WEB);
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = AgentOptions::new("node-a", SourceConfig::Manifests(dir.clone()), fast());
    let agent = Agent::start(opts, Box::new(dp), async move {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    let calls = rec
        .wait_for(LIVENESS, "initial sync", |c| !c.is_empty())
        .await;
    assert_eq!(names(&calls[0]), ["default/web:http"]);

    // Add an endpoint and a second, partly bad file: the good parts apply.
    write(
        &dir,
        "web.yaml",
        &WEB.replace("[10.0.0.1]}]", "[10.0.0.1]}, {addresses: [10.0.0.2]}]"),
    );
    write(
        &dir,
        "more.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: api, namespace: default}\nspec: {clusterIP: 10.96.0.11, ports: [{name: http, port: 81}]}\n---\napiVersion: v1\nkind: Service\nmetadata: {name: broken}\nspec: {ports: 5}\n",
    );
    let calls = rec
        .wait_for(LIVENESS, "re-read after change", |c| {
            c.last().is_some_and(|l| {
                l.snapshot.services.len() == 2
                    && l.snapshot
                        .endpoints
                        .iter()
                        .any(|(k, e)| k.name == "web" && e.len() == 2)
            })
        })
        .await;
    assert_eq!(
        names(calls.last().unwrap()),
        ["default/api:http", "default/web:http"]
    );

    // Removing the file removes its service.
    std::fs::remove_file(dir.join("more.yaml")).unwrap();
    rec.wait_for(LIVENESS, "service removed", |c| {
        c.last().is_some_and(|l| l.snapshot.services.len() == 1)
    })
    .await;

    stop.send(()).unwrap();
    agent.wait().await.unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}
