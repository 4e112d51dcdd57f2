//! GPU/model profiles: the data the timing model runs on, read from TOML files under
//! `profiles/` (embedded with `include_str!`). Each file carries, next to every figure, the
//! published source it comes from or the derivation that produced it.
//!
//! Invariants: a parsed [`Profile`] has positive counts and sizes, finite positive rates, and
//! efficiencies in (0, 1]; anything else is a [`ProfileError`], never a panic.

use serde::Deserialize;

use crate::error::ProfileError;

const LLAMA_31_8B_H100X1: &str = include_str!("../profiles/llama-3.1-8b-h100x1.toml");
const CODELLAMA_34B_H100X2: &str = include_str!("../profiles/codellama-34b-h100x2.toml");

/// The transformer's shape: what sets FLOPs, weight bytes and KV bytes.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub name: String,
    pub num_layers: u32,
    pub hidden_size: u32,
    pub num_attention_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub intermediate_size: u32,
    pub vocab_size: u32,
    /// Bytes per weight and per KV element (2 for BF16).
    pub dtype_bytes: u32,
    /// The model's context length (`max_position_embeddings`), tokens.
    pub max_model_len: u32,
    pub source: String,
}

/// The GPUs one engine runs on.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSpec {
    pub gpu: String,
    /// GPUs per engine (tensor parallel degree).
    pub tensor_parallel: u32,
    /// Dense BF16 tensor throughput per GPU, TFLOP/s.
    pub peak_dense_tflops: f64,
    /// HBM bandwidth per GPU, TB/s.
    pub hbm_bandwidth_tb_s: f64,
    /// GPU-to-GPU link bandwidth each way, GB/s.
    pub interconnect_gb_s: f64,
    pub source: String,
}

/// Achieved fractions of the peaks, and fixed costs.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EfficiencySpec {
    /// Share of peak FLOP/s the per-layer non-attention work achieves in prefill.
    pub linear: f64,
    /// Share of peak FLOP/s the attention kernel achieves in prefill.
    pub attention: f64,
    /// Share of peak HBM bandwidth achieved when streaming weights or KV.
    pub hbm: f64,
    /// Share of the link bandwidth an all-reduce achieves.
    pub interconnect: f64,
    /// Fixed cost of one all-reduce, microseconds.
    pub allreduce_latency_us: f64,
    /// Fixed cost of one engine step, milliseconds.
    pub step_overhead_ms: f64,
}

/// KV-cache capacity of one engine.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheSpec {
    /// Tokens of KV the engine holds (`num_gpu_blocks * block_size`).
    pub tokens: u64,
    pub source: String,
}

/// A figure the profile must reproduce (tests/profiles.rs checks each one).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    /// `prefill_tokens_per_s`, `linear_prefill_tokens_per_s` or `ttft_ms_upper_bound`.
    pub metric: String,
    pub prompt_tokens: u32,
    /// The TP degree the figure was measured at (may differ from the profile's).
    pub tensor_parallel: u32,
    pub value: f64,
    /// Allowed relative deviation.
    pub tolerance: f64,
    pub source: String,
}

/// One GPU/model profile.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub description: String,
    pub model: ModelSpec,
    pub hardware: HardwareSpec,
    pub efficiency: EfficiencySpec,
    pub kv_cache: KvCacheSpec,
    #[serde(default)]
    pub published: Vec<Figure>,
    #[serde(default)]
    pub cross_check: Vec<Figure>,
}

impl Profile {
    /// The names of the embedded profiles.
    pub const BUILTIN: [&'static str; 2] = ["llama-3.1-8b-h100x1", "codellama-34b-h100x2"];

    /// An embedded profile by name.
    pub fn builtin(name: &str) -> Result<Profile, ProfileError> {
        let text = match name {
            "llama-3.1-8b-h100x1" => LLAMA_31_8B_H100X1,
            "codellama-34b-h100x2" => CODELLAMA_34B_H100X2,
            _ => return Err(ProfileError::Unknown(name.to_string())),
        };
        Profile::from_toml(name, text)
    }

    /// Parses and validates a profile; `name` labels errors.
    pub fn from_toml(name: &str, text: &str) -> Result<Profile, ProfileError> {
        let profile: Profile = toml::from_str(text).map_err(|e| ProfileError::Parse {
            name: name.to_string(),
            message: e.to_string(),
        })?;
        profile.validate()?;
        Ok(profile)
    }

    /// The same profile on a different number of GPUs (for checks against figures measured
    /// at another TP degree).
    pub fn with_tensor_parallel(&self, tp: u32) -> Result<Profile, ProfileError> {
        let mut p = self.clone();
        p.hardware.tensor_parallel = tp;
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), ProfileError> {
        let m = &self.model;
        let counts = [
            ("model.num_layers", m.num_layers),
            ("model.hidden_size", m.hidden_size),
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_kv_heads", m.num_kv_heads),
            ("model.head_dim", m.head_dim),
            ("model.intermediate_size", m.intermediate_size),
            ("model.vocab_size", m.vocab_size),
            ("model.dtype_bytes", m.dtype_bytes),
            ("model.max_model_len", m.max_model_len),
            ("hardware.tensor_parallel", self.hardware.tensor_parallel),
        ];
        for (field, v) in counts {
            if v == 0 {
                return Err(self.zero(field));
            }
        }
        if self.kv_cache.tokens == 0 {
            return Err(self.zero("kv_cache.tokens"));
        }
        let h = &self.hardware;
        let e = &self.efficiency;
        self.positive("hardware.peak_dense_tflops", h.peak_dense_tflops)?;
        self.positive("hardware.hbm_bandwidth_tb_s", h.hbm_bandwidth_tb_s)?;
        self.positive("hardware.interconnect_gb_s", h.interconnect_gb_s)?;
        self.non_negative("efficiency.allreduce_latency_us", e.allreduce_latency_us)?;
        self.non_negative("efficiency.step_overhead_ms", e.step_overhead_ms)?;
        for (field, v) in [
            ("efficiency.linear", e.linear),
            ("efficiency.attention", e.attention),
            ("efficiency.hbm", e.hbm),
            ("efficiency.interconnect", e.interconnect),
        ] {
            if !(v.is_finite() && v > 0.0 && v <= 1.0) {
                return Err(ProfileError::Efficiency {
                    name: self.name.clone(),
                    field,
                    value: v,
                });
            }
        }
        Ok(())
    }

    fn zero(&self, field: &'static str) -> ProfileError {
        ProfileError::ZeroCount {
            name: self.name.clone(),
            field,
        }
    }

    fn positive(&self, field: &'static str, value: f64) -> Result<(), ProfileError> {
        if value.is_finite() && value > 0.0 {
            Ok(())
        } else {
            Err(ProfileError::NotPositive {
                name: self.name.clone(),
                field,
                value,
            })
        }
    }

    fn non_negative(&self, field: &'static str, value: f64) -> Result<(), ProfileError> {
        if value.is_finite() && value >= 0.0 {
            Ok(())
        } else {
            Err(ProfileError::NotPositive {
                name: self.name.clone(),
                field,
                value,
            })
        }
    }
}

impl ModelSpec {
    /// Parameters of one decoder layer's matrices (attention projections + gated MLP).
    pub fn params_per_layer(&self) -> u64 {
        let h = u64::from(self.hidden_size);
        let q = u64::from(self.num_attention_heads) * u64::from(self.head_dim);
        let kv = u64::from(self.num_kv_heads) * u64::from(self.head_dim);
        let i = u64::from(self.intermediate_size);
        h * (q + 2 * kv) + q * h + 3 * h * i
    }

    /// Parameters of all decoder layers.
    pub fn layer_params(&self) -> u64 {
        self.params_per_layer() * u64::from(self.num_layers)
    }

    /// Parameters of the output projection (read once per step, used once per sampled token).
    pub fn lm_head_params(&self) -> u64 {
        u64::from(self.vocab_size) * u64::from(self.hidden_size)
    }

    /// KV-cache bytes one token occupies across all layers (all TP ranks together).
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.num_layers)
            * u64::from(self.num_kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_parse_and_shapes_match_published_sizes() {
        let p = Profile::builtin("llama-3.1-8b-h100x1").unwrap();
        assert_eq!(p.model.params_per_layer(), 218_103_808);
        assert_eq!(p.model.kv_bytes_per_token(), 131_072);
        let total = p.model.layer_params() + 2 * p.model.lm_head_params();
        assert!((total as f64 / 1e9 - 8.03).abs() < 0.01, "{total}");
        let c = Profile::builtin("codellama-34b-h100x2").unwrap();
        assert_eq!(c.model.params_per_layer(), 692_060_160);
        assert_eq!(c.model.kv_bytes_per_token(), 196_608);
        assert_eq!(c.hardware.tensor_parallel, 2);
    }

    #[test]
    fn bad_profiles_are_errors() {
        assert!(matches!(
            Profile::builtin("nope"),
            Err(ProfileError::Unknown(_))
        ));
        assert!(matches!(
            Profile::from_toml("x", "name = 1"),
            Err(ProfileError::Parse { .. })
        ));
        let text = LLAMA_31_8B_H100X1.replace("linear = 0.6646", "linear = 1.5");
        assert!(matches!(
            Profile::from_toml("x", &text),
            Err(ProfileError::Efficiency { .. })
        ));
        let p = Profile::builtin("llama-3.1-8b-h100x1").unwrap();
        assert!(matches!(
            p.with_tensor_parallel(0),
            Err(ProfileError::ZeroCount { .. })
        ));
    }
}
