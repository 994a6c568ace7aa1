//! `cargo xtask setup`: install what a fresh machine of this kind (Debian 12, rustup stable,
//! root) lacks to build and test kproxy. Idempotent; when everything is present it only runs
//! one `dpkg-query` per package plus `bpf-linker --version`/`ldd`, a no-op in well under a
//! second.
//!
//! 1. apt: the packages of [`APT_PACKAGES`] whose `dpkg-query -W -f='${Status}'` is not
//!    `install ok installed` (`apt-get update` first, only then), except those whose command
//!    another package already put on `PATH` ([`SATISFIED_BY_COMMAND`]: `kubectl`).
//! 2. `bpf-linker` 0.13.0 built against LLVM 22 (`cargo install`), unless the one on `PATH`
//!    already is (Debian 12's `llvm-config` on PATH is LLVM 14, so the build is pointed at
//!    `/usr/lib/llvm-22` explicitly).
//! 3. A final check of the whole BPF toolchain (the same check `kproxy/build.rs` makes).
//! 4. `mdbook` [`MDBOOK_VERSION`] (builds the user guide, `cargo xtask docs`), unless that
//!    version is on `PATH` or in cargo's bin directory: Debian 12 does not package it, so
//!    `cargo install mdbook@… --locked --no-default-features --features search` (no `serve` /
//!    `watch`: 130 crates to build instead of 191; the HTML and its search index are the same).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context as _, bail};

use crate::bpf_toolchain::{self, BPF_LINKER_VERSION, LLVM_MAJOR};
use crate::process::{is_root, output, run_step};

/// Every apt package kproxy's build, tests and demo use, with why.
pub const APT_PACKAGES: &[(&str, &str)] = &[
    (
        "rustc-web",
        "Debian's rustc (LLVM 22) that compiles the BPF programs",
    ),
    (
        "cargo-web",
        "its cargo, run by aya-build as `rustup run /usr cargo`",
    ),
    (
        "libstd-rust-web-dev-bpf",
        "the prebuilt `core` for bpfel-unknown-none",
    ),
    ("llvm-22-dev", "libLLVM 22 that bpf-linker links"),
    (
        "libpolly-22-dev",
        "needed to link bpf-linker against LLVM 22",
    ),
    ("zlib1g-dev", "needed to link bpf-linker"),
    ("libzstd-dev", "needed to link bpf-linker"),
    ("bpftool", "inspecting loaded BPF programs, maps and links"),
    (
        "iproute2",
        "`ip netns`/veth topologies of the tests and the demo",
    ),
    (
        "iptables",
        "the iptables proxier (iptables-restore, legacy and nft backends)",
    ),
    ("ipset", "the IPVS proxier's sets"),
    ("conntrack", "conntrack cleanup tests"),
    (
        "nftables",
        "nft, for tests that inspect nf_tables and the throughput bench's counting sinks",
    ),
    ("python3", "test and demo helper scripts"),
    ("libcap2-bin", "capsh/setcap for capability tests"),
    ("util-linux", "nsenter and mount for the test namespaces"),
    ("procps", "sysctl and ps"),
    (
        "kmod",
        "modprobe/lsmod for mode detection; depmod for the IPVS guest's initramfs",
    ),
    (
        "qemu-system-x86",
        "the QEMU guest the IPVS tests run in (`cargo xtask guest`)",
    ),
    ("busybox-static", "the IPVS guest's /init and shell"),
    (
        "ipvsadm",
        "inspecting IPVS state (copied into the IPVS guest)",
    ),
    ("cpio", "building the IPVS guest's initramfs"),
    (
        "kubernetes-client",
        "kubectl 1.20 (kustomize 2.0.3): the deploy tests render deploy/base and the overlays",
    ),
    (
        "mmdebstrap",
        "unpacks the container image's Debian packages (`cargo xtask image`, deploy/image/packages.txt)",
    ),
    (
        "podman",
        "runs the image the way the DaemonSet does (tests/tests/agent/deploy_image.rs), as root; \
         its recommends (uidmap, slirp4netns, fuse-overlayfs: rootless; catatonit: --init; \
         buildah) are not needed",
    ),
    (
        "runc",
        "podman's OCI runtime here: crun (podman's default) fails on this machine's hybrid cgroups",
    ),
    (
        "prometheus",
        "promtool (19 MB download; no smaller Debian package ships it): `promtool check \
         metrics` on the agent's /metrics",
    ),
];

/// Packages whose command, when already on `PATH` from elsewhere, is enough: another
/// package's `kubectl` (e.g. a cloud SDK's) owns /usr/bin/kubectl, so installing
/// kubernetes-client over it would fail with a file conflict.
const SATISFIED_BY_COMMAND: &[(&str, &str)] = &[("kubernetes-client", "kubectl")];

/// Installs what is missing; returns the installs it performed (empty: nothing to do).
pub fn run() -> anyhow::Result<Vec<String>> {
    let start = Instant::now();
    let mut performed = Vec::new();

    let missing = missing_apt_packages()?;
    if !missing.is_empty() {
        println!("setup: missing apt packages: {}", missing.join(" "));
        apt_install(&missing)?;
        let still = missing_apt_packages()?;
        if !still.is_empty() {
            bail!(
                "apt-get install finished but these are still not installed: {}",
                still.join(" ")
            );
        }
        performed.push(format!("apt-get install {}", missing.join(" ")));
    }

    if let Some(problem) = bpf_toolchain::bpf_linker_problem() {
        println!("setup: bpf-linker needs (re)installing: {problem}");
        install_bpf_linker()?;
        if let Some(problem) = bpf_toolchain::bpf_linker_problem() {
            bail!(
                "bpf-linker was installed into {} but is still unusable: {problem} \
                 (is that directory on PATH?)",
                install_bin_dir().display()
            );
        }
        performed.push(format!(
            "cargo install bpf-linker@{BPF_LINKER_VERSION} (LLVM {LLVM_MAJOR})"
        ));
    }

    if let Some(installed) = ensure_mdbook()? {
        performed.push(installed);
    }

    let problems = bpf_toolchain::toolchain_problems();
    if !problems.is_empty() {
        bail!(
            "the BPF toolchain is still incomplete:\n  - {}",
            problems.join("\n  - ")
        );
    }
    if performed.is_empty() {
        println!(
            "setup: nothing to do: {} apt packages, bpf-linker {BPF_LINKER_VERSION} (LLVM \
             {LLVM_MAJOR}) and mdbook {MDBOOK_VERSION} present (checked in {:.2} s)",
            APT_PACKAGES.len(),
            start.elapsed().as_secs_f64()
        );
    } else {
        println!(
            "setup: done in {:.1} s: {}",
            start.elapsed().as_secs_f64(),
            performed.join("; ")
        );
    }
    Ok(performed)
}

/// Whether `dpkg-query -W -f='${Status}'` output means installed.
fn is_installed_status(status: &str) -> bool {
    status.trim() == "install ok installed"
}

fn missing_apt_packages() -> anyhow::Result<Vec<&'static str>> {
    if bpf_toolchain::find_on_path("dpkg-query").is_none() {
        bail!(
            "dpkg-query not found: `cargo xtask setup` supports Debian 12 (bookworm) machines only"
        );
    }
    let mut missing = Vec::new();
    for &(package, _why) in APT_PACKAGES {
        let command = SATISFIED_BY_COMMAND.iter().find(|(p, _)| *p == package);
        if command.is_some_and(|(_, c)| bpf_toolchain::find_on_path(c).is_some()) {
            continue;
        }
        // Exits non-zero for packages dpkg has never heard of: that is "missing" too.
        let status = output(Command::new("dpkg-query").args(["-W", "-f=${Status}", package]));
        if !status.as_deref().is_some_and(is_installed_status) {
            missing.push(package);
        }
    }
    Ok(missing)
}

/// `apt-get` as root (directly, or through sudo when we are not root).
fn apt_get() -> anyhow::Result<Command> {
    if is_root() {
        let mut cmd = Command::new("apt-get");
        cmd.env("DEBIAN_FRONTEND", "noninteractive");
        return Ok(cmd);
    }
    if bpf_toolchain::find_on_path("sudo").is_none() {
        bail!("installing apt packages needs root (and sudo is not installed)");
    }
    let mut cmd = Command::new("sudo");
    cmd.args(["env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
    Ok(cmd)
}

fn apt_install(packages: &[&str]) -> anyhow::Result<()> {
    run_step("setup", apt_get()?.arg("update"))?;
    run_step(
        "setup",
        apt_get()?
            .args([
                "-o",
                "DPkg::Lock::Timeout=900",
                "install",
                "-y",
                "--no-install-recommends",
            ])
            .args(packages),
    )?;
    Ok(())
}

/// Where `cargo install` puts binaries: `$CARGO_INSTALL_ROOT/bin`, else `$CARGO_HOME/bin`,
/// else `~/.cargo/bin`.
fn install_bin_dir() -> PathBuf {
    let root = std::env::var_os("CARGO_INSTALL_ROOT")
        .or_else(|| std::env::var_os("CARGO_HOME"))
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cargo")
        });
    root.join("bin")
}

/// `cargo install bpf-linker@0.13.0 --locked --force --no-default-features --features llvm-22`
/// against `/usr/lib/llvm-22` (its `bin/` first on PATH: Debian 12's default `llvm-config`
/// is LLVM 14, and with it the link of `-lLLVM` fails).
fn install_bpf_linker() -> anyhow::Result<()> {
    let llvm = format!("/usr/lib/llvm-{LLVM_MAJOR}");
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![PathBuf::from(format!("{llvm}/bin"))];
    dirs.extend(std::env::split_paths(&path));
    let path: OsString = std::env::join_paths(dirs).context("building PATH")?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.env("LLVM_PREFIX", &llvm)
        // llvm-sys names its variable after its own version: 221 for LLVM 22.1.
        .env(format!("LLVM_SYS_{LLVM_MAJOR}1_PREFIX"), &llvm)
        .env("PATH", path)
        .args([
            "install",
            &format!("bpf-linker@{BPF_LINKER_VERSION}"),
            "--locked",
            "--force",
        ])
        .args([
            "--no-default-features",
            "--features",
            &format!("llvm-{LLVM_MAJOR}"),
        ])
        // Outside the workspace so its .cargo/config.toml does not apply.
        .current_dir(std::env::temp_dir());
    run_step("setup", &mut cmd)?;
    Ok(())
}

/// The mdbook `cargo xtask docs` builds the user guide with. 0.5.4 builds with rustc ≥ 1.88.
pub const MDBOOK_VERSION: &str = "0.5.4";

/// The pinned mdbook: on `PATH`, else in cargo's bin directory (where `cargo install` puts it,
/// which a fresh shell may not have on `PATH`). None when neither is that version.
pub fn mdbook_path() -> Option<PathBuf> {
    let candidates = [
        bpf_toolchain::find_on_path("mdbook"),
        Some(install_bin_dir().join("mdbook")),
    ];
    candidates.into_iter().flatten().find(|p| {
        output(Command::new(p).arg("--version"))
            .is_some_and(|v| is_mdbook_version(&v, MDBOOK_VERSION))
    })
}

/// Whether `mdbook --version` output (`mdbook v0.5.4`) is `version`.
fn is_mdbook_version(output: &str, version: &str) -> bool {
    output.split_whitespace().nth(1) == Some(&format!("v{version}"))
}

/// Installs mdbook [`MDBOOK_VERSION`] unless present; returns what it did (None: nothing).
pub fn ensure_mdbook() -> anyhow::Result<Option<String>> {
    if mdbook_path().is_some() {
        return Ok(None);
    }
    println!("setup: mdbook {MDBOOK_VERSION} missing (it builds the user guide)");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "install",
        &format!("mdbook@{MDBOOK_VERSION}"),
        "--locked",
        "--force",
        "--no-default-features",
        "--features",
        "search",
    ])
    // Outside the workspace so its .cargo/config.toml does not apply.
    .current_dir(std::env::temp_dir());
    run_step("setup", &mut cmd)?;
    if mdbook_path().is_none() {
        bail!(
            "mdbook {MDBOOK_VERSION} was installed into {} but does not run",
            install_bin_dir().display()
        );
    }
    Ok(Some(format!("cargo install mdbook@{MDBOOK_VERSION}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_fully_installed_status_counts() {
        assert!(is_installed_status("install ok installed"));
        assert!(!is_installed_status("unknown ok not-installed"));
        assert!(!is_installed_status("deinstall ok config-files"));
        assert!(!is_installed_status("install ok half-configured"));
        assert!(!is_installed_status(""));
    }

    #[test]
    fn mdbook_version_is_read_from_its_version_line() {
        assert!(is_mdbook_version("mdbook v0.5.4\n", "0.5.4"));
        assert!(!is_mdbook_version("mdbook v0.4.52\n", "0.5.4"));
        assert!(!is_mdbook_version("mdbook v0.5.40\n", "0.5.4"));
        assert!(!is_mdbook_version("", "0.5.4"));
    }

    #[test]
    fn package_list_has_no_duplicates_and_names_the_bpf_route() {
        let mut names: Vec<&str> = APT_PACKAGES.iter().map(|(n, _)| *n).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), APT_PACKAGES.len(), "duplicate package");
        for needed in ["rustc-web", "cargo-web", "libstd-rust-web-dev-bpf"] {
            assert!(names.contains(&needed), "{needed}");
        }
        assert!(names.contains(&format!("llvm-{LLVM_MAJOR}-dev").as_str()));
        for (package, _) in SATISFIED_BY_COMMAND {
            assert!(names.contains(package), "{package}");
        }
    }
}
