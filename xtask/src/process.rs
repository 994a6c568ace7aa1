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

/// `$CARGO` (or `cargo`) without the variables `cargo run` set for xtask itself
/// (`CARGO_PKG_*`, `CARGO_MANIFEST_*`, `CARGO_CRATE_NAME`, …). Build scripts such as ring's
/// declare `rerun-if-env-changed` on some of them, so a nested cargo that inherits xtask's
/// values rebuilds those crates and everything above them (kube, kproxy: ≈ 80 s here), and
/// the next plain `cargo test` rebuilds them back.
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if is_cargo_run_variable(&key) {
            cmd.env_remove(&*key);
        }
    }
    cmd
}

/// Whether `cargo run` sets `key` for the program it runs (the package's own metadata).
fn is_cargo_run_variable(key: &str) -> bool {
    key.starts_with("CARGO_PKG_")
        || key.starts_with("CARGO_MANIFEST_")
        || matches!(
            key,
            "CARGO_CRATE_NAME" | "CARGO_BIN_NAME" | "CARGO_PRIMARY_PACKAGE"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_the_package_metadata_cargo_run_sets_but_not_cargo_itself() {
        for key in [
            "CARGO_PKG_NAME",
            "CARGO_PKG_VERSION_MAJOR",
            "CARGO_MANIFEST_DIR",
            "CARGO_MANIFEST_LINKS",
            "CARGO_CRATE_NAME",
        ] {
            assert!(is_cargo_run_variable(key), "{key}");
        }
        for key in ["CARGO", "CARGO_HOME", "CARGO_TARGET_DIR", "RUSTFLAGS"] {
            assert!(!is_cargo_run_variable(key), "{key}");
        }
    }
}
