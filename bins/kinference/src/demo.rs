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
use kinference_bench::synth::MultiTurn;
use kinference_bench::text::TextGen;
use kinference_bench::{summarize, Arrivals, Costs, PolicyRun, Report, RunReport, SimSetup};
use kinference_proxy::{Config, EventsSpec, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::cli::SimArgs;
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
    /// After the comparison, leave the replicas and a precise router running (Ctrl-C stops).
    #[arg(long)]
    keep_up: bool,
    /// The router's OpenAI port with --keep-up.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The router's admin port (metrics, /debug/explain) with --keep-up.
    #[arg(long, default_value = "127.0.0.1:9090")]
    admin: String,
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

    // The replicas: `kinference sim` as a library, every port chosen by the OS.
    let num_blocks = (args.kv_tokens / BLOCK_SIZE as usize).max(2);
    let sim_flags = [
        "sim".to_owned(),
        "--tokenizer".into(),
        tokenizer_dir.display().to_string(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        "0".into(),
        "--replicas".into(),
        args.replicas.to_string(),
        "--served-model-name".into(),
        MODEL.into(),
        "--profile".into(),
        args.profile.clone(),
        "--block-size".into(),
        BLOCK_SIZE.to_string(),
        "--num-gpu-blocks".into(),
        num_blocks.to_string(),
        "--speedup".into(),
        args.speedup.to_string(),
        "--kv-events-config".into(),
        r#"{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:0","replay_endpoint":"tcp://*:0"}"#.into(),
    ];
    let sim = SimFlags::try_parse_from(&sim_flags).context("simulator settings")?;
    let servers = kinference_sim_server::cli::start(sim.args.plans()?).await?;
    let mut replicas = Vec::new();
    for s in &servers {
        let url = format!("http://{}", s.addr);
        let eps = s
            .endpoints
            .as_ref()
            .and_then(|e| e.events.clone())
            .context("a simulated replica published no event endpoint")?;
        let replay = s.endpoints.as_ref().and_then(|e| e.replay.clone());
        let mut spec = ReplicaSpec::new(&url);
        spec.events = Some(EventsSpec {
            connect: Some(loopback(&eps)),
            replay: replay.as_deref().map(loopback),
            ..EventsSpec::default()
        });
        replicas.push(spec);
    }
    eprintln!(
        "demo: {} simulated replicas ({}, {} KV tokens each, {}x speed) at {}",
        servers.len(),
        args.profile,
        num_blocks * BLOCK_SIZE as usize,
        args.speedup,
        replicas
            .iter()
            .map(|r| r.url.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    );

    // The workload: multi-turn chats over a few shared system prompts.
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
    let costs = Costs {
        usd_per_gpu_hour: args.usd_per_gpu_hour,
        ..Costs::default()
    };
    let setup = SimSetup::from_profile(&args.profile, args.replicas, Some(args.kv_tokens as u64))?;
    let mut options = LiveOptions::new(TextGen::new(Some(&tokenizer))?);
    options.model = Some(MODEL.to_owned());
    options.arrivals = arrivals.clone();
    options.request_timeout = Duration::from_secs(120);
    options.costs = costs;
    options.timing = Some((setup.engine.timing.clone(), setup.gpus_per_replica));

    let metrics_urls: Vec<String> = replicas
        .iter()
        .map(|r| format!("{}/metrics", r.url))
        .collect();
    let reset_urls: Vec<String> = replicas
        .iter()
        .map(|r| format!("{}/reset_prefix_cache", r.url))
        .collect();
    let mut runs: Vec<PolicyRun> = Vec::new();
    for policy in &args.policies {
        let proxy = start_router(policy, &tokenizer_dir, &replicas, None).await?;
        // Events first: a router that misses the first batches would start cold.
        for r in &replicas {
            proxy
                .wait_for_events(&r.url, 0, Duration::from_secs(30), |h| h.connected)
                .await
                .with_context(|| format!("the {policy} router's event stream from {}", r.url))?;
        }
        eprintln!(
            "demo: {} requests through the {policy} router at http://{} ...",
            workload.requests.len(),
            proxy.data_addr()
        );
        let target = LiveTarget {
            name: policy.clone(),
            base_url: format!("http://{}", proxy.data_addr()),
            metrics_urls: metrics_urls.clone(),
            reset_urls: reset_urls.clone(),
        };
        let mut last = Instant::now();
        let mut result = kinference_bench::live::run_targets(
            &workload,
            std::slice::from_ref(&target),
            &options,
            &mut |p| {
                if last.elapsed() > Duration::from_secs(2) {
                    last = Instant::now();
                    eprintln!("demo:   {}/{} done", p.done, p.total);
                }
            },
        )
        .await?;
        proxy.shutdown().await;
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
    print_comparison(&run, args.speedup, &costs);
    let report = Report {
        mode: "live".into(),
        fleet: serde_json::json!({
            "replicas": args.replicas,
            "profile": args.profile,
            "kv_tokens_per_replica": num_blocks * BLOCK_SIZE as usize,
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
    eprintln!(
        "demo: finished in {:.0} s; results.json, report.md and plots in {}",
        started.elapsed().as_secs_f64(),
        args.out.display()
    );

    if args.keep_up {
        let proxy = start_router("precise", &tokenizer_dir, &replicas, Some(args)).await?;
        println!(
            "\nThe replicas and a precise router stay up (Ctrl-C stops them):\n  \
             curl http://{}/v1/chat/completions -H 'Content-Type: application/json' \\\n    \
             -d '{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hello\"}}]}}'\n  \
             curl http://{}/metrics\n  \
             curl -X POST http://{}/debug/explain -d '{{\"model\":\"{MODEL}\",\"prompt\":\"hello\"}}'\n  \
             curl http://{}/debug/replicas",
            proxy.data_addr(),
            proxy.admin_addr(),
            proxy.admin_addr(),
            proxy.admin_addr()
        );
        tokio::signal::ctrl_c()
            .await
            .context("waiting for Ctrl-C")?;
        proxy.shutdown().await;
    }
    for s in servers {
        s.shutdown();
    }
    Ok(())
}

/// `kinference sim`'s flags, parsed as the subcommand would parse them.
#[derive(Debug, Parser)]
struct SimFlags {
    #[command(flatten)]
    args: SimArgs,
}

async fn start_router(
    policy: &str,
    tokenizer: &Path,
    replicas: &[ReplicaSpec],
    keep_up: Option<&DemoArgs>,
) -> anyhow::Result<Proxy> {
    let mut pool = PoolConfig::new(MODEL, tokenizer, BLOCK_SIZE);
    pool.policy = kinference_proxy::parse_policy(policy).map_err(|e| anyhow::anyhow!(e))?;
    pool.replicas = replicas.to_vec();
    let mut config = Config::new(vec![pool]);
    config.scrape.interval_ms = 250;
    let (data, admin) = match keep_up {
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

fn ms(v: Option<f64>, speedup: f64) -> String {
    v.map_or_else(
        || "-".to_owned(),
        |s| format!("{:.0} ms", s * speedup * 1e3),
    )
}

/// The side-by-side table on stdout, and what the last policy saves against the first.
fn print_comparison(run: &RunReport, speedup: f64, costs: &Costs) {
    println!(
        "\n{} requests, {} ({}x speed; latencies in simulated GPU time)\n",
        run.workload.requests, run.label, speedup
    );
    println!(
        "| policy | hit rate | TTFT p50 | TTFT p90 | TTFT p99 | prefill GPU-s | kWh | $ | failed |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for p in &run.policies {
        let r = &p.result;
        let gpu = r.prefill_gpu_s.unwrap_or(0.0);
        println!(
            "| {} | {:.1} % | {} | {} | {} | {:.1} | {:.4} | {:.4} | {} |",
            r.policy,
            r.hit_rate * 100.0,
            ms(r.ttft_p50_s, speedup),
            ms(r.ttft_p90_s, speedup),
            ms(r.ttft_p99_s, speedup),
            gpu,
            costs.kwh(gpu),
            costs.usd(gpu),
            r.failed
        );
    }
    if let (Some(base), Some(last)) = (run.policies.first(), run.policies.last()) {
        if run.policies.len() > 1 {
            let (b, k) = (&base.result, &last.result);
            let gpu_b = b.prefill_gpu_s.unwrap_or(0.0);
            let gpu_k = k.prefill_gpu_s.unwrap_or(0.0);
            let saved = gpu_b - gpu_k;
            let pct = if gpu_b > 0.0 {
                saved / gpu_b * 100.0
            } else {
                0.0
            };
            println!(
                "\n{} vs {}: hit rate {:.1} % → {:.1} %, prefill GPU time −{:.1} % ({:.1} GPU-s, {:.4} kWh, ${:.4} saved on this workload)",
                k.policy,
                b.policy,
                b.hit_rate * 100.0,
                k.hit_rate * 100.0,
                pct,
                saved,
                costs.kwh(saved),
                costs.usd(saved)
            );
            if let (Some(p90b), Some(p90k)) = (b.ttft_p90_s, k.ttft_p90_s) {
                if p90k > 0.0 {
                    println!(
                        "TTFT p90 {} → {} ({:.1}x)",
                        ms(Some(p90b), speedup),
                        ms(Some(p90k), speedup),
                        p90b / p90k
                    );
                }
            }
        }
    }
}
