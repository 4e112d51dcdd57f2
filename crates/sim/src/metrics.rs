//! What the engine reports about itself, in vLLM's metric vocabulary
//! (vllm/v1/metrics/loggers.py, buckets from vllm/v1/metrics/buckets.py, 0.32).
//!
//! Counters follow vLLM's definitions: `prefix_cache_queries`/`hits` count prompt tokens
//! looked up and found at a request's first admission (re-admissions after preemption are
//! counted apart, as vLLM does); `prompt_tokens` counts a request's prompt when its first
//! token is produced. Histograms keep vLLM's bucket bounds so a shell can expose them as is.

/// vLLM's `REQUEST_LATENCY_BUCKETS` (e2e, queue, prefill, decode), seconds.
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's `TIME_TO_FIRST_TOKEN_BUCKETS`, seconds.
pub const TIME_TO_FIRST_TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `INTER_TOKEN_LATENCY_BUCKETS`, seconds.
pub const INTER_TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

/// A Prometheus-style histogram: per-bucket (non-cumulative) counts, an overflow count,
/// the sum and the number of observations.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    /// `counts[i]` observations fell in `(bounds[i-1], bounds[i]]`; the last entry is `+Inf`.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if !v.is_finite() {
            return;
        }
        let i = self.bounds.partition_point(|b| *b < v);
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    /// Cumulative counts per bound, then `+Inf`, as Prometheus exposes them.
    pub fn cumulative(&self) -> Vec<u64> {
        self.counts
            .iter()
            .scan(0u64, |acc, c| {
                *acc += c;
                Some(*acc)
            })
            .collect()
    }

    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// A snapshot of one engine's gauges, counters and histograms.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineMetrics {
    /// `vllm:num_requests_running`.
    pub num_running: usize,
    /// `vllm:num_requests_waiting` (preempted requests wait too).
    pub num_waiting: usize,
    /// `vllm:kv_cache_usage_perc`, 0..=1.
    pub kv_cache_usage: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Lookups of re-admitted (preempted) requests, kept out of the two counters above.
    pub preempted_prefix_cache_queries: u64,
    pub preempted_prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// `vllm:request_success{finished_reason="length"}`.
    pub requests_finished_length: u64,
    /// `vllm:request_success{finished_reason="stop"}` (stopped by the caller, see
    /// `Engine::stop`).
    pub requests_finished_stop: u64,
    /// `vllm:request_success{finished_reason="abort"}`.
    pub requests_aborted: u64,
    pub steps: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
}

impl EngineMetrics {
    pub(crate) fn new() -> Self {
        EngineMetrics {
            num_running: 0,
            num_waiting: 0,
            kv_cache_usage: 0.0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preempted_prefix_cache_queries: 0,
            preempted_prefix_cache_hits: 0,
            num_preemptions: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            requests_finished_length: 0,
            requests_finished_stop: 0,
            requests_aborted: 0,
            steps: 0,
            ttft: Histogram::new(TIME_TO_FIRST_TOKEN_BUCKETS),
            itl: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
        }
    }

    /// Prefix-cache hit rate over first admissions (hits / queries), 0 without queries.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_cache_queries == 0 {
            0.0
        } else {
            self.prefix_cache_hits as f64 / self.prefix_cache_queries as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_upper_inclusive() {
        let mut h = Histogram::new(INTER_TOKEN_LATENCY_BUCKETS);
        h.observe(0.01);
        h.observe(0.011);
        h.observe(1000.0);
        h.observe(f64::NAN);
        assert_eq!(h.counts[0], 1);
        assert_eq!(h.counts[1], 1);
        assert_eq!(*h.counts.last().unwrap(), 1);
        assert_eq!(h.count, 3);
        assert_eq!(*h.cumulative().last().unwrap(), 3);
        assert!((h.mean().unwrap() - 1000.021 / 3.0).abs() < 1e-9);
    }
}
