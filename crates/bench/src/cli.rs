//! `kinference bench`'s command line as a library: flags → workloads → simulated-time or live
//! runs → [`Report`] → `results.json`, `report.md`, plots and the report on stdout.
//!
//! The binary only parses [`BenchArgs`] and calls [`run`]. Progress and notes go to stderr,
//! the report to stdout; every failure comes back as a [`BenchError`]. Every policy of a
//! comparison sees the same re-timed workload (one [`Workload`] per run, cloned per load).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kinference_tokenize::Tokenizer;

use crate::live::{LiveOptions, LiveTarget};
use crate::peers::PeerRouter;
use crate::sources::{self, ConversationTiming, MOONCAKE_BLOCK};
use crate::synth::{MultiTurn, PrefixRatio, SharedPrefix};
use crate::text::{tokenize_chats, TextGen};
use crate::{
    bounds, compare_sim, summarize, Arrivals, BenchError, Costs, Progress, Report, RunReport,
    SimPolicy, SimSetup, Workload,
};

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
    pub mode: Mode,
    /// The workload (`--trace` implies `mooncake`).
    #[arg(long, value_enum, default_value = "mooncake")]
    pub workload: WorkloadKind,
    /// A Mooncake-format JSONL trace (plain or .gz).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Tokens per hash id of `--trace` (512 in the Mooncake release, 16 in the ShareGPT-derived file).
    #[arg(long, default_value_t = MOONCAKE_BLOCK)]
    pub trace_block: usize,
    /// ShareGPT JSONL(.gz) file (default: the shared multi-turn sample).
    #[arg(long)]
    pub sharegpt: Option<PathBuf>,
    /// ShareGPT conversations to read.
    #[arg(long, default_value_t = 1000)]
    pub conversations: usize,
    /// Azure CSV for `azure-*` workloads and `--arrivals azure`.
    #[arg(long)]
    pub azure: Option<PathBuf>,
    /// Policies, comma-separated: round-robin, least-load, session-affinity, approximate,
    /// precise, oracle (sim mode only).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "round-robin,least-load,approximate,precise,oracle"
    )]
    pub policies: Vec<String>,
    /// Sim mode: an extra policy as LABEL=JSON in the router's config schema, e.g.
    /// `precise-cap2={"kind":"precise","fair_share_cap":2.0}` (repeat for several).
    #[arg(long = "policy")]
    pub policy_json: Vec<String>,
    /// Simulated replicas.
    #[arg(long, default_value_t = 8)]
    pub replicas: usize,
    /// GPU/model profile of the simulated replicas.
    #[arg(long, default_value = "llama-3.1-8b-h100x1")]
    pub profile: String,
    /// KV-cache tokens per simulated replica (default: the profile's).
    #[arg(long)]
    pub kv_tokens: Option<u64>,
    /// How requests are timed.
    #[arg(long, value_enum, default_value = "trace")]
    pub arrivals: ArrivalKind,
    /// Divide the trace's times by this.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Requests per second for poisson/constant arrivals.
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Outstanding requests for closed-loop arrivals.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Sim mode: target offered load(s) as a fraction of fleet capacity, comma-separated; sets
    /// the trace speed-up from the timing model (several values = a sweep).
    #[arg(long, value_delimiter = ',')]
    pub load: Vec<f64>,
    /// Shared fraction(s) for the prefix-ratio workload, comma-separated (several = a sweep).
    #[arg(long, value_delimiter = ',', default_value = "0.5")]
    pub prefix_ratio: Vec<f64>,
    /// Synthetic workloads: requests (shared-prefix, prefix-ratio) or conversations (multi-turn).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Synthetic workloads: prefix groups.
    #[arg(long)]
    pub groups: Option<usize>,
    /// Shared-prefix: Zipf exponent of group popularity.
    #[arg(long)]
    pub zipf: Option<f64>,
    /// Shared-prefix: tokens of each shared prefix; prefix-ratio: prompt tokens.
    #[arg(long)]
    pub prefix_tokens: Option<usize>,
    /// Synthetic workloads: output tokens per request.
    #[arg(long)]
    pub output_tokens: Option<u32>,
    /// Seed of synthetic workloads and Poisson arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Stop after this many requests.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Stop issuing after this many seconds (sim: of workload time after re-timing; live: wall).
    #[arg(long)]
    pub max_duration: Option<f64>,
    /// Tokenizer directory: sizes live prompt text exactly and tokenizes ShareGPT chats for
    /// the simulator (default for ShareGPT in sim mode: the shared qwen3 tokenizer, if present).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Output folder for results.json, report.md and plots.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Skip the hit-rate references without timing (infinite, pooled, capped greedy).
    #[arg(long)]
    pub no_bounds: bool,
    /// Skip the PNG plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Watts per GPU while computing.
    #[arg(long, default_value_t = 700.0)]
    pub gpu_watts: f64,
    /// Dollars per GPU-hour.
    #[arg(long, default_value_t = 2.0)]
    pub usd_per_gpu_hour: f64,
    /// Live: NAME=URL of an OpenAI endpoint to benchmark (repeat for several).
    #[arg(long)]
    pub target: Vec<String>,
    /// Live: a replica's /metrics URL, for hit counters and per-replica load (repeat).
    #[arg(long)]
    pub replica_metrics: Vec<String>,
    /// Live: POST each replica's /reset_prefix_cache (derived from --replica-metrics)
    /// before each target.
    #[arg(long)]
    pub reset_caches: bool,
    /// Live: the model name to send (default: the target's first /v1/models entry).
    #[arg(long)]
    pub model: Option<String>,
    /// Live: most requests open at once.
    #[arg(long, default_value_t = 1024)]
    pub max_in_flight: usize,
    /// Live: per-request timeout, seconds.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Live: do not send `ignore_eos` (for endpoints that reject unknown fields).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Peer routers to compare (vllm-router, sglang-router): they need live mode with the
    /// replicas and the routers running; pass each one as a --target.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
}

/// Runs the benchmark `a` describes, writes its files to `--out` and prints the report;
/// `command` is the command line recorded in the report.
pub fn run(a: &BenchArgs, command: &str) -> Result<(), BenchError> {
    let costs = Costs {
        gpu_watts: a.gpu_watts,
        usd_per_gpu_hour: a.usd_per_gpu_hour,
    };
    check_peers(a)?;
    let report = match a.mode {
        Mode::Sim => run_sim(a, costs)?,
        Mode::Live => run_live(a, costs)?,
    };
    report.write_json(&a.out)?;
    report.write_markdown(&a.out, command)?;
    if !a.no_plots {
        let files = crate::plot::write_plots(&report, &a.out)?;
        if !crate::plot::font_available() {
            eprintln!("no TrueType font found (set KINFERENCE_FONT): plots have no text");
        }
        eprintln!("{} plots written", files.len());
    }
    println!("{}", report.markdown(command));
    eprintln!("results in {}", a.out.display());
    Ok(())
}

/// Peer routers are separate processes: only a live run can reach them.
fn check_peers(a: &BenchArgs) -> Result<(), BenchError> {
    for p in &a.peers {
        let Some(peer) = PeerRouter::from_name(p) else {
            return Err(BenchError::Usage(format!(
                "unknown peer router {p:?} (vllm-router, sglang-router)"
            )));
        };
        if a.mode == Mode::Sim {
            return Err(BenchError::Usage(format!(
                "peer routers run only in live mode: start the replicas (`kinference sim`) and \
                 `{}`, then pass it as --target {}=URL (installed: {})",
                peer.command(30000, 29000, &["<replica-url>...".into()])
                    .join(" "),
                peer.name(),
                peer.find().map_or("no".into(), |p| p.display().to_string())
            )));
        }
    }
    Ok(())
}

/// Prints progress to stderr at most twice a second (every 10 s when not on a terminal).
#[derive(Debug)]
pub struct ProgressLine {
    last: Instant,
    tty: bool,
    started: Instant,
}

impl Default for ProgressLine {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressLine {
    pub fn new() -> Self {
        ProgressLine {
            last: Instant::now() - Duration::from_secs(10),
            tty: std::io::stderr().is_terminal(),
            started: Instant::now(),
        }
    }

    pub fn update(&mut self, p: &Progress<'_>) {
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

/// A file of the shared data directory, used when its flag is not given.
fn data(rel: &str) -> Result<PathBuf, BenchError> {
    sources::data_file(rel).map_err(|e| BenchError::DefaultData {
        file: rel.to_owned(),
        source: Box::new(e),
    })
}

/// `given`, or the shared data file `rel`.
fn path_or_data(given: &Option<PathBuf>, rel: &str) -> Result<PathBuf, BenchError> {
    match given {
        Some(p) => Ok(p.clone()),
        None => data(rel),
    }
}

/// The workload(s) before re-timing: several for a prefix-ratio sweep.
pub fn workloads(a: &BenchArgs) -> Result<Vec<(String, Workload)>, BenchError> {
    let limit = a.max_requests.unwrap_or(usize::MAX);
    let kind = if a.trace.is_some() {
        WorkloadKind::Mooncake
    } else {
        a.workload
    };
    let w = match kind {
        WorkloadKind::Mooncake => {
            let p = path_or_data(&a.trace, "traces/mooncake/conversation_trace.jsonl")?;
            sources::read_mooncake(&p, a.trace_block, limit)?
        }
        WorkloadKind::Sharegpt => sharegpt(a)?,
        WorkloadKind::AzureConv => azure(a, "conv", limit)?,
        WorkloadKind::AzureCode => azure(a, "code", limit)?,
        WorkloadKind::SharedPrefix => shared_prefix(a)?,
        WorkloadKind::MultiTurn => multi_turn(a)?,
        WorkloadKind::PrefixRatio => return prefix_ratios(a),
    };
    Ok(vec![(w.name.clone(), w)])
}

fn sharegpt(a: &BenchArgs) -> Result<Workload, BenchError> {
    let p = path_or_data(
        &a.sharegpt,
        "traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz",
    )?;
    let timing = ConversationTiming {
        seed: a.seed,
        ..ConversationTiming::default()
    };
    sources::read_sharegpt(&p, a.conversations, timing)
}

/// An Azure trace workload; `which` names the default file (`conv` or `code`).
fn azure(a: &BenchArgs, which: &str, limit: usize) -> Result<Workload, BenchError> {
    let p = path_or_data(
        &a.azure,
        &format!("traces/azure/AzureLLMInferenceTrace_{which}.csv"),
    )?;
    let rows = sources::read_azure(&p, limit)?;
    let name = p
        .file_stem()
        .map_or("azure".into(), |s| s.to_string_lossy().into_owned());
    Ok(sources::azure_workload(&name, &rows, a.seed))
}

fn shared_prefix(a: &BenchArgs) -> Result<Workload, BenchError> {
    let d = SharedPrefix::default();
    SharedPrefix {
        requests: a.requests.unwrap_or(d.requests),
        groups: a.groups.unwrap_or(d.groups),
        zipf_s: a.zipf.unwrap_or(d.zipf_s),
        prefix_tokens: a.prefix_tokens.unwrap_or(d.prefix_tokens),
        output_tokens: a.output_tokens.unwrap_or(d.output_tokens),
        rate: a.rate,
        seed: a.seed,
        ..d
    }
    .generate()
}

fn multi_turn(a: &BenchArgs) -> Result<Workload, BenchError> {
    let d = MultiTurn::default();
    MultiTurn {
        conversations: a.requests.unwrap_or(d.conversations),
        system_prompts: a.groups.unwrap_or(d.system_prompts),
        reply_tokens: a.output_tokens.unwrap_or(d.reply_tokens),
        seed: a.seed,
        ..d
    }
    .generate()
}

/// One workload per `--prefix-ratio` value.
fn prefix_ratios(a: &BenchArgs) -> Result<Vec<(String, Workload)>, BenchError> {
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

/// How requests are timed, with the trace's times divided by `speedup`.
pub fn arrivals(a: &BenchArgs, speedup: f64) -> Result<Arrivals, BenchError> {
    Ok(match a.arrivals {
        ArrivalKind::Trace => Arrivals::Trace { speedup },
        ArrivalKind::Poisson => Arrivals::Poisson {
            rate: a.rate,
            seed: a.seed,
        },
        ArrivalKind::Constant => Arrivals::Constant { rate: a.rate },
        ArrivalKind::Azure => {
            let p = path_or_data(&a.azure, "traces/azure/AzureLLMInferenceTrace_conv.csv")?;
            let rows = sources::read_azure(&p, usize::MAX)?;
            Arrivals::Times {
                times: rows.iter().map(|r| r.at).collect(),
                speedup,
            }
        }
        ArrivalKind::Concurrency => Arrivals::Concurrency(a.concurrency),
    })
}

/// `--tokenizer`, or for ShareGPT in the simulator the shared qwen3 tokenizer if present.
fn tokenizer(a: &BenchArgs, sharegpt_sim: bool) -> Result<Option<Tokenizer>, BenchError> {
    let dir = match &a.tokenizer {
        Some(d) => Some(d.clone()),
        None if sharegpt_sim => sources::data_file("tokenizers/qwen3").ok(),
        None => None,
    };
    dir.map(|d| load_tokenizer(&d)).transpose()
}

fn load_tokenizer(dir: &Path) -> Result<Tokenizer, BenchError> {
    Tokenizer::from_dir(dir).map_err(|source| BenchError::LoadTokenizer {
        dir: dir.to_owned(),
        source,
    })
}

/// `--policies` and every `--policy LABEL=JSON`, in that order.
fn sim_policies(a: &BenchArgs) -> Result<Vec<SimPolicy>, BenchError> {
    let mut policies: Vec<SimPolicy> = a
        .policies
        .iter()
        .filter(|p| !p.trim().is_empty())
        .map(|p| SimPolicy::from_name(p.trim()))
        .collect::<Result<_, _>>()?;
    for p in &a.policy_json {
        let Some((label, json)) = p.split_once('=') else {
            return Err(BenchError::Usage(format!(
                "--policy wants LABEL=JSON, got {p:?}"
            )));
        };
        policies.push(SimPolicy::from_json(label, json)?);
    }
    Ok(policies)
}

/// A simulated-time comparison: every workload at every `--load` (or at `--speedup`).
pub fn run_sim(a: &BenchArgs, costs: Costs) -> Result<Report, BenchError> {
    if a.arrivals == ArrivalKind::Concurrency {
        return Err(BenchError::Usage(
            "closed-loop arrivals (--arrivals concurrency) need live mode".into(),
        ));
    }
    let setup = SimSetup::from_profile(&a.profile, a.replicas, a.kv_tokens)?;
    let policies = sim_policies(a)?;
    let sharegpt = a.trace.is_none() && a.workload == WorkloadKind::Sharegpt;
    let tok = tokenizer(a, sharegpt)?;
    if sharegpt && tok.is_none() {
        eprintln!(
            "no tokenizer: ShareGPT chats use the word-level stand-in (about 25 % fewer tokens)"
        );
    }
    let sim = SimComparison {
        a,
        setup: &setup,
        policies: &policies,
        costs,
    };
    let loads: Vec<Option<f64>> = if a.load.is_empty() {
        vec![None]
    } else {
        a.load.iter().map(|l| Some(*l)).collect()
    };
    let mut runs = Vec::new();
    let mut progress = ProgressLine::new();
    for (label, mut w) in workloads(a)? {
        tokenize_chats(&mut w, tok.as_ref(), setup.engine.vocab_size)?;
        for &load in &loads {
            runs.push(sim.run_at(&label, &w, load, &mut progress)?);
        }
    }
    Ok(Report {
        mode: "sim".into(),
        fleet: sim_fleet(&setup),
        costs,
        runs,
    })
}

/// What every run of a simulated comparison shares.
struct SimComparison<'a> {
    a: &'a BenchArgs,
    setup: &'a SimSetup,
    policies: &'a [SimPolicy],
    costs: Costs,
}

impl SimComparison<'_> {
    /// One run: `w` re-timed for `load` (or `--speedup`), with bounds, under every policy.
    fn run_at(
        &self,
        label: &str,
        w: &Workload,
        load: Option<f64>,
        progress: &mut ProgressLine,
    ) -> Result<RunReport, BenchError> {
        let (a, setup) = (self.a, self.setup);
        let mut w = w.clone();
        // Work and span are measured on the workload's own times.
        let speedup = match load {
            Some(l) => {
                if !matches!(a.arrivals, ArrivalKind::Trace) {
                    return Err(BenchError::Usage(
                        "--load sets the trace speed-up: use it with --arrivals trace".into(),
                    ));
                }
                crate::sim::speedup_for_load(&w, setup, l)?
            }
            None => a.speedup,
        };
        let arr = arrivals(a, speedup)?;
        arr.apply(&mut w)?;
        w.truncate(None, a.max_duration);
        if w.is_empty() {
            return Err(BenchError::Usage(
                "the workload is empty after --max-requests/--max-duration".into(),
            ));
        }
        let b = (!a.no_bounds).then(|| hit_rate_bounds(&w, setup));
        let run_label = match load {
            Some(l) => format!("{label} at {:.0} % load", l * 100.0),
            None => label.to_owned(),
        };
        eprintln!(
            "{run_label}: {} requests, {} policies",
            w.len(),
            self.policies.len()
        );
        let results = compare_sim(setup, &w, self.policies, &self.costs, &mut |p| {
            progress.update(p)
        })?;
        Ok(RunReport {
            label: run_label,
            load,
            speedup: matches!(a.arrivals, ArrivalKind::Trace | ArrivalKind::Azure)
                .then_some(speedup),
            workload: summarize(&w, &arr),
            bounds: b,
            policies: results,
        })
    }
}

/// The hit-rate references of `w` on `setup`'s fleet.
fn hit_rate_bounds(w: &Workload, setup: &SimSetup) -> bounds::Bounds {
    bounds::compute(
        w,
        setup.replicas,
        setup.blocks_per_replica(),
        setup.engine.block_size,
        setup.engine.vocab_size,
        setup.engine.max_model_len,
    )
}

/// The simulated fleet as `results.json` describes it.
fn sim_fleet(setup: &SimSetup) -> serde_json::Value {
    serde_json::json!({
        "replicas": setup.replicas,
        "profile": setup.profile,
        "gpus_per_replica": setup.gpus_per_replica,
        "block_size": setup.engine.block_size,
        "kv_blocks_per_replica": setup.blocks_per_replica(),
        "kv_tokens_per_replica": setup.blocks_per_replica() * setup.engine.block_size,
        "max_model_len": setup.engine.max_model_len,
    })
}

/// `--target NAME=URL`s, each with the replicas' metrics (and reset) URLs.
fn live_targets(a: &BenchArgs) -> Result<Vec<LiveTarget>, BenchError> {
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
    a.target
        .iter()
        .map(|t| {
            let Some((name, url)) = t.split_once('=') else {
                return Err(BenchError::Usage(format!(
                    "--target wants NAME=URL, got {t:?}"
                )));
            };
            Ok(LiveTarget {
                name: name.to_string(),
                base_url: url.to_string(),
                metrics_urls: a.replica_metrics.clone(),
                reset_urls: resets.clone(),
            })
        })
        .collect()
}

/// The live client's settings for one workload timed by `arr`.
fn live_options(
    a: &BenchArgs,
    tok: Option<&Tokenizer>,
    arr: &Arrivals,
    costs: Costs,
    setup: &SimSetup,
) -> Result<LiveOptions, BenchError> {
    let mut o = LiveOptions::new(TextGen::new(tok)?);
    o.model = a.model.clone();
    o.arrivals = arr.clone();
    o.max_duration = a.max_duration.map(Duration::from_secs_f64);
    o.request_timeout = Duration::from_secs_f64(a.request_timeout);
    o.max_in_flight = a.max_in_flight;
    o.ignore_eos = !a.no_ignore_eos;
    o.costs = costs;
    o.timing = Some((setup.engine.timing.clone(), setup.gpus_per_replica));
    Ok(o)
}

/// A live comparison: every workload against every `--target` over HTTP.
pub fn run_live(a: &BenchArgs, costs: Costs) -> Result<Report, BenchError> {
    if a.target.is_empty() {
        return Err(BenchError::Usage(
            "live mode needs at least one --target NAME=URL".into(),
        ));
    }
    if !a.load.is_empty() {
        return Err(BenchError::Usage(
            "--load needs the simulator's timing model: use --speedup or --rate in live mode"
                .into(),
        ));
    }
    let targets = live_targets(a)?;
    let tok = tokenizer(a, false)?;
    let setup = SimSetup::from_profile(&a.profile, a.replicas, a.kv_tokens)?;
    let mut runs = Vec::new();
    let mut progress = ProgressLine::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(BenchError::Runtime)?;
    for (label, mut w) in workloads(a)? {
        let arr = arrivals(a, a.speedup)?;
        arr.apply(&mut w)?;
        let o = live_options(a, tok.as_ref(), &arr, costs, &setup)?;
        let results = runtime.block_on(crate::live::run_targets(&w, &targets, &o, &mut |p| {
            progress.update(p)
        }))?;
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
