//! Everything about "which mode": which can run here ([`probe`], in [`DETECT_ORDER`]), which
//! one's state is here ([`Evidence`]: the agent's start-up cleanup and `kproxy inspect` both ask
//! it), choosing one ([`select`]) and removing the others' leftovers ([`cleanup_others`],
//! [`cleanup_all`]).
//!
//! Probes (`mode: ""`) try what the mode needs for real, then remove what they created:
//!
//! - **ebpf**: the BPF object is built in; the kernel has BTF (`/sys/kernel/btf/vmlinux`);
//!   the object loads with its maps (under a throwaway pin directory of the configured
//!   bpffs), the verifier accepts the socket-LB `connect4` program and the TC ingress
//!   program, and `connect4` attaches to a throwaway child cgroup of the socket-LB cgroup;
//!   that cgroup is on cgroup2 and shows the host's hierarchy, not a private cgroup
//!   namespace's own ([`crate::dataplane::ebpf::socket_lb::cgroup`]).
//!   Without CAP_BPF/CAP_SYS_ADMIN (or with an old kernel) one of these fails and says why.
//! - **nftables**: the kernel is at least 5.13 (upstream's minimum for its nftables mode),
//!   `nft` runs, and a throwaway table `ip kproxy-probe-<pid>` can be created and deleted.
//! - **ipvs**: [`crate::dataplane::ipvs::usable`] (the IPVS generic-netlink family resolves, ipset ≥ 6).
//!   Choosing it logs upstream's deprecation warning.
//! - **iptables**: `iptables -t nat -S` works with one of the nft / legacy binaries (needs
//!   CAP_NET_ADMIN).
//!
//! [`select`] runs them in [`DETECT_ORDER`] and logs why each rejected mode was rejected.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use aya::programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SchedClassifier};
use kproxy_common::ct::PROG_TC_INGRESS;
use kproxy_common::ct6::PROG_TC6_INGRESS;
use kproxy_common::layout::LAYOUTS;
use kproxy_common::sock::{PROG_SOCK_CONNECT4, PROG_SOCK_RELEASE};

use anyhow::{Context, bail};
use ipnet::IpNet;
use tracing::{info, warn};

use super::build::{build_with_resync, restore_binary};
use crate::config::{ModeChoice, ProxyConfig};
use crate::dataplane::ebpf::object::{self, LoadOptions};
use crate::dataplane::iptables::exec::{ExecIptables, Flavor, Runner};
use crate::dataplane::iptables::{self as ipt};
use crate::dataplane::ipvs as ipvs_mod;
use crate::dataplane::nftables::kernel::NftRunner;
use crate::dataplane::{Dataplane, ProxyMode};
use crate::model::IpFamily;
use crate::observe::metrics::Metrics;
use crate::sync::SyncRequester;

/// Whether `mode` can run here; `Err` says why not.
pub fn probe(mode: ProxyMode, cfg: &ProxyConfig) -> Result<(), String> {
    match mode {
        ProxyMode::Ebpf => probe_ebpf(&cfg.bpf.bpffs, cfg.bpf.cgroup.as_deref()),
        ProxyMode::Ipvs => crate::dataplane::ipvs::usable(),
        ProxyMode::Iptables => probe_iptables(),
        ProxyMode::Nftables => probe_nftables(),
    }
}

/// The order `mode: ""` tries the modes in (upstream's empty mode means iptables; kproxy
/// prefers its eBPF datapath, then nftables, upstream's recommended mode).
pub const DETECT_ORDER: [ProxyMode; 4] = [
    ProxyMode::Ebpf,
    ProxyMode::Nftables,
    ProxyMode::Ipvs,
    ProxyMode::Iptables,
];

/// Upstream's minimum kernel for the nftables mode.
pub const NFTABLES_MIN_KERNEL: (u32, u32) = (5, 13);

/// Upstream's warning when the ipvs mode is used (kube-proxy ≥ 1.35).
pub const IPVS_DEPRECATION: &str = "The ipvs proxier is now deprecated and may be removed in a future release. Please use 'nftables' instead.";

/// Builds the forced mode, or the first mode of [`DETECT_ORDER`] whose probe
/// ([`probe`]) passes and that builds; logs why each earlier mode was
/// rejected. Removes what the other modes (and upstream kube-proxy) left
/// ([`build_cleaned`]). Returns the datapath and the metrics it reports into; the datapath
/// asks `resync` for syncs it needs on its own (hand it to the sync loop too).
/// `node_pod_cidrs` as for [`super::build::build`].
pub fn select(
    choice: ModeChoice,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    resync: &SyncRequester,
) -> anyhow::Result<(Box<dyn Dataplane>, Metrics)> {
    let attempt = |mode: ProxyMode| -> anyhow::Result<(Box<dyn Dataplane>, Metrics)> {
        let metrics = Metrics::new(mode);
        let dp = build_cleaned(mode, cfg, node_pod_cidrs, &metrics, resync)?;
        Ok((dp, metrics))
    };
    match choice {
        ModeChoice::Forced(mode) => attempt(mode).with_context(|| format!("--proxy-mode={mode}")),
        ModeChoice::Detect => {
            let mut reasons = Vec::new();
            for mode in DETECT_ORDER {
                if let Err(why) = probe(mode, cfg) {
                    warn!(%mode, "proxy mode rejected: {why}");
                    reasons.push(format!("{mode}: {why}"));
                    continue;
                }
                match attempt(mode) {
                    Ok(r) => {
                        info!(%mode, "proxy mode detected");
                        return Ok(r);
                    }
                    Err(e) => {
                        warn!(%mode, "proxy mode rejected: {e:#}");
                        reasons.push(format!("{mode}: {e:#}"));
                    }
                }
            }
            bail!("no proxy mode can run here ({})", reasons.join("; "))
        }
    }
}

/// Builds `mode`'s datapath, reporting into `metrics`, after removing what the other modes
/// left ([`cleanup_others`], as upstream's `CleanupLeftovers` before its proxier is built).
pub fn build_cleaned(
    mode: ProxyMode,
    cfg: &ProxyConfig,
    node_pod_cidrs: &[IpNet],
    metrics: &Metrics,
    resync: &SyncRequester,
) -> anyhow::Result<Box<dyn Dataplane>> {
    if mode == ProxyMode::Ipvs {
        // Upstream logs it at error level (and records an `IPVSDeprecation` event).
        tracing::error!("{IPVS_DEPRECATION}");
    }
    cleanup_others(mode, cfg);
    build_with_resync(mode, cfg, node_pod_cidrs, Some(metrics), Some(resync))
}

/// One cleanup step's outcome, for the log and [`cleanup_all`]'s error.
fn step(errors: &mut Vec<String>, what: &str, r: Result<(), String>) {
    match r {
        Ok(()) => tracing::debug!("cleanup: {what} done"),
        Err(e) => {
            warn!("cleanup: {what}: {e}");
            errors.push(format!("{what}: {e}"));
        }
    }
}

fn cleanup_ebpf(cfg: &ProxyConfig, errors: &mut Vec<String>) {
    let dir = cfg.bpf.bpffs.join("kproxy");
    if dir.exists() {
        step(
            errors,
            "eBPF pins",
            crate::dataplane::ebpf::service_maps::cleanup_pins(&cfg.bpf.bpffs)
                .map_err(|e| e.to_string()),
        );
    }
}

/// Whether `bin --version` runs.
pub(super) fn have(bin: &str) -> bool {
    std::process::Command::new(bin)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn cleanup_iptables(errors: &mut Vec<String>) {
    for family in [IpFamily::V4, IpFamily::V6] {
        for flavor in [Flavor::Nft, Flavor::Legacy] {
            let bin = format!(
                "{}-{}",
                if family == IpFamily::V4 {
                    "iptables"
                } else {
                    "ip6tables"
                },
                if flavor == Flavor::Nft {
                    "nft"
                } else {
                    "legacy"
                }
            );
            if !have(&bin) {
                continue;
            }
            let mut b = ExecIptables::new(family, flavor, Runner { netns: None });
            step(
                errors,
                &format!("iptables rules ({bin})"),
                ipt::cleanup::cleanup_leftovers(&mut b).map_err(|e| e.to_string()),
            );
        }
    }
}

/// The nftables mode's (kproxy's or upstream kube-proxy's) `ip kube-proxy` / `ip6
/// kube-proxy` tables.
fn cleanup_nft(errors: &mut Vec<String>) {
    if have("nft") {
        step(
            errors,
            "nft tables ip/ip6 kube-proxy",
            crate::dataplane::nftables::dataplane::cleanup_tables(&NftRunner::default()),
        );
    }
}

fn cleanup_ipvs(cfg: &ProxyConfig, errors: &mut Vec<String>) {
    // Virtual services (upstream flushes IPVS), except those in ipvs.excludeCIDRs.
    if let Ok(mut h) = ipvs_mod::genl::IpvsHandle::open()
        && h.version().is_ok()
    {
        let r = h.services().map_err(|e| e.to_string()).and_then(|svcs| {
            for s in svcs {
                if cfg
                    .ipvs
                    .exclude_cidrs
                    .iter()
                    .any(|n| n.contains(&s.key.addr))
                {
                    continue;
                }
                h.delete_service(&s.key).map_err(|e| e.to_string())?;
            }
            Ok(())
        });
        step(errors, "IPVS virtual services", r);
    }
    match ipvs_mod::rtnl::Rtnl::open() {
        Ok(mut rtnl) => {
            let dev = ipvs_mod::config::DEFAULT_DUMMY_DEVICE;
            let r = rtnl.link_index(dev).and_then(|i| match i {
                Some(i) => rtnl.delete_link(i),
                None => Ok(()),
            });
            step(errors, dev, r.map_err(|e| e.to_string()));
        }
        Err(e) => step(errors, "rtnetlink", Err(e.to_string())),
    }
    let tools = match ipvs_mod::netfilter::Tools::here() {
        Ok(t) => t,
        Err(e) => return step(errors, "IPVS iptables rules and ipsets", Err(e.to_string())),
    };
    if !have("ipset") {
        return;
    }
    for family in [IpFamily::V4, IpFamily::V6] {
        for flavor in [Flavor::Nft, Flavor::Legacy] {
            let restore = restore_binary(family, flavor);
            if !have(&ipvs_mod::netfilter::iptables_binary(&restore)) {
                continue;
            }
            step(
                errors,
                &format!("IPVS iptables rules and ipsets ({restore})"),
                ipvs_mod::netfilter::cleanup(&tools, family, &restore),
            );
        }
    }
}

/// Which modes' kernel state exists here, read once: what start-up cleanup and `kproxy inspect`
/// decide by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evidence {
    /// The eBPF mode's pinned service map under `<bpffs>/kproxy/`.
    pub ebpf: bool,
    /// The IPVS mode's dummy device (`kube-ipvs0`) or its ipsets.
    pub ipvs: bool,
    /// Per-service chains (`KUBE-SVC-*`, `KUBE-SEP-*`) of the iptables mode (kproxy's or
    /// upstream's), in either backend or family. The IPVS mode shares `KUBE-SERVICES`, not these.
    pub iptables: bool,
    /// A `KUBE-SERVICES` nat chain (iptables or IPVS mode, also with no service chains).
    pub kube_services: bool,
}

impl Evidence {
    /// Reads the kernel (bpffs, rtnetlink, `ipset list -n`, `iptables-save -t nat`).
    pub fn here(cfg: &ProxyConfig) -> Self {
        let nat = nat_tables();
        let declares = |prefixes: &[&str]| {
            nat.lines()
                .any(|l| prefixes.iter().any(|p| l.starts_with(p)))
        };
        Evidence {
            ebpf: cfg
                .bpf
                .bpffs
                .join("kproxy")
                .join(kproxy_common::service::MAP_SERVICES)
                .exists(),
            ipvs: ipvs_mode_evidence(),
            iptables: declares(&[":KUBE-SVC-", ":KUBE-SEP-"]),
            kube_services: declares(&[":KUBE-SERVICES "]),
        }
    }

    /// The mode whose datapath is programmed here, preferring ebpf, then ipvs, then iptables.
    pub fn programmed(&self) -> Option<ProxyMode> {
        if self.ebpf {
            Some(ProxyMode::Ebpf)
        } else if self.ipvs {
            Some(ProxyMode::Ipvs)
        } else if self.iptables || self.kube_services {
            Some(ProxyMode::Iptables)
        } else {
            None
        }
    }
}

fn output_of(bin: &str, args: &[&str]) -> String {
    std::process::Command::new(bin)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// `iptables-save -t nat` of both backends and families, read once for every check.
fn nat_tables() -> String {
    [
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
        "ip6tables-legacy-save",
    ]
    .iter()
    .map(|bin| output_of(bin, &["-t", "nat"]))
    .collect()
}

fn ipvs_mode_evidence() -> bool {
    let dummy = ipvs_mod::rtnl::Rtnl::open()
        .and_then(|mut r| r.link_index(ipvs_mod::config::DEFAULT_DUMMY_DEVICE))
        .is_ok_and(|i| i.is_some());
    dummy
        || output_of("ipset", &["list", "-n"])
            .lines()
            .any(|l| l.starts_with("KUBE-CLUSTER-IP"))
}

/// Removes what the modes other than `mode` (and upstream kube-proxy) left, as upstream's
/// `CleanupLeftovers` at start-up. The `ip`/`ip6 kube-proxy` nftables tables are removed
/// in every mode but nftables (whose tables they are). iptables and ipvs modes share chain names
/// (`KUBE-SERVICES`, …), so one of them removes the other's rules only when that mode's own
/// objects show it ran (per-service chains; `kube-ipvs0` or its ipsets): a restart in the same
/// mode never flushes live rules. The IPVS mode's leftovers (virtual services, `kube-ipvs0`,
/// ipsets) are removed only when `kube-ipvs0` or its ipsets exist, in every other mode: IPVS
/// may serve something else on the host. Failures are logged; they never stop the start.
pub fn cleanup_others(mode: ProxyMode, cfg: &ProxyConfig) {
    let mut errors = vec![];
    if mode != ProxyMode::Ebpf {
        cleanup_ebpf(cfg, &mut errors);
    }
    // The ebpf and nftables modes share no chain with iptables: its rules always go (as
    // upstream's nftables mode removes the iptables mode's leftovers), so only the ipvs mode
    // reads the nat tables for the iptables mode's evidence.
    let iptables = match mode {
        ProxyMode::Iptables => false,
        ProxyMode::Ebpf | ProxyMode::Nftables => true,
        ProxyMode::Ipvs => Evidence::here(cfg).iptables,
    };
    // IPVS may serve others on this host: its services are flushed only when kube-proxy's
    // ipvs mode demonstrably ran here.
    let ipvs = mode != ProxyMode::Ipvs && ipvs_mode_evidence();
    match (iptables, ipvs) {
        (true, true) => {
            info!(%mode, "removing the iptables and ipvs modes' leftovers");
            cleanup_netfilter_modes(cfg, &mut errors);
        }
        (true, false) => {
            info!(%mode, "removing the iptables mode's leftovers");
            cleanup_iptables(&mut errors);
        }
        (false, true) => {
            info!(%mode, "removing the ipvs mode's leftovers");
            cleanup_ipvs(cfg, &mut errors);
        }
        (false, false) => {}
    }
    if mode != ProxyMode::Nftables {
        cleanup_nft(&mut errors);
    }
}

/// Both netfilter modes' leftovers. They share chains (`KUBE-SERVICES`, `KUBE-MARK-MASQ`,
/// `KUBE-PROXY-FIREWALL`, …) that each one's rules keep in use, so nothing is deleted while
/// the other mode still jumps to it: the IPVS mode's rules are unhooked first (jumps deleted,
/// chains flushed), then the iptables mode's objects go, then the IPVS mode's chains, sets,
/// virtual services and device. A clean run logs no warning.
fn cleanup_netfilter_modes(cfg: &ProxyConfig, errors: &mut Vec<String>) {
    unhook_ipvs_rules();
    cleanup_iptables(errors);
    cleanup_ipvs(cfg, errors);
}

/// [`ipvs_mod::netfilter::unhook`] for every family and iptables backend present.
fn unhook_ipvs_rules() {
    let Ok(tools) = ipvs_mod::netfilter::Tools::here() else {
        return;
    };
    for family in [IpFamily::V4, IpFamily::V6] {
        for flavor in [Flavor::Nft, Flavor::Legacy] {
            let restore = restore_binary(family, flavor);
            if have(&ipvs_mod::netfilter::iptables_binary(&restore)) {
                ipvs_mod::netfilter::unhook(&tools, &restore);
            }
        }
    }
}

/// Removes everything any mode (and upstream kube-proxy) left in the kernel: eBPF pins
/// (maps, socket-LB and TC links), iptables rules of both backends and families, upstream's
/// `kube-proxy` nftables tables, IPVS virtual services, `kube-ipvs0`, the IPVS mode's ipsets
/// and rules. Every step runs; the error lists the ones that failed.
pub fn cleanup_all(cfg: &ProxyConfig) -> anyhow::Result<()> {
    let mut errors = vec![];
    cleanup_ebpf(cfg, &mut errors);
    cleanup_netfilter_modes(cfg, &mut errors);
    cleanup_nft(&mut errors);
    if errors.is_empty() {
        info!("cleanup: removed what every mode and kube-proxy left");
        Ok(())
    } else {
        bail!("cleanup incomplete: {}", errors.join("; "))
    }
}

/// Removes a directory on drop (a throwaway cgroup or pin directory).
struct TempDir {
    path: PathBuf,
    recursive: bool,
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if self.recursive {
            let _ = fs::remove_dir_all(&self.path);
        } else {
            let _ = fs::remove_dir(&self.path);
        }
    }
}

fn probe_ebpf(bpffs: &Path, cgroup: Option<&Path>) -> Result<(), String> {
    if !object::is_built() {
        return Err("this binary was built without the BPF object".into());
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err("the kernel has no BTF (/sys/kernel/btf/vmlinux missing)".into());
    }
    let cg_root = match cgroup {
        Some(p) => p.to_path_buf(),
        None => crate::dataplane::ebpf::loader::cgroup2_root()
            .ok_or("no cgroup2 mount for socket LB (pass --bpf-cgroup)")?,
    };
    crate::dataplane::ebpf::socket_lb::cgroup::check(&cg_root).map_err(|e| e.to_string())?;
    crate::dataplane::ebpf::loader::ensure_bpffs(bpffs).map_err(|e| e.to_string())?;
    let tag = format!("kproxy-probe-{}", std::process::id());
    let pins = TempDir {
        path: bpffs.join(&tag),
        recursive: true,
    };
    fs::create_dir_all(&pins.path).map_err(|e| format!("creating {}: {e}", pins.path.display()))?;
    // Every keyed map small: the probe only needs the verifier's verdict.
    let small = LAYOUTS
        .iter()
        .filter(|l| l.is_keyed())
        .map(|l| (l.name, 16));
    let mut ebpf = object::load(&LoadOptions {
        pin_dir: Some(&pins.path),
        max_entries: small.collect(),
    })
    .map_err(|e| format!("loading the BPF object: {}", object::error_chain(&e)))?;
    for name in [PROG_TC_INGRESS, PROG_TC6_INGRESS] {
        let tc: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or("the BPF object has no TC program")?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| e.to_string())?;
        tc.load()
            .map_err(|e| format!("the verifier rejected {name}: {}", object::error_chain(&e)))?;
    }
    // Attached beside connect4 (kernel ≥ 5.9); loading it checks the hook and its helpers.
    let release: &mut CgroupSock = ebpf
        .program_mut(PROG_SOCK_RELEASE)
        .ok_or("the BPF object has no socket-release program")?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())?;
    release.load().map_err(|e| {
        format!(
            "the verifier rejected {PROG_SOCK_RELEASE} (cgroup/sock_release): {}",
            object::error_chain(&e)
        )
    })?;
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(PROG_SOCK_CONNECT4)
        .ok_or("the BPF object has no socket-LB program")?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())?;
    prog.load().map_err(|e| {
        format!(
            "the verifier rejected {PROG_SOCK_CONNECT4}: {}",
            object::error_chain(&e)
        )
    })?;
    // The attach is tried on a fresh sub-cgroup, which holds no process. Where the cgroup2
    // mount is read-only (the DaemonSet mounts the host's hierarchy read-only) no sub-cgroup
    // can be made: the probe then attaches to the cgroup itself, for as long as one attach and
    // one detach take. Its maps are the probe's own, empty, so a connect() it sees meanwhile
    // goes through untouched; cgroup links add to the programs already there (a running
    // kproxy's during a rolling update) instead of replacing them.
    let cg = TempDir {
        path: cg_root.join(&tag),
        recursive: false,
    };
    let target = match fs::create_dir(&cg.path) {
        // A container's agent is pid 1: a probe that died left its directory behind.
        Ok(()) => cg.path.clone(),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => cg.path.clone(),
        Err(e) if e.raw_os_error() == Some(libc::EROFS) => cg_root.clone(),
        Err(e) => {
            return Err(format!(
                "creating a probe cgroup {}: {e}",
                cg.path.display()
            ));
        }
    };
    let file = fs::File::open(&target).map_err(|e| format!("{}: {e}", target.display()))?;
    let link = prog.attach(&file, CgroupAttachMode::Single).map_err(|e| {
        format!(
            "attaching socket LB to a cgroup: {}",
            object::error_chain(&e)
        )
    })?;
    prog.detach(link).map_err(|e| e.to_string())?;
    drop(ebpf);
    drop(cg);
    drop(pins);
    Ok(())
}

fn probe_iptables() -> Result<(), String> {
    let mut reasons = vec![];
    for bin in ["iptables-nft", "iptables-legacy", "iptables"] {
        match Command::new(bin)
            .args(["-w", "5", "-t", "nat", "-S"])
            .output()
        {
            Ok(o) if o.status.success() => return Ok(()),
            Ok(o) => reasons.push(format!(
                "{bin}: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            )),
            Err(e) => reasons.push(format!("{bin}: {e}")),
        }
    }
    Err(format!("no usable iptables ({})", reasons.join("; ")))
}

/// `major.minor` of a kernel release string (`6.1.0-18-amd64` → (6, 1)).
pub fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut it = release.trim().split(['.', '-']);
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

fn probe_nftables() -> Result<(), String> {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_err(|e| format!("reading the kernel version: {e}"))?;
    let version = kernel_version(&release)
        .ok_or_else(|| format!("cannot parse the kernel version {:?}", release.trim()))?;
    if version < NFTABLES_MIN_KERNEL {
        return Err(format!(
            "kernel {} is older than {}.{} (upstream's minimum for nftables mode)",
            release.trim(),
            NFTABLES_MIN_KERNEL.0,
            NFTABLES_MIN_KERNEL.1
        ));
    }
    let nft = NftRunner::default();
    nft.run(&["--version"], None)
        .map_err(|e| format!("nft is not usable: {e}"))?;
    let table = format!("kproxy-probe-{}", std::process::id());
    nft.run(&["add", "table", "ip", &table], None)
        .map_err(|e| format!("cannot create an nftables table: {e}"))?;
    nft.run(&["delete", "table", "ip", &table], None)
        .map_err(|e| format!("cannot delete the probe nftables table ip {table}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_parse_and_compare_with_the_nftables_minimum() {
        assert_eq!(kernel_version("6.1.0-18-amd64\n"), Some((6, 1)));
        assert_eq!(kernel_version("5.13"), Some((5, 13)));
        assert_eq!(kernel_version("garbage"), None);
        assert!(kernel_version("5.12.19").unwrap() < NFTABLES_MIN_KERNEL);
        assert!(kernel_version("5.13.0").unwrap() >= NFTABLES_MIN_KERNEL);
        assert!(kernel_version("6.0.1").unwrap() >= NFTABLES_MIN_KERNEL);
    }

    #[test]
    fn detection_tries_nftables_after_ebpf_and_before_ipvs() {
        assert_eq!(
            DETECT_ORDER,
            [
                ProxyMode::Ebpf,
                ProxyMode::Nftables,
                ProxyMode::Ipvs,
                ProxyMode::Iptables
            ]
        );
    }
}
