//! `cargo xtask <command>`: kproxy's developer and CI driver (std, anyhow and clap; every
//! command answers `--help`).
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

use clap::{Parser, Subcommand};

/// kproxy's developer and CI driver.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Install what this machine lacks for building and testing kproxy (apt, bpf-linker,
    /// mdbook; idempotent).
    Setup,
    /// Build the BPF object alone and print its path.
    BuildEbpf,
    /// Setup, then run every test (kernel tests included; needs root).
    Test(test::Args),
    /// Run the IPVS test suite in a QEMU guest (Debian's kernel).
    Guest(guest::Args),
    /// Setup, build, then run the agent on a network-namespace node and send traffic through
    /// a ClusterIP and a NodePort (needs root).
    Demo,
    /// Build in release mode and run the benchmarks (needs root); the report goes to bench/.
    Bench(bench::Args),
    /// Build the user guide (docs/, mdBook) into target/book/.
    Docs,
    /// Build the container image (Debian packages + the kproxy binary, no base image) into
    /// target/image/kproxy-image.tar, an OCI archive (podman/docker load); needs root.
    Image(image::Args),
}

impl Command {
    /// The command's name on the command line.
    fn name(&self) -> &'static str {
        match self {
            Command::Setup => "setup",
            Command::BuildEbpf => "build-ebpf",
            Command::Test(_) => "test",
            Command::Guest(_) => "guest",
            Command::Demo => "demo",
            Command::Bench(_) => "bench",
            Command::Docs => "docs",
            Command::Image(_) => "image",
        }
    }
}

/// Pass-through arguments as given: clap hands those after a leading `--` apart (once the
/// first argument is taken, everything after it, `--` included, is `args`).
fn rejoin(args: &[String], after_dashes: &[String]) -> Vec<String> {
    let mut all = args.to_vec();
    if !after_dashes.is_empty() {
        all.push("--".into());
        all.extend_from_slice(after_dashes);
    }
    all
}

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
    let cli = Cli::parse();
    let name = cli.command.name();
    let result = match cli.command {
        Command::Setup => setup::run().map(|_| ExitCode::SUCCESS),
        Command::BuildEbpf => build_ebpf::run(),
        Command::Test(args) => test::run(&args),
        Command::Guest(args) => guest::run(&args),
        Command::Demo => demo::run(),
        Command::Bench(args) => bench::run(&args),
        Command::Docs => docs::run(),
        Command::Image(args) => image::run(&args),
    };
    result.unwrap_or_else(|err| {
        eprintln!("xtask {name}: error: {err:#}");
        ExitCode::FAILURE
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;
    use clap::error::ErrorKind;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied()))
    }

    /// `cargo xtask <command> --help` answers for every command (it once ended in a backtrace
    /// for `bench`, whose arguments went to kp-bench after a release build).
    #[test]
    fn every_command_answers_help() {
        Cli::command().debug_assert();
        let names: Vec<String> = Cli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_string())
            .collect();
        assert_eq!(
            names,
            [
                "setup",
                "build-ebpf",
                "test",
                "guest",
                "demo",
                "bench",
                "docs",
                "image"
            ]
        );
        for (name, args) in names.iter().zip([
            &["setup"][..],
            &["build-ebpf"],
            &["test"],
            &["guest"],
            &["demo"],
            &["bench"],
            &["docs"],
            &["image"],
        ]) {
            assert_eq!(parse(args).unwrap().command.name(), name);
        }
        for name in names.iter().map(String::as_str).chain(["--help"]) {
            let args: Vec<&str> = if name == "--help" {
                vec![name]
            } else {
                vec![name, "--help"]
            };
            let e = parse(&args).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::DisplayHelp, "{name}: {e}");
        }
        assert!(parse(&[]).is_err());
        assert!(parse(&["demo", "extra"]).is_err());
    }

    /// `test ARGS…` hands every argument to cargo test as given, `--` included; `guest ARGS…`
    /// to the guest's test binary.
    #[test]
    fn test_and_guest_pass_their_arguments_through() {
        let passed = |args: &[&str]| -> Vec<String> {
            match parse(args).unwrap().command {
                Command::Test(a) => a.cargo_test_args(),
                Command::Guest(a) => a.test_args(),
                other => panic!("{other:?}"),
            }
        };
        for args in [
            &["some_filter"][..],
            &["--no-run"],
            &["-p", "kproxy-tests", "--test", "ebpf", "--", "--nocapture"],
            &["filter", "--", "--test-threads=1"],
            &["--", "--nocapture"],
            &[],
        ] {
            let with = |cmd: &'static str| [&[cmd][..], args].concat();
            assert_eq!(passed(&with("test")), args, "test {args:?}");
            assert_eq!(passed(&with("guest")), args, "guest {args:?}");
        }
    }
}
