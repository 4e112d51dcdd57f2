//! Simulated time: an instant on the caller's clock, in nanoseconds.
//!
//! The engine never reads a clock; every call that needs "now" takes a [`SimTime`]. The
//! epoch is the caller's choice: tests start at zero, a live shell passes nanoseconds since
//! the Unix epoch so that `KvEventBatch.ts` (seconds as `f64`) looks like vLLM's
//! `time.time()`. Arithmetic saturates instead of overflowing.

use std::fmt;
use std::time::Duration;

/// An instant of simulated time: nanoseconds since the caller's epoch.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SimTime(u64);

impl SimTime {
    pub const ZERO: SimTime = SimTime(0);

    pub const fn from_nanos(nanos: u64) -> Self {
        SimTime(nanos)
    }

    pub const fn from_millis(millis: u64) -> Self {
        SimTime(millis.saturating_mul(1_000_000))
    }

    /// Seconds since the epoch; negative or non-finite values become zero, huge ones saturate.
    pub fn from_secs_f64(secs: f64) -> Self {
        if !secs.is_finite() || secs <= 0.0 {
            return SimTime::ZERO;
        }
        let nanos = secs * 1e9;
        if nanos >= u64::MAX as f64 {
            SimTime(u64::MAX)
        } else {
            SimTime(nanos as u64)
        }
    }

    pub const fn as_nanos(self) -> u64 {
        self.0
    }

    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }

    pub fn saturating_add(self, d: Duration) -> Self {
        let add = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        SimTime(self.0.saturating_add(add))
    }

    /// The time from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: SimTime) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Debug for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SimTime({:.9}s)", self.as_secs_f64())
    }
}

impl fmt::Display for SimTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.6}s", self.as_secs_f64())
    }
}

/// A duration from seconds, clamping negative and non-finite values to zero.
pub(crate) fn duration_from_secs(secs: f64) -> Duration {
    if !secs.is_finite() || secs <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_saturate_and_clamp() {
        assert_eq!(SimTime::from_secs_f64(-1.0), SimTime::ZERO);
        assert_eq!(SimTime::from_secs_f64(f64::NAN), SimTime::ZERO);
        assert_eq!(SimTime::from_secs_f64(1.5).as_nanos(), 1_500_000_000);
        assert_eq!(
            SimTime::from_nanos(u64::MAX)
                .saturating_add(Duration::from_secs(1))
                .as_nanos(),
            u64::MAX
        );
        assert_eq!(
            SimTime::from_millis(5).saturating_since(SimTime::from_millis(7)),
            Duration::ZERO
        );
        assert_eq!(duration_from_secs(-3.0), Duration::ZERO);
        assert_eq!(duration_from_secs(0.25), Duration::from_millis(250));
    }
}
