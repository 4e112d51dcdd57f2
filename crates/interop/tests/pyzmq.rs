//! KV events against libzmq itself (pyzmq, `scripts/pyzmq_peer.py`), both directions and both
//! socket roles: a pyzmq publisher sending vLLM's frames into our subscriber, and a pyzmq
//! subscriber decoding the simulator's batches (with vLLM's own msgspec classes when the peer
//! runs in vLLM's venv).
//!
//! The peer's interpreter is `KINFERENCE_ZMQ_PY` (`scripts/zmq-interop.sh` installs a pinned
//! pyzmq and sets it). Without it every test here skips with a message, unless
//! `KINFERENCE_ZMQ_PY_REQUIRED=1` (CI), which turns a missing peer into a failure.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use kinference_events::{DpRank, EventPlane, EventPlaneConfig, ReplicaId, WorkerConfig};
use kinference_interop::fetch_replay;
use kinference_sim_server::{KvEventsConfig, Server};
use kinference_testkit::{loopback, sim, unused_port, WAIT};
use kinference_vllm::{BlockHash, HashValue, KvEvent, KvEventBatch, Tier};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

const TOPIC: &str = "kv@127.0.0.1@tiny";

/// How long the peer may take to say "ready": importing vLLM (for its msgspec classes) takes
/// most of a minute on a busy two-core machine.
const PEER_START: Duration = Duration::from_secs(240);

/// The peer's Python, or `None` (skip) when it is not configured and not required.
fn python() -> Option<PathBuf> {
    let required = std::env::var("KINFERENCE_ZMQ_PY_REQUIRED").is_ok_and(|v| v == "1");
    let py = std::env::var_os("KINFERENCE_ZMQ_PY").map(PathBuf::from);
    match py {
        Some(p) if p.exists() => Some(p),
        other => {
            let why = match other {
                Some(p) => format!("KINFERENCE_ZMQ_PY={} does not exist", p.display()),
                None => "KINFERENCE_ZMQ_PY is not set".to_owned(),
            };
            assert!(!required, "the pyzmq peer is required: {why}");
            eprintln!("SKIPPED: no pyzmq peer ({why}); run scripts/zmq-interop.sh");
            None
        }
    }
}

/// A running `pyzmq_peer.py`.
struct Peer {
    child: Child,
    stdin: ChildStdin,
    lines: Lines<BufReader<ChildStdout>>,
    /// The endpoint it bound (or dialled).
    endpoint: String,
}

impl Peer {
    async fn start(py: &PathBuf, args: &[&str]) -> Peer {
        let script = kinference_testkit::repo_root().join("scripts/pyzmq_peer.py");
        let mut child = Command::new(py)
            .arg(script)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start the pyzmq peer: {e}"));
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let mut peer = Peer {
            child,
            stdin,
            lines: BufReader::new(stdout).lines(),
            endpoint: String::new(),
        };
        let first = peer.line(PEER_START).await.expect("the peer said nothing");
        peer.endpoint = first
            .strip_prefix("ready ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_owned();
        peer
    }

    /// The next stdout line, `None` after `within` without one.
    async fn line(&mut self, within: Duration) -> Option<String> {
        match tokio::time::timeout(within, self.lines.next_line()).await {
            Ok(Ok(Some(l))) => Some(l),
            Ok(Ok(None)) => panic!("the peer exited: {:?}", self.child.try_wait()),
            Ok(Err(e)) => panic!("reading the peer: {e}"),
            Err(_) => None,
        }
    }

    async fn stop(mut self) {
        let _ = self.stdin.write_all(b"quit\n").await;
        let _ = tokio::time::timeout(WAIT, self.child.wait()).await;
    }
}

fn hash_json(h: &HashValue) -> Value {
    match h {
        HashValue::Int(i) => json!(i),
        HashValue::Bytes(b) => json!(b.iter().map(|x| format!("{x:02x}")).collect::<String>()),
    }
}

/// A batch in the peer's JSON form (the fields both decoders report).
fn batch_json(batch: &KvEventBatch) -> Value {
    let events: Vec<Value> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => json!({
                "type": "BlockStored",
                "block_hashes": s.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "parent_block_hash": s.parent_block_hash.as_ref().map(hash_json),
                "token_ids": s.token_ids,
                "block_size": s.block_size,
                "medium": s.medium,
            }),
            KvEvent::BlockRemoved(r) => json!({
                "type": "BlockRemoved",
                "block_hashes": r.block_hashes.iter().map(hash_json).collect::<Vec<_>>(),
                "medium": r.medium,
            }),
            KvEvent::AllBlocksCleared => json!({"type": "AllBlocksCleared"}),
        })
        .collect();
    Value::from(events)
}

// --- a pyzmq publisher into our subscriber -------------------------------------------------

async fn expect_blocks(plane: &EventPlane, worker: kinference_events::WorkerId, base: u64, n: u64) {
    let health = plane
        .wait_for(worker, WAIT, |h| h.entries == n as usize)
        .await
        .unwrap_or_else(|e| panic!("the index never held {n} blocks: {e}"));
    assert_eq!(health.decode_errors, 0, "{health:?}");
    let index = plane.index();
    let index = index.read();
    for h in base..base + n {
        assert!(
            index.holds(worker, BlockHash(h), Tier::Gpu),
            "block {h} missing"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pyzmq_publisher_that_binds_feeds_our_connecting_subscriber() {
    let Some(py) = python() else { return };
    let (base, n) = (1000, 20);
    let args = [
        "pub",
        "--bind",
        "--endpoint",
        "tcp://127.0.0.1:*",
        "--topic",
        TOPIC,
        "--count",
        "20",
        "--hash-base",
        "1000",
    ];
    let mut peer = Peer::start(&py, &args).await;
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let worker = plane
        .add_worker(
            WorkerConfig::connect(ReplicaId(1), DpRank(0), &peer.endpoint).with_topic(TOPIC),
        )
        .await
        .unwrap();
    expect_blocks(&plane, worker, base, n).await;
    assert_eq!(peer.line(WAIT).await.as_deref(), Some("sent 20"));
    peer.stop().await;
    plane.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pyzmq_publisher_that_connects_feeds_our_bound_subscriber() {
    let Some(py) = python() else { return };
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let worker = plane
        .add_worker(
            WorkerConfig::bind(ReplicaId(2), DpRank(0), "tcp://127.0.0.1:0").with_topic(TOPIC),
        )
        .await
        .unwrap();
    let bound = plane.health(worker).unwrap().local_endpoint.unwrap();
    let args = [
        "pub",
        "--connect",
        "--endpoint",
        &bound,
        "--topic",
        TOPIC,
        "--count",
        "20",
        "--hash-base",
        "5000",
    ];
    let peer = Peer::start(&py, &args).await;
    expect_blocks(&plane, worker, 5000, 20).await;
    peer.stop().await;
    plane.shutdown().await;
}

// --- the simulator's publisher into a pyzmq subscriber ---------------------------------------

async fn complete(server: &Server, i: usize) {
    let url = format!("http://{}/v1/completions", server.addr);
    let prompt =
        format!("request {i}: the router keeps a map from block hashes to replicas; ").repeat(4);
    let body = json!({"model": "tiny", "prompt": prompt, "max_tokens": 2});
    let resp = reqwest::Client::new()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(
        resp.status().is_success(),
        "{}",
        resp.text().await.unwrap_or_default()
    );
}

fn sim_config(events: &str) -> kinference_sim_server::ServerConfig {
    let mut kv = KvEventsConfig::new(events);
    kv.replay_endpoint = Some("tcp://*:0".into());
    kv.topic = TOPIC.into();
    let mut cfg = sim::config("tiny", 256, 16, 1000.0);
    cfg.kv_events = Some(kv);
    cfg
}

/// Drives requests until the peer has received a batch (the subscription has reached the
/// publisher; earlier batches are dropped, as vLLM's are), then more; checks that the peer
/// decoded every batch from its first one on, exactly as the replay log holds it.
async fn peer_decodes_every_batch(server: &Server, peer: &mut Peer) {
    let mut got: Vec<Value> = Vec::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut i = 0;
    while got.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the peer never got a batch"
        );
        complete(server, i).await;
        i += 1;
        while let Some(l) = peer.line(Duration::from_millis(200)).await {
            got.push(serde_json::from_str(&l).unwrap());
        }
    }
    for j in 0..5 {
        complete(server, 1000 + j).await;
    }
    assert!(server.events_published(0).await);
    let replay = loopback(
        server
            .endpoints
            .as_ref()
            .unwrap()
            .replay
            .as_deref()
            .unwrap(),
    );
    let log = fetch_replay(&replay, 0, WAIT).await.unwrap();
    let last = log.last().unwrap().seq;
    while got.last().and_then(|v| v["seq"].as_u64()) != Some(last) {
        let l = peer.line(WAIT).await.expect("the peer stopped receiving");
        got.push(serde_json::from_str(&l).unwrap());
    }
    let first = got[0]["seq"].as_u64().unwrap();
    let expected: Vec<_> = log.iter().filter(|b| b.seq >= first).collect();
    assert_eq!(
        got.len(),
        expected.len(),
        "a batch was lost after the first"
    );
    assert!(expected.len() >= 5, "{expected:?}");
    for (ours, theirs) in expected.iter().zip(&got) {
        assert_eq!(theirs["seq"].as_u64(), Some(ours.seq));
        assert_eq!(theirs["topic"], TOPIC);
        assert_eq!(
            theirs["events"],
            batch_json(&ours.batch),
            "seq {}",
            ours.seq
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connecting_simulator_serves_at_once_and_reaches_a_pyzmq_subscriber_bound_later() {
    let Some(py) = python() else { return };
    // vLLM's rule: a non-wildcard endpoint connects. Nothing listens there yet.
    let port = unused_port();
    let server = sim::start(sim_config(&format!("tcp://127.0.0.1:{port}"))).await;
    complete(&server, 0).await; // serves before any subscriber exists
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let args = ["sub", "--bind", "--endpoint", &endpoint, "--topic", TOPIC];
    let mut peer = Peer::start(&py, &args).await;
    peer_decodes_every_batch(&server, &mut peer).await;
    peer.stop().await;
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pyzmq_subscriber_that_connects_decodes_a_binding_simulator() {
    let Some(py) = python() else { return };
    let server = sim::start(sim_config("tcp://*:0")).await;
    let events = loopback(
        server
            .endpoints
            .as_ref()
            .unwrap()
            .events
            .as_deref()
            .unwrap(),
    );
    let args = ["sub", "--connect", "--endpoint", &events, "--topic", TOPIC];
    let mut peer = Peer::start(&py, &args).await;
    peer_decodes_every_batch(&server, &mut peer).await;
    peer.stop().await;
    server.shutdown();
}

// --- many pyzmq publishers connecting to one bound endpoint ----------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pyzmq_publishers_sharing_one_bound_endpoint_are_told_apart_by_topic() {
    let Some(py) = python() else { return };
    let plane = EventPlane::start(EventPlaneConfig::default()).unwrap();
    let endpoint = format!("tcp://127.0.0.1:{}", unused_port());
    let topic = |i: u32| format!("kv@10.0.0.{i}@tiny");
    let mut workers = Vec::new();
    for i in 0..3 {
        let cfg = WorkerConfig::bind(ReplicaId(10 + i), DpRank(0), &endpoint).with_topic(&topic(i));
        workers.push(plane.add_worker(cfg).await.unwrap());
    }
    let mut peers = Vec::new();
    for (i, n) in [(0u32, 5u64), (1, 7), (2, 9), (9, 4)] {
        let (t, count, base) = (topic(i), n.to_string(), (10_000 * (i + 1)).to_string());
        let args = [
            "pub",
            "--connect",
            "--endpoint",
            &endpoint,
            "--topic",
            &t,
            "--count",
            &count,
            "--hash-base",
            &base,
        ];
        peers.push(Peer::start(&py, &args).await);
    }
    for (i, w) in workers.iter().enumerate() {
        let n = [5, 7, 9][i];
        expect_blocks(&plane, *w, 10_000 * (i as u64 + 1), n).await;
    }
    // Topic 9 belongs to no replica: its 4 batches are counted, reported and applied nowhere.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let b = plane.bound_endpoints();
        if b[0].unknown_messages == 4 {
            assert_eq!(b[0].unknown_topics.get(&topic(9)), Some(&4));
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{b:?}");
        tokio::task::yield_now().await;
    }
    assert_eq!(plane.index().read().len(), 5 + 7 + 9);
    for p in peers {
        p.stop().await;
    }
    plane.shutdown().await;
}
