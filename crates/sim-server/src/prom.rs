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

/// One engine's metrics, labelled with its DP rank.
#[derive(Clone, Debug)]
pub struct EngineSnapshot {
    pub rank: i64,
    pub metrics: EngineMetrics,
}

/// Renders the exposition text for every engine of a replica: each metric family once, with
/// one series per engine (label `engine` = DP rank), as vLLM's logger exposes DP engines.
pub fn render(model: &str, cache: &CacheInfo, engines: &[EngineSnapshot]) -> String {
    let model = escape(model);
    let labels: Vec<String> = engines
        .iter()
        .map(|e| format!("engine=\"{}\",model_name=\"{model}\"", e.rank))
        .collect();
    let series = |f: &dyn Fn(&EngineMetrics) -> f64| -> Vec<(String, f64)> {
        engines
            .iter()
            .zip(&labels)
            .map(|(e, l)| (l.clone(), f(&e.metrics)))
            .collect()
    };
    let mut out = String::new();
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        &series(&|m| m.num_running as f64),
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        &series(&|m| m.num_waiting as f64),
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        &series(&|m| m.kv_cache_usage),
    );
    let info: Vec<(String, f64)> = engines
        .iter()
        .map(|e| {
            let l = format!(
                "block_size=\"{}\",enable_prefix_caching=\"{}\",engine=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"",
                cache.block_size,
                if cache.enable_prefix_caching { "True" } else { "False" },
                e.rank,
                cache.num_gpu_blocks,
                escape(&cache.prefix_caching_hash_algo),
            );
            (l, 1.0)
        })
        .collect();
    gauge(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        &info,
    );
    counters(&mut out, &labels, engines);
    histograms(&mut out, &labels, engines);
    out
}

fn gauge(out: &mut String, name: &str, help: &str, series: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    for (labels, v) in series {
        let _ = writeln!(out, "{name}{{{labels}}} {v:?}");
    }
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
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

fn counters(out: &mut String, labels: &[String], engines: &[EngineSnapshot]) {
    type Get = fn(&EngineMetrics) -> u64;
    let counters: [(&str, &str, Get); 5] = [
        (
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            |m| m.prefix_cache_queries,
        ),
        (
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            |m| m.prefix_cache_hits,
        ),
        (
            "vllm:num_preemptions",
            "Cumulative number of preemption from the engine.",
            |m| m.num_preemptions,
        ),
        (
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            |m| m.prompt_tokens,
        ),
        (
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            |m| m.generation_tokens,
        ),
    ];
    for (name, help, get) in counters {
        let _ = writeln!(
            out,
            "# HELP {name}_total {help}\n# TYPE {name}_total counter"
        );
        for (e, l) in engines.iter().zip(labels) {
            let _ = writeln!(out, "{name}_total{{{l}}} {}", get(&e.metrics));
        }
    }
    let name = "vllm:request_success";
    let _ = writeln!(
        out,
        "# HELP {name}_total Count of successfully processed requests.\n# TYPE {name}_total counter"
    );
    for (e, l) in engines.iter().zip(labels) {
        let m = &e.metrics;
        // vLLM counts aborted requests under the same counter with reason "abort".
        for (reason, v) in [
            ("stop", m.requests_finished_stop),
            ("length", m.requests_finished_length),
            ("abort", m.requests_aborted),
        ] {
            let _ = writeln!(out, "{name}_total{{{l},finished_reason=\"{reason}\"}} {v}");
        }
    }
}

fn histograms(out: &mut String, labels: &[String], engines: &[EngineSnapshot]) {
    type Get = fn(&EngineMetrics) -> &Histogram;
    let hists: [(&str, &str, Get); 6] = [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            |m| &m.ttft,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            |m| &m.itl,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            |m| &m.e2e,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            |m| &m.queue_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            |m| &m.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            |m| &m.decode_time,
        ),
    ];
    for (name, help, get) in hists {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (e, l) in engines.iter().zip(labels) {
            histogram(out, name, l, get(&e.metrics));
        }
    }
}
