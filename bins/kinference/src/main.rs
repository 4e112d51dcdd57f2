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
