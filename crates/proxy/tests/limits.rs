//! The router under hostile or excessive clients (issue 16): stalled request heads are closed
//! while other clients are served, the connection cap pauses accepting and resumes, a burst
//! beyond `max_in_flight` and its queue is shed with 429 + Retry-After while the admitted
//! requests complete, a replica at `max_in_flight_per_replica` is passed over (and a fleet
//! of full ones queues, then sheds), a pool with no replica answering gets 503 + Retry-After,
//! an HTTP/2 client that stops answering PINGs is disconnected, the admin port's token is
//! enforced, and speculative entries follow the outcome of the request they were guessed for.
//! The data port's own HTTP/1.1 path serves bodies in pieces, pipelined requests and bodies
//! left unread, and hands a connection to hyper at its first request it does not serve, with
//! the same answers. Nothing sleeps to wait: tests wait on sockets
//! closing, responses arriving, or the router's state.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use kinference_proxy::api::ExplainResponse;
use kinference_proxy::{AdminToken, Config, PoolConfig, Proxy, ReplicaSpec};
use kinference_testkit::{metric, tokenizer_dir, WAIT};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

const MODEL: &str = "tiny";

/// A replica that reads each request whole (head and `content-length` body) and answers
/// `status` with a small JSON body, on kept-alive connections; while `hold` is true it waits
/// before answering.
async fn replica(status: u16, hold: watch::Receiver<bool>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    serve_replica(l, status, hold);
    addr
}

/// [`replica`] on a listener already bound. `GET /metrics` is answered at once with an empty
/// page (a scrape sees a healthy replica with no load), whatever `hold` says.
fn serve_replica(l: TcpListener, status: u16, hold: watch::Receiver<bool>) {
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            let mut hold = hold.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                loop {
                    let Some(end) = read_request(&mut sock, &mut buf).await else {
                        return;
                    };
                    let scrape = buf.starts_with(b"GET /metrics ");
                    buf.drain(..end);
                    if scrape {
                        let resp = "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if sock.write_all(resp.as_bytes()).await.is_err() {
                            return;
                        }
                        continue;
                    }
                    if hold.wait_for(|h| !*h).await.is_err() {
                        return;
                    }
                    let body = r#"{"id":"x","object":"text_completion","choices":[]}"#;
                    let reason = if status == 200 { "OK" } else { "Busy" };
                    let resp = format!(
                        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if sock.write_all(resp.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
}

/// Reads one request into `buf`; the length of its head and body, or `None` at EOF.
async fn read_request(sock: &mut TcpStream, buf: &mut Vec<u8>) -> Option<usize> {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(h) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..h]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= h + 4 + len {
                return Some(h + 4 + len);
            }
        }
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

fn open() -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    // Never held: the sender may go.
    std::mem::forget(tx);
    rx
}

fn config(replicas: &[SocketAddr], policy: &str) -> Config {
    let mut pool = PoolConfig::new(MODEL, tokenizer_dir(), 32);
    pool.policy = kinference_proxy::parse_policy(policy).unwrap();
    pool.replicas = replicas
        .iter()
        .map(|a| ReplicaSpec::new(&format!("http://{a}")))
        .collect();
    let mut c = Config::new(vec![pool]);
    c.listen = "127.0.0.1:0".into();
    c.admin = "127.0.0.1:0".into();
    c.scrape.interval_ms = 0;
    c.expose_endpoint_header = true;
    c
}

/// One HTTP/1.1 request on a fresh connection; (status, headers in lower case, body).
async fn request(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    request_on(&mut s, method, path, body, true).await
}

/// One request on `s`; with `close`, asks the router to close the connection after it.
async fn request_on(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    body: &str,
    close: bool,
) -> (u16, String, String) {
    request_with(s, method, path, body, close, "").await
}

/// [`request_on`] with `extra` header lines (each ending in `\r\n`).
async fn request_with(
    s: &mut TcpStream,
    method: &str,
    path: &str,
    body: &str,
    close: bool,
    extra: &str,
) -> (u16, String, String) {
    let conn = if close { "close" } else { "keep-alive" };
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: {conn}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    read_response(s, &mut Vec::new()).await
}

/// Reads one response with a `content-length` body from `s`, bytes past it left in `buf`.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> (u16, String, String) {
    let mut chunk = [0u8; 8192];
    loop {
        if let Some(h) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..h]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if buf.len() >= h + 4 + len {
                let status = head[9..12].parse().unwrap();
                let body = String::from_utf8_lossy(&buf[h + 4..h + 4 + len]).into_owned();
                buf.drain(..h + 4 + len);
                return (status, head, body);
            }
        }
        let n = s.read(&mut chunk).await.unwrap();
        assert!(n > 0, "connection closed before a whole response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn metrics_page(proxy: &Proxy) -> String {
    let (status, _, body) = request(proxy.admin_addr(), "GET", "/metrics", "").await;
    assert_eq!(status, 200, "{body}");
    body
}

/// The data port's client timeouts of `kind` counted on `page`.
fn data_timeouts(page: &str, kind: &str) -> f64 {
    metric(
        page,
        &format!(r#"kinference_client_timeouts_total{{port="data",kind="{kind}"}}"#),
    )
}

/// `GET /health` answered 200 on `s`, which stays open.
async fn health_on(s: &mut TcpStream) {
    let (status, _, body) = request_on(s, "GET", "/health", "", false).await;
    assert_eq!(status, 200, "{body}");
}

/// A connection to `addr` with one request answered on it, kept alive.
async fn kept_alive(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    health_on(&mut s).await;
    s
}

/// Waits until `n` requests wait in pool `tiny`'s queue; panics after `WAIT`.
async fn wait_queued(proxy: &Proxy, n: f64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let page = metrics_page(proxy).await;
        let queued = metric(&page, r#"kinference_queued_requests{pool="tiny"}"#);
        if queued == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queued} queued, not {n}, after {WAIT:?}"
        );
        tokio::task::yield_now().await;
    }
}

/// Reads until the router closes `s`; panics if it sends anything or stays open past `WAIT`.
async fn closed_by_router(mut s: TcpStream) {
    let mut b = [0u8; 64];
    let r = tokio::time::timeout(WAIT, s.read(&mut b))
        .await
        .expect("the router never closed the connection");
    match r {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("expected the connection closed, got {other:?}"),
    }
}

/// The names of a response head's header lines, sorted, without the status line and `date`'s
/// value: what the fast path and hyper must agree on.
fn header_names(head: &str) -> Vec<String> {
    let mut names: Vec<String> = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.to_string()))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_carries_split_pipelined_unread_and_handed_over_requests() {
    let ok = replica(200, open()).await;
    let proxy = Proxy::start(config(&[ok], "least-load")).await.unwrap();
    let mut s = TcpStream::connect(proxy.data_addr()).await.unwrap();
    let body = r#"{"model":"tiny","prompt":"hello there"}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut buf = Vec::new();

    // A head first, its body after.
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(&body.as_bytes()[..7]).await.unwrap();
    tokio::task::yield_now().await;
    s.write_all(&body.as_bytes()[7..]).await.unwrap();
    let (status, lean_head, text) = read_response(&mut s, &mut buf).await;
    assert_eq!(status, 200, "{text}");
    assert!(lean_head.contains("\r\ndate: "), "{lean_head}");

    // The rest of a body read apart from its head, with the next request right behind it in
    // the same write: the body's read stops at its end (a read past it would leave this body
    // with bytes that are not JSON and the next head without its first bytes: a 400, or no
    // answer at all).
    s.write_all(format!("{head}{}", &body[..7]).as_bytes())
        .await
        .unwrap();
    tokio::task::yield_now().await;
    s.write_all(format!("{}{head}{body}", &body[7..]).as_bytes())
        .await
        .unwrap();
    for _ in 0..2 {
        let (status, _, text) = read_response(&mut s, &mut buf).await;
        assert_eq!(status, 200, "{text}");
    }

    // Two requests in one write: two answers, in order.
    let two = format!("{head}{body}{head}{body}");
    s.write_all(two.as_bytes()).await.unwrap();
    for _ in 0..2 {
        let (status, _, text) = read_response(&mut s, &mut buf).await;
        assert_eq!(status, 200, "{text}");
    }

    // A body the handler never reads (405) is drained; the connection goes on.
    let (status, lean_405, _) =
        request_with(&mut s, "POST", "/v1/models", "abcde", false, "").await;
    assert_eq!(status, 405, "{lean_405}");
    s.write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
    let (status, _, text) = read_response(&mut s, &mut buf).await;
    assert_eq!(status, 200, "{text}");

    // A chunked body is not this path's: hyper takes the connection and answers it, then
    // serves the plain requests after it, with the same header lines as the fast path.
    let chunked = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{body}\r\n0\r\n\r\n",
        body.len()
    );
    s.write_all(chunked.as_bytes()).await.unwrap();
    let (status, _, text) = read_response(&mut s, &mut buf).await;
    assert_eq!(status, 200, "{text}");
    s.write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
    let (status, hyper_head, text) = read_response(&mut s, &mut buf).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(header_names(&lean_head), header_names(&hyper_head));
    let (status, hyper_405, _) =
        request_with(&mut s, "POST", "/v1/models", "abcde", false, "").await;
    assert_eq!(status, 405);
    assert_eq!(header_names(&lean_405), header_names(&hyper_405));

    // Asked to close: both paths say so, then close.
    let (status, hyper_close, _) = request_with(&mut s, "POST", "/v1/models", "", true, "").await;
    assert_eq!(status, 405);
    closed_by_router(s).await;
    let mut s = TcpStream::connect(proxy.data_addr()).await.unwrap();
    let (status, lean_close, _) = request_with(&mut s, "POST", "/v1/models", "", true, "").await;
    assert_eq!(status, 405);
    assert!(lean_close.contains("\r\nconnection: close"), "{lean_close}");
    assert_eq!(header_names(&lean_close), header_names(&hyper_close));
    closed_by_router(s).await;

    // A target this path's parser takes but `http` does not (`<`): hyper gets the head whole
    // (it would wait for one otherwise) and refuses it.
    let mut s8 = TcpStream::connect(proxy.data_addr()).await.unwrap();
    s8.write_all(b"GET /v1/models<x> HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, _, text) = read_response(&mut s8, &mut Vec::new()).await;
    assert_eq!(status, 400, "{text}");

    // HTTP/1.0 is hyper's from the first request.
    let mut s10 = TcpStream::connect(proxy.data_addr()).await.unwrap();
    let req10 = format!(
        "POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s10.write_all(req10.as_bytes()).await.unwrap();
    let (status, _, text) = read_response(&mut s10, &mut Vec::new()).await;
    assert_eq!(status, 200, "{text}");
    assert!(buf.is_empty(), "{buf:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_heads_are_closed_while_other_clients_are_served() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.timeouts.header_read_ms = 300;
    cfg.threads = Some(2);
    let proxy = Proxy::start(cfg).await.unwrap();
    let addr = proxy.data_addr();

    const STALLED: usize = 300;
    let mut stalled = Vec::with_capacity(STALLED);
    for i in 0..STALLED {
        let mut s = TcpStream::connect(addr).await.unwrap();
        // Half a head, and then nothing (every other one sends nothing at all).
        if i % 2 == 0 {
            s.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-le")
                .await
                .unwrap();
        }
        stalled.push(s);
    }
    // Served meanwhile, each on a connection of its own.
    for _ in 0..20 {
        let (status, _, body) = request(addr, "GET", "/health", "").await;
        assert_eq!(status, 200, "{body}");
    }
    let closing = stalled.into_iter().map(closed_by_router);
    futures_util::future::join_all(closing).await;
    let page = metrics_page(&proxy).await;
    assert_eq!(
        data_timeouts(&page, "header_read"),
        STALLED as f64,
        "{page}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_body_gets_408_and_an_idle_connection_is_closed() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.timeouts.body_read_ms = 200;
    cfg.limits.min_body_rate_bytes_per_s = 0;
    cfg.timeouts.keep_alive_ms = 200;
    let proxy = Proxy::start(cfg).await.unwrap();
    let addr = proxy.data_addr();

    // A whole head announcing 1,000 bytes, and 10 of them.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(WAIT, s.read_to_end(&mut got))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    assert!(text.contains("\"RequestTimeoutError\""), "{text}");

    // A kept-alive connection after its request: closed once idle.
    closed_by_router(kept_alive(addr).await).await;

    let page = metrics_page(&proxy).await;
    assert_eq!(data_timeouts(&page, "body_read"), 1.0, "{page}");
    assert_eq!(data_timeouts(&page, "keep_alive"), 1.0, "{page}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_begun_on_a_kept_alive_connection_has_the_head_timeout_not_the_idle_one() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.timeouts.header_read_ms = 200;
    // Longer than the test waits: only the head timeout can close the connection in time.
    cfg.timeouts.keep_alive_ms = 10 * WAIT.as_millis() as u64;
    let proxy = Proxy::start(cfg).await.unwrap();
    let mut s = kept_alive(proxy.data_addr()).await;
    s.write_all(b"GET /health HTTP/1.1\r\nho").await.unwrap();
    closed_by_router(s).await;
    let page = metrics_page(&proxy).await;
    assert_eq!(data_timeouts(&page, "header_read"), 1.0, "{page}");
    proxy.shutdown().await;
}

/// The watchdog's timer is armed for the first head's deadline; a request's end that moves
/// the next deadline before it must wake the watchdog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_timeout_shorter_than_the_head_timeout_closes_a_kept_alive_connection() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    // Longer than the test waits: only the idle timeout can close the connection in time.
    cfg.timeouts.header_read_ms = 10 * WAIT.as_millis() as u64;
    cfg.timeouts.keep_alive_ms = 200;
    let proxy = Proxy::start(cfg).await.unwrap();
    closed_by_router(kept_alive(proxy.data_addr()).await).await;
    let page = metrics_page(&proxy).await;
    assert_eq!(data_timeouts(&page, "keep_alive"), 1.0, "{page}");
    proxy.shutdown().await;
}

/// The watchdog hears nothing of heads that come whole (it is not woken per request): its
/// timer, armed for the first head's deadline, must find the idle deadline when it fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_whose_heads_came_whole_is_closed_by_the_idle_timeout_not_the_head_one() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.timeouts.header_read_ms = 100;
    cfg.timeouts.keep_alive_ms = 1_000;
    let proxy = Proxy::start(cfg).await.unwrap();
    let mut s = kept_alive(proxy.data_addr()).await;
    health_on(&mut s).await;
    // Several head timeouts later, well inside the idle one: still open.
    let mut b = [0u8; 64];
    let early = tokio::time::timeout(std::time::Duration::from_millis(400), s.read(&mut b)).await;
    assert!(early.is_err(), "closed before the idle timeout: {early:?}");
    closed_by_router(s).await;
    let page = metrics_page(&proxy).await;
    assert_eq!(data_timeouts(&page, "keep_alive"), 1.0, "{page}");
    assert!(!page.contains(r#"kind="header_read""#), "{page}");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_pauses_accepting_and_resumes_when_one_closes() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.limits.max_connections = 4;
    cfg.threads = Some(1);
    let proxy = Proxy::start(cfg).await.unwrap();
    let addr = proxy.data_addr();

    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(kept_alive(addr).await);
    }
    // The fifth is accepted by the kernel but not by the router: its request waits.
    let fifth = tokio::spawn(async move { request(addr, "GET", "/health", "").await });
    let page = loop {
        let page = metrics_page(&proxy).await;
        if page.contains("kinference_accept_pauses_total{port=\"data\"}") {
            break page;
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(
        metric(&page, r#"kinference_client_connections{port="data"}"#),
        4.0,
        "{page}"
    );
    assert!(!fifth.is_finished(), "served past the cap");
    drop(held.pop());
    let (status, _, body) = tokio::time::timeout(WAIT, fifth)
        .await
        .expect("accepting never resumed")
        .unwrap();
    assert_eq!(status, 200, "{body}");
    proxy.shutdown().await;
}

fn completion(i: usize) -> String {
    json!({"model": MODEL, "prompt": format!("request {i}"), "max_tokens": 1}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_beyond_the_gate_is_shed_with_429_while_admitted_requests_complete() {
    let (release, hold) = watch::channel(true);
    let slow = replica(200, hold).await;
    let mut cfg = config(&[slow], "least-load");
    cfg.limits.max_in_flight = 2;
    cfg.limits.max_queue = 2;
    cfg.limits.retry_after_s = 3;
    cfg.timeouts.queue_ms = WAIT.as_millis() as u64;
    let proxy = Arc::new(Proxy::start(cfg).await.unwrap());
    let addr = proxy.data_addr();

    let mut burst = FuturesUnordered::new();
    for i in 0..10 {
        burst.push(tokio::spawn(async move {
            request(addr, "POST", "/v1/completions", &completion(i)).await
        }));
    }
    // The replica holds the two it has and two more wait in the queue: the first six answers
    // can only be refusals.
    for _ in 0..6 {
        let (status, head, body) = tokio::time::timeout(WAIT, burst.next())
            .await
            .expect("no refusal came")
            .unwrap()
            .unwrap();
        assert_eq!(status, 429, "{head}{body}");
        assert!(head.contains("retry-after: 3"), "{head}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["type"], "RateLimitError", "{body}");
        assert_eq!(err["error"]["code"], 429, "{body}");
    }
    let page = metrics_page(&proxy).await;
    assert_eq!(
        metric(
            &page,
            r#"kinference_shed_requests_total{pool="tiny",reason="queue_full",status="429"}"#
        ),
        6.0,
        "{page}"
    );
    assert_eq!(
        metric(&page, r#"kinference_queued_requests{pool="tiny"}"#),
        2.0,
        "{page}"
    );
    release.send(false).unwrap();
    let mut ok = 0;
    while let Some(done) = tokio::time::timeout(WAIT, burst.next()).await.unwrap() {
        let (status, head, body) = done.unwrap();
        assert_eq!(status, 200, "{head}{body}");
        ok += 1;
    }
    assert_eq!(ok, 4, "two in flight and two queued complete");
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas[0].workers[0].load.in_flight == 0
        })
        .await
        .unwrap();
    // The gate is free again.
    let (status, _, body) = request(addr, "POST", "/v1/completions", &completion(99)).await;
    assert_eq!(status, 200, "{body}");
    Arc::try_unwrap(proxy).unwrap().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_guards_everything_but_the_probes() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.admin_auth.token = AdminToken::new("s3cret-token\n");
    let proxy = Proxy::start(cfg).await.unwrap();
    let admin = proxy.admin_addr();

    let get = |path: &'static str, auth: Option<&'static str>| async move {
        let mut s = TcpStream::connect(admin).await.unwrap();
        let auth = auth.map_or(String::new(), |a| format!("authorization: {a}\r\n"));
        let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\n{auth}connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).await.unwrap();
        let text = String::from_utf8_lossy(&got).into_owned();
        (text[9..12].parse::<u16>().unwrap(), text)
    };
    for path in ["/debug/replicas", "/metrics"] {
        let (status, text) = get(path, None).await;
        assert_eq!(status, 401, "{text}");
        assert!(text.contains("\"AuthenticationError\""), "{text}");
        assert!(
            text.to_ascii_lowercase()
                .contains("www-authenticate: bearer"),
            "{text}"
        );
        let (status, _) = get(path, Some("Bearer wrong")).await;
        assert_eq!(status, 401);
        let (status, _) = get(path, Some("Bearer s3cret-token-and-more")).await;
        assert_eq!(status, 401);
        let (status, text) = get(path, Some("Bearer s3cret-token")).await;
        assert_eq!(status, 200, "{text}");
    }
    let (status, text) = get("/livez", None).await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = get("/readyz", None).await;
    assert!(
        status == 200 || status == 503,
        "a probe is never refused: {status}"
    );

    // Explain reveals how a prompt routes: guarded too.
    let mut s = TcpStream::connect(admin).await.unwrap();
    let (status, _, body) =
        request_on(&mut s, "POST", "/debug/explain", &completion(1), true).await;
    assert_eq!(status, 401, "{body}");

    let (_, page) = get("/metrics", Some("Bearer s3cret-token")).await;
    assert_eq!(
        metric_in(&page, "kinference_admin_unauthorized_total"),
        7.0,
        "{page}"
    );
    proxy.shutdown().await;
}

/// [`metric`] on a raw HTTP answer (head included).
fn metric_in(answer: &str, series: &str) -> f64 {
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    metric(body, series)
}

/// A prompt of several 32-token blocks, different per `i`.
fn long_prompt(i: usize) -> String {
    let mut s = format!("Conversation {i}. ");
    for k in 0..40 {
        s.push_str(&format!(
            "Turn {k} of conversation {i} talks about caching. "
        ));
    }
    s
}

async fn explain(proxy: &Proxy, prompt: &str) -> ExplainResponse {
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    let (status, _, text) = request(proxy.admin_addr(), "POST", "/debug/explain", &body).await;
    assert_eq!(status, 200, "{text}");
    serde_json::from_str(&text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_entries_follow_the_outcome() {
    // Alone, a replica answering 503: its 503 goes back to the client and nothing of the
    // request's prefix is assumed cached there.
    let busy = replica(503, open()).await;
    let proxy = Proxy::start(config(
        &[busy],
        "{kind: precise, speculative_ttl_ms: 600000}",
    ))
    .await
    .unwrap();
    let body = json!({"model": MODEL, "prompt": long_prompt(0), "max_tokens": 1}).to_string();
    let (status, _, text) = request(proxy.data_addr(), "POST", "/v1/completions", &body).await;
    assert_eq!(status, 503, "{text}");
    let e = explain(&proxy, &long_prompt(0)).await;
    assert!(e.blocks > 2, "{e:?}");
    assert_eq!(proxy.status().pools[0].tracked_entries, 0, "{e:?}");
    assert_eq!(e.candidates[0].speculative_blocks, 0, "{e:?}");
    proxy.shutdown().await;

    // Next to a replica that answers: every request ends there (directly, or after the 503),
    // and only that replica holds speculative entries.
    let ok = replica(200, open()).await;
    let proxy = Proxy::start(config(
        &[busy, ok],
        "{kind: precise, speculative_ttl_ms: 600000}",
    ))
    .await
    .unwrap();
    let mut blocks = 0;
    for i in 1..=6 {
        let body = json!({"model": MODEL, "prompt": long_prompt(i), "max_tokens": 1}).to_string();
        let (status, head, text) =
            request(proxy.data_addr(), "POST", "/v1/completions", &body).await;
        assert_eq!(status, 200, "{text}");
        assert!(
            head.contains(&format!("x-kinference-endpoint: {ok}")),
            "{head}"
        );
        let e = explain(&proxy, &long_prompt(i)).await;
        for c in &e.candidates {
            let want = if c.replica == format!("http://{ok}") {
                e.blocks as u32
            } else {
                0
            };
            assert_eq!(c.speculative_blocks, want, "{e:#?}");
        }
        blocks += e.blocks;
    }
    assert_eq!(proxy.status().pools[0].tracked_entries, blocks);
    let page = metrics_page(&proxy).await;
    assert!(
        metric(
            &page,
            r#"kinference_retries_total{pool="tiny",kind="unavailable"}"#
        ) >= 1.0,
        "the 503 replica was tried: {page}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served_through_the_same_accept_loop() {
    let ok = replica(200, open()).await;
    let proxy = Proxy::start(config(&[ok], "least-load")).await.unwrap();
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let mut answers = Vec::new();
    for i in 0..4 {
        let c = client.clone();
        let url = format!("http://{}/v1/completions", proxy.data_addr());
        answers.push(tokio::spawn(async move {
            c.post(url)
                .header("content-type", "application/json")
                .body(completion(i))
                .send()
                .await
                .unwrap()
        }));
    }
    for a in answers {
        let resp = a.await.unwrap();
        assert_eq!(resp.version(), reqwest::Version::HTTP_2);
        assert_eq!(resp.status(), 200);
    }
    let page = metrics_page(&proxy).await;
    assert_eq!(
        metric(&page, r#"kinference_client_connections{port="data"}"#),
        1.0,
        "four requests as streams of one connection: {page}"
    );
    proxy.shutdown().await;
}

/// Requests in flight per replica, as the router counts them.
fn in_flight(s: &kinference_proxy::ReplicasResponse) -> Vec<u32> {
    s.pools[0]
        .replicas
        .iter()
        .map(|r| r.workers.iter().map(|w| w.load.in_flight).sum())
        .collect()
}

/// A request of session `session` (the pool routes by session affinity), spawned.
fn session_request(
    addr: SocketAddr,
    session: &'static str,
    i: usize,
) -> tokio::task::JoinHandle<(u16, String, String)> {
    tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let extra = format!("x-session: {session}\r\n");
        request_with(
            &mut s,
            "POST",
            "/v1/completions",
            &completion(i),
            true,
            &extra,
        )
        .await
    })
}

/// Two held replicas behind a router whose pool routes by session affinity, with
/// `max_in_flight_per_replica: cap` and a queue of one; the sender releases the replicas.
async fn affinity_router(cap: u32) -> (Proxy, watch::Sender<bool>) {
    let (release, hold) = watch::channel(true);
    let a = replica(200, hold.clone()).await;
    let b = replica(200, hold).await;
    let mut cfg = config(&[a, b], "session-affinity");
    cfg.pools[0].session_header = Some("x-session".into());
    cfg.limits.max_in_flight_per_replica = cap;
    cfg.limits.max_queue = 1;
    cfg.limits.retry_after_s = 5;
    cfg.timeouts.queue_ms = 10 * WAIT.as_millis() as u64;
    (Proxy::start(cfg).await.unwrap(), release)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_at_its_in_flight_limit_is_passed_over_and_a_full_pool_queues_then_sheds() {
    // Without the limit, one session's requests stack on its replica.
    let (proxy, release) = affinity_router(0).await;
    let addr = proxy.data_addr();
    let first = session_request(addr, "s1", 1);
    proxy
        .wait_until(WAIT, |s| in_flight(s).iter().sum::<u32>() == 1)
        .await
        .unwrap();
    let second = session_request(addr, "s1", 2);
    let stacked = proxy
        .wait_until(WAIT, |s| in_flight(s).iter().sum::<u32>() == 2)
        .await
        .unwrap();
    let mut loads = in_flight(&stacked);
    loads.sort_unstable();
    assert_eq!(loads, [0, 2], "{stacked:#?}");
    release.send(false).unwrap();
    for r in [first, second] {
        assert_eq!(r.await.unwrap().0, 200);
    }
    proxy.shutdown().await;

    // With a limit of one, the second goes to the other replica.
    let (proxy, release) = affinity_router(1).await;
    let addr = proxy.data_addr();
    let first = session_request(addr, "s1", 1);
    proxy
        .wait_until(WAIT, |s| in_flight(s).iter().sum::<u32>() == 1)
        .await
        .unwrap();
    let second = session_request(addr, "s1", 2);
    let spread = proxy
        .wait_until(WAIT, |s| in_flight(s).iter().sum::<u32>() == 2)
        .await
        .unwrap();
    assert_eq!(in_flight(&spread), [1, 1], "{spread:#?}");

    // Both full: the next one waits in the queue, and the one after it is shed at once.
    let third = session_request(addr, "s1", 3);
    wait_queued(&proxy, 1.0).await;
    let (status, head, body) = session_request(addr, "s2", 4).await.unwrap();
    assert_eq!(status, 429, "{head}{body}");
    assert!(head.contains("retry-after: 5"), "{head}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["type"], "RateLimitError", "{body}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("replicas_full"),
        "{body}"
    );
    assert!(!third.is_finished(), "the queued request was answered");

    // Room comes free: the queued request is served.
    release.send(false).unwrap();
    for r in [first, second, third] {
        let (status, head, body) = tokio::time::timeout(WAIT, r).await.unwrap().unwrap();
        assert_eq!(status, 200, "{head}{body}");
    }
    let page = metrics_page(&proxy).await;
    let shed = |reason: &str| {
        metric(
            &page,
            &format!(
                r#"kinference_shed_requests_total{{pool="tiny",reason="{reason}",status="429"}}"#
            ),
        )
    };
    assert_eq!(shed("replicas_full"), 1.0, "{page}");
    assert_eq!(
        metric(&page, r#"kinference_queued_requests{pool="tiny"}"#),
        0.0,
        "{page}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_for_room_is_served_as_soon_as_a_replica_comes_back_up() {
    let (release, hold) = watch::channel(true);
    let a = replica(200, hold.clone()).await;
    // B: a port nothing listens on yet.
    let b = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let b_addr = b.local_addr().unwrap();
    drop(b);
    let mut cfg = config(&[a, b_addr], "least-load");
    cfg.scrape.interval_ms = 20;
    cfg.scrape.idle_interval_ms = 20;
    cfg.limits.max_in_flight_per_replica = 1;
    cfg.limits.max_queue = 1;
    // Far longer than the test waits: only a wake-up can serve the queued request in time.
    cfg.timeouts.queue_ms = 10 * WAIT.as_millis() as u64;
    let proxy = Proxy::start(cfg).await.unwrap();
    let addr = proxy.data_addr();
    let health = |s: &kinference_proxy::ReplicasResponse| -> Vec<kinference_proxy::api::Health> {
        s.pools[0].replicas.iter().map(|r| r.health).collect()
    };
    use kinference_proxy::api::Health::{Down, Up};
    proxy
        .wait_until(WAIT, |s| health(s) == [Up, Down])
        .await
        .unwrap();

    // A holds the first request; the second waits for room (B is down).
    let first = session_request(addr, "s1", 1);
    proxy
        .wait_until(WAIT, |s| in_flight(s) == [1, 0])
        .await
        .unwrap();
    let second = session_request(addr, "s2", 2);
    wait_queued(&proxy, 1.0).await;

    // B comes up on the same port; the scrape that finds it wakes the waiting request.
    let b = TcpListener::bind(b_addr).await.unwrap();
    serve_replica(b, 200, watch::channel(false).1);
    let (status, head, body) = tokio::time::timeout(WAIT, second)
        .await
        .expect("the waiting request was not woken when B came up")
        .unwrap();
    assert_eq!(status, 200, "{head}{body}");
    assert!(!first.is_finished(), "A was released early");
    release.send(false).unwrap();
    assert_eq!(first.await.unwrap().0, 200);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_whose_replicas_all_refuse_answers_503_with_retry_after() {
    // A port that was free a moment ago: nothing listens there now.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut cfg = config(&[closed], "least-load");
    cfg.limits.retry_after_s = 7;
    let proxy = Proxy::start(cfg).await.unwrap();
    let addr = proxy.data_addr();
    // Routed, passed through, and again once the replica is known to be down.
    for (path, body) in [
        ("/v1/completions", completion(1)),
        (
            "/tokenize",
            json!({"model": MODEL, "prompt": "x"}).to_string(),
        ),
        ("/v1/completions", completion(2)),
    ] {
        let (status, head, body) = request(addr, "POST", path, &body).await;
        assert_eq!(status, 503, "{path}: {head}{body}");
        assert!(head.contains("retry-after: 7"), "{path}: {head}");
        let err: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(err["error"]["type"], "ServiceUnavailableError", "{body}");
        assert!(
            err["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("no usable replica for pool `tiny`"),
            "{body}"
        );
    }
    proxy.shutdown().await;
}

/// HTTP/2 frame types read or written by hand.
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const ACK: u8 = 0x1;

/// One HTTP/2 frame on stream 0.
fn h2_frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = len.to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags, 0, 0, 0, 0]);
    f.extend_from_slice(payload);
    f
}

/// The next frame from `s` as (type, flags, payload); `None` once the router closed it.
async fn next_h2_frame(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(u8, u8, Vec<u8>)> {
    let mut chunk = [0u8; 4096];
    loop {
        if buf.len() >= 9 {
            let len = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]) as usize;
            if buf.len() >= 9 + len {
                let frame: Vec<u8> = buf.drain(..9 + len).collect();
                return Some((frame[3], frame[4], frame[9..].to_vec()));
            }
        }
        match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_stops_answering_pings_is_disconnected() {
    let ok = replica(200, open()).await;
    let mut cfg = config(&[ok], "least-load");
    cfg.timeouts.h2_keep_alive_interval_ms = 100;
    cfg.timeouts.h2_keep_alive_timeout_ms = 100;
    // Longer than the test waits: only the PINGs can close the connection in time.
    cfg.timeouts.keep_alive_ms = 10 * WAIT.as_millis() as u64;
    cfg.timeouts.header_read_ms = 10 * WAIT.as_millis() as u64;
    let proxy = Proxy::start(cfg).await.unwrap();

    let mut s = TcpStream::connect(proxy.data_addr()).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        .await
        .unwrap();
    s.write_all(&h2_frame(SETTINGS, 0, &[])).await.unwrap();
    // A client that answers keeps its connection: two PINGs answered in turn.
    let mut buf = Vec::new();
    let mut answered = 0;
    while answered < 2 {
        let (kind, flags, payload) = tokio::time::timeout(WAIT, next_h2_frame(&mut s, &mut buf))
            .await
            .expect("no PING came")
            .expect("closed while the client answered");
        match (kind, flags & ACK) {
            (SETTINGS, 0) => s.write_all(&h2_frame(SETTINGS, ACK, &[])).await.unwrap(),
            (PING, 0) => {
                s.write_all(&h2_frame(PING, ACK, &payload)).await.unwrap();
                answered += 1;
            }
            _ => {}
        }
    }
    // Silent from now on: the next PING goes unanswered and the router hangs up.
    let silent = tokio::time::Instant::now();
    let mut pings = 0;
    while let Some((kind, flags, _)) = tokio::time::timeout(WAIT, next_h2_frame(&mut s, &mut buf))
        .await
        .expect("the router never closed the silent connection")
    {
        if (kind, flags & ACK) == (PING, 0) {
            pings += 1;
        }
    }
    assert_eq!(
        pings, 1,
        "one PING, unanswered, and the connection is closed"
    );
    // The next PING is due an interval after the last answer, and closes the connection a
    // timeout after it is sent.
    assert!(
        silent.elapsed() >= std::time::Duration::from_millis(200),
        "{:?}",
        silent.elapsed()
    );
    // The router may close the socket just before its connection task counts the timeout.
    let series = r#"kinference_client_timeouts_total{port="data",kind="h2_keep_alive"}"#;
    tokio::time::timeout(WAIT, async {
        while !metrics_page(&proxy).await.contains(series) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the PING timeout was never counted");
    let page = metrics_page(&proxy).await;
    assert_eq!(metric(&page, series), 1.0, "{page}");
    proxy.shutdown().await;
}
