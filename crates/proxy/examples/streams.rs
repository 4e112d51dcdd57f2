//! Holds many streamed completions open through a router at once and reports how each ended:
//! the load side of `scripts/streams.sh` (router memory and CPU per open stream).
//!
//! ```sh
//! cargo run --release -p kinference-proxy --example streams -- \
//!     --addr 127.0.0.1:8080 --model tiny --streams 10000 [--h2-connections 40] [--max-tokens 16]
//! ```
//!
//! Over HTTP/1.1 every stream has a connection of its own; with `--h2-connections C` the
//! streams are spread over C HTTP/2 connections (prior knowledge, as the router accepts h2c).
//! Prints `open N` on stdout once every stream has its response head (the caller samples the
//! router then: all N are in flight, none has ended, since a stream ends only after its last
//! token), then one JSON line with the outcome: streams that ended with `data: [DONE]`, those
//! cut or refused, the chunks read, and the seconds until all were open and until all ended.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper::Request;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;
use tokio::sync::Notify;

struct Args {
    addr: SocketAddr,
    model: String,
    streams: usize,
    h2_connections: usize,
    max_tokens: u32,
}

fn args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8080".parse().unwrap(),
        model: "tiny".into(),
        streams: 10_000,
        h2_connections: 0,
        max_tokens: 16,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().expect("a value after the flag");
        match flag.as_str() {
            "--addr" => a.addr = val().parse().unwrap(),
            "--model" => a.model = val(),
            "--streams" => a.streams = val().parse().unwrap(),
            "--h2-connections" => a.h2_connections = val().parse().unwrap(),
            "--max-tokens" => a.max_tokens = val().parse().unwrap(),
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// How one stream ended.
#[derive(Debug)]
enum End {
    /// Status 200 and the body ended with `data: [DONE]`.
    Done { chunks: usize },
    /// A status other than 200.
    Status(u16),
    /// The body ended or broke without `[DONE]`.
    Cut,
    /// No connection, or the request could not be sent.
    Failed,
}

fn request(a: &Args, i: usize) -> Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": a.model,
        "prompt": format!("Stream {i}: tell a long story about routers and caches."),
        "max_tokens": a.max_tokens,
        "stream": true,
    })
    .to_string();
    Request::post("/v1/completions")
        .header("host", a.addr.to_string())
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

/// How far the streams got: each is settled once, at its response head or at its failure.
struct Progress {
    n: usize,
    settled: AtomicUsize,
    heads: AtomicUsize,
    all_settled: Notify,
}

impl Progress {
    fn settle(&self, head: bool) {
        if head {
            self.heads.fetch_add(1, Ordering::SeqCst);
        }
        if self.settled.fetch_add(1, Ordering::SeqCst) + 1 == self.n {
            self.all_settled.notify_one();
        }
    }
}

/// Awaits the response head of a sent request, then reads the body to its end.
async fn finish(
    sent: impl std::future::Future<Output = hyper::Result<hyper::Response<hyper::body::Incoming>>>,
    progress: &Progress,
) -> End {
    let Ok(resp) = sent.await else {
        progress.settle(false);
        return End::Failed;
    };
    progress.settle(true);
    let status = resp.status().as_u16();
    if status != 200 {
        return End::Status(status);
    }
    let mut body = resp.into_body();
    let mut chunks = 0;
    let mut tail = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return End::Cut;
        };
        if let Ok(data) = frame.into_data() {
            chunks += 1;
            tail.extend_from_slice(&data);
            if tail.len() > 64 {
                tail.drain(..tail.len() - 64);
            }
        }
    }
    if String::from_utf8_lossy(&tail)
        .trim_end()
        .ends_with("data: [DONE]")
    {
        End::Done { chunks }
    } else {
        End::Cut
    }
}

/// One stream on a connection of its own (HTTP/1.1).
async fn h1_stream(a: Arc<Args>, i: usize, progress: Arc<Progress>) -> End {
    let handshake = async {
        let tcp = TcpStream::connect(a.addr).await.ok()?;
        http1::handshake(TokioIo::new(tcp)).await.ok()
    };
    let Some((mut send, conn)) = handshake.await else {
        progress.settle(false);
        return End::Failed;
    };
    tokio::spawn(conn);
    finish(send.send_request(request(&a, i)), &progress).await
}

/// The streams `i ≡ c (mod C)` on HTTP/2 connection `c`.
async fn h2_connection(a: Arc<Args>, c: usize, progress: Arc<Progress>) -> Vec<End> {
    let mine: Vec<usize> = (c..a.streams).step_by(a.h2_connections).collect();
    let handshake = async {
        let tcp = TcpStream::connect(a.addr).await.ok()?;
        http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .ok()
    };
    let Some((send, conn)) = handshake.await else {
        return mine
            .iter()
            .map(|_| {
                progress.settle(false);
                End::Failed
            })
            .collect();
    };
    tokio::spawn(conn);
    let streams = mine.into_iter().map(|i| {
        let (a, progress, mut send) = (a.clone(), progress.clone(), send.clone());
        tokio::spawn(async move {
            if send.ready().await.is_err() {
                progress.settle(false);
                return End::Failed;
            }
            finish(send.send_request(request(&a, i)), &progress).await
        })
    });
    let mut ends = Vec::new();
    for s in streams.collect::<Vec<_>>() {
        ends.push(s.await.expect("stream task"));
    }
    ends
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = Arc::new(args());
    let progress = Arc::new(Progress {
        n: a.streams,
        settled: AtomicUsize::new(0),
        heads: AtomicUsize::new(0),
        all_settled: Notify::new(),
    });
    let t0 = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    if a.h2_connections == 0 {
        for i in 0..a.streams {
            let (a, p) = (a.clone(), progress.clone());
            tasks.spawn(async move { vec![h1_stream(a, i, p).await] });
        }
    } else {
        for c in 0..a.h2_connections {
            tasks.spawn(h2_connection(a.clone(), c, progress.clone()));
        }
    }
    progress.all_settled.notified().await;
    let heads = progress.heads.load(Ordering::SeqCst);
    // The caller samples the router on this line.
    println!("open {heads}");
    let open_secs = t0.elapsed().as_secs_f64();
    let mut ends: BTreeMap<&str, usize> = BTreeMap::new();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    let mut chunks = 0;
    while let Some(batch) = tasks.join_next().await {
        for end in batch.expect("connection task") {
            let kind = match end {
                End::Done { chunks: c } => {
                    chunks += c;
                    "done"
                }
                End::Status(s) => {
                    *statuses.entry(s).or_default() += 1;
                    "status"
                }
                End::Cut => "cut",
                End::Failed => "failed",
            };
            *ends.entry(kind).or_default() += 1;
        }
    }
    let out = serde_json::json!({
        "streams": a.streams,
        "h2_connections": a.h2_connections,
        "heads": heads,
        "ends": ends,
        "statuses": statuses,
        "chunks": chunks,
        "all_open_secs": open_secs,
        "secs": t0.elapsed().as_secs_f64(),
    });
    println!("{out}");
}
