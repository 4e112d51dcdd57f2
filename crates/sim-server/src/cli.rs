//! The simulator's command line, shared by `kinference sim` and the standalone
//! `kinference-sim-server`: flags → one [`ServerConfig`] per replica → running [`Server`]s.
//!
//! Flags use vLLM's names where vLLM has one (`--served-model-name`, `--block-size`,
//! `--num-gpu-blocks-override`, `--prefix-caching-hash-algo`, `--data-parallel-size`,
//! `--lora-modules`, `--kv-events-config`), with short aliases (`--model`, `--num-gpu-blocks`,
//! `--hash-algo`, `--events-endpoint`, `--replay-endpoint`).
//!
//! Port rule for `--replicas N` with `--data-parallel-size D`: replica `i` serves HTTP on
//! `port + i`; DP rank `r` of replica `i` publishes on the events port `+ i×D + r` and
//! answers replay on the replay port `+ i×D + r` (tcp endpoints). Within one replica this is
//! vLLM's own per-rank rule (base + rank); across replicas the blocks of D ports follow each
//! other. Port 0 (HTTP or events) gives every replica and rank its own free port instead;
//! the lines printed at start-up say which. Overlapping ports are refused before anything
//! binds.
//!
//! `--tokenizer` is required: block hashes are only comparable with a real replica's when the
//! prompt is tokenized by the same tokenizer, so there is no silent default.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use kinference_sim::{EngineConfig, Profile};
use kinference_tokenize::Tokenizer;
use kinference_vllm::HashAlgo;
use serde_json::Value;
use thiserror::Error;
use tokio::net::TcpListener;

use crate::publisher::{endpoint_port, publisher_binds, EventFaults};
use crate::{KvEventsConfig, LoraModule, Server, ServerConfig, ServerError};

/// Why the flags do not describe a runnable fleet, or why it did not start.
#[derive(Debug, Error)]
pub enum CliError {
    #[error("--{flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error("port {port} is used twice: {first} and {second}")]
    PortOverlap {
        port: u16,
        first: String,
        second: String,
    },
    #[error("replica {index}: cannot listen on {host}:{port}: {source}")]
    Bind {
        index: usize,
        host: String,
        port: u16,
        source: std::io::Error,
    },
    #[error("replica {index}: {source}")]
    Server { index: usize, source: ServerError },
    #[error("waiting for a shutdown signal: {0}")]
    Signal(std::io::Error),
}

fn invalid(flag: &'static str, reason: impl ToString) -> CliError {
    CliError::Invalid {
        flag,
        reason: reason.to_string(),
    }
}

/// The simulator's flags.
#[derive(Clone, Debug, clap::Args)]
pub struct SimArgs {
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,
    /// HTTP port of the first replica (replica i: port + i; 0 picks free ports).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Replicas to run in this process.
    #[arg(long, default_value_t = 1)]
    pub replicas: usize,
    /// The served model name requests must use.
    #[arg(
        long = "served-model-name",
        visible_alias = "model",
        default_value = "sim"
    )]
    pub model: String,
    /// Directory with tokenizer.json (and tokenizer_config.json for chat templates): the same
    /// tokenizer as the model the simulated replicas stand in for.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Built-in GPU/model profile for timing and KV capacity.
    #[arg(long, default_value = "llama-3.1-8b-h100x1", value_parser = clap::builder::PossibleValuesParser::new(Profile::BUILTIN))]
    pub profile: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks per engine (overrides the profile's capacity).
    #[arg(long = "num-gpu-blocks-override", visible_alias = "num-gpu-blocks")]
    pub num_gpu_blocks: Option<usize>,
    /// Context length, tokens (default: the profile's).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// sha256, sha256_cbor, xxhash or xxhash_cbor.
    #[arg(
        long = "prefix-caching-hash-algo",
        visible_alias = "hash-algo",
        default_value = "sha256"
    )]
    pub hash_algo: String,
    /// PYTHONHASHSEED of the replicas being imitated (changes NONE_HASH).
    #[arg(long)]
    pub hash_seed: Option<String>,
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// Engines (DP ranks) per replica behind one HTTP server.
    #[arg(long, default_value_t = 1)]
    pub data_parallel_size: usize,
    /// Rank of the first engine (ranks are R .. R + D; events ports offset by rank).
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u16,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// KV-event PUB endpoint of the first replica's first rank, e.g. tcp://*:5557 (binds) or
    /// tcp://router:5557 (connects).
    #[arg(long, conflicts_with = "kv_events_config")]
    pub events_endpoint: Option<String>,
    /// Replay ROUTER endpoint of the first replica's first rank, e.g. tcp://*:5558.
    #[arg(long, requires = "events_endpoint")]
    pub replay_endpoint: Option<String>,
    /// Topic of every KV-event message.
    #[arg(long, default_value = "", requires = "events_endpoint")]
    pub events_topic: String,
    /// vLLM's `--kv-events-config` JSON (`endpoint`, `replay_endpoint`, `topic`,
    /// `buffer_steps`, `max_queue_size`), instead of the three flags above.
    #[arg(long)]
    pub kv_events_config: Option<String>,
    /// LoRA adapters, `name=path` or vLLM's JSON `{"name", "path", "base_model_name"}`.
    #[arg(long, num_args = 1..)]
    pub lora_modules: Vec<String>,
    /// Accepted for vLLM compatibility; adapters are served whenever `--lora-modules` is given.
    #[arg(long)]
    pub enable_lora: bool,
    /// Test harnesses: percent of KV-event batches not sent live (still replayable), as a PUB
    /// losing them at its high-water mark.
    #[arg(long, default_value_t = 0.0)]
    pub events_drop_pct: f64,
    /// Test harnesses: percent of live KV-event batches sent twice.
    #[arg(long, default_value_t = 0.0)]
    pub events_dup_pct: f64,
    /// Test harnesses: percent of live KV-event batches held back and sent after the next one.
    #[arg(long, default_value_t = 0.0)]
    pub events_reorder_pct: f64,
    /// Seed of the injected event faults (one seed, one sequence of faults).
    #[arg(long, default_value_t = 0)]
    pub events_fault_seed: u64,
}

/// One replica to start: where it listens and what it runs.
#[derive(Clone, Debug)]
pub struct ReplicaPlan {
    pub index: usize,
    pub host: String,
    pub port: u16,
    pub config: ServerConfig,
}

/// Parses one `--lora-modules` value.
pub fn parse_lora_module(s: &str) -> Result<LoraModule, CliError> {
    if s.trim_start().starts_with('{') {
        let v: Value = serde_json::from_str(s).map_err(|e| invalid("lora-modules", e))?;
        let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
        let (Some(name), Some(path)) = (field("name"), field("path")) else {
            return Err(invalid(
                "lora-modules",
                format!("{s}: JSON form needs \"name\" and \"path\""),
            ));
        };
        return Ok(LoraModule {
            name,
            path,
            base_model_name: field("base_model_name"),
        });
    }
    match s.split_once('=') {
        Some((name, path)) if !name.is_empty() && !path.is_empty() => Ok(LoraModule {
            name: name.to_owned(),
            path: path.to_owned(),
            base_model_name: None,
        }),
        _ => Err(invalid(
            "lora-modules",
            format!("{s}: expected name=path or a JSON object"),
        )),
    }
}

/// vLLM's `--kv-events-config` JSON; `None` when it disables events.
pub fn parse_kv_events_config(json: &str) -> Result<Option<KvEventsConfig>, CliError> {
    let flag = "kv-events-config";
    let v: Value = serde_json::from_str(json).map_err(|e| invalid(flag, e))?;
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
    let count = |key: &str| -> Result<Option<usize>, CliError> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(n) => n
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| *n > 0)
                .map(Some)
                .ok_or_else(|| invalid(flag, format!("{key} must be a positive integer"))),
        }
    };
    if let Some(n) = count("buffer_steps")? {
        cfg.buffer_steps = n;
    }
    if let Some(n) = count("max_queue_size")? {
        cfg.max_queue_size = n;
    }
    Ok(Some(cfg))
}

impl SimArgs {
    /// The engine every rank runs (rank 0's; ranks differ only in `data_parallel_rank`).
    pub fn engine_config(&self) -> Result<EngineConfig, CliError> {
        let profile = Profile::builtin(&self.profile).map_err(|e| invalid("profile", e))?;
        let mut e = EngineConfig::from_profile(&profile);
        if self.block_size == 0 {
            return Err(invalid("block-size", "must be at least 1"));
        }
        // `from_profile` sizes the cache in 16-token blocks; keep the token capacity.
        let tokens = e.num_gpu_blocks.saturating_mul(e.block_size);
        e.block_size = self.block_size;
        e.num_gpu_blocks = self.num_gpu_blocks.unwrap_or(tokens / self.block_size);
        if let Some(v) = self.max_model_len {
            e.max_model_len = v;
        } else {
            // vLLM derives the context length from the model but refuses to start when the
            // cache cannot hold one sequence; a small override shrinks it to what fits.
            let capacity = e.num_gpu_blocks.saturating_sub(1) * e.block_size;
            e.max_model_len = e.max_model_len.min(capacity);
        }
        if let Some(v) = self.max_num_seqs {
            e.max_num_seqs = v;
        }
        if let Some(v) = self.max_num_batched_tokens {
            e.max_num_batched_tokens = v;
        }
        e.hash_algo = self
            .hash_algo
            .parse::<HashAlgo>()
            .map_err(|e| invalid("prefix-caching-hash-algo", e))?;
        e.hash_seed = self.hash_seed.clone();
        e.enable_prefix_caching = !self.no_enable_prefix_caching;
        e.data_parallel_rank = Some(i64::from(self.data_parallel_rank));
        Ok(e)
    }

    /// The first replica's event config, from either flag style, with the injected faults.
    pub fn kv_events(&self) -> Result<Option<KvEventsConfig>, CliError> {
        let faults = EventFaults {
            drop_pct: self.events_drop_pct,
            dup_pct: self.events_dup_pct,
            reorder_pct: self.events_reorder_pct,
            // Each replica of the process offsets it (see `plans`), so they differ.
            seed: self.events_fault_seed,
        };
        faults.validate().map_err(|e| invalid("events-faults", e))?;
        let cfg = if let Some(json) = &self.kv_events_config {
            parse_kv_events_config(json)?
        } else {
            self.events_endpoint.as_ref().map(|e| {
                let mut cfg = KvEventsConfig::new(e);
                cfg.replay_endpoint = self.replay_endpoint.clone();
                cfg.topic = self.events_topic.clone();
                cfg
            })
        };
        if faults.any() && cfg.is_none() {
            return Err(invalid(
                "events-faults",
                "event faults need events (--events-endpoint or --kv-events-config)",
            ));
        }
        Ok(cfg.map(|mut c| {
            c.faults = faults;
            c
        }))
    }

    /// One plan per replica, with ports laid out by the rule in the module docs.
    pub fn plans(&self) -> Result<Vec<ReplicaPlan>, CliError> {
        if self.replicas == 0 {
            return Err(invalid("replicas", "must be at least 1"));
        }
        if self.data_parallel_size == 0 {
            return Err(invalid("data-parallel-size", "must be at least 1"));
        }
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            return Err(invalid("speedup", "must be a positive number"));
        }
        let engine = self.engine_config()?;
        let kv = self.kv_events()?;
        let lora_modules = self
            .lora_modules
            .iter()
            .map(|s| parse_lora_module(s))
            .collect::<Result<Vec<_>, _>>()?;
        let dp = self.data_parallel_size;
        let mut plans = Vec::with_capacity(self.replicas);
        for i in 0..self.replicas {
            let port = if self.port == 0 {
                0
            } else {
                offset_port(self.port, i).ok_or_else(|| invalid("port", "past 65535"))?
            };
            let by = u16::try_from(i * dp).map_err(|_| invalid("replicas", "too many ports"))?;
            let kv = kv
                .as_ref()
                .map(|k| {
                    k.offset(by).map(|mut k| {
                        k.faults.seed = k.faults.seed.wrapping_add(i as u64);
                        k
                    })
                })
                .transpose()
                .map_err(|e| invalid("events-endpoint", e))?;
            plans.push(ReplicaPlan {
                index: i,
                host: self.host.clone(),
                port,
                config: ServerConfig {
                    model: self.model.clone(),
                    engine: engine.clone(),
                    tokenizer_dir: self.tokenizer.clone(),
                    speedup: self.speedup,
                    kv_events: kv,
                    data_parallel_size: dp,
                    lora_modules: lora_modules.clone(),
                },
            });
        }
        check_ports(&plans, self.data_parallel_rank)?;
        Ok(plans)
    }
}

fn offset_port(port: u16, by: usize) -> Option<u16> {
    u16::try_from(by).ok().and_then(|b| port.checked_add(b))
}

/// Refuses plans where two listeners of this process would share a fixed port.
fn check_ports(plans: &[ReplicaPlan], first_rank: u16) -> Result<(), CliError> {
    let mut used: HashMap<u16, String> = HashMap::new();
    let mut claim = |port: u16, what: String| -> Result<(), CliError> {
        if port == 0 {
            return Ok(());
        }
        match used.get(&port) {
            Some(first) => Err(CliError::PortOverlap {
                port,
                first: first.clone(),
                second: what,
            }),
            None => {
                used.insert(port, what);
                Ok(())
            }
        }
    };
    for p in plans {
        claim(p.port, format!("replica {} HTTP", p.index))?;
        let Some(kv) = &p.config.kv_events else {
            continue;
        };
        for r in 0..p.config.data_parallel_size {
            let rank = usize::from(first_rank) + r;
            let by = u16::try_from(rank).map_err(|_| invalid("data-parallel-rank", "too large"))?;
            let rank_kv = kv.offset(by).map_err(|e| invalid("events-endpoint", e))?;
            // A connecting PUB uses a port of the subscriber's host, not of this process.
            if publisher_binds(&rank_kv.endpoint) {
                if let Some(port) = endpoint_port(&rank_kv.endpoint) {
                    claim(port, format!("replica {} rank {rank} events", p.index))?;
                }
            }
            if let Some(port) = rank_kv.replay_endpoint.as_deref().and_then(endpoint_port) {
                claim(port, format!("replica {} rank {rank} replay", p.index))?;
            }
        }
    }
    Ok(())
}

/// Starts every planned replica; on a failure the ones already started are stopped.
/// Replicas with the same tokenizer directory share one loaded tokenizer.
pub async fn start(plans: Vec<ReplicaPlan>) -> Result<Vec<Server>, CliError> {
    let mut servers: Vec<Server> = Vec::with_capacity(plans.len());
    let mut tokenizers: HashMap<PathBuf, Arc<Tokenizer>> = HashMap::new();
    for p in plans {
        let started = async {
            let tokenizer = match tokenizers.get(&p.config.tokenizer_dir) {
                Some(t) => Arc::clone(t),
                None => {
                    let t = Tokenizer::from_dir(&p.config.tokenizer_dir)
                        .map(Arc::new)
                        .map_err(|e| CliError::Server {
                            index: p.index,
                            source: e.into(),
                        })?;
                    tokenizers.insert(p.config.tokenizer_dir.clone(), Arc::clone(&t));
                    t
                }
            };
            let listener =
                TcpListener::bind((p.host.as_str(), p.port))
                    .await
                    .map_err(|source| CliError::Bind {
                        index: p.index,
                        host: p.host.clone(),
                        port: p.port,
                        source,
                    })?;
            Server::start_with_tokenizer(p.config, listener, tokenizer)
                .await
                .map_err(|source| CliError::Server {
                    index: p.index,
                    source,
                })
        }
        .await;
        match started {
            Ok(s) => servers.push(s),
            Err(e) => {
                for s in servers {
                    s.shutdown();
                }
                return Err(e);
            }
        }
    }
    Ok(servers)
}

/// The start-up line of one replica: `replica=I url=http://ADDR events=E0,E1 replay=R0,R1`
/// (one endpoint per DP rank, `-` when none).
pub fn describe(index: usize, server: &Server) -> String {
    let eps = server.event_endpoints();
    let list = |pick: &dyn Fn(&crate::RankEvents) -> Option<String>| -> String {
        let v: Vec<String> = eps
            .iter()
            .map(|e| e.as_ref().and_then(pick).unwrap_or_else(|| "-".into()))
            .collect();
        v.join(",")
    };
    format!(
        "replica={index} url=http://{} dp_ranks={} events={} replay={}",
        server.addr,
        server
            .ranks()
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        list(&|e| Some(e.events.clone())),
        list(&|e| e.replay.clone()),
    )
}

/// Runs the replicas the flags describe until SIGINT or SIGTERM, printing one line per
/// replica (see [`describe`]) once all of them listen.
pub async fn run(args: &SimArgs) -> Result<(), CliError> {
    let servers = start(args.plans()?).await?;
    for (i, s) in servers.iter().enumerate() {
        println!("{}", describe(i, s));
    }
    let waited = shutdown_signal().await;
    for s in servers {
        s.shutdown();
    }
    waited.map_err(CliError::Signal)
}

async fn shutdown_signal() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            r = tokio::signal::ctrl_c() => r,
            _ = term.recv() => Ok(()),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimArgs,
    }

    fn args(extra: &[&str]) -> SimArgs {
        let mut v = vec!["sim", "--tokenizer", "/tok"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v)
            .unwrap_or_else(|e| panic!("{e}"))
            .args
    }

    #[test]
    fn replicas_and_ranks_get_consecutive_ports() {
        let a = args(&[
            "--port",
            "9000",
            "--replicas",
            "3",
            "--data-parallel-size",
            "2",
            "--events-endpoint",
            "tcp://*:7000",
            "--replay-endpoint",
            "tcp://*:7100",
        ]);
        let plans = a.plans().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(plans.len(), 3);
        let ports: Vec<u16> = plans.iter().map(|p| p.port).collect();
        assert_eq!(ports, vec![9000, 9001, 9002]);
        let kv = plans[2]
            .config
            .kv_events
            .as_ref()
            .unwrap_or_else(|| panic!());
        assert_eq!(kv.endpoint, "tcp://*:7004");
        assert_eq!(kv.replay_endpoint.as_deref(), Some("tcp://*:7104"));
        // Rank 1 of replica 2 (the server applies the rank): 7005, as vLLM offsets rank 1.
        let r1 = kv.offset(1).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r1.endpoint, "tcp://*:7005");
        assert!(plans.iter().all(|p| p.config.data_parallel_size == 2));
    }

    #[test]
    fn overlapping_ports_are_refused() {
        // Defaults 5557/5558 with two replicas: replica 1's events would be replica 0's replay.
        let a = args(&[
            "--replicas",
            "2",
            "--events-endpoint",
            "tcp://*:5557",
            "--replay-endpoint",
            "tcp://*:5558",
        ]);
        let err = a.plans().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains("5558"), "{err}");
        let http = args(&["--port", "7000", "--events-endpoint", "tcp://*:7000"]);
        assert!(matches!(http.plans(), Err(CliError::PortOverlap { .. })));
        // A connecting PUB dials the subscriber's port: no clash with our own listeners.
        let connect = args(&["--port", "7000", "--events-endpoint", "tcp://10.0.0.1:7000"]);
        assert!(connect.plans().is_ok());
        // Port 0 everywhere: every listener picks its own.
        let free = args(&[
            "--port",
            "0",
            "--replicas",
            "4",
            "--events-endpoint",
            "tcp://127.0.0.1:0",
            "--replay-endpoint",
            "tcp://127.0.0.1:0",
        ]);
        assert!(free.plans().is_ok());
    }

    #[test]
    fn vllm_flag_names_and_short_aliases_agree() {
        let long = args(&[
            "--served-model-name",
            "m",
            "--num-gpu-blocks-override",
            "80",
            "--prefix-caching-hash-algo",
            "sha256_cbor",
            "--block-size",
            "32",
            "--kv-events-config",
            r#"{"endpoint":"tcp://*:6000","replay_endpoint":"tcp://*:6001","topic":"kv","buffer_steps":7,"max_queue_size":3}"#,
        ]);
        let short = args(&[
            "--model",
            "m",
            "--num-gpu-blocks",
            "80",
            "--hash-algo",
            "sha256_cbor",
            "--block-size",
            "32",
            "--events-endpoint",
            "tcp://*:6000",
            "--replay-endpoint",
            "tcp://*:6001",
            "--events-topic",
            "kv",
        ]);
        let (l, s) = (long.plans().unwrap(), short.plans().unwrap());
        assert_eq!(l[0].config.engine, s[0].config.engine);
        assert_eq!(l[0].config.model, "m");
        assert_eq!(l[0].config.engine.num_gpu_blocks, 80);
        assert_eq!(l[0].config.engine.block_size, 32);
        assert_eq!(l[0].config.engine.hash_algo, HashAlgo::Sha256Cbor);
        // 80 blocks of 32 hold 79 * 32 tokens: the profile's 131072 shrinks to fit.
        assert_eq!(l[0].config.engine.max_model_len, 79 * 32);
        let lk = l[0].config.kv_events.clone().unwrap();
        let sk = s[0].config.kv_events.clone().unwrap();
        assert_eq!((lk.buffer_steps, lk.max_queue_size), (7, 3));
        assert_eq!(
            (&lk.endpoint, &lk.replay_endpoint, &lk.topic),
            (&sk.endpoint, &sk.replay_endpoint, &sk.topic)
        );
        let both = Cli::try_parse_from([
            "sim",
            "--tokenizer",
            "t",
            "--events-endpoint",
            "tcp://*:1",
            "--kv-events-config",
            "{}",
        ]);
        assert!(both.is_err(), "one event flag style at a time");
        assert!(
            Cli::try_parse_from(["sim"]).is_err(),
            "--tokenizer is required"
        );
        let off = parse_kv_events_config(r#"{"enable_kv_cache_events": false}"#).unwrap();
        assert_eq!(off, None);
        assert!(parse_kv_events_config(r#"{"buffer_steps": 0}"#).is_err());
    }

    #[test]
    fn event_fault_flags_reach_every_replica_with_its_own_seed() {
        let a = args(&[
            "--replicas",
            "2",
            "--events-endpoint",
            "tcp://127.0.0.1:0",
            "--events-drop-pct",
            "5",
            "--events-dup-pct",
            "1.5",
            "--events-reorder-pct",
            "2",
            "--events-fault-seed",
            "7",
        ]);
        let plans = a.plans().unwrap_or_else(|e| panic!("{e}"));
        let f: Vec<EventFaults> = plans
            .iter()
            .map(|p| {
                p.config
                    .kv_events
                    .as_ref()
                    .map(|k| k.faults)
                    .unwrap_or_default()
            })
            .collect();
        assert_eq!(
            (f[0].drop_pct, f[0].dup_pct, f[0].reorder_pct),
            (5.0, 1.5, 2.0)
        );
        assert_eq!((f[0].seed, f[1].seed), (7, 8));
        assert!(args(&[])
            .plans()
            .is_ok_and(|p| p[0].config.kv_events.is_none()));
        let no_events = args(&["--events-drop-pct", "1"]).plans();
        assert!(matches!(
            no_events,
            Err(CliError::Invalid {
                flag: "events-faults",
                ..
            })
        ));
        let json = args(&["--kv-events-config", "{}", "--events-dup-pct", "200"]).plans();
        assert!(matches!(
            json,
            Err(CliError::Invalid {
                flag: "events-faults",
                ..
            })
        ));
    }

    #[test]
    fn lora_modules_parse_both_forms() {
        assert_eq!(
            parse_lora_module("sql=/adapters/sql").unwrap(),
            LoraModule {
                name: "sql".into(),
                path: "/adapters/sql".into(),
                base_model_name: None
            }
        );
        let j = parse_lora_module(r#"{"name":"a","path":"/p","base_model_name":"base"}"#).unwrap();
        assert_eq!(j.base_model_name.as_deref(), Some("base"));
        assert!(parse_lora_module("noequals").is_err());
        assert!(parse_lora_module(r#"{"name":"a"}"#).is_err());
        let a = args(&["--lora-modules", "x=/x", "y=/y"]);
        assert_eq!(a.plans().unwrap()[0].config.lora_modules.len(), 2);
    }

    #[test]
    fn bad_values_are_errors_naming_the_flag() {
        for (flags, flag) in [
            (vec!["--replicas", "0"], "replicas"),
            (vec!["--data-parallel-size", "0"], "data-parallel-size"),
            (vec!["--speedup", "0"], "speedup"),
            (vec!["--hash-algo", "md5"], "prefix-caching-hash-algo"),
            (vec!["--block-size", "0"], "block-size"),
            (
                vec![
                    "--data-parallel-size",
                    "2",
                    "--events-endpoint",
                    "ipc:///tmp/x",
                ],
                "events-endpoint",
            ),
        ] {
            let err = args(&flags).plans().map(|_| ()).unwrap_err().to_string();
            assert!(err.starts_with(&format!("--{flag}")), "{flags:?}: {err}");
        }
    }
}
