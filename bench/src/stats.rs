//! Order statistics of a figure's samples.

/// Median, p90, p99 (nearest rank), mean, min, max of a sample set.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        if samples.is_empty() {
            return Summary::default();
        }
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        Summary {
            n: v.len(),
            median: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            min: v[0],
            max: v[v.len() - 1],
        }
    }
}

/// Nearest-rank percentile of sorted `v` (non-empty).
fn percentile(v: &[f64], p: f64) -> f64 {
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        let s = Summary::of(&v);
        assert_eq!((s.median, s.p90, s.p99), (50.0, 90.0, 99.0));
        assert_eq!((s.min, s.max, s.n), (1.0, 100.0, 100));
        assert_eq!(Summary::of(&[3.0, 1.0, 2.0]).median, 2.0);
        assert_eq!(Summary::of(&[]).n, 0);
    }
}
