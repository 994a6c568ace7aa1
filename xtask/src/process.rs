//! Running external commands: echo them, time them, fail with the command line on error.

use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// Prints `<step>: $ <cmd>`, runs it with inherited stdio, and returns how long it took.
pub fn run_step(step: &str, cmd: &mut Command) -> anyhow::Result<Duration> {
    println!("{step}: $ {}", display(cmd));
    let start = Instant::now();
    let status = cmd
        .status()
        .with_context(|| format!("spawning {}", display(cmd)))?;
    let took = start.elapsed();
    if !status.success() {
        bail!("{} failed ({status})", display(cmd));
    }
    println!("{step}: done in {:.1} s", took.as_secs_f64());
    Ok(took)
}

/// Runs `cmd` quietly and returns its stdout when it exits 0.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `VAR=value … program args…` as a shell would show it.
pub fn display(cmd: &Command) -> String {
    let mut parts: Vec<String> = cmd
        .get_envs()
        .filter_map(|(k, v)| Some(format!("{}={}", k.to_string_lossy(), v?.to_string_lossy())))
        .collect();
    parts.push(cmd.get_program().to_string_lossy().into_owned());
    parts.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    parts.join(" ")
}

/// Whether xtask runs as root (`id -u`, keeping xtask free of libc bindings).
pub fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}
