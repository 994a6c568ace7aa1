//! `cargo xtask test [ARGS…]`: `setup`, then the whole test suite, kernel tests included:
//! `cargo build -p kproxy --bins` (the agent binary the traffic tests run), the container
//! image ([`crate::image::build`] with the dev binary just built, see
//! [`crate::image::Profile`]: mmdebstrap and the archive that the `deploy_image` tests run
//! with podman), then
//! `cargo test --workspace --exclude kproxy-ebpf --no-fail-fast ARGS…` with
//! `KPROXY_TESTS_REQUIRE_KERNEL=1`, so a kernel test that cannot run fails instead of printing
//! "skipped", and one failing test binary does not hide the others' results. Then the IPVS
//! suite in the QEMU guest ([`crate::guest`]; the host kernel has no IPVS), always, also when
//! the host suite failed. Then the user guide ([`crate::docs`]: the reference page
//! regenerated, the mdBook built). Needs root. Fails when any of them fails.

use std::process::ExitCode;

use anyhow::{Context as _, bail};

use crate::bpf_toolchain::EBPF_PACKAGE;
use crate::process::{display, is_root};

/// Read by `kproxy_tests::netns::require_root` (tests/src/netns.rs, `REQUIRE_KERNEL_ENV`).
const REQUIRE_KERNEL_ENV: &str = "KPROXY_TESTS_REQUIRE_KERNEL";
/// Read by `kproxy_tests::podman` (tests/src/podman.rs, `IMAGE_ARCHIVE_ENV`): the archive
/// [`crate::image::build`] wrote.
const IMAGE_ARCHIVE_ENV: &str = "KPROXY_IMAGE_ARCHIVE";

/// The packages the host suite tests. The guest suite ([`crate::guest`]) takes its binary
/// from a `cargo test --no-run` with the same selection: features unify per selection, so
/// another one (e.g. `-p kproxy-tests`) would give `kproxy` and the test binary a different
/// hash and recompile them.
pub const HOST_PACKAGES: &[&str] = &["--workspace", "--exclude", EBPF_PACKAGE];

/// `cargo xtask test [ARGS…]`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Arguments for `cargo test`, as given (e.g. a test name filter, `-p kproxy-tests`,
    /// `-- --nocapture`). One plain word is also the guest suite's filter.
    #[arg(allow_hyphen_values = true, value_name = "ARGS")]
    args: Vec<String>,
    /// What follows a leading `--` (clap takes that `--` as its own).
    #[arg(last = true, hide = true)]
    after_dashes: Vec<String>,
}

impl Args {
    /// The arguments as given on the command line.
    pub fn cargo_test_args(&self) -> Vec<String> {
        crate::rejoin(&self.args, &self.after_dashes)
    }
}

pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    let args = &args.cargo_test_args()[..];
    if !is_root() {
        bail!(
            "`cargo xtask test` runs the kernel tests (namespaces, BPF, netfilter) and needs root; \
             unprivileged, run `cargo test --workspace` (kernel tests then print \"skipped\")"
        );
    }
    crate::setup::run()?;
    // The traffic tests run the real agent binary (`kproxy_tests::topology::kproxy_bin`);
    // `cargo test` builds only the test harness of the `kproxy` package, not its binary.
    let mut build = crate::process::cargo();
    build
        .args(["build", "--package", "kproxy", "--bins"])
        .current_dir(crate::workspace_root());
    println!("test: $ {}", display(&build));
    if !build
        .status()
        .with_context(|| format!("spawning {}", display(&build)))?
        .success()
    {
        bail!("building the kproxy binary failed");
    }
    // The container image the `deploy_image` tests run with podman, built fresh so they test
    // this commit (tests/src/podman.rs finds it through IMAGE_ARCHIVE_ENV). A failed build
    // does not stop the suite: those tests then fail, naming the missing archive.
    println!("test: the container image");
    let image = match crate::image::build(crate::image::Profile::Dev) {
        Ok(built) => {
            println!(
                "test: image {} ({:.1} MiB compressed) in {}",
                built.digest,
                built.compressed_size as f64 / 1048576.0,
                built.archive.display()
            );
            Some(built)
        }
        Err(err) => {
            eprintln!("test: building the container image failed: {err:#}");
            None
        }
    };
    let mut cmd = crate::process::cargo();
    if let Some(built) = &image {
        cmd.env(IMAGE_ARCHIVE_ENV, &built.archive);
    }
    cmd.arg("test")
        .args(HOST_PACKAGES)
        .arg("--no-fail-fast")
        .args(args)
        .env(REQUIRE_KERNEL_ENV, "1")
        .current_dir(crate::workspace_root());
    println!("test: $ {}", display(&cmd));
    let status = cmd
        .status()
        .with_context(|| format!("spawning {}", display(&cmd)))?;
    // A signal-killed cargo has no code: report failure.
    let code = status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1));
    // The guest's ARGS are a test-name filter only when the caller passed one plain word.
    let guest_args: Vec<String> = match args {
        [filter] if !filter.starts_with('-') => vec![filter.clone()],
        _ => vec![],
    };
    println!("test: IPVS suite in the QEMU guest");
    let guest_passed = match crate::guest::run_suite(&guest_args) {
        Ok(outcome) => outcome.passed,
        Err(err) => {
            eprintln!("test: the IPVS guest suite could not run: {err:#}");
            false
        }
    };
    println!("test: the user guide");
    let docs_built = match crate::docs::build() {
        Ok(_) => true,
        Err(err) => {
            eprintln!("test: building the user guide failed: {err:#}");
            false
        }
    };
    Ok(
        match (code, guest_passed && docs_built && image.is_some()) {
            (0, true) => ExitCode::SUCCESS,
            (0, false) => ExitCode::FAILURE,
            (c, _) => ExitCode::from(c),
        },
    )
}
