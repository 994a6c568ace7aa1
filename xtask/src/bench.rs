//! `cargo xtask bench [--quick] [--out DIR] [--only GROUP,…]`: builds the agent and the
//! benchmark runner in release mode and runs `kp-bench` (tests/src/bin/kp-bench.rs; what it
//! measures is documented in `kproxy_tests::bench`). Needs root. Writes `REPORT.md`,
//! `results.json` and SVG plots into DIR (default `bench/`). `--quick` finishes in under
//! 3 minutes; the full run in under 15 on 2 cores.

use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};

use crate::process::{display, is_root};

pub fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    if !is_root() {
        bail!("`cargo xtask bench` needs root (network namespaces, BPF, netfilter)");
    }
    crate::setup::run()?;
    let root = crate::workspace_root();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args([
            "build",
            "--release",
            "--package",
            "kproxy",
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
    let mut bench = Command::new(root.join("target/release/kp-bench"));
    bench.args(args).current_dir(&root);
    println!("bench: $ {}", display(&bench));
    let status = bench
        .status()
        .with_context(|| format!("spawning {}", display(&bench)))?;
    Ok(ExitCode::from(
        status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1)),
    ))
}
