//! A measurement probe, not a router: the least an HTTP/1.1 keep-alive forwarder built on
//! tokio can cost per request on a given machine, to tell the router's HTTP layer apart from
//! its routing work in `scripts/router-latency.sh` (`TARGETS=floor`). It forwards each request's
//! bytes untouched to the next replica in turn over pooled upstream connections and copies the
//! response back (Content-Length or chunked framing), as nginx does in the same script. No
//! parsing beyond the heads, no policy, no metrics, no limits, no timeouts.
//!
//! `--stack hyper` does the same through hyper's HTTP/1 server and hyper-util's pooled client
//! (the router's stack, without axum and without any of the router's own code), so the two
//! modes split the router's HTTP cost into what hyper takes and what the router adds.
//!
//! `--stack mixed` is hyper's server with the lean client (the request's own task writes the
//! request and reads the whole response, no client connection task), to split hyper's cost
//! between its two sides.
//!
//! `cargo run --release -p kinference-proxy --example http_floor -- [--threads N]
//! [--stack lean|hyper|mixed] LISTEN URL...` prints `listening on ADDR` once bound (`LISTEN` may use
//! port 0).
//!
//! Invariants: a request with a body must carry Content-Length (chunked requests get 411 and a
//! close); an upstream connection goes back to its pool only after a complete response that
//! did not ask to close.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MAX_HEADERS: usize = 64;

fn main() -> std::io::Result<()> {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let mut threads = 2usize;
    let mut stack = String::from("lean");
    loop {
        match (args.first().map(String::as_str), args.get(1)) {
            (Some("--threads"), Some(n)) => threads = n.parse().unwrap_or(2).max(1),
            (Some("--stack"), Some(s)) => stack = s.clone(),
            _ => break,
        }
        args.drain(..2);
    }
    let (listen, urls) = args.split_first().ok_or_else(|| {
        std::io::Error::other(
            "usage: http_floor [--threads N] [--stack lean|hyper|mixed] LISTEN URL...",
        )
    })?;
    let upstreams: Vec<SocketAddr> = urls
        .iter()
        .map(|u| {
            u.trim_start_matches("http://")
                .trim_end_matches('/')
                .parse()
                .map_err(|e| std::io::Error::other(format!("{u}: {e}")))
        })
        .collect::<std::io::Result<_>>()?;
    if upstreams.is_empty() {
        return Err(std::io::Error::other("no upstream"));
    }
    let listener = std::net::TcpListener::bind(listen)?;
    listener.set_nonblocking(true)?;
    println!("listening on {}", listener.local_addr()?);
    let mut handles = Vec::new();
    for i in 0..threads {
        let l = listener.try_clone()?;
        let ups = upstreams.clone();
        let stack = stack.clone();
        handles.push(std::thread::spawn(move || match stack.as_str() {
            "hyper" => serve_hyper(l, ups, i),
            "mixed" => serve_mixed(l, ups, i),
            _ => serve(l, ups, i),
        }));
    }
    for h in handles {
        h.join()
            .map_err(|_| std::io::Error::other("a thread panicked"))??;
    }
    Ok(())
}

/// One thread's accept loop on the shared listener, on a runtime of its own: each connection
/// goes to `serve` (a task on this thread). Tokio's timer only with `timers` (hyper's client
/// needs it; the lean mode does not).
fn accept_loop<F, Fut>(l: std::net::TcpListener, timers: bool, serve: F) -> std::io::Result<()>
where
    F: Fn(TcpStream) -> Fut + 'static,
    Fut: Future<Output = ()> + 'static,
{
    let mut rt = tokio::runtime::Builder::new_current_thread();
    rt.enable_io();
    if timers {
        rt.enable_time();
    }
    let rt = rt.build()?;
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, async move {
        let l = TcpListener::from_std(l)?;
        loop {
            let (c, _) = l.accept().await?;
            c.set_nodelay(true)?;
            tokio::task::spawn_local(serve(c));
        }
    })
}

/// One thread: its own upstream pools, the shared listener.
fn serve(l: std::net::TcpListener, ups: Vec<SocketAddr>, start: usize) -> std::io::Result<()> {
    let pools: Rc<Vec<RefCell<Vec<TcpStream>>>> =
        Rc::new(ups.iter().map(|_| RefCell::new(Vec::new())).collect());
    let next = Rc::new(Cell::new(start));
    let ups = Rc::new(ups);
    accept_loop(l, false, move |c| {
        let (pools, next, ups) = (pools.clone(), next.clone(), ups.clone());
        async move {
            let _ = connection(c, &ups, &pools, &next).await;
        }
    })
}

/// The same through hyper: its HTTP/1 server per connection, hyper-util's pooled client per
/// thread, the request's body and the response's streamed through.
fn serve_hyper(
    l: std::net::TcpListener,
    ups: Vec<SocketAddr>,
    start: usize,
) -> std::io::Result<()> {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::{TokioExecutor, TokioIo};

    // No Nagle on the upstream side, as the router's own client and the lean mode.
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    let client = Client::builder(TokioExecutor::new()).build(connector);
    let next = Rc::new(Cell::new(start));
    let ups: Rc<Vec<String>> = Rc::new(ups.iter().map(|a| format!("http://{a}")).collect());
    accept_loop(l, true, move |c| {
        let (client, next, ups) = (client.clone(), next.clone(), ups.clone());
        let svc =
            hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
                let i = next.get() % ups.len();
                next.set(i + 1);
                let pq = req.uri().path_and_query().map_or("/", |p| p.as_str());
                let uri = format!("{}{pq}", ups[i]).parse::<hyper::Uri>();
                let client = client.clone();
                async move {
                    *req.uri_mut() = uri.map_err(std::io::Error::other)?;
                    client.request(req).await.map_err(std::io::Error::other)
                }
            });
        async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(c), svc)
                .await;
        }
    })
}

/// hyper's HTTP/1 server with the lean client: the request's own task checks a connection
/// out of this thread's pool, writes head and body in one call and reads the whole response
/// (no client connection task, no dispatch channel), to split hyper's cost between its
/// server and its client.
fn serve_mixed(
    l: std::net::TcpListener,
    ups: Vec<SocketAddr>,
    start: usize,
) -> std::io::Result<()> {
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::TokioIo;

    let pools: Rc<Vec<RefCell<Vec<TcpStream>>>> =
        Rc::new(ups.iter().map(|_| RefCell::new(Vec::new())).collect());
    let next = Rc::new(Cell::new(start));
    let ups = Rc::new(ups);
    accept_loop(l, true, move |c| {
        let (pools, next, ups) = (pools.clone(), next.clone(), ups.clone());
        let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
            let (pools, next, ups) = (pools.clone(), next.clone(), ups.clone());
            async move {
                let (parts, body) = req.into_parts();
                let body = body
                    .collect()
                    .await
                    .map_err(std::io::Error::other)?
                    .to_bytes();
                let i = next.get() % ups.len();
                next.set(i + 1);
                let mut out = Vec::with_capacity(512 + body.len());
                let pq = parts.uri.path_and_query().map_or("/", |p| p.as_str());
                out.extend_from_slice(parts.method.as_str().as_bytes());
                out.extend_from_slice(b" ");
                out.extend_from_slice(pq.as_bytes());
                out.extend_from_slice(b" HTTP/1.1\r\n");
                for (k, v) in parts.headers.iter() {
                    out.extend_from_slice(k.as_str().as_bytes());
                    out.extend_from_slice(b": ");
                    out.extend_from_slice(v.as_bytes());
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(&body);
                let pooled = pools[i].borrow_mut().pop();
                let mut u = match pooled {
                    Some(u) => u,
                    None => {
                        let u = TcpStream::connect(ups[i]).await?;
                        u.set_nodelay(true)?;
                        u
                    }
                };
                u.write_all(&out).await?;
                let mut buf = Vec::with_capacity(16 * 1024);
                let (status, headers, body, keep) = read_response(&mut u, &mut buf).await?;
                if keep {
                    pools[i].borrow_mut().push(u);
                }
                let mut resp = hyper::Response::new(Full::new(bytes::Bytes::from(body)));
                *resp.status_mut() =
                    hyper::StatusCode::from_u16(status).map_err(std::io::Error::other)?;
                *resp.headers_mut() = headers;
                Ok::<_, std::io::Error>(resp)
            }
        });
        async move {
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(c), svc)
                .await;
        }
    })
}

/// One whole response: status, its end-to-end headers, the body (de-chunked), and whether
/// the connection can carry another request.
async fn read_response(
    u: &mut TcpStream,
    buf: &mut Vec<u8>,
) -> std::io::Result<(u16, hyper::HeaderMap, Vec<u8>, bool)> {
    loop {
        if read_more(u, buf).await? == 0 {
            return Err(std::io::Error::other("upstream closed before a response"));
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head) = resp.parse(buf).map_err(std::io::Error::other)? {
            let mut map = hyper::HeaderMap::with_capacity(resp.headers.len());
            let mut framing = Framing::Close;
            let mut keep = true;
            for h in resp.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    let n = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    framing = Framing::Length(n);
                    continue;
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    framing = Framing::Chunked;
                    continue;
                } else if h.name.eq_ignore_ascii_case("connection") {
                    keep = !h.value.eq_ignore_ascii_case(b"close");
                    continue;
                }
                if let (Ok(k), Ok(v)) = (
                    hyper::header::HeaderName::from_bytes(h.name.as_bytes()),
                    hyper::header::HeaderValue::from_bytes(h.value),
                ) {
                    map.append(k, v);
                }
            }
            let status = resp.code.unwrap_or(502);
            if matches!(status, 204 | 304) {
                framing = Framing::Length(0);
            }
            let rest = buf.split_off(head);
            *buf = rest;
            return match framing {
                Framing::Length(n) => {
                    while buf.len() < n {
                        if read_more(u, buf).await? == 0 {
                            return Err(std::io::Error::other("short body"));
                        }
                    }
                    buf.truncate(n);
                    Ok((status, map, std::mem::take(buf), keep))
                }
                Framing::Chunked => {
                    let mut scan = Chunks::default();
                    let mut done = scan.feed(buf);
                    while !done {
                        let at = buf.len();
                        if read_more(u, buf).await? == 0 {
                            return Err(std::io::Error::other("short body"));
                        }
                        done = scan.feed(&buf[at..]);
                    }
                    Ok((status, map, dechunk(buf), keep))
                }
                Framing::Close => {
                    while read_more(u, buf).await? > 0 {}
                    Ok((status, map, std::mem::take(buf), false))
                }
            };
        }
    }
}

/// The data of a complete chunked body (extensions and trailers dropped).
fn dechunk(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(b.len());
    let mut rest = b;
    while let Some(eol) = rest.iter().position(|&x| x == b'\n') {
        let line = std::str::from_utf8(&rest[..eol]).unwrap_or("0");
        let size = line.split(';').next().unwrap_or("0").trim();
        let n = usize::from_str_radix(size, 16).unwrap_or(0);
        rest = &rest[eol + 1..];
        if n == 0 || rest.len() < n {
            break;
        }
        out.extend_from_slice(&rest[..n]);
        rest = rest.get(n + 2..).unwrap_or(&[]);
    }
    out
}

async fn connection(
    mut c: TcpStream,
    ups: &[SocketAddr],
    pools: &[RefCell<Vec<TcpStream>>],
    next: &Cell<usize>,
) -> std::io::Result<()> {
    let mut buf: Vec<u8> = Vec::with_capacity(16 * 1024);
    let mut rbuf: Vec<u8> = Vec::with_capacity(16 * 1024);
    loop {
        // The request head, then its body.
        let (head, body) = loop {
            if let Some(hb) = request_head(&buf)? {
                break hb;
            }
            if read_more(&mut c, &mut buf).await? == 0 {
                return Ok(());
            }
        };
        let Some(body) = body else {
            c.write_all(
                b"HTTP/1.1 411 Length Required\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            )
            .await?;
            return Ok(());
        };
        while buf.len() < head + body {
            if read_more(&mut c, &mut buf).await? == 0 {
                return Ok(());
            }
        }
        let n = head + body;
        let i = next.get() % ups.len();
        next.set(i + 1);
        let pooled = pools[i].borrow_mut().pop();
        let mut u = match pooled {
            Some(u) => u,
            None => {
                let u = TcpStream::connect(ups[i]).await?;
                u.set_nodelay(true)?;
                u
            }
        };
        u.write_all(&buf[..n]).await?;
        buf.drain(..n);
        let reusable = relay(&mut u, &mut c, &mut rbuf).await?;
        if reusable {
            pools[i].borrow_mut().push(u);
        }
    }
}

async fn read_more(s: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    if buf.capacity() - buf.len() < 4096 {
        buf.reserve(16 * 1024);
    }
    s.read_buf(buf).await
}

/// `Some((head length, Some(body length) or None for a chunked body))` once the head is in.
#[allow(clippy::type_complexity)]
fn request_head(buf: &[u8]) -> std::io::Result<Option<(usize, Option<usize>)>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf).map_err(std::io::Error::other)? {
        httparse::Status::Partial => Ok(None),
        httparse::Status::Complete(head) => {
            let mut len = Some(0);
            for h in req.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    len = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse().ok());
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    len = None;
                }
            }
            Ok(Some((head, len)))
        }
    }
}

/// How a response body ends.
enum Framing {
    Length(usize),
    Chunked,
    Close,
}

/// Copies one response from `u` to `c`; says whether `u` can carry another request.
async fn relay(u: &mut TcpStream, c: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<bool> {
    buf.clear();
    let (head, framing, keep) = loop {
        if read_more(u, buf).await? == 0 {
            return Err(std::io::Error::other("upstream closed before a response"));
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut resp = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head) = resp.parse(buf).map_err(std::io::Error::other)? {
            let mut framing = Framing::Close;
            let mut keep = true;
            for h in resp.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    let n = std::str::from_utf8(h.value)
                        .ok()
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    framing = Framing::Length(n);
                } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
                    framing = Framing::Chunked;
                } else if h.name.eq_ignore_ascii_case("connection") {
                    keep = !h.value.eq_ignore_ascii_case(b"close");
                }
            }
            if matches!(resp.code, Some(204 | 304)) {
                framing = Framing::Length(0);
            }
            break (head, framing, keep);
        }
    };
    match framing {
        Framing::Length(n) => {
            let mut have = buf.len() - head;
            c.write_all(buf).await?;
            while have < n {
                buf.clear();
                let k = read_more(u, buf).await?;
                if k == 0 {
                    return Ok(false);
                }
                have += k;
                c.write_all(buf).await?;
            }
            Ok(keep && have == n)
        }
        Framing::Chunked => {
            let mut scan = Chunks::default();
            let mut done = scan.feed(&buf[head..]);
            c.write_all(buf).await?;
            while !done {
                buf.clear();
                if read_more(u, buf).await? == 0 {
                    return Ok(false);
                }
                done = scan.feed(buf);
                c.write_all(buf).await?;
            }
            Ok(keep)
        }
        Framing::Close => {
            c.write_all(buf).await?;
            loop {
                buf.clear();
                if read_more(u, buf).await? == 0 {
                    return Ok(false);
                }
                c.write_all(buf).await?;
            }
        }
    }
}

/// Finds the end of a chunked body fed in pieces (sizes, extensions, data, trailers).
#[derive(Default)]
struct Chunks {
    state: u8,
    size: usize,
    /// Bytes of the current trailer line (0 at a line start).
    line: usize,
}

impl Chunks {
    const SIZE: u8 = 0;
    const EXT: u8 = 1;
    const DATA: u8 = 2;
    const DATA_CR: u8 = 3;
    const DATA_LF: u8 = 4;
    const TRAILER: u8 = 5;

    /// Feeds the next bytes; true once the terminating empty line went by.
    fn feed(&mut self, mut b: &[u8]) -> bool {
        while let Some((&x, rest)) = b.split_first() {
            match self.state {
                Self::SIZE => match x {
                    b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F' => {
                        let d = (x as char).to_digit(16).unwrap_or(0) as usize;
                        self.size = self.size.saturating_mul(16).saturating_add(d);
                    }
                    b'\n' => self.end_size_line(),
                    _ => self.state = Self::EXT,
                },
                Self::EXT => {
                    if x == b'\n' {
                        self.end_size_line();
                    }
                }
                Self::DATA => {
                    let k = self.size.min(b.len());
                    self.size -= k;
                    if self.size == 0 {
                        self.state = Self::DATA_CR;
                    }
                    b = &b[k..];
                    continue;
                }
                Self::DATA_CR => self.state = Self::DATA_LF,
                Self::DATA_LF => self.state = Self::SIZE,
                _ => {
                    // Trailers: a line of length 0 (just CRLF) ends the body.
                    if x == b'\n' {
                        if self.line == 0 {
                            return true;
                        }
                        self.line = 0;
                    } else if x != b'\r' {
                        self.line += 1;
                    }
                }
            }
            b = rest;
        }
        false
    }

    fn end_size_line(&mut self) {
        if self.size == 0 {
            self.state = Self::TRAILER;
            self.line = 0;
        } else {
            self.state = Self::DATA;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Chunks;

    /// A chunked body with an extension and a trailer ends where it ends, fed whole or a byte
    /// at a time, and not before.
    #[test]
    fn the_end_of_a_chunked_body_is_found_in_any_split() {
        let body: &[u8] =
            b"5;x=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-t: 1\r\n\r\n";
        assert!(Chunks::default().feed(body));
        let mut c = Chunks::default();
        for (i, b) in body.iter().enumerate() {
            assert_eq!(
                c.feed(std::slice::from_ref(b)),
                i + 1 == body.len(),
                "byte {i}"
            );
        }
        // Data that looks like a last chunk is data.
        let plain: &[u8] = b"5\r\n0\r\n\r\n\r\n0\r\n\r\n";
        let mut c = Chunks::default();
        let ends: Vec<usize> = (0..plain.len())
            .filter(|&i| c.feed(&plain[i..=i]))
            .collect();
        assert_eq!(ends, vec![plain.len() - 1]);
    }
}
