//! End-to-end checks of the replica shell over real HTTP and ZMQ sockets: OpenAI shapes,
//! prefix-cache reporting, streaming, metrics, errors, and a KV-event subscriber that ends up
//! holding exactly the engine's cached blocks.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::Duration;

use kinference_events::socket::{SocketType, ZmqSocket};
use kinference_events::{EventPlane, EventPlaneConfig, ReplicaId, WorkerConfig};
use kinference_sim_server::{KvEventsConfig, Server};
use kinference_testkit::{loopback, metric, sim, tokenizer_dir, WAIT};
use kinference_vllm::{BlockHash, DpRank, Tier};
use serde_json::{json, Value};

const PROMPT: &str = "The router keeps a map from block hashes to the servers that hold them. \
When a new request arrives it tokenizes the prompt, splits it into fixed size blocks, hashes \
every block together with its parent, and sends the request to the server that already caches \
the longest prefix. First question: what is a block?";

async fn start(kv_events: Option<KvEventsConfig>) -> Server {
    let mut cfg = sim::config("tiny", 200, 32, 1000.0);
    cfg.engine.max_model_len = 2048;
    cfg.kv_events = kv_events;
    sim::start(cfg).await
}

async fn post(server: &Server, path: &str, body: &Value) -> (u16, String) {
    let url = format!("http://{}{path}", server.addr);
    let resp = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

async fn get(server: &Server, path: &str) -> (u16, String) {
    let url = format!("http://{}{path}", server.addr);
    let resp = reqwest::get(url).await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_prompt_reports_cached_tokens_and_metrics() {
    let server = start(None).await;
    let (status, tok) = post(
        &server,
        "/tokenize",
        &json!({"model": "tiny", "prompt": PROMPT}),
    )
    .await;
    assert_eq!(status, 200);
    let tok: Value = serde_json::from_str(&tok).unwrap();
    let n = tok["count"].as_u64().unwrap();
    assert_eq!(tok["tokens"].as_array().unwrap().len() as u64, n);
    assert_eq!(tok["max_model_len"], 2048);
    assert!(
        n > 64,
        "prompt should span several 32-token blocks, got {n}"
    );
    let full_blocks = (n - 1) / 32 * 32;

    let (status, first) = post(&server, "/v1/completions", &completion(4)).await;
    assert_eq!(status, 200, "{first}");
    let first: Value = serde_json::from_str(&first).unwrap();
    assert_eq!(first["object"], "text_completion");
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["prompt_tokens"].as_u64(), Some(n));
    assert_eq!(first["usage"]["completion_tokens"], 4);
    assert_eq!(first["usage"]["total_tokens"].as_u64(), Some(n + 4));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);

    let (_, second) = post(&server, "/v1/completions", &completion(4)).await;
    let second: Value = serde_json::from_str(&second).unwrap();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(full_blocks)
    );
    assert_ne!(first["id"], second["id"]);

    let (status, metrics) = get(&server, "/metrics").await;
    assert_eq!(status, 200);
    let labels = "{engine=\"0\",model_name=\"tiny\"}";
    for (name, v) in [
        ("vllm:prefix_cache_queries_total", 2 * n),
        ("vllm:prefix_cache_hits_total", full_blocks),
        ("vllm:generation_tokens_total", 8),
        ("vllm:num_requests_running", 0),
    ] {
        let series = format!("{name}{labels}");
        assert_eq!(metric(&metrics, &series), v as f64, "{series}");
    }
    assert!(metrics.contains("vllm:cache_config_info{block_size=\"32\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"200\",prefix_caching_hash_algo=\"sha256\"} 1.0"));
    assert!(metrics.contains(
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"tiny\",le=\"+Inf\"} 2"
    ));
    assert!(metrics.contains(
        "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"tiny\",le=\"0.001\"}"
    ));
    server.shutdown();
}

fn sse_data(body: &str) -> Vec<&str> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not SSE: {e:?}"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_yields_token_chunks_usage_and_done() {
    let server = start(None).await;
    let mut req = completion(5);
    req["stream"] = json!(true);
    req["stream_options"] = json!({"include_usage": true});
    let (status, body) = post(&server, "/v1/completions", &req).await;
    assert_eq!(status, 200);
    let events = sse_data(&body);
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert_eq!(chunks.len(), 6, "5 token chunks and a usage chunk: {body}");
    for c in &chunks[..5] {
        assert_eq!(c["object"], "text_completion");
        assert!(!c["choices"][0]["text"].as_str().unwrap().is_empty());
    }
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], Value::Null);
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 5);

    let chat = json!({"model": "tiny", "max_tokens": 3, "stream": true,
                      "messages": [{"role": "user", "content": PROMPT}]});
    let (status, body) = post(&server, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200);
    let events = sse_data(&body);
    assert_eq!(events.len(), 5, "role chunk, 3 tokens, [DONE]: {body}");
    assert_eq!(events[4], "[DONE]");
    let role: Value = serde_json::from_str(events[0]).unwrap();
    assert_eq!(role["object"], "chat.completion.chunk");
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let last: Value = serde_json::from_str(events[3]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none(), "usage only when asked");
    server.shutdown();
}

/// The `id` of every chunk of a streamed request.
async fn streamed_ids(server: &Server, path: &str, body: &Value) -> Vec<String> {
    let (status, text) = post(server, path, body).await;
    assert_eq!(status, 200, "{text}");
    sse_data(&text)
        .into_iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["id"].as_str().unwrap().to_owned()
        })
        .collect()
}

fn vllm_like_id(id: &str, prefix: &str) -> bool {
    id.strip_prefix(prefix)
        .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_ids_are_random_per_request_and_shared_by_its_chunks() {
    // vLLM: `chatcmpl-` / `cmpl-` + `random_uuid()` (16 hex digits), one id per request.
    let (a, b) = (start(None).await, start(None).await);
    let chat = json!({"model": "tiny", "max_tokens": 3, "stream": true,
                      "messages": [{"role": "user", "content": PROMPT}]});
    let mut completion = completion(3);
    completion["stream"] = json!(true);
    let mut seen = HashSet::new();
    for server in [&a, &b] {
        for (path, body, prefix) in [
            ("/v1/chat/completions", &chat, "chatcmpl-"),
            ("/v1/chat/completions", &chat, "chatcmpl-"),
            ("/v1/completions", &completion, "cmpl-"),
        ] {
            let ids = streamed_ids(server, path, body).await;
            assert!(ids.len() >= 3, "{ids:?}");
            assert!(
                ids.iter().all(|id| id == &ids[0]),
                "one id per request: {ids:?}"
            );
            assert!(vllm_like_id(&ids[0], prefix), "{}", ids[0]);
            assert!(seen.insert(ids[0].clone()), "repeated id {}", ids[0]);
        }
    }
    a.shutdown();
    b.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_models_health_and_errors() {
    let server = start(None).await;
    let chat = json!({"model": "tiny", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "Hello there"}]});
    let (status, body) = post(&server, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 2);

    let (status, models) = get(&server, "/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    assert_eq!(models["data"][0]["max_model_len"], 2048);
    assert_eq!(get(&server, "/health").await.0, 200);

    let url = format!("http://{}/v1/completions", server.addr);
    let resp = reqwest::Client::new()
        .post(url)
        .header("content-type", "application/json")
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let err: Value = resp.json().await.unwrap();
    assert_eq!(err["error"]["type"], "BadRequestError");
    assert_eq!(err["error"]["code"], 400);

    let (status, body) = post(&server, "/v1/completions", &json!({"model": "tiny"})).await;
    assert_eq!(status, 400, "missing prompt: {body}");
    let mut unknown = completion(2);
    unknown["model"] = json!("other");
    let (status, body) = post(&server, "/v1/completions", &unknown).await;
    assert_eq!(status, 404);
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(err["error"]["message"], "The model `other` does not exist.");
    server.shutdown();
}

async fn engine_hashes(server: &Server) -> HashSet<BlockHash> {
    server
        .inspect(|e| {
            e.block_pool()
                .cached_blocks()
                .iter()
                .map(|(d, _)| BlockHash::from_digest(d.as_bytes()))
                .collect()
        })
        .await
        .unwrap()
}

/// Shared-prefix traffic whose blocks the engine caches.
async fn traffic(server: &Server) {
    for (i, suffix) in [
        "",
        " Second question?",
        " Third one, longer than the others?",
    ]
    .iter()
    .enumerate()
    {
        let body = json!({"prompt": format!("{PROMPT}{suffix}"), "max_tokens": 40 + i});
        let (status, text) = post(server, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_plane_holds_exactly_the_engine_blocks() {
    let server = start(Some(sim::events_on_port_zero())).await;
    let eps = server.endpoints.clone().unwrap();
    let events = loopback(eps.events.as_deref().unwrap());
    let replay = loopback(eps.replay.as_deref().unwrap());
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let cfg = WorkerConfig::connect(ReplicaId(1), DpRank(0), &events).with_replay(&replay);
    let w = plane.add_worker(cfg).await.unwrap();
    plane
        .wait_for(w, Duration::from_secs(10), |h| h.connected)
        .await
        .unwrap();

    traffic(&server).await;
    let expected = engine_hashes(&server).await;
    assert!(
        expected.len() >= 5,
        "engine caches {} blocks",
        expected.len()
    );
    let index = plane.index();
    let matches = move |_: &kinference_events::WorkerHealth| {
        let idx = index.read();
        idx.worker_entries(w) == expected.len()
            && expected.iter().all(|h| idx.holds(w, *h, Tier::Gpu))
    };
    let h = plane
        .wait_for(w, Duration::from_secs(10), matches)
        .await
        .unwrap_or_else(|e| panic!("index never matched the engine: {e}; {:?}", plane.health(w)));
    assert_eq!(h.decode_errors, 0);
    assert_eq!(h.unrecoverable_gaps, 0);

    // A reset publishes AllBlocksCleared; the subscriber's view empties with the engine's.
    let (status, _) = post(&server, "/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200);
    let index = plane.index();
    plane
        .wait_for(w, Duration::from_secs(10), move |_| {
            index.read().worker_entries(w) == 0
        })
        .await
        .unwrap();
    assert!(engine_hashes(&server).await.is_empty());
    plane.shutdown().await;
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_returns_every_batch_in_order_then_the_end_marker() {
    let server = start(Some(sim::events_on_port_zero())).await;
    traffic(&server).await;
    let eps = server.endpoints.clone().unwrap();
    let mut dealer = ZmqSocket::new(SocketType::DEALER).unwrap();
    dealer
        .connect(&loopback(eps.replay.as_deref().unwrap()))
        .unwrap();
    let ask: [&[u8]; 2] = [b"", &1u64.to_be_bytes()];
    dealer.send(&ask).await.unwrap();
    let mut seqs = Vec::new();
    let mut stored = 0usize;
    loop {
        let frames = dealer.recv().await.unwrap();
        match kinference_vllm::parse_replay(&frames).unwrap() {
            kinference_vllm::ReplayFrame::End => break,
            kinference_vllm::ReplayFrame::Batch { seq, payload, .. } => {
                seqs.push(seq);
                let batch = kinference_vllm::decode_batch(payload).unwrap();
                stored += batch.events.len();
            }
        }
    }
    assert!(seqs.len() >= 2, "replayed {seqs:?}");
    let want: Vec<u64> = (1..1 + seqs.len() as u64).collect();
    assert_eq!(seqs, want, "replay starts at the asked seq, no gaps");
    assert!(stored > 0);
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_event_sources_and_reset_prefix_cache() {
    let server = start(Some(sim::events_on_port_zero())).await;
    let eps = server.endpoints.clone().unwrap();
    let (status, body) = get(&server, "/kv_event_sources").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["0"]["endpoint"].as_str(), eps.events.as_deref());
    assert_eq!(v["0"]["replay_endpoint"].as_str(), eps.replay.as_deref());
    assert_eq!(v["0"]["buffer_steps"], 10_000);

    traffic(&server).await;
    assert!(!engine_hashes(&server).await.is_empty());
    let (status, body) = post(&server, "/reset_prefix_cache", &json!({})).await;
    assert_eq!(status, 200, "{body}");
    // The reset takes effect at once; its AllBlocksCleared goes out with the next step.
    assert!(engine_hashes(&server).await.is_empty());
    let (_, again) = post(&server, "/v1/completions", &completion(2)).await;
    let again: Value = serde_json::from_str(&again).unwrap();
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    server.shutdown();
}

/// Replays the real vLLM 0.32 capture's requests: `/tokenize` gives the same token ids, and
/// each response has the same shape and usage counts (text aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matches_a_real_vllm_capture() {
    let path = tokenizer_dir().join("../run1/requests.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("capture missing at {}: {e}", path.display()));
    let capture: Value = serde_json::from_str(&text).unwrap();
    let steps = capture["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    let server = start(None).await;
    for step in steps {
        let name = step["name"].as_str().unwrap();
        let (status, tok) = post(&server, "/tokenize", &step["tokenize_request"]).await;
        assert_eq!(status, 200, "{name}: {tok}");
        let tok: Value = serde_json::from_str(&tok).unwrap();
        assert_eq!(tok["tokens"], step["tokenize"]["tokens"], "{name}");
        assert_eq!(tok["count"], step["tokenize"]["count"], "{name}");

        let path = step["path"].as_str().unwrap();
        let (status, resp) = post(&server, path, &step["request"]).await;
        assert_eq!(status, 200, "{name}: {resp}");
        let resp: Value = serde_json::from_str(&resp).unwrap();
        let real = &step["response"];
        assert_eq!(resp["object"], real["object"], "{name}");
        assert_eq!(resp["model"], real["model"], "{name}");
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(resp["usage"][k], real["usage"][k], "{name}: usage.{k}");
        }
        let (ours, theirs) = (&resp["choices"][0], &real["choices"][0]);
        assert_eq!(ours["finish_reason"], theirs["finish_reason"], "{name}");
        let id = resp["id"].as_str().unwrap();
        let real_id = real["id"].as_str().unwrap();
        assert_eq!(
            id.split('-').next(),
            real_id.split('-').next(),
            "{name}: id prefix"
        );
    }
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_simulator_rebinds_its_event_ports_and_the_subscriber_follows() {
    let first = start(Some(sim::events_on_port_zero())).await;
    let eps = first.endpoints.clone().unwrap();
    let (events, replay) = (eps.events.unwrap(), eps.replay.unwrap());
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let cfg = WorkerConfig::connect(ReplicaId(1), DpRank(0), &loopback(&events))
        .with_replay(&loopback(&replay));
    let w = plane.add_worker(cfg).await.unwrap();
    traffic(&first).await;
    let held = engine_hashes(&first).await.len();
    plane
        .wait_for(w, WAIT, |h| h.entries == held && !h.stale)
        .await
        .unwrap();
    // Stopping the publisher closes its accepted connections first, which leaves them in
    // TIME_WAIT on its ports; like vLLM (libzmq sets SO_REUSEADDR) it must bind them again.
    first.shutdown();
    let port = |ep: &str| ep.rsplit(':').next().unwrap().to_owned();
    let mut kv = KvEventsConfig::new(&format!("tcp://*:{}", port(&events)));
    kv.replay_endpoint = Some(format!("tcp://*:{}", port(&replay)));
    let second = start(Some(kv)).await;
    let eps = second.endpoints.clone().unwrap();
    assert_eq!(eps.events.as_deref().map(port), Some(port(&events)));
    assert_eq!(eps.replay.as_deref().map(port), Some(port(&replay)));
    // The same subscriber redials by itself, sees the new stream and holds its blocks only.
    // Batches sent before its subscription reaches the new publisher are dropped (as with
    // vLLM), so requests go on until the restart has been seen.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut i = 0;
    while plane.health(w).unwrap().resets == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the restart was never seen"
        );
        let body = json!({"prompt": format!("{PROMPT} Restarted {i}?"), "max_tokens": 4});
        let (status, text) = post(&second, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{text}");
        i += 1;
    }
    let expected = engine_hashes(&second).await;
    let index = plane.index();
    let h = plane
        .wait_for(w, WAIT, |h| {
            h.resets >= 1 && !h.stale && h.entries == expected.len()
        })
        .await
        .unwrap();
    assert!(h.connected, "{h:?}");
    assert!(expected
        .iter()
        .all(|b| index.read().holds(w, *b, Tier::Gpu)));
    plane.shutdown().await;
    second.shutdown();
}

/// `/debug/cache` of rank 0: (cached blocks, published batches).
async fn debug_cache(server: &Server) -> (usize, u64) {
    let (status, body) = get(server, "/debug/cache").await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let r = &v["ranks"][0];
    (
        r["cached_blocks"].as_u64().unwrap() as usize,
        r["published_batches"].as_u64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_duplicated_and_reordered_events_still_end_in_the_engine_blocks() {
    let mut kv = sim::events_on_port_zero();
    kv.faults = kinference_sim_server::EventFaults {
        drop_pct: 20.0,
        dup_pct: 5.0,
        reorder_pct: 10.0,
        seed: 3,
    };
    let server = start(Some(kv)).await;
    let eps = server.endpoints.clone().unwrap();
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let cfg = WorkerConfig::connect(ReplicaId(1), DpRank(0), &loopback(&eps.events.unwrap()))
        .with_replay(&loopback(&eps.replay.unwrap()));
    let w = plane.add_worker(cfg).await.unwrap();
    plane.wait_for(w, WAIT, |h| h.connected).await.unwrap();
    // Enough batches that the seeded faults include each kind; a dropped batch shows as a
    // gap only when a later one arrives, so requests go on until the index has caught up.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut i = 0;
    loop {
        let (cached, published) = debug_cache(&server).await;
        assert_eq!(cached, engine_hashes(&server).await.len());
        if published >= 40 {
            let index = plane.index();
            let caught_up = plane
                .wait_for(w, Duration::from_secs(2), move |h| {
                    h.applied_seq == Some(published - 1)
                        && !h.stale
                        && index.read().worker_entries(w) == cached
                })
                .await;
            if caught_up.is_ok() {
                break;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the index never caught up: {:?}",
            plane.health(w)
        );
        let body = json!({"prompt": format!("{PROMPT} Faulty {i}?"), "max_tokens": 40});
        let (status, text) = post(&server, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{text}");
        i += 1;
    }
    let expected = engine_hashes(&server).await;
    let index = plane.index();
    assert!(expected
        .iter()
        .all(|b| index.read().holds(w, *b, Tier::Gpu)));
    let h = plane.health(w).unwrap();
    // Drops show as gaps; copies and reorders as repeats the replay proved, never as restarts.
    assert!(h.gaps > 0 && h.repeats > 0, "faults were injected: {h:?}");
    assert_eq!(h.resets, 0, "{h:?}");
    plane.shutdown().await;
    server.shutdown();
}
