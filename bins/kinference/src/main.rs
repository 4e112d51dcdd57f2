//! `kinference`: one binary for the router (`serve`), the simulated vLLM fleet (`sim`), the
//! trace-replay benchmark (`bench`), the one-command demo (`demo`) and the CRD generator
//! (`crdgen`). Each subcommand lives in its own module; this file only parses the command line
//! and sets up logging.

mod bench;
mod crdgen;
mod demo;
mod epp;
mod serve;
mod sim;

use clap::{Parser, Subcommand};

// With glibc's allocator the router's added latency grew during a long run (p50 from about 3 to
// 12 ms over ~10k requests of ~1,000 tokens); with mimalloc it stayed flat. One allocator for
// the whole binary: the demo runs router and replicas in one process.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc gives pages it no longer uses back to the OS after `MIMALLOC_PURGE_DELAY`
/// milliseconds (1 s by default) and, when it needs them again, takes a page fault and a zeroed
/// page for each: about one per request at one connection (size classes used less often than
/// once a second); 10 s took 6–10 µs off each such request (BENCHMARKS.md, docs/config.md).
const PURGE_DELAY: (&str, &str) = ("MIMALLOC_PURGE_DELAY", "10000");

/// Runs the router again with [`PURGE_DELAY`] set, unless the environment names it already (an
/// operator's own value is kept). mimalloc reads its options from the environment when the
/// process starts, before `main`, and changing them later needs `unsafe`; `exec` keeps the pid
/// and the arguments. Nothing has started yet, so the only cost is loading the binary twice.
fn allocator_settings() {
    use std::os::unix::process::CommandExt;
    let (name, value) = PURGE_DELAY;
    if std::env::var_os(name).is_some() {
        return;
    }
    let Ok(exe) = std::env::current_exe() else {
        return;
    };
    let err = std::process::Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(name, value)
        .exec();
    eprintln!("warning: could not start again with {name}={value} ({err}); continuing without it");
}

#[derive(Debug, Parser)]
#[command(
    name = "kinference",
    version,
    about = "KV-cache-aware routing for vLLM fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the cache-aware OpenAI-compatible router.
    Serve(serve::ServeArgs),
    /// Run the endpoint picker for an inference gateway (Envoy ext_proc, Gateway API
    /// Inference Extension protocol): the router's decisions, the gateway carries the bytes.
    Epp(epp::EppArgs),
    /// Run one or more simulated vLLM replicas (no GPU).
    Sim(sim::SimArgs),
    /// Replay a trace against routing policies and report TTFT, hit rate and GPU time.
    Bench(bench::BenchArgs),
    /// Simulated replicas + the router + a bundled workload: round-robin vs. kinference.
    Demo(demo::DemoArgs),
    /// Print the kinference.io CustomResourceDefinitions (YAML), generated from the Rust types.
    Crdgen(crdgen::CrdgenArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if matches!(cli.command, Command::Serve(_) | Command::Epp(_)) {
        allocator_settings();
    }
    // The demo speaks to a newcomer: its own lines and the table, warnings only from the
    // router and the replicas unless asked (-v).
    let level = match &cli.command {
        Command::Demo(a) => match a.verbose {
            0 => "warn",
            1 => "info",
            _ => "debug",
        },
        _ => "info",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Serve(a) => serve::run(a),
        Command::Epp(a) => epp::run(a),
        Command::Sim(a) => sim::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Crdgen(a) => crdgen::run(a),
    }
}
