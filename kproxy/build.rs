//! Builds the BPF object (`kproxy-ebpf`, target `bpfel-unknown-none`, Debian's rustc-web +
//! bpf-linker) and tells `src/bpf.rs` where it is (`KPROXY_EBPF_OBJECT`), which embeds it.
//!
//! The build itself lives in `xtask/src/bpf_toolchain.rs`, shared with `cargo xtask
//! build-ebpf`. A missing toolchain fails here with a message naming what is missing and
//! saying to run `cargo xtask setup`; `AYA_BUILD_SKIP=1` embeds an empty object instead.

#[path = "../xtask/src/bpf_toolchain.rs"]
mod bpf_toolchain;

use std::env;
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("set by cargo"));
    let workspace = manifest_dir
        .parent()
        .expect("kproxy/ is inside the workspace");
    let ebpf_dir = workspace.join(bpf_toolchain::EBPF_PACKAGE);

    // Inputs of the BPF object besides its own crate (aya-build watches that one).
    println!("cargo:rerun-if-env-changed={}", bpf_toolchain::SKIP_ENV);
    println!(
        "cargo:rerun-if-changed={}",
        workspace.join("kproxy-common").display()
    );
    println!("cargo:rerun-if-changed={}", ebpf_dir.display());
    println!("cargo:rerun-if-changed={}", bpf_toolchain::RUSTC);
    if let Some(linker) = bpf_toolchain::find_on_path("bpf-linker") {
        println!("cargo:rerun-if-changed={}", linker.display());
    }

    // SAFETY: build scripts are single-threaded here; only the nested BPF cargo reads it (its
    // "Compiling …" lines would otherwise be replayed as warnings on every kproxy build).
    unsafe { env::set_var("CARGO_TERM_QUIET", "true") };
    let object = bpf_toolchain::build_object(&ebpf_dir, &out_dir)?;
    if bpf_toolchain::skip_requested() {
        println!(
            "cargo:warning={}=1: embedding an EMPTY BPF object; loading it will fail",
            bpf_toolchain::SKIP_ENV
        );
    }
    println!(
        "cargo:rustc-env={}={}",
        bpf_toolchain::OBJECT_PATH_ENV,
        object.display()
    );
    println!(
        "cargo:rustc-env={}={}",
        bpf_toolchain::TOOLS_OBJECT_PATH_ENV,
        out_dir.join(bpf_toolchain::EBPF_TOOLS_BIN).display()
    );
    Ok(())
}
