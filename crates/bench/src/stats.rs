//! What one policy's run measured, in the form `results.json` carries it, and the arithmetic
//! behind it: nearest-rank quantiles, load imbalance, GPU time to energy and money.
//!
//! Invariants: quantiles are `None` without samples, never NaN; every duration is in seconds;
//! GPU-seconds count each GPU of a tensor-parallel replica.

use serde::Serialize;

/// Nearest-rank quantile of unsorted samples (`q` in 0..=1).
pub fn quantile(samples: &[f64], q: f64) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * (v.len() - 1) as f64).round() as usize;
    v.get(rank).copied()
}

/// p50, p90, p99.
pub fn quantiles3(samples: &[f64]) -> [Option<f64>; 3] {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    v.sort_by(f64::total_cmp);
    [0.5, 0.9, 0.99].map(|q| {
        if v.is_empty() {
            return None;
        }
        let rank = (q * (v.len() - 1) as f64).round() as usize;
        v.get(rank).copied()
    })
}

/// Most requests on one replica ÷ the mean (1 = perfectly even; 0 without requests).
pub fn imbalance(per_replica: &[u64]) -> f64 {
    let total: u64 = per_replica.iter().sum();
    if total == 0 || per_replica.is_empty() {
        return 0.0;
    }
    let max = per_replica.iter().copied().max().unwrap_or(0) as f64;
    max / (total as f64 / per_replica.len() as f64)
}

/// How GPU time is priced.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Costs {
    /// Power drawn by one GPU while it computes, watts (700 W: an H100 SXM5's board power).
    pub gpu_watts: f64,
    /// Price of one GPU-hour, US dollars.
    pub usd_per_gpu_hour: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            gpu_watts: 700.0,
            usd_per_gpu_hour: 2.0,
        }
    }
}

impl Costs {
    pub fn kwh(&self, gpu_secs: f64) -> f64 {
        gpu_secs * self.gpu_watts / 3.6e6
    }

    pub fn usd(&self, gpu_secs: f64) -> f64 {
        gpu_secs / 3600.0 * self.usd_per_gpu_hour
    }
}

/// Per-replica outstanding requests over time.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadTimeline {
    /// Sample times, seconds from the run's start.
    pub t: Vec<f64>,
    /// `per_replica[r][i]`: requests routed to replica `r` and not finished at `t[i]`.
    pub per_replica: Vec<Vec<u32>>,
}

impl LoadTimeline {
    pub fn new(replicas: usize) -> Self {
        LoadTimeline {
            t: Vec::new(),
            per_replica: vec![Vec::new(); replicas],
        }
    }

    pub fn push(&mut self, t: f64, outstanding: &[u32]) {
        self.t.push(t);
        for (series, v) in self.per_replica.iter_mut().zip(outstanding) {
            series.push(*v);
        }
    }
}

/// One policy's figures, as `results.json` lists them. Fields a mode cannot measure are
/// `None` (JSON `null`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    /// Requests issued, finished, failed.
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Prompt tokens looked up in the prefix cache, and those found there.
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`: the fraction of prompt tokens served from cache.
    pub hit_rate: f64,
    /// Where the hit figures come from: `engine counters`, `replica metrics`, `usage`.
    pub hit_source: String,
    pub ttft_p50_s: Option<f64>,
    pub ttft_p90_s: Option<f64>,
    pub ttft_p99_s: Option<f64>,
    pub ttft_mean_s: Option<f64>,
    pub itl_p50_s: Option<f64>,
    pub itl_p90_s: Option<f64>,
    pub itl_p99_s: Option<f64>,
    pub e2e_p50_s: Option<f64>,
    pub e2e_p90_s: Option<f64>,
    pub e2e_p99_s: Option<f64>,
    /// From the first arrival to the last completion, seconds (simulated or wall).
    pub duration_s: f64,
    pub throughput_rps: f64,
    pub output_tok_s: f64,
    /// Most requests on one replica ÷ the mean; `None` when replicas are not observable.
    pub imbalance: Option<f64>,
    pub per_replica_requests: Vec<u64>,
    /// GPU-seconds the timing model charges for prefilling the uncached prompt tokens.
    pub prefill_gpu_s: Option<f64>,
    /// GPU-seconds of every engine step (prefill and decode).
    pub busy_gpu_s: Option<f64>,
    /// Time the engines spent stepping (prefill or decode) ÷ (replicas × duration): any
    /// running request keeps an engine stepping, so this is occupancy, not compute saturation.
    pub utilization: Option<f64>,
    pub prefill_kwh: Option<f64>,
    pub prefill_usd: Option<f64>,
    /// Round-robin's prefill GPU-seconds minus this policy's (positive = saved), when
    /// round-robin ran on the same workload.
    pub prefill_gpu_s_saved_vs_rr: Option<f64>,
    pub kwh_saved_vs_rr: Option<f64>,
    pub usd_saved_vs_rr: Option<f64>,
    pub preemptions: Option<u64>,
    /// Wall-clock seconds the run took.
    pub wall_s: f64,
}

impl PolicyResult {
    /// An empty result for `policy`, to be filled in by a runner.
    pub fn empty(policy: &str) -> Self {
        PolicyResult {
            policy: policy.to_string(),
            requests: 0,
            completed: 0,
            failed: 0,
            prompt_tokens: 0,
            cached_tokens: 0,
            hit_rate: 0.0,
            hit_source: String::new(),
            ttft_p50_s: None,
            ttft_p90_s: None,
            ttft_p99_s: None,
            ttft_mean_s: None,
            itl_p50_s: None,
            itl_p90_s: None,
            itl_p99_s: None,
            e2e_p50_s: None,
            e2e_p90_s: None,
            e2e_p99_s: None,
            duration_s: 0.0,
            throughput_rps: 0.0,
            output_tok_s: 0.0,
            imbalance: None,
            per_replica_requests: Vec::new(),
            prefill_gpu_s: None,
            busy_gpu_s: None,
            utilization: None,
            prefill_kwh: None,
            prefill_usd: None,
            prefill_gpu_s_saved_vs_rr: None,
            kwh_saved_vs_rr: None,
            usd_saved_vs_rr: None,
            preemptions: None,
            wall_s: 0.0,
        }
    }

    /// Fills the latency fields from raw samples (seconds).
    pub fn set_latencies(&mut self, ttft: &[f64], itl: &[f64], e2e: &[f64]) {
        [self.ttft_p50_s, self.ttft_p90_s, self.ttft_p99_s] = quantiles3(ttft);
        self.ttft_mean_s = (!ttft.is_empty()).then(|| ttft.iter().sum::<f64>() / ttft.len() as f64);
        [self.itl_p50_s, self.itl_p90_s, self.itl_p99_s] = quantiles3(itl);
        [self.e2e_p50_s, self.e2e_p90_s, self.e2e_p99_s] = quantiles3(e2e);
    }

    pub fn set_hits(&mut self, prompt_tokens: u64, cached_tokens: u64, source: &str) {
        self.prompt_tokens = prompt_tokens;
        self.cached_tokens = cached_tokens;
        self.hit_rate = if prompt_tokens == 0 {
            0.0
        } else {
            cached_tokens as f64 / prompt_tokens as f64
        };
        self.hit_source = source.to_string();
    }
}

/// Fills the savings fields of every result against the one named `baseline`.
pub fn fill_savings(results: &mut [PolicyResult], baseline: &str, costs: &Costs) {
    let Some(base) = results
        .iter()
        .find(|r| r.policy == baseline)
        .and_then(|r| r.prefill_gpu_s)
    else {
        return;
    };
    for r in results.iter_mut() {
        if let Some(p) = r.prefill_gpu_s {
            let saved = base - p;
            r.prefill_gpu_s_saved_vs_rr = Some(saved);
            r.kwh_saved_vs_rr = Some(costs.kwh(saved));
            r.usd_saved_vs_rr = Some(costs.usd(saved));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_use_nearest_rank_and_skip_nan() {
        let v: Vec<f64> = (1..=101).map(f64::from).chain([f64::NAN]).collect();
        assert_eq!(quantile(&v, 0.5), Some(51.0));
        assert_eq!(quantiles3(&v), [Some(51.0), Some(91.0), Some(100.0)]);
        assert_eq!(quantile(&[], 0.5), None);
    }

    #[test]
    fn imbalance_and_costs() {
        assert_eq!(imbalance(&[10, 10, 10, 10]), 1.0);
        assert_eq!(imbalance(&[40, 0, 0, 0]), 4.0);
        assert_eq!(imbalance(&[]), 0.0);
        let c = Costs::default();
        assert!((c.kwh(3600.0) - 0.7).abs() < 1e-12);
        assert!((c.usd(1800.0) - 1.0).abs() < 1e-12);
        let mut rs = vec![PolicyResult::empty("round-robin"), PolicyResult::empty("x")];
        rs[0].prefill_gpu_s = Some(100.0);
        rs[1].prefill_gpu_s = Some(60.0);
        fill_savings(&mut rs, "round-robin", &c);
        assert_eq!(rs[1].prefill_gpu_s_saved_vs_rr, Some(40.0));
        assert_eq!(rs[0].prefill_gpu_s_saved_vs_rr, Some(0.0));
    }
}
