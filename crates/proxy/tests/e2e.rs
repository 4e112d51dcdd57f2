//! End-to-end proofs of the data plane: the router started on port 0 in front of simulated
//! vLLM replicas (`kinference-sim-server`, in process, on port 0) with real HTTP and ZMQ.
//! Nothing sleeps to wait: tests await the router's state (`Proxy::wait_until`), the event
//! streams (`Proxy::wait_for_events`) or the replicas' engines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use kinference_policy::PolicyConfig;
use kinference_proxy::api::{ErrorBody, ExplainResponse, Health, ReplicasResponse};
use kinference_proxy::{Config, EventsSpec, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::Server;
use kinference_testkit::sim::{self, replica_with_events};
use kinference_testkit::{metric, tokenizer_dir, WAIT};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const MODEL: &str = "tiny";
/// A long shared prefix (about 1,000 tokens) and a question that differs per request.
fn prompt(prefix: usize, question: &str) -> String {
    let mut s = format!("Document {prefix}. ");
    for i in 0..120 {
        s.push_str(&format!(
            "Section {i} of document {prefix} explains block hashing. "
        ));
    }
    s.push_str(question);
    s
}

struct SimOpts {
    events: bool,
    speedup: f64,
    dp: usize,
    block_size: usize,
    hash_seed: Option<String>,
}

impl Default for SimOpts {
    fn default() -> Self {
        SimOpts {
            events: false,
            speedup: 1000.0,
            dp: 1,
            block_size: 32,
            hash_seed: None,
        }
    }
}

async fn sim(o: SimOpts) -> Server {
    let mut cfg = sim::config(MODEL, 600, o.block_size, o.speedup);
    cfg.engine.hash_seed = o.hash_seed;
    if o.events {
        cfg.kv_events = Some(sim::events_on_port_zero());
    }
    cfg.data_parallel_size = o.dp;
    sim::start(cfg).await
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

fn pool(replicas: Vec<ReplicaSpec>, policy: PolicyConfig) -> PoolConfig {
    let mut p = PoolConfig::new(MODEL, tokenizer_dir(), 32);
    p.policy = policy;
    p.replicas = replicas;
    p
}

fn precise(speculative_ms: u64) -> PolicyConfig {
    parse(&format!(
        "{{kind: precise, speculative_ttl_ms: {speculative_ms}}}"
    ))
}

fn parse(yaml: &str) -> PolicyConfig {
    kinference_proxy::parse_policy(yaml).unwrap()
}

fn config(pools: Vec<PoolConfig>) -> Config {
    let mut c = Config::new(pools);
    c.listen = "127.0.0.1:0".into();
    c.admin = "127.0.0.1:0".into();
    c.expose_endpoint_header = true;
    c.scrape.interval_ms = 50;
    c
}

async fn router(cfg: Config) -> Proxy {
    Proxy::start(cfg).await.unwrap()
}

fn client() -> reqwest::Client {
    reqwest::Client::builder().build().unwrap()
}

struct Reply {
    status: u16,
    endpoint: Option<String>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    fn cached_tokens(&self) -> u64 {
        self.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    }

    fn error(&self) -> ErrorBody {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    post_raw(addr, path, serde_json::to_vec(body).unwrap()).await
}

async fn post_raw(addr: SocketAddr, path: &str, body: Vec<u8>) -> Reply {
    let resp = client()
        .post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-kinference-endpoint")
        .map(|v| v.to_str().unwrap().to_owned());
    Reply {
        status,
        endpoint,
        body: resp.text().await.unwrap(),
    }
}

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let resp = client()
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn completion(text: &str, max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": text, "max_tokens": max_tokens})
}

async fn wait_up(proxy: &Proxy) -> ReplicasResponse {
    proxy
        .wait_until(WAIT, |s| {
            s.pools
                .iter()
                .flat_map(|p| &p.replicas)
                .all(|r| r.health == Health::Up)
        })
        .await
        .unwrap_or_else(|s| panic!("replicas never came up: {s:#?}"))
}

/// Waits until the scraped load shows every replica idle too: a scrape taken while the last
/// request ran would otherwise make its replica look busier than the others for a while.
async fn wait_scraped_idle(proxy: &Proxy) {
    proxy
        .wait_until(WAIT, |s| {
            s.pools
                .iter()
                .flat_map(|p| &p.replicas)
                .flat_map(|r| &r.workers)
                .all(|w| w.load.in_flight == 0 && w.load.running == 0 && w.load.waiting == 0)
        })
        .await
        .unwrap_or_else(|s| panic!("replicas never looked idle: {s:#?}"));
}

async fn wait_idle(proxy: &Proxy) {
    proxy
        .wait_until(WAIT, |s| {
            s.pools
                .iter()
                .flat_map(|p| &p.replicas)
                .flat_map(|r| &r.workers)
                .all(|w| w.load.in_flight == 0 && w.load.in_flight_prefill_tokens == 0)
        })
        .await
        .unwrap_or_else(|s| panic!("in-flight counters never returned to 0: {s:#?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_prefix_lands_on_the_replica_that_caches_it() {
    let sims = [
        sim(SimOpts {
            events: true,
            ..SimOpts::default()
        })
        .await,
        sim(SimOpts {
            events: true,
            ..SimOpts::default()
        })
        .await,
        sim(SimOpts {
            events: true,
            ..SimOpts::default()
        })
        .await,
    ];
    // Speculation off: the second request can only find the prefix through the KV events.
    let mut replicas: Vec<ReplicaSpec> = sims[..2].iter().map(replica_with_events).collect();
    let mut discovered = ReplicaSpec::new(&url(sims[2].addr));
    discovered.events = Some(EventsSpec {
        discover: true,
        ..EventsSpec::default()
    });
    replicas.push(discovered);
    let proxy = router(config(vec![pool(replicas, precise(0))])).await;
    wait_up(&proxy).await;

    for doc in 0..3 {
        // Entries per replica before: this document's blocks are new everywhere.
        let before: BTreeMap<String, usize> = proxy.status().pools[0]
            .replicas
            .iter()
            .map(|r| (r.url.clone(), r.workers[0].index_entries))
            .collect();
        let first = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&prompt(doc, "What is a block?"), 4),
        )
        .await;
        assert_eq!(first.status, 200, "{}", first.body);
        let served = first.endpoint.clone().unwrap();
        let served_url = format!("http://{served}");
        let prompt_tokens = first.json()["usage"]["prompt_tokens"].as_u64().unwrap();
        let blocks = (prompt_tokens / 32) as usize;
        let want = before[&served_url] + blocks;
        proxy
            .wait_for_events(&served_url, 0, WAIT, |h| h.entries >= want && !h.stale)
            .await
            .unwrap_or_else(|e| panic!("events never reached the index: {e}"));
        wait_scraped_idle(&proxy).await;

        let second_body = completion(&prompt(doc, "And what is its hash?"), 4);
        let explain = post(proxy.admin_addr(), "/debug/explain", &second_body).await;
        assert_eq!(explain.status, 200, "{}", explain.body);
        let explain: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
        assert_eq!(explain.reason, "cached_prefix", "{explain:#?}");
        assert_eq!(explain.candidates.len(), 3);
        assert_eq!(explain.candidates[0].replica, served_url, "{explain:#?}");
        assert!(
            explain.candidates[0].gpu_blocks as usize >= blocks - 1,
            "{explain:#?}"
        );
        assert_eq!(explain.candidates[0].speculative_blocks, 0);

        let second = post(proxy.data_addr(), "/v1/completions", &second_body).await;
        assert_eq!(second.status, 200, "{}", second.body);
        assert_eq!(second.endpoint.as_deref(), Some(served.as_str()));
        assert!(second.cached_tokens() > 0, "{}", second.body);
        assert!(second.cached_tokens() >= explain.candidates[0].predicted_cached_tokens as u64 / 2);
    }

    let (status, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metric(
            &text,
            "kinference_decisions_total{pool=\"tiny\",policy=\"precise\",reason=\"cached_prefix\"}"
        ) >= 3.0
    );
    assert!(
        metric(
            &text,
            "kinference_cached_tokens_total{pool=\"tiny\",kind=\"actual\"}"
        ) > 0.0
    );
    assert!(
        metric(
            &text,
            "kinference_cached_tokens_total{pool=\"tiny\",kind=\"predicted\"}"
        ) > 0.0
    );
    assert!(metric(&text, "kinference_index_entries{pool=\"tiny\"}") > 0.0);
    // The tokenizer's prefix cache: each document's first prompt missed; its explained and its
    // sent second prompt reused the first's ids up to the question.
    let tokenizer_cache =
        |labels: &str| metric(&text, &format!("kinference_tokenizer_cache_{labels}"));
    assert_eq!(
        tokenizer_cache("lookups_total{pool=\"tiny\",outcome=\"miss\"}"),
        3.0
    );
    assert_eq!(
        tokenizer_cache("lookups_total{pool=\"tiny\",outcome=\"hit\"}"),
        6.0
    );
    let doc_bytes = prompt(0, "").len() as f64;
    assert!(
        tokenizer_cache("text_bytes_total{pool=\"tiny\",kind=\"reused\"}")
            > 6.0 * (doc_bytes - 32.0)
    );
    assert!(
        tokenizer_cache("text_bytes_total{pool=\"tiny\",kind=\"encoded_on_miss\"}")
            > 3.0 * doc_bytes
    );
    assert!(tokenizer_cache("entries{pool=\"tiny\"}") >= 3.0);
    assert_eq!(proxy.status().pools[0].tokenizer_cache.hits, 6);
    let discovered_url = url(sims[2].addr);
    assert_eq!(
        metric(&text, &format!("kinference_event_stream_connected{{pool=\"tiny\",replica=\"{discovered_url}\",rank=\"0\"}}")),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            &format!("kinference_replica_scorable{{pool=\"tiny\",replica=\"{discovered_url}\"}}")
        ),
        1.0
    );
    let ok = format!(
        "kinference_requests_total{{route=\"completions\",replica=\"{}\",status=\"200\"}}",
        url(sims[0].addr)
    );
    assert!(
        text.contains("kinference_requests_total{route=\"completions\""),
        "{ok}\n{text}"
    );
    assert!(
        text.contains("kinference_request_duration_seconds_count{route=\"completions\""),
        "{text}"
    );
    assert!(
        text.contains("kinference_first_byte_seconds_count{route=\"completions\""),
        "{text}"
    );
    assert!(text.contains("kinference_event_stream_gaps_total{"));

    let status = proxy.status();
    for r in &status.pools[0].replicas {
        let ev = r.workers[0].events.as_ref().unwrap();
        assert!(ev.connected, "{r:#?}");
        assert_eq!(ev.decode_errors, 0);
        assert!(r.scorable);
        assert_eq!(r.cache_config.as_ref().unwrap().block_size, Some(32));
    }
    assert_eq!(status.pools[0].replicas[2].events_mode, "discover");
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

/// The savings against round-robin: round-robin, deciding the same requests without sending
/// them, finds a prefix cached only on the replica it sent that prefix to before, so over one
/// document asked four times it hits on its third and fourth requests (the ones back on a
/// replica it already sent the document to), where the precise policy, keeping the document
/// on one replica, hits on the last three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savings_are_compared_with_what_round_robin_would_have_cached() {
    let sims = [sim(SimOpts::default()).await, sim(SimOpts::default()).await];
    let replicas = sims
        .iter()
        .map(|s| ReplicaSpec::new(&url(s.addr)))
        .collect();
    let mut p = pool(replicas, precise(60_000));
    p.baselines = vec!["round-robin".into(), "least-load".into()];
    let proxy = router(config(vec![p])).await;
    wait_up(&proxy).await;
    let mut cached = Vec::new();
    for q in ["First?", "Second?", "Third?", "Fourth?"] {
        let r = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&prompt(7, q), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        cached.push(r.cached_tokens());
    }
    assert_eq!(cached[0], 0);
    assert!(cached[1..].iter().all(|&c| c > 0), "{cached:?}");

    let (status, body) = get(proxy.admin_addr(), "/debug/savings").await;
    assert_eq!(status, 200, "{body}");
    let s: kinference_proxy::api::SavingsResponse = serde_json::from_str(&body).unwrap();
    let pool = &s.pools[0];
    assert_eq!(pool.figures.requests_observed, 4);
    assert_eq!(
        pool.figures.saved_prefill_tokens,
        cached.iter().sum::<u64>()
    );
    let rr = &pool.baselines[0];
    assert_eq!(rr.policy, "round-robin");
    // The questions differ from their first token: every hit is the document's full blocks.
    assert_eq!(rr.cached_tokens, cached[2] + cached[3], "{s:#?}");
    assert!(rr.saved_vs_gpu_seconds > 0.0, "{s:#?}");
    assert!(
        (rr.gpu_seconds + rr.saved_vs_gpu_seconds - pool.figures.saved_gpu_seconds).abs() < 1e-9
    );
    assert_eq!(pool.baselines[1].policy, "least-load");
    assert_eq!(s.baselines.len(), 2);
    assert_eq!(s.baselines[0].cached_tokens, rr.cached_tokens);

    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_baseline_cached_tokens_total{pool=\"tiny\",policy=\"round-robin\"}"
        ),
        rr.cached_tokens as f64
    );
    assert_eq!(
        metric(&text, "kinference_usage_prompt_tokens_total{pool=\"tiny\"}"),
        pool.figures.prompt_tokens as f64
    );
}

/// The baselines see each routed request once, also one that a replica's 503 moved on to the
/// next replica. The live policy and the round-robin baseline both alternate over the two
/// replicas (the busy one first), so the baseline, deciding the document's four requests,
/// places it on the busy replica, the live one, the busy one and the live one, and finds it
/// cached on the third and fourth. Had it seen each moved request twice (or not at all) it
/// would have found it cached on the last three (or none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_baselines_see_a_moved_request_once() {
    let s = sim(SimOpts::default()).await;
    let busy = busy_replica().await;
    let replicas = vec![ReplicaSpec::new(&url(busy)), ReplicaSpec::new(&url(s.addr))];
    let mut p = pool(replicas, parse("round-robin"));
    p.baselines = vec!["round-robin".into()];
    let mut cfg = config(vec![p]);
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    let mut cached = Vec::new();
    for q in ["First?", "Second?", "Third?", "Fourth?"] {
        let r = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&prompt(9, q), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        cached.push(r.cached_tokens());
    }
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_retries_total{pool=\"tiny\",kind=\"unavailable\"}"
        ),
        2.0,
        "{text}"
    );
    // One replica answers: the document is cached there from the second request on.
    assert_eq!(cached[0], 0);
    assert!(
        cached[1] > 0 && cached[1..].iter().all(|&c| c == cached[1]),
        "{cached:?}"
    );
    let (status, body) = get(proxy.admin_addr(), "/debug/savings").await;
    assert_eq!(status, 200, "{body}");
    let savings: kinference_proxy::api::SavingsResponse = serde_json::from_str(&body).unwrap();
    let pool = &savings.pools[0];
    assert_eq!(pool.figures.requests_observed, 4);
    assert_eq!(pool.baselines[0].policy, "round-robin");
    assert_eq!(
        pool.baselines[0].cached_tokens,
        2 * cached[1],
        "{savings:#?}"
    );
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

/// A replica's scale-in cost is the prefix it served from cache that no other replica held;
/// once another replica caches that prefix too, losing the first would cost nothing, and its
/// cost says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scale_in_cost_counts_only_prefixes_no_other_replica_holds() {
    let events = || SimOpts {
        events: true,
        ..SimOpts::default()
    };
    let sims = [sim(events()).await, sim(events()).await];
    let replicas: Vec<ReplicaSpec> = sims.iter().map(replica_with_events).collect();
    let proxy = router(config(vec![pool(replicas, precise(0))])).await;
    wait_up(&proxy).await;
    let cost = |s: &ReplicasResponse, url: &str| {
        s.pools[0]
            .replicas
            .iter()
            .find(|r| r.url == url)
            .and_then(|r| r.scale_in_cost)
            .unwrap()
    };

    let first = post(
        proxy.data_addr(),
        "/v1/completions",
        &completion(&prompt(5, "First?"), 2),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let holder = format!("http://{}", first.endpoint.clone().unwrap());
    let other = sims
        .iter()
        .map(|s| url(s.addr))
        .find(|u| *u != holder)
        .unwrap();
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 32;
    proxy
        .wait_for_events(&holder, 0, WAIT, |h| h.entries >= blocks && !h.stale)
        .await
        .unwrap_or_else(|e| panic!("events never reached the index: {e}"));
    // A miss is no unique hit.
    assert_eq!(cost(&proxy.status(), &holder), 0.0);

    let second = post(
        proxy.data_addr(),
        "/v1/completions",
        &completion(&prompt(5, "Second?"), 2),
    )
    .await;
    assert_eq!(second.endpoint, first.endpoint);
    let cached = second.cached_tokens() as f64;
    assert!(cached > 0.0);
    let s = proxy.status();
    // The default half-life is ten minutes: the test's seconds hardly decay it.
    let c = cost(&s, &holder);
    assert!((c - cached).abs() <= 0.01 * cached, "{c} vs {cached}");
    assert_eq!(cost(&s, &other), 0.0);
    // The same document again: the prefix counts once, not once per hit.
    post(
        proxy.data_addr(),
        "/v1/completions",
        &completion(&prompt(5, "Third?"), 2),
    )
    .await;
    let c = cost(&proxy.status(), &holder);
    assert!((c - cached).abs() <= 0.01 * cached, "{c} vs {cached}");

    // The other replica caches the document too (a client that bypasses the router).
    let other_addr = sims.iter().find(|s| url(s.addr) == other).unwrap().addr;
    let direct = post(
        other_addr,
        "/v1/completions",
        &completion(&prompt(5, "Direct?"), 2),
    )
    .await;
    assert_eq!(direct.status, 200, "{}", direct.body);
    proxy
        .wait_until(WAIT, |s| cost(s, &holder) == 0.0)
        .await
        .unwrap_or_else(|s| panic!("the shared prefix still counts: {s:#?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_prefix_spreads_over_replicas() {
    let mut sims = Vec::new();
    for _ in 0..3 {
        sims.push(
            sim(SimOpts {
                speedup: 20.0,
                ..SimOpts::default()
            })
            .await,
        );
    }
    let replicas = sims
        .iter()
        .map(|s| ReplicaSpec::new(&url(s.addr)))
        .collect();
    let proxy = router(config(vec![pool(replicas, precise(2000))])).await;
    wait_up(&proxy).await;
    let addr = proxy.data_addr();
    let mut tasks = Vec::new();
    for i in 0..18 {
        tasks.push(tokio::spawn(async move {
            post(
                addr,
                "/v1/completions",
                &completion(&prompt(7, &format!("Question {i}?")), 60),
            )
            .await
        }));
    }
    let mut per_replica: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        *per_replica.entry(r.endpoint.unwrap()).or_default() += 1;
    }
    assert!(
        per_replica.len() >= 2,
        "all on one replica: {per_replica:?}"
    );
    assert!(per_replica.values().all(|n| *n < 18), "{per_replica:?}");
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert!(
        text.contains("reason=\"prefix_spread\"") || text.contains("reason=\"load_over_cache\""),
        "{text}"
    );
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

/// A TCP relay in front of a replica that can be cut: the replica "dies" mid-response.
struct Relay {
    addr: SocketAddr,
    kill: watch::Sender<bool>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (kill, rx) = watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                let mut rx = rx.clone();
                tokio::spawn(async move {
                    if *rx.borrow() {
                        return;
                    }
                    let Ok(mut outbound) = TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = rx.wait_for(|k| *k) => {}
                    }
                });
            }
        });
        Relay { addr, kill }
    }

    fn kill(&self) {
        self.kill.send_replace(true);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_stream_ends_the_stream_with_an_error() {
    let s = sim(SimOpts {
        speedup: 1.0,
        ..SimOpts::default()
    })
    .await;
    let relay = Relay::start(s.addr).await;
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(relay.addr))],
        precise(2000),
    )]);
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    let mut body = completion(&prompt(1, "Stream, please."), 2000);
    body["stream"] = json!(true);
    let resp = client()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    assert_eq!(proxy.in_flight(), 1);
    relay.kill();
    let rest = tokio::time::timeout(WAIT, async {
        let mut text = String::new();
        let mut failed = false;
        while let Some(item) = stream.next().await {
            match item {
                Ok(b) => text.push_str(&String::from_utf8_lossy(&b)),
                Err(_) => failed = true,
            }
        }
        (text, failed)
    })
    .await
    .expect("the stream hung after the replica died");
    let (text, failed) = rest;
    let last = text.trim_end().rsplit("\n\n").next().unwrap_or("");
    let error_event = last
        .strip_prefix("data: ")
        .and_then(|j| serde_json::from_str::<ErrorBody>(j).ok());
    assert!(
        failed || error_event.is_some(),
        "neither an error nor an error event: {text:?}"
    );
    if let Some(e) = error_event {
        assert_eq!(e.error.code, 502);
        assert_eq!(e.error.kind, "BadGatewayError");
    }
    assert!(!text.contains("[DONE]"));
    wait_idle(&proxy).await;
    let (_, metrics) = get(proxy.admin_addr(), "/metrics").await;
    assert!(
        metrics.contains("kinference_upstream_failures_total{replica=\""),
        "{metrics}"
    );
    proxy.shutdown().await;
    s.shutdown();
}

async fn refused_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_replica_is_retried_on_the_next_one() {
    let s = sim(SimOpts::default()).await;
    let dead = refused_addr().await;
    let replicas = vec![ReplicaSpec::new(&url(dead)), ReplicaSpec::new(&url(s.addr))];
    let mut cfg = config(vec![pool(replicas, parse("round-robin"))]);
    // No scrapes: the router learns that the replica is dead from the refused connection.
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    for i in 0..4 {
        let r = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&format!("hello {i}"), 3),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.endpoint.as_deref(), Some(s.addr.to_string().as_str()));
    }
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_retries_total{pool=\"tiny\",kind=\"connect\"}"
        ),
        1.0,
        "{text}"
    );
    let st = proxy.status();
    assert_eq!(st.pools[0].replicas[0].health, Health::Down);
    assert!(st.pools[0].replicas[0].last_error.is_some());
    assert_eq!(st.pools[0].replicas[1].health, Health::Up);
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_bytes_through_the_router_equal_direct_bytes() {
    let direct = sim(SimOpts::default()).await;
    let behind = sim(SimOpts::default()).await;
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(behind.addr))],
        precise(2000),
    )]);
    cfg.expose_endpoint_header = false;
    let proxy = router(cfg).await;
    let long = prompt(3, "Tell me more.");
    let requests = [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 40, "stream": true,
                                   "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "max_tokens": 30, "stream": true,
                                        "messages": [{"role": "user", "content": long}]}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": long, "max_tokens": 20}),
        ),
    ];
    // HTTP/1.1 and HTTP/2 (prior knowledge) clients both see the replica's bytes. Both
    // requests carry one X-Request-Id: response ids (and the sims' text, seeded by them) are
    // random per request otherwise, as vLLM's are.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for (i, (path, body)) in requests.iter().enumerate() {
        let id = format!("e2e-bytes-{i}");
        let send = |c: &reqwest::Client, addr: SocketAddr| {
            c.post(format!("http://{addr}{path}"))
                .header("x-request-id", &id)
                .json(body)
                .send()
        };
        // The replica's end-to-end headers, with the body: the same through the router.
        let reply = |resp: reqwest::Response| async move {
            let mut headers: Vec<(String, String)> = resp
                .headers()
                .iter()
                .filter(|(n, _)| {
                    !matches!(
                        n.as_str(),
                        "date" | "content-length" | "transfer-encoding" | "connection"
                    )
                })
                .map(|(n, v)| (n.to_string(), v.to_str().unwrap().to_owned()))
                .collect();
            headers.sort();
            let r = Reply {
                status: resp.status().as_u16(),
                endpoint: None,
                body: resp.text().await.unwrap(),
            };
            (r, headers)
        };
        let (a, a_headers) = reply(send(&client(), direct.addr).await.unwrap()).await;
        let (via, via_headers) = if i == 1 {
            let resp = send(&h2, proxy.data_addr()).await.unwrap();
            assert_eq!(resp.version(), reqwest::Version::HTTP_2);
            reply(resp).await
        } else {
            reply(send(&client(), proxy.data_addr()).await.unwrap()).await
        };
        assert_eq!((a.status, via.status), (200, 200), "{}", via.body);
        assert!(
            a_headers.iter().any(|(n, _)| n == "content-type"),
            "{a_headers:?}"
        );
        assert_eq!(a_headers, via_headers, "{path}");
        assert_eq!(normalize(&a.body), normalize(&via.body), "{path}");
        assert!(a.body.len() > 200);
    }
    proxy.shutdown().await;
}

/// Masks `"created": N`: the sims stamp wall-clock seconds.
fn normalize(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    while let Some(i) = rest.find("\"created\":") {
        let (head, tail) = rest.split_at(i + "\"created\":".len());
        out.push_str(head);
        out.push('N');
        rest = tail.trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_json() {
    let s = sim(SimOpts::default()).await;
    let dead = refused_addr().await;
    let mut live = pool(vec![ReplicaSpec::new(&url(s.addr))], precise(2000));
    live.name = Some("live".into());
    let mut gone = PoolConfig::new("gone-model", tokenizer_dir(), 32);
    gone.replicas = vec![ReplicaSpec::new(&url(dead))];
    let mut cfg = config(vec![live, gone]);
    cfg.limits.max_body_bytes = 4096;
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    let addr = proxy.data_addr();

    let cases: Vec<(Reply, u16, &str)> = vec![
        (
            post_raw(addr, "/v1/completions", b"{\"model\": ".to_vec()).await,
            400,
            "BadRequestError",
        ),
        (
            post_raw(addr, "/v1/chat/completions", b"[1, 2]".to_vec()).await,
            400,
            "BadRequestError",
        ),
        (
            post(addr, "/v1/chat/completions", &json!({"model": MODEL})).await,
            400,
            "BadRequestError",
        ),
        (
            post(addr, "/v1/completions", &completion(&"x".repeat(5000), 2)).await,
            413,
            "RequestTooLargeError",
        ),
        (
            post(
                addr,
                "/v1/completions",
                &json!({"model": "nope", "prompt": "hi"}),
            )
            .await,
            404,
            "NotFoundError",
        ),
        (
            post(addr, "/tokenize", &json!({"model": "nope", "prompt": "hi"})).await,
            404,
            "NotFoundError",
        ),
        (
            post(
                addr,
                "/v1/completions",
                &json!({"model": "gone-model", "prompt": "hi"}),
            )
            .await,
            503,
            "ServiceUnavailableError",
        ),
    ];
    for (i, (reply, status, kind)) in cases.iter().enumerate() {
        assert_eq!(reply.status, *status, "case {i}: {}", reply.body);
        let e = reply.error();
        assert_eq!(e.error.code, *status, "case {i}");
        assert_eq!(e.error.kind, *kind, "case {i}");
        assert!(!e.error.message.is_empty());
        let v: Value = serde_json::from_str(&reply.body).unwrap();
        assert!(
            v["error"].get("param").is_some(),
            "case {i}: {}",
            reply.body
        );
    }
    assert_eq!(cases[4].0.error().error.param.as_deref(), Some("model"));
    // The live pool still serves, and passthrough endpoints reach it.
    let ok = post(
        addr,
        "/tokenize",
        &json!({"model": MODEL, "prompt": "hello"}),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert!(ok.json()["count"].as_u64().unwrap() > 0);
    let (status, models) = get(addr, "/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [MODEL, "gone-model"]);
    assert_eq!(
        models["data"][0]["max_model_len"],
        json!(599 * 32),
        "described by the replica"
    );
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(&text, "kinference_router_errors_total{kind=\"too_large\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            "kinference_router_errors_total{kind=\"unknown_model\"}"
        ),
        2.0
    );
    assert_eq!(
        metric(&text, "kinference_router_errors_total{kind=\"no_replica\"}"),
        1.0
    );
    // A routed path's other methods: 405 in the same shape, with `Allow`; `/v1/models`
    // answers HEAD as GET; a path of its own goes to a replica.
    for (method, path, allow) in [
        (reqwest::Method::GET, "/v1/completions", "POST"),
        (reqwest::Method::PUT, "/v1/chat/completions", "POST"),
        (reqwest::Method::POST, "/v1/models", "GET,HEAD"),
    ] {
        let resp = client()
            .request(method.clone(), format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 405, "{method} {path}");
        assert_eq!(resp.headers()["allow"], allow, "{method} {path}");
        let e: ErrorBody = serde_json::from_str(&resp.text().await.unwrap()).unwrap();
        assert_eq!(e.error.kind, "MethodNotAllowedError");
        assert_eq!(e.error.code, 405);
    }
    let head = client()
        .head(format!("http://{addr}/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status().as_u16(), 200);
    assert!(head.text().await.unwrap().is_empty());
    assert_eq!(
        get(addr, "/v1/completions/").await.0,
        404,
        "the replica's own 404"
    );
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_router_errors_total{kind=\"method_not_allowed\"}"
        ),
        3.0
    );
    assert_eq!(
        metric(
            &text,
            "kinference_router_errors_total{kind=\"unknown_model\"}"
        ),
        2.0,
        "the 404 above was the replica's, not the router's"
    );
    let (status, ready) = get(proxy.admin_addr(), "/readyz").await;
    assert_eq!(status, 503, "the gone pool has no healthy replica: {ready}");
    assert_eq!(get(proxy.admin_addr(), "/healthz").await.0, 200);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_releases_in_flight_and_aborts_upstream() {
    let s = sim(SimOpts {
        speedup: 1.0,
        ..SimOpts::default()
    })
    .await;
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(s.addr))],
        precise(2000),
    )]);
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;

    // Mid-stream: read one chunk, then drop the response.
    let mut body = completion(&prompt(2, "Go on."), 3000);
    body["stream"] = json!(true);
    let resp = client()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    assert_eq!(proxy.in_flight(), 1);
    drop(stream);
    wait_idle(&proxy).await;
    assert!(
        tokio::time::timeout(
            WAIT,
            s.wait_until(0, |e| e.num_running() == 0 && e.num_waiting() == 0)
        )
        .await
        .unwrap(),
        "the replica kept generating for a client that left"
    );

    // Before the response head: a non-streamed request whose client gives up.
    let slow = client()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&completion(&prompt(2, "Take your time."), 3000))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(
        slow.is_err(),
        "the request should have outlived its client timeout"
    );
    wait_idle(&proxy).await;
    assert!(tokio::time::timeout(
        WAIT,
        s.wait_until(0, |e| e.num_running() == 0 && e.num_waiting() == 0)
    )
    .await
    .unwrap());
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_client_disconnects_total{route=\"completions\"}"
        ),
        1.0
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_are_workers_and_the_rank_header_pins_them() {
    let s = sim(SimOpts {
        dp: 2,
        ..SimOpts::default()
    })
    .await;
    let mut r = ReplicaSpec::new(&url(s.addr));
    r.dp_ranks = 2;
    let proxy = router(config(vec![pool(vec![r], precise(5000))])).await;
    wait_up(&proxy).await;
    // Cold prefixes first (they spread over the ranks), then one follow-up each.
    for doc in 10..14 {
        let first = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&prompt(doc, "One?"), 3),
        )
        .await;
        assert_eq!(first.status, 200, "{}", first.body);
    }
    for doc in 10..14 {
        let second = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&prompt(doc, "Two?"), 3),
        )
        .await;
        assert_eq!(second.status, 200, "{}", second.body);
        assert!(
            second.cached_tokens() > 0,
            "doc {doc}: the second request missed the rank holding its prefix"
        );
    }
    let st = proxy.status();
    let workers = &st.pools[0].replicas[0].workers;
    assert_eq!(workers.len(), 2);
    // Both ranks served traffic: the router spreads cold prefixes over ranks.
    let engine_blocks = |i: usize| s.inspect_rank(i, |e| e.block_pool().cached_blocks().len());
    let (a, b) = (
        engine_blocks(0).await.unwrap(),
        engine_blocks(1).await.unwrap(),
    );
    assert!(a > 0 && b > 0, "rank caches: {a} and {b}");
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_another_block_size_is_unscorable_and_routed_by_load() {
    let s16 = sim(SimOpts {
        block_size: 16,
        events: true,
        ..SimOpts::default()
    })
    .await;
    let s32 = sim(SimOpts {
        events: true,
        ..SimOpts::default()
    })
    .await;
    let replicas = vec![replica_with_events(&s16), replica_with_events(&s32)];
    let proxy = router(config(vec![pool(replicas, precise(2000))])).await;
    let st = proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas.iter().all(|r| r.cache_config.is_some())
        })
        .await
        .unwrap();
    let bad = &st.pools[0].replicas[0];
    assert!(!bad.scorable);
    assert!(
        bad.unscorable_reason
            .as_deref()
            .unwrap()
            .contains("block size is 16"),
        "{bad:#?}"
    );
    assert!(st.pools[0].replicas[1].scorable);
    let explain = post(
        proxy.admin_addr(),
        "/debug/explain",
        &completion(&prompt(4, "?"), 2),
    )
    .await;
    let explain: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
    let bad_score = explain
        .candidates
        .iter()
        .find(|c| c.replica == bad.url)
        .unwrap();
    assert!(!bad_score.scorable);
    assert_eq!(bad_score.gpu_blocks, 0);
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(&text, "kinference_unscorable_replicas{pool=\"tiny\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &text,
            &format!(
                "kinference_replica_scorable{{pool=\"tiny\",replica=\"{}\"}}",
                bad.url
            )
        ),
        0.0
    );
    // It still serves.
    let r = post(
        proxy.data_addr(),
        "/v1/completions",
        &completion("hello there", 2),
    )
    .await;
    assert_eq!(r.status, 200);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_whose_event_hashes_differ_is_unscorable() {
    // The same block size and algorithm in vllm:cache_config_info, but another
    // PYTHONHASHSEED: only the events' own hashes can tell.
    let other = sim(SimOpts {
        events: true,
        hash_seed: Some("another-seed".into()),
        ..SimOpts::default()
    })
    .await;
    let same = sim(SimOpts {
        events: true,
        ..SimOpts::default()
    })
    .await;
    let replicas = vec![replica_with_events(&other), replica_with_events(&same)];
    let proxy = router(config(vec![pool(replicas, precise(2000))])).await;
    wait_up(&proxy).await;
    // Distinct prompts straight to each replica, so that both announce root blocks.
    for (i, s) in [&other, &same].into_iter().enumerate() {
        for q in ["first?", "second?"] {
            let text = format!("replica {i} {q} {}", prompt(3, q));
            let r = post(s.addr, "/v1/completions", &completion(&text, 1)).await;
            assert_eq!(r.status, 200, "{}", r.body);
        }
    }
    let st = proxy
        .wait_until(WAIT, |s| !s.pools[0].replicas[0].scorable)
        .await
        .unwrap_or_else(|s| panic!("the replica with another seed stayed scorable: {s:#?}"));
    let bad = &st.pools[0].replicas[0];
    let why = bad.unscorable_reason.as_deref().unwrap();
    assert!(why.contains("PYTHONHASHSEED"), "{why}");
    // The replica hashing as the pool does announced its roots too, and stays scorable.
    let good = proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas[1].workers[0].index_entries > 0
        })
        .await
        .unwrap();
    assert!(good.pools[0].replicas[1].scorable, "{good:#?}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_and_replicas_describe_the_fleet_without_forwarding() {
    let s = sim(SimOpts {
        events: true,
        ..SimOpts::default()
    })
    .await;
    let proxy = router(config(vec![pool(
        vec![replica_with_events(&s)],
        precise(2000),
    )]))
    .await;
    wait_up(&proxy).await;
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": prompt(5, "Explain.")}]});
    let tok = post(s.addr, "/tokenize", &chat).await.json();
    let n = tok["count"].as_u64().unwrap();
    let explain = post(proxy.admin_addr(), "/debug/explain", &chat).await;
    assert_eq!(explain.status, 200, "{}", explain.body);
    let e: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
    assert_eq!(e.api, "chat");
    assert_eq!(
        u64::from(e.prompt_tokens),
        n,
        "the router tokenizes chat exactly as the replica"
    );
    assert_eq!(e.blocks as u64, n / 32);
    assert_eq!(e.reason, "no_cache");
    assert_eq!(e.chosen.as_deref(), Some("replica-0/dp0"));
    assert!(e.tokenize_error.is_none());
    let served = s
        .inspect(|e| e.block_pool().cached_blocks().len())
        .await
        .unwrap();
    assert_eq!(served, 0, "explain must not forward");
    let (status, body) = get(proxy.admin_addr(), "/debug/replicas").await;
    assert_eq!(status, 200);
    let st: ReplicasResponse = serde_json::from_str(&body).unwrap();
    let r = &st.pools[0].replicas[0];
    assert_eq!((r.health, r.scorable, r.dp_ranks), (Health::Up, true, 1));
    assert_eq!(r.events_mode, "connect");
    assert_eq!(st.pools[0].policy, "precise");
    assert_eq!(st.pools[0].block_size, 32);
    let (status, ready) = get(proxy.admin_addr(), "/readyz").await;
    assert_eq!(status, 200, "{ready}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_end_requests_instead_of_hanging() {
    // A "replica" that accepts connections and never answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let held = Arc::new(tokio::sync::Mutex::new(Vec::new()));
    let h = held.clone();
    tokio::spawn(async move {
        while let Ok((sock, _)) = silent.accept().await {
            h.lock().await.push(sock);
        }
    });
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(silent_addr))],
        precise(2000),
    )]);
    cfg.scrape.interval_ms = 0;
    cfg.timeouts.first_byte_ms = 300;
    let proxy = router(cfg).await;
    let r = tokio::time::timeout(
        WAIT,
        post(proxy.data_addr(), "/v1/completions", &completion("hi", 2)),
    )
    .await
    .expect("hung");
    assert_eq!(r.status, 504, "{}", r.body);
    assert_eq!(r.error().error.kind, "GatewayTimeoutError");
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

/// A fake replica that answers every connection with `response`, then either closes or keeps
/// the connection open and silent.
async fn fake_replica(response: Vec<u8>, hold: bool) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let response = Arc::new(response);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            let response = response.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                let _ = sock.read(&mut buf).await;
                let _ = sock.write_all(&response).await;
                if hold {
                    std::future::pending::<()>().await;
                }
            });
        }
    });
    addr
}

/// A fake replica that answers every request 503 and closes.
async fn busy_replica() -> SocketAddr {
    fake_replica(
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            .to_vec(),
        false,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_503_head_moves_the_request_to_the_next_replica() {
    let s = sim(SimOpts::default()).await;
    let busy = busy_replica().await;
    let replicas = vec![ReplicaSpec::new(&url(busy)), ReplicaSpec::new(&url(s.addr))];
    let mut cfg = config(vec![pool(replicas, parse("round-robin"))]);
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    for i in 0..2 {
        let r = post(
            proxy.data_addr(),
            "/v1/completions",
            &completion(&format!("hi {i}"), 2),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.endpoint.as_deref(), Some(s.addr.to_string().as_str()));
    }
    let (_, text) = get(proxy.admin_addr(), "/metrics").await;
    assert_eq!(
        metric(
            &text,
            "kinference_retries_total{pool=\"tiny\",kind=\"unavailable\"}"
        ),
        1.0,
        "{text}"
    );
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

/// A fake replica that answers each request (one per connection) with the head it received
/// as its body, under a head with hop-by-hop headers, one its `Connection` names, a header of
/// its own and one that claims to be the router's.
async fn echo_head_replica() -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                let end = loop {
                    if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                    let mut buf = [0u8; 4096];
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                };
                let head = String::from_utf8_lossy(&got[..end]).into_owned();
                let reply = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close, X-Hop\r\n\
                     X-Hop: 1\r\nKeep-Alive: timeout=5\r\nX-Reply: yes\r\n\
                     x-kinference-endpoint: spoofed\r\nContent-Length: {}\r\n\r\n{head}",
                    head.len()
                );
                let _ = sock.write_all(reply.as_bytes()).await;
            });
        }
    });
    addr
}

/// What each side gets of the other's headers, whichever HTTP path the client's request
/// takes (the data port's own HTTP/1.1 path, with names in any case; hyper's, over HTTP/2):
/// the replica gets the client's end-to-end headers, `Host` naming it, and no hop-by-hop
/// header, none the client's `Connection` names and not the client's DP rank; the client gets
/// the replica's end-to-end headers, not its hop-by-hop ones, and the router's own
/// `x-kinference-endpoint` instead of the replica's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_side_gets_the_others_end_to_end_headers_only() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let replica = echo_head_replica().await;
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(replica))],
        parse("round-robin"),
    )]);
    cfg.scrape.interval_ms = 0;
    let proxy = router(cfg).await;
    let body = serde_json::to_vec(&completion("hi", 2)).unwrap();
    let expect_replica_head = |head: &str| {
        let lower = head.to_ascii_lowercase();
        let has = |line: &str| lower.contains(&format!("\r\n{line}\r\n"));
        assert!(has(&format!("host: {replica}")), "{head}");
        assert!(has("authorization: bearer k"), "{head}");
        assert!(has("x-custom: 1"), "{head}");
        assert!(has(&format!("content-length: {}", body.len())), "{head}");
        for gone in [
            "x-private",
            "keep-alive",
            "te:",
            "x-data-parallel-rank",
            "router:80",
        ] {
            assert!(!lower.contains(gone), "{gone} reached the replica: {head}");
        }
    };

    // The data port's own path: a plain HTTP/1.1 request.
    let mut tcp = TcpStream::connect(proxy.data_addr()).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: router:80\r\nConnection: keep-alive, X-Private\r\n\
         X-Private: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Data-Parallel-Rank: 3\r\n\
         Authorization: Bearer k\r\nX-Custom: 1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(&body).await.unwrap();
    let mut got = Vec::new();
    let (reply_head, reply_body) = loop {
        let mut buf = [0u8; 8192];
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "the router closed early: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((h, b)) = text.split_once("\r\n\r\n") {
            let len: usize = h
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(str::to_owned)
                })
                .unwrap()
                .parse()
                .unwrap();
            if b.len() >= len {
                break (h.to_owned(), b.to_owned());
            }
        }
    };
    expect_replica_head(&reply_body);
    let lower = reply_head.to_ascii_lowercase();
    assert!(lower.starts_with("http/1.1 200 ok\r\n"), "{reply_head}");
    assert!(lower.contains("\r\nx-reply: yes"), "{reply_head}");
    assert!(
        lower.contains("\r\ncontent-type: text/plain"),
        "{reply_head}"
    );
    assert!(
        lower.contains(&format!("\r\nx-kinference-endpoint: {replica}")),
        "{reply_head}"
    );
    for gone in ["x-hop", "keep-alive", "spoofed", "close"] {
        assert!(
            !lower.contains(gone),
            "{gone} reached the client: {reply_head}"
        );
    }

    // hyper's path: HTTP/2 (which has no connection headers to send).
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let resp = h2
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .header("authorization", "Bearer k")
        .header("x-custom", "1")
        .header("x-data-parallel-rank", "3")
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.version(), reqwest::Version::HTTP_2);
    let h = resp.headers().clone();
    assert_eq!(h["x-reply"], "yes");
    assert_eq!(h["content-type"], "text/plain");
    assert_eq!(h["x-kinference-endpoint"], replica.to_string().as_str());
    assert!(
        !h.contains_key("x-hop") && !h.contains_key("keep-alive"),
        "{h:?}"
    );
    expect_replica_head(&resp.text().await.unwrap());
    proxy.shutdown().await;
}

/// Streams one completion through a router whose only replica is `replica`, with the given
/// idle timeout; returns the router (to drain and stop) and the reply.
async fn stream_through(replica: SocketAddr, idle_ms: u64) -> (Proxy, Reply) {
    let mut cfg = config(vec![pool(
        vec![ReplicaSpec::new(&url(replica))],
        precise(2000),
    )]);
    cfg.scrape.interval_ms = 0;
    cfg.timeouts.idle_ms = idle_ms;
    let proxy = router(cfg).await;
    let mut body = completion("hello", 100);
    body["stream"] = json!(true);
    let r = tokio::time::timeout(WAIT, post(proxy.data_addr(), "/v1/completions", &body))
        .await
        .expect("hung");
    (proxy, r)
}

/// A stream that keeps sending, in gaps well under the idle timeout, for longer than one idle
/// period in all: the idle timer set at the start fires mid-stream and must be re-armed, not
/// end the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_keeps_sending_outlives_the_idle_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CHUNKS: usize = 8;
    let event = "data: {\"choices\":[{\"text\":\" the\"}]}\n\n";
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                let _ = sock.read(&mut buf).await;
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
                            transfer-encoding: chunked\r\n\r\n";
                let _ = sock.write_all(head.as_bytes()).await;
                for _ in 0..CHUNKS {
                    let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                    let _ = sock.write_all(chunk.as_bytes()).await;
                    // The replica's pacing (what is being tested), not a wait for a result.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let _ = sock.write_all(b"0\r\n\r\n").await;
            });
        }
    });
    let (proxy, r) = stream_through(addr, 400).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.body,
        event.repeat(CHUNKS),
        "the stream was cut or changed"
    );
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_goes_silent_ends_with_an_error_event() {
    let event = "data: {\"choices\":[{\"text\":\" the\"}]}\n\n";
    let head =
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
    let response = format!("{head}{:x}\r\n{event}\r\n", event.len()).into_bytes();
    let silent = fake_replica(response, true).await;
    let (proxy, r) = stream_through(silent, 300).await;
    assert_eq!(r.status, 200);
    let events: Vec<&str> = r.body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 2, "{}", r.body);
    assert_eq!(format!("{}\n\n", events[0]), event);
    let err: ErrorBody = serde_json::from_str(events[1].strip_prefix("data: ").unwrap()).unwrap();
    assert!(err.error.message.contains("idle_timeout"), "{err:?}");
    wait_idle(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_replica_is_scraped_less_and_any_news_brings_its_scrape_back() {
    let s = sim(SimOpts {
        events: true,
        ..SimOpts::default()
    })
    .await;
    let mut cfg = config(vec![pool(vec![replica_with_events(&s)], precise(0))]);
    // Ticks every 50 ms; a quiet replica would wait a minute, longer than this test runs, so
    // every scrape after the first is one that news caused.
    cfg.scrape.idle_interval_ms = 60_000;
    let proxy = router(cfg).await;
    let url = url(s.addr);
    proxy
        .wait_for_events(&url, 0, WAIT, |h| h.connected)
        .await
        .unwrap();
    let scrapes = |st: &ReplicasResponse| st.pools[0].replicas[0].scrapes;
    let quiet = proxy
        .wait_until(WAIT, |st| scrapes(st).idle >= 3)
        .await
        .unwrap_or_else(|st| panic!("no tick was skipped: {st:#?}"));
    let ok = scrapes(&quiet).ok;
    assert_eq!(quiet.pools[0].replicas[0].health, Health::Up);
    // More quiet ticks, no scrape.
    let later = proxy
        .wait_until(WAIT, |st| scrapes(st).idle >= scrapes(&quiet).idle + 3)
        .await
        .unwrap();
    assert_eq!(scrapes(&later).ok, ok, "{later:#?}");

    // A request (and the KV events it causes) is news: scraped again, then quiet again.
    let r = post(
        proxy.data_addr(),
        "/v1/completions",
        &completion(&prompt(1, "Why?"), 2),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.body);
    let busy = proxy
        .wait_until(WAIT, |st| scrapes(st).ok > ok)
        .await
        .unwrap_or_else(|st| panic!("the request brought no scrape: {st:#?}"));
    let settled = proxy
        .wait_until(WAIT, |st| scrapes(st).idle >= scrapes(&busy).idle + 3)
        .await
        .unwrap_or_else(|st| panic!("the replica never turned quiet again: {st:#?}"));
    let ok = scrapes(&settled).ok;

    // A dead replica's event stream drops: it is scraped (and found down) at the next tick,
    // not a minute later.
    s.shutdown();
    let down = proxy
        .wait_until(WAIT, |st| st.pools[0].replicas[0].health == Health::Down)
        .await
        .unwrap_or_else(|st| panic!("the dead replica was not found down: {st:#?}"));
    assert!(
        scrapes(&down).failed >= 1 && scrapes(&down).ok == ok,
        "{down:#?}"
    );
    proxy.shutdown().await;
}

/// A replica with `protocol: h2c` is spoken to with HTTP/2 prior knowledge: scrapes (it comes
/// up), KV events still indexed, a request and a streamed one served, and the prefix's next
/// turn routed there with cached tokens; the replica counts every one as HTTP/2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_replica_is_spoken_to_with_http2() {
    let s = sim(SimOpts {
        events: true,
        ..SimOpts::default()
    })
    .await;
    let mut spec = replica_with_events(&s);
    spec.protocol = kinference_proxy::UpstreamProtocol::H2c;
    let proxy = router(config(vec![pool(vec![spec], precise(0))])).await;
    proxy
        .wait_until(WAIT, |st| st.pools[0].replicas[0].health == Health::Up)
        .await
        .unwrap_or_else(|st| panic!("never scraped over HTTP/2: {st:#?}"));
    let scraped = s.http2_requests();
    assert!(scraped > 0);
    sim::prime_events(&proxy, &url(s.addr), MODEL).await;
    let before = proxy.status().pools[0].replicas[0].workers[0].index_entries;

    let body = json!({"model": MODEL, "prompt": prompt(1, "Why?"), "max_tokens": 4});
    let first = post(proxy.data_addr(), "/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 32;
    proxy
        .wait_for_events(&url(s.addr), 0, WAIT, |h| h.entries >= before + blocks)
        .await
        .unwrap();
    let next = json!({"model": MODEL, "prompt": prompt(1, "How?"), "max_tokens": 4});
    let second = post(proxy.data_addr(), "/v1/completions", &next).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert!(second.cached_tokens() > 0, "{}", second.body);

    let mut streamed = next.clone();
    streamed["stream"] = json!(true);
    let resp = client()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    // The three requests, besides the scrapes.
    assert!(s.http2_requests() >= scraped + 3, "{}", s.http2_requests());
    proxy.shutdown().await;
}
