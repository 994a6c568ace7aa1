//! The kproxy container image under podman, for the `agent` group's `deploy_image` tests:
//! finding and loading the archive `cargo xtask image` writes ([`require_image`], [`load`]),
//! turning a DaemonSet's pod spec into `podman run` options ([`pod_run`]: host network,
//! security context, environment, volumes), and one running container ([`PodContainer`]:
//! output in a log file, stopped like the kubelet stops a pod, removed on drop).
//!
//! podman runs as root with `--runtime runc --cgroup-manager cgroupfs` and explicit
//! `nofile`/`nproc` limits ([`GLOBAL`], [`ULIMITS`]): on this machine crun fails (hybrid
//! cgroups) and podman's default `RLIMIT_NOFILE` (1048576) is above the hard limit.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, PodSpec};
use serde_json::Value;

use crate::agentproc::AgentProcess;
use crate::netns::{REQUIRE_KERNEL_ENV, is_stale_name, run_checked, unique_name};
use crate::tools::require_tool;

/// Set by `cargo xtask test` to the archive it just built (xtask/src/test.rs).
pub const IMAGE_ARCHIVE_ENV: &str = "KPROXY_IMAGE_ARCHIVE";
/// Where `cargo xtask image` writes the archive, under the target directory
/// (xtask/src/image.rs, `Profile::archive`): the release image, then the dev-binary image of
/// `cargo xtask image --profile dev` (which `cargo xtask test` builds).
pub const ARCHIVES_IN_TARGET: &[&str] = &["image/kproxy-image.tar", "image/kproxy-image-dev.tar"];
/// podman's global options (see the module docs).
pub const GLOBAL: &[&str] = &["--runtime", "runc", "--cgroup-manager", "cgroupfs"];
/// Resource limits every container needs here (see the module docs).
pub const ULIMITS: &[&str] = &[
    "--ulimit",
    "nofile=20000:20000",
    "--ulimit",
    "nproc=4096:4096",
];

/// `podman GLOBAL…`: add a subcommand and its arguments.
pub fn podman() -> Command {
    let mut cmd = Command::new("podman");
    cmd.args(GLOBAL);
    cmd
}

/// The image archive: `$KPROXY_IMAGE_ARCHIVE`, else the first of [`ARCHIVES_IN_TARGET`] that
/// exists under the target directory this test binary was built in (else the first's path).
pub fn archive_path() -> PathBuf {
    if let Some(p) = std::env::var_os(IMAGE_ARCHIVE_ENV) {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/<profile>/deps/<test binary>
    let target = exe
        .ancestors()
        .nth(3)
        .expect("the test binary is in target/<profile>/deps");
    let candidates: Vec<PathBuf> = ARCHIVES_IN_TARGET.iter().map(|a| target.join(a)).collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .unwrap_or(&candidates[0])
        .clone()
}

/// The archive, when podman, runc and the archive are here; otherwise `None` after printing
/// `skipped: …`, or a panic under `KPROXY_TESTS_REQUIRE_KERNEL=1` (`cargo xtask test` builds
/// the image and installs podman, so a missing one is a failure there).
pub fn require_image() -> Option<PathBuf> {
    require_tool("podman", "podman")?;
    require_tool("runc", "runc")?;
    let archive = archive_path();
    if archive.is_file() {
        return Some(archive);
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_string();
    let why = format!(
        "no image archive at {} (build it with `cargo xtask image`; `cargo xtask test` does)",
        archive.display()
    );
    if std::env::var(REQUIRE_KERNEL_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: {why} (and {REQUIRE_KERNEL_ENV}=1)");
    }
    eprintln!("skipped: {test}: {why}");
    None
}

/// The loaded image, as the archive describes it.
#[derive(Debug, Clone)]
pub struct Image {
    /// The config's digest without `sha256:` (podman's image ID; containers run by it, so a
    /// concurrent load of another `kproxy:latest` cannot swap the image under a test).
    pub id: String,
    /// `sha256:…` of the manifest.
    pub digest: String,
    /// The name `index.json` gives it (`io.containerd.image.name`).
    pub name: String,
    /// The config's labels.
    pub labels: BTreeMap<String, String>,
    /// The config's entrypoint.
    pub entrypoint: Vec<String>,
    /// What `podman load` printed.
    pub load_output: String,
}

/// `podman load -i archive`, once per process (the tests of a binary share it); panics when
/// it fails.
pub fn load(archive: &Path) -> &'static Image {
    static LOADED: OnceLock<Image> = OnceLock::new();
    LOADED.get_or_init(|| {
        let index: Value = serde_json::from_str(&tar_member(archive, "index.json")).unwrap();
        let m = &index["manifests"][0];
        let digest = m["digest"].as_str().unwrap().to_string();
        let name = m["annotations"]["io.containerd.image.name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let manifest: Value = serde_json::from_str(&tar_member(archive, &blob(&digest))).unwrap();
        let config_digest = manifest["config"]["digest"].as_str().unwrap();
        let config: Value =
            serde_json::from_str(&tar_member(archive, &blob(config_digest))).unwrap();
        let labels = config["config"]["Labels"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
            .collect();
        let entrypoint = config["config"]["Entrypoint"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        let start = Instant::now();
        let load_output = run_checked(podman().arg("load").arg("-i").arg(archive))
            .unwrap_or_else(|e| panic!("podman load -i {}: {e:#}", archive.display()));
        eprintln!(
            "podman load -i {}: {:.1} s: {}",
            archive.display(),
            start.elapsed().as_secs_f64(),
            load_output.trim()
        );
        let id = config_digest.trim_start_matches("sha256:").to_string();
        run_checked(podman().args(["image", "exists", &id])).unwrap_or_else(|e| {
            panic!("image {id} is not in podman's storage after the load: {e:#}")
        });
        Image {
            id,
            digest,
            name,
            labels,
            entrypoint,
            load_output,
        }
    })
}

fn blob(digest: &str) -> String {
    format!("blobs/sha256/{}", digest.trim_start_matches("sha256:"))
}

/// One member of a tar archive, as text.
fn tar_member(archive: &Path, member: &str) -> String {
    run_checked(Command::new("tar").arg("-xOf").arg(archive).arg(member))
        .unwrap_or_else(|e| panic!("reading {member} from {}: {e:#}", archive.display()))
}

/// Where the pod's host resources come from in a test, and the values the kubelet would fill
/// in.
pub struct PodHost<'a> {
    /// The network namespace that is the "node" (`hostNetwork: true` joins it).
    pub netns: PathBuf,
    /// A hostPath volume's host path (and its `type`) → the path podman mounts instead.
    pub host_path: &'a dyn Fn(&str, Option<&str>) -> PathBuf,
    /// A ConfigMap volume's name → its files (key → content).
    pub config_map: &'a dyn Fn(&str) -> BTreeMap<String, String>,
    /// A `fieldRef` environment value (`spec.nodeName`) → its value.
    pub field: &'a dyn Fn(&str) -> String,
    /// Where ConfigMap volumes are written.
    pub scratch: PathBuf,
}

/// A pod spec as `podman run` options: `options` (before the image), `entrypoint` (the
/// container's `command`, `$(VAR)` expanded) and `args` (after the image).
#[derive(Debug, Clone)]
pub struct PodRun {
    pub options: Vec<String>,
    pub entrypoint: Vec<String>,
    pub args: Vec<String>,
    /// `terminationGracePeriodSeconds` (30 when unset, the API default): `podman stop -t`.
    pub grace_seconds: i64,
}

impl PodRun {
    /// `run --rm --name NAME OPTIONS --entrypoint JSON IMAGE ARGS` (after [`GLOBAL`]).
    pub fn argv(&self, name: &str, image: &str) -> Vec<String> {
        let mut v: Vec<String> = ["run", "--rm", "--pull=never", "--name", name]
            .map(String::from)
            .to_vec();
        v.extend(self.options.iter().cloned());
        v.push(format!(
            "--entrypoint={}",
            serde_json::to_string(&self.entrypoint).unwrap()
        ));
        v.push(image.to_string());
        v.extend(self.args.iter().cloned());
        v
    }
}

/// The fields of a container's `securityContext` [`pod_run`] translates; any other fails the
/// conversion (a new one in the manifest must be mapped here, not silently dropped).
const SECURITY_FIELDS: &[&str] = &[
    "privileged",
    "allowPrivilegeEscalation",
    "capabilities",
    "seccompProfile",
];
/// Container fields that have no `podman run` counterpart in this test, and why.
const IGNORED_CONTAINER_FIELDS: &[(&str, &str)] = &[
    ("name", "the pod's, not the container's"),
    (
        "image",
        "the test runs the loaded archive by image ID (checked by the caller)",
    ),
    ("imagePullPolicy", "podman runs with --pull=never"),
    ("ports", "hostNetwork: the ports are the node's"),
    ("livenessProbe", "the test polls the probes' paths itself"),
    ("readinessProbe", "the test polls the probes' paths itself"),
    (
        "resources",
        "requests only steer the scheduler (limits would be mapped)",
    ),
];

/// Translates the pod spec and its container like a kubelet with hostNetwork would (see
/// [`PodRun`]). Panics on anything it cannot translate faithfully.
pub fn pod_run(pod: &PodSpec, c: &Container, host: &PodHost<'_>) -> PodRun {
    let mut o: Vec<String> = ULIMITS.iter().map(|s| s.to_string()).collect();
    assert_eq!(
        pod.host_network,
        Some(true),
        "the DaemonSet uses the node's network"
    );
    assert_ne!(pod.host_pid, Some(true), "hostPID is not mapped");
    assert_ne!(pod.host_ipc, Some(true), "hostIPC is not mapped");
    assert!(
        pod.security_context
            .as_ref()
            .is_none_or(|s| serde_json::to_value(s).unwrap() == serde_json::json!({})),
        "a pod-level securityContext is not mapped: {:?}",
        pod.security_context
    );
    o.push(format!("--network=ns:{}", host.netns.display()));
    // A hostNetwork pod keeps the node's UTS namespace (containerd and CRI-O do so).
    o.push("--uts=host".into());
    // The container's own cgroup namespace, as on a cgroup v2 node (containerd, CRI-O).
    o.push("--cgroupns=private".into());

    let cv = serde_json::to_value(c).unwrap();
    for key in cv.as_object().unwrap().keys() {
        let known = ["command", "args", "env", "securityContext", "volumeMounts"];
        assert!(
            known.contains(&key.as_str()) || IGNORED_CONTAINER_FIELDS.iter().any(|(k, _)| k == key),
            "container field {key} is not mapped to podman"
        );
    }
    if let Some(limits) = c.resources.as_ref().and_then(|r| r.limits.as_ref()) {
        panic!("resource limits are not mapped to podman: {limits:?}");
    }

    // Security context.
    let sc = c.security_context.clone().unwrap_or_default();
    for key in serde_json::to_value(&sc)
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
    {
        assert!(
            SECURITY_FIELDS.contains(&key.as_str()),
            "securityContext.{key} is not mapped to podman"
        );
    }
    if sc.privileged == Some(true) {
        o.push("--privileged".into());
    }
    if sc.allow_privilege_escalation == Some(false) {
        o.push("--security-opt=no-new-privileges".into());
    }
    if let Some(caps) = &sc.capabilities {
        for cap in caps.drop.iter().flatten() {
            o.push(format!("--cap-drop={cap}"));
        }
        for cap in caps.add.iter().flatten() {
            o.push(format!("--cap-add={cap}"));
        }
    }
    match sc.seccomp_profile.as_ref().map(|p| p.type_.as_str()) {
        None | Some("RuntimeDefault") => {}
        Some("Unconfined") => o.push("--security-opt=seccomp=unconfined".into()),
        Some(other) => panic!("seccompProfile {other} is not mapped"),
    }

    // Environment, then `$(VAR)` in the command line (the kubelet's expansion).
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), None) => v.clone(),
            (None, Some(from)) => {
                let field = from
                    .field_ref
                    .as_ref()
                    .unwrap_or_else(|| panic!("env {}: only fieldRef is mapped", e.name));
                (host.field)(&field.field_path)
            }
            _ => panic!("env {}: neither a value nor a fieldRef", e.name),
        };
        o.push(format!("--env={}={value}", e.name));
        env.insert(e.name.clone(), value);
    }
    let expand = |s: &String| {
        env.iter()
            .fold(s.clone(), |s, (k, v)| s.replace(&format!("$({k})"), v))
    };
    let entrypoint: Vec<String> = c.command.iter().flatten().map(expand).collect();
    let args: Vec<String> = c.args.iter().flatten().map(expand).collect();
    assert!(!entrypoint.is_empty(), "the container sets command");

    // Volumes.
    let volumes = pod.volumes.clone().unwrap_or_default();
    for m in c.volume_mounts.iter().flatten() {
        let v = volumes
            .iter()
            .find(|v| v.name == m.name)
            .unwrap_or_else(|| panic!("volumeMount {} has no volume", m.name));
        let mut opts = vec![];
        let source = if let Some(hp) = &v.host_path {
            (host.host_path)(&hp.path, hp.type_.as_deref())
        } else if let Some(cm) = &v.config_map {
            let dir = host.scratch.join(format!("configmap-{}", v.name));
            std::fs::create_dir_all(&dir).unwrap();
            for (key, text) in (host.config_map)(&cm.name) {
                std::fs::write(dir.join(key), text).unwrap();
            }
            // ConfigMap volumes are read-only whatever the mount says.
            opts.push("ro".to_string());
            dir
        } else {
            panic!(
                "volume {}: only hostPath and configMap volumes are mapped",
                v.name
            );
        };
        if m.read_only == Some(true) && !opts.iter().any(|x| x == "ro") {
            opts.push("ro".into());
        }
        assert!(m.sub_path.is_none(), "subPath is not mapped");
        match m.mount_propagation.as_deref() {
            None | Some("None") => {}
            Some("HostToContainer") => opts.push("rslave".into()),
            Some("Bidirectional") => opts.push("rshared".into()),
            Some(other) => panic!("mountPropagation {other}"),
        }
        let mut spec = format!("{}:{}", source.display(), m.mount_path);
        if !opts.is_empty() {
            spec.push(':');
            spec.push_str(&opts.join(","));
        }
        o.push(format!("--volume={spec}"));
    }
    PodRun {
        options: o,
        entrypoint,
        args,
        grace_seconds: pod.termination_grace_period_seconds.unwrap_or(30),
    }
}

/// A container started with `podman run` (attached: its output goes to a log file through
/// an [`AgentProcess`]); removed (`podman rm -f`) on drop.
pub struct PodContainer {
    pub name: String,
    proc: AgentProcess,
}

impl PodContainer {
    /// `podman GLOBAL… run --rm --name <unique> …` of `run` and `image`, output in `log`.
    pub fn start(hint: &str, run: &PodRun, image: &str, log: PathBuf) -> PodContainer {
        sweep_stale_containers();
        let name = unique_name(hint);
        let mut cmd = podman();
        cmd.args(run.argv(&name, image));
        eprintln!("starting container {name}: {cmd:?}");
        PodContainer {
            proc: AgentProcess::spawn(cmd, log),
            name,
        }
    }

    /// The container's output so far.
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// Polls `f` until `Some`, failing (with the log) when the container exits or after the
    /// agent tests' liveness bound.
    pub fn wait_for<T>(&mut self, what: &str, f: impl FnMut() -> Option<T>) -> T {
        self.proc.wait_for(what, f)
    }

    /// The container's first process as the host sees it.
    pub fn pid(&self) -> u32 {
        let out = run_checked(podman().args(["inspect", "--format", "{{.State.Pid}}", &self.name]))
            .unwrap();
        out.trim().parse().unwrap_or_else(|_| panic!("pid {out:?}"))
    }

    /// What the kubelet does to stop a pod: SIGTERM, SIGKILL after `grace_seconds`
    /// (`podman stop -t`); waits until `podman run` returned (the container is removed).
    pub fn stop(&mut self, grace_seconds: i64) {
        run_checked(podman().args(["stop", "-t", &grace_seconds.to_string(), &self.name]))
            .unwrap_or_else(|e| panic!("podman stop {}: {e:#}", self.name));
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.proc.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < deadline,
                "podman run did not return after the stop"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for PodContainer {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "--force", "--time", "0", &self.name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Removes containers that test processes which no longer exist left running.
fn sweep_stale_containers() {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(|| {
        let Ok(names) = run_checked(podman().args(["ps", "--all", "--format", "{{.Names}}"]))
        else {
            return;
        };
        for name in names.lines().filter(|n| is_stale_name(n)) {
            let _ = run_checked(podman().args(["rm", "--force", "--time", "0", name]));
        }
    });
}

/// The capability names of a `/proc/<pid>/status` mask line (`CapEff:\t00000000a80425fb`),
/// as the manifests spell them (`NET_ADMIN`), sorted.
pub fn capability_names(mask: u64) -> Vec<String> {
    // include/uapi/linux/capability.h, in bit order.
    const NAMES: [&str; 41] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ];
    let mut v: Vec<String> = (0..64)
        .filter(|b| mask & (1 << b) != 0)
        .map(|b| {
            NAMES
                .get(b)
                .map_or_else(|| format!("CAP_{b}"), |n| n.to_string())
        })
        .collect();
    v.sort();
    v
}

/// A `Cap…:` line of `/proc/<pid>/status` as a mask.
pub fn status_mask(status: &str, field: &str) -> u64 {
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in {status}"));
    u64::from_str_radix(line.trim(), 16).unwrap()
}
