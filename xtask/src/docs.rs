//! `cargo xtask docs`: builds the user guide (`docs/`, an mdBook) into `<target>/book/`.
//!
//! 1. mdbook [`crate::setup::MDBOOK_VERSION`], installed when missing
//!    ([`crate::setup::ensure_mdbook`]).
//! 2. The configuration reference page (`docs/src/reference.md`) is regenerated from the code:
//!    `cargo run -p kproxy -- reference` (a hidden command printing
//!    `kproxy::cli::reference::markdown`). A unit test there fails when the committed page
//!    differs, so a stale page is caught by `cargo test` even where this command did not run.
//! 3. `mdbook build docs --dest-dir <target>/book` (a chapter missing from `docs/src` fails
//!    the build: `create-missing = false`).
//!
//! `cargo xtask test` runs the same build after the test suite, so CI builds the book.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context as _, bail};

use crate::process::{display, run_step};

/// The generated page, relative to the workspace root (`kproxy::cli::reference::PAGE`).
const REFERENCE_PAGE: &str = "docs/src/reference.md";

pub fn run() -> anyhow::Result<ExitCode> {
    let book = build()?;
    println!(
        "docs: the user guide is {}",
        book.join("index.html").display()
    );
    Ok(ExitCode::SUCCESS)
}

/// Regenerates the reference page and builds the book; returns the output directory.
pub fn build() -> anyhow::Result<PathBuf> {
    let root = crate::workspace_root();
    crate::setup::ensure_mdbook()?;
    let mdbook = crate::setup::mdbook_path().context("mdbook is not installed")?;
    write_reference(&root)?;
    let out = crate::target_dir().join("book");
    run_step(
        "docs",
        Command::new(&mdbook)
            .arg("build")
            .arg(root.join("docs"))
            .arg("--dest-dir")
            .arg(&out),
    )?;
    let pages = html_pages(&out)?;
    if pages.is_empty() {
        bail!("mdbook wrote no HTML page into {}", out.display());
    }
    println!(
        "docs: {} pages in {}: {}",
        pages.len(),
        out.display(),
        pages.join(" ")
    );
    Ok(out)
}

/// Writes `kproxy reference` into [`REFERENCE_PAGE`], saying whether it changed.
fn write_reference(root: &Path) -> anyhow::Result<()> {
    let mut cmd = crate::process::cargo();
    cmd.args([
        "run",
        "--quiet",
        "--package",
        "kproxy",
        "--bin",
        "kproxy",
        "--",
        "reference",
    ])
    .current_dir(root);
    println!("docs: $ {}", display(&cmd));
    let out = cmd
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("spawning {}", display(&cmd)))?;
    if !out.status.success() {
        bail!("{} failed ({})", display(&cmd), out.status);
    }
    let page = String::from_utf8(out.stdout).context("kproxy reference printed non-UTF-8")?;
    if !page.starts_with("# Configuration reference") {
        bail!("`kproxy reference` printed something else than the reference page");
    }
    let path = root.join(REFERENCE_PAGE);
    let before = std::fs::read_to_string(&path).unwrap_or_default();
    if before == page {
        println!("docs: {REFERENCE_PAGE} is current");
    } else {
        std::fs::write(&path, &page).with_context(|| format!("writing {}", path.display()))?;
        println!("docs: {REFERENCE_PAGE} regenerated (commit it)");
    }
    Ok(())
}

/// The `.html` files directly in `dir`, sorted.
fn html_pages(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut pages: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".html"))
        .collect();
    pages.sort();
    Ok(pages)
}
