//! deploy/kproxy.yaml: every object deserializes into its k8s-openapi type without losing a
//! field (a typo would be dropped silently by a real API server), the DaemonSet has what a
//! kube-proxy replacement needs, the ConfigMap holds a KubeProxyConfiguration of known fields,
//! and the ClusterRole covers exactly what a real agent asks the API server for — derived
//! from the fake API server's request log while an in-process agent ran (syncing, publishing
//! its Starting event and repeated FailedToStartServiceHealthcheck events).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::SourceConfig;
use kproxy::sync::RunnerConfig;
use kproxy_tests::fakeapi::FakeApi;
use kproxy_tests::fixtures;
use kproxy_tests::recording::RecordingDataplane;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::oneshot;

const LIVENESS: Duration = Duration::from_secs(20);

fn manifest_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/kproxy.yaml")
}

/// Every document of deploy/kproxy.yaml as JSON.
fn documents() -> Vec<Value> {
    let text = std::fs::read_to_string(manifest_path()).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| {
            let v: serde_yaml::Value = serde::Deserialize::deserialize(d).unwrap();
            serde_json::to_value(v).unwrap()
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// Deserializes `doc` as `K` and checks that serializing it back gives the same JSON: no field
/// was unknown to the type (and so silently dropped).
fn typed<K: DeserializeOwned + Serialize>(doc: &Value) -> K {
    let obj: K = serde_json::from_value(doc.clone()).unwrap_or_else(|e| {
        panic!("{} does not deserialize: {e}", doc["kind"]);
    });
    let back = serde_json::to_value(&obj).unwrap();
    assert_eq!(&back, doc, "{} lost or changed fields", doc["kind"]);
    obj
}

struct Deploy {
    role: ClusterRole,
    binding: ClusterRoleBinding,
    account: ServiceAccount,
    config: ConfigMap,
    daemonset: DaemonSet,
}

fn deploy() -> Deploy {
    let docs = documents();
    let one = |kind: &str| -> &Value {
        let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "exactly one {kind}");
        found[0]
    };
    assert_eq!(
        docs.len(),
        5,
        "ServiceAccount, ClusterRole, binding, ConfigMap, DaemonSet"
    );
    Deploy {
        role: typed(one("ClusterRole")),
        binding: typed(one("ClusterRoleBinding")),
        account: typed(one("ServiceAccount")),
        config: typed(one("ConfigMap")),
        daemonset: typed(one("DaemonSet")),
    }
}

#[test]
fn manifests_deserialize_and_fit_together() {
    let d = deploy();
    let sa = d.account.metadata.name.as_deref().unwrap();
    let ns = d.account.metadata.namespace.as_deref().unwrap();
    assert_eq!(
        d.binding.role_ref.name,
        d.role.metadata.name.clone().unwrap()
    );
    let subjects = d.binding.subjects.as_ref().unwrap();
    assert!(
        subjects.iter().any(|s| s.kind == "ServiceAccount"
            && s.name == sa
            && s.namespace.as_deref() == Some(ns)),
        "binding names the service account"
    );
    let pod = d.daemonset.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa));
    assert_eq!(pod.host_network, Some(true));
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical")
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "tolerates every taint, like kube-proxy"
    );
    let c = &pod.containers[0];
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(
        sc.privileged,
        Some(false),
        "capabilities instead of privileged"
    );
    let caps = sc.capabilities.as_ref().unwrap().add.clone().unwrap();
    for cap in ["NET_ADMIN", "BPF", "PERFMON", "SYS_ADMIN", "SYS_RESOURCE"] {
        assert!(caps.iter().any(|c| c == cap), "{cap}");
    }
    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().unwrap().http_get.clone().unwrap();
        (g.path.unwrap(), serde_json::to_value(&g.port).unwrap())
    };
    assert_eq!(probe(&c.liveness_probe), ("/livez".into(), 10256.into()));
    assert_eq!(probe(&c.readiness_probe), ("/healthz".into(), 10256.into()));

    // Host paths mounted, read-only where kproxy only reads.
    let volumes = pod.volumes.as_ref().unwrap();
    let mounts = c.volume_mounts.as_ref().unwrap();
    let host_mount = |host: &str| {
        let v = volumes
            .iter()
            .find(|v| v.host_path.as_ref().is_some_and(|h| h.path == host))
            .unwrap_or_else(|| panic!("no hostPath volume {host}"));
        mounts
            .iter()
            .find(|m| m.name == v.name)
            .unwrap_or_else(|| panic!("{host} not mounted"))
            .clone()
    };
    assert_eq!(host_mount("/sys/fs/bpf").mount_path, "/sys/fs/bpf");
    assert_eq!(host_mount("/lib/modules").read_only, Some(true));
    assert_eq!(host_mount("/sys/fs/cgroup").read_only, Some(true));
    assert_eq!(
        host_mount("/run/xtables.lock").mount_path,
        "/run/xtables.lock"
    );
    let cgroup_at = host_mount("/sys/fs/cgroup").mount_path;
    let command = c.command.as_ref().unwrap();
    assert!(
        command.contains(&format!("--bpf-cgroup={cgroup_at}")),
        "socket LB attaches to the mounted host cgroup2 root: {command:?}"
    );
    let config_mount = mounts
        .iter()
        .find(|m| {
            volumes.iter().any(|v| {
                v.name == m.name
                    && v.config_map.as_ref().map(|c| c.name.as_str())
                        == d.config.metadata.name.as_deref()
            })
        })
        .expect("the ConfigMap is mounted");
    let key = d
        .config
        .data
        .as_ref()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    assert!(
        command.contains(&format!("--config={}/{key}", config_mount.mount_path)),
        "--config points at the ConfigMap's file: {command:?}"
    );
}

/// The names (nested with dots) of every field of the upstream KubeProxyConfiguration.
fn known_config_fields() -> BTreeSet<String> {
    let text = std::fs::read_to_string(fixtures::upstream("config/kube-proxy-configuration.yaml"))
        .unwrap();
    let doc: serde_yaml::Value = serde_yaml::from_str(&text).unwrap();
    let mut out = BTreeSet::new();
    fn walk(prefix: &str, v: &serde_yaml::Value, out: &mut BTreeSet<String>) {
        for (k, v) in v.as_mapping().unwrap() {
            let name = format!("{prefix}{}", k.as_str().unwrap());
            out.insert(name.clone());
            // A leaf is a {type: …} description; anything else is a nested struct.
            if v.get("type").is_none() {
                walk(&format!("{name}."), v, out);
            }
        }
    }
    walk("", &doc["fields"], &mut out);
    out
}

#[test]
fn configmap_holds_a_kube_proxy_configuration_of_known_fields() {
    let d = deploy();
    let data = d.config.data.unwrap();
    assert_eq!(data.len(), 1);
    let conf: serde_yaml::Value = serde_yaml::from_str(data.values().next().unwrap()).unwrap();
    assert_eq!(
        conf["apiVersion"].as_str(),
        Some("kubeproxy.config.k8s.io/v1alpha1")
    );
    assert_eq!(conf["kind"].as_str(), Some("KubeProxyConfiguration"));
    let known = known_config_fields();
    assert!(
        known.len() > 40,
        "upstream field list read ({})",
        known.len()
    );
    let mut checked = 0;
    fn walk(prefix: &str, v: &serde_yaml::Value, known: &BTreeSet<String>, checked: &mut usize) {
        for (k, v) in v.as_mapping().unwrap() {
            let name = format!("{prefix}{}", k.as_str().unwrap());
            if prefix.is_empty() && (name == "apiVersion" || name == "kind") {
                continue;
            }
            assert!(
                known.contains(&name),
                "unknown KubeProxyConfiguration field {name}"
            );
            *checked += 1;
            if v.is_mapping() {
                walk(&format!("{name}."), v, known, checked);
            }
        }
    }
    walk("", &conf, &known, &mut checked);
    assert!(checked >= 15, "{checked} fields checked");
    assert_eq!(conf["healthzBindAddress"].as_str(), Some("0.0.0.0:10256"));
    assert_eq!(conf["metricsBindAddress"].as_str(), Some("127.0.0.1:10249"));
    assert_eq!(conf["oomScoreAdj"].as_i64(), Some(-999));
}

/// (API group, resource, verb) granted by `role`.
fn grants(role: &ClusterRole) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for r in role.rules.as_ref().unwrap() {
        assert!(r.resource_names.is_none() && r.non_resource_urls.is_none());
        for g in r.api_groups.as_ref().unwrap() {
            for res in r.resources.as_ref().unwrap() {
                for verb in &r.verbs {
                    assert_ne!(verb, "*", "no wildcards");
                    out.insert((g.clone(), res.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

fn lb_service(hc_port: u16) -> Service {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "lb", "namespace": "shop"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.20", "externalTrafficPolicy": "Local",
                 "healthCheckNodePort": hc_port,
                 "ports": [{"name": "http", "port": 80, "nodePort": 30080}]}
    }))
    .unwrap()
}

fn lb_slice() -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": "lb-1", "namespace": "shop", "labels": {"kubernetes.io/service-name": "lb"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": [{"addresses": ["10.0.0.1"], "nodeName": "node-a"}]
    }))
    .unwrap()
}

#[tokio::test]
async fn cluster_role_covers_exactly_what_a_running_agent_requests() {
    let role = deploy().role;
    let api = FakeApi::start().await.unwrap();
    let mut node = Node::default();
    node.metadata.name = Some("node-a".into());
    api.create(&node).unwrap();
    // The service's healthCheckNodePort is taken: the agent reports it with an event, again on
    // every sync (a series: create, then patch).
    let blocker = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let taken: SocketAddr = blocker.local_addr().unwrap();
    api.create(&lb_service(taken.port())).unwrap();
    api.create(&lb_slice()).unwrap();

    let dir = std::env::temp_dir().join(format!("kproxy-deploy-rbac-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let (dp, rec) = RecordingDataplane::new();
    let (stop, stopped) = oneshot::channel::<()>();
    let opts = AgentOptions {
        node_port_addresses: vec!["127.0.0.0/8".parse().unwrap()],
        ..AgentOptions::new(
            "node-a",
            SourceConfig::Kube {
                kubeconfig: Some(kubeconfig),
                master: None,
            },
            RunnerConfig::new(Duration::from_millis(10), Duration::from_millis(300)),
        )
    };
    let agent = Agent::start(opts, Box::new(dp), async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    rec.wait_for(LIVENESS, "two syncs", |c| c.len() >= 2).await;
    let deadline = std::time::Instant::now() + LIVENESS;
    loop {
        let events = api.list::<Event>();
        let failed = events
            .iter()
            .find(|e| e.reason.as_deref() == Some("FailedToStartServiceHealthcheck"));
        if let Some(e) = failed
            && e.series.as_ref().is_some_and(|s| s.count >= 2)
        {
            assert_eq!(e.type_.as_deref(), Some("Warning"));
            let r = e.regarding.as_ref().unwrap();
            assert_eq!(
                (r.kind.as_deref(), r.namespace.as_deref(), r.name.as_deref()),
                (Some("Service"), Some("shop"), Some("lb"))
            );
            assert!(
                e.note
                    .as_deref()
                    .is_some_and(|n| n.contains(&format!("on port {}", taken.port()))),
                "{:?}",
                e.note
            );
            assert!(
                events
                    .iter()
                    .any(|e| e.reason.as_deref() == Some("Starting")),
                "Starting event"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no repeated FailedToStartServiceHealthcheck event: {events:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(());
    agent.wait().await.unwrap();
    drop(blocker);

    // What the agent asked for, as RBAC sees it.
    let requested: BTreeSet<(String, String, String)> = api
        .requests()
        .iter()
        .map(|r| {
            let kind = r
                .kind()
                .unwrap_or_else(|| panic!("request to an unknown path {}", r.path));
            let verb = r
                .verb()
                .unwrap_or_else(|| panic!("odd method {}", r.method));
            (
                kind.group().to_owned(),
                kind.plural().to_owned(),
                verb.to_owned(),
            )
        })
        .collect();
    let granted = grants(&role);
    for need in &requested {
        assert!(granted.contains(need), "ClusterRole lacks {need:?}");
    }
    // The run exercised every kind of request the role is for.
    for need in [
        ("", "services", "list"),
        ("", "services", "watch"),
        ("", "nodes", "watch"),
        ("discovery.k8s.io", "endpointslices", "watch"),
        ("events.k8s.io", "events", "create"),
        ("events.k8s.io", "events", "patch"),
    ] {
        let need = (need.0.to_owned(), need.1.to_owned(), need.2.to_owned());
        assert!(
            requested.contains(&need),
            "agent never made {need:?}: {requested:?}"
        );
    }
    // Nothing beyond: reads (list/watch/get) of what was read, create/patch of events.
    let read: BTreeSet<(String, String)> = requested
        .iter()
        .filter(|(_, res, _)| res != "events")
        .map(|(g, r, _)| (g.clone(), r.clone()))
        .collect();
    for (g, res, verb) in &granted {
        let ok = if res == "events" {
            g == "events.k8s.io" && (verb == "create" || verb == "patch")
        } else {
            read.contains(&(g.clone(), res.clone()))
                && ["list", "watch", "get"].contains(&verb.as_str())
        };
        assert!(ok, "ClusterRole grants more than needed: {g}/{res} {verb}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
