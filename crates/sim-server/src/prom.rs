//! `/metrics` in vLLM's Prometheus vocabulary: names, `model_name`/`engine` labels, and
//! histogram buckets exactly as `vllm/v1/metrics/loggers.py` exposes them.

use std::fmt::Write;

use kinference_sim::{EngineMetrics, Histogram};

/// What the cache-config info metric reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheInfo {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub enable_prefix_caching: bool,
    pub prefix_caching_hash_algo: String,
}

/// Renders the exposition text for one engine.
pub fn render(model: &str, engine: i64, cache: &CacheInfo, m: &EngineMetrics) -> String {
    let labels = format!("engine=\"{engine}\",model_name=\"{}\"", escape(model));
    let mut out = String::new();
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &labels,
        m.num_running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &labels,
        m.num_waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &labels,
        m.kv_cache_usage,
    );
    let info = format!(
        "block_size=\"{}\",enable_prefix_caching=\"{}\",engine=\"{engine}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"",
        cache.block_size,
        if cache.enable_prefix_caching { "True" } else { "False" },
        cache.num_gpu_blocks,
        escape(&cache.prefix_caching_hash_algo),
    );
    gauge(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &info,
        1.0,
    );
    counters(&mut out, &labels, m);
    histograms(&mut out, &labels, m);
    out
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v:?}"
    );
}

fn histogram(out: &mut String, name: &str, help: &str, labels: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let cumulative = h.cumulative();
    for (i, bound) in h.bounds.iter().enumerate() {
        let c = cumulative.get(i).copied().unwrap_or(h.count);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{bound:?}\"}} {c}");
    }
    let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", h.count);
    let _ = writeln!(out, "{name}_count{{{labels}}} {}", h.count);
    let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", h.sum);
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn counters(out: &mut String, labels: &str, m: &EngineMetrics) {
    let counters: [(&str, &str, u64); 6] = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            m.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            m.prefix_cache_hits,
        ),
        (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            m.num_preemptions,
        ),
        (
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            m.prompt_tokens,
        ),
        (
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            m.generation_tokens,
        ),
        (
            "vllm:request_success",
            "Count of successfully processed requests.",
            m.requests_finished_length,
        ),
    ];
    for (name, help, v) in counters {
        let l = if name == "vllm:request_success" {
            format!("{labels},finished_reason=\"length\"")
        } else {
            labels.to_owned()
        };
        let _ = writeln!(
            out,
            "# HELP {name}_total {help}\n# TYPE {name}_total counter\n{name}_total{{{l}}} {v}"
        );
        if name == "vllm:request_success" {
            // vLLM counts aborted requests under the same counter with reason "abort".
            let _ = writeln!(
                out,
                "{name}_total{{{labels},finished_reason=\"abort\"}} {}",
                m.requests_aborted
            );
        }
    }
}

fn histograms(out: &mut String, labels: &str, m: &EngineMetrics) {
    let hists: [(&str, &str, &Histogram); 6] = [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &m.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &m.queue_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &m.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &m.decode_time,
        ),
    ];
    for (name, help, h) in hists {
        histogram(out, name, help, labels, h);
    }
}
