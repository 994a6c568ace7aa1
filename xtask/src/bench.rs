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
    if status.success() && !args.iter().any(|a| a == "--out" || a == "--only") {
        update_readme(&root)?;
    }
    Ok(ExitCode::from(
        status.code().map_or(1, |c| u8::try_from(c).unwrap_or(1)),
    ))
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
    fn splice_replaces_only_the_marked_text() {
        let readme = format!("a\n{START}\nold\n{END}\nb\n");
        assert_eq!(
            splice(&readme, "new\n").unwrap(),
            format!("a\n{START}\nnew\n{END}\nb\n")
        );
        assert_eq!(splice("no markers", "x"), None);
    }
}
