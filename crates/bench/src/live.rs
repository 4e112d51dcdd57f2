//! Live mode: a workload sent over HTTP to OpenAI-compatible endpoints (the router, a peer
//! router, a replica), timed from the client with streaming responses.
//!
//! ```text
//!   Workload ──▶ issue loop (open: sleep until each arrival; closed: N workers)
//!                   │ spawn per request, at most max_in_flight open
//!                   ▼
//!   POST /v1/completions | /v1/chat/completions (stream, include_usage)
//!        SSE chunks ──▶ TTFT (first content), ITL (gaps between content chunks), e2e, usage
//!   before/after: GET each replica /metrics ──▶ prefix-cache hits/queries, requests per replica
//! ```
//!
//! All timing uses tokio's clock, so tests may pause it. Hit rates come from the replicas'
//! own counters when their metrics URLs are given (`vllm:prefix_cache_hits_total` over
//! `vllm:prefix_cache_queries_total`, differences across the run), else from
//! `usage.prompt_tokens_details.cached_tokens`. Targets are run one after another; each may
//! reset the replicas' prefix caches first so that every policy starts cold.

use std::sync::Arc;
use std::time::Duration;

use kinference_sim::TimingModel;
use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;

use crate::error::BenchError;
use crate::report::PolicyRun;
use crate::sim::{prefill_secs, Progress};
use crate::stats::{imbalance, Costs, PolicyResult};
use crate::text::TextGen;
use crate::workload::{Arrivals, Prompt, Workload};

/// One endpoint to benchmark, under a label (the policy it routes with).
#[derive(Clone, Debug, PartialEq)]
pub struct LiveTarget {
    pub name: String,
    /// The OpenAI base URL (`http://host:port` or `http://host:port/v1`).
    pub base_url: String,
    /// The replicas' Prometheus endpoints (`http://replica/metrics`), for hit counters and
    /// requests per replica.
    pub metrics_urls: Vec<String>,
    /// URLs to POST before this target's run (the replicas' `/reset_prefix_cache`).
    pub reset_urls: Vec<String>,
}

impl LiveTarget {
    /// A router at `base_url` in front of replicas at `replica_urls` (`http://host:port`):
    /// their counters are read from `/metrics` and their caches reset before the run.
    pub fn in_front_of(name: &str, base_url: String, replica_urls: &[String]) -> LiveTarget {
        LiveTarget {
            name: name.to_owned(),
            base_url,
            metrics_urls: replica_urls
                .iter()
                .map(|u| format!("{u}/metrics"))
                .collect(),
            reset_urls: replica_urls
                .iter()
                .map(|u| format!("{u}/reset_prefix_cache"))
                .collect(),
        }
    }
}

/// How a live run issues requests.
#[derive(Clone, Debug)]
pub struct LiveOptions {
    /// The `model` field; `None` asks the target's `/v1/models` for its first model.
    pub model: Option<String>,
    /// Open loop (the workload's times, already re-timed) unless `Arrivals::Concurrency`.
    pub arrivals: Arrivals,
    /// Stop issuing requests after this long (requests already sent may finish).
    pub max_duration: Option<Duration>,
    /// Per-request limit, headers to last byte.
    pub request_timeout: Duration,
    /// Most requests open at once in open-loop mode (arrivals wait beyond it).
    pub max_in_flight: usize,
    /// Send vLLM's `ignore_eos: true` so outputs have the workload's lengths.
    pub ignore_eos: bool,
    pub text: TextGen,
    pub costs: Costs,
    /// The GPU profile's timing model and GPUs per replica, to estimate prefill GPU time
    /// from prompt and cached token counts.
    pub timing: Option<(TimingModel, u32)>,
}

impl LiveOptions {
    pub fn new(text: TextGen) -> Self {
        LiveOptions {
            model: None,
            arrivals: Arrivals::Trace { speedup: 1.0 },
            max_duration: None,
            request_timeout: Duration::from_secs(600),
            max_in_flight: 1024,
            ignore_eos: true,
            text,
            costs: Costs::default(),
            timing: None,
        }
    }
}

/// What one request measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Outcome {
    pub ok: bool,
    pub error: Option<String>,
    pub ttft: Option<f64>,
    pub itl: Vec<f64>,
    pub e2e: f64,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub chunks: u64,
}

/// Counters summed over a Prometheus exposition.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplicaCounters {
    pub prefix_cache_queries: f64,
    pub prefix_cache_hits: f64,
    pub requests: f64,
}

/// Sums the counters the benchmark reads from one `/metrics` text. Accepts the names with
/// and without `_total`, and vLLM's older `gpu_` prefixed cache counters.
pub fn parse_counters(page: &str) -> ReplicaCounters {
    let mut c = ReplicaCounters::default();
    for s in kinference_vllm::metrics::text::parse(page).filter_map(Result::ok) {
        let base = s.name.strip_suffix("_total").unwrap_or(s.name);
        match base {
            "vllm:prefix_cache_queries" | "vllm:gpu_prefix_cache_queries" => {
                c.prefix_cache_queries += s.value;
            }
            "vllm:prefix_cache_hits" | "vllm:gpu_prefix_cache_hits" => {
                c.prefix_cache_hits += s.value
            }
            "vllm:request_success" => c.requests += s.value,
            _ => {}
        }
    }
    c
}

/// What one server-sent-events payload carried.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chunk {
    /// Generated text in this chunk (completions `text` or chat `delta.content`).
    pub content: bool,
    pub done: bool,
    pub usage: Option<(u64, u64, Option<u64>)>,
}

/// Parses one `data:` payload of an OpenAI stream.
pub fn parse_sse_data(data: &str) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk {
            done: true,
            ..Chunk::default()
        };
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Chunk::default();
    };
    let choice = v.get("choices").and_then(|c| c.get(0));
    let text = choice.and_then(|c| {
        c.get("text")
            .or_else(|| c.get("delta").and_then(|d| d.get("content")))
            .and_then(Value::as_str)
    });
    let usage = v.get("usage").filter(|u| !u.is_null()).map(|u| {
        let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
        let cached = u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64);
        (n("prompt_tokens"), n("completion_tokens"), cached)
    });
    Chunk {
        content: text.is_some_and(|t| !t.is_empty()),
        done: false,
        usage,
    }
}

fn endpoint(base: &str, path: &str) -> String {
    let b = base.trim_end_matches('/');
    if b.ends_with("/v1") {
        format!("{b}/{path}")
    } else {
        format!("{b}/v1/{path}")
    }
}

/// The request body and the path it goes to.
fn body(prompt: &Prompt, max_tokens: u32, model: &str, o: &LiveOptions) -> (&'static str, Value) {
    let mut v = match prompt {
        Prompt::Blocks {
            ids,
            len,
            block_tokens,
        } => json!({"prompt": o.text.blocks_text(ids, *len, *block_tokens)}),
        Prompt::Tokens(t) => json!({ "prompt": t }),
        Prompt::Chat(m) => json!({
            "messages": m.iter().map(|x| json!({"role": x.role, "content": x.content})).collect::<Vec<_>>()
        }),
    };
    let path = if matches!(prompt, Prompt::Chat(_)) {
        "chat/completions"
    } else {
        "completions"
    };
    if let Some(obj) = v.as_object_mut() {
        obj.insert("model".into(), json!(model));
        obj.insert("max_tokens".into(), json!(max_tokens));
        obj.insert("stream".into(), json!(true));
        obj.insert("stream_options".into(), json!({"include_usage": true}));
        obj.insert("temperature".into(), json!(0.0));
        if o.ignore_eos {
            obj.insert("ignore_eos".into(), json!(true));
        }
    }
    (path, v)
}

/// Sends one streaming request and times it.
pub async fn send_one(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    timeout: Duration,
) -> Outcome {
    let start = Instant::now();
    let mut o = Outcome::default();
    let run = async {
        let resp = client
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!(
                "HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ));
        }
        read_stream(resp, start, &mut o).await
    };
    match tokio::time::timeout(timeout, run).await {
        Ok(Ok(())) => o.ok = true,
        Ok(Err(e)) => o.error = Some(e),
        Err(_) => o.error = Some(format!("timed out after {timeout:?}")),
    }
    o.e2e = start.elapsed().as_secs_f64();
    o
}

/// Reads a streamed response's SSE lines into `o`: content chunks (TTFT from `start`, ITL
/// between them) and the final usage.
async fn read_stream(
    mut resp: reqwest::Response,
    start: Instant,
    o: &mut Outcome,
) -> Result<(), String> {
    let mut buf: Vec<u8> = Vec::new();
    let mut last: Option<Instant> = None;
    while let Some(bytes) = resp.chunk().await.map_err(|e| e.to_string())? {
        let now = Instant::now();
        buf.extend_from_slice(&bytes);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let Some(data) = line.trim().strip_prefix("data:") else {
                continue;
            };
            let c = parse_sse_data(data);
            if c.content {
                o.chunks += 1;
                match last {
                    None => o.ttft = Some(now.duration_since(start).as_secs_f64()),
                    Some(prev) => o.itl.push(now.duration_since(prev).as_secs_f64()),
                }
                last = Some(now);
            }
            if let Some((p, cpl, cached)) = c.usage {
                o.prompt_tokens = Some(p);
                o.completion_tokens = Some(cpl);
                o.cached_tokens = cached;
            }
        }
    }
    Ok(())
}

async fn scrape(
    client: &reqwest::Client,
    urls: &[String],
) -> Result<Vec<ReplicaCounters>, BenchError> {
    let mut out = Vec::new();
    for u in urls {
        let text = client
            .get(u)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| BenchError::Live(format!("GET {u}: {e}")))?
            .text()
            .await
            .map_err(|e| BenchError::Live(format!("GET {u}: {e}")))?;
        out.push(parse_counters(&text));
    }
    Ok(out)
}

/// The first model a target serves (`GET /v1/models`).
pub async fn discover_model(
    client: &reqwest::Client,
    base_url: &str,
) -> Result<String, BenchError> {
    let url = endpoint(base_url, "models");
    let v: Value = client
        .get(&url)
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| BenchError::Live(format!("GET {url}: {e}")))?
        .text()
        .await
        .map_err(|e| BenchError::Live(format!("GET {url}: {e}")))
        .and_then(|t| {
            serde_json::from_str(&t).map_err(|e| BenchError::Live(format!("GET {url}: {e}")))
        })?;
    v.get("data")
        .and_then(|d| d.get(0))
        .and_then(|m| m.get("id"))
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| BenchError::Live(format!("{url} lists no model")))
}

fn client() -> Result<reqwest::Client, BenchError> {
    reqwest::Client::builder()
        .tcp_nodelay(true)
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| BenchError::Live(e.to_string()))
}

/// Runs `w` against one target.
pub async fn run_target(
    w: &Workload,
    target: &LiveTarget,
    o: &LiveOptions,
    progress: &mut (dyn FnMut(&Progress<'_>) + Send),
) -> Result<PolicyRun, BenchError> {
    let client = client()?;
    for u in &target.reset_urls {
        client
            .post(u)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| BenchError::Live(format!("POST {u}: {e}")))?;
    }
    let model = match &o.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &target.base_url).await?,
    };
    let before = scrape(&client, &target.metrics_urls).await?;
    let wall = Instant::now();
    let outcomes = issue(&client, w, target, o, &model, progress).await;
    let duration = wall.elapsed().as_secs_f64();
    let after = scrape(&client, &target.metrics_urls).await?;
    let mut run = summarize(&target.name, &outcomes, &before, &after, duration, o);
    run.result.wall_s = duration;
    Ok(run)
}

/// Issues the requests; returns one outcome per request issued (in issue order).
async fn issue(
    client: &reqwest::Client,
    w: &Workload,
    target: &LiveTarget,
    o: &LiveOptions,
    model: &str,
    progress: &mut (dyn FnMut(&Progress<'_>) + Send),
) -> Vec<(usize, Outcome)> {
    let start = Instant::now();
    let mut issuer = Issuer {
        client,
        w,
        target,
        o,
        model,
        start,
        deadline: o.max_duration.map(|d| start + d),
        set: JoinSet::new(),
        outcomes: Vec::new(),
        next_report: 0,
    };
    match &o.arrivals {
        Arrivals::Concurrency(n) => issuer.closed_loop(*n, progress).await,
        _ => issuer.open_loop(progress).await,
    }
    let mut outcomes = issuer.outcomes;
    outcomes.sort_by_key(|(i, _)| *i);
    outcomes
}

/// One target's requests in flight and the outcomes collected so far.
struct Issuer<'a> {
    client: &'a reqwest::Client,
    w: &'a Workload,
    target: &'a LiveTarget,
    o: &'a LiveOptions,
    model: &'a str,
    start: Instant,
    /// No request is issued at or after it.
    deadline: Option<Instant>,
    set: JoinSet<(usize, Outcome)>,
    outcomes: Vec<(usize, Outcome)>,
    next_report: usize,
}

impl Issuer<'_> {
    /// Sends request `i`; `permit`, if any, is released when it finishes.
    fn spawn(&mut self, i: usize, permit: Option<OwnedSemaphorePermit>) {
        let Some(r) = self.w.requests.get(i) else {
            return;
        };
        let (path, b) = body(&r.prompt, r.max_tokens, self.model, self.o);
        let url = endpoint(&self.target.base_url, path);
        let client = self.client.clone();
        let timeout = self.o.request_timeout;
        self.set.spawn(async move {
            let out = send_one(&client, &url, &b, timeout).await;
            drop(permit);
            (i, out)
        });
    }

    /// Records a finished request; reports progress every 1 % of the workload.
    fn finished(
        &mut self,
        res: Result<(usize, Outcome), JoinError>,
        progress: &mut (dyn FnMut(&Progress<'_>) + Send),
    ) {
        if let Ok(x) = res {
            self.outcomes.push(x);
        }
        let (done, total) = (self.outcomes.len(), self.w.len());
        if done >= self.next_report {
            progress(&Progress {
                label: &self.target.name,
                done,
                total,
                secs: self.start.elapsed().as_secs_f64(),
            });
            self.next_report = done + (total / 100).max(1);
        }
    }

    /// `n` requests outstanding: each one that finishes makes room for the next.
    async fn closed_loop(&mut self, n: usize, progress: &mut (dyn FnMut(&Progress<'_>) + Send)) {
        let total = self.w.len();
        let mut next = 0;
        for _ in 0..n.max(1).min(total) {
            self.spawn(next, None);
            next += 1;
        }
        while let Some(res) = self.set.join_next().await {
            self.finished(res, progress);
            let i = next;
            next += 1;
            let in_time = self.deadline.is_none_or(|d| Instant::now() < d);
            if i < total && in_time {
                self.spawn(i, None);
            }
        }
    }

    /// Each request at its (re-timed) arrival, at most `max_in_flight` open.
    async fn open_loop(&mut self, progress: &mut (dyn FnMut(&Progress<'_>) + Send)) {
        let sem = Arc::new(Semaphore::new(self.o.max_in_flight.max(1)));
        let t0 = self.w.requests.first().map_or(0.0, |r| r.at);
        for i in 0..self.w.len() {
            let at = self.w.requests.get(i).map_or(0.0, |r| r.at - t0);
            let when = self.start + Duration::from_secs_f64(at.max(0.0));
            if self.deadline.is_some_and(|d| when >= d) {
                break;
            }
            // Collect finished requests while waiting for the next arrival.
            loop {
                tokio::select! {
                    biased;
                    Some(res) = self.set.join_next(), if !self.set.is_empty() => {
                        self.finished(res, progress);
                    }
                    _ = tokio::time::sleep_until(when) => break,
                }
            }
            let Ok(permit) = sem.clone().acquire_owned().await else {
                break;
            };
            self.spawn(i, Some(permit));
        }
        while let Some(res) = self.set.join_next().await {
            self.finished(res, progress);
        }
    }
}

fn summarize(
    name: &str,
    outcomes: &[(usize, Outcome)],
    before: &[ReplicaCounters],
    after: &[ReplicaCounters],
    duration: f64,
    o: &LiveOptions,
) -> PolicyRun {
    let mut r = PolicyResult::empty(name);
    r.requests = outcomes.len();
    let ok: Vec<&Outcome> = outcomes.iter().map(|(_, x)| x).filter(|x| x.ok).collect();
    r.completed = ok.len();
    r.failed = r.requests - r.completed;
    let ttft: Vec<f64> = ok.iter().filter_map(|x| x.ttft).collect();
    let itl: Vec<f64> = ok.iter().flat_map(|x| x.itl.iter().copied()).collect();
    let e2e: Vec<f64> = ok.iter().map(|x| x.e2e).collect();
    r.set_latencies(&ttft, &itl, &e2e);
    r.duration_s = duration;
    if duration > 0.0 {
        r.throughput_rps = r.completed as f64 / duration;
        let out: u64 = ok
            .iter()
            .map(|x| x.completion_tokens.unwrap_or(x.chunks))
            .sum();
        r.output_tok_s = out as f64 / duration;
    }
    set_hits_and_balance(&mut r, &ok, before, after);
    if let Some((timing, gpus)) = &o.timing {
        set_prefill(&mut r, &ok, timing, *gpus, &o.costs);
    }
    PolicyRun {
        result: r,
        ttft_samples: ttft,
        timeline: None,
    }
}

/// Hit rate from the replicas' counters over the run (else from usage), and the requests
/// each replica served.
fn set_hits_and_balance(
    r: &mut PolicyResult,
    ok: &[&Outcome],
    before: &[ReplicaCounters],
    after: &[ReplicaCounters],
) {
    let delta: Vec<ReplicaCounters> = after
        .iter()
        .zip(before)
        .map(|(a, b)| ReplicaCounters {
            prefix_cache_queries: (a.prefix_cache_queries - b.prefix_cache_queries).max(0.0),
            prefix_cache_hits: (a.prefix_cache_hits - b.prefix_cache_hits).max(0.0),
            requests: (a.requests - b.requests).max(0.0),
        })
        .collect();
    let q: f64 = delta.iter().map(|d| d.prefix_cache_queries).sum();
    let usage_prompt: u64 = ok.iter().filter_map(|x| x.prompt_tokens).sum();
    let usage_cached: Option<u64> = ok
        .iter()
        .map(|x| x.cached_tokens)
        .try_fold(0u64, |acc, c| c.map(|c| acc + c));
    if q > 0.0 {
        let h: f64 = delta.iter().map(|d| d.prefix_cache_hits).sum();
        r.set_hits(q as u64, h as u64, "replica metrics");
    } else if let (Some(c), true) = (usage_cached, usage_prompt > 0) {
        r.set_hits(usage_prompt, c, "usage.prompt_tokens_details.cached_tokens");
    } else {
        r.set_hits(usage_prompt, 0, "unavailable");
    }
    if !delta.is_empty() {
        let per: Vec<u64> = delta.iter().map(|d| d.requests.round() as u64).collect();
        r.imbalance = Some(imbalance(&per));
        r.per_replica_requests = per;
    }
}

/// Estimated prefill GPU time from the timing model, its energy and price.
fn set_prefill(
    r: &mut PolicyResult,
    ok: &[&Outcome],
    timing: &TimingModel,
    gpus: u32,
    costs: &Costs,
) {
    // Per request: its own cached tokens when usage reports them, else the run's rate.
    let rate = r.hit_rate;
    let secs: f64 = ok
        .iter()
        .filter_map(|x| {
            let p = x.prompt_tokens? as usize;
            let c = x
                .cached_tokens
                .map_or((p as f64 * rate) as usize, |c| c as usize);
            Some(prefill_secs(timing, p, c))
        })
        .sum::<f64>()
        * f64::from(gpus.max(1));
    r.prefill_gpu_s = Some(secs);
    r.prefill_kwh = Some(costs.kwh(secs));
    r.prefill_usd = Some(costs.usd(secs));
}

/// Runs `w` against every target in turn (the demo's entry point) and fills in savings
/// against the target named `round-robin`, if any.
pub async fn run_targets(
    w: &Workload,
    targets: &[LiveTarget],
    o: &LiveOptions,
    progress: &mut (dyn FnMut(&Progress<'_>) + Send),
) -> Result<Vec<PolicyRun>, BenchError> {
    let mut runs = Vec::new();
    for t in targets {
        runs.push(run_target(w, t, o, progress).await?);
    }
    let mut results: Vec<PolicyResult> = runs.iter().map(|r| r.result.clone()).collect();
    crate::stats::fill_savings(&mut results, "round-robin", &o.costs);
    for (r, x) in runs.iter_mut().zip(results) {
        r.result = x;
    }
    Ok(runs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_parse_vllm_names_with_labels() {
        let text = "# HELP vllm:prefix_cache_hits_total x\n\
            # TYPE vllm:prefix_cache_hits_total counter\n\
            vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 96.0\n\
            vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 200.0\n\
            vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 100\n\
            vllm:request_success_total{finished_reason=\"length\",model_name=\"m\"} 3.0\n\
            vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 2.0 1700000000\n\
            vllm:gpu_prefix_cache_hits 4\n\
            other_metric 9\n";
        let c = parse_counters(text);
        assert_eq!(c.prefix_cache_hits, 100.0);
        assert_eq!(c.prefix_cache_queries, 300.0);
        assert_eq!(c.requests, 5.0);
    }

    #[test]
    fn sse_payloads() {
        let c = parse_sse_data(r#"{"choices":[{"index":0,"text":" the"}]}"#);
        assert!(c.content && !c.done && c.usage.is_none());
        let c = parse_sse_data(r#"{"choices":[{"delta":{"content":""}}]}"#);
        assert!(!c.content);
        let c = parse_sse_data(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
        );
        assert_eq!(c.usage, Some((10, 3, Some(8))));
        assert!(parse_sse_data(" [DONE]").done);
        assert_eq!(endpoint("http://h:1/", "models"), "http://h:1/v1/models");
        assert_eq!(endpoint("http://h:1/v1", "models"), "http://h:1/v1/models");
    }
}
