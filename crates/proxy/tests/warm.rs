//! Hot-prefix warming end to end: the router on port 0 in front of three recording replicas
//! (HTTP servers on port 0 that keep every completion body and hold client requests until
//! released, so that in-flight load builds up exactly). A request whose prefix is held by a
//! worker over the fair-share cap spreads; with `warm.mode` on, the prefix alone goes to the
//! planned worker as a one-token completion of its token ids, and with it off nothing does.
//! Nothing sleeps to wait: the tests await the replicas' records.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::routing::post;
use axum::{Json, Router};
use kinference_proxy::{Config, PoolConfig, Proxy, ReplicaSpec, WarmMode};
use kinference_testkit::{metric, tokenizer_dir, WAIT};
use kinference_tokenize::{CompletionRequest, Tokenizer};
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

const MODEL: &str = "tiny";
const BLOCK: u32 = 32;

/// What a recording replica saw.
#[derive(Clone)]
struct Seen {
    bodies: Arc<Mutex<Vec<Value>>>,
    /// Bumped on every record.
    count: watch::Sender<usize>,
    /// Client requests (not warms) are answered once this turns true.
    release: watch::Receiver<bool>,
}

async fn completions(State(s): State<Seen>, Json(body): Json<Value>) -> Json<Value> {
    let warm = body["max_tokens"] == 1;
    let prompt_tokens = body["prompt"].as_array().map_or(0, Vec::len);
    s.bodies.lock().push(body);
    s.count.send_modify(|c| *c += 1);
    if !warm {
        let mut release = s.release.clone();
        let _ = release.wait_for(|r| *r).await;
    }
    Json(json!({
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                  "total_tokens": prompt_tokens + 1,
                  "prompt_tokens_details": {"cached_tokens": 0}}
    }))
}

struct Replica {
    addr: SocketAddr,
    seen: Seen,
}

impl Replica {
    async fn start(release: watch::Receiver<bool>) -> Replica {
        let seen = Seen {
            bodies: Arc::default(),
            count: watch::channel(0).0,
            release,
        };
        let app = Router::new()
            .route("/v1/completions", post(completions))
            .with_state(seen.clone());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        Replica { addr, seen }
    }

    fn bodies(&self) -> Vec<Value> {
        self.seen.bodies.lock().clone()
    }

    fn clients(&self) -> usize {
        self.bodies()
            .iter()
            .filter(|b| b["max_tokens"] != 1)
            .count()
    }

    fn warms(&self) -> Vec<Value> {
        self.bodies()
            .into_iter()
            .filter(|b| b["max_tokens"] == 1)
            .collect()
    }
}

/// Waits until `done` holds over the replicas, re-checking on every record.
async fn wait_for(replicas: &[Replica], done: impl Fn(&[Replica]) -> bool) {
    let mut rxs: Vec<_> = replicas.iter().map(|r| r.seen.count.subscribe()).collect();
    tokio::time::timeout(WAIT, async {
        loop {
            if done(replicas) {
                return;
            }
            let changes = rxs.iter_mut().map(|rx| Box::pin(rx.changed()));
            let _ = futures_util::future::select_all(changes).await;
        }
    })
    .await
    .expect("the replicas never saw what was expected");
}

/// A long shared document and a question that differs per request.
fn prompt(question: &str) -> String {
    let mut s = String::from("Shared document. ");
    for i in 0..40 {
        s.push_str(&format!("Section {i} explains how blocks are hashed. "));
    }
    s.push_str(question);
    s
}

fn request(question: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt(question), "max_tokens": 8})
}

fn tokens(body: &Value) -> Vec<u32> {
    let tok = Tokenizer::from_dir(tokenizer_dir()).unwrap();
    let body = serde_json::to_vec(body).unwrap();
    let req = CompletionRequest::from_json(&body).unwrap();
    tok.encode_completion_request(&req)
        .unwrap()
        .into_iter()
        .next()
        .unwrap()
}

/// Three recording replicas behind a router that spreads as soon as one worker has a request
/// in flight (fair-share cap 1, no slack), with warming in `mode`.
async fn fleet(mode: WarmMode) -> (Vec<Replica>, watch::Sender<bool>, Proxy) {
    let (release, rx) = watch::channel(false);
    let mut replicas = Vec::new();
    for _ in 0..3 {
        replicas.push(Replica::start(rx.clone()).await);
    }
    let mut pool = PoolConfig::new(MODEL, tokenizer_dir(), BLOCK);
    pool.policy = kinference_proxy::parse_policy(
        "{kind: precise, speculative_ttl_ms: 60000, fair_share_cap: 1.0, fair_share_slack: 0}",
    )
    .unwrap();
    pool.replicas = replicas
        .iter()
        .map(|r| ReplicaSpec::new(&format!("http://{}", r.addr)))
        .collect();
    pool.warm.mode = mode;
    let mut cfg = Config::new(vec![pool]);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    // Load is the router's own in-flight count: the replicas have no /metrics.
    cfg.scrape.interval_ms = 0;
    let proxy = Proxy::start(cfg).await.unwrap();
    (replicas, release, proxy)
}

fn send(proxy: &Proxy, body: Value) -> tokio::task::JoinHandle<u16> {
    let addr = proxy.data_addr();
    tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("http://{addr}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    })
}

async fn metrics(proxy: &Proxy) -> String {
    let addr = proxy.admin_addr();
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Two requests sharing the document: the first held on its replica, the second spilled.
struct Spill {
    /// The replica holding the prefix (the first request in flight there).
    holder: usize,
    /// The replica the second request went to.
    spilled: usize,
    first: Value,
    second: Value,
    clients: Vec<tokio::task::JoinHandle<u16>>,
}

impl Spill {
    /// Every client request answered 200 (once released).
    async fn answered(self) {
        for c in self.clients {
            assert_eq!(c.await.unwrap(), 200);
        }
    }
}

async fn spill(replicas: &[Replica], proxy: &Proxy) -> Spill {
    let first = request("What is block 1?");
    let a = send(proxy, first.clone());
    wait_for(replicas, |rs| {
        rs.iter().map(Replica::clients).sum::<usize>() == 1
    })
    .await;
    let holder = replicas.iter().position(|r| r.clients() == 1).unwrap();
    let second = request("What is block 2?");
    let b = send(proxy, second.clone());
    wait_for(replicas, |rs| {
        rs.iter().map(Replica::clients).sum::<usize>() == 2
    })
    .await;
    let spilled = (0..replicas.len())
        .find(|&i| i != holder && replicas[i].clients() == 1)
        .expect("the second request went to the replica holding the first: no spread");
    Spill {
        holder,
        spilled,
        first,
        second,
        clients: vec![a, b],
    }
}

async fn warmed(mode: WarmMode) {
    let (replicas, release, proxy) = fleet(mode).await;
    let s = spill(&replicas, &proxy).await;
    let (holder, spilled) = (s.holder, s.spilled);
    wait_for(&replicas, |rs| rs.iter().any(|r| !r.warms().is_empty())).await;
    let at: Vec<usize> = (0..3)
        .filter(|&i| !replicas[i].warms().is_empty())
        .collect();
    let expected = match mode {
        WarmMode::Chosen => spilled,
        _ => (0..3).find(|&i| i != holder && i != spilled).unwrap(),
    };
    assert_eq!(at, vec![expected], "holder {holder}, spilled {spilled}");
    let warms = replicas[expected].warms();
    assert_eq!(warms.len(), 1, "{warms:?}");
    let warm = &warms[0];
    assert_eq!(warm["model"], MODEL);
    assert_eq!(warm["max_tokens"], 1);
    assert_eq!(warm["stream"], false);
    assert!(warm.get("priority").is_none(), "{warm}");
    // The prompt is the hot prefix: the full blocks the two prompts share, as token ids.
    let (t1, t2) = (tokens(&s.first), tokens(&s.second));
    let common = t1.iter().zip(&t2).take_while(|(a, b)| a == b).count();
    let hot = common / BLOCK as usize * BLOCK as usize;
    assert!(
        hot >= 4 * BLOCK as usize,
        "prefix too short: {common} tokens"
    );
    let sent: Vec<u32> = serde_json::from_value(warm["prompt"].clone()).unwrap();
    assert_eq!(sent, t2[..hot].to_vec());
    let text = metrics(&proxy).await;
    assert_eq!(
        metric(&text, "kinference_warms_sent_total{pool=\"tiny\"}"),
        1.0
    );
    assert_eq!(
        metric(&text, "kinference_warm_prompt_tokens_total{pool=\"tiny\"}"),
        hot as f64
    );
    release.send_replace(true);
    s.answered().await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spilled_hot_prefix_is_warmed_on_the_next_worker() {
    warmed(WarmMode::Next).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spilled_hot_prefix_is_warmed_on_the_spill_target() {
    warmed(WarmMode::Chosen).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_is_warmed_when_warming_is_off() {
    let (replicas, release, proxy) = fleet(WarmMode::Off).await;
    let s = spill(&replicas, &proxy).await;
    // A warm is counted before the spilled request is forwarded: by now it would show.
    let text = metrics(&proxy).await;
    assert!(
        text.contains("reason=\"prefix_spread\""),
        "no spread: {text}"
    );
    assert!(!text.contains("kinference_warms_sent_total{"), "{text}");
    assert!(replicas.iter().all(|r| r.warms().is_empty()));
    release.send_replace(true);
    s.answered().await;
    proxy.shutdown().await;
}
