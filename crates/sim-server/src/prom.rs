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
    // Sized for the whole page up front: grown by doubling from empty instead, every scrape
    // reallocated and copied it a dozen times, touching fresh memory each time.
    let mut out = String::with_capacity(PAGE_BYTES_PER_ENGINE * engines.len().max(1));
    type Get = fn(&EngineMetrics) -> f64;
    let gauges: [(&str, &str, Get); 3] = [
        (
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            |m| m.num_running as f64,
        ),
        (
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            |m| m.num_waiting as f64,
        ),
        (
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            |m| m.kv_cache_usage,
        ),
    ];
    for (name, help, get) in gauges {
        gauge(
            &mut out,
            name,
            help,
            engines
                .iter()
                .zip(&labels)
                .map(|(e, l)| (l.as_str(), get(&e.metrics))),
        );
    }
    let info: Vec<String> = engines
        .iter()
        .map(|e| {
            format!(
                "block_size=\"{}\",enable_prefix_caching=\"{}\",engine=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\"",
                cache.block_size,
                if cache.enable_prefix_caching { "True" } else { "False" },
                e.rank,
                cache.num_gpu_blocks,
                escape(&cache.prefix_caching_hash_algo),
            )
        })
        .collect();
    gauge(
        &mut out,
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        info.iter().map(|l| (l.as_str(), 1.0)),
    );
    counters(&mut out, &labels, engines);
    histograms(&mut out, &labels, engines);
    out
}

/// Bytes of one engine's series on the page, rounded up (the test below keeps it an upper
/// bound for an engine with every counter in the millions).
const PAGE_BYTES_PER_ENGINE: usize = 24 * 1024;

fn gauge<'a>(
    out: &mut String,
    name: &str,
    help: &str,
    series: impl Iterator<Item = (&'a str, f64)>,
) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_sim::{Engine, EngineConfig};

    /// An engine's series with every counter and histogram at its widest (20-digit counts,
    /// long float sums), and two engines with long labels.
    #[test]
    fn a_page_fits_the_capacity_it_is_given() {
        let engine = Engine::new(EngineConfig::small(64, 16)).unwrap_or_else(|e| panic!("{e}"));
        let mut m = engine.metrics();
        m.kv_cache_usage = 0.123_456_789_012_345_67;
        for c in [
            &mut m.prefix_cache_queries,
            &mut m.prefix_cache_hits,
            &mut m.num_preemptions,
            &mut m.prompt_tokens,
            &mut m.generation_tokens,
            &mut m.requests_finished_length,
            &mut m.requests_finished_stop,
            &mut m.requests_aborted,
        ] {
            *c = u64::MAX;
        }
        for h in [
            &mut m.ttft,
            &mut m.itl,
            &mut m.e2e,
            &mut m.queue_time,
            &mut m.prefill_time,
            &mut m.decode_time,
        ] {
            h.counts.iter_mut().for_each(|c| *c = u64::MAX / 64);
            h.count = u64::MAX;
            h.sum = 123_456_789.123_456_78;
        }
        let cache = CacheInfo {
            block_size: 16,
            num_gpu_blocks: 1 << 20,
            enable_prefix_caching: true,
            prefix_caching_hash_algo: "sha256_cbor".into(),
        };
        let engines: Vec<EngineSnapshot> = (0..2)
            .map(|rank| EngineSnapshot {
                rank: 1_000_000 + rank,
                metrics: m.clone(),
            })
            .collect();
        let page = render("meta-llama/Llama-3.1-8B-Instruct", &cache, &engines);
        assert!(
            page.len() <= PAGE_BYTES_PER_ENGINE * engines.len(),
            "{} bytes for {} engines",
            page.len(),
            engines.len()
        );
        assert!(page.contains("vllm:num_requests_running{engine=\"1000000\""));
    }
}
