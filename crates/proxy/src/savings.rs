//! What cache hits save: prefill tokens not recomputed, the GPU-seconds they would have cost,
//! and that time in energy and money. Pure arithmetic (no clock, no I/O), so every figure can
//! be checked by hand.
//!
//! Invariants: the GPU time comes from the simulator's timing model, with the arithmetic of
//! [`TimingModel::saved_prefill_seconds`], the very function `kinference bench` charges
//! prefill with (to the bit; [`SavingsModel::saved_for`] only computes a prompt's uncached
//! charge once for several counts), so the router's live savings and a benchmark's report of
//! the same requests agree; a replica of a profile spans its tensor-parallel GPUs, and every
//! one of them is counted. The cached tokens are the ones the replica reports
//! (`usage.prompt_tokens_details.cached_tokens`), never the router's prediction: a request
//! whose response reports none saves nothing here.

use kinference_sim::{Profile, ProfileError, TimingModel};
use serde::{Deserialize, Serialize};

/// The timing profile a pool's savings are charged with unless it names another.
pub const DEFAULT_PROFILE: &str = "llama-3.1-8b-h100x1";

/// The GPU time model of one pool's replicas.
#[derive(Clone, Debug, PartialEq)]
pub struct SavingsModel {
    /// The profile's name (`crates/sim/profiles`).
    pub profile: String,
    timing: TimingModel,
    /// GPUs one replica runs on (the profile's tensor-parallel degree).
    pub gpus: u32,
}

/// What a baseline policy would have found cached for one request, had it routed all the
/// traffic (`baselines`; the estimate the savings are compared with).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BaselineGuess {
    /// The baseline's name (`round-robin`, ...).
    pub policy: &'static str,
    pub cached_tokens: u32,
}

/// What one request (or a sum of them) saved.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Saved {
    /// Prompt tokens served from the replica's cache instead of prefilled.
    pub tokens: u64,
    /// GPU-seconds of prefill those tokens would have cost.
    pub gpu_seconds: f64,
}

impl SavingsModel {
    /// A built-in profile by name (`llama-3.1-8b-h100x1`, `codellama-34b-h100x2`).
    pub fn builtin(name: &str) -> Result<SavingsModel, ProfileError> {
        Ok(Self::from_profile(&Profile::builtin(name)?))
    }

    pub fn from_profile(p: &Profile) -> SavingsModel {
        SavingsModel {
            profile: p.name.clone(),
            timing: TimingModel::from_profile(p),
            gpus: p.hardware.tensor_parallel.max(1),
        }
    }

    /// A prompt of `prompt` tokens of which the replica reported `cached` served from cache.
    pub fn saved(&self, prompt: u32, cached: u64) -> Saved {
        self.saved_for(prompt)(cached)
    }

    /// [`SavingsModel::saved`] for one prompt and any number of cached counts (what the replica
    /// reported, what each baseline would have found): the prompt's uncached cost is computed
    /// once. The same arithmetic as [`TimingModel::saved_prefill_seconds`].
    pub fn saved_for(&self, prompt: u32) -> impl Fn(u64) -> Saved + '_ {
        let prompt = prompt as usize;
        let uncached = self.timing.request_prefill_seconds(prompt, 0);
        move |cached| {
            let cached = usize::try_from(cached).unwrap_or(usize::MAX).min(prompt);
            let seconds = (uncached - self.timing.request_prefill_seconds(prompt, cached)).max(0.0);
            Saved {
                tokens: cached as u64,
                gpu_seconds: seconds * f64::from(self.gpus),
            }
        }
    }

    /// GPU-seconds a prompt of `prompt` tokens, `cached` of them served from cache, costs to
    /// prefill: what `kinference bench` charges each request with (a warm's own cost).
    pub fn prefill_gpu_seconds(&self, prompt: u32, cached: u64) -> f64 {
        let prompt = prompt as usize;
        let cached = usize::try_from(cached).unwrap_or(usize::MAX).min(prompt);
        self.timing.request_prefill_seconds(prompt, cached) * f64::from(self.gpus)
    }
}

/// What a GPU-second costs: the settings `savings.usd_per_gpu_hour` and `savings.gpu_watts`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Prices {
    /// Price of one GPU-hour, US dollars (2.0: a typical on-demand H100 rate).
    pub usd_per_gpu_hour: f64,
    /// Power one GPU draws while it computes, watts (700: an H100 SXM5's board power).
    pub gpu_watts: f64,
}

impl Default for Prices {
    fn default() -> Self {
        // The same defaults as `kinference bench` (`--usd-per-gpu-hour`, `--gpu-watts`).
        Prices {
            usd_per_gpu_hour: 2.0,
            gpu_watts: 700.0,
        }
    }
}

impl Prices {
    /// Kilowatt-hours drawn by `gpu_seconds` of GPU time.
    pub fn kwh(&self, gpu_seconds: f64) -> f64 {
        gpu_seconds * self.gpu_watts / 3.6e6
    }

    /// US dollars `gpu_seconds` of GPU time cost.
    pub fn usd(&self, gpu_seconds: f64) -> f64 {
        gpu_seconds / 3600.0 * self.usd_per_gpu_hour
    }

    /// Why these prices cannot be used, if they cannot.
    pub fn problem(&self) -> Option<&'static str> {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(self.usd_per_gpu_hour) {
            Some("usd_per_gpu_hour must be a number >= 0")
        } else if !ok(self.gpu_watts) {
            Some("gpu_watts must be a number >= 0")
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9_f64.max(b.abs() * 1e-9)
    }

    /// The Llama-3.1-8B / H100 profile's per-unit costs, computed here from its published
    /// figures (crates/sim/profiles/llama-3.1-8b-h100x1.toml) rather than read from the model.
    struct Hand {
        per_token: f64,
        per_attention_pair: f64,
        per_kv_token_read: f64,
    }

    impl Hand {
        fn llama_8b() -> Hand {
            let hidden = 4096.0;
            let kv_dim = 8.0 * 128.0;
            // q, o: hidden²; k, v: hidden × kv_dim; gated MLP: 3 × hidden × 14336.
            let layer_params =
                hidden * hidden * 2.0 + hidden * kv_dim * 2.0 + 3.0 * hidden * 14336.0;
            assert_eq!(layer_params, 218_103_808.0);
            let (layers, peak, hbm) = (32.0, 989.4e12, 3.35e12);
            Hand {
                per_token: 2.0 * layers * layer_params / (peak * 0.6646),
                per_attention_pair: 4.0 * layers * 32.0 * 128.0 / (peak * 0.5),
                // K and V, 32 layers, 8 KV heads of 128, 2 bytes.
                per_kv_token_read: 2.0 * 32.0 * 8.0 * 128.0 * 2.0 / (hbm * 0.8),
            }
        }

        /// Prefilling `n` new tokens on `c` cached: linear work, and attention that is either
        /// compute-bound (n·c + n(n+1)/2 pairs) or bound by reading the KV of c + n tokens.
        fn cost(&self, n: f64, c: f64) -> f64 {
            let pairs = n * c + n * (n + 1.0) / 2.0;
            n * self.per_token
                + (pairs * self.per_attention_pair).max((c + n) * self.per_kv_token_read)
        }
    }

    #[test]
    fn a_prefill_costs_what_its_hit_would_save() {
        let m = SavingsModel::builtin(DEFAULT_PROFILE).unwrap();
        let (cold, warm) = (
            m.prefill_gpu_seconds(2048, 0),
            m.prefill_gpu_seconds(2048, 1024),
        );
        assert!(cold > warm && warm > 0.0, "{cold} {warm}");
        assert!(close(cold - warm, m.saved(2048, 1024).gpu_seconds));
        // Cached tokens beyond the prompt are the prompt.
        assert!(close(
            m.prefill_gpu_seconds(64, 1000),
            m.prefill_gpu_seconds(64, 64)
        ));
    }

    #[test]
    fn a_hit_saves_the_prefill_work_of_its_tokens() {
        let m = SavingsModel::builtin(DEFAULT_PROFILE).unwrap();
        let h = Hand::llama_8b();
        assert_eq!(m.gpus, 1);
        for (prompt, cached) in [(4096u32, 2048u64), (1000, 992), (300, 16), (8192, 8192)] {
            let (p, c) = (f64::from(prompt), cached as f64);
            let want = h.cost(p, 0.0) - h.cost(p - c, c);
            let got = m.saved(prompt, cached);
            assert_eq!(got.tokens, cached);
            // The model's step times are whole nanoseconds: two roundings, 1 ns each.
            assert!(
                (got.gpu_seconds - want).abs() < 2e-9 + want * 1e-9,
                "{prompt}/{cached}: {} vs {want}",
                got.gpu_seconds
            );
        }
        // Compute-bound, the hit saves its own tokens' linear work and their attention among
        // themselves: 2048 of 4096 cached saves 2048 * 2 * 32 * 218,103,808 / (989.4e12 *
        // 0.6646) = 43.48 ms + 2048 * 2049 / 2 pairs * 4 * 32 * 32 * 128 / (989.4e12 * 0.5)
        // = 2.22 ms, i.e. 45.70 ms.
        let s = m.saved(4096, 2048).gpu_seconds;
        assert!((s - 0.045_70).abs() < 0.000_01, "{s}");
    }

    /// One prompt charged once for several cached counts gives, to the bit, what the timing
    /// model's own `saved_prefill_seconds` gives each (what `kinference bench` charges).
    #[test]
    fn one_prompt_charged_for_several_counts_is_charged_as_each_alone() {
        for name in [DEFAULT_PROFILE, "codellama-34b-h100x2"] {
            let p = Profile::builtin(name).unwrap();
            let (m, timing) = (
                SavingsModel::from_profile(&p),
                TimingModel::from_profile(&p),
            );
            for prompt in [0u32, 1, 17, 512, 4096, 30_000] {
                let saved = m.saved_for(prompt);
                for cached in [0u64, 1, 16, 511, 4096, 29_999, 1_000_000] {
                    let c = (cached as usize).min(prompt as usize);
                    let want = timing.saved_prefill_seconds(prompt as usize, c) * f64::from(m.gpus);
                    let got = saved(cached);
                    assert_eq!(got.tokens, c as u64);
                    assert_eq!(
                        got.gpu_seconds.to_bits(),
                        want.to_bits(),
                        "{name} {prompt} {cached}"
                    );
                }
            }
        }
    }

    #[test]
    fn nothing_cached_saves_nothing_and_the_hit_is_capped_at_the_prompt() {
        let m = SavingsModel::builtin(DEFAULT_PROFILE).unwrap();
        assert_eq!(m.saved(500, 0), Saved::default());
        assert_eq!(m.saved(0, 0), Saved::default());
        let capped = m.saved(64, 1_000);
        assert_eq!(capped.tokens, 64);
        assert!(close(capped.gpu_seconds, m.saved(64, 64).gpu_seconds));
    }

    #[test]
    fn a_replica_on_two_gpus_counts_both() {
        // CodeLlama-34B on two H100s: the step's work is split over both GPUs, so the step is
        // half as long, but both GPUs are busy for it.
        let m2 = SavingsModel::builtin("codellama-34b-h100x2").unwrap();
        assert_eq!(m2.gpus, 2);
        let p = Profile::builtin("codellama-34b-h100x2").unwrap();
        let m1 = SavingsModel::from_profile(&p.with_tensor_parallel(1).unwrap());
        assert_eq!(m1.gpus, 1);
        let (two, one) = (m2.saved(4096, 2048), m1.saved(4096, 2048));
        // The same FLOPs at the same efficiency: equal GPU-seconds, but for the all-reduce
        // traffic the second GPU adds.
        assert!(two.gpu_seconds >= one.gpu_seconds, "{two:?} {one:?}");
        assert!(two.gpu_seconds < one.gpu_seconds * 1.2, "{two:?} {one:?}");
    }

    #[test]
    fn prices_by_hand() {
        let p = Prices::default();
        // One GPU-hour at 700 W is 0.7 kWh and costs $2.
        assert!(close(p.kwh(3600.0), 0.7));
        assert!(close(p.usd(3600.0), 2.0));
        let q = Prices {
            usd_per_gpu_hour: 3.5,
            gpu_watts: 400.0,
        };
        // 90 GPU-seconds: 90 * 400 / 3.6e6 = 0.01 kWh; 90 / 3600 * 3.5 = $0.0875.
        assert!(close(q.kwh(90.0), 0.01));
        assert!(close(q.usd(90.0), 0.0875));
        assert_eq!(q.problem(), None);
        let bad = Prices {
            usd_per_gpu_hour: -1.0,
            ..q
        };
        assert!(bad.problem().is_some());
        let nan = Prices {
            gpu_watts: f64::NAN,
            ..q
        };
        assert!(nan.problem().is_some());
    }
}
