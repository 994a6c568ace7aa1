//! Settings of the agent's own process (`--oom-score-adj`).

use tracing::info;

/// Writes `value` to `/proc/self/oom_score_adj` (`--oom-score-adj`, upstream default -999).
pub fn apply_oom_score_adj(value: i32) -> std::io::Result<()> {
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
