//! Settings of the agent's own process (`--oom-score-adj`, the allocator's mmap threshold).

use tracing::info;

/// glibc serves allocations of at least this size from mappings of their own.
pub(crate) const MMAP_THRESHOLD: i32 = 128 * 1024;

/// Fixes glibc's mmap threshold at its default (`M_MMAP_THRESHOLD`, `MMAP_THRESHOLD`):
/// left dynamic, glibc raises it to the size of each mapped block freed (the kernel's BTF
/// parsed at load, 4.7 MB, the list pages), after which the first sync's large temporaries
/// land in the heap, where they leave holes the kernel never gets back. Fixed, they are mapped
/// and unmapped: the agent's peak RSS at 10k services × 5 endpoints is about 1 MB lower and no
/// longer depends on the order in which loading and listing freed their buffers. Called by
/// `main` before any thread starts, beside the arena limit: a process-wide allocator policy,
/// set before the first large buffer is freed (the agent as a library leaves it alone).
pub fn fix_mmap_threshold() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes glibc's allocation policy; it is thread-safe.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Writes `value` to `/proc/self/oom_score_adj` (`--oom-score-adj`, upstream default -999).
pub(crate) fn apply_oom_score_adj(value: i32) -> std::io::Result<()> {
    if !(-1000..=1000).contains(&value) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("oomScoreAdj {value} is outside [-1000, 1000]"),
        ));
    }
    std::fs::write("/proc/self/oom_score_adj", value.to_string())?;
    info!(oom_score_adj = value, "set /proc/self/oom_score_adj");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_score_adj_is_written_and_range_checked() {
        // Writing the current value back exercises the write without changing the process.
        let current: i32 = std::fs::read_to_string("/proc/self/oom_score_adj")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        apply_oom_score_adj(current).unwrap();
        let after: i32 = std::fs::read_to_string("/proc/self/oom_score_adj")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert_eq!(after, current);
        for bad in [-1001, 1001] {
            let e = apply_oom_score_adj(bad).unwrap_err();
            assert!(e.to_string().contains(&bad.to_string()), "{e}");
        }
    }
}
