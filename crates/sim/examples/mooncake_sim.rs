//! Replays the Mooncake conversation trace (FAST'25 release) round-robin on simulated vLLM
//! engines in virtual time, and prints wall time, simulated time and the prefix-cache hit rate.
//!
//! ```text
//! cargo run --release -p kinference-sim --example mooncake_sim -- \
//!     [--engines 8] [--limit N] [--profile llama-3.1-8b-h100x1] [--trace PATH]
//! ```
//!
//! The trace gives, per request, an arrival time (ms), input and output lengths and the ids of
//! its 512-token prefix blocks. Each id becomes 512 pseudo-random token ids seeded by the id, so
//! requests sharing ids share token prefixes (and hence vLLM block hashes); the last block is
//! cut to the input length.

#[path = "common/trace.rs"]
mod trace;

use std::error::Error;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use kinference_sim::{Engine, EngineConfig, Fleet, FleetReport, FleetView, Profile, Request};

use trace::{arrival, default_trace_path, read_trace, Slice};

struct Args {
    engines: usize,
    limit: usize,
    profile: String,
    trace: Option<PathBuf>,
}

fn parse_args() -> Result<Args, Box<dyn Error>> {
    let mut a = Args {
        engines: 8,
        limit: usize::MAX,
        profile: "llama-3.1-8b-h100x1".into(),
        trace: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--engines" => a.engines = value.parse()?,
            "--limit" => a.limit = value.parse()?,
            "--profile" => a.profile = value,
            "--trace" => a.trace = Some(value.into()),
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let profile = Profile::builtin(&args.profile)?;
    let cfg = EngineConfig::from_profile(&profile);
    let vocab = cfg.vocab_size;
    let engines: Vec<Engine> = (0..args.engines)
        .map(|_| Engine::new(cfg.clone()))
        .collect::<Result<_, _>>()?;
    let path = match args.trace {
        Some(p) => p,
        None => default_trace_path()?,
    };
    let lines = read_trace(
        &path,
        Slice {
            limit: args.limit,
            until_ms: u64::MAX,
        },
    )?;
    let prompt_tokens: usize = lines.iter().map(|l| l.input_length).sum();
    let arrivals = lines.iter().enumerate().map(|(i, l)| arrival(i, l, vocab));
    let mut fleet = Fleet::new(engines)?;
    let mut next = 0usize;
    let mut round_robin = |v: &FleetView<'_>, _: &Request| {
        next += 1;
        (next - 1) % v.len()
    };
    let wall = Instant::now();
    let report = fleet.run(arrivals, &mut round_robin)?;
    let wall = wall.elapsed();
    println!(
        "profile            {} ({} engines, round-robin)",
        profile.name, args.engines
    );
    println!(
        "requests           {} finished of {}",
        report.records.len(),
        lines.len()
    );
    println!("prompt tokens      {prompt_tokens}");
    print_figures(&report, wall);
    Ok(())
}

/// The run's figures after the workload lines: tokens, times, hit rate, TTFT, engine counts.
fn print_figures(report: &FleetReport, wall: Duration) {
    let preemptions: u64 = report
        .engine_metrics
        .iter()
        .map(|m| m.num_preemptions)
        .sum();
    let generated: u64 = report
        .engine_metrics
        .iter()
        .map(|m| m.generation_tokens)
        .sum();
    println!("generated tokens   {generated}");
    println!("wall time          {:.2} s", wall.as_secs_f64());
    println!("simulated time     {:.1} s", report.simulated_secs());
    println!(
        "speed-up           {:.0}x real time",
        report.simulated_secs() / wall.as_secs_f64()
    );
    println!(
        "prefix hit rate    {:.2} %",
        report.prefix_hit_rate() * 100.0
    );
    for (name, q) in [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)] {
        if let Some(t) = report.ttft_quantile(q) {
            println!("TTFT {name}           {t:.3} s");
        }
    }
    println!("engine steps       {}", report.steps);
    println!("KV events          {}", report.kv_events);
    println!("preemptions        {preemptions}");
}
