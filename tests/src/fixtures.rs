//! Where the copied upstream data lives (see `tests/fixtures/upstream/NOTICE.md`).

use std::path::PathBuf;

/// `tests/fixtures/upstream/<rel>`.
pub fn upstream(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/upstream")
        .join(rel)
}
