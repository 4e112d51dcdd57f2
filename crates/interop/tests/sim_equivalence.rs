//! The simulator against a real vLLM: one request sequence sent to both must produce the same
//! KV events and the same prefix-cache hits.
//!
//! Runs only when `KINFERENCE_REAL_VLLM_URL` (and the other `KINFERENCE_REAL_VLLM_*`
//! variables) are set, as `scripts/interop.sh` does; otherwise it prints why it skipped and
//! passes. The sim replica runs in-process with the real server's cache settings (read from its
//! `vllm:cache_config_info`: block size, `num_gpu_blocks`, hash algorithm) and the real
//! server's own tokenizer directory (`KINFERENCE_REAL_VLLM_MODEL_DIR`, by default the model
//! `scripts/real-vllm.sh` installs).
//!
//! Every request uses `max_tokens = 1`, so both engines cache prompt blocks only (the tiny
//! model's random output never enters a hash). The sequence covers shared prefixes, a chat
//! growing turn by turn (with fixed assistant turns, not the model's output), token-id prompts,
//! a prompt of exactly two blocks sent twice (vLLM recomputes and re-caches its last block),
//! `cache_salt`, `n = 2`, and enough distinct prompts to turn the 80-block cache over twice,
//! with revisits of warm prompts and of prompts that a shorter prompt has partly evicted.
//!
//! Checked, request by request and at the end:
//! - `/tokenize` gives the same ids, and `usage.prompt_tokens` agrees;
//! - `usage.prompt_tokens_details.cached_tokens` is equal, also once capacity is exceeded: the
//!   simulator's block pool evicts in vLLM's order (free-queue LRU, a request's blocks freed
//!   tail first), so partial hits after evictions match too. Nothing is exempted: with one
//!   request in flight at a time neither engine's timing can reorder evictions (concurrent
//!   requests could, as the simulated step times are not the real CPU engine's);
//! - the events, flattened to one entry per block (`BlockStored` split per block with its
//!   parent and tokens, `BlockRemoved` per hash, `AllBlocksCleared`), are the same sequence:
//!   how vLLM groups blocks into events and batches depends on its step boundaries (chunked
//!   prefill), which the comparison deliberately ignores;
//! - the `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits` counters grow by the same
//!   amounts.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_events::socket::ZmqSocket;
use kinference_interop::env::{model_dir, MODEL_DIR_VAR};
use kinference_interop::env::{SKIP_MESSAGE, TOPIC};
use kinference_interop::http::parse_cache_config;
use kinference_interop::{fetch_replay, EventLog, RealVllmEnv};
use kinference_sim::EngineConfig;
use kinference_sim_server::{Server, ServerConfig};
use kinference_testkit::sim;
use kinference_vllm::metrics::text;
use kinference_vllm::{BlockHash, BlockHasher, ExtraKeysFormat, HashAlgo, KvEvent, RequestExtras};
use serde_json::{json, Value};
use tokio::time::Instant;

const MODEL: &str = "tiny";
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
const REPLAY_TIMEOUT: Duration = Duration::from_secs(5);
/// Between replay reads when no live message wakes the wait earlier.
const POLL_INTERVAL: Duration = Duration::from_millis(200);

const SHARED_PREFIX: &str = "A cache-aware router keeps a map from block hashes to the servers \
that hold them. When a request arrives it tokenizes the prompt exactly as the engine would, \
splits the token ids into fixed-size blocks, hashes every full block together with the hash of \
the block before it, and looks up how many leading blocks each server still caches. ";

const QUESTIONS: [&str; 4] = [
    "Question one: what exactly is a block?",
    "Question two: why does every hash depend on its parent?",
    "Question three: what happens when the engine evicts a block?",
    "Question four: how does the router notice a restarted engine?",
];

const SYSTEM: &str = "You are a precise assistant for questions about key-value caches, \
prefix caching, block hashing and request routing in language model serving systems.";

const TURNS: [(&str, &str); 3] = [
    (
        "How does the engine decide which blocks it may reuse for a new request?",
        "It hashes each full block with its parent and looks the hashes up in order.",
    ),
    (
        "And what does the router need to know to predict that reuse?",
        "Which hashes every engine holds, from the events the engines publish.",
    ),
    (
        "What goes wrong if the router misses an eviction message?",
        "It predicts hits that no longer exist and sends requests to the wrong engine.",
    ),
];

/// Deterministic token ids in `[5, 4000)` (ids below 5 are the tokenizer's special tokens).
fn ids(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            5 + (x % 3995) as u32
        })
        .collect()
}

/// One request of the sequence.
#[derive(Clone, Debug)]
struct Step {
    name: String,
    path: &'static str,
    body: Value,
    /// What `/tokenize` gets for it.
    tokenize: Value,
    /// A token-id prompt: used as given (vLLM's `/tokenize` takes text only).
    ids: Option<Vec<u32>>,
    salt: Option<String>,
}

fn completion(name: &str, prompt: Value, extra: Value) -> Step {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0});
    let salt = extra
        .get("cache_salt")
        .and_then(Value::as_str)
        .map(str::to_owned);
    if let Value::Object(m) = extra {
        body.as_object_mut().unwrap().extend(m);
    }
    let ids = serde_json::from_value(prompt.clone()).ok();
    Step {
        name: name.to_owned(),
        path: "/v1/completions",
        body,
        tokenize: json!({"model": MODEL, "prompt": prompt}),
        ids,
        salt,
    }
}

fn chat(name: &str, messages: Value) -> Step {
    Step {
        name: name.to_owned(),
        path: "/v1/chat/completions",
        body: json!({"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0.0}),
        tokenize: json!({"model": MODEL, "messages": messages, "add_generation_prompt": true}),
        ids: None,
        salt: None,
    }
}

fn sequence(bs: usize, num_blocks: usize) -> Vec<Step> {
    let mut steps = Vec::new();
    for (i, q) in QUESTIONS.iter().enumerate() {
        steps.push(completion(
            &format!("shared-{i}"),
            json!(format!("{SHARED_PREFIX}{q}")),
            json!({}),
        ));
    }
    let mut messages = vec![json!({"role": "system", "content": SYSTEM})];
    for (i, (user, assistant)) in TURNS.iter().enumerate() {
        messages.push(json!({"role": "user", "content": user}));
        steps.push(chat(&format!("chat-{i}"), json!(messages)));
        messages.push(json!({"role": "assistant", "content": assistant}));
    }
    let base = ids(1, 5 * bs + 7);
    for i in 0..3u64 {
        let prompt = [base.clone(), ids(100 + i, bs + 11)].concat();
        steps.push(completion(&format!("ids-{i}"), json!(prompt), json!({})));
    }
    let exact = ids(21, 2 * bs);
    for i in 0..2 {
        steps.push(completion(
            &format!("exact-two-blocks-{i}"),
            json!(exact),
            json!({}),
        ));
    }
    let salted = format!("{SHARED_PREFIX}{}", QUESTIONS[0]);
    for (i, salt) in ["tenant-a", "tenant-a", "tenant-b"].iter().enumerate() {
        let extra = json!({"cache_salt": salt});
        steps.push(completion(
            &format!("salt-{i}-{salt}"),
            json!(salted),
            extra,
        ));
    }
    steps.push(completion(
        "n-2",
        json!(ids(30, 3 * bs + 5)),
        json!({"n": 2, "temperature": 1.0}),
    ));
    // Distinct 10-block prompts until the cache has turned over twice, revisiting earlier
    // prompts (their cached prefixes shrink as blocks are evicted).
    for i in 0..2 * num_blocks / 10 + 2 {
        steps.push(completion(
            &format!("evict-{i}"),
            json!(ids(1000 + i as u64, 10 * bs)),
            json!({}),
        ));
        if i % 3 == 2 {
            steps.push(completion(
                &format!("revisit-shared-{i}"),
                json!(salted),
                json!({}),
            ));
            let prompt = [base.clone(), ids(100, bs + 11)].concat();
            steps.push(completion(
                &format!("revisit-ids-{i}"),
                json!(prompt),
                json!({}),
            ));
        }
        if i >= 6 && i % 3 == 0 {
            // A 5-block prompt takes half of some older prompt's blocks, then that prompt
            // (six back) comes again: partly evicted, tail blocks first.
            let nudge = ids(5000 + i as u64, 4 * bs + 3);
            steps.push(completion(&format!("nudge-{i}"), json!(nudge), json!({})));
            let old = ids(1000 + (i - 6) as u64, 10 * bs);
            let name = format!("revisit-old-{}", i - 6);
            steps.push(completion(&name, json!(old), json!({})));
        }
    }
    steps
}

/// One block-level KV event, independent of how events were grouped into messages.
#[derive(Clone, Debug, PartialEq, Eq)]
enum BlockEvent {
    Stored {
        hash: u64,
        parent: Option<u64>,
        tokens: Vec<u32>,
    },
    Removed(u64),
    Cleared,
}

fn flatten(log: &EventLog, from_seq: u64) -> Vec<BlockEvent> {
    let mut out = Vec::new();
    for b in log.batches().iter().filter(|b| b.seq >= from_seq) {
        for e in &b.batch.events {
            match e {
                KvEvent::BlockStored(s) => {
                    let bs = s.block_size as usize;
                    let mut parent = s.parent_block_hash.as_ref().map(|p| p.block_hash().0);
                    for (h, t) in s.block_hashes.iter().zip(s.token_ids.chunks(bs.max(1))) {
                        let hash = h.block_hash().0;
                        out.push(BlockEvent::Stored {
                            hash,
                            parent,
                            tokens: t.to_vec(),
                        });
                        parent = Some(hash);
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    out.extend(
                        r.block_hashes
                            .iter()
                            .map(|h| BlockEvent::Removed(h.block_hash().0)),
                    );
                }
                KvEvent::AllBlocksCleared => out.push(BlockEvent::Cleared),
            }
        }
    }
    out
}

/// One server under comparison: its HTTP base, its replayed event log, and how to wait.
struct Side {
    name: &'static str,
    base: String,
    replay: String,
    log: EventLog,
    /// The real server's live stream (its PUB connects to us): wakes the settle loop early.
    live: Option<ZmqSocket>,
    sim: Option<Server>,
    client: reqwest::Client,
}

impl Side {
    async fn post(&self, path: &str, body: &Value) -> Value {
        let url = format!("{}{path}", self.base);
        let resp = self.client.post(&url).json(body).send().await.unwrap();
        let status = resp.status();
        let text = resp.text().await.unwrap();
        assert!(
            status.is_success(),
            "{}: {url} answered {status}: {text}",
            self.name
        );
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    async fn metrics(&self) -> String {
        let url = format!("{}/metrics", self.base);
        self.client
            .get(&url)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// (prefix_cache_queries, prefix_cache_hits) summed over engines.
    async fn counters(&self) -> (f64, f64) {
        let page = self.metrics().await;
        let sum = |name: &str| -> f64 {
            text::parse(&page)
                .filter_map(Result::ok)
                .filter(|s| s.name == name)
                .map(|s| s.value)
                .sum()
        };
        (
            sum("vllm:prefix_cache_queries_total"),
            sum("vllm:prefix_cache_hits_total"),
        )
    }

    async fn refresh(&mut self) {
        if let Some(s) = &self.sim {
            assert!(s.events_published(0).await, "sim publisher stopped");
        }
        let batches = fetch_replay(&self.replay, self.log.next_seq(), REPLAY_TIMEOUT)
            .await
            .unwrap();
        self.log.extend(batches).unwrap();
    }

    /// Waits until the log holds every block of `chain` (the request's effect is published).
    async fn settle(&mut self, what: &str, chain: &[BlockHash], clears_before: Option<usize>) {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            self.refresh().await;
            let model = self.log.model();
            let cleared = clears_before.is_none_or(|n| self.log.clear_seqs().len() > n);
            if cleared && chain.iter().all(|h| model.contains(*h)) {
                return;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "{}: {what} never showed in the event log",
                self.name
            );
            match &mut self.live {
                // A live message wakes us at once; otherwise read the replay log again.
                Some(live) => {
                    let _ = tokio::time::timeout(left.min(POLL_INTERVAL), live.recv()).await;
                }
                None => {
                    // The sim's publisher already caught up in `refresh`: nothing more comes.
                    panic!("{}: {what} is not in the published log", self.name);
                }
            }
        }
    }
}

async fn real_side(env: &RealVllmEnv, client: &reqwest::Client) -> Side {
    let mut live = ZmqSocket::sub("").unwrap();
    live.bind(&env.events).await.unwrap();
    let mut side = Side {
        name: "real vLLM",
        base: env.url.clone(),
        replay: env.replay.clone(),
        log: EventLog::new(),
        live: Some(live),
        sim: None,
        client: client.clone(),
    };
    side.refresh().await;
    side
}

async fn sim_side(bs: usize, num_blocks: usize, algo: HashAlgo, client: &reqwest::Client) -> Side {
    let dir = model_dir();
    assert!(
        dir.join("tokenizer.json").is_file(),
        "no tokenizer.json in {} (set {MODEL_DIR_VAR} to the real server's model directory)",
        dir.display()
    );
    let mut engine = EngineConfig::small(num_blocks, bs);
    engine.max_model_len = 2048;
    engine.hash_algo = algo;
    let mut cfg = ServerConfig::new(MODEL, engine, dir, 1000.0);
    let mut kv = sim::events_on_port_zero();
    kv.topic = TOPIC.into();
    cfg.kv_events = Some(kv);
    let server = sim::start(cfg).await;
    let replay = server
        .endpoints
        .as_ref()
        .and_then(|e| e.replay.clone())
        .unwrap();
    let port = replay.rsplit(':').next().unwrap().to_owned();
    Side {
        name: "sim",
        base: format!("http://{}", server.addr),
        replay: format!("tcp://127.0.0.1:{port}"),
        log: EventLog::new(),
        live: None,
        sim: Some(server),
        client: client.clone(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_matches_real_vllm_events_and_hits() {
    let Some(env) = RealVllmEnv::from_env().expect("interop environment") else {
        println!("{SKIP_MESSAGE}");
        return;
    };
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let mut real = real_side(&env, &client).await;
    let cfg = parse_cache_config(&real.metrics().await).expect("vllm:cache_config_info");
    let (bs, num_blocks) = (cfg.block_size as usize, cfg.num_gpu_blocks as usize);
    let algo: HashAlgo = cfg.hash_algo.parse().unwrap();
    println!(
        "real vLLM at {}: block size {bs}, {num_blocks} blocks, {algo:?}",
        env.url
    );
    let mut sim = sim_side(bs, num_blocks, algo, &client).await;
    let hasher = BlockHasher::new(algo, bs, None, ExtraKeysFormat::Tagged).unwrap();

    // Both start from an empty cache; each side's AllBlocksCleared goes out with its next step.
    let marks = [real.log.next_seq(), sim.log.next_seq()];
    let clears = [real.log.clear_seqs().len(), sim.log.clear_seqs().len()];
    for side in [&real, &sim] {
        side.post("/reset_prefix_cache", &json!({})).await;
    }
    let before = [real.counters().await, sim.counters().await];

    let mut mismatches = Vec::new();
    println!(
        "  {:<24} {:>6} {:>7} {:>11} {:>10}",
        "request", "tokens", "blocks", "cached real", "cached sim"
    );
    for (k, step) in sequence(bs, num_blocks).iter().enumerate() {
        let tokens: Vec<u32> = match &step.ids {
            Some(ids) => ids.clone(),
            None => {
                let t_real: Value = real.post("/tokenize", &step.tokenize).await;
                let t_sim: Value = sim.post("/tokenize", &step.tokenize).await;
                assert_eq!(
                    t_real["tokens"], t_sim["tokens"],
                    "{}: /tokenize differs: the sim must use the real server's tokenizer",
                    step.name
                );
                serde_json::from_value(t_real["tokens"].clone()).unwrap()
            }
        };
        let extras = RequestExtras {
            cache_salt: step.salt.clone(),
            ..RequestExtras::default()
        };
        let full = tokens.len() / bs;
        let chain: Vec<BlockHash> = hasher
            .hash_blocks(&tokens[..full * bs], &extras)
            .iter()
            .map(|d| d.event_hash())
            .collect();
        let mut cached = [0u64; 2];
        for (i, side) in [&mut real, &mut sim].into_iter().enumerate() {
            let r = side.post(step.path, &step.body).await;
            assert_eq!(
                r["usage"]["prompt_tokens"].as_u64(),
                Some(tokens.len() as u64),
                "{}",
                step.name
            );
            cached[i] = r["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("{}: no cached_tokens in {r}", side.name));
            let clear = (k == 0).then_some(clears[i]);
            side.settle(&step.name, &chain, clear).await;
        }
        println!(
            "  {:<24} {:>6} {:>7} {:>11} {:>10}",
            step.name,
            tokens.len(),
            full,
            cached[0],
            cached[1]
        );
        if cached[0] != cached[1] {
            mismatches.push(format!(
                "{}: real {} cached tokens, sim {}",
                step.name, cached[0], cached[1]
            ));
        }
    }

    let after = [real.counters().await, sim.counters().await];
    let delta = |i: usize| (after[i].0 - before[i].0, after[i].1 - before[i].1);
    println!(
        "prefix cache (queries, hits): real {:?}, sim {:?}",
        delta(0),
        delta(1)
    );
    let events = [flatten(&real.log, marks[0]), flatten(&sim.log, marks[1])];
    let count = |e: &[BlockEvent], f: fn(&BlockEvent) -> bool| e.iter().filter(|x| f(x)).count();
    for (name, e) in ["real", "sim"].iter().zip(&events) {
        println!(
            "{name}: {} stored, {} removed, {} cleared",
            count(e, |x| matches!(x, BlockEvent::Stored { .. })),
            count(e, |x| matches!(x, BlockEvent::Removed(_))),
            count(e, |x| matches!(x, BlockEvent::Cleared)),
        );
    }
    if let Some(i) =
        (0..events[0].len().max(events[1].len())).find(|i| events[0].get(*i) != events[1].get(*i))
    {
        mismatches.push(format!(
            "block events differ first at #{i}: real {:?}, sim {:?}",
            events[0].get(i),
            events[1].get(i)
        ));
    }
    if delta(0) != delta(1) {
        mismatches.push(format!(
            "prefix-cache counters: real {:?}, sim {:?}",
            delta(0),
            delta(1)
        ));
    }
    assert!(
        count(&events[0], |x| matches!(x, BlockEvent::Removed(_))) > 0,
        "the sequence must exceed the real server's cache"
    );
    if let Some(s) = sim.sim.take() {
        s.shutdown();
    }
    assert!(
        mismatches.is_empty(),
        "{} differences:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}
