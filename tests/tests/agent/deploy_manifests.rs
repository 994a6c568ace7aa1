//! The deploy manifests: deploy/kproxy.yaml and the kustomize base and overlays
//! (deploy/base, deploy/overlays/{kubeadm,kind}, rendered by the real `kubectl kustomize`).
//! In every rendering, every object deserializes into its k8s-openapi type without losing a
//! field (a typo would be dropped silently by a real API server), the DaemonSet has what a
//! kube-proxy replacement needs (image, capabilities without privileged, the host mounts, the
//! config file where `--config` reads it), the ConfigMap holds a KubeProxyConfiguration of
//! known fields, and the container's command line with its mounted files loads through
//! kproxy's own flag and config loader. The rendered base is deploy/kproxy.yaml; an overlay's
//! DaemonSet is the base's plus exactly the changes its kustomization.yaml explains. The
//! ClusterRole covers exactly what a real agent asks the API server for — derived from the
//! fake API server's request log while an in-process agent ran (syncing, publishing its
//! Starting event and repeated FailedToStartServiceHealthcheck events).

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{ConfigMap, Node, Service, ServiceAccount};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use kproxy::app::agent::Agent;
use kproxy::app::agent::AgentOptions;
use kproxy::config::{ModeChoice, SourceConfig};
use kproxy::dataplane::ProxyMode;
use kproxy::sync::RunnerConfig;
use kproxy_tests::agentproc::ScratchDir;
use kproxy_tests::deploy::{command_line, deploy_dir, kustomize, parse_documents};
use kproxy_tests::fakeapi::FakeApi;
use kproxy_tests::fixtures;
use kproxy_tests::recording::RecordingDataplane;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::oneshot;

const LIVENESS: Duration = Duration::from_secs(20);
/// The image every rendering runs (`cargo xtask image` / deploy/Dockerfile tag it so).
const IMAGE: &str = "kproxy:latest";
/// The ConfigMap holding the KubeProxyConfiguration.
const CONFIG_MAP: &str = "kproxy";
/// Where Kubernetes mounts a pod's service-account token and CA.
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Every document of deploy/kproxy.yaml.
fn documents() -> Vec<Value> {
    parse_documents(&std::fs::read_to_string(deploy_dir().join("kproxy.yaml")).unwrap())
}

/// The kustomize overlays, with the flags each adds to the base's command.
const OVERLAYS: [(&str, &[&str]); 2] = [
    (
        "overlays/kubeadm",
        &["--kubeconfig=/var/lib/kproxy-api/kubeconfig.conf"],
    ),
    (
        "overlays/kind",
        &[
            "--kubeconfig=/var/lib/kproxy-api/kubeconfig.conf",
            "--conntrack-max-per-core=0",
            "--proxy-mode=iptables",
            "--iptables-localhost-nodeports=false",
        ],
    ),
];

/// deploy/kproxy.yaml and, when kubectl is here, the rendered base and overlays.
fn renderings() -> Vec<(String, Vec<Value>)> {
    let mut out = vec![("deploy/kproxy.yaml".to_owned(), documents())];
    let dirs = std::iter::once("base").chain(OVERLAYS.iter().map(|(d, _)| *d));
    for dir in dirs {
        match kustomize(dir) {
            Some(docs) => out.push((format!("deploy/{dir}"), docs)),
            None => break,
        }
    }
    out
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
    /// The ConfigMap with the KubeProxyConfiguration.
    config: ConfigMap,
    /// The other ConfigMaps (an overlay's kubeconfig).
    other_config_maps: Vec<ConfigMap>,
    daemonset: DaemonSet,
}

fn deploy_from(what: &str, docs: &[Value]) -> Deploy {
    let one = |kind: &str| -> &Value {
        let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind).collect();
        assert_eq!(found.len(), 1, "{what}: exactly one {kind}");
        found[0]
    };
    let kinds = [
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",
    ];
    for d in docs {
        assert!(
            kinds.iter().any(|k| d["kind"] == *k),
            "{what}: unexpected {}",
            d["kind"]
        );
    }
    let (config, other): (Vec<&Value>, Vec<&Value>) = docs
        .iter()
        .filter(|d| d["kind"] == "ConfigMap")
        .partition(|d| d["metadata"]["name"] == CONFIG_MAP);
    assert_eq!(config.len(), 1, "{what}: one ConfigMap {CONFIG_MAP}");
    Deploy {
        role: typed(one("ClusterRole")),
        binding: typed(one("ClusterRoleBinding")),
        account: typed(one("ServiceAccount")),
        config: typed(config[0]),
        other_config_maps: other.into_iter().map(typed).collect(),
        daemonset: typed(one("DaemonSet")),
    }
}

fn deploy() -> Deploy {
    let docs = documents();
    assert_eq!(
        docs.len(),
        5,
        "ServiceAccount, ClusterRole, binding, ConfigMap, DaemonSet"
    );
    deploy_from("deploy/kproxy.yaml", &docs)
}

#[test]
fn manifests_deserialize_and_fit_together() {
    let all = renderings();
    for (what, docs) in &all {
        check_fits(what, &deploy_from(what, docs));
    }
    eprintln!("checked {} renderings", all.len());
}

fn check_fits(what: &str, d: &Deploy) {
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
        "{what}: binding names the service account"
    );
    let pod = d.daemonset.spec.template.spec.as_ref().unwrap();
    assert_eq!(pod.service_account_name.as_deref(), Some(sa), "{what}");
    assert_ne!(
        pod.automount_service_account_token,
        Some(false),
        "{what}: the agent's credentials are its service-account token"
    );
    assert_eq!(pod.host_network, Some(true), "{what}");
    assert_eq!(
        pod.priority_class_name.as_deref(),
        Some("system-node-critical"),
        "{what}"
    );
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
        "{what}: tolerates every taint, like kube-proxy"
    );
    assert_eq!(pod.containers.len(), 1, "{what}");
    let c = &pod.containers[0];
    assert_eq!(c.image.as_deref(), Some(IMAGE), "{what}");
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(
        sc.privileged,
        Some(false),
        "{what}: capabilities instead of privileged"
    );
    let caps = sc.capabilities.as_ref().unwrap();
    assert_eq!(caps.drop, Some(vec!["ALL".to_owned()]), "{what}");
    let add = caps.add.clone().unwrap();
    for cap in [
        "NET_ADMIN",
        "BPF",
        "PERFMON",
        "SYS_ADMIN",
        "SYS_RESOURCE",
        "SYS_MODULE",
        "NET_RAW",
    ] {
        assert!(add.iter().any(|c| c == cap), "{what}: {cap}");
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
            .unwrap_or_else(|| panic!("{what}: no hostPath volume {host}"));
        mounts
            .iter()
            .find(|m| m.name == v.name)
            .unwrap_or_else(|| panic!("{what}: {host} not mounted"))
            .clone()
    };
    let bpffs = host_mount("/sys/fs/bpf");
    assert_eq!(bpffs.mount_path, "/sys/fs/bpf", "{what}");
    assert_eq!(
        bpffs.mount_propagation.as_deref(),
        Some("HostToContainer"),
        "{what}: pins made by the host (or a previous agent) show up"
    );
    assert_eq!(host_mount("/lib/modules").read_only, Some(true), "{what}");
    assert_eq!(host_mount("/sys/fs/cgroup").read_only, Some(true), "{what}");
    assert_eq!(
        host_mount("/run/xtables.lock").mount_path,
        "/run/xtables.lock",
        "{what}"
    );
    let cgroup_at = host_mount("/sys/fs/cgroup").mount_path;
    let argv = command_line(c);
    assert!(
        argv.contains(&format!("--bpf-cgroup={cgroup_at}")),
        "{what}: socket LB attaches to the mounted host cgroup2 root: {argv:?}"
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
        .unwrap_or_else(|| panic!("{what}: the ConfigMap is mounted"));
    let key = d
        .config
        .data
        .as_ref()
        .unwrap()
        .keys()
        .next()
        .unwrap()
        .clone();
    assert_eq!(
        format!("{}/{key}", config_mount.mount_path),
        "/var/lib/kproxy/config.conf",
        "{what}"
    );
    assert!(
        argv.contains(&format!("--config={}/{key}", config_mount.mount_path)),
        "{what}: --config points at the ConfigMap's file: {argv:?}"
    );
}

/// Documents keyed by kind/name, the generated names' hash suffix left as it is.
fn by_name(docs: &[Value]) -> std::collections::BTreeMap<String, Value> {
    docs.iter()
        .map(|d| {
            let key = format!("{}/{}", d["kind"], d["metadata"]["name"]);
            (key, d.clone())
        })
        .collect()
}

#[test]
fn rendered_base_is_deploy_kproxy_yaml() {
    let Some(base) = kustomize("base") else {
        return;
    };
    let want = by_name(&documents());
    let got = by_name(&base);
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (k, v) in &want {
        assert_eq!(
            &got[k], v,
            "deploy/base renders {k} unlike deploy/kproxy.yaml"
        );
    }
}

#[test]
fn overlays_change_only_what_they_explain() {
    let Some(base) = kustomize("base") else {
        return;
    };
    let base_ds = by_name(&base).remove("\"DaemonSet\"/\"kproxy\"").unwrap();
    for (dir, args) in OVERLAYS {
        let Some(docs) = kustomize(dir) else {
            return;
        };
        let mut ds = by_name(&docs).remove("\"DaemonSet\"/\"kproxy\"").unwrap();
        let spec = &mut ds["spec"]["template"]["spec"];
        // dnsPolicy Default: the node's resolver, not the cluster DNS behind a ClusterIP.
        assert_eq!(spec["dnsPolicy"], "Default", "{dir}");
        // The kubeconfig ConfigMap, mounted where --kubeconfig reads it.
        let volumes = spec["volumes"].as_array_mut().unwrap();
        let at = volumes.iter().position(|v| v["name"] == "api-kubeconfig");
        let v = volumes.remove(at.unwrap_or_else(|| panic!("{dir}: no api-kubeconfig volume")));
        let generated = v["configMap"]["name"].as_str().unwrap();
        assert!(
            generated.starts_with("kproxy-kubeconfig"),
            "{dir}: {generated}"
        );
        assert!(
            docs.iter()
                .any(|d| d["kind"] == "ConfigMap" && d["metadata"]["name"] == generated),
            "{dir}: the mounted ConfigMap {generated} is rendered too"
        );
        let c = &mut spec["containers"][0];
        let mounts = c["volumeMounts"].as_array_mut().unwrap();
        let at = mounts.iter().position(|m| m["name"] == "api-kubeconfig");
        let m = mounts.remove(at.unwrap_or_else(|| panic!("{dir}: kubeconfig not mounted")));
        assert_eq!(m["mountPath"], "/var/lib/kproxy-api", "{dir}");
        assert_eq!(m["readOnly"], true, "{dir}");
        let got: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(got, args, "{dir}: flags added to the base's command");
        c.as_object_mut().unwrap().remove("args");
        // Whatever is left is the base's DaemonSet, setting for setting.
        let mut want = base_ds.clone();
        want["spec"]["template"]["spec"]["dnsPolicy"] = "Default".into();
        assert_eq!(
            ds, want,
            "{dir} changes the base's DaemonSet beyond its explained changes"
        );
    }
}

#[test]
fn every_rendering_loads_with_kproxys_config_loader() {
    let all = renderings();
    for (what, docs) in &all {
        let d = deploy_from(what, docs);
        let root = ScratchDir::new("deploy-load").unwrap();
        let cfg = load_as_deployed(what, &d, root.path());
        match what.as_str() {
            "deploy/kproxy.yaml" | "deploy/base" => {
                assert_eq!(cfg.mode, ModeChoice::Detect, "{what}");
                assert_eq!(cfg.conntrack.max_per_core, 32768, "{what}");
                assert!(
                    matches!(
                        &cfg.source,
                        SourceConfig::Kube {
                            kubeconfig: None,
                            master: None
                        }
                    ),
                    "{what}: in-cluster config: {:?}",
                    cfg.source
                );
            }
            overlay => {
                let kind = overlay.ends_with("/kind");
                let server = overlay_kubeconfig_server(what, &cfg.source, root.path());
                let want = if kind {
                    "https://kind-control-plane:6443"
                } else {
                    "https://control-plane.invalid:6443"
                };
                assert_eq!(server, want, "{what}");
                let (mode, max_per_core) = if kind {
                    (ModeChoice::Forced(ProxyMode::Iptables), 0)
                } else {
                    (ModeChoice::Detect, 32768)
                };
                assert_eq!(cfg.mode, mode, "{what}");
                assert_eq!(cfg.conntrack.max_per_core, max_per_core, "{what}");
            }
        }
        assert_eq!(
            cfg.node_name, "node-a",
            "{what}: --hostname-override=$(NODE_NAME)"
        );
        assert_eq!(
            cfg.healthz_bind_address,
            Some("0.0.0.0:10256".parse().unwrap()),
            "{what}"
        );
        assert_eq!(cfg.cluster_cidrs, vec!["10.244.0.0/16".parse().unwrap()]);
    }
    eprintln!("loaded {} renderings", all.len());
}

/// Writes every ConfigMap volume of the DaemonSet's pod under `root` at its mount path, then
/// loads the container's command line (paths below those mounts moved under `root`,
/// `$(NODE_NAME)` = node-a) with kproxy's own flag and config loader.
fn load_as_deployed(what: &str, d: &Deploy, root: &Path) -> kproxy::config::ProxyConfig {
    let pod = d.daemonset.spec.template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let maps: Vec<&ConfigMap> = std::iter::once(&d.config)
        .chain(&d.other_config_maps)
        .collect();
    let mut config_mounts = Vec::new();
    for m in c.volume_mounts.as_ref().unwrap() {
        let v = pod
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == m.name)
            .unwrap();
        let Some(src) = &v.config_map else { continue };
        let map = maps
            .iter()
            .find(|cm| cm.metadata.name.as_deref() == Some(src.name.as_str()))
            .unwrap_or_else(|| panic!("{what}: ConfigMap {} is not in the manifests", src.name));
        let dir = root.join(m.mount_path.trim_start_matches('/'));
        std::fs::create_dir_all(&dir).unwrap();
        for (key, text) in map.data.as_ref().unwrap() {
            std::fs::write(dir.join(key), text).unwrap();
        }
        config_mounts.push(m.mount_path.clone());
    }
    assert!(!config_mounts.is_empty(), "{what}: no ConfigMap mounted");
    let argv: Vec<std::ffi::OsString> = command_line(c)
        .into_iter()
        .map(|a| {
            let mut a = a.replace("$(NODE_NAME)", "node-a");
            for at in &config_mounts {
                a = a.replace(&format!("={at}/"), &format!("={}{at}/", root.display()));
            }
            a.into()
        })
        .collect();
    let inv = kproxy::cli::parse(argv.clone())
        .unwrap_or_else(|e| panic!("{what}: {argv:?} does not parse: {e}"));
    let loaded = kproxy::cli::load(&inv, None)
        .unwrap_or_else(|e| panic!("{what}: {argv:?} does not load: {e}"));
    assert_eq!(loaded.command, kproxy::cli::Command::Agent, "{what}");
    loaded.config
}

/// The API server an overlay's kubeconfig names; checks it authenticates as the pod's
/// service account (token and CA where Kubernetes mounts them) and lies in a mounted file.
fn overlay_kubeconfig_server(what: &str, source: &SourceConfig, root: &Path) -> String {
    let SourceConfig::Kube {
        kubeconfig: Some(path),
        master: None,
    } = source
    else {
        panic!("{what}: an overlay reaches the API server through a kubeconfig: {source:?}");
    };
    assert!(
        path.starts_with(root),
        "{what}: {} is a mounted file",
        path.display()
    );
    let kc = kube::config::Kubeconfig::read_from(path)
        .unwrap_or_else(|e| panic!("{what}: {}: {e}", path.display()));
    assert_eq!(kc.clusters.len(), 1, "{what}");
    let cluster = kc.clusters[0].cluster.clone().unwrap();
    assert_eq!(
        cluster.certificate_authority,
        Some(format!("{SERVICE_ACCOUNT_DIR}/ca.crt")),
        "{what}"
    );
    let user = kc.auth_infos[0].auth_info.clone().unwrap();
    assert_eq!(
        user.token_file,
        Some(format!("{SERVICE_ACCOUNT_DIR}/token")),
        "{what}"
    );
    cluster.server.unwrap()
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
    let known = known_config_fields();
    assert!(
        known.len() > 40,
        "upstream field list read ({})",
        known.len()
    );
    for (what, docs) in renderings() {
        check_config_fields(&what, &deploy_from(&what, &docs), &known);
    }
}

fn check_config_fields(what: &str, d: &Deploy, known: &BTreeSet<String>) {
    let data = d.config.data.clone().unwrap();
    assert_eq!(data.len(), 1, "{what}");
    let conf: serde_yaml::Value = serde_yaml::from_str(data.values().next().unwrap()).unwrap();
    assert_eq!(
        conf["apiVersion"].as_str(),
        Some("kubeproxy.config.k8s.io/v1alpha1"),
        "{what}"
    );
    assert_eq!(
        conf["kind"].as_str(),
        Some("KubeProxyConfiguration"),
        "{what}"
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
    walk("", &conf, known, &mut checked);
    assert!(checked >= 15, "{what}: {checked} fields checked");
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
        // Two syncs close together may each create the event before either sees the other's
        // (the ServiceCIDR list asks for a sync right after the first): the repeated one counts.
        let failed = events.iter().find(|e| {
            e.reason.as_deref() == Some("FailedToStartServiceHealthcheck")
                && e.series.as_ref().is_some_and(|s| s.count >= 2)
        });
        if let Some(e) = failed {
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
        ("networking.k8s.io", "servicecidrs", "watch"),
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
