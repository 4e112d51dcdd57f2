//! The timing model: how long one engine step takes for a given batch.
//!
//! A roofline per component, with achieved fractions of the peaks taken from the profile:
//!
//! ```text
//!   linear    = max(FLOP(layers) * T + FLOP(lm_head) * S,  bytes(weights))   / achieved rate
//!   attention = Σ_requests max(FLOP(n new on c cached), bytes(KV of c + n)) / achieved rate
//!   allreduce = 2 * layers * (latency + T * hidden * 2 B * 2(t-1)/t / link)  (t > 1 GPUs)
//!   step      = overhead + linear + attention + allreduce
//! ```
//!
//! with `T` the scheduled tokens of the step and `S` the sampled ones. Prefill cost thus grows
//! with uncached tokens and, through attention, with their context; a decode step costs the
//! weight stream plus a KV read per running request. All work divides evenly over the TP
//! ranks. The result is a simulated duration; speeding up a live run is the shell's business.

use std::time::Duration;

use crate::profile::Profile;
use crate::time::duration_from_secs;

/// One request's share of a step: `new_tokens` computed on top of `context_tokens` already
/// in its KV cache; `samples` when the step ends its prefill or decodes (a token is sampled).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchItem {
    pub new_tokens: u32,
    pub context_tokens: u32,
    pub samples: bool,
}

/// Step durations: a roofline from a [`Profile`], or a fixed duration for tests.
#[derive(Clone, Debug, PartialEq)]
pub enum TimingModel {
    Roofline(Roofline),
    /// Every step that runs anything takes exactly this long.
    Fixed(Duration),
}

/// Precomputed per-unit costs, in seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    per_token: f64,
    per_sampled_token: f64,
    weight_stream: f64,
    per_attention_pair: f64,
    per_kv_token_read: f64,
    allreduce_fixed: f64,
    allreduce_per_token: f64,
    overhead: f64,
    /// [`REFERENCE`]'s step alone, as [`TimingModel::step_duration`] gives it: the same for
    /// every request charged (the router charges each request's savings several times over).
    reference_seconds: f64,
}

/// The compute-bound step a request's prefill is charged against
/// ([`TimingModel::request_prefill_seconds`]).
const REFERENCE: BatchItem = BatchItem {
    new_tokens: 8192,
    context_tokens: 0,
    samples: false,
};

impl TimingModel {
    pub fn from_profile(p: &Profile) -> TimingModel {
        let m = &p.model;
        let h = &p.hardware;
        let e = &p.efficiency;
        let tp = f64::from(h.tensor_parallel);
        let flops = tp * h.peak_dense_tflops * 1e12;
        let linear_rate = flops * e.linear;
        let attention_rate = flops * e.attention;
        let hbm_rate = tp * h.hbm_bandwidth_tb_s * 1e12 * e.hbm;
        let layers = f64::from(m.num_layers);
        let dtype = f64::from(m.dtype_bytes);
        let weights = (m.layer_params() + m.lm_head_params()) as f64 * dtype;
        let (allreduce_fixed, allreduce_per_token) = if h.tensor_parallel > 1 {
            let link = h.interconnect_gb_s * 1e9 * e.interconnect;
            let ring = 2.0 * (tp - 1.0) / tp;
            (
                2.0 * layers * e.allreduce_latency_us * 1e-6,
                2.0 * layers * f64::from(m.hidden_size) * dtype * ring / link,
            )
        } else {
            (0.0, 0.0)
        };
        let mut r = Roofline {
            per_token: 2.0 * m.layer_params() as f64 / linear_rate,
            per_sampled_token: 2.0 * m.lm_head_params() as f64 / linear_rate,
            weight_stream: weights / hbm_rate,
            per_attention_pair: 4.0
                * layers
                * f64::from(m.num_attention_heads)
                * f64::from(m.head_dim)
                / attention_rate,
            per_kv_token_read: m.kv_bytes_per_token() as f64 / hbm_rate,
            allreduce_fixed,
            allreduce_per_token,
            overhead: e.step_overhead_ms * 1e-3,
            reference_seconds: 0.0,
        };
        r.reference_seconds = duration_from_secs(r.step_seconds(&[REFERENCE])).as_secs_f64();
        TimingModel::Roofline(r)
    }

    pub fn fixed(per_step: Duration) -> TimingModel {
        TimingModel::Fixed(per_step)
    }

    /// The simulated duration of a step running `items`; zero for an empty batch.
    pub fn step_duration(&self, items: &[BatchItem]) -> Duration {
        match self {
            TimingModel::Fixed(d) if !items.is_empty() => *d,
            TimingModel::Fixed(_) => Duration::ZERO,
            TimingModel::Roofline(r) => duration_from_secs(r.step_seconds(items)),
        }
    }

    /// Seconds for one uncached prompt of `prompt_tokens`, prefilled in one step.
    pub fn prefill_seconds(&self, prompt_tokens: u32) -> f64 {
        let item = BatchItem {
            new_tokens: prompt_tokens,
            context_tokens: 0,
            samples: true,
        };
        match self {
            TimingModel::Fixed(d) => d.as_secs_f64(),
            TimingModel::Roofline(r) => r.step_seconds(&[item]),
        }
    }

    /// Seconds of GPU compute charged for prefilling `prompt - cached` tokens on top of
    /// `cached` tokens already in the KV cache: the request's linear and attention work,
    /// measured as the difference it makes to a compute-bound reference step, so the per-step
    /// overhead and the weight-streaming floor (paid by every step, prefill or not) cancel out.
    /// Per replica (all its TP ranks at once): multiply by the GPUs for GPU-seconds.
    pub fn request_prefill_seconds(&self, prompt: usize, cached: usize) -> f64 {
        let item = BatchItem {
            new_tokens: u32::try_from(prompt.saturating_sub(cached)).unwrap_or(u32::MAX),
            context_tokens: u32::try_from(cached.min(prompt)).unwrap_or(u32::MAX),
            samples: true,
        };
        let with = self.step_duration(&[REFERENCE, item]).as_secs_f64();
        let without = match self {
            TimingModel::Roofline(r) => r.reference_seconds,
            TimingModel::Fixed(d) => d.as_secs_f64(),
        };
        (with - without).max(0.0)
    }

    /// Seconds of prefill a cache hit of `cached` tokens spares a prompt of `prompt` tokens:
    /// [`TimingModel::request_prefill_seconds`] without the hit minus with it.
    pub fn saved_prefill_seconds(&self, prompt: usize, cached: usize) -> f64 {
        (self.request_prefill_seconds(prompt, 0) - self.request_prefill_seconds(prompt, cached))
            .max(0.0)
    }

    /// Seconds of the per-layer non-attention work for `tokens` (compute-bound term only):
    /// what per-operator measurements such as Vidur's add up to.
    pub fn linear_seconds(&self, tokens: u64) -> f64 {
        match self {
            TimingModel::Fixed(_) => 0.0,
            TimingModel::Roofline(r) => r.per_token * tokens as f64,
        }
    }
}

impl Roofline {
    fn step_seconds(&self, items: &[BatchItem]) -> f64 {
        if items.is_empty() {
            return 0.0;
        }
        let mut tokens = 0.0;
        let mut sampled = 0.0;
        let mut attention = 0.0;
        for it in items {
            let n = f64::from(it.new_tokens);
            let c = f64::from(it.context_tokens);
            tokens += n;
            if it.samples {
                sampled += 1.0;
            }
            let pairs = n * c + n * (n + 1.0) / 2.0;
            let compute = pairs * self.per_attention_pair;
            let read = (c + n) * self.per_kv_token_read;
            attention += compute.max(read);
        }
        let linear =
            (tokens * self.per_token + sampled * self.per_sampled_token).max(self.weight_stream);
        let allreduce = self.allreduce_fixed + tokens * self.allreduce_per_token;
        self.overhead + linear + attention + allreduce
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> TimingModel {
        TimingModel::from_profile(&Profile::builtin(name).unwrap())
    }

    #[test]
    fn prefill_grows_with_tokens_and_context() {
        let m = model("llama-3.1-8b-h100x1");
        let short = m.prefill_seconds(512);
        let long = m.prefill_seconds(8192);
        assert!(long > 10.0 * short, "{short} {long}");
        let cold = BatchItem {
            new_tokens: 512,
            context_tokens: 0,
            samples: true,
        };
        let warm = BatchItem {
            new_tokens: 512,
            context_tokens: 30_000,
            samples: true,
        };
        assert!(m.step_duration(&[warm]) > m.step_duration(&[cold]));
    }

    #[test]
    fn decode_is_weight_bound_and_grows_with_batch_context() {
        let m = model("llama-3.1-8b-h100x1");
        let one = BatchItem {
            new_tokens: 1,
            context_tokens: 1000,
            samples: true,
        };
        let d1 = m.step_duration(&[one]).as_secs_f64();
        // 15.0 GB of weights at 0.8 * 3.35 TB/s plus 1 ms overhead.
        assert!((d1 - 0.0066).abs() < 0.0005, "{d1}");
        let batch = vec![
            BatchItem {
                new_tokens: 1,
                context_tokens: 20_000,
                samples: true
            };
            64
        ];
        assert!(m.step_duration(&batch).as_secs_f64() > 2.0 * d1);
        assert_eq!(m.step_duration(&[]), Duration::ZERO);
    }

    /// The reference step kept with the model is the one `step_duration` gives, to the bit, so
    /// a request's charge is what computing both steps gives.
    #[test]
    fn the_kept_reference_step_is_step_durations() {
        let models = [
            ("llama-3.1-8b-h100x1", model("llama-3.1-8b-h100x1")),
            ("codellama-34b-h100x2", model("codellama-34b-h100x2")),
            ("fixed", TimingModel::fixed(Duration::from_millis(7))),
        ];
        for (name, m) in models {
            let without = m.step_duration(&[REFERENCE]).as_secs_f64();
            for (prompt, cached) in [(0, 0), (1, 0), (512, 0), (4096, 2048), (100_000, 99_999)] {
                let item = BatchItem {
                    new_tokens: prompt - cached,
                    context_tokens: cached,
                    samples: true,
                };
                let with = m.step_duration(&[REFERENCE, item]).as_secs_f64();
                assert_eq!(
                    m.request_prefill_seconds(prompt as usize, cached as usize)
                        .to_bits(),
                    (with - without).max(0.0).to_bits(),
                    "{name} {prompt} {cached}"
                );
            }
        }
    }

    #[test]
    fn fixed_model_charges_only_non_empty_steps() {
        let m = TimingModel::fixed(Duration::from_millis(7));
        let it = BatchItem {
            new_tokens: 3,
            context_tokens: 0,
            samples: false,
        };
        assert_eq!(m.step_duration(&[it]), Duration::from_millis(7));
        assert_eq!(m.step_duration(&[]), Duration::ZERO);
    }
}
