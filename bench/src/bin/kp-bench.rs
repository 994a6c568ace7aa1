//! `kp-bench [--quick] [--out DIR] [--only GROUP,…] [--commit SHA]`: runs kproxy's
//! benchmarks (see `kproxy_bench`) and writes the report into DIR (default `bench/`).
//! Needs root. `cargo xtask bench` builds everything in release mode and runs this. The
//! command line is `kproxy_bench::cli::Args` (`kp-bench --help`).
//!
//! The ipvs figures (the host kernel has no IPVS) come from two more invocations, both driven
//! by `cargo xtask bench --ipvs-guest`:
//! - `kp-bench --in-guest [--commit SHA]` runs inside the QEMU guest: the connect and control
//!   groups for ipvs ([`Plan::ipvs_guest`]), printing the results JSON between
//!   [`GUEST_JSON_BEGIN`] / [`GUEST_JSON_END`] on stdout;
//! - `kp-bench --merge-guest FILE --accel ACCEL --guest-seconds S [--out DIR]` (host) merges
//!   that JSON (FILE is the guest's output) into DIR's `results.json` (replacing an earlier guest run's figures) and
//!   rewrites the report (a DIR other than `bench` without a `results.json` gets the guest
//!   figures alone).

use std::time::{Instant, SystemTime};

use anyhow::Context as _;
use clap::Parser as _;
use kproxy_bench::cli::Args;
use kproxy_bench::{
    GUEST_JSON_BEGIN, GUEST_JSON_END, Machine, Plan, Results, connect, control, guest_json,
    inspect, iptables_foreign, maglev, nftables, packet, report, soak, throughput,
};

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(file) = &args.merge_guest {
        return merge_guest(file, &args.out, &args.accel, args.guest_seconds);
    }
    anyhow::ensure!(
        nix::unistd::geteuid().is_root(),
        "kp-bench needs root (namespaces, BPF)"
    );
    let (quick, in_guest) = (args.quick, args.in_guest);
    let wanted = |g: &str| args.wanted(g);
    let mut plan = if in_guest {
        Plan::ipvs_guest()
    } else {
        Plan::new(quick)
    };
    let start = Instant::now();
    let mut results = Results {
        commit: args.commit.clone().unwrap_or_else(git_commit),
        started_unix: SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)?
            .as_secs(),
        quick,
        only: args.only_text(),
        machine: machine(),
        ..Default::default()
    };
    if !in_guest {
        // ipvs runs where the kernel has it; on a host without, it is measured in the guest.
        match kproxy::dataplane::ipvs::usable() {
            Ok(()) => plan.modes.push("ipvs".into()),
            Err(e) => {
                let why = format!(
                    "this kernel has no usable IPVS ({e}); `cargo xtask bench --ipvs-guest` \
                     measures ipvs in a QEMU guest and merges it into this report"
                );
                if wanted("connect") {
                    for &n in &plan.connect_scales {
                        results.unavailable(format!("connect/ipvs/{n}"), &why);
                    }
                }
                if wanted("control") {
                    results.unavailable(format!("cold-start/ipvs/{}", plan.cold_services), &why);
                }
            }
        }
    }
    let group = |name: &str,
                 results: &mut Results,
                 f: &dyn Fn(&Plan, &mut Results) -> anyhow::Result<()>|
     -> anyhow::Result<()> {
        if !wanted(name) {
            return Ok(());
        }
        let t = Instant::now();
        f(&plan, results)?;
        results
            .group_seconds
            .insert(name.to_string(), t.elapsed().as_secs_f64());
        Ok(())
    };
    if !in_guest {
        group("packet", &mut results, &packet::run)?;
    }
    group("connect", &mut results, &connect::run)?;
    group("control", &mut results, &control::run)?;
    if !in_guest {
        group("maglev", &mut results, &maglev::run)?;
        group("throughput", &mut results, &throughput::run)?;
        group("resync", &mut results, &nftables::resync)?;
    }
    // Minutes each: in a full run, or when named (a plain --quick run skips them).
    let named = |g: &str| args.named(g);
    for (name, f) in [
        (
            "inspect",
            &inspect::run as &dyn Fn(&Plan, &mut Results) -> anyhow::Result<()>,
        ),
        ("soak", &soak::run),
        (iptables_foreign::GROUP, &iptables_foreign::run),
    ] {
        if !in_guest && (!quick || named(name)) {
            group(name, &mut results, f)?;
        }
    }
    results.duration_s = start.elapsed().as_secs_f64();
    if in_guest {
        // The guest has no way back but its output port.
        println!("{GUEST_JSON_BEGIN}");
        println!("{}", serde_json::to_string(&results)?);
        println!("{GUEST_JSON_END}");
        return Ok(());
    }
    report::write(&results, &args.out)?;
    eprintln!(
        "kp-bench: {} figures, {} unavailable, {:.0} s; report in {}",
        results.figures.len(),
        results.unavailable.len(),
        results.duration_s,
        args.out.join("REPORT.md").display()
    );
    Ok(())
}

/// Merges a guest run's results (`--in-guest` output) into `out`'s `results.json` and rewrites
/// the report.
fn merge_guest(
    file: &std::path::Path,
    out: &std::path::Path,
    accel: &str,
    seconds: f64,
) -> anyhow::Result<()> {
    let read = |p: &std::path::Path| -> anyhow::Result<Results> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    };
    let output =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    let json = guest_json(&output).with_context(|| {
        format!(
            "{} holds no results between {GUEST_JSON_BEGIN} and {GUEST_JSON_END}",
            file.display()
        )
    })?;
    let guest: Results = serde_json::from_str(json).context("parsing the guest's results")?;
    let path = out.join("results.json");
    let mut results = if path.exists() || out == std::path::Path::new("bench") {
        read(&path).with_context(|| {
            format!(
                "no host run to merge into: run `cargo xtask bench` first ({})",
                path.display()
            )
        })?
    } else {
        // A scratch directory without a host run: the guest figures alone.
        eprintln!(
            "kp-bench: no {}: writing the guest figures alone",
            path.display()
        );
        Results {
            commit: guest.commit.clone(),
            started_unix: guest.started_unix,
            machine: machine(),
            ..Default::default()
        }
    };
    results.merge_guest(guest, accel, seconds);
    report::write(&results, out)?;
    eprintln!(
        "kp-bench: guest figures merged; {} figures, {} unavailable; report in {}",
        results.figures.len(),
        results.unavailable.len(),
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
