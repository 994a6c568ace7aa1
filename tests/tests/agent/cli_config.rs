//! The `kproxy` binary's command line and `KubeProxyConfiguration` handling, run as a user (or
//! a kube-proxy DaemonSet) would run it.
//!
//! Upstream data: `tests/fixtures/upstream/config/kube-proxy-configuration.yaml` (every
//! v1alpha1 field with its default) and `kube-proxy-flags.yaml` (every upstream flag).
//! Needs the binary: `cargo build -p kproxy` (`cargo xtask test` builds it).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kproxy::config::GoDuration;
use kproxy_tests::fixtures;
use kproxy_tests::netns::unique_name;
use kproxy_tests::topology::kproxy_bin;
use serde_yaml::Value;

/// A scratch directory removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(hint: &str) -> Scratch {
        let dir = std::env::temp_dir().join(unique_name(hint));
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
    fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, text).unwrap();
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs the binary; returns (exit code, stdout, stderr). Colours off so stderr is plain.
fn kproxy(args: &[&str]) -> (i32, String, String) {
    let bin = kproxy_bin().expect("kproxy binary");
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(bin)
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .output()
        .expect("run kproxy");
    (
        status.code().unwrap_or(-1),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

fn ok(args: &[&str]) -> (String, String) {
    let (code, out, err) = kproxy(args);
    assert_eq!(code, 0, "kproxy {args:?} failed:\n{err}");
    (out, err)
}

fn fails(args: &[&str]) -> String {
    let (code, _, err) = kproxy(args);
    assert_ne!(code, 0, "kproxy {args:?} should fail");
    err
}

const HEAD: &str = "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n";

/// Writes the effective config for `args` and returns it as YAML.
fn effective(dir: &Scratch, args: &[&str]) -> Value {
    let out = dir.path(&unique_name("eff"));
    let out_s = out.to_str().unwrap().to_owned();
    let mut all: Vec<&str> = args.to_vec();
    all.push("--write-config-to");
    all.push(&out_s);
    ok(&all);
    serde_yaml::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

fn at<'a>(v: &'a Value, path: &[&str]) -> Option<&'a Value> {
    path.iter().try_fold(v, |v, k| v.get(*k))
}

fn s(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(other) => serde_yaml::to_string(other).unwrap().trim().to_owned(),
        None => "<absent>".into(),
    }
}

// ---------------------------------------------------------------------------------------------
// Defaults: every upstream field, against the upstream field list.

/// The value a fixture default text names: its leading token (`"30s (D)"` ⇒ `30s`,
/// `'"" => iptables …'` ⇒ ``, `"0.0.0.0:10256, or …"` ⇒ `0.0.0.0:10256`).
fn default_token(text: &str) -> String {
    let t = text.trim();
    if let Some(rest) = t.strip_prefix('"') {
        return rest.split('"').next().unwrap_or_default().to_owned();
    }
    t.split([' ', ',']).next().unwrap_or_default().to_owned()
}

/// Compares one written value with the fixture's type and default.
fn check_field(
    path: &[&str],
    ty: &str,
    default: Option<&str>,
    got: Option<&Value>,
) -> Result<(), String> {
    let where_ = path.join(".");
    let want = default.map(default_token);
    let is_list = ty.starts_with("[]");
    let is_map = ty.starts_with("map");
    let is_duration = ty.contains("duration");
    let is_bool = ty.contains("bool") && !is_map;
    match (want.as_deref(), got) {
        // Unset lists: absent, null or empty.
        (Some("unset") | None, None | Some(Value::Null)) if is_list => Ok(()),
        (Some("unset") | None, Some(Value::Sequence(v))) if is_list && v.is_empty() => Ok(()),
        (Some("{}") | None, Some(Value::Mapping(m))) if is_map && m.is_empty() => Ok(()),
        (_, None) => Err(format!("{where_}: missing from the written config")),
        (w, Some(g)) if is_duration => {
            let want = GoDuration::parse(w.unwrap_or("0"))
                .map_err(|e| format!("{where_}: fixture {e}"))?;
            let got =
                GoDuration::parse(&s(Some(g))).map_err(|e| format!("{where_}: written {e}"))?;
            (want == got)
                .then_some(())
                .ok_or(format!("{where_}: want {want}, got {got}"))
        }
        (w, Some(g)) if is_bool => {
            let want = w.unwrap_or("false");
            (s(Some(g)) == want)
                .then_some(())
                .ok_or(format!("{where_}: want {want}, got {}", s(Some(g))))
        }
        (w, Some(g)) if ty.contains("int") || ty.contains("float") => {
            let want: f64 = w
                .unwrap_or("0")
                .parse()
                .map_err(|_| format!("{where_}: fixture default {w:?}"))?;
            let got: f64 = s(Some(g))
                .parse()
                .map_err(|_| format!("{where_}: written {g:?}"))?;
            (want == got)
                .then_some(())
                .ok_or(format!("{where_}: want {want}, got {got}"))
        }
        (w, Some(g)) => {
            let want = w.unwrap_or("");
            (s(Some(g)) == want)
                .then_some(())
                .ok_or(format!("{where_}: want {want:?}, got {:?}", s(Some(g))))
        }
    }
}

/// Walks the fixture's `fields` tree; returns how many leaves were checked.
fn check_tree(
    fixture: &Value,
    written: &Value,
    path: &mut Vec<String>,
    errors: &mut Vec<String>,
) -> usize {
    let mut n = 0;
    for (k, v) in fixture.as_mapping().unwrap() {
        let k = k.as_str().unwrap().to_owned();
        path.push(k.clone());
        let p: Vec<&str> = path.iter().map(String::as_str).collect();
        if let Some(ty) = v.get("type").and_then(Value::as_str) {
            let default = v.get("default").and_then(Value::as_str);
            n += 1;
            if k == "logging" {
                // "format text, flushFrequency 5s, verbosity 0 (A2)": check each named setting.
                let text = default.unwrap().split(" (").next().unwrap();
                for kv in text.split(", ") {
                    let (sub, want) = kv.split_once(' ').unwrap();
                    let ty = if sub == "flushFrequency" {
                        "duration"
                    } else if sub == "verbosity" {
                        "int"
                    } else {
                        "string"
                    };
                    if let Err(e) = check_field(&[&k, sub], ty, Some(want), at(written, &[&k, sub]))
                    {
                        errors.push(e);
                    }
                }
            } else if let Err(e) = check_field(&p, ty, default, at(written, &p)) {
                errors.push(e);
            }
        } else {
            n += check_tree(v, written, path, errors);
        }
        path.pop();
    }
    n
}

#[test]
fn every_config_field_is_written_with_its_upstream_default() {
    let dir = Scratch::new("cli-defaults");
    let minimal = dir.write("min.yaml", HEAD);
    let written = effective(&dir, &["--config", minimal.to_str().unwrap()]);
    let fixture: Value = serde_yaml::from_str(
        &std::fs::read_to_string(fixtures::upstream("config/kube-proxy-configuration.yaml"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(s(written.get("apiVersion")), s(fixture.get("apiVersion")));
    assert_eq!(s(written.get("kind")), s(fixture.get("kind")));
    let mut errors = Vec::new();
    let checked = check_tree(&fixture["fields"], &written, &mut Vec::new(), &mut errors);
    assert!(
        errors.is_empty(),
        "{} of {checked} fields differ:\n{}",
        errors.len(),
        errors.join("\n")
    );
    // Every v1alpha1 field of the upstream list: 17 top-level leaves and 36 in 7 sections.
    assert_eq!(checked, 53, "fields checked");
}

#[test]
fn kproxy_extension_fields_have_their_defaults() {
    let dir = Scratch::new("cli-ext");
    let w = effective(&dir, &[]);
    assert_eq!(s(w.get("syncPeriod")), "30s");
    assert_eq!(s(w.get("minSyncPeriod")), "1s");
    assert_eq!(s(at(&w, &["bpf", "bpffs"])), "/sys/fs/bpf");
    assert_eq!(s(at(&w, &["bpf", "xdp"])), "best-effort");
    assert_eq!(s(at(&w, &["bpf", "lbAlgorithm"])), "random");
    assert_eq!(s(at(&w, &["bpf", "maglevTableSize"])), "16381");
    assert_eq!(s(at(&w, &["bpf", "cgroup"])), "");
}

#[test]
fn removed_upstream_fields_are_accepted_with_a_warning() {
    let dir = Scratch::new("cli-removed");
    let f = dir.write(
        "c.yaml",
        &format!("{HEAD}udpIdleTimeout: 250ms\nresourceContainer: /kube-proxy\n"),
    );
    let out = dir.path("out.yaml");
    let (_, err) = ok(&[
        "--config",
        f.to_str().unwrap(),
        "--write-config-to",
        out.to_str().unwrap(),
    ]);
    assert!(
        err.contains("config field udpIdleTimeout was removed from kube-proxy; ignored"),
        "{err}"
    );
    assert!(
        err.contains("config field resourceContainer was removed"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------------
// Errors name the field (and the flag).

#[test]
fn unknown_fields_are_rejected_with_their_path() {
    let dir = Scratch::new("cli-unknown");
    for (yaml, path, field) in [
        ("iptables:\n  syncPeriodd: 5s\n", "iptables", "syncPeriodd"),
        ("bogusField: 1\n", "", "bogusField"),
        ("bpf:\n  mapSize: {ct: 5}\n", "bpf", "mapSize"),
        ("conntrack:\n  maxPerCPU: 5\n", "conntrack", "maxPerCPU"),
    ] {
        let f = dir.write("c.yaml", &format!("{HEAD}{yaml}"));
        let err = fails(&["--config", f.to_str().unwrap()]);
        assert!(
            err.contains(&format!("unknown field `{field}`")),
            "{yaml}: {err}"
        );
        assert!(
            err.contains(&format!("config file {}: {path}", f.display())),
            "{yaml}: {err}"
        );
    }
}

#[test]
fn bad_values_are_rejected_naming_each_field() {
    let dir = Scratch::new("cli-bad");
    let f = dir.write(
        "c.yaml",
        &format!(
            "{HEAD}iptables:\n  minSyncPeriod: -1s\n  masqueradeBit: 32\nmode: userspace\nclusterCIDR: 10.0.0.0/40\n\
             metricsBindAddress: 127.0.0.1:0\nnodePortAddresses: [primary, 10.0.0.0/8]\ndetectLocalMode: Bridge\n\
             oomScoreAdj: -1001\nconntrack:\n  tcpCloseWaitTimeout: -1h\nipvs:\n  scheduler: fifo\n"
        ),
    );
    let err = fails(&["--config", f.to_str().unwrap()]);
    let want = [
        "iptables.minSyncPeriod: must be >= 0",
        "iptables.masqueradeBit: must be within the range [0, 31]",
        "mode: \"userspace\" is not a proxy mode",
        "clusterCIDR: \"10.0.0.0/40\" must be a valid CIDR",
        "metricsBindAddress: \"127.0.0.1:0\": must be a valid port",
        "nodePortAddresses[0]: can't use both 'primary' and CIDRs",
        "detectLocalMode: \"Bridge\" is not supported",
        "oomScoreAdj: must be within the range [-1000, 1000]",
        "conntrack.tcpCloseWaitTimeout: must be >= 0",
        "ipvs.scheduler: \"fifo\" is not supported",
    ];
    for w in want {
        assert!(err.contains(w), "missing {w:?} in:\n{err}");
    }
    assert_eq!(
        err.lines().filter(|l| l.starts_with("  ")).count(),
        want.len(),
        "{err}"
    );
    // A wrongly typed value names its path too.
    let f = dir.write("t.yaml", &format!("{HEAD}iptables:\n  syncPeriod: 30\n"));
    let err = fails(&["--config", f.to_str().unwrap()]);
    assert!(
        err.contains("iptables.syncPeriod: invalid duration \"30\""),
        "{err}"
    );
    let f = dir.write(
        "v.yaml",
        "apiVersion: kubeproxy.config.k8s.io/v1beta9\nkind: KubeProxyConfiguration\n",
    );
    let err = fails(&["--config", f.to_str().unwrap()]);
    assert!(
        err.contains("apiVersion: \"kubeproxy.config.k8s.io/v1beta9\" is not supported"),
        "{err}"
    );
    let err = fails(&["--config", dir.path("missing.yaml").to_str().unwrap()]);
    assert!(err.contains("cannot read config file"), "{err}");
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    let err = fails(&["--iptables-sync-period=5x"]);
    assert!(
        err.contains("invalid argument \"5x\" for \"--iptables-sync-period\" flag"),
        "{err}"
    );
    let err = fails(&["--masquerade-all=maybe"]);
    assert!(err.contains("\"--masquerade-all\" flag"), "{err}");
    let err = fails(&["--iptables-masquerade-bit=33"]);
    assert!(
        err.contains(
            "iptables.masqueradeBit (--iptables-masquerade-bit): must be within the range [0, 31]"
        ),
        "{err}"
    );
    let err = fails(&["--bpf-lb-maglev-table-size=16383"]);
    assert!(
        err.contains("bpf.maglevTableSize (--bpf-lb-maglev-table-size): 16383 must be a prime"),
        "{err}"
    );
    let err = fails(&["--bpf-lb-maglev-table-size=big"]);
    assert!(err.contains("\"--bpf-lb-maglev-table-size\" flag"), "{err}");
    let err = fails(&["--cluster-cidr=10.0.0.0/8,11.0.0.0/8"]);
    assert!(err.contains("clusterCIDR (--cluster-cidr)"), "{err}");
    // Unknown flags and stray arguments: a usage error (exit 2) naming them.
    let (code, _, err) = kproxy(&["--no-such-flag=1"]);
    assert_eq!(code, 2);
    assert!(err.contains("--no-such-flag"), "{err}");
    let (code, _, err) = kproxy(&["stray"]);
    assert_eq!(code, 2);
    assert!(err.contains("stray"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Flags and file together.

#[test]
fn flags_override_the_file_and_only_flags_given() {
    let dir = Scratch::new("cli-override");
    let f = dir.write(
        "c.yaml",
        &format!(
            "{HEAD}mode: iptables\nclusterCIDR: 10.1.0.0/16\niptables:\n  syncPeriod: 10s\n  masqueradeAll: true\n\
             conntrack:\n  maxPerCore: 0\nbpf:\n  xdp: off\n"
        ),
    );
    let w = effective(
        &dir,
        &[
            "--config",
            f.to_str().unwrap(),
            "--iptables-sync-period=20s",
            "--cluster-cidr",
            "10.2.0.0/16",
            "--bpf-xdp=native",
            "--hostname-override=Worker-9",
        ],
    );
    assert_eq!(s(at(&w, &["iptables", "syncPeriod"])), "20s", "flag wins");
    assert_eq!(s(w.get("clusterCIDR")), "10.2.0.0/16", "flag wins");
    assert_eq!(s(at(&w, &["bpf", "xdp"])), "native", "flag wins");
    assert_eq!(s(w.get("hostnameOverride")), "worker-9", "lowercased");
    assert_eq!(s(w.get("mode")), "iptables", "file kept");
    assert_eq!(
        s(at(&w, &["iptables", "masqueradeAll"])),
        "true",
        "file kept"
    );
    assert_eq!(s(at(&w, &["conntrack", "maxPerCore"])), "0", "file kept");
    assert_eq!(
        s(at(&w, &["iptables", "minSyncPeriod"])),
        "1s",
        "default kept"
    );
}

#[test]
fn write_config_to_round_trips() {
    let dir = Scratch::new("cli-roundtrip");
    let a = dir.path("a.yaml");
    let b = dir.path("b.yaml");
    let flags = [
        "--proxy-mode=ipvs",
        "--ipvs-scheduler=wrr",
        "--ipvs-exclude-cidrs=10.9.0.0/16,fd09::/64",
        "--ipvs-strict-arp",
        "--ipvs-tcp-timeout=15m",
        "--cluster-cidr=10.244.0.0/16,fd00:10:244::/56",
        "--detect-local-mode=InterfaceNamePrefix",
        "--pod-interface-name-prefix=veth",
        "--nodeport-addresses=192.168.0.0/16",
        "--conntrack-max-per-core=0",
        "--conntrack-udp-timeout=30s",
        "--oom-score-adj=-500",
        "--metrics-bind-address=0.0.0.0:9249",
        "--bind-address=::",
        "--sync-period=45s",
        "--min-sync-period=2s",
        "--bpf-cgroup=/sys/fs/cgroup/kproxy",
        "--bpf-devices=eth0,eth1",
        "--bpf-map-sizes=ct=262144,services=8192",
        "--bpf-lb-algorithm=maglev",
        "--bpf-lb-maglev-table-size=65521",
        "--hostname-override=node-a",
        "--logging-format=json",
        "--v=3",
    ];
    let mut args: Vec<&str> = flags.to_vec();
    let a_s = a.to_str().unwrap().to_owned();
    args.extend(["--write-config-to", &a_s]);
    ok(&args);
    ok(&["--config", &a_s, "--write-config-to", b.to_str().unwrap()]);
    let text_a = std::fs::read_to_string(&a).unwrap();
    let text_b = std::fs::read_to_string(&b).unwrap();
    assert_eq!(
        text_a, text_b,
        "re-reading the written config changes nothing"
    );

    // The resolved configuration is the same too (in-process, same code as the binary).
    let load = |args: &[&str]| {
        let mut v = vec![std::ffi::OsString::from("kproxy")];
        v.extend(args.iter().map(std::ffi::OsString::from));
        let inv = kproxy::cli::parse(v).unwrap();
        kproxy::cli::load(&inv, Some("host".into())).unwrap().config
    };
    let from_flags = load(&flags);
    let from_file = load(&["--config", &a_s]);
    assert_eq!(from_flags, from_file);
    assert_eq!(from_file.ipvs.scheduler, "wrr");
    assert_eq!(from_file.bpf.map_sizes.len(), 2);
    assert_eq!(from_file.bpf.maglev_table_size, 65_521);
}

// ---------------------------------------------------------------------------------------------
// Drop-in command lines.

fn flag_list(key: &str) -> Vec<(String, String)> {
    let v: Value = serde_yaml::from_str(
        &std::fs::read_to_string(fixtures::upstream("config/kube-proxy-flags.yaml")).unwrap(),
    )
    .unwrap();
    v[key]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|f| (s(f.get("name")), s(f.get("sample"))))
        .collect()
}

#[test]
fn every_upstream_flag_is_accepted_and_unimplemented_ones_warn_once() {
    let dir = Scratch::new("cli-flags");
    let out = dir.path("out.yaml");
    let flags = flag_list("flags");
    let legacy = flag_list("legacy");
    assert_eq!(flags.len(), 56, "upstream flags in the fixture");
    assert_eq!(legacy.len(), 16, "legacy flags in the fixture");
    let args: Vec<String> = flags
        .iter()
        .chain(&legacy)
        .map(|(name, sample)| {
            format!(
                "--{name}={}",
                sample.replace("@OUT@", out.to_str().unwrap())
            )
        })
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_, err) = ok(&args);
    assert!(out.is_file(), "--write-config-to wrote the file");
    // Every flag kproxy does not implement logs exactly one warning naming it.
    let mut warned = 0;
    for (name, _) in flags.iter().chain(&legacy) {
        let spec = kproxy::cli::flags::lookup(&name.replace('_', "-"))
            .unwrap_or_else(|| panic!("--{name} missing from kproxy's flag table"));
        let n = err
            .lines()
            .filter(|l| l.contains(&format!("flag --{} ", spec.name)))
            .count();
        match spec.support {
            kproxy::cli::flags::Support::Implemented => assert_eq!(n, 0, "--{name}: {err}"),
            _ => {
                assert_eq!(n, 1, "--{name} should warn once:\n{err}");
                warned += 1;
            }
        }
    }
    // 13 upstream flags kproxy accepts without effect, and the 16 legacy ones
    // (`--feature-gates` is implemented: unknown gates are warned about one by one).
    assert_eq!(warned, 29, "flags accepted without effect");
}

/// kubeadm's generated config.conf (every field written, zero values as kubeadm encodes them).
const KUBEADM_CONFIG: &str = r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: null
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: ""
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: false
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 0
metricsBindAddress: ""
mode: ""
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"#;

#[test]
fn kubeadm_config_and_command_line_are_accepted() {
    let dir = Scratch::new("cli-kubeadm");
    let conf = dir.write("config.conf", KUBEADM_CONFIG);
    let conf_arg = format!("--config={}", conf.display());
    let out = dir.path("out.yaml");
    // What kubeadm's (and kind's) DaemonSet runs, plus --write-config-to to stop after loading.
    let (_, err) = ok(&[
        &conf_arg,
        "--hostname-override=KIND-worker",
        "--v=2",
        "--write-config-to",
        out.to_str().unwrap(),
    ]);
    assert!(
        !err.contains("WARN"),
        "a kubeadm config needs no warning:\n{err}"
    );
    let w: Value = serde_yaml::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(s(w.get("hostnameOverride")), "kind-worker");
    assert_eq!(
        s(at(&w, &["clientConnection", "kubeconfig"])),
        "/var/lib/kube-proxy/kubeconfig.conf"
    );
    assert_eq!(s(w.get("clusterCIDR")), "10.244.0.0/16");
    assert_eq!(
        s(at(&w, &["iptables", "syncPeriod"])),
        "30s",
        "zero means default"
    );
    assert_eq!(
        s(at(&w, &["conntrack", "maxPerCore"])),
        "32768",
        "null means default"
    );
    assert_eq!(s(w.get("healthzBindAddress")), "0.0.0.0:10256");
    assert_eq!(
        s(at(&w, &["logging", "verbosity"])),
        "2",
        "-v over the file"
    );

    // An old-style command line full of klog and removed flags.
    let (_, err) = ok(&[
        "--v=2",
        "--logtostderr=true",
        "--alsologtostderr",
        "--log_dir=/var/log",
        "--kubeconfig=/var/lib/kube-proxy/kubeconfig",
        "--cluster-cidr=10.244.0.0/16",
        "--proxy-mode=iptables",
        "--oom-score-adj=-998",
        "--resource-container=",
        "--masquerade-all=false",
        "--iptables-sync-period",
        "1m0s",
        "--conntrack-max-per-core=0",
        "--hostname-override",
        "node-2",
        "--write-config-to",
        dir.path("old.yaml").to_str().unwrap(),
    ]);
    for flag in [
        "--logtostderr",
        "--alsologtostderr",
        "--log-dir",
        "--resource-container",
    ] {
        assert!(
            err.contains(&format!("flag {flag} was removed from kube-proxy")),
            "{flag}: {err}"
        );
    }
}

#[test]
fn init_only_validates_and_exits() {
    ok(&["--init-only", "--hostname-override=n"]);
    let err = fails(&["--init-only", "--proxy-mode=kernelspace"]);
    assert!(
        err.contains("mode (--proxy-mode): \"kernelspace\""),
        "{err}"
    );
}

#[test]
fn version_prints_and_exits_zero() {
    let (out, _) = ok(&["--version"]);
    assert_eq!(out.trim(), format!("kproxy v{}", env!("CARGO_PKG_VERSION")));
    let (out, _) = ok(&["--version=raw"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["name"], "kproxy");
    // --version wins over anything else (like upstream's verflag), even a bad config.
    ok(&["--version", "--config=/does/not/exist"]);
}

#[test]
fn mode_values() {
    let dir = Scratch::new("cli-mode");
    for mode in ["\"\"", "ebpf", "ipvs", "iptables", "nftables"] {
        let f = dir.write("c.yaml", &format!("{HEAD}mode: {mode}\n"));
        ok(&["--config", f.to_str().unwrap(), "--init-only"]);
        ok(&[
            &format!("--proxy-mode={}", mode.trim_matches('"')),
            "--init-only",
        ]);
    }
    for (mode, reason) in [
        ("kernelspace", "is the Windows proxy mode"),
        ("userspace", "is not a proxy mode"),
        ("IPTABLES", "is not a proxy mode"),
    ] {
        let f = dir.write("c.yaml", &format!("{HEAD}mode: {mode}\n"));
        let err = fails(&["--config", f.to_str().unwrap()]);
        assert!(
            err.contains(&format!("mode: \"{mode}\" {reason}")),
            "{mode}: {err}"
        );
        let err = fails(&[&format!("--proxy-mode={mode}")]);
        assert!(
            err.contains(&format!("mode (--proxy-mode): \"{mode}\" {reason}")),
            "{mode}: {err}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// render and cleanup.

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/examples")
}

#[test]
fn render_with_a_mode_prints_that_datapaths_plan() {
    let ex = examples();
    let render = |mode: &str| {
        let (out, err) = ok(&[
            "render",
            "--proxy-mode",
            mode,
            "--manifests",
            ex.to_str().unwrap(),
            "--hostname-override",
            "demo-node",
        ]);
        assert!(!err.contains("warning"), "{err}");
        out
    };
    let ipt = render("iptables");
    assert!(ipt.contains("*nat") && ipt.contains("COMMIT"), "{ipt}");
    for ep in ["10.244.1.2:8080", "10.244.1.3:8080"] {
        assert!(
            ipt.contains(&format!("-j DNAT --to-destination {ep}")),
            "{ep} in {ipt}"
        );
    }
    assert!(
        ipt.contains("-d 10.96.0.10 --dport 80") && ipt.contains("--dport 30080"),
        "{ipt}"
    );
    let ipvs = render("ipvs");
    assert!(
        ipvs.contains("10.96.0.10") && ipvs.contains("10.244.1.3"),
        "{ipvs}"
    );
    let ebpf = render("ebpf");
    assert!(
        ebpf.contains("10.96.0.10") && ebpf.contains("10.244.1.2"),
        "{ebpf}"
    );
    let nft = render("nftables");
    assert!(
        nft.contains("# IPv4\nadd table ip kube-proxy") && nft.contains("add table ip6 kube-proxy"),
        "{nft}"
    );
    for ep in ["10.244.1.2:8080", "10.244.1.3:8080"] {
        assert!(nft.contains(&format!("dnat to {ep}")), "{ep} in {nft}");
    }
    assert!(
        nft.contains(
            "add element ip kube-proxy service-ips { 10.96.0.10 . tcp . 80 : goto service-"
        ) && nft
            .contains("add element ip kube-proxy service-nodeports { tcp . 30080 : goto external-"),
        "{nft}"
    );
}

#[test]
fn render_prints_the_snapshot_of_the_examples() {
    let ex = examples();
    let (out, err) = ok(&[
        "render",
        "--proxy-mode",
        "iptables",
        "--manifests",
        ex.to_str().unwrap(),
        "--hostname-override",
        "demo-node",
        "--output",
        "json",
    ]);
    assert!(!err.contains("warning"), "{err}");
    let snap: serde_json::Value = serde_json::from_str(&out).unwrap();
    let web = &snap["services"]["default/web:http"];
    assert_eq!(
        web["cluster_ips"],
        serde_json::json!(["10.96.0.10"]),
        "{web}"
    );
    assert_eq!(web["port"], 80);
    assert_eq!(web["node_port"], 30080);
    let eps: Vec<String> = snap["endpoints"]["default/web:http"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            format!(
                "{}:{} local={}",
                e["ip"].as_str().unwrap(),
                e["port"],
                e["is_local"]
            )
        })
        .collect();
    assert_eq!(
        eps,
        ["10.244.1.2:8080 local=true", "10.244.1.3:8080 local=true"]
    );
    assert!(snap["services"]["default/echo:udp"].is_object(), "{out}");
    assert_eq!(snap["node"]["name"], "demo-node");

    let (table, _) = ok(&[
        "render",
        "--manifests",
        ex.to_str().unwrap(),
        "--hostname-override",
        "demo-node",
        "--output",
        "table",
    ]);
    let web_line = table
        .lines()
        .find(|l| l.starts_with("default/web:http"))
        .unwrap_or_else(|| panic!("{table}"));
    for part in [
        "TCP",
        "10.96.0.10:80",
        "nodePort 30080",
        "10.244.1.2:8080*",
        "10.244.1.3:8080*",
    ] {
        assert!(web_line.contains(part), "{part} missing: {web_line}");
    }

    // Problems go to stderr; a missing --manifests is an error.
    let dir = Scratch::new("cli-render");
    let bad = dir.write(
        "bad.yaml",
        "apiVersion: v1\nkind: Service\nmetadata: {name: broken, namespace: default}\nspec:\n  clusterIP: 10.96.0.99\n  ports: [{port: 99999}]\n",
    );
    let (out, err) = ok(&[
        "render",
        "--manifests",
        bad.to_str().unwrap(),
        "--hostname-override",
        "n",
    ]);
    assert!(err.contains("warning:") && err.contains("broken"), "{err}");
    assert!(serde_json::from_str::<serde_json::Value>(&out).is_ok());
    let err = fails(&["render"]);
    assert!(err.contains("render needs --manifests PATH"), "{err}");
}

#[test]
fn cleanup_exits_zero() {
    if !kproxy_tests::netns::require_root() {
        return;
    }
    // In a private network namespace with a private bpffs path, so a cleanup that does remove
    // kernel state never touches the machine's.
    let ns = kproxy_tests::netns::Netns::new("cli-cleanup").unwrap();
    let dir = Scratch::new("cli-cleanup");
    let bin = kproxy_bin().unwrap();
    for args in [vec!["cleanup"], vec!["--cleanup"]] {
        let out = ns
            .command(&bin)
            .args(&args)
            .args([
                "--bpffs",
                dir.0.to_str().unwrap(),
                "--hostname-override",
                "n",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
