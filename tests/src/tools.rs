//! External tools a test runs (`kubectl`, `promtool`): found on `PATH`, or the test is skipped
//! with `skipped: why` — unless [`REQUIRE_KERNEL_ENV`] is `1` (`cargo xtask test`), where a
//! missing tool fails the test, so a CI run cannot pass by skipping. `cargo xtask setup`
//! installs the packages named here.

use std::path::PathBuf;

use crate::netns::REQUIRE_KERNEL_ENV;

/// `program`'s path on `PATH`, else `None` after printing `skipped: …` (or a panic naming the
/// Debian `package` when [`REQUIRE_KERNEL_ENV`] is `1`).
pub fn require_tool(program: &str, package: &str) -> Option<PathBuf> {
    if let Some(found) = find_on_path(program) {
        return Some(found);
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("<unnamed>")
        .to_string();
    let why =
        format!("`{program}` is not installed (Debian package {package}; `cargo xtask setup`)");
    if std::env::var(REQUIRE_KERNEL_ENV).is_ok_and(|v| v == "1") {
        panic!("{test}: {why} (and {REQUIRE_KERNEL_ENV}=1)");
    }
    eprintln!("skipped: {test}: {why}");
    None
}

/// The first `program` file in a `PATH` directory.
pub fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| p.is_file())
}
