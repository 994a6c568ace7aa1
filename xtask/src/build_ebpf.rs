//! `cargo xtask build-ebpf`: build the BPF object alone (the same `bpf_toolchain::build_object`
//! call `kproxy/build.rs` makes) into `<target>/xtask-ebpf/` and print its path, e.g. for
//! `llvm-objdump -d`, `bpftool btf dump file`, or `bpftool prog loadall` into a bpffs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context as _, bail};

use crate::bpf_toolchain;

pub fn run() -> anyhow::Result<ExitCode> {
    if bpf_toolchain::skip_requested() {
        bail!(
            "{} is set: unset it to build the BPF object",
            bpf_toolchain::SKIP_ENV
        );
    }
    let root = crate::workspace_root();
    let target_dir =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let out_dir = target_dir.join("xtask-ebpf");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let endian = if cfg!(target_endian = "big") {
        "big"
    } else {
        "little"
    };
    // SAFETY: xtask is single-threaded here. These are the variables cargo hands a build
    // script, which aya-build reads; CARGO_TERM_QUIET keeps the nested cargo's progress quiet.
    unsafe {
        std::env::set_var("OUT_DIR", &out_dir);
        std::env::set_var("CARGO_CFG_TARGET_ENDIAN", endian);
        std::env::set_var("CARGO_CFG_TARGET_ARCH", std::env::consts::ARCH);
        std::env::set_var("CARGO_TERM_QUIET", "true");
    }
    // aya-build runs the nested cargo in the current directory: it must be in the workspace.
    std::env::set_current_dir(&root).with_context(|| format!("cd {}", root.display()))?;
    let object = bpf_toolchain::build_object(&root.join(bpf_toolchain::EBPF_PACKAGE), &out_dir)?;
    let len = std::fs::metadata(&object)?.len();
    eprintln!("build-ebpf: {len} bytes");
    println!("{}", object.display());
    Ok(ExitCode::SUCCESS)
}
