//! `kinference`: one binary for the router (`serve`), the simulated vLLM fleet (`sim`), the
//! trace-replay benchmark (`bench`) and the one-command demo (`demo`). Each subcommand lives in
//! its own module; this file only parses the command line and sets up logging.

mod bench;
mod sim;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "kinference", version, about = "KV-cache-aware routing for vLLM fleets")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run one or more simulated vLLM replicas (no GPU).
    Sim(sim::SimArgs),
    /// Replay a trace against routing policies and report TTFT, hit rate and GPU time.
    Bench(bench::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match cli.command {
        Command::Sim(a) => sim::run(a),
        Command::Bench(a) => bench::run(a),
    }
}
