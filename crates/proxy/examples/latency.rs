//! Sequential request latency over one keep-alive connection, for comparing a replica reached
//! directly with the same replica behind the router.
//!
//! ```sh
//! cargo run --release -p kinference-proxy --example latency -- \
//!     --url http://127.0.0.1:8101 --model sim --requests 2000 [--stream] [--chat] [--lines]
//! ```
//!
//! Prompts are one of 8 shared ~4,000-character prefixes plus a unique suffix; prints p50,
//! p90, p99 and the rate.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

struct Args {
    url: String,
    model: String,
    requests: usize,
    warmup: usize,
    max_tokens: u32,
    stream: bool,
    chat: bool,
    /// End each sentence of the shared prefix with a newline instead of a space.
    lines: bool,
}

fn args() -> Args {
    let mut a = Args {
        url: "http://127.0.0.1:8080".into(),
        model: "sim".into(),
        requests: 1000,
        warmup: 100,
        max_tokens: 8,
        stream: false,
        chat: false,
        lines: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().expect("a value after the flag");
        match flag.as_str() {
            "--url" => a.url = val(),
            "--model" => a.model = val(),
            "--requests" => a.requests = val().parse().unwrap(),
            "--warmup" => a.warmup = val().parse().unwrap(),
            "--max-tokens" => a.max_tokens = val().parse().unwrap(),
            "--stream" => a.stream = true,
            "--chat" => a.chat = true,
            "--lines" => a.lines = true,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

fn prefix(k: usize, lines: bool) -> String {
    let mut s = format!("Shared context {k}. ");
    while s.len() < 4000 {
        s.push_str("The router keeps a map from block hashes to the replicas that hold them.");
        s.push(if lines { '\n' } else { ' ' });
    }
    s
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = args();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1)
        .build(connector);
    let prefixes: Vec<String> = (0..8).map(|k| prefix(k, a.lines)).collect();
    let path = if a.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let mut times = Vec::with_capacity(a.requests);
    let started = Instant::now();
    for i in 0..a.warmup + a.requests {
        let text = format!("{} Request {i}.", prefixes[i % 8]);
        let body = if a.chat {
            serde_json::json!({"model": a.model, "max_tokens": a.max_tokens, "stream": a.stream,
                               "messages": [{"role": "user", "content": text}]})
        } else {
            serde_json::json!({"model": a.model, "prompt": text, "max_tokens": a.max_tokens,
                               "stream": a.stream})
        };
        let req = http::Request::post(format!("{}{path}", a.url))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(serde_json::to_vec(&body).unwrap())))
            .unwrap();
        let t0 = Instant::now();
        let resp = client.request(req).await.unwrap();
        assert!(resp.status().is_success(), "status {}", resp.status());
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let dt = t0.elapsed();
        assert!(!bytes.is_empty());
        if i >= a.warmup {
            times.push(dt);
        }
    }
    let wall = started.elapsed();
    times.sort();
    let pct = |p: f64| -> Duration { times[((times.len() - 1) as f64 * p) as usize] };
    println!(
        "{} requests to {}{path} (stream={}, max_tokens={}): p50 {:.3} ms  p90 {:.3} ms  p99 {:.3} ms  ({:.0} req/s incl. warmup)",
        times.len(),
        a.url,
        a.stream,
        a.max_tokens,
        pct(0.5).as_secs_f64() * 1e3,
        pct(0.9).as_secs_f64() * 1e3,
        pct(0.99).as_secs_f64() * 1e3,
        (a.warmup + a.requests) as f64 / wall.as_secs_f64(),
    );
}
