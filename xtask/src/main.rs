//! `cargo xtask <command>`: kproxy's developer and CI driver (plain std + anyhow).
//!
//! | command | module |
//! |---|---|
//! | `setup` | [`setup`]: install what a fresh Debian 12 machine lacks (idempotent) |
//! | `build-ebpf` | [`build_ebpf`]: build the BPF object alone and print its path |
//! | `test [ARGS…]` | [`test`](mod@test): setup, then `cargo test --workspace` (kernel tests included) |
//! | `guest [ARGS…]` | [`guest`]: the IPVS suite in a QEMU guest booting Debian's kernel |
//! | `demo` | [`demo`] |
//! | `bench` | [`bench`](mod@bench) |
//! | `docs` | [`docs`]: build the user guide (mdBook) |
//! | `image [--profile dev] [--rootfs DIR]` | [`image`]: the container image from Debian packages, as an OCI archive |
//!
//! [`bpf_toolchain`] is shared with `kproxy/build.rs` (one definition of the BPF build).

mod bench;
mod bpf_toolchain;
mod build_ebpf;
mod demo;
mod docs;
mod guest;
mod image;
mod process;
mod setup;
mod test;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

const USAGE: &str = "\
usage: cargo xtask <command> [args…]

commands:
  setup        install what this machine lacks for building and testing kproxy (apt + bpf-linker)
  build-ebpf   build the BPF object alone and print its path
  test [ARGS]  setup, then run every test (kernel tests included; needs root); ARGS go to cargo test
  guest [ARGS] run the IPVS test suite in a QEMU guest (Debian's kernel); ARGS go to the test binary
  demo         run the demo topology
  docs         build the user guide (docs/, mdBook) into target/book/
  image [--profile dev] [--rootfs DIR]
               build the container image (Debian packages + release binary, no base image) into
               target/image/kproxy-image.tar (OCI archive; podman/docker load); needs root.
               --profile dev: the dev binary, into target/image/kproxy-image-dev.tar (what
               `test` runs); --rootfs DIR: only the image's files, into DIR (deploy/Dockerfile)
  bench [--quick] [--out DIR] [--only packet,connect,control]
               build in release mode and run the benchmarks (needs root); report in bench/
  bench --ipvs-guest [--out DIR]
               the ipvs figures in the QEMU guest, merged into the report of the run above";

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ is inside the workspace")
        .to_path_buf()
}

/// Cargo's target directory: `$CARGO_TARGET_DIR`, else the workspace's `target/`.
pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace_root().join("target"), PathBuf::from)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some((command, rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let result = match command.as_str() {
        "setup" => no_args(command, rest)
            .and_then(|()| setup::run())
            .map(|_| ExitCode::SUCCESS),
        "build-ebpf" => no_args(command, rest).and_then(|()| build_ebpf::run()),
        "test" => test::run(rest),
        "guest" => guest::run(rest),
        "demo" => demo::run(rest),
        "bench" => bench::run(rest),
        "docs" => docs::run(rest),
        "image" => image::run(rest),
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        other => {
            eprintln!("xtask: unknown command {other:?}\n{USAGE}");
            Ok(ExitCode::from(2))
        }
    };
    result.unwrap_or_else(|err| {
        eprintln!("xtask {command}: error: {err:#}");
        ExitCode::FAILURE
    })
}

fn no_args(command: &str, rest: &[String]) -> anyhow::Result<()> {
    if rest.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("`{command}` takes no arguments, got {rest:?}")
    }
}
