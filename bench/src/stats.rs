//! Order statistics of a figure's samples, and the one way a figure is derived from two
//! measured ones ([`difference`]).

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

/// A quantity derived from two measurements, `a − b`, as the difference of their medians
/// ([`difference`]) — never a difference per sample: the samples of two noisy measurements
/// subtract to anything, negatives included (a round whose `b` came out high gave a node's
/// share of −0.3 ns per packet), and the median of such differences follows the noisiest
/// pairs rather than the two typical values.
///
/// `Err` when the difference is not positive: the quantity is then drowned in the noise of the
/// two measurements, and no figure is better than a negative one.
pub fn difference(a: &[f64], b: &[f64]) -> Result<f64, Drowned> {
    let (ma, mb) = (Summary::of(a).median, Summary::of(b).median);
    let d = ma - mb;
    if a.is_empty() || b.is_empty() || d.is_nan() || d <= 0.0 {
        return Err(Drowned {
            a: ma,
            b: mb,
            n: (a.len(), b.len()),
        });
    }
    Ok(d)
}

/// A [`difference`] that is not positive.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "drowned in noise: median {a:.1} − median {b:.1} ≤ 0 (of {} and {} samples)",
    n.0,
    n.1
)]
pub struct Drowned {
    /// The two medians.
    pub a: f64,
    pub b: f64,
    /// The two sample counts.
    pub n: (usize, usize),
}

/// The interquartile range (nearest rank) of a sample set: how far its middle half spreads.
pub fn iqr(samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    percentile(&v, 75.0) - percentile(&v, 25.0)
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
        assert_eq!(iqr(&[5.0, 1.0, 2.0, 4.0, 3.0]), 2.0);
        assert_eq!(iqr(&[]), 0.0);
    }

    /// Paired rounds whose differences are once negative (a noisy round of `b`): the derived
    /// figure is the difference of the medians, positive.
    #[test]
    fn a_difference_is_of_the_medians_not_per_sample() {
        let a = [610.0, 620.0, 630.0];
        let b = [430.0, 700.0, 440.0];
        assert!(a.iter().zip(&b).any(|(x, y)| x - y < 0.0));
        assert_eq!(difference(&a, &b), Ok(180.0));
        let e = difference(&b, &[500.0, 500.0, 500.0]).unwrap_err();
        assert_eq!((e.a, e.b, e.n), (440.0, 500.0, (3, 3)));
        assert!(e.to_string().starts_with("drowned in noise"), "{e}");
        assert!(difference(&[], &b).is_err());
    }
}
