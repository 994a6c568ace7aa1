//! `cargo xtask bench`: not written yet (see DESIGN.md §4 for what it will measure).

use std::process::ExitCode;

pub fn run(_args: &[String]) -> anyhow::Result<ExitCode> {
    eprintln!("xtask bench: not yet implemented");
    Ok(ExitCode::FAILURE)
}
