//! `kinference sim`: simulated vLLM replicas (no GPU) on HTTP and ZMQ, for trying the router,
//! benchmarks and real clients against something that behaves like a vLLM fleet.
//!
//! The flags, the port layout of `--replicas` and `--data-parallel-size`, and the start-up
//! lines (`replica=I url=... dp_ranks=... events=... replay=...`, one per replica) are those
//! of `kinference_sim_server::cli`, shared with the standalone `kinference-sim-server`.

use anyhow::Context;

/// Flags of `kinference sim`: exactly the simulator's own (one definition for both binaries).
pub use kinference_sim_server::cli::SimArgs;

/// Runs the replicas until SIGINT or SIGTERM.
pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime
        .block_on(kinference_sim_server::cli::run(&args))
        .context("kinference sim")
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser, Subcommand};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Debug, Subcommand)]
    enum Command {
        Sim(super::SimArgs),
    }

    #[test]
    fn flags_form_a_valid_subcommand() {
        Cli::command().debug_assert();
        let args = ["kinference", "sim", "--tokenizer", "/t", "--replicas", "3"];
        let cli = Cli::try_parse_from(args).unwrap_or_else(|e| panic!("{e}"));
        let Command::Sim(a) = cli.command;
        assert_eq!((a.replicas, a.port), (3, 8000));
    }
}
