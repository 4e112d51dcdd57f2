//! The data behind `/dashboard`, `/debug/dashboard` and `/debug/savings`: the savings since
//! start, and a short history of fleet-wide rates sampled from the router's own `/metrics`
//! page, so that every number the dashboard draws is one `/metrics` also exposes.
//!
//! Invariants: the history is a ring of at most [`HISTORY_LEN`] points (memory does not grow
//! with uptime); a point's rates are differences of counters between two samples, never
//! counters since start; sampling reads the metrics registry and the fleet snapshot and changes
//! no routing state.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use kinference_vllm::metrics::text;

use crate::api::{
    BaselineSavings, HistoryPoint, PoolSavings, ReplicaLoad, SavingsFigures, SavingsResponse,
};
use crate::fleet::Fleet;
use crate::savings::Prices;

/// Points kept: ten minutes at one a second.
pub(crate) const HISTORY_LEN: usize = 600;
/// Time between two points.
pub(crate) const INTERVAL: Duration = Duration::from_secs(1);

/// The counters of one `/metrics` page the history is made of.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Totals {
    requests: f64,
    predicted_cached: f64,
    reported_cached: f64,
    routed_prompt: f64,
    /// `kinference_first_byte_seconds` summed over routes and replicas: (le, cumulative count),
    /// by `le` ascending.
    first_byte: Vec<(f64, f64)>,
    /// `kinference_decisions` summed over pools and policies.
    reasons: BTreeMap<String, u64>,
}

impl Totals {
    /// Reads the counters from a page the router rendered (lines it cannot read are skipped).
    pub fn from_page(page: &str) -> Totals {
        let mut t = Totals::default();
        let mut buckets: BTreeMap<u64, (f64, f64)> = BTreeMap::new();
        for s in text::parse(page).flatten() {
            match s.name {
                "kinference_requests_total" => t.requests += s.value,
                "kinference_routed_prompt_tokens_total" => t.routed_prompt += s.value,
                "kinference_cached_tokens_total" => match s.label("kind").as_deref() {
                    Some("predicted") => t.predicted_cached += s.value,
                    Some("actual") => t.reported_cached += s.value,
                    _ => {}
                },
                "kinference_decisions_total" => {
                    if let Some(r) = s.label("reason") {
                        *t.reasons.entry(r.into_owned()).or_default() += s.value as u64;
                    }
                }
                "kinference_first_byte_seconds_bucket" => {
                    let le = s.label("le").and_then(|v| match v.as_ref() {
                        "+Inf" => Some(f64::INFINITY),
                        v => v.parse::<f64>().ok(),
                    });
                    if let Some(le) = le {
                        // Keyed by the bits of a non-negative float, which sort as the floats do.
                        let e = buckets.entry(le.to_bits()).or_insert((le, 0.0));
                        e.1 += s.value;
                    }
                }
                _ => {}
            }
        }
        t.first_byte = buckets.into_values().collect();
        t
    }
}

/// The `q` quantile (0..=1) of a histogram given as cumulative counts by upper bound, `le`
/// ascending (the last may be `+Inf`), interpolated linearly inside the bucket it falls in as
/// Prometheus' `histogram_quantile` does; `None` without observations.
pub(crate) fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let mut lower = (0.0, 0.0);
    for &(le, count) in buckets {
        if count >= rank && count > lower.1 {
            if le.is_infinite() {
                return Some(lower.0);
            }
            let within = (rank - lower.1) / (count - lower.1);
            return Some(lower.0 + (le - lower.0) * within);
        }
        lower = (le, count);
    }
    Some(lower.0)
}

/// Bucket counts of `now` minus those of `before` (a histogram over the interval); buckets
/// that went back (a series removed with its replica) count as zero.
fn bucket_delta(now: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    now.iter()
        .map(|&(le, c)| {
            let prev = before
                .iter()
                .find(|(l, _)| l.to_bits() == le.to_bits())
                .map_or(0.0, |p| p.1);
            (le, (c - prev).max(0.0))
        })
        .collect()
}

/// The sampled history: the last [`HISTORY_LEN`] points and the counters of the latest.
#[derive(Debug, Default)]
pub(crate) struct History {
    points: VecDeque<HistoryPoint>,
    last: Option<(f64, Totals)>,
}

impl History {
    /// Adds the point that ends at `t` (seconds since start): rates against the previous
    /// sample; the first sample only sets the baseline.
    pub fn push(&mut self, t: f64, totals: Totals, saved_gpu_seconds: f64, load: Vec<ReplicaLoad>) {
        if let Some((t0, before)) = &self.last {
            let dt = t - t0;
            if dt > 0.0 {
                let prompt = (totals.routed_prompt - before.routed_prompt).max(0.0);
                let rate = |now: f64, then: f64| {
                    (prompt > 0.0).then(|| ((now - then).max(0.0) / prompt).min(1.0))
                };
                let fb = bucket_delta(&totals.first_byte, &before.first_byte);
                let ms = |q| quantile(&fb, q).map(|s| s * 1000.0);
                self.points.push_back(HistoryPoint {
                    t,
                    requests_per_s: (totals.requests - before.requests).max(0.0) / dt,
                    predicted_hit_rate: rate(totals.predicted_cached, before.predicted_cached),
                    reported_hit_rate: rate(totals.reported_cached, before.reported_cached),
                    ttft_p50_ms: ms(0.5),
                    ttft_p90_ms: ms(0.9),
                    ttft_p99_ms: ms(0.99),
                    saved_gpu_seconds,
                    load,
                });
                while self.points.len() > HISTORY_LEN {
                    self.points.pop_front();
                }
            }
        }
        self.last = Some((t, totals));
    }

    pub fn points(&self) -> Vec<HistoryPoint> {
        self.points.iter().cloned().collect()
    }

    /// Decisions by reason as of the last sample.
    pub fn reasons(&self) -> BTreeMap<String, u64> {
        self.last
            .as_ref()
            .map(|(_, t)| t.reasons.clone())
            .unwrap_or_default()
    }
}

/// Each replica's load now, summed over its ranks (read from the replicas themselves: the
/// dashboard samples it every second, and a whole fleet snapshot reads the index too).
pub(crate) fn fleet_loads(fleet: &Fleet) -> Vec<ReplicaLoad> {
    let mut out = Vec::new();
    for pool in &fleet.pools {
        for r in pool.replicas().iter() {
            let loads: Vec<_> = r.workers.iter().map(|w| w.load()).collect();
            out.push(ReplicaLoad {
                replica: r.url().to_owned(),
                running: loads.iter().map(|l| l.running).sum(),
                waiting: loads.iter().map(|l| l.waiting).sum(),
                in_flight: loads.iter().map(|l| l.in_flight).sum(),
                kv_usage: loads.iter().map(|l| l.kv_usage).fold(0.0, f64::max),
            });
        }
    }
    out
}

/// The savings since start, per pool and in total, valued at `prices`, and against each
/// pool's baselines.
pub(crate) fn savings(fleet: &Fleet, prices: Prices) -> SavingsResponse {
    let figures = |observed: u64, prompt: u64, tokens: u64, gpu_seconds: f64| SavingsFigures {
        requests_observed: observed,
        prompt_tokens: prompt,
        saved_prefill_tokens: tokens,
        saved_gpu_seconds: gpu_seconds,
        saved_kwh: prices.kwh(gpu_seconds),
        saved_usd: prices.usd(gpu_seconds),
    };
    let against = |policy: &str, tokens: u64, baseline: f64, saved: f64| {
        let vs = saved - baseline;
        BaselineSavings {
            policy: policy.to_owned(),
            cached_tokens: tokens,
            gpu_seconds: baseline,
            saved_vs_gpu_seconds: vs,
            saved_vs_kwh: prices.kwh(vs),
            saved_vs_usd: prices.usd(vs),
        }
    };
    let pools: Vec<PoolSavings> = fleet
        .pools
        .iter()
        .map(|p| {
            let saved = fleet.metrics.saved(&p.name);
            let names: Vec<&'static str> =
                p.rules().shadows.lock().iter().map(|s| s.name()).collect();
            let baselines = names
                .into_iter()
                .map(|policy| {
                    let b = fleet.metrics.baseline_saved(&p.name, policy);
                    against(policy, b.tokens, b.gpu_seconds, saved.gpu_seconds)
                })
                .collect();
            PoolSavings {
                name: p.name.clone(),
                profile: p.savings.profile.clone(),
                gpus_per_replica: p.savings.gpus,
                figures: figures(
                    fleet.metrics.usage_count(&p.name),
                    fleet.metrics.usage_prompt_tokens(&p.name),
                    saved.tokens,
                    saved.gpu_seconds,
                ),
                baselines,
            }
        })
        .collect();
    let sum = |f: fn(&SavingsFigures) -> f64| pools.iter().map(|p| f(&p.figures)).sum::<f64>();
    let total = figures(
        pools.iter().map(|p| p.figures.requests_observed).sum(),
        pools.iter().map(|p| p.figures.prompt_tokens).sum(),
        pools.iter().map(|p| p.figures.saved_prefill_tokens).sum(),
        sum(|f| f.saved_gpu_seconds),
    );
    // A total against a baseline only covers the pools that compare with it:
    // (policy, cached tokens, the baseline's GPU-seconds, the measured GPU-seconds).
    let mut sums: Vec<(&str, u64, f64, f64)> = Vec::new();
    for p in &pools {
        for b in &p.baselines {
            let i = match sums.iter().position(|t| t.0 == b.policy) {
                Some(i) => i,
                None => {
                    sums.push((&b.policy, 0, 0.0, 0.0));
                    sums.len() - 1
                }
            };
            sums[i].1 += b.cached_tokens;
            sums[i].2 += b.gpu_seconds;
            sums[i].3 += p.figures.saved_gpu_seconds;
        }
    }
    let totals = sums
        .into_iter()
        .map(|(policy, tokens, baseline, saved)| against(policy, tokens, baseline, saved))
        .collect();
    SavingsResponse {
        uptime_secs: fleet.now().as_secs_f64(),
        usd_per_gpu_hour: prices.usd_per_gpu_hour,
        gpu_watts: prices.gpu_watts,
        total,
        baselines: totals,
        pools,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_their_bucket() {
        // 10 observations: 4 up to 0.1 s, 4 more up to 0.2 s, 2 above 0.4 s.
        let b = [(0.1, 4.0), (0.2, 8.0), (0.4, 8.0), (f64::INFINITY, 10.0)];
        // The median (rank 5) is a quarter into the second bucket.
        assert!((quantile(&b, 0.5).unwrap() - 0.125).abs() < 1e-12);
        // Rank 2 is half-way through the first bucket, which starts at 0.
        assert!((quantile(&b, 0.2).unwrap() - 0.05).abs() < 1e-12);
        // In the +Inf bucket: its lower bound, as histogram_quantile answers.
        assert_eq!(quantile(&b, 0.99), Some(0.4));
        assert_eq!(quantile(&[(0.1, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
    }

    const PAGE_1: &str = "\
# TYPE kinference_requests counter
kinference_requests_total{route=\"completions\",replica=\"http://a:1\",status=\"200\"} 10
kinference_requests_total{route=\"completions\",replica=\"http://b:1\",status=\"200\"} 5
kinference_routed_prompt_tokens_total{pool=\"m\"} 1000
kinference_cached_tokens_total{pool=\"m\",kind=\"predicted\"} 400
kinference_cached_tokens_total{pool=\"m\",kind=\"actual\"} 300
kinference_decisions_total{pool=\"m\",policy=\"precise\",reason=\"cached_prefix\"} 9
kinference_decisions_total{pool=\"m\",policy=\"precise\",reason=\"no_cache\"} 6
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://a:1\",le=\"0.1\"} 2
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://a:1\",le=\"+Inf\"} 10
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://b:1\",le=\"0.1\"} 5
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://b:1\",le=\"+Inf\"} 5
";

    const PAGE_2: &str = "\
kinference_requests_total{route=\"completions\",replica=\"http://a:1\",status=\"200\"} 30
kinference_requests_total{route=\"completions\",replica=\"http://b:1\",status=\"200\"} 5
kinference_routed_prompt_tokens_total{pool=\"m\"} 3000
kinference_cached_tokens_total{pool=\"m\",kind=\"predicted\"} 1400
kinference_cached_tokens_total{pool=\"m\",kind=\"actual\"} 1300
kinference_decisions_total{pool=\"m\",policy=\"precise\",reason=\"cached_prefix\"} 29
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://a:1\",le=\"0.1\"} 22
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://a:1\",le=\"+Inf\"} 30
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://b:1\",le=\"0.1\"} 5
kinference_first_byte_seconds_bucket{route=\"completions\",replica=\"http://b:1\",le=\"+Inf\"} 5
";

    #[test]
    fn a_page_sums_over_labels() {
        let t = Totals::from_page(PAGE_1);
        assert_eq!(t.requests, 15.0);
        assert_eq!((t.predicted_cached, t.reported_cached), (400.0, 300.0));
        assert_eq!(t.routed_prompt, 1000.0);
        assert_eq!(t.first_byte, vec![(0.1, 7.0), (f64::INFINITY, 15.0)]);
        assert_eq!(t.reasons["cached_prefix"], 9);
        assert_eq!(t.reasons["no_cache"], 6);
    }

    #[test]
    fn points_are_rates_over_the_interval_and_the_ring_is_bounded() {
        let mut h = History::default();
        h.push(1.0, Totals::from_page(PAGE_1), 0.5, Vec::new());
        assert!(h.points().is_empty(), "the first sample is the baseline");
        h.push(3.0, Totals::from_page(PAGE_2), 0.75, Vec::new());
        let p = &h.points()[0];
        // 20 requests in 2 s; 2000 prompt tokens of which 1000 predicted and 1000 reported.
        assert_eq!(p.requests_per_s, 10.0);
        assert_eq!(p.predicted_hit_rate, Some(0.5));
        assert_eq!(p.reported_hit_rate, Some(0.5));
        // 20 first bytes in the interval, all of them within 0.1 s: p50 at rank 10 of 20.
        assert!((p.ttft_p50_ms.unwrap() - 50.0).abs() < 1e-9);
        assert_eq!(p.saved_gpu_seconds, 0.75);
        assert_eq!(h.reasons()["cached_prefix"], 29);
        for i in 0..(HISTORY_LEN + 10) {
            h.push(4.0 + i as f64, Totals::from_page(PAGE_2), 1.0, Vec::new());
        }
        assert_eq!(h.points().len(), HISTORY_LEN);
        // Nothing changed: no rate, no hit rate, no latency.
        let last = h.points().pop().unwrap();
        assert_eq!(last.requests_per_s, 0.0);
        assert_eq!(last.predicted_hit_rate, None);
        assert_eq!(last.ttft_p50_ms, None);
    }
}
