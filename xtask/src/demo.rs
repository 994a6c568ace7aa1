//! `cargo xtask demo`: not written yet (the demo topology lands next).

use std::process::ExitCode;

pub fn run(_args: &[String]) -> anyhow::Result<ExitCode> {
    eprintln!("xtask demo: not yet implemented");
    Ok(ExitCode::FAILURE)
}
