//! `kinference demo`: the whole product on one machine with no GPU and nothing to download.
//!
//! ```text
//!   N simulated replicas (realistic GPU profile, sped up; KV events on)
//!        ▲ one router per policy, each in front of the same replicas:
//!        │   round-robin, then kinference's precise policy
//!   bundled multi-turn chat workload, replayed live over HTTP through each router
//!        └─▶ TTFT, prefix-cache hit rate (the replicas' own counters), prefill GPU-seconds,
//!            kWh and $ — side by side, and what kinference saves
//! ```
//!
//! Invariants: every policy sees the same workload against the same replicas, whose caches
//! are reset before each run; latencies are measured in wall-clock time and reported in the
//! simulated GPU's time (× the speed-up), so HTTP and tokenization overhead is included
//! (inflated by the same factor, which only makes the comparison conservative for both).
//! The tokenizer is compiled into the binary and written to a temporary directory.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use kinference_bench::live::{LiveOptions, LiveTarget};
use kinference_bench::report::comparison;
use kinference_bench::synth::MultiTurn;
use kinference_bench::text::TextGen;
use kinference_bench::{
    summarize, Arrivals, Costs, PolicyRun, Report, RunReport, SimSetup, Workload,
};
use kinference_proxy::{Config, EventsSpec, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::cli::SimArgs;
use kinference_sim_server::Server;
use kinference_tokenize::Tokenizer;
use tokio::net::TcpListener;

/// The demo's tokenizer (a small Llama-style BPE with a chat template), so the demo needs no
/// files from outside the binary.
const TOKENIZER_FILES: [(&str, &[u8]); 4] = [
    (
        "tokenizer.json",
        include_bytes!("../assets/demo-tokenizer/tokenizer.json"),
    ),
    (
        "tokenizer_config.json",
        include_bytes!("../assets/demo-tokenizer/tokenizer_config.json"),
    ),
    (
        "chat_template.jinja",
        include_bytes!("../assets/demo-tokenizer/chat_template.jinja"),
    ),
    (
        "config.json",
        include_bytes!("../assets/demo-tokenizer/config.json"),
    ),
];

const MODEL: &str = "demo";
const BLOCK_SIZE: u32 = 16;

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Simulated replicas.
    #[arg(long, default_value_t = 4)]
    replicas: usize,
    /// GPU/model profile of the replicas (timing and KV capacity).
    #[arg(long, default_value = "llama-3.1-8b-h100x1")]
    profile: String,
    /// KV-cache tokens per replica: small enough that spreading a conversation over every
    /// replica evicts, as a busy production fleet would.
    #[arg(long, default_value_t = 65_536)]
    kv_tokens: usize,
    /// Conversations in the workload (each several turns over shared system prompts).
    #[arg(long, default_value_t = 64)]
    conversations: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// New conversations per simulated second.
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Simulated seconds per wall-clock second.
    #[arg(long, default_value_t = 10.0)]
    speedup: f64,
    /// A policy to compare (repeat the flag; the first is the baseline for savings): a name, or
    /// a policy in the config file's schema, e.g. `{kind: precise, fair_share_cap: 1.5}`.
    #[arg(long = "policy", default_values = ["round-robin", "precise"])]
    policies: Vec<String>,
    /// A tokenizer directory to use instead of the built-in one.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Where to write results.json, report.md and plots.
    #[arg(long, default_value = "target/demo")]
    out: PathBuf,
    /// Price of one GPU-hour, US dollars.
    #[arg(long, default_value_t = 2.0)]
    usd_per_gpu_hour: f64,
    /// After the comparison, leave the replicas and a precise router running, with its live
    /// dashboard, until Ctrl-C.
    #[arg(long, alias = "keep-up")]
    keep: bool,
    /// The router's OpenAI port with --keep.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The router's admin port (dashboard, metrics, /debug/explain) with --keep.
    #[arg(long, default_value = "127.0.0.1:9090")]
    admin: String,
    /// More log lines: -v for the router's and replicas' info lines, -vv for debug (by
    /// default only warnings; RUST_LOG overrides both).
    #[arg(short, long, action = clap::ArgAction::Count)]
    pub verbose: u8,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if args.replicas == 0 || args.policies.is_empty() {
        bail!("the demo needs at least one replica and one policy");
    }
    for p in &args.policies {
        kinference_proxy::parse_policy(p).map_err(|e| anyhow::anyhow!("--policy: {e}"))?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let scratch = std::env::temp_dir().join(format!("kinference-demo-{}", std::process::id()));
    let result = runtime.block_on(demo(&args, &scratch));
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

async fn demo(args: &DemoArgs, scratch: &Path) -> anyhow::Result<()> {
    let started = Instant::now();
    let tokenizer_dir = match &args.tokenizer {
        Some(d) => d.clone(),
        None => write_tokenizer(scratch)?,
    };
    let tokenizer = Tokenizer::from_dir(&tokenizer_dir)
        .with_context(|| format!("loading the tokenizer in {}", tokenizer_dir.display()))?;
    let fleet = Replicas::start(args, &tokenizer_dir).await?;
    let (workload, arrivals) = workload(args)?;
    let costs = Costs {
        usd_per_gpu_hour: args.usd_per_gpu_hour,
        ..Costs::default()
    };
    let options = live_options(args, &tokenizer, &arrivals, costs)?;
    let mut runs: Vec<PolicyRun> = Vec::new();
    for policy in &args.policies {
        let mut result =
            through_router(args, policy, &tokenizer_dir, &fleet, &workload, &options).await?;
        runs.append(&mut result);
    }
    let run = RunReport {
        label: workload.name.clone(),
        load: None,
        speedup: Some(args.speedup),
        workload: summarize(&workload, &arrivals),
        bounds: None,
        policies: runs,
    };
    print!("{}", comparison(&run, args.speedup, &costs));
    write_report(args, &fleet, costs, run)?;
    eprintln!(
        "demo: finished in {:.0} s; results.json, report.md and plots in {}",
        started.elapsed().as_secs_f64(),
        args.out.display()
    );
    if args.keep {
        keep_up(args, &tokenizer_dir, &fleet, &workload, &options).await?;
    }
    for s in fleet.servers {
        s.shutdown();
    }
    Ok(())
}

/// The simulated replicas and the router's entries for them.
struct Replicas {
    servers: Vec<Server>,
    specs: Vec<ReplicaSpec>,
    /// KV-cache blocks per replica.
    num_blocks: usize,
}

impl Replicas {
    /// `kinference sim` as a library, every port chosen by the OS.
    async fn start(args: &DemoArgs, tokenizer_dir: &Path) -> anyhow::Result<Replicas> {
        let num_blocks = (args.kv_tokens / BLOCK_SIZE as usize).max(2);
        let flags = sim_flags(args, tokenizer_dir, num_blocks);
        let sim = SimFlags::try_parse_from(&flags).context("simulator settings")?;
        let servers = kinference_sim_server::cli::start(sim.args.plans()?).await?;
        let specs = servers
            .iter()
            .map(replica_spec)
            .collect::<anyhow::Result<Vec<_>>>()?;
        eprintln!(
            "demo: {} simulated replicas ({}, {} KV tokens each, {}x speed) at {}",
            servers.len(),
            args.profile,
            num_blocks * BLOCK_SIZE as usize,
            args.speedup,
            specs
                .iter()
                .map(|r| r.url.as_str())
                .collect::<Vec<_>>()
                .join(" ")
        );
        Ok(Replicas {
            servers,
            specs,
            num_blocks,
        })
    }

    fn urls(&self) -> Vec<String> {
        self.specs.iter().map(|r| r.url.clone()).collect()
    }
}

/// The command line `kinference sim` would be given for the demo's replicas.
fn sim_flags(args: &DemoArgs, tokenizer_dir: &Path, num_blocks: usize) -> Vec<String> {
    [
        "sim",
        "--tokenizer",
        &tokenizer_dir.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--replicas",
        &args.replicas.to_string(),
        "--served-model-name",
        MODEL,
        "--profile",
        &args.profile,
        "--block-size",
        &BLOCK_SIZE.to_string(),
        "--num-gpu-blocks",
        &num_blocks.to_string(),
        "--speedup",
        &args.speedup.to_string(),
        "--kv-events-config",
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}"#,
    ]
    .map(str::to_owned)
    .into()
}

/// A router's entry for a started replica: its URL and its event streams over loopback.
fn replica_spec(s: &Server) -> anyhow::Result<ReplicaSpec> {
    let eps = s
        .endpoints
        .as_ref()
        .and_then(|e| e.events.clone())
        .context("a simulated replica published no event endpoint")?;
    let replay = s.endpoints.as_ref().and_then(|e| e.replay.clone());
    let mut spec = ReplicaSpec::new(&format!("http://{}", s.addr));
    spec.events = Some(EventsSpec {
        connect: Some(loopback(&eps)),
        replay: replay.as_deref().map(loopback),
        ..EventsSpec::default()
    });
    Ok(spec)
}

/// Multi-turn chats over a few shared system prompts, timed at the demo's speed-up.
fn workload(args: &DemoArgs) -> anyhow::Result<(Workload, Arrivals)> {
    let mut workload = MultiTurn {
        conversations: args.conversations,
        turns: args.turns,
        // Long user turns (pasted documents, code): history is most of every prompt, so
        // where a conversation's turns land decides how much is recomputed.
        system_prompts: 4,
        system_tokens: 512,
        user_tokens: 1024,
        reply_tokens: 64,
        start_rate: args.rate,
        think_secs: 8.0,
        seed: 7,
    }
    .generate()?;
    let arrivals = Arrivals::Trace {
        speedup: args.speedup,
    };
    arrivals.apply(&mut workload)?;
    Ok((workload, arrivals))
}

fn live_options(
    args: &DemoArgs,
    tokenizer: &Tokenizer,
    arrivals: &Arrivals,
    costs: Costs,
) -> anyhow::Result<LiveOptions> {
    let setup = SimSetup::from_profile(&args.profile, args.replicas, Some(args.kv_tokens as u64))?;
    let mut options = LiveOptions::new(TextGen::new(Some(tokenizer))?);
    options.model = Some(MODEL.to_owned());
    options.arrivals = arrivals.clone();
    options.request_timeout = Duration::from_secs(120);
    options.costs = costs;
    options.timing = Some((setup.engine.timing.clone(), setup.gpus_per_replica));
    Ok(options)
}

/// The workload through a fresh router with `policy` in front of the replicas.
async fn through_router(
    args: &DemoArgs,
    policy: &str,
    tokenizer_dir: &Path,
    fleet: &Replicas,
    workload: &Workload,
    options: &LiveOptions,
) -> anyhow::Result<Vec<PolicyRun>> {
    let proxy = start_router(policy, tokenizer_dir, &fleet.specs, args, false).await?;
    // Events first: a router that misses the first batches would start cold.
    for r in &fleet.specs {
        proxy
            .wait_for_events(&r.url, 0, Duration::from_secs(30), |h| h.connected)
            .await
            .with_context(|| format!("the {policy} router's event stream from {}", r.url))?;
    }
    let target = LiveTarget::in_front_of(
        policy,
        format!("http://{}", proxy.data_addr()),
        &fleet.urls(),
    );
    let mut bar = ProgressBar::new(policy, workload.requests.len());
    let result = kinference_bench::live::run_targets(
        workload,
        std::slice::from_ref(&target),
        options,
        &mut |p| bar.update(p.done),
    )
    .await;
    bar.finish();
    proxy.shutdown().await;
    Ok(result?)
}

/// One policy's run on stderr: a bar redrawn in place on a terminal, a line per tenth of
/// the requests otherwise (a log file gets no carriage returns).
struct ProgressBar {
    label: String,
    total: usize,
    done: usize,
    terminal: bool,
    drawn: Option<Instant>,
    /// `done` when the bar was last drawn.
    drawn_done: usize,
    started: Instant,
}

impl ProgressBar {
    const WIDTH: usize = 32;

    fn new(label: &str, total: usize) -> Self {
        use std::io::IsTerminal;
        let mut bar = ProgressBar {
            label: format!("{label:>12}"),
            total: total.max(1),
            done: 0,
            terminal: std::io::stderr().is_terminal(),
            drawn: None,
            drawn_done: 0,
            started: Instant::now(),
        };
        bar.draw();
        bar
    }

    fn update(&mut self, done: usize) {
        let tenth = |n: usize| n * 10 / self.total;
        let due = if self.terminal {
            self.drawn
                .is_none_or(|t| t.elapsed() >= Duration::from_millis(100))
        } else {
            tenth(done) > tenth(self.done)
        };
        self.done = done;
        if due {
            self.drawn = Some(Instant::now());
            self.draw();
        }
    }

    fn draw(&mut self) {
        self.drawn_done = self.done;
        let filled = (self.done.min(self.total) * Self::WIDTH) / self.total;
        let line = format!(
            "{} [{}{}] {}/{} requests, {:.0} s",
            self.label,
            "#".repeat(filled),
            "-".repeat(Self::WIDTH - filled),
            self.done,
            self.total,
            self.started.elapsed().as_secs_f64()
        );
        if self.terminal {
            eprint!("\r{line}");
        } else {
            eprintln!("{line}");
        }
    }

    fn finish(&mut self) {
        if self.terminal || self.drawn_done != self.done {
            self.draw();
        }
        if self.terminal {
            eprintln!();
        }
    }
}

/// results.json, report.md and the plots under `--out`.
fn write_report(
    args: &DemoArgs,
    fleet: &Replicas,
    costs: Costs,
    run: RunReport,
) -> anyhow::Result<()> {
    let report = Report {
        mode: "live".into(),
        fleet: serde_json::json!({
            "replicas": args.replicas,
            "profile": args.profile,
            "kv_tokens_per_replica": fleet.num_blocks * BLOCK_SIZE as usize,
            "speedup": args.speedup,
            "latencies": "wall-clock seconds at the speed-up (multiply by it for GPU time)",
        }),
        costs,
        runs: vec![run],
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    report.write_json(&args.out)?;
    report.write_markdown(&args.out, "kinference demo")?;
    kinference_bench::plot::write_plots(&report, &args.out)?;
    Ok(())
}

/// `--keep`: a precise router on the fixed ports until Ctrl-C, with the workload replayed
/// through it over and over so that its dashboard has something to show.
async fn keep_up(
    args: &DemoArgs,
    tokenizer_dir: &Path,
    fleet: &Replicas,
    workload: &Workload,
    options: &LiveOptions,
) -> anyhow::Result<()> {
    let proxy = start_router("precise", tokenizer_dir, &fleet.specs, args, true).await?;
    let target = LiveTarget::in_front_of(
        "precise",
        format!("http://{}", proxy.data_addr()),
        &fleet.urls(),
    );
    let (workload, options) = (workload.clone(), options.clone());
    let traffic = tokio::spawn(async move {
        loop {
            let run = kinference_bench::live::run_targets(
                &workload,
                std::slice::from_ref(&target),
                &options,
                &mut |_| {},
            )
            .await;
            if let Err(e) = run {
                tracing::warn!(error = %e, "the demo's background traffic stopped");
                return;
            }
        }
    });
    println!(
        "\nThe replicas and a precise router stay up (Ctrl-C stops them).\n\
         Live dashboard: http://{}/dashboard\n  \
         curl http://{}/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
         -d '{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'\n  \
         curl http://{}/metrics\n  \
         curl -X POST http://{}/debug/explain -d '{{\"model\":\"{MODEL}\",\"prompt\":\"hello\"}}'\n  \
         curl http://{}/debug/replicas",
        proxy.admin_addr(),
        proxy.data_addr(),
        proxy.admin_addr(),
        proxy.admin_addr(),
        proxy.admin_addr()
    );
    eprintln!("demo: the workload is replayed through this router until Ctrl-C");
    let waited = tokio::signal::ctrl_c().await.context("waiting for Ctrl-C");
    traffic.abort();
    proxy.shutdown().await;
    waited?;
    Ok(())
}

/// `kinference sim`'s flags, parsed as the subcommand would parse them.
#[derive(Debug, Parser)]
struct SimFlags {
    #[command(flatten)]
    args: SimArgs,
}

/// A router with `policy` in front of `replicas`, its savings charged with the demo's profile
/// and price; on `--listen` and `--admin` when `fixed_ports`, else on ports the OS picks.
async fn start_router(
    policy: &str,
    tokenizer: &Path,
    replicas: &[ReplicaSpec],
    args: &DemoArgs,
    fixed_ports: bool,
) -> anyhow::Result<Proxy> {
    let mut pool = PoolConfig::new(MODEL, tokenizer, BLOCK_SIZE);
    pool.policy = kinference_proxy::parse_policy(policy).map_err(|e| anyhow::anyhow!(e))?;
    pool.replicas = replicas.to_vec();
    pool.savings_profile = args.profile.clone();
    let mut config = Config::new(vec![pool]);
    config.scrape.interval_ms = 250;
    config.savings.usd_per_gpu_hour = args.usd_per_gpu_hour;
    let (data, admin) = match fixed_ports.then_some(args) {
        Some(a) => (
            TcpListener::bind(&a.listen)
                .await
                .with_context(|| format!("binding {}", a.listen))?,
            TcpListener::bind(&a.admin)
                .await
                .with_context(|| format!("binding {}", a.admin))?,
        ),
        None => (
            TcpListener::bind("127.0.0.1:0").await?,
            TcpListener::bind("127.0.0.1:0").await?,
        ),
    };
    Ok(Proxy::start_with(config, data, admin).await?)
}

/// A publisher's bound endpoint (`tcp://0.0.0.0:P` or `tcp://*:P`) as a loopback address.
fn loopback(bound: &str) -> String {
    match bound.rsplit_once(':') {
        Some((_, port)) => format!("tcp://127.0.0.1:{port}"),
        None => bound.to_owned(),
    }
}

fn write_tokenizer(scratch: &Path) -> anyhow::Result<PathBuf> {
    let dir = scratch.join("tokenizer");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in TOKENIZER_FILES {
        std::fs::write(dir.join(name), bytes)
            .with_context(|| format!("writing {}", dir.join(name).display()))?;
    }
    Ok(dir)
}
