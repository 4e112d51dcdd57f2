//! `kinference-sim-server`: one simulated vLLM replica on HTTP (and ZMQ for KV events), with
//! vLLM's flag names so a deployment can swap it for a real replica.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kinference_sim::{EngineConfig, Profile};
use kinference_sim_server::{KvEventsConfig, Server, ServerConfig};
use kinference_vllm::HashAlgo;
use serde_json::Value;

#[derive(Debug, Parser)]
#[command(about = "A GPU-free vLLM replica: OpenAI HTTP API, /metrics and KV events")]
struct Args {
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    #[arg(long, default_value = "sim")]
    served_model_name: String,
    /// Directory with tokenizer.json (and tokenizer_config.json for chat templates).
    #[arg(long)]
    tokenizer: PathBuf,
    /// Built-in GPU/model profile for timing and KV capacity.
    #[arg(long, default_value = "llama-3.1-8b-h100x1")]
    profile: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Overrides the profile's KV capacity.
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    #[arg(long)]
    max_model_len: Option<usize>,
    #[arg(long)]
    max_num_seqs: Option<usize>,
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    #[arg(long, default_value = "sha256")]
    prefix_caching_hash_algo: String,
    #[arg(long)]
    no_enable_prefix_caching: bool,
    #[arg(long, default_value_t = 0)]
    data_parallel_rank: i64,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// vLLM's `--kv-events-config` JSON (`endpoint`, `replay_endpoint`, `topic`, `buffer_steps`).
    #[arg(long)]
    kv_events_config: Option<String>,
}

fn engine_config(a: &Args) -> Result<EngineConfig, Box<dyn std::error::Error>> {
    let profile = Profile::builtin(&a.profile)?;
    let mut e = EngineConfig::from_profile(&profile);
    // `from_profile` sizes the cache in 16-token blocks; keep the token capacity.
    let tokens = e.num_gpu_blocks.saturating_mul(e.block_size);
    e.block_size = a.block_size;
    e.num_gpu_blocks = a.num_gpu_blocks.unwrap_or(tokens / a.block_size.max(1));
    if let Some(v) = a.max_model_len {
        e.max_model_len = v;
    }
    if let Some(v) = a.max_num_seqs {
        e.max_num_seqs = v;
    }
    if let Some(v) = a.max_num_batched_tokens {
        e.max_num_batched_tokens = v;
    }
    e.hash_algo = a.prefix_caching_hash_algo.parse::<HashAlgo>()?;
    e.enable_prefix_caching = !a.no_enable_prefix_caching;
    e.data_parallel_rank = Some(a.data_parallel_rank);
    Ok(e)
}

fn kv_events(json: &str) -> Result<Option<KvEventsConfig>, Box<dyn std::error::Error>> {
    let v: Value = serde_json::from_str(json)?;
    if v.get("enable_kv_cache_events").and_then(Value::as_bool) == Some(false) {
        return Ok(None);
    }
    let endpoint = v
        .get("endpoint")
        .and_then(Value::as_str)
        .unwrap_or("tcp://*:5557");
    let mut cfg = KvEventsConfig::new(endpoint);
    cfg.replay_endpoint = v
        .get("replay_endpoint")
        .and_then(Value::as_str)
        .map(str::to_owned);
    if let Some(t) = v.get("topic").and_then(Value::as_str) {
        cfg.topic = t.to_owned();
    }
    if let Some(n) = v.get("buffer_steps").and_then(Value::as_u64) {
        cfg.buffer_steps = usize::try_from(n)?;
    }
    Ok(Some(cfg))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let cfg = ServerConfig {
        model: args.served_model_name.clone(),
        engine: engine_config(&args)?,
        tokenizer_dir: args.tokenizer.clone(),
        speedup: args.speedup,
        kv_events: args
            .kv_events_config
            .as_deref()
            .map(kv_events)
            .transpose()?
            .flatten(),
    };
    let addr: SocketAddr = format!("{}:{}", args.host, args.port).parse()?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let server = Server::start(cfg, listener).await?;
    println!(
        "serving {} on http://{}",
        args.served_model_name, server.addr
    );
    if let Some(eps) = &server.endpoints {
        println!("kv events: {:?} replay: {:?}", eps.events, eps.replay);
    }
    tokio::signal::ctrl_c().await?;
    server.shutdown();
    Ok(())
}
