//! The BPF toolchain and the one way kproxy builds its BPF object.
//!
//! Shared verbatim by `kproxy/build.rs` (which embeds the object; it includes this file with
//! `#[path]`) and by `cargo xtask build-ebpf` / `cargo xtask setup`, so the build and the
//! installer agree on what "the toolchain is present" means. Keep it std + anyhow + aya-build.
//!
//! The route (TOOLCHAIN.md §1): Debian's rustc-web (`/usr/bin/rustc`, LLVM 22, a prebuilt
//! `core` for `bpfel-unknown-none` from `libstd-rust-web-dev-bpf`) selected as the rustup path
//! toolchain `/usr`, plus `bpf-linker` 0.13.0 built against the same LLVM major.
#![allow(dead_code, reason = "each includer uses a different subset")]

use std::env;
use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

/// The BPF crate (a workspace member, not a default member).
pub const EBPF_PACKAGE: &str = "kproxy-ebpf";
/// Its binary target: the object's file name in the build's `OUT_DIR`.
pub const EBPF_BIN: &str = "kproxy-ebpf";
/// Environment variable `kproxy/build.rs` sets (for `include_bytes!`) to the object's path.
pub const OBJECT_PATH_ENV: &str = "KPROXY_EBPF_OBJECT";
/// The bench and test tools' object (same programs plus the counter and the floors), never
/// embedded in the agent.
pub const EBPF_TOOLS_BIN: &str = "kproxy-ebpf-bench";
/// Where `kproxy/build.rs` tells the crate the tools' object is.
pub const TOOLS_OBJECT_PATH_ENV: &str = "KPROXY_EBPF_TOOLS_OBJECT";
/// When `1`/`true`, no BPF object is built; an empty file stands in for it.
pub const SKIP_ENV: &str = "AYA_BUILD_SKIP";

/// rustup path toolchain holding Debian's rustc-web (`/usr/bin/rustc`, `/usr/bin/cargo`).
pub const TOOLCHAIN: &str = "/usr";
pub const RUSTC: &str = "/usr/bin/rustc";
pub const CARGO: &str = "/usr/bin/cargo";
/// Where `libstd-rust-web-dev-bpf` puts the prebuilt `core` for the BPF target.
pub const BPF_CORE_DIR: &str = "/usr/lib/rustlib/bpfel-unknown-none/lib";
/// LLVM major of Debian's rustc-web; `bpf-linker` must link the same one.
pub const LLVM_MAJOR: u32 = 22;
pub const BPF_LINKER_VERSION: &str = "0.13.0";

/// Whether `AYA_BUILD_SKIP` asks to skip the BPF build (same rule as aya-build).
pub fn skip_requested() -> bool {
    env::var_os(SKIP_ENV).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// `program` as found on `PATH` (the lookup rustc does for its `bpf-linker` linker).
pub fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
}

/// The LLVM major in `rustc -vV` output (`LLVM version: 22.1.8`).
pub fn parse_llvm_major(rustc_vv: &str) -> Option<u32> {
    let version = rustc_vv
        .lines()
        .find_map(|l| l.strip_prefix("LLVM version: "))?;
    version.trim().split('.').next()?.parse().ok()
}

fn output_of(program: impl AsRef<OsStr>, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Why `bpf-linker` is unusable, or `None` when it is 0.13.0 on `PATH` linked against
/// `libLLVM.so.22`.
pub fn bpf_linker_problem() -> Option<String> {
    let Some(path) = find_on_path("bpf-linker") else {
        return Some("bpf-linker is not on PATH".to_string());
    };
    let version = output_of(&path, &["--version"]).unwrap_or_default();
    if version.split_whitespace().nth(1) != Some(BPF_LINKER_VERSION) {
        return Some(format!(
            "{} reports {:?}, want bpf-linker {BPF_LINKER_VERSION}",
            path.display(),
            version.trim()
        ));
    }
    // bpf-linker links libLLVM dynamically; its major must match rustc's bitcode.
    let ldd = output_of("ldd", &[&path.to_string_lossy()]).unwrap_or_default();
    let want = format!("libLLVM.so.{LLVM_MAJOR}");
    match ldd.lines().find(|l| l.contains("libLLVM")) {
        Some(line) if line.contains(&want) && !line.contains("not found") => None,
        Some(line) => Some(format!(
            "{} links {:?}, want {want} (resolvable)",
            path.display(),
            line.trim()
        )),
        None => Some(format!("{} does not link {want}", path.display())),
    }
}

/// Everything missing for a BPF build, each naming the file and the package that provides it.
/// Empty when the toolchain is complete.
pub fn toolchain_problems() -> Vec<String> {
    let mut problems = Vec::new();
    if !Path::new(RUSTC).is_file() {
        problems.push(format!("{RUSTC} is missing (apt package rustc-web)"));
    } else {
        let vv = output_of(RUSTC, &["-vV"]).unwrap_or_default();
        match parse_llvm_major(&vv) {
            Some(LLVM_MAJOR) => {}
            other => problems.push(format!(
                "{RUSTC} uses LLVM {other:?}, kproxy's BPF route expects LLVM {LLVM_MAJOR} \
                 (update LLVM_MAJOR in xtask/src/bpf_toolchain.rs and the llvm-N packages)"
            )),
        }
    }
    if !Path::new(CARGO).is_file() {
        problems.push(format!("{CARGO} is missing (apt package cargo-web)"));
    }
    let has_core = fs::read_dir(BPF_CORE_DIR).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with("libcore-"))
    });
    if !has_core {
        problems.push(format!(
            "no prebuilt core in {BPF_CORE_DIR} (apt package libstd-rust-web-dev-bpf)"
        ));
    }
    if let Some(problem) = bpf_linker_problem() {
        problems.push(problem);
    }
    problems
}

/// Builds the BPF object into `out_dir` with aya-build and returns its path.
///
/// `ebpf_dir` is the `kproxy-ebpf` crate directory; the current directory must be inside the
/// workspace (aya-build runs `rustup run /usr cargo build --package kproxy-ebpf` there). The
/// caller's environment must carry what cargo gives build scripts: `OUT_DIR`,
/// `CARGO_CFG_TARGET_ENDIAN` and `CARGO_CFG_TARGET_ARCH`. With `AYA_BUILD_SKIP=1` an empty
/// file is written instead (host-only work; loading it then fails with a clear error).
pub fn build_object(ebpf_dir: &Path, out_dir: &Path) -> anyhow::Result<PathBuf> {
    let object = out_dir.join(EBPF_BIN);
    if skip_requested() {
        for path in [object.clone(), out_dir.join(EBPF_TOOLS_BIN)] {
            fs::write(&path, [])
                .with_context(|| format!("writing the empty stand-in {}", path.display()))?;
        }
        return Ok(object);
    }
    let problems = toolchain_problems();
    if !problems.is_empty() {
        bail!(
            "the BPF toolchain is incomplete:\n  - {}\nRun `cargo xtask setup` to install it (or set \
             {SKIP_ENV}=1 to build kproxy without its BPF object; loading it then fails).",
            problems.join("\n  - ")
        );
    }
    let ebpf_dir = ebpf_dir
        .to_str()
        .with_context(|| format!("non-UTF-8 path {}", ebpf_dir.display()))?;
    let package = aya_build::Package {
        name: EBPF_PACKAGE,
        root_dir: ebpf_dir,
        ..Default::default()
    };
    aya_build::build_ebpf([package], aya_build::Toolchain::Custom(TOOLCHAIN))
        .context("building the BPF object (kproxy-ebpf) with Debian's rustc-web and bpf-linker")?;
    let len = fs::metadata(&object)
        .with_context(|| format!("aya-build produced no {}", object.display()))?
        .len();
    if len == 0 {
        bail!("aya-build produced an empty {}", object.display());
    }
    let tools = out_dir.join(EBPF_TOOLS_BIN);
    fs::metadata(&tools).with_context(|| format!("aya-build produced no {}", tools.display()))?;
    Ok(object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llvm_major_is_read_from_rustc_vv() {
        let vv = "rustc 1.96.0 (ac68faa20 2026-05-25)\nbinary: rustc\nhost: x86_64-unknown-linux-gnu\n\
                  release: 1.96.0\nLLVM version: 22.1.8\n";
        assert_eq!(parse_llvm_major(vv), Some(22));
        assert_eq!(parse_llvm_major("rustc 1.96.0\n"), None);
        assert_eq!(parse_llvm_major("LLVM version: x.1\n"), None);
    }

    #[test]
    fn find_on_path_finds_a_file_only() {
        // `sh` is on PATH on every machine this runs on.
        assert!(find_on_path("sh").is_some());
        assert!(find_on_path("no-such-program-kproxy-xtask").is_none());
    }
}
