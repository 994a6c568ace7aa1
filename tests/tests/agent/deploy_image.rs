//! Issue #20: the container image `cargo xtask image` builds, run with podman the way the
//! DaemonSet describes the pod, in the node namespace of the traffic topology.
//!
//! The pod spec is read from the rendered manifests (`kubectl kustomize deploy/overlays/…`),
//! never restated here: host network (= the topology's node namespace), the container's
//! command and args (`$(NODE_NAME)` expanded from its env's `spec.nodeName`), its security
//! context (`--cap-drop ALL` + exactly its adds, `privileged: false`, no privilege escalation
//! = `no-new-privileges`, seccomp unconfined), its volumes at their mount paths with their
//! read-only flags and propagation, the ConfigMaps' files mounted where the DaemonSet mounts
//! them. `kproxy_tests::podman::pod_run` fails on any field it does not map. The three runs:
//!
//! | mode | rendering | what the test changes |
//! |---|---|---|
//! | ebpf (detected: the ConfigMap's `mode: ""`) | `deploy/overlays/kubeadm` | — |
//! | iptables (the overlay's `--proxy-mode=iptables`) | `deploy/overlays/kind` | — |
//! | nftables | `deploy/overlays/kubeadm` | `mode: nftables` in the ConfigMap's config.conf |
//!
//! What every run changes, because a test must: the overlays' kubeconfig ConfigMap holds a
//! kubeconfig for the in-repo fake API server (in the node namespace, plain HTTP on 127.0.0.1)
//! instead of the control-plane endpoint and the service-account token; the hostPath volumes
//! come from the test's own objects where it has dedicated ones — `/sys/fs/bpf` is the test's
//! bpffs; `/sys/fs/cgroup` is the host's cgroup2 hierarchy root (read-only, as declared) and
//! `--bpf-cgroup=<its mount path>` points one level down, at the test's own cgroup, so socket
//! LB covers the test's pods and not the machine (kproxy's cgroup check accepts a sub-cgroup
//! of a mount that shows the hierarchy root, and refuses a bind mount of the sub-cgroup
//! itself); `/lib/modules` is an empty directory when the host has none (this one has none);
//! `/run/xtables.lock` is the host's. podman's own needs (`kproxy_tests::podman`): runc,
//! cgroupfs, `nofile`/`nproc` limits. The capabilities the container gets are the declared
//! ones that this machine grants at all: its bounding set lacks `SYS_RESOURCE` (podman drops
//! a capability it does not hold), so the agent's `oomScoreAdj` of -999 fails with a warning
//! here.
//!
//! Each run checks `/livez` and `/healthz` (the probes' paths and port), `/proxyMode`, a
//! ClusterIP from a pod inside the socket-LB cgroup and a NodePort from the external client
//! (backend on the second node), the container's capabilities, `NoNewPrivs` and seccomp mode,
//! and that the iptables rules are in the backend the host's own `iptables` reads. Then a
//! rolling update: two long-lived TCP connections (client → NodePort, pod → ClusterIP) run
//! while the container is stopped like the kubelet stops a pod (SIGTERM) and a new container
//! of the same image starts; both keep exchanging data to their end, and new connections work.
//!
//! `image_holds_the_tools_and_no_shell` checks the image itself: labels, entrypoint = the
//! DaemonSet's command, name = its `image:`, every tool the agent runs starts (its libraries
//! are there), the iptables backend the host uses is the image's with the same version, no
//! shell.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kproxy_tests::agentns::NsFakeApi;
use kproxy_tests::agentproc::{ScratchDir, http_get};
use kproxy_tests::deploy::{Rendered, command_line, deploy_dir, kustomize, parse_documents};
use kproxy_tests::netns::{Bpffs, TestCgroup, cgroup2_mount, require_root};
use kproxy_tests::podman::{
    self, Image, PodContainer, PodHost, PodRun, capability_names, podman, require_image,
    status_mask,
};
use kproxy_tests::topology::{NODE_IP, NODE_POD_CIDR, Probe, Topology, TopologySpec};
use kproxy_tests::traffic::Hold;

/// The node name (`spec.nodeName`, which the DaemonSet passes as `--hostname-override`).
const NODE: &str = "kpt-node";
const CLUSTER_IP: &str = "10.96.0.20";
const NODE_PORT: u16 = 30081;
/// How long each long-lived connection runs: the stop, the new container's start and its
/// first sync happen well inside it (asserted: the connections are still running after).
const HOLD_SECONDS: u64 = 60;

/// One run: which rendering, what the test changes in the config, which mode must result.
struct Case {
    hint: &'static str,
    rendering: &'static str,
    config_mode: Option<&'static str>,
    expect_mode: &'static str,
}

#[test]
fn ebpf_as_deployed() {
    run_as_deployed(Case {
        hint: "di-ebpf",
        rendering: "overlays/kubeadm",
        config_mode: None,
        expect_mode: "ebpf",
    });
}

#[test]
fn iptables_as_deployed() {
    run_as_deployed(Case {
        hint: "di-ipt",
        rendering: "overlays/kind",
        config_mode: None,
        expect_mode: "iptables",
    });
}

#[test]
fn nftables_as_deployed() {
    run_as_deployed(Case {
        hint: "di-nft",
        rendering: "overlays/kubeadm",
        config_mode: Some("nftables"),
        expect_mode: "nftables",
    });
}

/// `image: kproxy:latest` as Docker, containerd and the archive name it.
fn normalized_image(image: &str) -> String {
    let (repo, tag) = match image.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, t),
        _ => (image, "latest"),
    };
    let repo = match repo.split_once('/') {
        None => format!("docker.io/library/{repo}"),
        Some((host, _)) if host.contains('.') || host.contains(':') || host == "localhost" => {
            repo.to_string()
        }
        Some(_) => format!("docker.io/{repo}"),
    };
    format!("{repo}:{tag}")
}

fn objects(topo: &Topology) -> (Node, Vec<Service>, Vec<EndpointSlice>) {
    let local = topo.pod("pod-l1").ip;
    let remote = topo.pod("pod-r0").ip;
    let node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": NODE},
        "spec": {"podCIDRs": [NODE_POD_CIDR]},
        "status": {"addresses": [{"type": "InternalIP", "address": NODE_IP.to_string()}]}
    }))
    .unwrap();
    let web = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.0.21", "clusterIPs": ["10.96.0.21"],
                 "ipFamilies": ["IPv4"],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080,
                            "nodePort": NODE_PORT}]}
    }))
    .unwrap();
    let api = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "api", "namespace": "default"},
        "spec": {"clusterIP": CLUSTER_IP, "clusterIPs": [CLUSTER_IP], "ipFamilies": ["IPv4"],
                 "ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 8080}]}
    }))
    .unwrap();
    let slice = |svc: &str, ip: std::net::Ipv4Addr, node: &str| -> EndpointSlice {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{svc}-1"), "namespace": "default",
                         "labels": {"kubernetes.io/service-name": svc}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "protocol": "TCP", "port": 8080}],
            "endpoints": [{"addresses": [ip.to_string()], "conditions": {"ready": true},
                           "nodeName": node}]
        }))
        .unwrap()
    };
    (
        node,
        vec![web, api],
        vec![slice("web", remote, "node2"), slice("api", local, NODE)],
    )
}

/// The value of `--<flag>=` in `argv`.
fn flag<'a>(argv: &'a [String], name: &str) -> Option<&'a str> {
    argv.iter()
        .find_map(|a| a.strip_prefix(&format!("--{name}=")))
}

/// The ConfigMap volume mounted at `dir` (its name).
fn config_map_mounted_at(r: &Rendered, dir: &str) -> String {
    let c = r.container();
    let m = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == dir)
        .unwrap_or_else(|| panic!("nothing is mounted at {dir}"));
    let v = r
        .pod()
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == m.name)
        .unwrap();
    v.config_map
        .as_ref()
        .unwrap_or_else(|| panic!("{dir} is not a ConfigMap volume"))
        .name
        .clone()
}

/// `(dir, file name)` of a path.
fn split(path: &str) -> (String, String) {
    let p = Path::new(path);
    (
        p.parent().unwrap().display().to_string(),
        p.file_name().unwrap().to_string_lossy().into_owned(),
    )
}

/// The port of a `host:port` / `:port` bind address in config.conf.
fn bind_port(config: &serde_yaml::Value, field: &str) -> u16 {
    let addr = config[field]
        .as_str()
        .unwrap_or_else(|| panic!("config.conf has no {field}"));
    addr.rsplit(':').next().unwrap().parse().unwrap()
}

/// Everything of one run that outlives a container.
struct Rig {
    topo: Topology,
    cg: TestCgroup,
    bpffs: Bpffs,
    scratch: ScratchDir,
    run: PodRun,
    image: &'static Image,
    /// (path, port) of the liveness and readiness probes.
    liveness: (String, u16),
    readiness: (String, u16),
    metrics_port: u16,
    expect_mode: &'static str,
    _api: NsFakeApi,
}

impl Rig {
    fn start(&self, n: u32) -> PodContainer {
        let log = self.scratch.path().join(format!("kproxy-{n}.log"));
        PodContainer::start(
            &format!("di-{}-{n}", self.expect_mode),
            &self.run,
            &self.image.id,
            log,
        )
    }

    /// Waits for readiness (a first sync), then checks liveness and the mode.
    fn wait_ready(&self, c: &mut PodContainer) {
        let ns = &self.topo.node;
        let (path, port) = &self.readiness;
        c.wait_for("readiness (GET /healthz = 200)", || {
            http_get(ns, *port, path).filter(|(code, _)| *code == 200)
        });
        let (path, port) = &self.liveness;
        let (code, body) = http_get(ns, *port, path).expect("liveness answers");
        assert_eq!(code, 200, "GET {path}: {body}");
        let mode = http_get(ns, self.metrics_port, "/proxyMode")
            .expect("metrics server")
            .1;
        assert_eq!(
            mode.trim(),
            self.expect_mode,
            "GET /proxyMode; log:\n{}",
            c.log()
        );
    }

    fn cluster_ip(&self) -> String {
        format!("{CLUSTER_IP}:80")
    }

    fn node_port(&self) -> String {
        format!("{NODE_IP}:{NODE_PORT}")
    }

    /// New connections through both services answer from the expected backends.
    fn check_traffic(&self, c: &mut PodContainer) {
        let pod0 = &self.topo.pod("pod-l0").ns;
        let (cip, np) = (self.cluster_ip(), self.node_port());
        c.wait_for("the ClusterIP to answer from pod-l1", || {
            Probe::tcp(&cip, 1)
                .timeout(Duration::from_millis(500))
                .run(pod0, Some(&self.cg))
                .ok()
                .filter(|r| r.answers.get("pod-l1") == Some(&1))
        });
        let r = Probe::tcp(&cip, 10).run(pod0, Some(&self.cg)).unwrap();
        assert_eq!(r.answers.get("pod-l1"), Some(&10), "ClusterIP: {r:?}");
        c.wait_for("the NodePort to answer from pod-r0", || {
            Probe::tcp(&np, 1)
                .timeout(Duration::from_millis(500))
                .run(&self.topo.client, None)
                .ok()
                .filter(|r| r.answers.get("pod-r0") == Some(&1))
        });
        let r = Probe::tcp(&np, 10).run(&self.topo.client, None).unwrap();
        assert_eq!(r.answers.get("pod-r0"), Some(&10), "NodePort: {r:?}");
    }
}

fn run_as_deployed(case: Case) {
    if !require_root() {
        return;
    }
    let Some(archive) = require_image() else {
        return;
    };
    let Some(docs) = kustomize(case.rendering) else {
        return;
    };
    let what = format!("deploy/{}", case.rendering);
    let r = Rendered::from_documents(&what, &docs);
    let image = podman::load(&archive);
    let c = r.container();
    assert_eq!(
        normalized_image(c.image.as_deref().unwrap()),
        image.name,
        "{what}'s image: is the name the archive gives the image"
    );
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.privileged, Some(false), "{what}");

    let mut topo = TopologySpec::new(case.hint)
        .local_pods(2)
        .remote_pods(1)
        .ipv6(false)
        .build()
        .unwrap();
    topo.serve_all().unwrap();
    let scratch = ScratchDir::new(case.hint).unwrap();
    let bpffs = Bpffs::new(&format!("{}-fs", case.hint)).unwrap();
    let cg = TestCgroup::new(&format!("{}-cg", case.hint)).unwrap();
    let api = NsFakeApi::start(&topo.node);
    let (node, services, slices) = objects(&topo);
    api.api.create(&node).unwrap();
    for s in &services {
        api.api.create(s).unwrap();
    }
    for s in &slices {
        api.api.create(s).unwrap();
    }
    let kubeconfig = std::fs::read_to_string(api.kubeconfig(scratch.path())).unwrap();

    // Which ConfigMap holds what the command line reads.
    let argv = command_line(c);
    let (config_dir, config_key) = split(flag(&argv, "config").expect("--config"));
    let config_map = config_map_mounted_at(&r, &config_dir);
    let (kubeconfig_dir, kubeconfig_key) = split(
        flag(&argv, "kubeconfig")
            .unwrap_or_else(|| panic!("{what}: reaches the API server through --kubeconfig")),
    );
    let kubeconfig_map = config_map_mounted_at(&r, &kubeconfig_dir);
    let mut config: serde_yaml::Value =
        serde_yaml::from_str(&r.config_map(&config_map).data.as_ref().unwrap()[&config_key])
            .unwrap();
    if let Some(mode) = case.config_mode {
        config["mode"] = mode.into();
    }
    let config_text = serde_yaml::to_string(&config).unwrap();

    let cgroup_root = cgroup2_mount().unwrap();
    let cg_below_root = cg.path().strip_prefix(&cgroup_root).unwrap().to_path_buf();
    let lib_modules = if Path::new("/lib/modules").is_dir() {
        PathBuf::from("/lib/modules")
    } else {
        let d = scratch.path().join("lib-modules");
        std::fs::create_dir_all(&d).unwrap();
        d
    };
    let bpffs_path = bpffs.path().to_path_buf();
    let host_path = |path: &str, kind: Option<&str>| -> PathBuf {
        let mapped = match path {
            "/sys/fs/bpf" => bpffs_path.clone(),
            "/sys/fs/cgroup" => cgroup_root.clone(),
            "/lib/modules" => lib_modules.clone(),
            "/run/xtables.lock" => PathBuf::from(path),
            other => panic!("{what} mounts hostPath {other}: map it in this test"),
        };
        match kind {
            Some("FileOrCreate") if !mapped.exists() => {
                std::fs::File::create(&mapped).unwrap();
            }
            Some("DirectoryOrCreate") => std::fs::create_dir_all(&mapped).unwrap(),
            Some("Directory") => assert!(mapped.is_dir(), "{}", mapped.display()),
            _ => {}
        }
        mapped
    };
    let config_maps = |name: &str| -> BTreeMap<String, String> {
        let mut data = r.config_map(name).data.clone().unwrap_or_default();
        if name == config_map {
            data.insert(config_key.clone(), config_text.clone());
        }
        if name == kubeconfig_map {
            data.insert(kubeconfig_key.clone(), kubeconfig.clone());
        }
        data
    };
    let field = |path: &str| -> String {
        assert_eq!(path, "spec.nodeName", "only the node name is mapped");
        NODE.to_string()
    };
    let host = PodHost {
        netns: topo.node.path(),
        host_path: &host_path,
        config_map: &config_maps,
        field: &field,
        scratch: scratch.path().to_path_buf(),
    };
    let mut run = podman::pod_run(r.pod(), c, &host);

    // --bpf-cgroup: the test's cgroup below the mounted hierarchy root.
    let cgroup_mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| {
            r.pod().volumes.iter().flatten().any(|v| {
                v.name == m.name
                    && v.host_path
                        .as_ref()
                        .is_some_and(|h| h.path == "/sys/fs/cgroup")
            })
        })
        .expect("the cgroup2 root is mounted")
        .mount_path
        .clone();
    let declared = format!("--bpf-cgroup={cgroup_mount}");
    let dedicated = format!("--bpf-cgroup={cgroup_mount}/{}", cg_below_root.display());
    let mut replaced = 0;
    for a in run.entrypoint.iter_mut().chain(run.args.iter_mut()) {
        if *a == declared {
            *a = dedicated.clone();
            replaced += 1;
        }
    }
    assert_eq!(replaced, 1, "{what}: the command passes {declared}");

    let probe = |p: &Option<k8s_openapi::api::core::v1::Probe>| {
        let g = p.as_ref().unwrap().http_get.clone().unwrap();
        let port = match g.port {
            k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(p) => p as u16,
            other => panic!("probe port {other:?}"),
        };
        (g.path.unwrap(), port)
    };
    let rig = Rig {
        liveness: probe(&c.liveness_probe),
        readiness: probe(&c.readiness_probe),
        metrics_port: bind_port(&config, "metricsBindAddress"),
        expect_mode: case.expect_mode,
        run,
        image,
        topo,
        cg,
        bpffs,
        scratch,
        _api: api,
    };
    assert_eq!(
        rig.readiness.1,
        bind_port(&config, "healthzBindAddress"),
        "the probes ask the health server"
    );

    let mut first = rig.start(1);
    rig.wait_ready(&mut first);
    rig.check_traffic(&mut first);
    check_security(&first, sc.capabilities.as_ref().unwrap());
    check_mode_state(&rig);

    // A rolling update under two long-lived connections.
    let pod0 = &rig.topo.pod("pod-l0").ns;
    let mut ext = Hold::start(
        &rig.topo.client,
        None,
        &rig.node_port(),
        HOLD_SECONDS,
        "client → NodePort",
    );
    let mut int = Hold::start(
        pod0,
        Some(&rig.cg),
        &rig.cluster_ip(),
        HOLD_SECONDS,
        "pod → ClusterIP",
    );
    assert_eq!(ext.backend, "pod-r0");
    assert_eq!(int.backend, "pod-l1");
    std::thread::sleep(Duration::from_millis(500));
    first.stop(rig.run.grace_seconds);
    let first_log = first.log();
    assert!(
        first_log.contains("SIGTERM"),
        "the agent saw the kubelet's SIGTERM:\n{first_log}"
    );
    drop(first);
    std::thread::sleep(Duration::from_secs(1));
    ext.assert_running();
    int.assert_running();

    let mut second = rig.start(2);
    rig.wait_ready(&mut second);
    ext.assert_running();
    int.assert_running();
    rig.check_traffic(&mut second);
    check_mode_state(&rig);
    let ext_n = ext.finish();
    let int_n = int.finish();
    let log = second.log();
    assert!(!log.contains("panicked"), "{log}");
    eprintln!(
        "{}: served through the rolling update ({ext_n} + {int_n} exchanges); the new \
         container's log:\n{log}",
        case.expect_mode
    );
}

/// The container's process has exactly the declared capabilities this machine grants (see
/// the module docs), no way to gain more, and no seccomp filter.
fn check_security(c: &PodContainer, caps: &k8s_openapi::api::core::v1::Capabilities) {
    let status = std::fs::read_to_string(format!("/proc/{}/status", c.pid())).unwrap();
    let available = status_mask(
        &std::fs::read_to_string("/proc/self/status").unwrap(),
        "CapBnd",
    );
    let available = capability_names(available);
    assert_eq!(caps.drop.as_deref(), Some(&["ALL".to_string()][..]));
    let mut want: Vec<String> = caps
        .add
        .iter()
        .flatten()
        .filter(|c| available.contains(c))
        .cloned()
        .collect();
    want.sort();
    let missing: Vec<&String> = caps
        .add
        .iter()
        .flatten()
        .filter(|c| !available.contains(c))
        .collect();
    if !missing.is_empty() {
        eprintln!("note: this machine does not grant {missing:?}; the container runs without");
    }
    for set in ["CapEff", "CapPrm", "CapBnd"] {
        assert_eq!(
            capability_names(status_mask(&status, set)),
            want,
            "{set} of the container's process"
        );
    }
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}:")))
            .unwrap_or_default()
            .trim()
            .to_string()
    };
    assert_eq!(field("NoNewPrivs"), "1", "allowPrivilegeEscalation: false");
    assert_eq!(field("Seccomp"), "0", "seccompProfile: Unconfined");
}

/// The mode's kernel state, seen from the host's side.
fn check_mode_state(rig: &Rig) {
    let ns = &rig.topo.node;
    match rig.expect_mode {
        "ebpf" => assert!(
            rig.bpffs.entries().unwrap().contains(&"kproxy".to_string()),
            "pins in the test's bpffs"
        ),
        // The host's `iptables-save` (its default backend) reads the container's rules.
        "iptables" => {
            let out = ns.exec("iptables-save", &["-t", "nat"]).unwrap();
            assert!(
                out.lines().any(|l| l.starts_with(":KUBE-SERVICES")),
                "the host's iptables-save does not see the container's rules:\n{out}"
            );
        }
        "nftables" => {
            ns.exec("nft", &["list", "table", "ip", "kube-proxy"])
                .unwrap();
        }
        other => panic!("mode {other}"),
    }
}

/// `podman run --rm --network=none --entrypoint=PROGRAM IMAGE ARGS`: (success, stdout+stderr).
fn run_in_image(image: &Image, program: &str, args: &[&str]) -> (bool, String) {
    let o = podman()
        .args(["run", "--rm", "--pull=never", "--network=none"])
        .args(podman::ULIMITS)
        .arg(format!("--entrypoint={program}"))
        .arg(&image.id)
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

#[test]
fn image_holds_the_tools_and_no_shell() {
    if !require_root() {
        return;
    }
    let Some(archive) = require_image() else {
        return;
    };
    let image = podman::load(&archive);
    let docs = parse_documents(&std::fs::read_to_string(deploy_dir().join("kproxy.yaml")).unwrap());
    let r = Rendered::from_documents("deploy/kproxy.yaml", &docs);
    let c = r.container();
    assert_eq!(normalized_image(c.image.as_deref().unwrap()), image.name);
    assert_eq!(
        image.entrypoint.first(),
        c.command.as_ref().and_then(|v| v.first()),
        "the image's entrypoint is the binary the DaemonSet runs"
    );
    for label in [
        "version", "revision", "source", "created", "licenses", "title",
    ] {
        let key = format!("org.opencontainers.image.{label}");
        assert!(
            image.labels.get(&key).is_some_and(|v| !v.is_empty()),
            "label {key}: {:?}",
            image.labels
        );
    }
    assert_eq!(
        image.labels["org.opencontainers.image.version"],
        env!("CARGO_PKG_VERSION")
    );

    // Every tool the agent runs starts: its libraries are in the image.
    let (ok, out) = run_in_image(image, "/usr/local/bin/kproxy", &["--version"]);
    assert!(ok && out.contains(env!("CARGO_PKG_VERSION")), "{out}");
    for tool in [
        "iptables-nft",
        "iptables-legacy",
        "ip6tables-nft",
        "ip6tables-legacy",
        "iptables-nft-restore",
        "iptables-legacy-save",
        "nft",
    ] {
        let (ok, out) = run_in_image(image, tool, &["--version"]);
        assert!(ok, "{tool} --version in the image: {out}");
    }
    // `ipset version` also asks the kernel, which needs NET_ADMIN: that it printed its own
    // version shows it started.
    let (_, out) = run_in_image(image, "ipset", &["version"]);
    assert!(
        out.starts_with("ipset v"),
        "ipset version in the image: {out}"
    );

    // The host's iptables (its default backend) and the image's same-backend tool agree, so
    // the rules the agent writes from the container are the ones the node's tools read.
    let host_version = std::process::Command::new("iptables")
        .arg("--version")
        .output()
        .unwrap();
    let host_version = String::from_utf8_lossy(&host_version.stdout).into_owned();
    let backend = if host_version.contains("nf_tables") {
        "iptables-nft"
    } else {
        "iptables-legacy"
    };
    let (_, image_version) = run_in_image(image, backend, &["--version"]);
    assert_eq!(
        image_version.trim(),
        host_version.trim(),
        "the image's {backend} differs from the host's iptables"
    );

    // No shell.
    for shell in ["/bin/sh", "/bin/bash", "/usr/bin/dash", "/usr/bin/sh"] {
        let (ok, out) = run_in_image(image, shell, &["-c", "true"]);
        assert!(!ok, "{shell} runs in the image: {out}");
    }
    let size = compressed_size(&archive);
    eprintln!(
        "image {} ({}), {:.1} MiB compressed; {}",
        image.digest,
        image.labels["org.opencontainers.image.revision"],
        size as f64 / 1048576.0,
        image.load_output.trim()
    );
    assert!(
        size < 60 << 20,
        "the image is {size} bytes compressed (aim: < 60 MiB)"
    );
}

/// Config and layers of the archive's manifest, as a node downloads them.
fn compressed_size(archive: &Path) -> u64 {
    let read = |member: &str| -> serde_json::Value {
        let o = std::process::Command::new("tar")
            .arg("-xOf")
            .arg(archive)
            .arg(member)
            .output()
            .unwrap();
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let index = read("index.json");
    let digest = index["manifests"][0]["digest"].as_str().unwrap();
    let manifest = read(&format!(
        "blobs/sha256/{}",
        digest.trim_start_matches("sha256:")
    ));
    manifest["config"]["size"].as_u64().unwrap()
        + manifest["layers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["size"].as_u64().unwrap())
            .sum::<u64>()
}

#[test]
fn image_names_normalize_like_docker() {
    assert_eq!(
        normalized_image("kproxy:latest"),
        "docker.io/library/kproxy:latest"
    );
    assert_eq!(
        normalized_image("kproxy"),
        "docker.io/library/kproxy:latest"
    );
    assert_eq!(normalized_image("me/kproxy:v1"), "docker.io/me/kproxy:v1");
    assert_eq!(
        normalized_image("registry.example:5000/kproxy:v1"),
        "registry.example:5000/kproxy:v1"
    );
}
