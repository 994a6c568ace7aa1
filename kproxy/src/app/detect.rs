//! Proxy-mode detection (`mode: ""`): can this kernel run a mode? Each probe tries what the
//! mode needs for real, then removes what it created.
//!
//! - **ebpf**: the BPF object is built in; the kernel has BTF (`/sys/kernel/btf/vmlinux`);
//!   the object loads with its maps (under a throwaway pin directory of the configured
//!   bpffs), the verifier accepts the socket-LB `connect4` program and the TC ingress
//!   program, and `connect4` attaches to a throwaway child cgroup of the socket-LB cgroup;
//!   that cgroup is on cgroup2 and shows the host's hierarchy, not a private cgroup
//!   namespace's own ([`crate::dataplane::ebpf::socket_lb::cgroup`]).
//!   Without CAP_BPF/CAP_SYS_ADMIN (or with an old kernel) one of these fails and says why.
//! - **ipvs**: [`crate::dataplane::ipvs::usable`] (the IPVS generic-netlink family resolves, ipset ≥ 6).
//! - **iptables**: `iptables -t nat -S` works with one of the nft / legacy binaries (needs
//!   CAP_NET_ADMIN).
//!
//! [`crate::app::build::select`] runs them in [`crate::app::build::DETECT_ORDER`] and logs why each
//! rejected mode was rejected.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use aya::programs::{CgroupAttachMode, CgroupSockAddr, SchedClassifier};
use kproxy_common::ct::PROG_TC_INGRESS;
use kproxy_common::ct6::PROG_TC6_INGRESS;
use kproxy_common::layout::LAYOUTS;
use kproxy_common::sock::PROG_SOCK_CONNECT4;

use crate::config::ProxyConfig;
use crate::dataplane::ProxyMode;
use crate::dataplane::ebpf::object::{self, LoadOptions};

/// Whether `mode` can run here; `Err` says why not.
pub fn probe(mode: ProxyMode, cfg: &ProxyConfig) -> Result<(), String> {
    match mode {
        ProxyMode::Ebpf => probe_ebpf(&cfg.bpf.bpffs, cfg.bpf.cgroup.as_deref()),
        ProxyMode::Ipvs => crate::dataplane::ipvs::usable(),
        ProxyMode::Iptables => probe_iptables(),
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
    .map_err(|e| format!("loading the BPF object: {}", chain(&e)))?;
    for name in [PROG_TC_INGRESS, PROG_TC6_INGRESS] {
        let tc: &mut SchedClassifier = ebpf
            .program_mut(name)
            .ok_or("the BPF object has no TC program")?
            .try_into()
            .map_err(|e: aya::programs::ProgramError| e.to_string())?;
        tc.load()
            .map_err(|e| format!("the verifier rejected {name}: {}", chain(&e)))?;
    }
    let prog: &mut CgroupSockAddr = ebpf
        .program_mut(PROG_SOCK_CONNECT4)
        .ok_or("the BPF object has no socket-LB program")?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| e.to_string())?;
    prog.load()
        .map_err(|e| format!("the verifier rejected {PROG_SOCK_CONNECT4}: {}", chain(&e)))?;
    let cg = TempDir {
        path: cg_root.join(&tag),
        recursive: false,
    };
    fs::create_dir_all(&cg.path)
        .map_err(|e| format!("creating a probe cgroup {}: {e}", cg.path.display()))?;
    let file = fs::File::open(&cg.path).map_err(|e| e.to_string())?;
    let link = prog
        .attach(&file, CgroupAttachMode::Single)
        .map_err(|e| format!("attaching socket LB to a cgroup: {}", chain(&e)))?;
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

/// An error with its sources (aya hides the errno in `source()`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}
