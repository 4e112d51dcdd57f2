//! The benchmark's outputs: the [`Report`] a run builds, `results.json` for scripts, and a
//! markdown table for people (printed, and written as `report.md`).
//!
//! `results.json` layout (every time in seconds, every rate a fraction):
//!
//! ```text
//! { "mode": "sim" | "live", "fleet": {...}, "costs": {...},
//!   "policies": { "<name>": { "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
//!                             "e2e_p50_s", "throughput_rps", "imbalance", "prefill_gpu_s", ... } },
//!   "runs": [ { "label", "load", "speedup", "workload": {...}, "bounds": {...} | null,
//!               "policies": { ... as above ... } } ] }
//! ```
//!
//! The top-level `policies` is the first run's (the only one unless a sweep was asked for).

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::bounds::Bounds;
use crate::error::BenchError;
use crate::stats::{Costs, LoadTimeline, PolicyResult};

/// A short description of the workload a run used.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadSummary {
    pub name: String,
    pub requests: usize,
    /// Prompt tokens where known without a tokenizer (0 for untokenized chats).
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// First to last arrival, seconds, after re-timing.
    pub span_s: f64,
    pub arrivals: String,
}

/// One policy in one run, with the series the plots draw.
#[derive(Clone, Debug)]
pub struct PolicyRun {
    pub result: PolicyResult,
    pub ttft_samples: Vec<f64>,
    pub timeline: Option<LoadTimeline>,
}

/// One workload (or one load level of a sweep) under every policy.
#[derive(Clone, Debug)]
pub struct RunReport {
    pub label: String,
    /// Target offered load (fraction of fleet capacity), when one was set.
    pub load: Option<f64>,
    /// Arrival speed-up applied to the workload's times.
    pub speedup: Option<f64>,
    pub workload: WorkloadSummary,
    pub bounds: Option<Bounds>,
    pub policies: Vec<PolicyRun>,
}

/// Everything a benchmark invocation measured.
#[derive(Clone, Debug)]
pub struct Report {
    /// `sim` or `live`.
    pub mode: String,
    /// Free-form fleet description (profile, replicas, KV size; or the targets).
    pub fleet: Value,
    pub costs: Costs,
    pub runs: Vec<RunReport>,
}

fn policies_json(ps: &[PolicyRun]) -> Result<Value, BenchError> {
    let mut m = Map::new();
    for p in ps {
        let v = serde_json::to_value(&p.result).map_err(|e| BenchError::Report(e.to_string()))?;
        m.insert(p.result.policy.clone(), v);
    }
    Ok(Value::Object(m))
}

impl Report {
    /// The `results.json` document.
    pub fn to_json(&self) -> Result<Value, BenchError> {
        let ser = |v: &dyn erased::Ser| v.to_value();
        let mut runs = Vec::new();
        for r in &self.runs {
            runs.push(json!({
                "label": r.label,
                "load": r.load,
                "speedup": r.speedup,
                "workload": ser(&r.workload)?,
                "bounds": match &r.bounds { Some(b) => ser(b)?, None => Value::Null },
                "policies": policies_json(&r.policies)?,
            }));
        }
        let first = match self.runs.first() {
            Some(r) => policies_json(&r.policies)?,
            None => Value::Object(Map::new()),
        };
        Ok(json!({
            "mode": self.mode,
            "fleet": self.fleet,
            "costs": ser(&self.costs)?,
            "policies": first,
            "runs": runs,
        }))
    }

    /// Writes `results.json` into `dir` (created if needed).
    pub fn write_json(&self, dir: &Path) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
        let text = serde_json::to_string_pretty(&self.to_json()?)
            .map_err(|e| BenchError::Report(e.to_string()))?;
        let p = dir.join("results.json");
        std::fs::write(&p, text + "\n").map_err(|e| BenchError::io(p, e))
    }

    /// Writes `report.md` into `dir`.
    pub fn write_markdown(&self, dir: &Path, command: &str) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
        let p = dir.join("report.md");
        std::fs::write(&p, self.markdown(command)).map_err(|e| BenchError::io(p, e))
    }

    /// The human-readable report: one table per run, bounds, costs, the command.
    pub fn markdown(&self, command: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# kinference bench ({} mode)\n", self.mode);
        if !command.is_empty() {
            let _ = writeln!(s, "```\n{command}\n```\n");
        }
        let _ = writeln!(s, "Fleet: `{}`\n", self.fleet);
        let _ = writeln!(
            s,
            "Energy and cost: {:.0} W per GPU while computing, ${:.2} per GPU-hour.\n",
            self.costs.gpu_watts, self.costs.usd_per_gpu_hour
        );
        for r in &self.runs {
            run_markdown(&mut s, r);
        }
        s
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{:.0}", x * 1000.0))
}

fn run_markdown(s: &mut String, r: &RunReport) {
    let _ = writeln!(s, "## {}\n", r.label);
    let w = &r.workload;
    let _ = writeln!(
        s,
        "Workload: {} — {} requests over {:.0} s ({}), {:.2} M prompt tokens, {:.2} M output tokens.",
        w.name,
        w.requests,
        w.span_s,
        w.arrivals,
        w.prompt_tokens as f64 / 1e6,
        w.output_tokens as f64 / 1e6
    );
    if let Some(l) = r.load {
        let _ = write!(s, " Target load {:.0} % of fleet capacity", l * 100.0);
        if let Some(x) = r.speedup {
            let _ = write!(s, " (trace times ÷ {x:.2})");
        }
        let _ = writeln!(s, ".");
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "| policy | hit rate | TTFT p50 ms | p90 ms | p99 ms | ITL p50 ms | e2e p50 s | req/s | out tok/s | imbalance | prefill GPU-s | saved vs RR | kWh saved | $ saved | busy | done/issued |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for p in &r.policies {
        policy_row(s, &p.result);
    }
    let _ = writeln!(s);
    if let Some(b) = &r.bounds {
        bounds_line(s, b);
    }
    if let Some(p) = r.policies.first() {
        let _ = writeln!(s, "Hit rates from: {}.\n", p.result.hit_source);
    }
}

/// One policy's row of a run's table.
fn policy_row(s: &mut String, x: &PolicyResult) {
    let saved = x
        .prefill_gpu_s_saved_vs_rr
        .zip(x.prefill_gpu_s)
        .map(|(d, own)| {
            let base = own + d;
            if base > 0.0 {
                format!("{d:.1} ({:.1} %)", 100.0 * d / base)
            } else {
                format!("{d:.1}")
            }
        });
    let _ = writeln!(
        s,
        "| {} | {:.1} % | {} | {} | {} | {} | {} | {:.2} | {:.0} | {} | {} | {} | {} | {} | {} | {}/{} |",
        x.policy,
        x.hit_rate * 100.0,
        ms(x.ttft_p50_s),
        ms(x.ttft_p90_s),
        ms(x.ttft_p99_s),
        ms(x.itl_p50_s),
        opt(x.e2e_p50_s, 2),
        x.throughput_rps,
        x.output_tok_s,
        opt(x.imbalance, 3),
        opt(x.prefill_gpu_s, 1),
        saved.unwrap_or_else(|| "-".into()),
        opt(x.kwh_saved_vs_rr, 3),
        opt(x.usd_saved_vs_rr, 2),
        x.utilization
            .map_or_else(|| "-".into(), |u| format!("{:.0} %", u * 100.0)),
        x.completed,
        x.requests,
    );
}

/// The hit-rate references without timing, as one sentence.
fn bounds_line(s: &mut String, b: &Bounds) {
    let _ = writeln!(
        s,
        "Hit-rate references without timing ({} replicas × {} blocks of {} tokens, LRU): \
         infinite cache {:.1} %, one pooled cache of the fleet's size {:.1} %, \
         capped greedy (1.1 × fair share) {:.1} % (imbalance {:.2}), round-robin {:.1} %.\n",
        b.replicas,
        b.blocks_per_replica,
        b.block_size,
        b.infinite_hit_rate * 100.0,
        b.pooled_hit_rate * 100.0,
        b.capped_greedy_hit_rate * 100.0,
        b.capped_greedy_imbalance,
        b.round_robin_hit_rate * 100.0
    );
}

/// Serialisation through `serde_json::to_value` with the error mapped, usable on `dyn`.
mod erased {
    use super::BenchError;
    use serde_json::Value;

    pub trait Ser {
        fn to_value(&self) -> Result<Value, BenchError>;
    }

    impl<T: serde::Serialize> Ser for T {
        fn to_value(&self) -> Result<Value, BenchError> {
            serde_json::to_value(self).map_err(|e| BenchError::Report(e.to_string()))
        }
    }
}

fn gpu_ms(v: Option<f64>, speedup: f64) -> String {
    v.map_or_else(
        || "-".to_owned(),
        |s| format!("{:.0} ms", s * speedup * 1e3),
    )
}

/// The demo's side-by-side table of a live run whose latencies were measured at `speedup`
/// (shown in simulated GPU time), and what the last policy saves against the first.
pub fn comparison(run: &RunReport, speedup: f64, costs: &Costs) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\n{} requests, {} ({}x speed; latencies in simulated GPU time)\n",
        run.workload.requests, run.label, speedup
    );
    let _ = writeln!(
        s,
        "| policy | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | prefill GPU-s | kWh | $ | failed |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &run.policies {
        let r = &p.result;
        let gpu = r.prefill_gpu_s.unwrap_or(0.0);
        let _ = writeln!(
            s,
            "| {} | {:.1} % | {} | {} | {} | {:.1} | {:.4} | {:.4} | {} |",
            r.policy,
            r.hit_rate * 100.0,
            gpu_ms(r.ttft_p50_s, speedup),
            gpu_ms(r.ttft_p90_s, speedup),
            gpu_ms(r.ttft_p99_s, speedup),
            gpu,
            costs.kwh(gpu),
            costs.usd(gpu),
            r.failed
        );
    }
    if let [base, .., last] = run.policies.as_slice() {
        savings(&mut s, &base.result, &last.result, speedup, costs);
    }
    s
}

/// `k`'s savings against the baseline `b`, in prefill GPU time and TTFT p90.
fn savings(s: &mut String, b: &PolicyResult, k: &PolicyResult, speedup: f64, costs: &Costs) {
    let gpu_b = b.prefill_gpu_s.unwrap_or(0.0);
    let gpu_k = k.prefill_gpu_s.unwrap_or(0.0);
    let saved = gpu_b - gpu_k;
    let pct = if gpu_b > 0.0 {
        saved / gpu_b * 100.0
    } else {
        0.0
    };
    let _ = writeln!(
        s,
        "\n{} vs {}: hit rate {:.1} % → {:.1} %, prefill GPU time −{:.1} % ({:.1} GPU-s, {:.4} kWh, ${:.4} saved on this workload)",
        k.policy,
        b.policy,
        b.hit_rate * 100.0,
        k.hit_rate * 100.0,
        pct,
        saved,
        costs.kwh(saved),
        costs.usd(saved)
    );
    if let (Some(p90b), Some(p90k)) = (b.ttft_p90_s, k.ttft_p90_s) {
        if p90k > 0.0 {
            let _ = writeln!(
                s,
                "TTFT p90 {} → {} ({:.1}x)",
                gpu_ms(Some(p90b), speedup),
                gpu_ms(Some(p90k), speedup),
                p90b / p90k
            );
        }
    }
}
