//! `kinference bench`: replays a workload against routing policies and reports TTFT, hit
//! rate, balance and GPU time: in simulated time (N simulated engines, the policies
//! in-process) or live over HTTP against OpenAI endpoints. Writes `results.json`,
//! `report.md` and PNG plots to `--out`, and prints the report.
//!
//! ```text
//! kinference bench --trace FILE --replicas 8 --mode sim --policies round-robin,precise --out DIR
//! kinference bench --workload sharegpt --replicas 4 --load 0.5,0.8
//! kinference bench --mode live --workload shared-prefix --target kinference=http://127.0.0.1:8000 \
//!     --replica-metrics http://127.0.0.1:8001/metrics --replica-metrics http://127.0.0.1:8002/metrics
//! ```

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kinference_bench::live::{LiveOptions, LiveTarget};
use kinference_bench::peers::PeerRouter;
use kinference_bench::sources::{self, ConversationTiming, MOONCAKE_BLOCK};
use kinference_bench::synth::{MultiTurn, PrefixRatio, SharedPrefix};
use kinference_bench::text::{tokenize_chats, TextGen};
use kinference_bench::{
    bounds, compare_sim, summarize, Arrivals, Costs, Progress, Report, RunReport, SimPolicy,
    SimSetup, Workload,
};
use kinference_tokenize::Tokenizer;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Simulated engines in virtual time, policies in-process (no sockets).
    Sim,
    /// HTTP against OpenAI-compatible endpoints (`--target`).
    Live,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Mooncake conversation trace (or `--trace FILE`).
    Mooncake,
    /// ShareGPT multi-turn conversations (each turn carries its history).
    Sharegpt,
    /// Azure conversation trace: arrival times and lengths, no shared prefixes.
    AzureConv,
    /// Azure code trace: arrival times and lengths, no shared prefixes.
    AzureCode,
    /// Groups sharing a long prefix, Zipf popularity.
    SharedPrefix,
    /// Synthetic multi-turn chats.
    MultiTurn,
    /// Fixed-length prompts with a shared fraction (`--prefix-ratio`, several = a sweep).
    PrefixRatio,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ArrivalKind {
    /// The workload's own times, divided by `--speedup` (or set by `--load`).
    Trace,
    /// Poisson at `--rate`.
    Poisson,
    /// Evenly spaced at `--rate`.
    Constant,
    /// Times from the Azure conversation trace (`--azure FILE` to change), over `--speedup`.
    Azure,
    /// Closed loop with `--concurrency` requests outstanding (live mode).
    Concurrency,
}

/// Flags of `kinference bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Simulated time or live HTTP.
    #[arg(long, value_enum, default_value = "sim")]
    mode: Mode,
    /// The workload (`--trace` implies `mooncake`).
    #[arg(long, value_enum, default_value = "mooncake")]
    workload: WorkloadKind,
    /// A Mooncake-format JSONL trace (plain or .gz).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Tokens per hash id of `--trace` (512 in the Mooncake release, 16 in the ShareGPT-derived file).
    #[arg(long, default_value_t = MOONCAKE_BLOCK)]
    trace_block: usize,
    /// ShareGPT JSONL(.gz) file (default: the shared multi-turn sample).
    #[arg(long)]
    sharegpt: Option<PathBuf>,
    /// ShareGPT conversations to read.
    #[arg(long, default_value_t = 1000)]
    conversations: usize,
    /// Azure CSV for `azure-*` workloads and `--arrivals azure`.
    #[arg(long)]
    azure: Option<PathBuf>,
    /// Policies, comma-separated: round-robin, least-load, session-affinity, approximate,
    /// precise, oracle (sim mode only).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-load,approximate,precise,oracle"
    )]
    policies: Vec<String>,
    /// Sim mode: an extra policy as LABEL=JSON in the router's config schema, e.g.
    /// `precise-cap2={"kind":"precise","fair_share_cap":2.0}` (repeat for several).
    #[arg(long = "policy")]
    policy_json: Vec<String>,
    /// Simulated replicas.
    #[arg(long, default_value_t = 8)]
    replicas: usize,
    /// GPU/model profile of the simulated replicas.
    #[arg(long, default_value = "llama-3.1-8b-h100x1")]
    profile: String,
    /// KV-cache tokens per simulated replica (default: the profile's).
    #[arg(long)]
    kv_tokens: Option<u64>,
    /// How requests are timed.
    #[arg(long, value_enum, default_value = "trace")]
    arrivals: ArrivalKind,
    /// Divide the trace's times by this.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Requests per second for poisson/constant arrivals.
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Outstanding requests for closed-loop arrivals.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Sim mode: target offered load(s) as a fraction of fleet capacity, comma-separated; sets
    /// the trace speed-up from the timing model (several values = a sweep).
    #[arg(long, value_delimiter = ',')]
    load: Vec<f64>,
    /// Shared fraction(s) for the prefix-ratio workload, comma-separated (several = a sweep).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    prefix_ratio: Vec<f64>,
    /// Synthetic workloads: requests (shared-prefix, prefix-ratio) or conversations (multi-turn).
    #[arg(long)]
    requests: Option<usize>,
    /// Synthetic workloads: prefix groups.
    #[arg(long)]
    groups: Option<usize>,
    /// Shared-prefix: Zipf exponent of group popularity.
    #[arg(long)]
    zipf: Option<f64>,
    /// Shared-prefix: tokens of each shared prefix; prefix-ratio: prompt tokens.
    #[arg(long)]
    prefix_tokens: Option<usize>,
    /// Synthetic workloads: output tokens per request.
    #[arg(long)]
    output_tokens: Option<u32>,
    /// Seed of synthetic workloads and Poisson arrivals.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop after this many requests.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Stop issuing after this many seconds (sim: of workload time after re-timing; live: wall).
    #[arg(long)]
    max_duration: Option<f64>,
    /// Tokenizer directory: sizes live prompt text exactly and tokenizes ShareGPT chats for
    /// the simulator (default for ShareGPT in sim mode: the shared qwen3 tokenizer, if present).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Output folder for results.json, report.md and plots.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Skip the hit-rate references without timing (infinite, pooled, capped greedy).
    #[arg(long)]
    no_bounds: bool,
    /// Skip the PNG plots.
    #[arg(long)]
    no_plots: bool,
    /// Watts per GPU while computing.
    #[arg(long, default_value_t = 700.0)]
    gpu_watts: f64,
    /// Dollars per GPU-hour.
    #[arg(long, default_value_t = 2.0)]
    usd_per_gpu_hour: f64,
    /// Live: NAME=URL of an OpenAI endpoint to benchmark (repeat for several).
    #[arg(long)]
    target: Vec<String>,
    /// Live: a replica's /metrics URL, for hit counters and per-replica load (repeat).
    #[arg(long)]
    replica_metrics: Vec<String>,
    /// Live: POST each replica's /reset_prefix_cache (derived from --replica-metrics)
    /// before each target.
    #[arg(long)]
    reset_caches: bool,
    /// Live: the model name to send (default: the target's first /v1/models entry).
    #[arg(long)]
    model: Option<String>,
    /// Live: most requests open at once.
    #[arg(long, default_value_t = 1024)]
    max_in_flight: usize,
    /// Live: per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    request_timeout: f64,
    /// Live: do not send `ignore_eos` (for endpoints that reject unknown fields).
    #[arg(long)]
    no_ignore_eos: bool,
    /// Peer routers to compare (vllm-router, sglang-router): they need live mode with the
    /// replicas and the routers running; pass each one as a --target.
    #[arg(long, value_delimiter = ',')]
    peers: Vec<String>,
}

/// Prints progress to stderr at most twice a second.
struct ProgressLine {
    last: Instant,
    tty: bool,
    started: Instant,
}

impl ProgressLine {
    fn new() -> Self {
        ProgressLine {
            last: Instant::now() - Duration::from_secs(10),
            tty: std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }

    fn update(&mut self, p: &Progress<'_>) {
        let done = p.done >= p.total;
        if !done && self.last.elapsed() < Duration::from_millis(if self.tty { 500 } else { 10_000 })
        {
            return;
        }
        self.last = Instant::now();
        let line = format!(
            "{:>16}: {:>6}/{} requests done, {:.0} s simulated/elapsed, {:.0} s wall",
            p.label,
            p.done,
            p.total,
            p.secs,
            self.started.elapsed().as_secs_f64()
        );
        let mut e = std::io::stderr();
        if self.tty {
            let _ = write!(e, "\r{line}\x1b[K");
            if done {
                let _ = writeln!(e);
            }
        } else {
            let _ = writeln!(e, "{line}");
        }
    }
}

fn data(rel: &str) -> anyhow::Result<PathBuf> {
    sources::data_file(rel).with_context(|| format!("default data file {rel} (pass a path)"))
}

/// The workload(s) before re-timing: several for a prefix-ratio sweep.
fn workloads(a: &BenchArgs) -> anyhow::Result<Vec<(String, Workload)>> {
    let limit = a.max_requests.unwrap_or(usize::MAX);
    let kind = if a.trace.is_some() {
        WorkloadKind::Mooncake
    } else {
        a.workload
    };
    let one = |w: Workload| Ok(vec![(w.name.clone(), w)]);
    match kind {
        WorkloadKind::Mooncake => {
            let p = match &a.trace {
                Some(p) => p.clone(),
                None => data("traces/mooncake/conversation_trace.jsonl")?,
            };
            one(sources::read_mooncake(&p, a.trace_block, limit)?)
        }
        WorkloadKind::Sharegpt => {
            let p = match &a.sharegpt {
                Some(p) => p.clone(),
                None => data("traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz")?,
            };
            let timing = ConversationTiming {
                seed: a.seed,
                ..ConversationTiming::default()
            };
            one(sources::read_sharegpt(&p, a.conversations, timing)?)
        }
        WorkloadKind::AzureConv | WorkloadKind::AzureCode => {
            let p = match &a.azure {
                Some(p) => p.clone(),
                None if kind == WorkloadKind::AzureConv => {
                    data("traces/azure/AzureLLMInferenceTrace_conv.csv")?
                }
                None => data("traces/azure/AzureLLMInferenceTrace_code.csv")?,
            };
            let rows = sources::read_azure(&p, limit)?;
            let name = p
                .file_stem()
                .map_or("azure".into(), |s| s.to_string_lossy().into_owned());
            one(sources::azure_workload(&name, &rows, a.seed))
        }
        WorkloadKind::SharedPrefix => {
            let d = SharedPrefix::default();
            one(SharedPrefix {
                requests: a.requests.unwrap_or(d.requests),
                groups: a.groups.unwrap_or(d.groups),
                zipf_s: a.zipf.unwrap_or(d.zipf_s),
                prefix_tokens: a.prefix_tokens.unwrap_or(d.prefix_tokens),
                output_tokens: a.output_tokens.unwrap_or(d.output_tokens),
                rate: a.rate,
                seed: a.seed,
                ..d
            }
            .generate()?)
        }
        WorkloadKind::MultiTurn => {
            let d = MultiTurn::default();
            one(MultiTurn {
                conversations: a.requests.unwrap_or(d.conversations),
                system_prompts: a.groups.unwrap_or(d.system_prompts),
                reply_tokens: a.output_tokens.unwrap_or(d.reply_tokens),
                seed: a.seed,
                ..d
            }
            .generate()?)
        }
        WorkloadKind::PrefixRatio => {
            let d = PrefixRatio::default();
            a.prefix_ratio
                .iter()
                .map(|&r| {
                    let w = PrefixRatio {
                        requests: a.requests.unwrap_or(d.requests),
                        prompt_tokens: a.prefix_tokens.unwrap_or(d.prompt_tokens),
                        prefix_ratio: r,
                        groups: a.groups.unwrap_or(d.groups),
                        output_tokens: a.output_tokens.unwrap_or(d.output_tokens),
                        rate: a.rate,
                        seed: a.seed,
                    }
                    .generate()?;
                    Ok((format!("prefix ratio {r}"), w))
                })
                .collect()
        }
    }
}

fn arrivals(a: &BenchArgs, speedup: f64) -> anyhow::Result<Arrivals> {
    Ok(match a.arrivals {
        ArrivalKind::Trace => Arrivals::Trace { speedup },
        ArrivalKind::Poisson => Arrivals::Poisson {
            rate: a.rate,
            seed: a.seed,
        },
        ArrivalKind::Constant => Arrivals::Constant { rate: a.rate },
        ArrivalKind::Azure => {
            let p = match &a.azure {
                Some(p) => p.clone(),
                None => data("traces/azure/AzureLLMInferenceTrace_conv.csv")?,
            };
            let rows = sources::read_azure(&p, usize::MAX)?;
            Arrivals::Times {
                times: rows.iter().map(|r| r.at).collect(),
                speedup,
            }
        }
        ArrivalKind::Concurrency => Arrivals::Concurrency(a.concurrency),
    })
}

fn tokenizer(a: &BenchArgs, sharegpt_sim: bool) -> anyhow::Result<Option<Tokenizer>> {
    let dir = match &a.tokenizer {
        Some(d) => Some(d.clone()),
        None if sharegpt_sim => sources::data_file("tokenizers/qwen3").ok(),
        None => None,
    };
    dir.map(|d| {
        Tokenizer::from_dir(&d).with_context(|| format!("loading the tokenizer in {}", d.display()))
    })
    .transpose()
}

fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let costs = Costs {
        gpu_watts: a.gpu_watts,
        usd_per_gpu_hour: a.usd_per_gpu_hour,
    };
    for p in &a.peers {
        let Some(peer) = PeerRouter::from_name(p) else {
            bail!("unknown peer router {p:?} (vllm-router, sglang-router)");
        };
        if a.mode == Mode::Sim {
            bail!(
                "peer routers run only in live mode: start the replicas (`kinference sim`) and \
                 `{}`, then pass it as --target {}=URL (installed: {})",
                peer.command(30000, 29000, &["<replica-url>...".into()])
                    .join(" "),
                peer.name(),
                peer.find().map_or("no".into(), |p| p.display().to_string())
            );
        }
    }
    let report = match a.mode {
        Mode::Sim => run_sim(&a, costs)?,
        Mode::Live => run_live(&a, costs)?,
    };
    let cmd = command_line();
    report.write_json(&a.out)?;
    report.write_markdown(&a.out, &cmd)?;
    if !a.no_plots {
        let files = kinference_bench::plot::write_plots(&report, &a.out)?;
        if !kinference_bench::plot::font_available() {
            eprintln!("no TrueType font found (set KINFERENCE_FONT): plots have no text");
        }
        eprintln!("{} plots written", files.len());
    }
    println!("{}", report.markdown(&cmd));
    eprintln!("results in {}", a.out.display());
    Ok(())
}

fn run_sim(a: &BenchArgs, costs: Costs) -> anyhow::Result<Report> {
    if a.arrivals == ArrivalKind::Concurrency {
        bail!("closed-loop arrivals (--arrivals concurrency) need live mode");
    }
    let setup = SimSetup::from_profile(&a.profile, a.replicas, a.kv_tokens)?;
    let mut policies: Vec<SimPolicy> = a
        .policies
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| SimPolicy::from_name(p.trim()))
        .collect::<Result<_, _>>()?;
    for p in &a.policy_json {
        let Some((label, json)) = p.split_once('=') else {
            bail!("--policy wants LABEL=JSON, got {p:?}");
        };
        policies.push(SimPolicy::from_json(label, json)?);
    }
    let sharegpt = a.trace.is_none() && a.workload == WorkloadKind::Sharegpt;
    let tok = tokenizer(a, sharegpt)?;
    if sharegpt && tok.is_none() {
        eprintln!(
            "no tokenizer: ShareGPT chats use the word-level stand-in (about 25 % fewer tokens)"
        );
    }
    let mut runs = Vec::new();
    let mut progress = ProgressLine::new();
    for (label, mut w) in workloads(a)? {
        tokenize_chats(&mut w, tok.as_ref(), setup.engine.vocab_size)?;
        let loads: Vec<Option<f64>> = if a.load.is_empty() {
            vec![None]
        } else {
            a.load.iter().map(|l| Some(*l)).collect()
        };
        for load in loads {
            let mut w = w.clone();
            // Work and span are measured on the workload's own times.
            let speedup = match load {
                Some(l) => {
                    if !matches!(a.arrivals, ArrivalKind::Trace) {
                        bail!("--load sets the trace speed-up: use it with --arrivals trace");
                    }
                    kinference_bench::sim::speedup_for_load(&w, &setup, l)?
                }
                None => a.speedup,
            };
            let arr = arrivals(a, speedup)?;
            arr.apply(&mut w)?;
            w.truncate(None, a.max_duration);
            if w.is_empty() {
                bail!("the workload is empty after --max-requests/--max-duration");
            }
            let b = (!a.no_bounds).then(|| {
                bounds::compute(
                    &w,
                    setup.replicas,
                    setup.blocks_per_replica(),
                    setup.engine.block_size,
                    setup.engine.vocab_size,
                    setup.engine.max_model_len,
                )
            });
            let run_label = match load {
                Some(l) => format!("{label} at {:.0} % load", l * 100.0),
                None => label.clone(),
            };
            eprintln!(
                "{run_label}: {} requests, {} policies",
                w.len(),
                policies.len()
            );
            let results = compare_sim(&setup, &w, &policies, &costs, &mut |p| progress.update(p))?;
            runs.push(RunReport {
                label: run_label,
                load,
                speedup: matches!(a.arrivals, ArrivalKind::Trace | ArrivalKind::Azure)
                    .then_some(speedup),
                workload: summarize(&w, &arr),
                bounds: b,
                policies: results,
            });
        }
    }
    Ok(Report {
        mode: "sim".into(),
        fleet: serde_json::json!({
            "replicas": setup.replicas,
            "profile": setup.profile,
            "gpus_per_replica": setup.gpus_per_replica,
            "block_size": setup.engine.block_size,
            "kv_blocks_per_replica": setup.blocks_per_replica(),
            "kv_tokens_per_replica": setup.blocks_per_replica() * setup.engine.block_size,
            "max_model_len": setup.engine.max_model_len,
        }),
        costs,
        runs,
    })
}

fn parse_target(s: &str) -> anyhow::Result<(String, String)> {
    let Some((name, url)) = s.split_once('=') else {
        bail!("--target wants NAME=URL, got {s:?}");
    };
    Ok((name.to_string(), url.to_string()))
}

fn run_live(a: &BenchArgs, costs: Costs) -> anyhow::Result<Report> {
    if a.target.is_empty() {
        bail!("live mode needs at least one --target NAME=URL");
    }
    if !a.load.is_empty() {
        bail!("--load needs the simulator's timing model: use --speedup or --rate in live mode");
    }
    let resets: Vec<String> = if a.reset_caches {
        a.replica_metrics
            .iter()
            .map(|m| {
                let base = m.trim_end_matches('/').trim_end_matches("/metrics");
                format!("{base}/reset_prefix_cache")
            })
            .collect()
    } else {
        Vec::new()
    };
    let targets: Vec<LiveTarget> = a
        .target
        .iter()
        .map(|t| {
            let (name, url) = parse_target(t)?;
            Ok(LiveTarget {
                name,
                base_url: url,
                metrics_urls: a.replica_metrics.clone(),
                reset_urls: resets.clone(),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let tok = tokenizer(a, false)?;
    let setup = SimSetup::from_profile(&a.profile, a.replicas, a.kv_tokens)?;
    let mut runs = Vec::new();
    let mut progress = ProgressLine::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    for (label, mut w) in workloads(a)? {
        let arr = arrivals(a, a.speedup)?;
        arr.apply(&mut w)?;
        let mut o = LiveOptions::new(TextGen::new(tok.as_ref())?);
        o.model = a.model.clone();
        o.arrivals = arr.clone();
        o.max_duration = a.max_duration.map(Duration::from_secs_f64);
        o.request_timeout = Duration::from_secs_f64(a.request_timeout);
        o.max_in_flight = a.max_in_flight;
        o.ignore_eos = !a.no_ignore_eos;
        o.costs = costs;
        o.timing = Some((setup.engine.timing.clone(), setup.gpus_per_replica));
        let results = runtime.block_on(kinference_bench::live::run_targets(
            &w,
            &targets,
            &o,
            &mut |p| progress.update(p),
        ))?;
        runs.push(RunReport {
            label,
            load: None,
            speedup: matches!(arr, Arrivals::Trace { .. }).then_some(a.speedup),
            workload: summarize(&w, &arr),
            bounds: None,
            policies: results,
        });
    }
    Ok(Report {
        mode: "live".into(),
        fleet: serde_json::json!({
            "targets": a.target,
            "replica_metrics": a.replica_metrics,
            "prefill_estimate_profile": setup.profile,
        }),
        costs,
        runs,
    })
}
