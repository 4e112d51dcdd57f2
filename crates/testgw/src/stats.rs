//! Gateway counters and the picker-latency record, shared by all requests behind one mutex.
//! Invariant: every counter only grows; a snapshot is a consistent copy taken under the lock.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde::Serialize;

/// Latency samples kept; beyond this the oldest half is dropped so a long soak stays bounded.
const MAX_SAMPLES: usize = 1 << 20;

/// Live counters of one gateway.
#[derive(Debug, Default)]
pub struct Stats {
    inner: Mutex<Counters>,
}

#[derive(Debug, Default)]
struct Counters {
    snapshot: StatsSnapshot,
    latencies: Vec<Duration>,
}

/// A copy of the counters, as `GET /gateway/stats` returns them.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StatsSnapshot {
    /// Client requests received (the stats endpoint excluded).
    pub requests: u64,
    /// First endpoint of each destination list the picker gave, per endpoint.
    pub picks: BTreeMap<String, u64>,
    /// Endpoint that actually answered, per endpoint (fail-open routing included).
    pub served: BTreeMap<String, u64>,
    /// Moves to the next endpoint of a list (connect failure or 503 before any body).
    pub fallbacks: u64,
    pub immediate_responses: u64,
    /// Requests routed by the gateway itself because the picker failed and fail-open is set.
    pub fail_open: u64,
    /// Requests answered 503 because the picker failed and fail-open is not set.
    pub fail_close: u64,
    /// Picks naming an endpoint outside the known pool (answered 503).
    pub invalid_destinations: u64,
    /// Picker exchanges that finished without any destination (answered 503).
    pub no_destination: u64,
    /// Picker streams that failed (unreachable, reset, timeout, protocol violation).
    pub picker_errors: u64,
    /// Requests where every endpoint failed before a response head.
    pub upstream_failures: u64,
    pub picker_latency: LatencySummary,
}

/// Picker latency: from the last request message the picker needed to the response that named
/// the destination. Microseconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_us: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

/// One countable event.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Event {
    Request,
    Fallback,
    Immediate,
    FailOpen,
    FailClose,
    InvalidDestination,
    NoDestination,
    PickerError,
    UpstreamFailure,
}

impl Stats {
    fn lock(&self) -> MutexGuard<'_, Counters> {
        // A panic while holding the lock leaves plain counters; they stay usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn count(&self, event: Event) {
        let mut c = self.lock();
        let s = &mut c.snapshot;
        let field = match event {
            Event::Request => &mut s.requests,
            Event::Fallback => &mut s.fallbacks,
            Event::Immediate => &mut s.immediate_responses,
            Event::FailOpen => &mut s.fail_open,
            Event::FailClose => &mut s.fail_close,
            Event::InvalidDestination => &mut s.invalid_destinations,
            Event::NoDestination => &mut s.no_destination,
            Event::PickerError => &mut s.picker_errors,
            Event::UpstreamFailure => &mut s.upstream_failures,
        };
        *field += 1;
    }

    pub(crate) fn pick(&self, endpoint: &str) {
        *self
            .lock()
            .snapshot
            .picks
            .entry(endpoint.to_owned())
            .or_default() += 1;
    }

    pub(crate) fn served(&self, endpoint: &str) {
        *self
            .lock()
            .snapshot
            .served
            .entry(endpoint.to_owned())
            .or_default() += 1;
    }

    pub(crate) fn picker_latency(&self, d: Duration) {
        let mut c = self.lock();
        if c.latencies.len() >= MAX_SAMPLES {
            c.latencies.drain(..MAX_SAMPLES / 2);
        }
        c.latencies.push(d);
    }

    /// Picker latency samples in arrival order.
    pub fn picker_latencies(&self) -> Vec<Duration> {
        self.lock().latencies.clone()
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let c = self.lock();
        let mut s = c.snapshot.clone();
        s.picker_latency = summarize(&c.latencies);
        s
    }
}

fn summarize(samples: &[Duration]) -> LatencySummary {
    if samples.is_empty() {
        return LatencySummary::default();
    }
    let mut us: Vec<u64> = samples
        .iter()
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .collect();
    us.sort_unstable();
    let n = us.len();
    // Nearest rank: the smallest sample with at least q of the samples at or below it.
    let rank = |q: f64| us[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
    LatencySummary {
        count: n as u64,
        mean_us: us.iter().map(|&v| v as u128).sum::<u128>() as u64 / n as u64,
        p50_us: rank(0.50),
        p90_us: rank(0.90),
        p99_us: rank(0.99),
        max_us: us[n - 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_uses_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let s = summarize(&samples);
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_us, 50);
        assert_eq!(s.p90_us, 90);
        assert_eq!(s.p99_us, 99);
        assert_eq!(s.max_us, 100);
        assert_eq!(s.mean_us, 50);
        assert_eq!(summarize(&[]), LatencySummary::default());
    }

    #[test]
    fn counters_and_maps_accumulate() {
        let stats = Stats::default();
        stats.count(Event::Request);
        stats.count(Event::Request);
        stats.count(Event::Fallback);
        stats.pick("10.0.0.1:8000");
        stats.pick("10.0.0.1:8000");
        stats.served("10.0.0.2:8000");
        stats.picker_latency(Duration::from_micros(7));
        let s = stats.snapshot();
        assert_eq!(s.requests, 2);
        assert_eq!(s.fallbacks, 1);
        assert_eq!(s.picks.get("10.0.0.1:8000"), Some(&2));
        assert_eq!(s.served.get("10.0.0.2:8000"), Some(&1));
        assert_eq!(s.picker_latency.count, 1);
        assert_eq!(stats.picker_latencies(), vec![Duration::from_micros(7)]);
    }
}
