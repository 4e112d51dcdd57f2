//! Many simulated replicas whose publishers connect to one router endpoint (vLLM
//! `endpoint: tcp://ROUTER:PORT`, each with its own `topic`), started before the router binds:
//! the simulators serve at once, and once the router is up its index holds every replica's
//! blocks, each attributed by topic (the batches sent before the router listened come back
//! through each replica's replay socket).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kinference_events::socket::{SocketType, ZmqSocket};
use kinference_proxy::{Config, EventsSpec, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::{KvEventsConfig, Server};
use kinference_testkit::{loopback, metric, sim, tokenizer_dir, unused_port, WAIT};
use kinference_vllm::events::codec::encode_batch;
use kinference_vllm::{BlockStored, HashValue, KvEvent, KvEventBatch};
use serde_json::{json, Value};

const REPLICAS: usize = 3;

async fn complete(server: &Server, text: &str) {
    let url = format!("http://{}/v1/completions", server.addr);
    let body = json!({"model": "tiny", "prompt": text, "max_tokens": 3});
    let resp = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success());
}

async fn cached_blocks(server: &Server) -> usize {
    server
        .inspect(|e| e.block_pool().cached_blocks().len())
        .await
        .unwrap()
}

/// A publisher under a topic no replica has: counted on /metrics and listed on
/// /debug/replicas, applied nowhere.
async fn unknown_topics_are_reported(proxy: &Proxy, endpoint: &str) {
    let entries_before = index_entries(proxy).await;
    // An XPUB is a PUB on the wire that also shows when the subscription has arrived.
    let mut stranger = ZmqSocket::new(SocketType::XPUB).unwrap();
    stranger.connect(endpoint).unwrap();
    let sub = tokio::time::timeout(WAIT, stranger.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(sub[0].first(), Some(&1), "{sub:?}");
    let payload = encode_batch(&stored_batch());
    for seq in 0u64..3 {
        let frames: [&[u8]; 3] = [b"kv@stranger@tiny", &seq.to_be_bytes(), &payload];
        stranger.send(&frames).await.unwrap();
    }
    let series = format!(
        "kinference_event_endpoint_unknown_topic_messages_total{{endpoint=\"{endpoint}\",pool=\"tiny\"}}"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let page = get(proxy, "/metrics").await;
        if page.contains("kinference_event_endpoint_unknown_topic_messages")
            && metric(&page, &series) == 3.0
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never reached 3:\n{page}"
        );
        tokio::task::yield_now().await;
    }
    let replicas: Value = serde_json::from_str(&get(proxy, "/debug/replicas").await).unwrap();
    let ep = &replicas["pools"][0]["event_endpoints"][0];
    assert_eq!(ep["unknown_topics"]["kv@stranger@tiny"], 3, "{ep}");
    assert_eq!(ep["topics"].as_array().unwrap().len(), REPLICAS, "{ep}");
    assert_eq!(index_entries(proxy).await, entries_before);
}

fn stored_batch() -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![HashValue::Int(424_242)],
            token_ids: vec![1; 16],
            block_size: 16,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        })],
        data_parallel_rank: Some(0),
    }
}

async fn get(proxy: &Proxy, path: &str) -> String {
    let url = format!("http://{}{path}", proxy.admin_addr());
    reqwest::get(&url).await.unwrap().text().await.unwrap()
}

async fn index_entries(proxy: &Proxy) -> u64 {
    let replicas: Value = serde_json::from_str(&get(proxy, "/debug/replicas").await).unwrap();
    replicas["pools"][0]["index_entries"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_connecting_before_the_router_binds_are_indexed_by_topic() {
    let router_events = format!("tcp://127.0.0.1:{}", unused_port());
    let topic = |i: usize| format!("kv@replica-{i}@tiny");
    let mut sims = Vec::new();
    for i in 0..REPLICAS {
        let mut kv = KvEventsConfig::new(&router_events);
        kv.replay_endpoint = Some("tcp://*:0".into());
        kv.topic = topic(i);
        let mut cfg = sim::config("tiny", 256, 16, 1000.0);
        cfg.kv_events = Some(kv);
        let server = sim::start(cfg).await;
        // Served while nothing listens at the router's endpoint yet.
        let words = "one two three four five six seven eight nine ten ".repeat(4 + i);
        complete(&server, &format!("replica {i}: {words}")).await;
        sims.push(server);
    }

    let mut pool = PoolConfig::new("tiny", tokenizer_dir(), 16);
    for (i, s) in sims.iter().enumerate() {
        let mut r = ReplicaSpec::new(&format!("http://{}", s.addr));
        let replay = s.endpoints.as_ref().unwrap().replay.as_deref().unwrap();
        r.events = Some(EventsSpec {
            bind: Some(router_events.clone()),
            replay: Some(loopback(replay)),
            topic: topic(i),
            ..EventsSpec::default()
        });
        pool.replicas.push(r);
    }
    let mut cfg = Config::new(vec![pool]);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    let proxy = Proxy::start(cfg).await.unwrap();

    for (i, s) in sims.iter().enumerate() {
        // More traffic once the router is up, until a batch gets through: batches sent before
        // the publisher has reconnected and taken the subscription are dropped, as vLLM's
        // are; the first one received shows the gap, and replay brings back the rest.
        let url = format!("http://{}", s.addr);
        let deadline = tokio::time::Instant::now() + WAIT;
        for j in 0.. {
            assert!(
                tokio::time::Instant::now() < deadline,
                "replica {i}: no batch arrived"
            );
            complete(
                s,
                &format!("replica {i}, request {j}: {}", "eleven ".repeat(20)),
            )
            .await;
            let short = std::time::Duration::from_millis(200);
            if proxy
                .wait_for_events(&url, 0, short, |h| h.messages > 0)
                .await
                .is_ok()
            {
                break;
            }
        }
        assert!(s.events_published(0).await);
        let n = cached_blocks(s).await;
        assert!(n >= 4, "replica {i} caches {n} blocks");
        let mut last = None;
        let h = proxy
            .wait_for_events(&url, 0, WAIT, |h| {
                last = Some(h.clone());
                h.entries == n && !h.stale
            })
            .await
            .unwrap_or_else(|e| panic!("replica {i} ({n} blocks): {e}; {last:?}"));
        assert_eq!(h.decode_errors, 0, "{h:?}");
        // The batches of the request served before the router listened came by replay.
        assert!(h.replays_succeeded >= 1 && h.resets == 0, "{h:?}");
    }
    unknown_topics_are_reported(&proxy, &router_events).await;
    proxy.shutdown().await;
    for s in sims {
        s.shutdown();
    }
}
