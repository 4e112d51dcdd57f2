//! Request features over real HTTP and ZMQ: client disconnects, `n > 1`, stop strings,
//! logprobs, LoRA adapters and `cache_salt` (checked against the hashes kinference-vllm
//! computes), vLLM's error bodies, data-parallel ranks, and the shared command line.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use clap::Parser;
use kinference_events::socket::{SocketType, ZmqSocket};
use kinference_sim_server::cli::{self, SimArgs};
use kinference_sim_server::{LoraModule, Server, ServerConfig};
use kinference_testkit::{loopback, metric, sim, tokenizer_dir, WAIT};
use kinference_vllm::{
    BlockHasher, BlockStored, ExtraKeysFormat, HashAlgo, KvEvent, KvEventBatch, Lora, RequestExtras,
};
use serde_json::{json, Value};

const PROMPT: &str = "The router keeps a map from block hashes to the servers that hold them. \
When a new request arrives it tokenizes the prompt, splits it into fixed size blocks, hashes \
every block together with its parent, and sends the request to the server that already caches \
the longest prefix. First question: what is a block?";

fn config(speedup: f64) -> ServerConfig {
    let mut cfg = sim::config("tiny", 200, 32, speedup);
    cfg.engine.max_model_len = 2048;
    cfg
}

async fn post_with(
    server: &Server,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("http://{}{path}", server.addr))
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, v)
}

async fn post(server: &Server, path: &str, body: &Value) -> (u16, Value) {
    post_with(server, path, body, &[]).await
}

/// The SSE events of a streamed response, parsed (the final `[DONE]` checked and dropped).
async fn post_stream(
    server: &Server,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Vec<Value> {
    let (status, v) = post_with(server, path, body, headers).await;
    assert_eq!(status, 200, "{v}");
    let text = v.as_str().unwrap().to_owned();
    let events: Vec<&str> = text
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap())
        .collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

async fn get_text(server: &Server, path: &str) -> String {
    reqwest::get(format!("http://{}{path}", server.addr))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

async fn tokens(server: &Server, prompt: &str) -> Vec<u32> {
    let (status, v) = post(server, "/tokenize", &json!({"prompt": prompt})).await;
    assert_eq!(status, 200, "{v}");
    serde_json::from_value(v["tokens"].clone()).unwrap()
}

/// Every batch the rank at `index` published, read back through its replay socket after
/// the publisher caught up with the engine.
async fn published(server: &Server, index: usize) -> Vec<KvEventBatch> {
    assert!(tokio::time::timeout(WAIT, server.events_published(index))
        .await
        .unwrap());
    let eps = server.rank_endpoints()[index].clone().unwrap();
    let mut dealer = ZmqSocket::new(SocketType::DEALER).unwrap();
    dealer
        .connect(&loopback(eps.replay.as_deref().unwrap()))
        .unwrap();
    let ask: [&[u8]; 2] = [b"", &0u64.to_be_bytes()];
    dealer.send(&ask).await.unwrap();
    let mut out = Vec::new();
    loop {
        let frames = tokio::time::timeout(WAIT, dealer.recv())
            .await
            .unwrap()
            .unwrap();
        match kinference_vllm::parse_replay(&frames).unwrap() {
            kinference_vllm::ReplayFrame::End => break,
            kinference_vllm::ReplayFrame::Batch { payload, .. } => {
                out.push(kinference_vllm::decode_batch(payload).unwrap());
            }
        }
    }
    out
}

fn stored(batches: &[KvEventBatch]) -> Vec<BlockStored> {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_aborts_and_frees_blocks() {
    // Real time: 10 ms steps, so a 1000-token request runs for 10 s unless aborted.
    let server = sim::start(config(1.0)).await;
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "stream": true});
    let mut resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", server.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    let running = |e: &kinference_sim::Engine| e.num_running() == 1;
    assert!(tokio::time::timeout(WAIT, server.wait_until(0, running))
        .await
        .unwrap());
    drop(resp);
    let idle = |e: &kinference_sim::Engine| {
        let pool = e.block_pool();
        e.num_running() == 0 && e.num_waiting() == 0 && pool.num_free() == pool.num_blocks() - 1
    };
    assert!(
        tokio::time::timeout(WAIT, server.wait_until(0, idle))
            .await
            .unwrap(),
        "the engine never dropped the abandoned request"
    );
    let (aborted, cached, generated) = server
        .inspect(|e| {
            let m = e.metrics();
            (
                m.requests_aborted,
                e.block_pool().cached_blocks().len(),
                m.generation_tokens,
            )
        })
        .await
        .unwrap();
    assert_eq!(aborted, 1);
    assert!(generated < 1000, "stopped early: {generated} tokens");
    assert!(cached > 0, "freed blocks stay cached, as in vLLM");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_share_the_prompt_blocks() {
    let mut cfg = config(1000.0);
    cfg.kv_events = Some(sim::events_on_port_zero());
    let server = sim::start(cfg).await;
    let ids = tokens(&server, PROMPT).await;
    let full = (ids.len() - 1) / 32;
    assert!(full >= 2);
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "n": 3});
    let (status, v) = post(&server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let texts: Vec<&str> = choices
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["finish_reason"], "length");
        assert_eq!(texts[i].split_whitespace().count(), 6);
    }
    assert!(
        texts[0] != texts[1] || texts[1] != texts[2],
        "choices are sampled apart"
    );
    assert_eq!(v["usage"]["prompt_tokens"], ids.len());
    assert_eq!(v["usage"]["completion_tokens"], 18);
    // The first child computes the prompt; the other two hit its blocks at admission.
    assert_eq!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"],
        full * 32,
        "vLLM reports the last child to finish"
    );
    let page = get_text(&server, "/metrics").await;
    let l = "{engine=\"0\",model_name=\"tiny\"}";
    assert_eq!(
        metric(&page, &format!("vllm:prefix_cache_queries_total{l}")),
        (3 * ids.len()) as f64
    );
    assert_eq!(
        metric(&page, &format!("vllm:prefix_cache_hits_total{l}")),
        (2 * full * 32) as f64
    );
    // Each prompt block is announced once.
    let hasher = BlockHasher::new(HashAlgo::Sha256, 32, None, ExtraKeysFormat::Tagged).unwrap();
    let chain: Vec<u64> = hasher
        .hash_blocks(&ids[..full * 32], &RequestExtras::default())
        .iter()
        .map(|d| d.event_hash().0)
        .collect();
    let announced: Vec<u64> = stored(&published(&server, 0).await)
        .iter()
        .flat_map(|s| s.block_hashes.iter().map(|h| h.block_hash().0))
        .collect();
    for h in &chain {
        assert_eq!(announced.iter().filter(|a| *a == h).count(), 1, "{h:x}");
    }

    // Streaming chat with n = 2: a role chunk per choice, both finish, usage counts both.
    let chat = json!({"model": "tiny", "max_tokens": 3, "n": 2, "stream": true,
                      "stream_options": {"include_usage": true},
                      "messages": [{"role": "user", "content": PROMPT}]});
    let chunks = post_stream(&server, "/v1/chat/completions", &chat, &[]).await;
    let roles: Vec<&Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"]["role"] == "assistant")
        .collect();
    assert_eq!(roles.len(), 2);
    for i in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["index"] == i && c["choices"][0]["delta"].get("role").is_none()
            })
            .collect();
        assert_eq!(mine.len(), 3, "three token chunks for choice {i}");
        assert_eq!(mine[2]["choices"][0]["finish_reason"], "length");
    }
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    server.shutdown();
}

/// The text `max_tokens` tokens of request id `rid` render to, from a request without stops.
async fn probe_text(server: &Server, rid: &str) -> String {
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 30});
    let (status, v) = post_with(server, "/v1/completions", &body, &[("X-Request-Id", rid)]).await;
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_truncate_and_finish_with_stop() {
    let server = sim::start(config(1000.0)).await;
    // The same request id gives the same pseudo-tokens, so the text is known in advance.
    let full = probe_text(&server, "stop-probe").await;
    let words: Vec<&str> = full.split(' ').filter(|w| !w.is_empty()).collect();
    assert_eq!(words.len(), 30);
    let stop = format!(" {}", words[10]);
    let at = full.find(&stop).unwrap();
    // Tokens up to the one that completed the stop string.
    let mut end = 0;
    let mut used = 0;
    for w in &words {
        end += w.len() + 1;
        used += 1;
        if end >= at + stop.len() {
            break;
        }
    }
    let rid = [("X-Request-Id", "stop-probe")];
    let body =
        json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 30, "stop": [stop, "never-there"]});
    let (status, v) = post_with(&server, "/v1/completions", &body, &rid).await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["text"], full[..at]);
    assert_eq!(c["finish_reason"], "stop");
    assert_eq!(c["stop_reason"], stop);
    assert_eq!(v["usage"]["completion_tokens"], used);

    let mut inc = body.clone();
    inc["stop"] = json!(stop);
    inc["include_stop_str_in_output"] = json!(true);
    let (_, v) = post_with(&server, "/v1/completions", &inc, &rid).await;
    assert_eq!(v["choices"][0]["text"], full[..at + stop.len()]);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = post_stream(&server, "/v1/completions", &streamed, &rid).await;
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(
        text,
        full[..at],
        "held-back text never leaks the stop string"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["stop_reason"], stop);

    let idle = |e: &kinference_sim::Engine| e.num_running() == 0;
    assert!(tokio::time::timeout(WAIT, server.wait_until(0, idle))
        .await
        .unwrap());
    let page = get_text(&server, "/metrics").await;
    let l = "engine=\"0\",model_name=\"tiny\"";
    assert_eq!(
        metric(
            &page,
            &format!("vllm:request_success_total{{{l},finished_reason=\"stop\"}}")
        ),
        3.0
    );
    assert_eq!(
        metric(
            &page,
            &format!("vllm:request_success_total{{{l},finished_reason=\"abort\"}}")
        ),
        0.0
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_in_openai_shapes() {
    let server = sim::start(config(1000.0)).await;
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "logprobs": 2});
    let (status, v) = post(&server, "/v1/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    let lp = &c["logprobs"];
    let toks: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(toks.len(), 4);
    assert_eq!(toks.concat(), c["text"].as_str().unwrap());
    let offsets: Vec<u64> = serde_json::from_value(lp["text_offset"].clone()).unwrap();
    let mut at = 0;
    for (o, t) in offsets.iter().zip(&toks) {
        assert_eq!(*o, at);
        at += t.len() as u64;
    }
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 2);
        let own = top[toks[i]].as_f64().unwrap();
        assert_eq!(own, lp["token_logprobs"][i].as_f64().unwrap());
        assert!(own <= 0.0);
        assert!(
            top.values().all(|x| x.as_f64().unwrap() <= own),
            "greedy: the sampled token leads"
        );
    }

    let chat = json!({"model": "tiny", "max_tokens": 3, "logprobs": true, "top_logprobs": 3,
                      "messages": [{"role": "user", "content": "Hello there"}]});
    let (status, v) = post(&server, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 3);
    for e in content {
        let token = e["token"].as_str().unwrap();
        let bytes: Vec<u8> = serde_json::from_value(e["bytes"].clone()).unwrap();
        assert_eq!(bytes, token.as_bytes());
        assert_eq!(e["top_logprobs"].as_array().unwrap().len(), 3);
        assert_eq!(e["top_logprobs"][0]["token"], token);
    }
    let mut plain = chat.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    plain.as_object_mut().unwrap().remove("top_logprobs");
    let (_, v) = post(&server, "/v1/chat/completions", &plain).await;
    assert_eq!(v["choices"][0]["logprobs"], Value::Null);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = post_stream(&server, "/v1/completions", &streamed, &[]).await;
    assert_eq!(chunks.len(), 4);
    for c in &chunks {
        assert_eq!(
            c["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            c["choices"][0]["logprobs"]["tokens"][0],
            c["choices"][0]["text"]
        );
    }
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_and_cache_salt_change_hashes_exactly_as_vllm_computes_them() {
    let mut cfg = config(1000.0);
    cfg.kv_events = Some(sim::events_on_port_zero());
    cfg.lora_modules = vec![
        LoraModule {
            name: "sql".into(),
            path: "/adapters/sql".into(),
            base_model_name: None,
        },
        LoraModule {
            name: "chat".into(),
            path: "/adapters/chat".into(),
            base_model_name: Some("base".into()),
        },
    ];
    let server = sim::start(cfg).await;
    let ids = tokens(&server, PROMPT).await;
    let full = (ids.len() - 1) / 32;
    let hasher = BlockHasher::new(HashAlgo::Sha256, 32, None, ExtraKeysFormat::Tagged).unwrap();
    let sql = Lora {
        name: "sql".into(),
        path: "/adapters/sql".into(),
    };
    let extras = |lora: Option<&Lora>, salt: Option<&str>| RequestExtras {
        lora: lora.cloned(),
        cache_salt: salt.map(str::to_owned),
        ..RequestExtras::default()
    };
    // (model, cache_salt, expected extras, expected lora_id)
    let cases = [
        ("sql", None, extras(Some(&sql), None), Some(1i64)),
        ("tiny", Some("s1"), extras(None, Some("s1")), None),
        ("sql", Some("s2"), extras(Some(&sql), Some("s2")), Some(1)),
        ("tiny", None, extras(None, None), None),
    ];
    for (model, salt, _, _) in &cases {
        let mut body = json!({"model": model, "prompt": PROMPT, "max_tokens": 1});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let (status, v) = post(&server, "/v1/completions", &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["model"], *model, "responses echo the adapter name");
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
            "{model} {salt:?}"
        );
    }
    let events = stored(&published(&server, 0).await);
    assert_eq!(
        events.len(),
        cases.len(),
        "one BlockStored per request: {events:?}"
    );
    let mut chains = Vec::new();
    for ((model, salt, ex, lora_id), ev) in cases.iter().zip(&events) {
        let want: Vec<u64> = hasher
            .hash_blocks(&ids[..full * 32], ex)
            .iter()
            .map(|d| d.event_hash().0)
            .collect();
        let got: Vec<u64> = ev.block_hashes.iter().map(|h| h.block_hash().0).collect();
        assert_eq!(got, want, "{model} {salt:?}");
        assert_eq!(ev.parent_block_hash, None);
        assert_eq!(ev.token_ids, ids[..full * 32]);
        assert_eq!(ev.lora_id, *lora_id, "{model}");
        let lora_name = (*model == "sql").then(|| "sql".to_owned());
        assert_eq!(ev.lora_name, lora_name);
        let keys: Vec<_> = (0..full).map(|i| hasher.event_extra_keys(i, ex)).collect();
        if keys.iter().all(Option::is_none) {
            assert!(ev
                .extra_keys
                .as_ref()
                .is_none_or(|k| k.iter().all(Option::is_none)));
        } else {
            assert_eq!(ev.extra_keys.as_ref(), Some(&keys), "{model} {salt:?}");
        }
        chains.push(got);
    }
    for i in 0..chains.len() {
        for j in i + 1..chains.len() {
            assert_ne!(
                chains[i][0], chains[j][0],
                "extras change every hash from block 0"
            );
        }
    }
    // The same extras hit; another salt under the same adapter does not.
    for (salt, hit) in [("s2", full * 32), ("s3", 0)] {
        let body = json!({"model": "sql", "prompt": PROMPT, "max_tokens": 1, "cache_salt": salt});
        let (_, v) = post(&server, "/v1/completions", &body).await;
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["cached_tokens"], hit,
            "salt {salt}"
        );
    }
    let models: Value = serde_json::from_str(&get_text(&server, "/v1/models").await).unwrap();
    let data = models["data"].as_array().unwrap();
    assert_eq!(data.len(), 3);
    assert_eq!(
        (&data[1]["id"], &data[1]["root"], &data[1]["parent"]),
        (&json!("sql"), &json!("/adapters/sql"), &json!("tiny"))
    );
    assert_eq!(data[2]["parent"], "base");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_vllm_error_bodies() {
    let server = sim::start(config(1000.0)).await;
    let long: Vec<u32> = vec![100; 2048];
    let cases: Vec<(Value, u16, &str)> = vec![
        (
            json!({"model": "tiny", "prompt": long}),
            400,
            "This model's maximum context length is 2048 tokens. However, your request has 2048 input tokens. Please reduce the length of the input messages.",
        ),
        (
            json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2046}),
            400,
            "'max_tokens' or 'max_completion_tokens' is too large: 2046. This model's maximum context length is 2048 tokens and your request has 3 input tokens (2046 > 2048 - 3).",
        ),
        (json!({"model": "nope", "prompt": "x"}), 404, "The model `nope` does not exist."),
        (json!({"prompt": "x", "n": 0}), 400, "n must be at least 1, got 0."),
        (
            json!({"prompt": "x", "cache_salt": ""}),
            400,
            "Parameter 'cache_salt' must be a non-empty string if provided.",
        ),
        (json!({"prompt": "x", "stop": 5}), 400, "`stop` must be a string or a list of strings"),
        (
            json!({"prompt": "x", "logprobs": 21}),
            400,
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (
            json!({"prompt": "x", "stream_options": {"include_usage": true}}),
            400,
            "Stream options can only be defined when `stream=True`.",
        ),
    ];
    for (body, status, message) in cases {
        let (got, v) = post(&server, "/v1/completions", &body).await;
        assert_eq!(got, status, "{body}: {v}");
        assert_eq!(v["error"]["message"], message, "{body}");
        assert_eq!(v["error"]["code"], status);
        let kind = if status == 404 {
            "NotFoundError"
        } else {
            "BadRequestError"
        };
        assert_eq!(v["error"]["type"], kind);
    }
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2});
    let (status, v) = post(&server, "/v1/chat/completions", &chat).await;
    assert_eq!(status, 400);
    assert_eq!(
        v["error"]["message"],
        "when using `top_logprobs`, `logprobs` must be set to true."
    );
    let (status, v) = post_with(
        &server,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 1}),
        &[("X-data-parallel-rank", "3")],
    )
    .await;
    assert_eq!(status, 400);
    assert_eq!(
        v["error"]["message"],
        "Requested DP rank 3 is out of range [0, 1)"
    );
    // Nothing was queued by any of them.
    let m = server.inspect(|e| e.metrics()).await.unwrap();
    assert_eq!(m.prefix_cache_queries, 0);
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_separate_engines_with_their_own_events() {
    let mut cfg = config(1.0);
    cfg.kv_events = Some(sim::events_on_port_zero());
    cfg.data_parallel_size = 2;
    let server = sim::start(cfg).await;
    assert_eq!(server.ranks(), vec![0, 1]);
    let eps = server.event_endpoints();
    let (e0, e1) = (eps[0].clone().unwrap(), eps[1].clone().unwrap());
    assert!(e0.binds && e1.binds);
    assert_ne!(e0.events, e1.events);
    assert_ne!(e0.replay, e1.replay);

    // The header pins a request to rank 1.
    let body = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 2});
    let (status, v) = post_with(
        &server,
        "/v1/completions",
        &body,
        &[("X-data-parallel-rank", "1")],
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let cached = |i| server.inspect_rank(i, |e| e.block_pool().cached_blocks().len());
    assert_eq!(cached(0).await, Some(0));
    assert!(cached(1).await.unwrap() > 0);
    let batches = published(&server, 1).await;
    assert!(!batches.is_empty());
    assert!(batches.iter().all(|b| b.data_parallel_rank == Some(1)));
    assert!(published(&server, 0).await.is_empty());
    // A header that is not an integer is ignored, as vLLM ignores it.
    let (status, _) = post_with(
        &server,
        "/v1/completions",
        &body,
        &[("X-data-parallel-rank", "one")],
    )
    .await;
    assert_eq!(status, 200);

    // Without the header, two requests in flight land on different ranks (least outstanding).
    let long = json!({"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "stream": true});
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut resp = reqwest::Client::new()
            .post(format!("http://{}/v1/completions", server.addr))
            .json(&long)
            .send()
            .await
            .unwrap();
        resp.chunk().await.unwrap().unwrap();
        open.push(resp);
    }
    for i in 0..2 {
        let one = |e: &kinference_sim::Engine| e.num_running() == 1;
        assert!(
            tokio::time::timeout(WAIT, server.wait_until(i, one))
                .await
                .unwrap(),
            "rank {i}"
        );
    }
    let page = get_text(&server, "/metrics").await;
    assert_eq!(
        page.matches("# TYPE vllm:num_requests_running gauge")
            .count(),
        1
    );
    for r in 0..2 {
        let series = format!("vllm:num_requests_running{{engine=\"{r}\",model_name=\"tiny\"}}");
        assert_eq!(metric(&page, &series), 1.0);
    }
    drop(open);
    let sources: Value =
        serde_json::from_str(&get_text(&server, "/kv_event_sources").await).unwrap();
    assert_eq!(sources["0"]["endpoint"].as_str(), Some(e0.events.as_str()));
    assert_eq!(sources["1"]["endpoint"].as_str(), Some(e1.events.as_str()));
    assert_eq!(
        sources["1"]["replay_endpoint"].as_str(),
        e1.replay.as_deref()
    );
    server.shutdown();
}

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    sim: SimArgs,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn command_line_starts_replicas_and_describes_them() {
    let tok = tokenizer_dir();
    let args = Cli::try_parse_from([
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--replicas",
        "2",
        "--data-parallel-size",
        "2",
        "--model",
        "tiny",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--block-size",
        "32",
        "--num-gpu-blocks",
        "80",
        "--speedup",
        "100",
        "--events-endpoint",
        "tcp://*:0",
        "--replay-endpoint",
        "tcp://*:0",
    ])
    .unwrap()
    .sim;
    let servers = cli::start(args.plans().unwrap()).await.unwrap();
    assert_eq!(servers.len(), 2);
    for (i, s) in servers.iter().enumerate() {
        let line = cli::describe(i, s);
        let field = |k: &str| {
            line.split(' ')
                .find_map(|f| f.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{k} missing: {line}"))
                .to_owned()
        };
        assert_eq!(field("replica"), i.to_string());
        assert_eq!(field("url"), format!("http://{}", s.addr));
        assert_eq!(field("dp_ranks"), "0,1");
        assert_eq!(field("events").split(',').count(), 2);
        assert_eq!(field("replay").split(',').count(), 2);
        let health = reqwest::get(format!("{}/health", field("url")))
            .await
            .unwrap();
        assert_eq!(health.status(), 200);
        let metrics = get_text(s, "/metrics").await;
        assert!(metrics.contains("num_gpu_blocks=\"80\""), "{metrics}");
    }
    // The replicas share one tokenizer (and its prefix cache): each gives the ids of the
    // other, and the second one's lookup of a text the first one cached is the same.
    let prompt =
        json!({"model": "tiny", "prompt": "One tokenizer for every replica of a process."});
    let (s0, t0) = post(&servers[0], "/tokenize", &prompt).await;
    let (s1, t1) = post(&servers[1], "/tokenize", &prompt).await;
    assert_eq!((s0, s1), (200, 200), "{t0} {t1}");
    assert!(t0["count"].as_u64().is_some_and(|n| n > 5), "{t0}");
    assert_eq!(t0["tokens"], t1["tokens"]);
    assert_ne!(servers[0].addr, servers[1].addr);
    for s in servers {
        s.shutdown();
    }
}
