//! `kinfctl doctor`: checks, against one live replica, that a router configured like this
//! would reproduce the replica's block hashes — and if not, says which setting differs.
//!
//! Steps: read the replica's cache config from `/metrics`; tokenize a unique probe locally and
//! through `/tokenize`; subscribe to the replica's KV events (endpoint given, or discovered
//! through `/kv_event_sources`); send the probe (as token ids, so hashing is checked apart
//! from tokenization); wait until the index built from the events holds the probe's blocks
//! under the hashes computed here; send it again and compare the replica's `cached_tokens`
//! with the index's prediction. On a mismatch, the hashes of other algorithms, block sizes and
//! seeds are tried against what arrived to name the cause.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kinference_events::{
    resolve_endpoint, resolve_replay, EndpointError, EventPlane, EventPlaneConfig, WorkerConfig,
};
use kinference_index::{ReplicaId, WorkerId};
use kinference_tokenize::Tokenizer;
use kinference_vllm::metrics::ReplicaMetrics;
use kinference_vllm::{
    BlockHash, BlockHasher, DpRank, ExtraKeysFormat, HashAlgo, RequestExtras, Tier,
};
use serde::Serialize;
use serde_json::{json, Value};

#[derive(Debug, clap::Args)]
pub struct DoctorArgs {
    /// The replica's base URL, e.g. http://10.0.0.7:8000.
    #[arg(long)]
    replica: String,
    /// The router's tokenizer directory for this pool: compared with the replica's /tokenize.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// The model name to send (default: the first one the replica serves).
    #[arg(long)]
    model: Option<String>,
    /// The router's block size for this pool (default: the replica's).
    #[arg(long)]
    block_size: Option<usize>,
    /// The router's hash algorithm for this pool (default: the replica's).
    #[arg(long)]
    algo: Option<HashAlgo>,
    /// The router's seed (the replica's PYTHONHASHSEED), if any.
    #[arg(long)]
    seed: Option<String>,
    /// tagged (vLLM 0.34) or untagged (vLLM ≤ 0.24) extra keys.
    #[arg(long, default_value = "tagged")]
    extra_keys_format: ExtraKeysFormat,
    /// The replica's KV-event endpoint as configured on the replica (`tcp://*:5557`: it binds
    /// and we connect; `tcp://HOST:PORT`: it connects and we bind). Default: /kv_event_sources.
    #[arg(long)]
    events: Option<String>,
    /// The replica's replay endpoint (default: /kv_event_sources).
    #[arg(long)]
    replay: Option<String>,
    /// The replica's event topic.
    #[arg(long, default_value = "")]
    topic: String,
    /// How long to wait for the replica's events.
    #[arg(long, default_value_t = 20)]
    timeout_secs: u64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Warn,
    Fail,
    Skip,
}

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Status,
    pub detail: String,
}

#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub replica: String,
    pub checks: Vec<Check>,
    /// True when the probe's blocks arrived under the router's hashes.
    pub hashes_match: bool,
}

impl Report {
    fn push(&mut self, name: &'static str, status: Status, detail: impl Into<String>) {
        self.checks.push(Check {
            name,
            status,
            detail: detail.into(),
        });
    }

    pub fn render(&self) -> String {
        let mut s = format!("replica {}\n", self.replica);
        for c in &self.checks {
            let tag = match c.status {
                Status::Ok => "ok  ",
                Status::Warn => "warn",
                Status::Fail => "FAIL",
                Status::Skip => "skip",
            };
            s.push_str(&format!("{tag}  {:<9} {}\n", c.name, c.detail));
        }
        s.push_str(if self.hashes_match {
            "verdict: a router with these settings reproduces this replica's block hashes\n"
        } else {
            "verdict: a router with these settings would NOT reproduce this replica's block hashes\n"
        });
        s
    }
}

pub fn run(args: &DoctorArgs) -> Result<(bool, String)> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let report = rt.block_on(diagnose(args))?;
    let text = if args.json {
        serde_json::to_string_pretty(&report)? + "\n"
    } else {
        report.render()
    };
    Ok((report.hashes_match, text))
}

/// Runs every check against the replica, in order; a check that makes the next ones
/// meaningless ends the report early.
pub async fn diagnose(args: &DoctorArgs) -> Result<Report> {
    let base = args.replica.trim_end_matches('/').to_owned();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.timeout_secs.max(1)))
        .build()?;
    let mut report = Report {
        replica: base.clone(),
        ..Report::default()
    };
    let model = check_replica(&mut report, &http, &base, args).await?;
    let target = Target { http, base, model };
    let (block_size, algo) = check_config(&mut report, &target, args).await?;
    let probe = Probe::new(&target, block_size).await?;
    check_tokenizer(&mut report, args, &probe)?;
    let Some(events) = subscribe(&mut report, &target, args).await? else {
        return Ok(report);
    };
    let hasher = BlockHasher::new(
        algo,
        block_size,
        args.seed.as_deref(),
        args.extra_keys_format,
    )?;
    let expected: Vec<BlockHash> = hasher
        .hash_blocks(&probe.ids, &RequestExtras::default())
        .iter()
        .map(|d| d.event_hash())
        .collect();
    check_hashes(
        &mut report,
        &target,
        &events,
        &probe,
        &expected,
        (block_size, algo),
        args,
    )
    .await?;
    if report.hashes_match {
        check_cached(&mut report, &target, &events, &probe, &expected, block_size).await?;
    }
    events.plane.shutdown().await;
    Ok(report)
}

/// The replica under test and the model the probe is sent to.
struct Target {
    http: reqwest::Client,
    base: String,
    model: String,
}

impl Target {
    async fn tokens(&self, text: &str) -> Result<Vec<u32>> {
        replica_tokens(&self.http, &self.base, &self.model, text).await
    }

    async fn complete(&self, ids: &[u32]) -> Result<Value> {
        complete(&self.http, &self.base, &self.model, ids).await
    }
}

/// Check 1: Reachable, and which model: `--model` if the replica serves it, else its first.
async fn check_replica(
    report: &mut Report,
    http: &reqwest::Client,
    base: &str,
    args: &DoctorArgs,
) -> Result<String> {
    let models: Value = get_json(http, &format!("{base}/v1/models")).await?;
    let served: Vec<String> = models["data"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|m| m["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let model = match (&args.model, served.first()) {
        (Some(m), _) if served.contains(m) => m.clone(),
        (Some(m), _) => bail!("the replica does not serve model {m:?} (it serves {served:?})"),
        (None, Some(m)) => m.clone(),
        (None, None) => bail!("the replica's /v1/models lists no model"),
    };
    report.push(
        "replica",
        Status::Ok,
        format!("serves {served:?}; probing {model:?}"),
    );
    Ok(model)
}

/// Check 2: Cache configuration from `/metrics`, against the router's settings; returns the block
/// size and algorithm the router would use (its own where given, else the replica's).
async fn check_config(
    report: &mut Report,
    target: &Target,
    args: &DoctorArgs,
) -> Result<(usize, HashAlgo)> {
    let metrics_text = target
        .http
        .get(format!("{}/metrics", target.base))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    let cache = ReplicaMetrics::from_exposition(&metrics_text)
        .cache_config
        .unwrap_or_default();
    let block_size = agree_block_size(report, args.block_size, cache.block_size)?;
    let replica_algo = cache
        .prefix_caching_hash_algo
        .as_deref()
        .and_then(|a| a.parse::<HashAlgo>().ok());
    let algo = agree_algo(report, args.algo, replica_algo);
    if cache.enable_prefix_caching == Some(false) {
        report.push(
            "config",
            Status::Fail,
            "prefix caching is off on the replica",
        );
    }
    if !report.checks.iter().any(|c| c.name == "config") {
        report.push(
            "config",
            Status::Ok,
            format!(
                "block size {block_size}, hash {}, {} GPU blocks (vllm:cache_config_info)",
                algo.as_str(),
                cache
                    .num_gpu_blocks
                    .map_or_else(|| "?".to_owned(), |n| n.to_string())
            ),
        );
    }
    Ok((block_size, algo))
}

/// The router's block size (`ours`, else the replica's); a disagreement is a failed check.
fn agree_block_size(
    report: &mut Report,
    ours: Option<usize>,
    theirs: Option<usize>,
) -> Result<usize> {
    Ok(match (ours, theirs) {
        (Some(ours), Some(theirs)) if ours != theirs => {
            report.push(
                "config",
                Status::Fail,
                format!("block size: router {ours}, replica {theirs} (vllm:cache_config_info)"),
            );
            ours
        }
        (Some(ours), _) => ours,
        (None, Some(theirs)) => theirs,
        (None, None) => bail!(
            "the replica publishes no block_size in vllm:cache_config_info; pass --block-size"
        ),
    })
}

/// The router's hash algorithm (`ours`, else the replica's, else vLLM's default sha256); a
/// disagreement is a failed check.
fn agree_algo(report: &mut Report, ours: Option<HashAlgo>, theirs: Option<HashAlgo>) -> HashAlgo {
    match (ours, theirs) {
        (Some(ours), Some(theirs)) if ours != theirs => {
            report.push(
                "config",
                Status::Fail,
                format!(
                    "hash algorithm: router {}, replica {}",
                    ours.as_str(),
                    theirs.as_str()
                ),
            );
            ours
        }
        (Some(ours), _) => ours,
        (None, Some(theirs)) => theirs,
        (None, None) => HashAlgo::Sha256,
    }
}

/// A prompt no cache holds yet, long enough for several blocks, as the replica tokenizes it.
struct Probe {
    nonce: String,
    text: String,
    ids: Vec<u32>,
}

impl Probe {
    async fn new(target: &Target, block_size: usize) -> Result<Probe> {
        let nonce = probe_nonce();
        let mut text = format!("kinference doctor probe {nonce}.");
        let ids = loop {
            let ids = target.tokens(&text).await?;
            if ids.len() > block_size * 4 || text.len() > 200_000 {
                break ids;
            }
            text.push_str(" The router checks that it hashes blocks exactly as this replica does.");
        };
        Ok(Probe { nonce, text, ids })
    }
}

/// Check 3: Tokenization: the router's tokenizer against the replica's `/tokenize`.
fn check_tokenizer(report: &mut Report, args: &DoctorArgs, probe: &Probe) -> Result<()> {
    let Some(dir) = &args.tokenizer else {
        report.push("tokenize", Status::Skip, "no --tokenizer given");
        return Ok(());
    };
    let tok = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
    let local = tok.encode_completion(&probe.text)?;
    let ids = &probe.ids;
    if &local == ids {
        report.push(
            "tokenize",
            Status::Ok,
            format!(
                "{} ids equal (local tokenizer and the replica's /tokenize)",
                ids.len()
            ),
        );
    } else {
        let at = local.iter().zip(ids).take_while(|(a, b)| a == b).count();
        report.push(
            "tokenize",
            Status::Fail,
            format!(
                "ids differ at position {at} (local {:?}, replica {:?}; {} vs {} ids): tokenizer files or special tokens differ",
                local.get(at),
                ids.get(at),
                local.len(),
                ids.len()
            ),
        );
    }
    Ok(())
}

/// A live subscription to the replica's rank-0 event stream.
struct Events {
    plane: EventPlane,
    worker: WorkerId,
    timeout: Duration,
}

/// Check 4: Events: subscribes to rank 0's stream and waits for the publisher; `None` (with the
/// failure reported) when that is not possible.
async fn subscribe(
    report: &mut Report,
    target: &Target,
    args: &DoctorArgs,
) -> Result<Option<Events>> {
    let base = &target.base;
    let Some((events, replay, topic)) = event_endpoints(args, &target.http, base).await? else {
        report.push(
            "events",
            Status::Fail,
            "the replica publishes no KV events (no --kv-events-config, or /kv_event_sources empty)",
        );
        return Ok(None);
    };
    let worker = WorkerId::new(ReplicaId(0), DpRank(0));
    let host = url_host(base).unwrap_or_else(|| "127.0.0.1".to_owned());
    let wc = match subscription(worker, &events, replay.as_deref(), &topic, &host) {
        Ok(wc) => wc,
        Err(e) => {
            report.push("events", Status::Fail, format!("cannot subscribe: {e}"));
            return Ok(None);
        }
    };
    let plane = EventPlane::start(EventPlaneConfig::default())?;
    if let Err(e) = plane.add_worker(wc).await {
        report.push(
            "events",
            Status::Fail,
            format!("cannot subscribe to {events}: {e} (a running router may already hold this address)"),
        );
        plane.shutdown().await;
        return Ok(None);
    }
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    if plane
        .wait_for(worker, timeout, |h| h.connected)
        .await
        .is_err()
    {
        report.push(
            "events",
            Status::Fail,
            format!("no publisher connected within {timeout:?} ({events})"),
        );
        plane.shutdown().await;
        return Ok(None);
    }
    let replay = replay.map(|r| format!(", replay {r}")).unwrap_or_default();
    report.push(
        "events",
        Status::Ok,
        format!("subscribed to {events}{replay}"),
    );
    Ok(Some(Events {
        plane,
        worker,
        timeout,
    }))
}

impl Events {
    fn holds_all(&self, hashes: &[BlockHash]) -> bool {
        let idx = self.plane.index();
        let idx = idx.read();
        !hashes.is_empty() && hashes.iter().all(|&h| idx.holds(self.worker, h, Tier::Gpu))
    }

    fn batches_applied(&self) -> Option<u64> {
        self.plane.health(self.worker).map(|h| h.batches_applied)
    }
}

/// Check 5: Sends the probe and checks its blocks arrive under the hashes the router computes;
/// on a mismatch, names the setting that differs.
async fn check_hashes(
    report: &mut Report,
    target: &Target,
    events: &Events,
    probe: &Probe,
    expected: &[BlockHash],
    (block_size, algo): (usize, HashAlgo),
    args: &DoctorArgs,
) -> Result<()> {
    let before = events.batches_applied().unwrap_or(0);
    target.complete(&probe.ids).await?;
    let seen = await_probe_blocks(target, events, probe, expected, block_size, before).await?;
    let seen = events.batches_applied().unwrap_or(seen);
    if events.holds_all(expected) {
        report.hashes_match = true;
        report.push(
            "hashes",
            Status::Ok,
            format!(
                "{}/{} probe blocks announced under the router's hashes",
                expected.len(),
                expected.len()
            ),
        );
    } else if seen == before {
        let h = events.plane.health(events.worker);
        report.push(
            "hashes",
            Status::Fail,
            format!(
                "no KV events applied within {:?} after the probe (wrong endpoint or topic?); stream: {}",
                events.timeout,
                h.map_or_else(
                    || "gone".to_owned(),
                    |h| format!(
                        "connected {}, messages {}, gaps {}, replays {}/{}, decode errors {}, socket errors {}, state {:?}",
                        h.connected, h.messages, h.gaps, h.replays_succeeded, h.replays_attempted,
                        h.decode_errors, h.socket_errors, h.sync
                    )
                )
            ),
        );
    } else {
        report.push(
            "hashes",
            Status::Fail,
            explain_mismatch(&probe.ids, block_size, algo, args, |hs| {
                events.holds_all(hs)
            }),
        );
    }
    Ok(())
}

/// Waits for the probe's blocks under `expected`; returns the batches applied so far. Once
/// some batch arrived after the probe, a quiet spell means the replica has announced
/// everything the probe filled.
async fn await_probe_blocks(
    target: &Target,
    events: &Events,
    probe: &Probe,
    expected: &[BlockHash],
    block_size: usize,
    before: u64,
) -> Result<u64> {
    const QUIET: Duration = Duration::from_millis(300);
    const NUDGE: Duration = Duration::from_secs(1);
    let mut nudges = 0u32;
    let deadline = tokio::time::Instant::now() + events.timeout;
    let mut seen = before;
    while !events.holds_all(expected) {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            break;
        }
        let wait = left.min(if seen > before { QUIET } else { NUDGE });
        match events
            .plane
            .wait_for(events.worker, wait, |h| h.batches_applied > seen)
            .await
        {
            Ok(h) => seen = h.batches_applied,
            Err(_) if seen > before => break,
            Err(_) => {
                // A subscription only reaches the publisher some time after the connection
                // (ZMQ's slow joiner), so the probe's batch may have been dropped. Any later
                // batch reveals the gap, and replay fetches what was missed.
                nudges += 1;
                // Long enough to fill whole blocks: only full blocks produce events.
                let nudge = format!("kinference doctor nudge {} {nudges}: ", probe.nonce)
                    .repeat((block_size * 2 / 4).max(8));
                let nudge_ids = target.tokens(&nudge).await?;
                target.complete(&nudge_ids).await?;
            }
        }
    }
    Ok(seen)
}

/// Check 6: The replica's own count of cached tokens for a second probe against the index's
/// prediction.
async fn check_cached(
    report: &mut Report,
    target: &Target,
    events: &Events,
    probe: &Probe,
    expected: &[BlockHash],
    block_size: usize,
) -> Result<()> {
    let usage = target.complete(&probe.ids).await?;
    let cached = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
    let held = events
        .plane
        .index()
        .read()
        .longest_prefix(expected)
        .get(events.worker)
        .map_or(0, |t| t.gpu);
    // vLLM always computes the last prompt token, so at most len - 1 tokens can be served
    // from cache, in whole blocks.
    let cap = (probe.ids.len().saturating_sub(1) / block_size) * block_size;
    let predicted = (held as usize * block_size).min(cap) as u64;
    let line = |c: u64| {
        format!("second probe: replica reports {c} cached tokens, index predicts {predicted}")
    };
    match cached {
        Some(c) if c == predicted => report.push("cached", Status::Ok, line(c)),
        Some(c) => report.push("cached", Status::Warn, line(c)),
        None => report.push(
            "cached",
            Status::Skip,
            "the replica reports no usage.prompt_tokens_details.cached_tokens",
        ),
    }
    Ok(())
}

/// Names the setting that makes the hashes differ, by trying the others against the index.
fn explain_mismatch(
    ids: &[u32],
    block_size: usize,
    algo: HashAlgo,
    args: &DoctorArgs,
    holds_all: impl Fn(&[BlockHash]) -> bool,
) -> String {
    let algos = [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ];
    let sizes = [block_size, 16, 32, 64, 128];
    let seeds: [Option<&str>; 3] = [args.seed.as_deref(), None, Some("0")];
    let formats = [ExtraKeysFormat::Tagged, ExtraKeysFormat::Untagged];
    for a in algos {
        for &bs in &sizes {
            for seed in seeds {
                for f in formats {
                    let Ok(h) = BlockHasher::new(a, bs, seed, f) else {
                        continue;
                    };
                    let hs: Vec<BlockHash> = h
                        .hash_blocks(ids, &RequestExtras::default())
                        .iter()
                        .map(|d| d.event_hash())
                        .collect();
                    if holds_all(&hs) {
                        let mut diffs = Vec::new();
                        if a != algo {
                            diffs.push(format!(
                                "hash algorithm {} (router: {})",
                                a.as_str(),
                                algo.as_str()
                            ));
                        }
                        if bs != block_size {
                            diffs.push(format!("block size {bs} (router: {block_size})"));
                        }
                        if seed != args.seed.as_deref() {
                            diffs.push(format!(
                                "seed {} (router: {})",
                                seed.unwrap_or("unset"),
                                args.seed.as_deref().unwrap_or("unset")
                            ));
                        }
                        return format!(
                            "events arrived, but the replica hashes with {}",
                            diffs.join(", ")
                        );
                    }
                }
            }
        }
    }
    "events arrived, but under none of the hashes tried (algorithms, block sizes, seeds unset/0): the replica's PYTHONHASHSEED is probably set to another value — pass it with --seed".to_owned()
}

async fn get_json(http: &reqwest::Client, url: &str) -> Result<Value> {
    let resp = http
        .get(url)
        .send()
        .await
        .with_context(|| format!("GET {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        bail!("GET {url}: HTTP {status}");
    }
    resp.json()
        .await
        .with_context(|| format!("GET {url}: not JSON"))
}

async fn replica_tokens(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    text: &str,
) -> Result<Vec<u32>> {
    let url = format!("{base}/tokenize");
    let resp: Value = http
        .post(&url)
        .json(&json!({"model": model, "prompt": text}))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?
        .error_for_status()?
        .json()
        .await?;
    resp["tokens"]
        .as_array()
        .context("/tokenize answered without `tokens`")?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|v| u32::try_from(v).ok())
                .context("/tokenize answered with a non-integer token")
        })
        .collect()
}

/// Sends the probe as token ids (one output token) and returns its `usage`.
async fn complete(http: &reqwest::Client, base: &str, model: &str, ids: &[u32]) -> Result<Value> {
    let url = format!("{base}/v1/completions");
    let resp = http
        .post(&url)
        .json(&json!({"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0}))
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        bail!("POST {url}: HTTP {status}: {body}");
    }
    Ok(body["usage"].clone())
}

/// The event endpoints: from the flags, or the replica's `/kv_event_sources` (rank 0).
async fn event_endpoints(
    args: &DoctorArgs,
    http: &reqwest::Client,
    base: &str,
) -> Result<Option<(String, Option<String>, String)>> {
    if let Some(e) = &args.events {
        return Ok(Some((e.clone(), args.replay.clone(), args.topic.clone())));
    }
    let Ok(sources) = get_json(http, &format!("{base}/kv_event_sources")).await else {
        return Ok(None);
    };
    let rank0 = sources
        .get("0")
        .or_else(|| sources.as_object().and_then(|o| o.values().next()));
    let Some(cfg) = rank0 else {
        return Ok(None);
    };
    let Some(endpoint) = cfg["endpoint"].as_str() else {
        return Ok(None);
    };
    let replay = args
        .replay
        .clone()
        .or_else(|| cfg["replay_endpoint"].as_str().map(str::to_owned));
    let topic = cfg["topic"].as_str().unwrap_or(&args.topic).to_owned();
    Ok(Some((endpoint.to_owned(), replay, topic)))
}

/// The stream to subscribe to for rank 0's reported endpoints, by the router's rule: a
/// wildcard host means the replica binds, so we dial the replica's own host.
fn subscription(
    worker: WorkerId,
    events: &str,
    replay: Option<&str>,
    topic: &str,
    replica_host: &str,
) -> Result<WorkerConfig, EndpointError> {
    let mut wc = resolve_endpoint(events, 0, replica_host)?
        .worker(worker.replica, worker.rank)
        .with_topic(topic);
    if let Some(r) = replay {
        wc = wc.with_replay(&resolve_replay(r, 0, replica_host)?);
    }
    Ok(wc)
}

fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    (!host.is_empty()).then(|| host.to_owned())
}

fn probe_nonce() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}-{}", t, std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_events::SocketMode;

    #[test]
    fn wildcard_endpoints_are_dialled_on_the_replica_host() {
        let w = WorkerId::new(ReplicaId(0), DpRank(0));
        let sub = |ep: &str, host: &str| subscription(w, ep, Some(ep), "", host).unwrap();
        let wc = sub("tcp://*:5557", "10.0.0.7");
        assert_eq!(wc.address, "tcp://10.0.0.7:5557");
        assert_eq!(wc.mode, SocketMode::Connect);
        assert_eq!(wc.replay.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(sub("tcp://0.0.0.0:1", "h").address, "tcp://h:1");
        for wildcard in ["::", "[::]", "[*]"] {
            let wc = sub(&format!("tcp://{wildcard}:2"), "h");
            assert_eq!(
                (wc.address.as_str(), wc.mode),
                ("tcp://h:2", SocketMode::Connect)
            );
        }
        let wc = sub("tcp://10.0.0.1:9", "h");
        assert_eq!(wc.address, "tcp://10.0.0.1:9");
        assert_eq!(wc.mode, SocketMode::Bind);
        assert!(subscription(w, "ipc:///tmp/kv", None, "", "h").is_err());
        assert_eq!(
            url_host("http://10.0.0.7:8000/x").as_deref(),
            Some("10.0.0.7")
        );
        assert_eq!(url_host("http://example").as_deref(), Some("example"));
        assert_eq!(url_host("http://[::1]:80").as_deref(), Some("[::1]"));
    }
}
