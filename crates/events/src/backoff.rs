//! Capped exponential backoff with jitter for socket errors and failed replays.
//!
//! Invariant: every delay lies in `[cap(n) * (1 - jitter), cap(n)]` where
//! `cap(n) = min(initial * 2^n, max)`; the jitter source is a seeded generator so tests are
//! deterministic, and waiting uses tokio's clock so paused-time tests run instantly.

use std::time::Duration;

/// Retry pacing. `jitter` is the fraction of each delay that is randomised (0 = none, 1 = full).
#[derive(Clone, Debug, PartialEq)]
pub struct BackoffConfig {
    /// First delay.
    pub initial: Duration,
    /// Largest delay.
    pub max: Duration,
    /// Fraction of each delay drawn at random, in `[0, 1]`.
    pub jitter: f64,
}

impl Default for BackoffConfig {
    fn default() -> Self {
        BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(10),
            jitter: 0.5,
        }
    }
}

impl BackoffConfig {
    pub(crate) fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.initial.is_zero() {
            out.push("backoff.initial must be > 0".to_owned());
        }
        if self.max < self.initial {
            out.push("backoff.max must be >= backoff.initial".to_owned());
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            out.push("backoff.jitter must be within [0, 1]".to_owned());
        }
        out
    }
}

/// The state of one retry sequence; [`Backoff::reset`] after a success.
#[derive(Clone, Debug)]
pub struct Backoff {
    config: BackoffConfig,
    attempt: u32,
    rng: u64,
}

impl Backoff {
    pub fn new(config: BackoffConfig, seed: u64) -> Self {
        Backoff {
            config,
            attempt: 0,
            rng: seed,
        }
    }

    /// Failures since the last reset.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    pub fn reset(&mut self) {
        self.attempt = 0;
    }

    /// The delay before the next retry; advances the sequence.
    pub fn next_delay(&mut self) -> Duration {
        let factor = 2u32.saturating_pow(self.attempt.min(31));
        let cap = self
            .config
            .initial
            .checked_mul(factor)
            .map_or(self.config.max, |d| d.min(self.config.max));
        self.attempt = self.attempt.saturating_add(1);
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let jitter = self.config.jitter.clamp(0.0, 1.0);
        cap.mul_f64(1.0 - jitter * unit)
    }

    /// Sleeps for [`Backoff::next_delay`] on tokio's clock.
    pub async fn wait(&mut self) {
        tokio::time::sleep(self.next_delay()).await;
    }

    // splitmix64: tiny, seedable and good enough to spread retries.
    fn next_u64(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(jitter: f64) -> BackoffConfig {
        BackoffConfig {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            jitter,
        }
    }

    #[test]
    fn doubles_until_capped_without_jitter() {
        let mut b = Backoff::new(cfg(0.0), 1);
        let ms: Vec<u128> = (0..8).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::from_millis(100));
    }

    #[test]
    fn jitter_stays_within_bounds_and_varies() {
        let mut b = Backoff::new(cfg(0.5), 42);
        let mut seen = std::collections::HashSet::new();
        for n in 0..200u32 {
            let cap = Duration::from_millis(100)
                .saturating_mul(2u32.saturating_pow(n.min(31)))
                .min(Duration::from_secs(2));
            let d = b.next_delay();
            assert!(
                d <= cap && d >= cap / 2,
                "attempt {n}: {d:?} vs cap {cap:?}"
            );
            seen.insert(d);
        }
        assert!(seen.len() > 100, "jitter should spread delays");
    }

    #[test]
    fn never_overflows() {
        let mut b = Backoff::new(cfg(1.0), 7);
        for _ in 0..1000 {
            assert!(b.next_delay() <= Duration::from_secs(2));
        }
        assert_eq!(b.attempt(), 1000);
    }

    #[tokio::test(start_paused = true)]
    async fn wait_uses_tokio_clock() {
        let start = tokio::time::Instant::now();
        let mut b = Backoff::new(cfg(0.0), 0);
        b.wait().await;
        b.wait().await;
        assert_eq!(start.elapsed(), Duration::from_millis(300));
    }
}
