//! `kinference-sim-server`: simulated vLLM replicas on HTTP (and ZMQ for KV events), with
//! vLLM's flag names so a deployment can swap one for a real replica. The same flags as
//! `kinference sim` (see `kinference_sim_server::cli`).

use clap::Parser;
use kinference_sim_server::cli::{self, SimArgs};

#[derive(Debug, Parser)]
#[command(about = "GPU-free vLLM replicas: OpenAI HTTP API, /metrics and KV events")]
struct Args {
    #[command(flatten)]
    sim: SimArgs,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    cli::run(&args.sim).await?;
    Ok(())
}
