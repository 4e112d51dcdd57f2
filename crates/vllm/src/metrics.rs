//! vLLM's Prometheus metrics as a router reads them: the metric names, the text exposition
//! parser ([`text`]), and the per-engine load and cache-config snapshot a router needs.
//!
//! A scrape is untrusted bytes: reading one never panics, skips lines it cannot read (counting
//! them), and keeps only what it understands. Names and labels follow vLLM ≥ 0.22
//! (`vllm:kv_cache_usage_perc`, `vllm:prefix_cache_*`); see `spec/vllm.md` §5.

use std::collections::BTreeMap;

pub mod text;

pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
pub const PREFIX_CACHE_QUERIES_TOTAL: &str = "vllm:prefix_cache_queries_total";
pub const PREFIX_CACHE_HITS_TOTAL: &str = "vllm:prefix_cache_hits_total";

/// Load of one engine (DP rank), from its gauges.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
}

/// The labels of `vllm:cache_config_info` a router must agree with.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheConfigInfo {
    pub block_size: Option<usize>,
    pub num_gpu_blocks: Option<usize>,
    pub enable_prefix_caching: Option<bool>,
    /// `sha256`, `sha256_cbor`, ... (absent on old vLLM versions).
    pub prefix_caching_hash_algo: Option<String>,
}

/// What a router takes from one scrape of a replica's `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ReplicaMetrics {
    /// Per `engine` label (the DP rank; samples without one count as engine 0).
    pub engines: BTreeMap<u32, EngineLoad>,
    pub cache_config: Option<CacheConfigInfo>,
    /// Lines that could not be parsed.
    pub unreadable_lines: usize,
}

impl ReplicaMetrics {
    /// Reads a scrape, keeping vLLM's series and ignoring everything else. With several
    /// models on one server the gauges of every model add up, as they share the engine.
    pub fn from_exposition(page: &str) -> Self {
        let mut m = ReplicaMetrics::default();
        for s in text::parse(page) {
            let Ok(s) = s else {
                m.unreadable_lines += 1;
                continue;
            };
            let engine = s
                .label("engine")
                .and_then(|e| e.parse::<u32>().ok())
                .unwrap_or(0);
            let value = if s.value.is_finite() { s.value } else { 0.0 };
            match s.name {
                NUM_REQUESTS_RUNNING => m.engines.entry(engine).or_default().running += value,
                NUM_REQUESTS_WAITING => m.engines.entry(engine).or_default().waiting += value,
                KV_CACHE_USAGE_PERC => {
                    let e = m.engines.entry(engine).or_default();
                    e.kv_usage = e.kv_usage.max(value.clamp(0.0, 1.0));
                }
                PREFIX_CACHE_QUERIES_TOTAL => {
                    m.engines.entry(engine).or_default().prefix_cache_queries += value
                }
                PREFIX_CACHE_HITS_TOTAL => {
                    m.engines.entry(engine).or_default().prefix_cache_hits += value
                }
                CACHE_CONFIG_INFO if m.cache_config.is_none() => {
                    m.cache_config = Some(CacheConfigInfo {
                        block_size: s.label("block_size").and_then(|v| v.parse().ok()),
                        num_gpu_blocks: s.label("num_gpu_blocks").and_then(|v| v.parse().ok()),
                        enable_prefix_caching: s
                            .label("enable_prefix_caching")
                            .and_then(|v| parse_py_bool(&v)),
                        prefix_caching_hash_algo: s
                            .label("prefix_caching_hash_algo")
                            .map(|v| v.into_owned()),
                    });
                }
                _ => {}
            }
        }
        m
    }
}

fn parse_py_bool(v: &str) -> Option<bool> {
    match v {
        "True" | "true" | "1" => Some(true),
        "False" | "false" | "0" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="80",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 640.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 320.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
process_cpu_seconds_total 1.5e3
garbage line {
"#;

    #[test]
    fn reads_vllm_series_per_engine() {
        let m = ReplicaMetrics::from_exposition(SCRAPE);
        assert_eq!(m.unreadable_lines, 1);
        let e0 = m.engines[&0];
        assert_eq!((e0.running, e0.waiting), (3.0, 2.0));
        assert_eq!(
            (e0.prefix_cache_queries, e0.prefix_cache_hits),
            (640.0, 320.0)
        );
        assert_eq!(m.engines[&1].running, 1.0);
        assert_eq!(m.engines[&1].kv_usage, 0.25);
        let c = m.cache_config.unwrap();
        assert_eq!(c.block_size, Some(32));
        assert_eq!(c.num_gpu_blocks, Some(80));
        assert_eq!(c.enable_prefix_caching, Some(true));
        assert_eq!(c.prefix_caching_hash_algo.as_deref(), Some("sha256_cbor"));
    }

    #[test]
    fn never_panics_on_arbitrary_text() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let alphabet: Vec<char> = "a{}=\",\\ \n#:0.5eE+-InfNa_é".chars().collect();
        for _ in 0..20_000 {
            let len = rng.gen_range(0..40);
            let s: String = (0..len)
                .map(|_| alphabet[rng.gen_range(0..alphabet.len())])
                .collect();
            let m = ReplicaMetrics::from_exposition(&s);
            assert!(m
                .engines
                .values()
                .all(|e| e.kv_usage >= 0.0 && e.kv_usage <= 1.0));
        }
    }
}
