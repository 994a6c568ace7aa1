//! The ebpf mode's face ([`ModeFace`]): usable when this binary carries the BPF object, the
//! kernel has BTF, the verifier accepts the programs and socket LB can attach to the cgroup
//! it would use; the datapath is [`EbpfDataplane`] from the `bpf:` section; its leftovers
//! are the pins under `<bpffs>/kproxy/` (maps and links).

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Context;
use aya::programs::{CgroupAttachMode, CgroupSock, CgroupSockAddr, SchedClassifier};
use kproxy_common::ct::PROG_TC_INGRESS;
use kproxy_common::ct6::PROG_TC6_INGRESS;
use kproxy_common::layout::LAYOUTS;
use kproxy_common::sock::{PROG_SOCK_CONNECT4, PROG_SOCK_RELEASE};

use crate::config::{ProxyConfig, SyncPeriods};
use crate::dataplane::face::{BuildContext, ModeFace, cleanup_step};
use crate::dataplane::inspect::{MapFill, Selected, ServiceReport};
use crate::dataplane::{Dataplane, ModeMetrics, ProxyMode};
use crate::model::{IpFamily, Snapshot};

use super::object::{self, LoadOptions};
use super::service_maps::{MapSizes, ServiceMapsConfig};
use super::{EbpfConfig, EbpfDataplane};

/// The ebpf mode.
pub(crate) struct Face;

/// The ebpf mode's configuration for `families`.
pub(crate) fn config(cfg: &ProxyConfig, families: &[IpFamily]) -> EbpfConfig {
    let size = |name: &str, default: u32| cfg.bpf.map_sizes.get(name).copied().unwrap_or(default);
    let d = MapSizes::default();
    let map_sizes = MapSizes {
        services: size("services", d.services),
        backend_slots: size("backendSlots", d.backend_slots),
        backends: size("backends", d.backends),
        affinity: size("affinity", d.affinity),
        source_ranges: size("sourceRanges", d.source_ranges),
        ct: size("ct", d.ct),
        sock_rev_nat: size("revNat", d.sock_rev_nat),
        maglev: size("maglev", d.maglev),
    };
    let mut timeouts = super::node_path::flows::Timeouts::default();
    if !cfg.conntrack.tcp_established_timeout.is_zero() {
        timeouts.tcp = cfg.conntrack.tcp_established_timeout;
    }
    if !cfg.conntrack.tcp_close_wait_timeout.is_zero() {
        timeouts.tcp_closing = cfg.conntrack.tcp_close_wait_timeout;
    }
    if !cfg.conntrack.udp_stream_timeout.is_zero() {
        timeouts.udp = cfg.conntrack.udp_stream_timeout;
    }
    // kproxy extensions (`bpf.conntrack`): the kernel's TIME_WAIT / CLOSE timeouts, which
    // upstream never sets, and the expiry period.
    timeouts.tcp_time_wait = cfg.bpf.ct_tcp_time_wait;
    timeouts.tcp_close = cfg.bpf.ct_tcp_close;
    timeouts.interval = cfg.bpf.ct_expiry_interval;
    EbpfConfig {
        ebpf: ServiceMapsConfig {
            families: families.to_vec(),
            map_sizes,
            bpffs: cfg.bpf.bpffs.clone(),
            cgroup: cfg.bpf.cgroup.clone(),
            lb_algorithm: cfg.bpf.lb_algorithm,
            maglev_table_size: cfg.bpf.maglev_table_size,
            full_sync_period: Face.sync_periods(cfg).sync_period,
            ..ServiceMapsConfig::default()
        },
        devices: (!cfg.bpf.devices.is_empty()).then(|| cfg.bpf.devices.clone()),
        tc: true,
        xdp: cfg.bpf.xdp,
        ct_timeouts: timeouts,
        node_port_cidrs: Face.node_port_cidrs(cfg),
    }
}

/// The pin directory of kproxy's maps and links under `bpffs`.
fn pins(cfg: &ProxyConfig) -> PathBuf {
    cfg.bpf.bpffs.join("kproxy")
}

impl ModeFace for Face {
    fn mode(&self) -> ProxyMode {
        ProxyMode::Ebpf
    }

    fn probe(&self, cfg: &ProxyConfig) -> Result<(), String> {
        probe(&cfg.bpf.bpffs, cfg.bpf.cgroup.as_deref())
    }

    fn build(&self, cx: &BuildContext<'_>) -> anyhow::Result<Box<dyn Dataplane>> {
        let dp = EbpfDataplane::new(config(cx.cfg, cx.families), cx.telemetry.clone())
            .context("setting up the eBPF datapath")?;
        Ok(Box::new(dp))
    }

    fn netfilter_conntrack(&self) -> bool {
        false
    }

    fn metrics(&self) -> ModeMetrics {
        ModeMetrics {
            bpf: true,
            ..ModeMetrics::generic(ProxyMode::Ebpf)
        }
    }

    /// The top-level (kproxy extension) periods.
    fn sync_periods(&self, cfg: &ProxyConfig) -> SyncPeriods {
        cfg.ebpf_sync
    }

    fn render(&self, cfg: &ProxyConfig, snap: &Snapshot) -> anyhow::Result<String> {
        let c = config(cfg, &[IpFamily::V4, IpFamily::V6]);
        Ok(super::service_maps::render(snap, &c.ebpf))
    }

    /// The pinned service map exists.
    fn programmed_here(&self, cfg: &ProxyConfig) -> bool {
        pins(cfg)
            .join(kproxy_common::service::MAP_SERVICES)
            .exists()
    }

    fn has_leftovers(&self, cfg: &ProxyConfig, _running: &dyn ModeFace) -> bool {
        pins(cfg).exists()
    }

    fn remove_leftovers(&self, cfg: &ProxyConfig, errors: &mut Vec<String>) {
        if pins(cfg).exists() {
            cleanup_step(
                errors,
                "eBPF pins",
                super::service_maps::cleanup_pins(&cfg.bpf.bpffs).map_err(|e| e.to_string()),
            );
        }
    }

    fn inspect(
        &self,
        cfg: &ProxyConfig,
        _snap: &Snapshot,
        selected: &Selected<'_>,
        reports: &mut [ServiceReport],
        maps: &mut Vec<MapFill>,
    ) -> anyhow::Result<()> {
        super::inspect::view(&cfg.bpf.bpffs, selected, reports, maps)
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

/// The object loads with its maps (under a throwaway pin directory of `bpffs`), the verifier
/// accepts the socket-LB `connect4` program and the TC ingress programs, and `connect4`
/// attaches to a throwaway child cgroup of the socket-LB cgroup; that cgroup is on cgroup2
/// and shows the host's hierarchy, not a private cgroup namespace's own
/// ([`super::socket_lb::cgroup`]). Without CAP_BPF/CAP_SYS_ADMIN (or with an old kernel)
/// one of these fails and says why.
fn probe(bpffs: &Path, cgroup: Option<&Path>) -> Result<(), String> {
    if !object::is_built() {
        return Err("this binary was built without the BPF object".into());
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        return Err("the kernel has no BTF (/sys/kernel/btf/vmlinux missing)".into());
    }
    let cg_root = match cgroup {
        Some(p) => p.to_path_buf(),
        None => super::socket_lb::cgroup::cgroup2_root()
            .ok_or("no cgroup2 mount for socket LB (pass --bpf-cgroup)")?,
    };
    super::socket_lb::cgroup::check(&cg_root).map_err(|e| e.to_string())?;
    super::pins::ensure_bpffs(bpffs).map_err(|e| e.to_string())?;
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
