//! `cargo xtask bench [--quick] [--out DIR] [--only GROUP,…]`: builds the agent and the
//! benchmark runner in release mode and runs `kp-bench` (bench/src/bin/kp-bench.rs of the
//! `kproxy-bench` crate; what it measures is documented in bench/src/lib.rs). Needs root.
//! Writes `REPORT.md`, `results.json` and SVG plots into DIR (default `bench/`, beside the
//! crate's code). `--quick` finishes in under 3 minutes; the full run in about 15 on 2 cores, plus
//! ≈ 20 for the `soak` (two modes × 4 min of churn) and `inspect` (100k services) groups.
//!
//! `cargo xtask bench --ipvs-guest [--out DIR]`: the ipvs figures, which need a kernel with
//! IPVS: boots the QEMU guest of `cargo xtask guest` ([`crate::guest::run_payload`]) with the
//! release `kp-bench`, `kproxy` and `kp-probe`, runs `kp-bench --in-guest` there and merges
//! its figures into DIR's `results.json` / `REPORT.md` (run it after the host run; rerunning
//! it replaces the previous guest figures). `--only GROUPS` (`connect`, `control`) measures
//! only those groups in the guest, e.g. `--ipvs-guest --only control --out /tmp/x` for the
//! ipvs cold start and one-change figures alone (≈ 3 min instead of ≈ 7); into a DIR without
//! a host run, the guest figures are written alone.

use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};

use crate::process::{display, is_root};

/// `cargo xtask bench [--quick] [--out DIR] [--only GROUP,…]`, `cargo xtask bench --ipvs-guest
/// [--out DIR] [--only GROUP,…]`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The quick plan (under 3 minutes).
    #[arg(long, conflicts_with = "ipvs_guest")]
    pub quick: bool,
    /// Where the report goes (default bench/; README's section is updated only then).
    #[arg(long, value_name = "DIR")]
    pub out: Option<String>,
    /// Only these groups, comma-separated (kp-bench checks the names, `kp-bench --help`
    /// lists them; with --ipvs-guest: connect, control).
    #[arg(long, value_name = "GROUP,…")]
    pub only: Option<String>,
    /// The ipvs figures in the QEMU guest, merged into the report of the host run in DIR.
    #[arg(long)]
    pub ipvs_guest: bool,
}

impl Args {
    /// kp-bench's arguments for the host run.
    fn kp_bench_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.quick {
            args.push("--quick".to_string());
        }
        for (flag, value) in [("--out", &self.out), ("--only", &self.only)] {
            if let Some(v) = value {
                args.extend([flag.to_string(), v.clone()]);
            }
        }
        args
    }
}

pub fn run(args: &Args) -> anyhow::Result<ExitCode> {
    if !is_root() {
        bail!("`cargo xtask bench` needs root (network namespaces, BPF, netfilter)");
    }
    crate::setup::run()?;
    let root = crate::workspace_root();
    // Without `cargo run`'s variables: with them, ring's build script reruns and the release
    // build recompiles everything above it (see `crate::process::cargo`).
    let mut build = crate::process::cargo();
    build
        .args([
            "build",
            "--release",
            "--package",
            "kproxy",
            "--package",
            "kproxy-bench",
            // kp-probe, which kp-bench runs in the test namespaces.
            "--package",
            "kproxy-tests",
        ])
        .arg("--bins")
        .current_dir(&root);
    println!("bench: $ {}", display(&build));
    if !build
        .status()
        .with_context(|| format!("spawning {}", display(&build)))?
        .success()
    {
        bail!("release build failed");
    }
    if args.ipvs_guest {
        return run_guest(&root, args);
    }
    let mut bench = Command::new(crate::target_dir().join("release/kp-bench"));
    bench.args(args.kp_bench_args()).current_dir(&root);
    println!("bench: $ {}", display(&bench));
    let status = bench
        .status()
        .with_context(|| format!("spawning {}", display(&bench)))?;
    if status.success() && args.out.is_none() && args.only.is_none() {
        update_readme(&root)?;
    }
    Ok(ExitCode::from(
        status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1)),
    ))
}

/// `--ipvs-guest`: the ipvs figures measured in the QEMU guest, merged into the host report.
fn run_guest(root: &std::path::Path, args: &Args) -> anyhow::Result<ExitCode> {
    let out = args.out.clone().unwrap_or_else(|| "bench".into());
    let only = args.only.clone();
    let release = crate::target_dir().join("release");
    let files: Vec<_> = ["kp-bench", "kproxy", "kp-probe"]
        .iter()
        .map(|b| release.join(b))
        .collect();
    let commit = crate::process::output(Command::new("git").args(["rev-parse", "HEAD"]))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let only = only.map_or(String::new(), |g| format!(" --only {g}"));
    let script = format!(
        "export RUST_BACKTRACE=1 RUST_LOG=warn\n\
         exec /payload/kp-bench --in-guest --commit {commit}{only}\n"
    );
    let start = std::time::Instant::now();
    let (outcome, output) = crate::guest::run_payload(&files, &script)?;
    let seconds = start.elapsed().as_secs_f64();
    // kp-bench finds its results JSON in the guest's output (between its markers).
    let file = root.join("target/guest/bench-output.log");
    std::fs::write(&file, output).with_context(|| format!("writing {}", file.display()))?;
    let mut merge = Command::new(release.join("kp-bench"));
    merge
        .arg("--merge-guest")
        .arg(&file)
        .args(["--accel", outcome.accel])
        .args(["--guest-seconds", &format!("{seconds:.1}")])
        .args(["--out", &out])
        .current_dir(root);
    println!("bench: $ {}", display(&merge));
    if !merge.status().context("spawning kp-bench")?.success() {
        bail!(
            "merging the guest results failed (guest run {}; its output: {})",
            if outcome.passed { "passed" } else { "failed" },
            file.display()
        );
    }
    if out == "bench" {
        update_readme(root)?;
    }
    Ok(ExitCode::SUCCESS)
}

const START: &str = "<!-- bench:start -->";
const END: &str = "<!-- bench:end -->";

/// `readme` with the text between the markers replaced by `section`; `None` without markers.
fn splice(readme: &str, section: &str) -> Option<String> {
    let start = readme.find(START)? + START.len();
    let end = readme[start..].find(END)? + start;
    Some(format!("{}\n{section}{}", &readme[..start], &readme[end..]))
}

/// README's performance section is generated: `kp-bench` writes `bench/README-section.md`,
/// this splices it between README's markers (only after a run over every group into the
/// default directory).
fn update_readme(root: &std::path::Path) -> anyhow::Result<()> {
    let section = std::fs::read_to_string(root.join("bench/README-section.md"))
        .context("reading bench/README-section.md")?;
    let path = root.join("README.md");
    let readme = std::fs::read_to_string(&path).context("reading README.md")?;
    let Some(updated) = splice(&readme, &section) else {
        bail!("README.md has no {START} … {END} section to update");
    };
    std::fs::write(&path, updated).context("writing README.md")?;
    println!("bench: README.md performance section updated");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_run_hands_its_options_to_kp_bench() {
        let args = |quick, out: Option<&str>, only: Option<&str>| Args {
            quick,
            out: out.map(String::from),
            only: only.map(String::from),
            ipvs_guest: false,
        };
        assert!(args(false, None, None).kp_bench_args().is_empty());
        assert_eq!(
            args(true, Some("/tmp/b"), Some("packet,soak")).kp_bench_args(),
            ["--quick", "--out", "/tmp/b", "--only", "packet,soak"]
        );
    }

    #[test]
    fn splice_replaces_only_the_marked_text() {
        let readme = format!("a\n{START}\nold\n{END}\nb\n");
        assert_eq!(
            splice(&readme, "new\n").unwrap(),
            format!("a\n{START}\nnew\n{END}\nb\n")
        );
        assert_eq!(splice("no markers", "x"), None);
    }
}
