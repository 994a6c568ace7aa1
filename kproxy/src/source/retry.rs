//! Retry policy of the kube source's list+watch loops (pure; the loop in
//! [`super::kube`] does the sleeping).
//!
//! - A failure waits a capped, jittered exponential backoff: `FIRST_DELAY` doubling up to
//!   [`MAX_DELAY`], each wait drawn from `[d/2, d]` so watchers of several kinds (and nodes)
//!   do not retry in lockstep. The cap bounds how long a returning API server goes unnoticed.
//! - A 410 Gone (the watch's resource version is no longer served, e.g. the API server came
//!   back with a fresh watch cache) is answered by an immediate re-list, whatever the backoff
//!   has grown to; only a second 410 in a row (a re-list that itself got 410) waits.
//! - The backoff resets once the server answers with data (a listed object, the end of a
//!   list, a watch event); the start of a list does not count, so a list that keeps failing
//!   keeps backing off.
//!
//! Differs from upstream's reflector (client-go: 800 ms doubling to 30 s, jitter 1.0, reset
//! after 2 min of quiet; a 410 waits for the grown backoff like any error): after a 30 s
//! outage that policy relists 30–50 s after the API server is back; this one within
//! [`MAX_DELAY`].

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::Duration;

/// The first retry's (un-jittered) wait.
pub(crate) const FIRST_DELAY: Duration = Duration::from_millis(500);
/// The longest wait between two attempts.
pub const MAX_DELAY: Duration = Duration::from_secs(5);

/// What to do after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Re-list now (a fresh list+watch).
    RelistNow,
    /// Wait this long, then retry where the watcher stands.
    Wait(Duration),
}

/// Backoff state of one list+watch loop.
#[derive(Debug)]
pub(crate) struct Retry {
    /// Failures since the server last answered with data.
    failures: u32,
    /// The last failure was a 410 answered with an immediate re-list.
    relisted_on_gone: bool,
    jitter: RandomState,
    draws: u64,
}

impl Default for Retry {
    fn default() -> Self {
        Self::new()
    }
}

impl Retry {
    pub(crate) fn new() -> Self {
        Retry {
            failures: 0,
            relisted_on_gone: false,
            jitter: RandomState::new(),
            draws: 0,
        }
    }

    /// The server answered with data: the next failure starts from [`FIRST_DELAY`] again.
    pub(crate) fn succeeded(&mut self) {
        self.failures = 0;
        self.relisted_on_gone = false;
    }

    /// A failure; `gone` when it was a 410 Gone.
    pub(crate) fn failed(&mut self, gone: bool) -> Next {
        if gone && !self.relisted_on_gone {
            self.relisted_on_gone = true;
            return Next::RelistNow;
        }
        self.relisted_on_gone = false;
        let ceiling = backoff(self.failures);
        self.failures = self.failures.saturating_add(1);
        Next::Wait(self.jittered(ceiling))
    }

    /// A wait in `[ceiling/2, ceiling]`.
    fn jittered(&mut self, ceiling: Duration) -> Duration {
        let mut h = self.jitter.build_hasher();
        h.write_u64(self.draws);
        self.draws += 1;
        let fraction = (h.finish() >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        ceiling / 2 + ceiling.mul_f64(fraction / 2.0)
    }
}

/// The un-jittered wait after `failures` earlier failures: [`FIRST_DELAY`] × 2^failures,
/// capped at [`MAX_DELAY`].
pub(crate) fn backoff(failures: u32) -> Duration {
    FIRST_DELAY
        .checked_mul(1u32.checked_shl(failures.min(31)).unwrap_or(u32::MAX))
        .map_or(MAX_DELAY, |d| d.min(MAX_DELAY))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(n: Next) -> Duration {
        match n {
            Next::Wait(d) => d,
            Next::RelistNow => panic!("expected a wait, got RelistNow"),
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let ceilings: Vec<u64> = (0..8).map(|f| backoff(f).as_millis() as u64).collect();
        assert_eq!(ceilings, [500, 1000, 2000, 4000, 5000, 5000, 5000, 5000]);
        assert_eq!(backoff(u32::MAX), MAX_DELAY);
        assert!(MAX_DELAY <= Duration::from_secs(10));
    }

    #[test]
    fn waits_are_jittered_within_half_to_full_ceiling_and_never_exceed_the_cap() {
        let mut r = Retry::new();
        let mut seen = std::collections::BTreeSet::new();
        for f in 0..200u32 {
            let d = wait(r.failed(false));
            let ceiling = backoff(f);
            assert!(
                d >= ceiling / 2 && d <= ceiling,
                "failure {f}: {d:?} not in [{:?}, {ceiling:?}]",
                ceiling / 2
            );
            assert!(d <= MAX_DELAY);
            seen.insert(d);
        }
        assert!(seen.len() > 100, "waits vary: {} distinct", seen.len());
    }

    #[test]
    fn success_resets_the_backoff() {
        let mut r = Retry::new();
        for _ in 0..10 {
            r.failed(false);
        }
        r.succeeded();
        assert!(wait(r.failed(false)) <= FIRST_DELAY);
    }

    #[test]
    fn gone_relists_at_once_even_after_a_long_outage() {
        let mut r = Retry::new();
        for _ in 0..20 {
            r.failed(false);
        }
        assert_eq!(r.failed(true), Next::RelistNow);
        // The re-list failing with 410 again waits (no busy loop against a broken server)…
        assert!(wait(r.failed(true)) >= MAX_DELAY / 2);
        // … and a later 410 after another kind of failure re-lists at once again.
        assert_eq!(r.failed(true), Next::RelistNow);
        r.failed(false);
        assert_eq!(r.failed(true), Next::RelistNow);
    }
}
