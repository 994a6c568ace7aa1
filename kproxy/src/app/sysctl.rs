//! Node sysctls kube-proxy sets or checks, shared by the iptables and IPVS datapaths:
//! conntrack limits and timeouts (upstream cmd/kube-proxy/app/server_linux.go + conntrack.go,
//! pkg/proxy/conntrack/sysctls.go), `route_localnet` for localhost NodePorts (iptables
//! proxier) and the `bridge-nf-call-iptables` check.
//!
//! Split in three: `desired` (config + CPU count → the values upstream wants, pure),
//! `plan` (desired + current values + whether /sys is writable → the writes, pure) and
//! [`apply`] (reads and writes files under a [`Host`]'s roots, logs every change as
//! `old → new`). A [`Host`] can point at a fake tree, so the I/O is tested without touching
//! the machine's global settings.
//!
//! Upstream's rules, followed here:
//! - `nf_conntrack_max`: only when `maxPerCore > 0`: `max(maxPerCore × CPUs, min)`; CPUs
//!   from `/sys/devices/system/cpu/online` (the host's count, not the cpuset's; upstream
//!   reads sysfs topology for the same reason), else the scheduler's count. Written when it
//!   differs from the current value (so it may also lower it, as upstream).
//! - `/sys/module/nf_conntrack/parameters/hashsize`: raised to `max/4` when it is smaller,
//!   never lowered; skipped with a warning when the first sysfs mount is not `rw` (upstream's
//!   `errReadOnlySysFS`, the Docker read-only /sys case). It is a module parameter, global to
//!   the machine, and the kernel refuses writes from outside the initial network namespace.
//! - `nf_conntrack_tcp_timeout_established`, `…_close_wait`, `nf_conntrack_udp_timeout`,
//!   `…_udp_timeout_stream`: whole seconds of the configured duration, each only when > 0,
//!   written when different. `nf_conntrack_tcp_be_liberal = 1` only when configured true.
//! - `net.ipv4.conf.all.route_localnet = 1` when the IPv4 datapath serves NodePorts on
//!   localhost (upstream: iptables `localhostNodePorts` and nodePortAddresses that include
//!   127.0.0.1).
//! - `net.bridge.bridge-nf-call-iptables`: only checked; a warning when it exists and is not
//!   1 (pods on a Linux bridge would bypass the rules). A missing file (no br_netfilter) is
//!   logged at debug, as upstream ignores it.
//!
//! Knowingly different: upstream fails kube-proxy's startup when a conntrack write fails;
//! [`apply`] reports every failure in [`SysctlReport::errors`] and lets the caller decide
//! (the agent should treat them as fatal to match upstream, or log them).

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

/// `KubeProxyConntrackConfiguration` (upstream semantics: zero means "leave the kernel's
/// value"): the resolved configuration's own type.
pub use crate::config::ConntrackConfig;

impl ConntrackConfig {
    /// Upstream's defaults (v1alpha1 defaults.go): 32768 per core, min 131072, established
    /// 24 h, close-wait 1 h, not liberal, UDP timeouts left alone.
    pub fn upstream_defaults() -> Self {
        ConntrackConfig {
            max_per_core: 32 * 1024,
            min: 128 * 1024,
            tcp_established_timeout: Duration::from_secs(24 * 3600),
            tcp_close_wait_timeout: Duration::from_secs(3600),
            tcp_be_liberal: false,
            udp_timeout: Duration::ZERO,
            udp_stream_timeout: Duration::ZERO,
        }
    }
}

/// Everything that decides which node sysctls kproxy sets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SysctlConfig {
    pub conntrack: ConntrackConfig,
    /// The IPv4 datapath accepts NodePort traffic to 127.0.0.1 (needs `route_localnet`).
    pub localhost_node_ports: bool,
}

/// Where a value lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Target {
    /// A sysctl by its dotted name (`net.netfilter.nf_conntrack_max`).
    Sysctl(&'static str),
    /// `/sys/module/nf_conntrack/parameters/hashsize`.
    ConntrackHashsize,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Sysctl(name) => f.write_str(name),
            Target::ConntrackHashsize => f.write_str("nf_conntrack hashsize"),
        }
    }
}

pub const CONNTRACK_MAX: Target = Target::Sysctl("net.netfilter.nf_conntrack_max");
pub const TCP_ESTABLISHED: Target =
    Target::Sysctl("net.netfilter.nf_conntrack_tcp_timeout_established");
pub const TCP_CLOSE_WAIT: Target =
    Target::Sysctl("net.netfilter.nf_conntrack_tcp_timeout_close_wait");
pub const TCP_BE_LIBERAL: Target = Target::Sysctl("net.netfilter.nf_conntrack_tcp_be_liberal");
pub const UDP_TIMEOUT: Target = Target::Sysctl("net.netfilter.nf_conntrack_udp_timeout");
pub const UDP_STREAM_TIMEOUT: Target =
    Target::Sysctl("net.netfilter.nf_conntrack_udp_timeout_stream");
pub const ROUTE_LOCALNET: Target = Target::Sysctl("net.ipv4.conf.all.route_localnet");
pub const BRIDGE_NF_CALL_IPTABLES: Target = Target::Sysctl("net.bridge.bridge-nf-call-iptables");

/// How a desired value is reconciled with the current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Rule {
    /// Write when different.
    Exactly,
    /// Write only when the current value is smaller (hashsize).
    AtLeast,
}

/// One value upstream wants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct Desired {
    pub target: Target,
    pub value: i64,
    pub rule: Rule,
}

/// Upstream's `getConntrackMax`: `None` when `maxPerCore` is 0.
pub(crate) fn conntrack_max(cfg: &ConntrackConfig, cpus: usize) -> Option<i64> {
    if cfg.max_per_core == 0 {
        return None;
    }
    let scaled = i64::from(cfg.max_per_core) * cpus as i64;
    Some(scaled.max(i64::from(cfg.min)))
}

/// Whole seconds (as Go's `int(d / time.Second)`), `None` when that is 0.
fn secs(d: Duration) -> Option<i64> {
    Some(d.as_secs() as i64).filter(|s| *s > 0)
}

/// The values upstream sets for `cfg` on a machine with `cpus` CPUs, in the order it sets
/// them.
pub(crate) fn desired(cfg: &SysctlConfig, cpus: usize) -> Vec<Desired> {
    let exactly = |target, value| Desired {
        target,
        value,
        rule: Rule::Exactly,
    };
    let ct = &cfg.conntrack;
    let mut out = vec![];
    if let Some(max) = conntrack_max(ct, cpus) {
        out.push(exactly(CONNTRACK_MAX, max));
        out.push(Desired {
            target: Target::ConntrackHashsize,
            value: max / 4,
            rule: Rule::AtLeast,
        });
    }
    if let Some(s) = secs(ct.tcp_established_timeout) {
        out.push(exactly(TCP_ESTABLISHED, s));
    }
    if let Some(s) = secs(ct.tcp_close_wait_timeout) {
        out.push(exactly(TCP_CLOSE_WAIT, s));
    }
    if ct.tcp_be_liberal {
        out.push(exactly(TCP_BE_LIBERAL, 1));
    }
    if let Some(s) = secs(ct.udp_timeout) {
        out.push(exactly(UDP_TIMEOUT, s));
    }
    if let Some(s) = secs(ct.udp_stream_timeout) {
        out.push(exactly(UDP_STREAM_TIMEOUT, s));
    }
    if cfg.localhost_node_ports {
        out.push(exactly(ROUTE_LOCALNET, 1));
    }
    out
}

/// One write the plan makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Change {
    pub target: Target,
    /// `None` when the current value could not be read.
    pub old: Option<i64>,
    pub new: i64,
}

/// What `plan` decided.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct SysctlPlan {
    pub changes: Vec<Change>,
    /// Already as wanted: (target, current value).
    pub unchanged: Vec<(Target, i64)>,
    /// Not written, with the reason (logged as a warning).
    pub skipped: Vec<(Target, String)>,
}

/// Decides the writes: `current` gives each target's value (`None`: unreadable),
/// `sysfs_writable` whether the first sysfs mount is `rw`.
pub(crate) fn plan(
    desired: &[Desired],
    current: impl Fn(Target) -> Option<i64>,
    sysfs_writable: bool,
) -> SysctlPlan {
    let mut p = SysctlPlan::default();
    for d in desired {
        let old = current(d.target);
        let ok = match (d.rule, old) {
            (Rule::Exactly, Some(v)) => v == d.value,
            (Rule::AtLeast, Some(v)) => v >= d.value,
            (_, None) => false,
        };
        if ok {
            p.unchanged.push((d.target, old.unwrap_or(d.value)));
            continue;
        }
        if d.target == Target::ConntrackHashsize {
            if old.is_none() {
                p.skipped.push((
                    d.target,
                    "cannot read the current hashsize (nf_conntrack not loaded?)".into(),
                ));
                continue;
            }
            if !sysfs_writable {
                p.skipped.push((
                    d.target,
                    format!(
                        "/sys is read-only: cannot raise it to {} (conntrack limits may be too low; with Docker see moby issue 24000)",
                        d.value
                    ),
                ));
                continue;
            }
        }
        p.changes.push(Change {
            target: d.target,
            old,
            new: d.value,
        });
    }
    p
}

/// Upstream's `isSysFSWritable` on `/proc/mounts` text: the first `sysfs` mount's first
/// option is `rw`. `None` when no sysfs is mounted.
pub(crate) fn sysfs_writable(mounts: &str) -> Option<bool> {
    mounts.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        (f.get(2) == Some(&"sysfs"))
            .then(|| f.get(3).and_then(|o| o.split(',').next()) == Some("rw"))
    })
}

/// The number of CPUs in a sysfs CPU list (`0-3,6,8-9` → 7). `None` when malformed or empty.
pub(crate) fn parse_cpu_list(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                b.checked_sub(a)? + 1
            }
            None => {
                part.parse::<usize>().ok()?;
                1
            }
        };
    }
    (n > 0).then_some(n)
}

/// The bridge check's verdict: a warning text when the value is readable and not 1.
pub(crate) fn bridge_check(value: Option<i64>) -> Option<String> {
    match value {
        Some(1) | None => None,
        Some(v) => Some(format!(
            "{BRIDGE_NF_CALL_IPTABLES} is {v}, not 1: traffic between pods on a Linux bridge bypasses the proxy rules (load br_netfilter and set it to 1 if pods use a bridge)"
        )),
    }
}

/// Where [`apply`] reads and writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// `/proc/sys` (per network namespace for `net.*`: the calling thread's).
    pub proc_sys: PathBuf,
    /// `/sys/module/nf_conntrack/parameters/hashsize`.
    pub hashsize: PathBuf,
    /// `/proc/self/mounts`.
    pub mounts: PathBuf,
    /// `/sys/devices/system/cpu/online`.
    pub cpu_online: PathBuf,
}

impl Host {
    /// The real machine.
    pub fn real() -> Host {
        Host::rooted(Path::new("/"))
    }

    /// The same layout below `root` (a fake tree for tests).
    pub fn rooted(root: &Path) -> Host {
        Host {
            proc_sys: root.join("proc/sys"),
            hashsize: root.join("sys/module/nf_conntrack/parameters/hashsize"),
            mounts: root.join("proc/self/mounts"),
            cpu_online: root.join("sys/devices/system/cpu/online"),
        }
    }

    pub fn path(&self, target: Target) -> PathBuf {
        match target {
            Target::Sysctl(name) => self.proc_sys.join(name.replace('.', "/")),
            Target::ConntrackHashsize => self.hashsize.clone(),
        }
    }

    pub fn read(&self, target: Target) -> io::Result<i64> {
        let path = self.path(target);
        let text = fs::read_to_string(&path)?;
        text.trim().parse().map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{}: {:?} is not an integer: {e}",
                    path.display(),
                    text.trim()
                ),
            )
        })
    }

    pub(crate) fn write(&self, target: Target, value: i64) -> io::Result<()> {
        fs::write(self.path(target), value.to_string())
    }

    /// CPUs of the machine (see the module docs).
    pub(crate) fn cpus(&self) -> usize {
        fs::read_to_string(&self.cpu_online)
            .ok()
            .and_then(|s| parse_cpu_list(&s))
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
    }
}

/// A write that failed.
#[derive(Debug, thiserror::Error)]
#[error("setting {target} to {value} (was {old:?}): {source}")]
pub struct SysctlError {
    pub target: Target,
    pub old: Option<i64>,
    pub value: i64,
    #[source]
    pub source: io::Error,
}

/// What [`apply`] did.
#[derive(Debug, Default)]
pub struct SysctlReport {
    pub plan: SysctlPlan,
    /// The changes that were written.
    pub written: Vec<Change>,
    pub errors: Vec<SysctlError>,
    /// The bridge check's warning, if any.
    pub bridge_warning: Option<String>,
}

/// Sets what `cfg` asks for on `host` (sysctls of the calling thread's network namespace),
/// logging every change as `old → new` and every skip as a warning.
pub fn apply(cfg: &SysctlConfig, host: &Host) -> SysctlReport {
    let cpus = host.cpus();
    let want = desired(cfg, cpus);
    let writable = fs::read_to_string(&host.mounts)
        .ok()
        .and_then(|m| sysfs_writable(&m))
        .unwrap_or(false);
    let plan = plan(&want, |t| host.read(t).ok(), writable);
    let mut report = SysctlReport::default();
    for (target, value) in &plan.unchanged {
        tracing::debug!(%target, value, "sysctl already set");
    }
    for (target, why) in &plan.skipped {
        tracing::warn!(%target, "not set: {why}");
    }
    for c in &plan.changes {
        match host.write(c.target, c.new) {
            Ok(()) => {
                let old = c.old.map_or_else(|| "?".to_string(), |v| v.to_string());
                tracing::info!(
                    sysctl = %c.target,
                    cpus,
                    "sysctl changed {}: {old} → {}",
                    c.target,
                    c.new
                );
                report.written.push(*c);
            }
            Err(source) => {
                let e = SysctlError {
                    target: c.target,
                    old: c.old,
                    value: c.new,
                    source,
                };
                tracing::error!("{e}");
                report.errors.push(e);
            }
        }
    }
    match host.read(BRIDGE_NF_CALL_IPTABLES) {
        Ok(v) => {
            report.bridge_warning = bridge_check(Some(v));
            if let Some(w) = &report.bridge_warning {
                tracing::warn!("{w}");
            }
        }
        Err(e) => {
            tracing::debug!("{BRIDGE_NF_CALL_IPTABLES} not readable ({e}): br_netfilter not loaded")
        }
    }
    report.plan = plan;
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    fn defaults() -> SysctlConfig {
        SysctlConfig {
            conntrack: ConntrackConfig::upstream_defaults(),
            localhost_node_ports: false,
        }
    }

    #[test]
    fn conntrack_max_scales_by_cpus_with_a_floor() {
        let cfg = ConntrackConfig::upstream_defaults();
        assert_eq!(conntrack_max(&cfg, 2), Some(131072), "floor wins");
        assert_eq!(conntrack_max(&cfg, 8), Some(262144), "scaled wins");
        let zero = ConntrackConfig {
            max_per_core: 0,
            ..cfg.clone()
        };
        assert_eq!(
            conntrack_max(&zero, 8),
            None,
            "maxPerCore 0 leaves it alone"
        );
        let no_min = ConntrackConfig {
            max_per_core: 10,
            min: 0,
            ..cfg
        };
        assert_eq!(conntrack_max(&no_min, 3), Some(30));
    }

    #[test]
    fn desired_values_follow_the_config() {
        let d = desired(&defaults(), 8);
        let got: Vec<(Target, i64, Rule)> = d.iter().map(|d| (d.target, d.value, d.rule)).collect();
        assert_eq!(
            got,
            vec![
                (CONNTRACK_MAX, 262144, Rule::Exactly),
                (Target::ConntrackHashsize, 65536, Rule::AtLeast),
                (TCP_ESTABLISHED, 86400, Rule::Exactly),
                (TCP_CLOSE_WAIT, 3600, Rule::Exactly),
            ]
        );
        let all = SysctlConfig {
            conntrack: ConntrackConfig {
                max_per_core: 0,
                min: 0,
                tcp_established_timeout: Duration::from_millis(999), // < 1 s: unset
                tcp_close_wait_timeout: Duration::ZERO,
                tcp_be_liberal: true,
                udp_timeout: Duration::from_secs(30),
                udp_stream_timeout: Duration::from_millis(120_500),
            },
            localhost_node_ports: true,
        };
        let got: Vec<(Target, i64)> = desired(&all, 8)
            .iter()
            .map(|d| (d.target, d.value))
            .collect();
        assert_eq!(
            got,
            vec![
                (TCP_BE_LIBERAL, 1),
                (UDP_TIMEOUT, 30),
                (UDP_STREAM_TIMEOUT, 120),
                (ROUTE_LOCALNET, 1),
            ]
        );
    }

    #[test]
    fn plan_writes_differences_raises_hashsize_only_and_respects_read_only_sysfs() {
        let d = desired(&defaults(), 8);
        let current = |max: i64, hash: i64| {
            move |t: Target| match t {
                CONNTRACK_MAX => Some(max),
                Target::ConntrackHashsize => Some(hash),
                TCP_ESTABLISHED => Some(432000),
                TCP_CLOSE_WAIT => Some(3600),
                _ => None,
            }
        };
        let p = plan(&d, current(65536, 16384), true);
        assert_eq!(
            p.changes,
            vec![
                Change {
                    target: CONNTRACK_MAX,
                    old: Some(65536),
                    new: 262144
                },
                Change {
                    target: Target::ConntrackHashsize,
                    old: Some(16384),
                    new: 65536
                },
                Change {
                    target: TCP_ESTABLISHED,
                    old: Some(432000),
                    new: 86400
                },
            ]
        );
        assert_eq!(p.unchanged, vec![(TCP_CLOSE_WAIT, 3600)]);
        // A bigger max is lowered (upstream writes when different); a bigger hashsize stays.
        let p = plan(&d, current(1 << 20, 1 << 18), true);
        assert_eq!(
            p.changes[0],
            Change {
                target: CONNTRACK_MAX,
                old: Some(1 << 20),
                new: 262144
            }
        );
        assert!(p.unchanged.contains(&(Target::ConntrackHashsize, 1 << 18)));
        // Read-only /sys: hashsize skipped with the reason, the rest still written.
        let p = plan(&d, current(65536, 16384), false);
        assert_eq!(p.skipped.len(), 1);
        assert_eq!(p.skipped[0].0, Target::ConntrackHashsize);
        assert!(p.skipped[0].1.contains("read-only"), "{:?}", p.skipped);
        assert_eq!(p.changes.len(), 2);
        // Unreadable sysctl: written anyway (old unknown); unreadable hashsize: skipped.
        let p = plan(&d, |_| None, true);
        assert_eq!(p.changes.len(), 3);
        assert!(p.changes.iter().all(|c| c.old.is_none()));
        assert_eq!(p.skipped[0].0, Target::ConntrackHashsize);
    }

    #[test]
    fn sysfs_mount_and_cpu_list_parsing() {
        let rw = "proc /proc proc rw,nosuid 0 0\nsysfs /sys sysfs rw,nosuid,nodev 0 0\n";
        let ro = "sysfs /sys sysfs ro,nosuid,nodev 0 0\nsysfs /other sysfs rw 0 0\n";
        assert_eq!(sysfs_writable(rw), Some(true));
        assert_eq!(
            sysfs_writable(ro),
            Some(false),
            "the first sysfs mount decides"
        );
        assert_eq!(sysfs_writable("proc /proc proc rw 0 0\n"), None);
        assert_eq!(parse_cpu_list("0-3,6,8-9\n"), Some(7));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list(""), None);
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("a-b"), None);
    }

    #[test]
    fn bridge_check_warns_only_on_a_readable_non_one_value() {
        assert_eq!(bridge_check(Some(1)), None);
        assert_eq!(bridge_check(None), None);
        let w = bridge_check(Some(0)).unwrap();
        assert!(w.contains("net.bridge.bridge-nf-call-iptables is 0"), "{w}");
    }
}
