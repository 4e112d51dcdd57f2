//! Live mode against two fake OpenAI replicas on loopback (port 0): streaming timing, usage,
//! the replicas' prefix-cache counters scraped before and after, per-replica imbalance, and
//! the cache reset between targets.
//!
//! The fake replica speaks just enough HTTP/1.1: one request per connection, the response
//! delimited by closing it. It keeps a prefix cache of 16-word blocks, so the hits it reports
//! (in `usage` and in `/metrics`) follow the workload's shared prefixes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use kinference_bench::live::{run_targets, LiveOptions, LiveTarget};
use kinference_bench::synth::SharedPrefix;
use kinference_bench::text::TextGen;
use kinference_bench::Arrivals;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct Replica {
    blocks: HashSet<Vec<String>>,
    queries: u64,
    hits: u64,
    requests: u64,
}

type Shared = Arc<Mutex<Replica>>;

async fn read_request(s: &mut TcpStream) -> (String, String) {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 65536];
    loop {
        let n = s.read(&mut tmp).await.unwrap();
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().unwrap())
            })
            .unwrap_or(0);
        if buf.len() >= end + 4 + len {
            let line = head.lines().next().unwrap().to_string();
            let body = String::from_utf8_lossy(&buf[end + 4..end + 4 + len]).to_string();
            return (line, body);
        }
    }
    (String::new(), String::new())
}

fn complete(r: &Shared, body: &str) -> (usize, usize, u64) {
    let v: Value = serde_json::from_str(body).unwrap();
    let words: Vec<String> = v["prompt"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    let mut rep = r.lock().unwrap();
    let blocks: Vec<Vec<String>> = (0..words.len() / 16)
        .map(|i| words[..(i + 1) * 16].to_vec())
        .collect();
    let hit = blocks
        .iter()
        .take_while(|b| rep.blocks.contains(*b))
        .count()
        * 16;
    rep.blocks.extend(blocks);
    rep.queries += words.len() as u64;
    rep.hits += hit as u64;
    rep.requests += 1;
    (words.len(), hit, v["max_tokens"].as_u64().unwrap())
}

async fn serve(mut s: TcpStream, r: Shared) {
    let (line, body) = read_request(&mut s).await;
    let mut out = String::new();
    if line.starts_with("POST /v1/completions") {
        let (prompt, cached, max_tokens) = complete(&r, &body);
        out.push_str(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
        );
        for _ in 0..max_tokens {
            out.push_str("data: {\"choices\":[{\"index\":0,\"text\":\" tok\"}]}\n\n");
        }
        out.push_str(&format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{max_tokens},\"prompt_tokens_details\":{{\"cached_tokens\":{cached}}}}}}}\n\ndata: [DONE]\n\n"
        ));
    } else if line.starts_with("GET /metrics") {
        let rep = r.lock().unwrap();
        let text = format!(
            "# TYPE vllm:prefix_cache_queries_total counter\n\
             vllm:prefix_cache_queries_total{{engine=\"0\"}} {}\n\
             vllm:prefix_cache_hits_total{{engine=\"0\"}} {}\n\
             vllm:request_success_total{{finished_reason=\"length\"}} {}\n",
            rep.queries, rep.hits, rep.requests
        );
        out.push_str(&format!(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        ));
    } else if line.starts_with("GET /v1/models") {
        let text = r#"{"object":"list","data":[{"id":"fake"}]}"#;
        out.push_str(&format!(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{text}",
            text.len()
        ));
    } else if line.starts_with("POST /reset_prefix_cache") {
        r.lock().unwrap().blocks.clear();
        out.push_str("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
    } else {
        out.push_str("HTTP/1.1 404 Not Found\r\nconnection: close\r\ncontent-length: 0\r\n\r\n");
    }
    let _ = s.write_all(out.as_bytes()).await;
    let _ = s.shutdown().await;
}

async fn start() -> (String, Shared) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let r: Shared = Arc::default();
    let r2 = r.clone();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else { return };
            tokio::spawn(serve(s, r2.clone()));
        }
    });
    (url, r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_run_times_requests_and_reads_replica_counters() {
    let (a, ra) = start().await;
    let (b, rb) = start().await;
    let w = SharedPrefix {
        requests: 40,
        groups: 2,
        prefix_tokens: 512,
        suffix_tokens: 64,
        output_tokens: 5,
        ..SharedPrefix::default()
    }
    .generate()
    .unwrap();
    let metrics = vec![format!("{a}/metrics"), format!("{b}/metrics")];
    let resets = vec![
        format!("{a}/reset_prefix_cache"),
        format!("{b}/reset_prefix_cache"),
    ];
    // Two targets: everything to replica A, then everything to replica B (each a stand-in for
    // a router); each starts from reset caches.
    let targets = vec![
        LiveTarget {
            name: "round-robin".into(),
            base_url: a.clone(),
            metrics_urls: metrics.clone(),
            reset_urls: resets.clone(),
        },
        LiveTarget {
            name: "direct-b".into(),
            base_url: format!("{b}/v1"),
            metrics_urls: metrics.clone(),
            reset_urls: resets.clone(),
        },
    ];
    let mut o = LiveOptions::new(TextGen::new(None).unwrap());
    o.arrivals = Arrivals::Concurrency(4);
    let mut calls = 0;
    let runs = run_targets(&w, &targets, &o, &mut |_| calls += 1)
        .await
        .unwrap();
    assert!(calls > 0);
    assert_eq!(runs.len(), 2);
    for run in &runs {
        let r = &run.result;
        assert_eq!(
            (r.requests, r.completed, r.failed),
            (40, 40, 0),
            "{}",
            r.policy
        );
        assert_eq!(r.hit_source, "replica metrics");
        assert_eq!(run.ttft_samples.len(), 40);
        assert!(r.itl_p50_s.is_some());
        assert_eq!(r.imbalance, Some(2.0));
        // 40 prompts of 576 words over 2 prefixes of 512: all but the first of each group hit
        // their 512-word prefix (whole 16-word blocks).
        assert_eq!(r.prompt_tokens, 40 * 576);
        assert_eq!(r.cached_tokens, 38 * 512);
        assert!(r.output_tok_s > 0.0);
    }
    assert_eq!(runs[0].result.per_replica_requests, vec![40, 0]);
    assert_eq!(runs[1].result.per_replica_requests, vec![0, 40]);
    assert_eq!(ra.lock().unwrap().requests, 40);
    assert_eq!(rb.lock().unwrap().requests, 40);
}

/// Open-loop pacing runs on tokio's clock: with the clock paused, ten arrivals at 2 per second
/// take 4.5 s of tokio time and no wall time to speak of.
#[tokio::test(start_paused = true)]
async fn open_loop_arrivals_follow_tokio_time() {
    let (a, _ra) = start().await;
    let mut w = SharedPrefix {
        requests: 10,
        groups: 1,
        prefix_tokens: 128,
        suffix_tokens: 64,
        output_tokens: 2,
        ..SharedPrefix::default()
    }
    .generate()
    .unwrap();
    let arrivals = Arrivals::Constant { rate: 2.0 };
    arrivals.apply(&mut w).unwrap();
    let target = LiveTarget {
        name: "a".into(),
        base_url: a.clone(),
        metrics_urls: vec![format!("{a}/metrics")],
        reset_urls: Vec::new(),
    };
    let mut o = LiveOptions::new(TextGen::new(None).unwrap());
    o.arrivals = arrivals;
    o.model = Some("fake".into());
    let t0 = tokio::time::Instant::now();
    let run = kinference_bench::live::run_target(&w, &target, &o, &mut |_| {})
        .await
        .unwrap();
    let took = t0.elapsed().as_secs_f64();
    assert_eq!(run.result.completed, 10);
    assert!((4.5..5.0).contains(&took), "{took}");
    assert!(run.result.hit_rate > 0.0);
}
