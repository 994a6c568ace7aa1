//! `kp-bench [--quick] [--out DIR] [--only GROUP,…] [--commit SHA]`: runs kproxy's
//! benchmarks (see `kproxy_tests::bench`) and writes the report into DIR (default `bench/`).
//! Needs root. `cargo xtask bench` builds everything in release mode and runs this.

use std::path::PathBuf;
use std::time::{Instant, SystemTime};

use anyhow::Context as _;
use kproxy_tests::bench::{Machine, Plan, Results, connect, control, maglev, packet, report};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut quick, mut out, mut only, mut commit) = (false, PathBuf::from("bench"), None, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--out" => out = args.next().context("--out needs a directory")?.into(),
            "--only" => only = Some(args.next().context("--only needs groups")?),
            "--commit" => commit = Some(args.next().context("--commit needs a value")?),
            other => anyhow::bail!("unknown argument {other:?} (see the module docs)"),
        }
    }
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "kp-bench needs root (namespaces, BPF)"
    );
    let wanted = |g: &str| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == g));
    let plan = Plan::new(quick);
    let start = Instant::now();
    let mut results = Results {
        commit: commit.unwrap_or_else(git_commit),
        started_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_secs(),
        quick,
        machine: machine(),
        ..Default::default()
    };
    if wanted("packet") {
        packet::run(&plan, &mut results)?;
    }
    if wanted("connect") {
        connect::run(&plan, &mut results)?;
    }
    if wanted("control") {
        control::run(&plan, &mut results)?;
    }
    if wanted("maglev") {
        maglev::run(&plan, &mut results)?;
    }
    results.duration_s = start.elapsed().as_secs_f64();
    report::write(&results, &out)?;
    eprintln!(
        "kp-bench: {} figures, {} unavailable, {:.0} s; report in {}",
        results.figures.len(),
        results.unavailable.len(),
        results.duration_s,
        out.join("REPORT.md").display()
    );
    Ok(())
}

fn git_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

fn machine() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let mem_kb: f64 = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    Machine {
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        memory_gib: mem_kb / 1024.0 / 1024.0,
        cpu_model: read("/proc/cpuinfo")
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
            .unwrap_or_default(),
    }
}
