//! The router in front of two real vLLM replicas: a request that shares a long prefix with an
//! earlier one lands on the replica that caches it, and vLLM reports exactly the cached tokens
//! the router predicted.
//!
//! Runs only when [`URLS_VAR`] and its companion variables are set (`scripts/interop.sh` starts
//! two fresh servers for it); otherwise it prints why it skipped and passes. The router runs in
//! process with speculation off, so the second request can find its prefix only through the
//! KV events vLLM published. The expected hit comes from vLLM itself: the common prefix of the
//! two prompts as vLLM's `/tokenize` returns them, cut to whole blocks.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kinference_interop::env::model_dir;
use kinference_interop::env::{MODEL, TOPIC};
use kinference_interop::{fetch_replay, EventLog, VllmHttp};
use kinference_proxy::api::{ExplainResponse, Health, ReplicasResponse};
use kinference_proxy::{Config, EventsSpec, PoolConfig, Proxy, ReplicaSpec};
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// The two servers' base URLs, comma separated.
const URLS_VAR: &str = "KINFERENCE_ROUTER_VLLM_URLS";
/// The endpoints their PUB sockets connect to (the router binds them), in the same order.
const EVENTS_VAR: &str = "KINFERENCE_ROUTER_VLLM_EVENTS";
/// Their replay ROUTER endpoints, in the same order.
const REPLAY_VAR: &str = "KINFERENCE_ROUTER_VLLM_REPLAY";
/// Their `topic`s, in the same order (optional; default [`TOPIC`] for both). When both
/// servers connect to one endpoint, the router binds it once and tells them apart by topic.
const TOPICS_VAR: &str = "KINFERENCE_ROUTER_VLLM_TOPICS";
/// Their `--prefix-caching-hash-algo`.
const HASH_ALGO_VAR: &str = "KINFERENCE_ROUTER_VLLM_HASH_ALGO";

const BLOCK_SIZE: u32 = 32;
/// Long enough for a vLLM on two shared CPU cores to start publishing and to prefill.
const WAIT: Duration = Duration::from_secs(120);

struct Replica {
    url: String,
    events: String,
    replay: String,
    topic: String,
}

/// `None` when [`URLS_VAR`] is unset; a panic when it is set but the rest is incomplete.
fn replicas_from_env() -> Option<(Vec<Replica>, String)> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    let urls = var(URLS_VAR)?;
    let list = |name: &str| -> Vec<String> {
        var(name)
            .unwrap_or_else(|| panic!("{URLS_VAR} is set but {name} is not"))
            .split(',')
            .map(|s| s.trim().trim_end_matches('/').to_owned())
            .collect()
    };
    let urls: Vec<String> = urls
        .split(',')
        .map(|s| s.trim().trim_end_matches('/').to_owned())
        .collect();
    let (events, replay) = (list(EVENTS_VAR), list(REPLAY_VAR));
    assert_eq!(urls.len(), 2, "{URLS_VAR} must name two servers");
    assert_eq!(events.len(), 2, "{EVENTS_VAR} must name two endpoints");
    assert_eq!(replay.len(), 2, "{REPLAY_VAR} must name two endpoints");
    let topics: Vec<String> = match var(TOPICS_VAR) {
        Some(t) => t.split(',').map(|s| s.trim().to_owned()).collect(),
        None => vec![TOPIC.to_owned(); 2],
    };
    assert_eq!(topics.len(), 2, "{TOPICS_VAR} must name two topics");
    let algo = var(HASH_ALGO_VAR)
        .unwrap_or_else(|| panic!("{URLS_VAR} is set but {HASH_ALGO_VAR} is not"));
    let replicas = urls
        .into_iter()
        .zip(events)
        .zip(replay)
        .zip(topics)
        .map(|(((url, events), replay), topic)| Replica {
            url,
            events,
            replay,
            topic,
        })
        .collect();
    Some((replicas, algo))
}

/// A document of about 700 tokens whose very first words differ per document (so two
/// documents share no block), followed by a question.
fn prompt(doc: usize, question: &str) -> String {
    let names = ["Aurora", "Basalt", "Cobalt", "Dunmore"];
    let name = names[doc % names.len()];
    let mut s = format!("{name} field report number {doc}. ");
    for i in 0..28 {
        s.push_str(&format!(
            "Paragraph {i} of the {name} report describes how shard {} stores its blocks. ",
            (i * 7 + doc * 3) % 101
        ));
    }
    s.push_str(question);
    s
}

fn completion(text: &str) -> Value {
    json!({"model": MODEL, "prompt": text, "max_tokens": 4, "temperature": 0.0})
}

struct Reply {
    /// The replica that served the request (`x-kinference-endpoint`, `host:port`).
    endpoint: String,
    body: Value,
}

impl Reply {
    fn usage(&self, key: &str) -> u64 {
        let v = match key {
            "cached_tokens" => &self.body["usage"]["prompt_tokens_details"]["cached_tokens"],
            _ => &self.body["usage"][key],
        };
        v.as_u64()
            .unwrap_or_else(|| panic!("no usage {key} in {}", self.body))
    }
}

async fn post(
    client: &reqwest::Client,
    addr: std::net::SocketAddr,
    path: &str,
    body: &Value,
) -> (u16, Option<String>, String) {
    let resp = client
        .post(format!("http://{addr}{path}"))
        .json(body)
        .send()
        .await
        .unwrap_or_else(|e| panic!("POST {path}: {e}"));
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-kinference-endpoint")
        .map(|v| v.to_str().unwrap().to_owned());
    (status, endpoint, resp.text().await.unwrap())
}

async fn complete(client: &reqwest::Client, proxy: &Proxy, text: &str) -> Reply {
    let (status, endpoint, body) = post(
        client,
        proxy.data_addr(),
        "/v1/completions",
        &completion(text),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    Reply {
        endpoint: endpoint.expect("x-kinference-endpoint (expose_endpoint_header is on)"),
        body: serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}")),
    }
}

async fn explain(client: &reqwest::Client, proxy: &Proxy, text: &str) -> ExplainResponse {
    let (status, _, body) = post(
        client,
        proxy.admin_addr(),
        "/debug/explain",
        &completion(text),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

/// Waits until both replicas are scraped up and idle, so that load does not weigh against
/// the replica that just served a request.
async fn wait_scraped_idle(proxy: &Proxy) -> ReplicasResponse {
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas.iter().all(|r| {
                r.health == Health::Up
                    && r.scorable
                    && r.workers.iter().all(|w| {
                        w.load.in_flight == 0 && w.load.running == 0 && w.load.waiting == 0
                    })
            })
        })
        .await
        .unwrap_or_else(|s| panic!("replicas never looked up and idle: {s:#?}"))
}

fn entries(proxy: &Proxy, url: &str) -> usize {
    proxy.status().pools[0]
        .replicas
        .iter()
        .find(|r| r.url == url)
        .map(|r| r.workers[0].index_entries)
        .unwrap()
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_sends_a_shared_prefix_to_the_replica_that_caches_it() {
    let Some((servers, algo)) = replicas_from_env() else {
        println!(
            "skipped: set {URLS_VAR} (scripts/interop.sh does, with two servers) to run the \
             router against two real vLLM replicas"
        );
        return;
    };
    let t0 = Instant::now();
    let mut pool = PoolConfig::new(MODEL, model_dir(), BLOCK_SIZE);
    pool.hash_algo = algo.clone();
    // Speculation off: the second request can find its prefix only through the KV events.
    pool.policy = kinference_proxy::parse_policy("{kind: precise, speculative_ttl_ms: 0}").unwrap();
    pool.replicas = servers
        .iter()
        .map(|s| {
            let mut r = ReplicaSpec::new(&s.url);
            // vLLM's PUB socket connects: the router binds.
            r.events = Some(EventsSpec {
                bind: Some(s.events.clone()),
                replay: Some(s.replay.clone()),
                topic: s.topic.clone(),
                ..EventsSpec::default()
            });
            r
        })
        .collect();
    let mut cfg = Config::new(vec![pool]);
    cfg.expose_endpoint_header = true;
    cfg.scrape.interval_ms = 200;
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = Proxy::start_with(cfg, data, admin).await.unwrap();

    // On an endpoint shared by both, a connection cannot be told apart per publisher (only
    // their messages can, by topic); the first request's events show the stream instead.
    let shared = servers[0].events == servers[1].events;
    for s in servers.iter().filter(|_| !shared) {
        let h = proxy
            .wait_for_events(&s.url, 0, WAIT, |h| h.connected)
            .await
            .unwrap_or_else(|e| panic!("{}'s events never connected to {}: {e}", s.url, s.events));
        println!("events of {} connected on {}", s.url, h.endpoint);
    }
    // A publisher that connects drops what it publishes before the router's subscription has
    // reached it (ZMQ's slow joiner), and a shared endpoint cannot show which publishers are
    // connected: each stream is primed until the router holds one of its messages, applied.
    for s in &servers {
        let n = kinference_testkit::sim::prime_events(&proxy, &s.url, MODEL).await;
        println!("events of {} arriving after {n} priming request(s)", s.url);
    }
    let status = wait_scraped_idle(&proxy).await;
    for r in &status.pools[0].replicas {
        let cc = r.cache_config.as_ref().expect("scraped cache config");
        assert_eq!(cc.block_size, Some(BLOCK_SIZE), "{r:#?}");
        assert_eq!(cc.hash_algo.as_deref(), Some(algo.as_str()), "{r:#?}");
    }
    println!(
        "router up, both replicas scorable: {:.1}s",
        t0.elapsed().as_secs_f64()
    );

    let client = reqwest::Client::new();
    let vllm = VllmHttp::new(&servers[0].url, MODEL).unwrap();
    let mut served_by = Vec::new();
    for doc in 0..2 {
        let first_text = prompt(doc, "Question: which shard stores the first block?");
        let second_text = prompt(doc, "And which paragraph names shard forty?");
        let before: Vec<usize> = servers.iter().map(|s| entries(&proxy, &s.url)).collect();

        let first = complete(&client, &proxy, &first_text).await;
        let holder = format!("http://{}", first.endpoint);
        let holder_i = servers
            .iter()
            .position(|s| s.url == holder)
            .unwrap_or_else(|| panic!("served by an unknown replica {holder}"));
        let prompt_tokens = first.usage("prompt_tokens");
        assert!(
            (600..2048 - 4).contains(&prompt_tokens),
            "the document should be long but fit the context: {prompt_tokens} tokens"
        );
        assert_eq!(
            first.usage("cached_tokens"),
            0,
            "a new document: {}",
            first.body
        );
        let full_blocks = usize::try_from(prompt_tokens / u64::from(BLOCK_SIZE)).unwrap();
        let want = before[holder_i] + full_blocks;
        let h = proxy
            .wait_for_events(&holder, 0, WAIT, |h| h.entries >= want && !h.stale)
            .await
            .unwrap_or_else(|e| panic!("the first request's blocks never reached the index: {e}"));
        wait_scraped_idle(&proxy).await;

        // The ground truth: vLLM's own tokenization of both prompts.
        let ids_a = vllm.tokenize_text(&first_text).await.unwrap();
        let ids_b = vllm.tokenize_text(&second_text).await.unwrap();
        assert_eq!(ids_a.len() as u64, prompt_tokens);
        let shared = common_prefix(&ids_a, &ids_b);
        let expect_cached = (shared / BLOCK_SIZE as usize) * BLOCK_SIZE as usize;
        assert!(
            expect_cached >= 512,
            "shared prefix {shared} tokens is too short"
        );
        assert!(expect_cached < ids_b.len());

        let plan = explain(&client, &proxy, &second_text).await;
        assert_eq!(plan.reason, "cached_prefix", "{plan:#?}");
        assert_eq!(plan.prompt_tokens as usize, ids_b.len(), "{plan:#?}");
        assert_eq!(plan.candidates.len(), 2, "{plan:#?}");
        let best = &plan.candidates[0];
        assert_eq!(best.replica, holder, "{plan:#?}");
        assert_eq!(best.speculative_blocks, 0, "{plan:#?}");
        assert_eq!(
            best.predicted_cached_tokens as usize, expect_cached,
            "{plan:#?}"
        );
        let other = &plan.candidates[1];
        assert_eq!(
            (other.gpu_blocks, other.predicted_cached_tokens),
            (0, 0),
            "the other replica never saw this document: {plan:#?}"
        );

        let second = complete(&client, &proxy, &second_text).await;
        assert_eq!(
            second.endpoint, first.endpoint,
            "the shared prefix must land where it is cached"
        );
        let cached = second.usage("cached_tokens");
        assert!(cached > 0, "{}", second.body);
        assert_eq!(
            cached, expect_cached as u64,
            "vLLM's cached tokens against the shared whole blocks: {}",
            second.body
        );
        assert_eq!(cached, u64::from(best.predicted_cached_tokens));
        println!(
            "doc {doc}: A {prompt_tokens} tokens -> {holder} (index entries {} after {} batches); \
             B {} tokens, shared prefix {shared} -> {} (predicted {} cached, vLLM cached {cached}): \
             {:.1}s",
            h.entries,
            h.batches_applied,
            second.usage("prompt_tokens"),
            second.endpoint,
            best.predicted_cached_tokens,
            t0.elapsed().as_secs_f64()
        );
        served_by.push(holder);
        wait_scraped_idle(&proxy).await;
    }
    println!("documents served by {served_by:?}");

    // The router's live hash check agrees with each real replica: two fresh root blocks sent
    // straight to it (no router involved) hash as the pool computes them.
    for s in &servers {
        let addr: std::net::SocketAddr = s
            .url
            .trim_start_matches("http://")
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", s.url));
        let before = proxy
            .wait_for_events(&s.url, 0, WAIT, |_| true)
            .await
            .unwrap();
        for q in ["root check one", "root check two"] {
            let text = format!("{q}: {}", prompt(9, q));
            let (status, _, body) =
                post(&client, addr, "/v1/completions", &completion(&text)).await;
            assert_eq!(status, 200, "{body}");
        }
        let h = proxy
            .wait_for_events(&s.url, 0, WAIT, |h| {
                h.root_samples.len() >= 2
                    && h.root_samples
                        .iter()
                        .rev()
                        .take(2)
                        .all(|r| !before.root_samples.contains(r))
            })
            .await
            .unwrap_or_else(|e| panic!("{} announced no fresh root blocks: {e}", s.url));
        assert_eq!(h.stored_block_size, Some(BLOCK_SIZE), "{}", s.url);
        let st = proxy.status();
        let r = st.pools[0]
            .replicas
            .iter()
            .find(|r| r.url == s.url)
            .unwrap();
        let ev = r.workers[0].events.as_ref().unwrap();
        assert_eq!(ev.root_hashes_match, Some(true), "{r:#?}");
        println!(
            "{}: its root blocks hash as the router computes them",
            s.url
        );
    }
    let status = wait_scraped_idle(&proxy).await;
    assert!(
        status.pools[0].replicas.iter().all(|r| r.scorable),
        "{status:#?}"
    );
    // Each replica's entries in the router's index are exactly the blocks its own event log
    // (read back through its replay socket, independently of the router) leaves cached.
    for s in &servers {
        let mut log = EventLog::new();
        log.extend(fetch_replay(&s.replay, 0, WAIT).await.unwrap())
            .unwrap();
        let held = log.model().len();
        let h = proxy
            .wait_for_events(&s.url, 0, WAIT, |h| h.entries == held && !h.stale)
            .await
            .unwrap_or_else(|e| panic!("{}: the index never held its {held} blocks: {e}", s.url));
        println!(
            "{} (topic {:?}): {} blocks, as its event log",
            s.url, s.topic, h.entries
        );
    }
    proxy.shutdown().await;
}
