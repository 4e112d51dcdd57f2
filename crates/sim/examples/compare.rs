//! Round-robin versus cache-aware routing on simulated vLLM engines, side by side.
//!
//! ```text
//! cargo run --release -p kinference-sim --example compare -- \
//!     [--engines 4] [--minutes 15] [--limit N] [--profile llama-3.1-8b-h100x1] \
//!     [--trace PATH] [--load-weight 64] [--fair-share-cap 1.25]
//! ```
//!
//! Replays the start of the Mooncake conversation trace twice on identical fleets in virtual
//! time (no GPU, no network): once round-robin, once routed by kinference's block index, which
//! learns what each engine caches only from the KV events the engines publish (see
//! `common/compare.rs` for the policy). Every figure comes from the simulated engines: the
//! hit rate from their prefix-cache counters, latencies from their request timestamps, GPU
//! time from the timing model of the chosen profile (`profiles/*.toml`, sourced figures).
//!
//! Two GPU-time figures: *prefill GPU-s* adds up, per request, the timing model's compute for
//! the prompt tokens not served from cache, on top of the cached context (the work a hit
//! avoids; recomputation after a preemption is not included); *busy GPU-s* adds up the
//! simulated duration of every engine step, prefill and decode, i.e. how long the fleet's GPUs
//! computed at all. Energy assumes 700 W per GPU while computing.

mod common;

use std::error::Error;
use std::path::{Path, PathBuf};
use std::time::Instant;

use kinference_sim::{Engine, EngineConfig, Profile};

use common::compare::{
    index_matches_engines, reuse_ceiling_tokens, run, CacheAware, CacheAwareOptions, Policy,
    RunResult, Summary,
};
use common::trace::{default_trace_path, read_trace, Slice, TraceLine};

/// The board power of one H100 SXM5 (NVIDIA datasheet: "up to 700 W"), drawn while busy.
const GPU_WATTS: f64 = 700.0;

struct Args {
    engines: usize,
    limit: usize,
    minutes: f64,
    profile: String,
    trace: Option<PathBuf>,
    opts: CacheAwareOptions,
}

const USAGE: &str = "usage: compare [--engines N] [--minutes M] [--limit N] [--profile NAME] \
                     [--trace PATH] [--load-weight BLOCKS] [--fair-share-cap X]";

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        engines: 4,
        limit: usize::MAX,
        minutes: 15.0,
        profile: "llama-3.1-8b-h100x1".into(),
        trace: None,
        opts: CacheAwareOptions::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        match flag.as_str() {
            "--engines" => a.engines = value.parse()?,
            "--limit" => a.limit = value.parse()?,
            "--minutes" => a.minutes = value.parse()?,
            "--profile" => a.profile = value,
            "--trace" => a.trace = Some(value.into()),
            "--load-weight" => a.opts.load_weight = value.parse()?,
            "--fair-share-cap" => a.opts.fair_share_cap = value.parse()?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
        }
    }
    if a.engines == 0 {
        return Err("--engines must be at least 1".into());
    }
    if a.minutes.is_nan() || a.minutes <= 0.0 {
        return Err("--minutes must be positive".into());
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let profile = Profile::builtin(&args.profile)?;
    let cfg = EngineConfig::from_profile(&profile);
    let path = match &args.trace {
        Some(p) => p.clone(),
        None => default_trace_path()?,
    };
    let until_ms = (args.minutes * 60_000.0).min(u64::MAX as f64) as u64;
    let slice = Slice {
        limit: args.limit,
        until_ms,
    };
    let lines = read_trace(&path, slice)?;
    if lines.is_empty() {
        return Err("the selected slice of the trace is empty".into());
    }
    print_header(&path, &lines, &args, &profile, &cfg);
    let wall = Instant::now();
    let rr = run(Policy::RoundRobin, &cfg, args.engines, &lines, args.opts)?;
    let ca = run(Policy::CacheAware, &cfg, args.engines, &lines, args.opts)?;
    let wall = wall.elapsed().as_secs_f64();
    let (a, b) = (Summary::of(&rr, &cfg.timing), Summary::of(&ca, &cfg.timing));
    print_table(&a, &b, &rr, &ca);
    print_saving(&a, &b);
    if let Some(router) = &ca.router {
        print_index(router, &ca.engines);
    }
    println!(
        "wall      {wall:.1} s for both runs ({:.1} s + {:.1} s), {:.0} s simulated each",
        rr.wall.as_secs_f64(),
        ca.wall.as_secs_f64(),
        a.simulated_secs.max(b.simulated_secs)
    );
    Ok(())
}

fn print_header(
    path: &Path,
    lines: &[TraceLine],
    args: &Args,
    profile: &Profile,
    cfg: &EngineConfig,
) {
    let prompt_tokens: usize = lines.iter().map(|l| l.input_length).sum();
    let span = lines.last().map_or(0, |l| l.timestamp) as f64 / 60_000.0;
    let ceiling = reuse_ceiling_tokens(lines, cfg.block_size) as f64;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    println!("kinference preview: round-robin vs cache-aware routing, simulated (no GPU)");
    println!(
        "workload  {name}: {} requests arriving over {span:.1} min, {:.2} M prompt tokens",
        lines.len(),
        prompt_tokens as f64 / 1e6
    );
    println!(
        "          an unbounded prefix cache could serve at most {:.1} % of them",
        100.0 * ceiling / prompt_tokens.max(1) as f64
    );
    println!(
        "fleet     {} x {} (block {} tokens, {} GPU blocks = {:.2} M tokens of KV each, {})",
        args.engines,
        profile.name,
        cfg.block_size,
        cfg.num_gpu_blocks,
        (cfg.num_gpu_blocks * cfg.block_size) as f64 / 1e6,
        cfg.hash_algo.as_str()
    );
}

fn print_table(a: &Summary, b: &Summary, rr: &RunResult, ca: &RunResult) {
    let mut rows = table_rows(a, b);
    let (aw, bw) = (rr.wall.as_secs_f64(), ca.wall.as_secs_f64());
    rows.push(["wall time".into(), secs1(aw), secs1(bw), String::new()]);
    println!();
    let (x, y) = (rr.policy.name(), ca.policy.name());
    println!("{:<34}{x:>14}{y:>14}{:>10}", "", "change");
    for [name, x, y, change] in rows {
        println!("{name:<34}{x:>14}{y:>14}{change:>10}");
    }
}

/// Label, round-robin, cache-aware, relative change.
fn table_rows(a: &Summary, b: &Summary) -> Vec<[String; 4]> {
    let one = |x: f64| format!("{x:.1}");
    let mut rows = vec![
        [
            "requests finished".into(),
            a.requests.to_string(),
            b.requests.to_string(),
            String::new(),
        ],
        [
            "prefix-hit rate (cached/prompt)".into(),
            format!("{:.1} %", a.hit_rate * 100.0),
            format!("{:.1} %", b.hit_rate * 100.0),
            format!("{:+.1} pt", (b.hit_rate - a.hit_rate) * 100.0),
        ],
    ];
    for (q, (x, y)) in ["p50", "p90", "p99"].iter().zip(a.ttft.iter().zip(&b.ttft)) {
        rows.push([format!("TTFT {q}"), secs(*x), secs(*y), pct(*x, *y)]);
    }
    let (ae, be) = (a.e2e_p50, b.e2e_p50);
    rows.push(["e2e latency p50".into(), secs(ae), secs(be), pct(ae, be)]);
    let (ap, bp) = (a.prefill_gpu_secs, b.prefill_gpu_secs);
    let change = pct(Some(ap), Some(bp));
    rows.push([
        "prefill GPU-s (timing model)".into(),
        one(ap),
        one(bp),
        change,
    ]);
    let (ab, bb) = (a.busy_gpu_secs, b.busy_gpu_secs);
    let change = pct(Some(ab), Some(bb));
    rows.push([
        "busy GPU-s (all simulated steps)".into(),
        one(ab),
        one(bb),
        change,
    ]);
    rows.push([
        "imbalance (max/mean requests)".into(),
        format!("{:.3}", a.imbalance),
        format!("{:.3}", b.imbalance),
        String::new(),
    ]);
    rows.push([
        "preemptions".into(),
        a.preemptions.to_string(),
        b.preemptions.to_string(),
        String::new(),
    ]);
    let (asim, bsim) = (secs1(a.simulated_secs), secs1(b.simulated_secs));
    rows.push(["simulated duration".into(), asim, bsim, String::new()]);
    rows
}

fn print_saving(a: &Summary, b: &Summary) {
    let kwh = |s: f64| s * GPU_WATTS / 3.6e6;
    let share = |d: f64, of: f64| 100.0 * d / of.max(f64::MIN_POSITIVE);
    let prefill = a.prefill_gpu_secs - b.prefill_gpu_secs;
    let busy = a.busy_gpu_secs - b.busy_gpu_secs;
    println!();
    println!(
        "saving    cache-aware vs round-robin: {prefill:.1} prefill GPU-s ({:.1} %), \
         {:.3} kWh at {GPU_WATTS:.0} W per GPU",
        share(prefill, a.prefill_gpu_secs),
        kwh(prefill)
    );
    println!(
        "          all steps: {busy:.1} busy GPU-s ({:.1} %), {:.3} kWh; over {:.1} min of traffic",
        share(busy, a.busy_gpu_secs),
        kwh(busy),
        a.simulated_secs / 60.0
    );
}

fn print_index(router: &CacheAware, engines: &[Engine]) {
    let a = router.applied;
    println!(
        "index     fed {} event batches: {} hashes stored, {} removed, {} ignored; \
         {} entries at the end",
        router.batches,
        a.stored,
        a.removed,
        a.ignored,
        router.index.len()
    );
    match index_matches_engines(&router.index, engines) {
        Ok(()) => println!(
            "          it agrees with every engine's prefix cache at the end (checked block by block)"
        ),
        Err(e) => println!("          it DISAGREES with the engines: {e}"),
    }
}

fn secs1(s: f64) -> String {
    format!("{s:.1} s")
}

fn secs(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |s| format!("{s:.3} s"))
}

/// The relative change from `a` to `b`, as a signed percentage.
fn pct(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 => format!("{:+.0} %", 100.0 * (b - a) / a),
        _ => String::new(),
    }
}
