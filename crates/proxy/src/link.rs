//! Upstream HTTP/1.1 connections driven by the request that uses them: a per-thread pool of
//! idle connections, each taken by one request at a time and polled from that request's own
//! task (while waiting for the response head, then from the response body handed to the
//! client), instead of by a connection task of its own. The HTTP/1.1 exchange is written
//! here: the request's head (as the caller writes it) and body in one write, the response
//! head parsed with `httparse` (the parser hyper uses) and handed on as its bytes and the
//! places of its headers ([`Headers`], no header map), its body read by `Content-Length`,
//! chunked framing, or to the close, straight from the socket into the frames handed to the
//! client, with no channel or dispatcher in between (BENCHMARKS.md, "the data port's HTTP/1.1 fast path").
//!
//! Why: with a connection task, every response chunk passed between two tasks (the connection
//! task decodes a chunk and waits until the body's reader takes it), so each chunk went to the
//! client in a write of its own, and each hop was a task wake-up. Driven in the request's task,
//! the chunks that arrive together are decoded in one poll and leave in one write; nothing
//! waits for bytes that have not arrived.
//!
//! Invariants: a connection is in the pool only when its last response was read to the end;
//! one taken from the pool is polled once first, and dropped if the replica closed it, if it
//! cannot take a request, or if it sat idle longer than `idle_timeout` (kept below the
//! replicas' keep-alive, so a replica does not close it under a request being written). A
//! response body dropped early (client gone) drops its connection, which closes the socket and
//! makes vLLM abort the request.
//!
//! Replicas spoken to with HTTP/2 prior knowledge (h2c) are the exception: one connection per
//! replica (per data-plane thread) carries every request as a stream, so it is driven by a task
//! of its own, and requests share it ([`Links::send_h2`]). A connection that closed is replaced
//! by the next request; a request that could not be started on it is a connect failure (nothing
//! reached the replica), one that failed after is not. Dropping a response body resets its
//! stream, which vLLM sees as a disconnect.

use std::collections::HashMap;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::uri::Authority;
use http::{Request, StatusCode};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::net::TcpStream;

use crate::heads::{Headers, Place};
use crate::sock::{self, READ_CHUNK};

/// Response heads larger than this are refused.
const MAX_HEAD: usize = 64 * 1024;
/// Header lines of one response head at most.
const MAX_HEADERS: usize = 100;
/// A chunk-size line (with its extensions) longer than this is refused.
const MAX_SIZE_LINE: usize = 4096;

/// One upstream HTTP/1.1 connection and the bytes read from it past the last response.
struct Link {
    tcp: TcpStream,
    buf: BytesMut,
    /// The request head being written, kept for the connection's next request.
    head: Vec<u8>,
    idle_since: Instant,
}

/// Why an upstream request failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LinkError {
    /// No connection: nothing was sent, another replica may take the request.
    #[error("connect to {authority}: {detail}")]
    Connect { authority: String, detail: String },
    /// The request was (or may have been) sent.
    #[error(transparent)]
    Http(#[from] hyper::Error),
    #[error("the connection closed before the response")]
    Closed,
    /// Reading or writing the connection failed after the request may have been sent.
    #[error("upstream connection: {0}")]
    Io(#[from] std::io::Error),
    /// The replica's response is not HTTP/1.1 this client reads.
    #[error("malformed response from the replica: {0}")]
    Malformed(&'static str),
}

impl LinkError {
    pub fn is_connect(&self) -> bool {
        matches!(self, LinkError::Connect { .. })
    }
}

/// A map by replica authority, keyed by its text as configured. `Authority` itself hashes and
/// compares byte by byte, case-folded (its comparisons and a checkin's entry lookup took about
/// 1,100 instructions a request even with ahash: BENCHMARKS.md, 2026-12-07, afternoon); the
/// text hashes and compares a word at a time, and one replica's authority is always the same
/// text (it comes from its endpoint).
/// ahash rather than std's SipHash: the keys are the configured replicas, not client input.
type ByAuthority<V> = HashMap<Box<str>, V, ahash::RandomState>;

/// Idle connections by replica authority; one pool per data-plane thread.
#[derive(Clone)]
pub(crate) struct Links {
    idle: Arc<Mutex<ByAuthority<Vec<Link>>>>,
    /// HTTP/2 connections by replica authority, shared by their requests.
    h2: Arc<Mutex<ByAuthority<http2::SendRequest<Full<Bytes>>>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    max_idle_per_host: usize,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links")
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl Links {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Links {
            idle: Arc::default(),
            h2: Arc::default(),
            connect_timeout,
            idle_timeout,
            max_idle_per_host: 256,
        }
    }

    /// Sends a request to `authority` on an idle connection, or a new one: its head as
    /// `write_head` writes it (request line in origin form, headers, the blank line; `Host`
    /// and the body's `Content-Length` are the caller's), then `body`. Runs `written` once the
    /// request is written, before its response is awaited: work that the response does not
    /// need is done while the replica works, instead of before the request leaves (not run
    /// when the request fails before it is written). `head_only`: the request is a `HEAD`,
    /// whose response has no body whatever its head says.
    pub async fn send(
        &self,
        authority: &Authority,
        head_only: bool,
        write_head: impl FnOnce(&mut Vec<u8>),
        body: &[u8],
        written: impl FnOnce(),
    ) -> Result<Reply, LinkError> {
        // A connection just checked and idle cannot be cancelled before the request is
        // written (nothing else runs on it in between), so a failure from here on may have
        // reached the replica and is not retried.
        let mut link = match self.checkout(authority).await {
            Some(link) => link,
            None => self.connect(authority).await?,
        };
        write_request(&link.tcp, &mut link.head, write_head, body).await?;
        written();
        let (status, headers, framing, reusable) = read_head(&mut link, head_only).await?;
        let mut body = H1Body {
            link: Some(link),
            framing,
            reusable,
            home: Some((self.clone(), authority.clone())),
        };
        // A body with nothing to read is at its end now: the connection goes back at once.
        if body.framing == Framing::Length(0) {
            body.framing = Framing::Done;
            body.release();
        }
        Ok(Reply {
            status,
            headers,
            body: LinkBody(Kind::H1(body)),
        })
    }

    /// Sends `req` to `authority` over HTTP/2 (prior knowledge) on the replica's shared
    /// connection, or a new one. The request's URI must be absolute (its scheme and authority
    /// are the stream's pseudo-headers).
    pub async fn send_h2(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Reply, LinkError> {
        *req.version_mut() = http::Version::HTTP_2;
        let mut sender = self.h2_sender(authority).await?;
        if sender.ready().await.is_err() {
            // It closed before this request was sent: one fresh connection, then give up.
            self.forget_closed_h2(authority);
            sender = self.h2_sender(authority).await?;
            if let Err(e) = sender.ready().await {
                self.forget_closed_h2(authority);
                return Err(LinkError::Connect {
                    authority: authority.to_string(),
                    detail: format!("HTTP/2 connection closed: {e}"),
                });
            }
        }
        let resp = sender.send_request(req).await?;
        let (parts, inner) = resp.into_parts();
        Ok(Reply {
            status: parts.status,
            headers: Headers::Map(parts.headers),
            body: LinkBody(Kind::H2(inner)),
        })
    }

    /// The replica's open HTTP/2 connection, or a new one (its task spawned here).
    async fn h2_sender(
        &self,
        authority: &Authority,
    ) -> Result<http2::SendRequest<Full<Bytes>>, LinkError> {
        let open = self
            .h2
            .lock()
            .get(authority.as_str())
            .filter(|s| !s.is_closed())
            .cloned();
        if let Some(sender) = open {
            return Ok(sender);
        }
        let tcp = self.dial(authority).await?;
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .map_err(|e| LinkError::Connect {
                authority: authority.to_string(),
                detail: format!("HTTP/2 handshake: {e}"),
            })?;
        let who = authority.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(replica = %who, error = %e, "HTTP/2 connection ended");
            }
        });
        self.h2
            .lock()
            .insert(authority.as_str().into(), sender.clone());
        Ok(sender)
    }

    /// Drops the cached connection of `authority` if it closed (another request may have
    /// replaced it already).
    fn forget_closed_h2(&self, authority: &Authority) {
        let mut h2 = self.h2.lock();
        if h2.get(authority.as_str()).is_some_and(|s| s.is_closed()) {
            h2.remove(authority.as_str());
        }
    }

    /// An idle connection that can take a request now, if there is one.
    async fn checkout(&self, authority: &Authority) -> Option<Link> {
        loop {
            let link = self.idle.lock().get_mut(authority.as_str())?.pop()?;
            if link.idle_since.elapsed() > self.idle_timeout {
                continue;
            }
            // Idle and readable means the replica closed it (or sent what it should not).
            let usable = poll_fn(|cx| {
                Poll::Ready(match link.tcp.poll_read_ready(cx) {
                    Poll::Pending => true,
                    Poll::Ready(Err(_)) => false,
                    Poll::Ready(Ok(())) => matches!(
                        link.tcp.try_read(&mut [0u8; 1]),
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                    ),
                })
            })
            .await;
            if usable {
                return Some(link);
            }
        }
    }

    fn checkin(&self, mut link: Link, authority: Authority) {
        let mut idle = self.idle.lock();
        // Read under the lock: a list is then in the order of its links' times (checkout
        // takes the newest), and the expired ones lead it.
        let now = Instant::now();
        link.idle_since = now;
        // Looked up before it is inserted: a key is a new allocation, made once per replica.
        let list = match idle.get_mut(authority.as_str()) {
            Some(list) => list,
            None => idle.entry(authority.as_str().into()).or_default(),
        };
        // The oldest first out, so that connections the replica may time out are not kept:
        // one clock reading, not one per link, under the shared lock.
        let expired =
            list.partition_point(|l| now.duration_since(l.idle_since) > self.idle_timeout);
        list.drain(..expired);
        if list.len() < self.max_idle_per_host {
            list.push(link);
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Link, LinkError> {
        Ok(Link {
            tcp: self.dial(authority).await?,
            buf: BytesMut::with_capacity(READ_CHUNK),
            head: Vec::with_capacity(512),
            idle_since: Instant::now(),
        })
    }

    /// A TCP connection to `authority` with `TCP_NODELAY`, within the connect timeout.
    async fn dial(&self, authority: &Authority) -> Result<TcpStream, LinkError> {
        let err = |detail: String| LinkError::Connect {
            authority: authority.to_string(),
            detail,
        };
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let port = authority.port_u16().unwrap_or(80);
        let tcp = tokio::time::timeout(self.connect_timeout, TcpStream::connect((host, port)))
            .await
            .map_err(|_| {
                err(format!(
                    "no connection within {} ms",
                    self.connect_timeout.as_millis()
                ))
            })?
            .map_err(|e| err(e.to_string()))?;
        // Small SSE chunks must leave at once: Nagle's algorithm with delayed ACKs adds ~40 ms.
        tcp.set_nodelay(true).map_err(|e| err(e.to_string()))?;
        Ok(tcp)
    }
}

/// Writes a request: its head, written into the connection's buffer by `write_head`, and its
/// body, together.
async fn write_request(
    tcp: &TcpStream,
    head: &mut Vec<u8>,
    write_head: impl FnOnce(&mut Vec<u8>),
    body: &[u8],
) -> Result<(), LinkError> {
    head.clear();
    write_head(head);
    let sent = sock::write_all_vectored(tcp, [&head[..], body]).await;
    // A head grown by unusually many or long headers is not kept for the connection's life.
    if head.capacity() > 16 * 1024 {
        *head = Vec::new();
    }
    sent?;
    Ok(())
}

/// Reads more of the connection into its buffer: the bytes read (0 at the end).
fn poll_read(link: &mut Link, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
    sock::poll_read_buf(&link.tcp, &mut link.buf, cx)
}

/// How a response body ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Framing {
    /// This many bytes are left.
    Length(u64),
    Chunked(Chunk),
    /// The body runs to the connection's end.
    UntilClose,
    Done,
}

/// Where a chunked body's decoder is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chunk {
    /// Before a chunk-size line.
    Size,
    /// This many bytes of a chunk's data are left.
    Data(u64),
    /// The CRLF after a chunk's data.
    DataEnd,
    /// Trailer lines, until an empty one.
    Trailers,
}

/// Reads the response head (skipping interim 1xx heads): its status and headers, how its body
/// is framed, and whether the connection can carry another request after it.
async fn read_head(
    link: &mut Link,
    head_only: bool,
) -> Result<(StatusCode, Headers, Framing, bool), LinkError> {
    loop {
        if !link.buf.is_empty() {
            match parse_head(&link.buf, head_only)? {
                Some(Parsed::Interim(n)) => {
                    link.buf.advance(n);
                    continue;
                }
                Some(Parsed::Final(n, head)) => {
                    let bytes = link.buf.split_to(n).freeze();
                    let headers = Headers::Raw {
                        bytes,
                        at: head.headers,
                    };
                    return Ok((head.status, headers, head.framing, head.reusable));
                }
                None if link.buf.len() > MAX_HEAD => {
                    return Err(LinkError::Malformed("a response head over 64 KiB"))
                }
                None => {}
            }
        }
        if poll_fn(|cx| poll_read(link, cx)).await? == 0 {
            return Err(LinkError::Closed);
        }
    }
}

enum Parsed {
    /// A 1xx head of this many bytes, to skip.
    Interim(usize),
    /// The final head, of this many bytes.
    Final(usize, Head),
}

/// A response head's parts, as positions in its bytes.
struct Head {
    status: StatusCode,
    headers: Vec<Place>,
    framing: Framing,
    reusable: bool,
}

/// The head at the front of `buf`, if it is all there.
fn parse_head(buf: &[u8], head_only: bool) -> Result<Option<Parsed>, LinkError> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut slots);
    let n = match resp.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(_) => return Err(LinkError::Malformed("not an HTTP/1.1 response head")),
    };
    let code = resp.code.unwrap_or(0);
    let status =
        StatusCode::from_u16(code).map_err(|_| LinkError::Malformed("an invalid status code"))?;
    if status.is_informational() && code != 101 {
        return Ok(Some(Parsed::Interim(n)));
    }
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - buf.as_ptr() as usize;
        (start, start + s.len())
    };
    let mut length: Option<u64> = None;
    let mut chunked = false;
    let mut encoded = false;
    let mut reusable = resp.version == Some(1);
    let mut headers = Vec::with_capacity(resp.headers.len());
    for h in resp.headers.iter() {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            let n = sock::content_length(h.value)
                .ok_or(LinkError::Malformed("an invalid Content-Length"))?;
            if length.is_some_and(|m| m != n) {
                return Err(LinkError::Malformed("two different Content-Lengths"));
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            encoded = true;
            // Chunked only if it is the last coding.
            chunked = h
                .value
                .rsplit(|&b| b == b',')
                .next()
                .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        } else if name.eq_ignore_ascii_case(b"connection")
            && h.value
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
        {
            reusable = false;
        }
        headers.push((at(name), at(h.value)));
    }
    let framing = if head_only || code == 204 || code == 304 {
        Framing::Length(0)
    } else if encoded {
        if chunked {
            Framing::Chunked(Chunk::Size)
        } else {
            Framing::UntilClose
        }
    } else {
        length.map_or(Framing::UntilClose, Framing::Length)
    };
    if framing == Framing::UntilClose || code == 101 {
        reusable = false;
    }
    Ok(Some(Parsed::Final(
        n,
        Head {
            status,
            headers,
            framing,
            reusable,
        },
    )))
}

/// A replica's response: its status, its headers as they came, and its body.
#[derive(Debug)]
pub(crate) struct Reply {
    pub status: StatusCode,
    pub headers: Headers,
    pub body: LinkBody,
}

/// A response body that drives its connection, and gives it back to the pool when the body
/// was read to the end.
pub(crate) struct LinkBody(Kind);

enum Kind {
    H1(H1Body),
    H2(Incoming),
}

struct H1Body {
    /// `None` once the body ended or failed (the connection went back to the pool or closed).
    link: Option<Link>,
    framing: Framing,
    reusable: bool,
    home: Option<(Links, Authority)>,
}

impl std::fmt::Debug for LinkBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkBody").finish_non_exhaustive()
    }
}

impl H1Body {
    /// The body ended: the connection goes back to the pool if it can carry another request
    /// and nothing was read past this response.
    fn release(&mut self) {
        let Some(link) = self.link.take() else {
            return;
        };
        if !self.reusable || !link.buf.is_empty() {
            return;
        }
        if let Some((links, authority)) = self.home.take() {
            links.checkin(link, authority);
        }
    }

    fn fail(&mut self, detail: &'static str) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.link = None;
        self.framing = Framing::Done;
        Poll::Ready(Some(Err(detail.into())))
    }

    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        loop {
            let Some(link) = self.link.as_mut() else {
                return Poll::Ready(None);
            };
            match self.framing {
                Framing::Done | Framing::Length(0) => {
                    self.framing = Framing::Done;
                    self.release();
                    return Poll::Ready(None);
                }
                Framing::Length(left) => {
                    if !link.buf.is_empty() {
                        let n = (link.buf.len() as u64).min(left);
                        let data = link.buf.split_to(n as usize).freeze();
                        self.framing = Framing::Length(left - n);
                        if left == n {
                            self.framing = Framing::Done;
                            self.release();
                        }
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Framing::UntilClose => {
                    if !link.buf.is_empty() {
                        let data = link.buf.split().freeze();
                        return Poll::Ready(Some(Ok(Frame::data(data))));
                    }
                }
                Framing::Chunked(state) => match decode_chunk(&mut link.buf, state) {
                    Ok(Some((next, data))) => {
                        self.framing = next;
                        if let Some(data) = data {
                            if next == Framing::Done {
                                self.release();
                            }
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                        continue;
                    }
                    Ok(None) => {}
                    Err(detail) => return self.fail(detail),
                },
            }
            // More bytes are needed.
            match std::task::ready!(poll_read(link, cx)) {
                Ok(0) if self.framing == Framing::UntilClose => {
                    self.framing = Framing::Done;
                    self.link = None;
                    return Poll::Ready(None);
                }
                Ok(0) => return self.fail("the replica closed the connection mid-body"),
                Ok(_) => {}
                Err(e) => {
                    self.link = None;
                    self.framing = Framing::Done;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One step of a chunked body's decoder over what `buf` holds: the next state and a chunk's
/// data if some is there, or `None` when more bytes are needed first.
#[allow(clippy::type_complexity)]
fn decode_chunk(
    buf: &mut BytesMut,
    state: Chunk,
) -> Result<Option<(Framing, Option<Bytes>)>, &'static str> {
    let line_end = |buf: &BytesMut, limit: usize| match memchr::memchr(b'\n', buf) {
        Some(i) => Ok(Some(i)),
        None if buf.len() > limit => Err("a chunk-size or trailer line too long"),
        None => Ok(None),
    };
    let chunked = |c: Chunk, data: Option<Bytes>| Ok(Some((Framing::Chunked(c), data)));
    match state {
        Chunk::Size => {
            let Some(i) = line_end(buf, MAX_SIZE_LINE)? else {
                return Ok(None);
            };
            let line = buf.split_to(i + 1);
            let digits = line[..]
                .split(|&b| b == b';' || b == b'\r' || b == b'\n')
                .next()
                .unwrap_or_default()
                .trim_ascii();
            if digits.is_empty() || digits.len() > 15 {
                return Err("an invalid chunk size");
            }
            let mut size = 0u64;
            for &d in digits {
                let v = (d as char).to_digit(16).ok_or("an invalid chunk size")?;
                size = size * 16 + u64::from(v);
            }
            if size == 0 {
                chunked(Chunk::Trailers, None)
            } else {
                chunked(Chunk::Data(size), None)
            }
        }
        Chunk::Data(left) => {
            if buf.is_empty() {
                return Ok(None);
            }
            let n = (buf.len() as u64).min(left);
            let data = buf.split_to(n as usize).freeze();
            if n == left {
                chunked(Chunk::DataEnd, Some(data))
            } else {
                chunked(Chunk::Data(left - n), Some(data))
            }
        }
        Chunk::DataEnd => match (buf.first(), buf.get(1)) {
            (None, _) | (Some(b'\r'), None) => Ok(None),
            (Some(b'\n'), _) => {
                buf.advance(1);
                chunked(Chunk::Size, None)
            }
            (Some(b'\r'), Some(b'\n')) => {
                buf.advance(2);
                chunked(Chunk::Size, None)
            }
            _ => Err("no line end after a chunk's data"),
        },
        Chunk::Trailers => {
            let Some(i) = line_end(buf, MAX_HEAD)? else {
                return Ok(None);
            };
            let line = buf.split_to(i + 1);
            if line.trim_ascii().is_empty() {
                Ok(Some((Framing::Done, None)))
            } else {
                chunked(Chunk::Trailers, None)
            }
        }
    }
}

impl Body for LinkBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().0 {
            Kind::H1(b) => {
                let polled = b.poll_frame(cx);
                if b.framing == Framing::Done {
                    b.release();
                }
                polled
            }
            Kind::H2(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Kind::H1(b) => b.framing == Framing::Done,
            Kind::H2(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Kind::H1(b) => match b.framing {
                Framing::Length(n) => SizeHint::with_exact(n),
                Framing::Done => SizeHint::with_exact(0),
                _ => SizeHint::default(),
            },
            Kind::H2(b) => b.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use http_body_util::BodyExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A replica that answers each request on a connection with `body` (keep-alive), or closes
    /// after the first answer when `close`; counts the connections it accepted.
    async fn replica(body: &'static str, close: bool) -> (Authority, Arc<AtomicUsize>) {
        let answer = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        scripted(answer.into_bytes(), 1, close).await
    }

    /// `GET /x`'s head for `authority`, as `Links::send` writes it.
    fn get(authority: &Authority) -> impl FnOnce(&mut Vec<u8>) + '_ {
        move |out: &mut Vec<u8>| {
            out.extend_from_slice(
                format!("GET /x HTTP/1.1\r\nhost: {authority}\r\n\r\n").as_bytes(),
            )
        }
    }

    /// `HEAD /x`'s head for `authority`.
    fn head(authority: &Authority) -> impl FnOnce(&mut Vec<u8>) + '_ {
        move |out: &mut Vec<u8>| {
            out.extend_from_slice(
                format!("HEAD /x HTTP/1.1\r\nhost: {authority}\r\n\r\n").as_bytes(),
            )
        }
    }

    /// `GET /x` as a request, for HTTP/2.
    fn request(authority: &Authority) -> Request<Full<Bytes>> {
        Request::builder()
            .uri(format!("http://{authority}/x"))
            .header(http::header::HOST, authority.as_str())
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn read_all(links: &Links, authority: &Authority) -> String {
        let resp = links
            .send(authority, false, get(authority), &[], || ())
            .await
            .unwrap();
        assert_eq!(resp.status, 200);
        let body = resp.body.collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    /// An HTTP/2-only replica answering every request with its HTTP version; its connections
    /// close when `close` is notified. Counts the connections it accepted.
    async fn h2_replica(close: Arc<tokio::sync::Notify>) -> (Authority, Arc<AtomicUsize>) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let close = close.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(|req: Request<Incoming>| async move {
                        let v = format!("{:?}", req.version());
                        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(
                            Bytes::from(v),
                        )))
                    });
                    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(sock), svc);
                    tokio::select! {
                        _ = conn => {}
                        // Dropping the connection closes the socket.
                        _ = close.notified() => {}
                    }
                });
            }
        });
        (Authority::try_from(addr.to_string()).unwrap(), accepted)
    }

    async fn read_all_h2(links: &Links, authority: &Authority) -> String {
        let resp = links.send_h2(authority, request(authority)).await.unwrap();
        assert_eq!(resp.status, 200);
        let body = resp.body.collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn h2c_requests_share_one_connection_and_a_closed_one_is_replaced() {
        let close = Arc::new(tokio::sync::Notify::new());
        let (authority, accepted) = h2_replica(close.clone()).await;
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        assert_eq!(read_all_h2(&links, &authority).await, "HTTP/2.0");
        let together =
            futures_util::future::join_all((0..4).map(|_| read_all_h2(&links, &authority))).await;
        assert!(together.iter().all(|v| v == "HTTP/2.0"), "{together:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);

        close.notify_waiters();
        // Wait until the client side has seen the close (no request races it then).
        let deadline = Instant::now() + Duration::from_secs(10);
        while !links
            .h2
            .lock()
            .get(authority.as_str())
            .is_some_and(|s| s.is_closed())
        {
            assert!(Instant::now() < deadline, "the close was never seen");
            tokio::task::yield_now().await;
        }
        assert_eq!(read_all_h2(&links, &authority).await, "HTTP/2.0");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_connection_read_to_the_end_is_reused() {
        let (authority, accepted) = replica("hello", false).await;
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        for _ in 0..3 {
            assert_eq!(read_all(&links, &authority).await, "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_idle_too_long_is_not_reused() {
        let (authority, accepted) = replica("hello", false).await;
        let links = Links::new(Duration::from_secs(2), Duration::ZERO);
        for _ in 0..2 {
            assert_eq!(read_all(&links, &authority).await, "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Checking a connection in drops the ones that sat idle past the timeout, however many
    /// lead the list, and keeps the younger ones in order.
    #[tokio::test]
    async fn checking_in_drops_the_connections_idle_too_long() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let authority: Authority = addr.to_string().parse().unwrap();
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(2));
        let now = Instant::now();
        // Well past the timeout or well inside it, whatever this test itself takes.
        let since: Vec<Instant> = [9_000, 7_000, 3_000, 1_000, 500]
            .iter()
            .map(|&ms| now.checked_sub(Duration::from_millis(ms)).unwrap())
            .collect();
        // The five listed, then the one checked in.
        let mut listed = Vec::new();
        for &idle_since in since.iter().chain([&now]) {
            listed.push(Link {
                tcp: TcpStream::connect(addr).await.unwrap(),
                buf: BytesMut::new(),
                head: Vec::new(),
                idle_since,
            });
        }
        let fresh = listed.pop().unwrap();
        links.idle.lock().insert(authority.as_str().into(), listed);
        links.checkin(fresh, authority.clone());
        let idle = links.idle.lock();
        let kept: Vec<Instant> = idle[authority.as_str()]
            .iter()
            .map(|l| l.idle_since)
            .collect();
        assert_eq!(kept.len(), 3, "{kept:?}");
        assert_eq!(kept[..2], since[3..]);
        assert!(kept[2] >= now);
    }

    #[tokio::test]
    async fn a_connection_the_replica_closed_is_replaced() {
        let (authority, accepted) = replica("bye", true).await;
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        for _ in 0..3 {
            assert_eq!(read_all(&links, &authority).await, "bye");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_body_dropped_early_takes_its_connection_with_it() {
        let (authority, accepted) = replica("a longer answer", false).await;
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        let resp = links
            .send(&authority, false, get(&authority), &[], || ())
            .await
            .unwrap();
        drop(resp);
        assert_eq!(read_all(&links, &authority).await, "a longer answer");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    /// Decodes a whole chunked body fed `step` bytes at a time: its data, or the error.
    fn dechunk(wire: &[u8], step: usize) -> Result<Vec<u8>, &'static str> {
        let (mut buf, mut state, mut data) = (BytesMut::new(), Chunk::Size, Vec::new());
        let mut fed = 0;
        loop {
            match decode_chunk(&mut buf, state)? {
                Some((Framing::Done, _)) => {
                    assert!(buf.is_empty() && fed == wire.len(), "ended early at {fed}");
                    return Ok(data);
                }
                Some((Framing::Chunked(next), d)) => {
                    data.extend_from_slice(&d.unwrap_or_default());
                    state = next;
                }
                Some(other) => panic!("{other:?}"),
                None if fed == wire.len() => return Err("incomplete"),
                None => {
                    let to = (fed + step).min(wire.len());
                    buf.extend_from_slice(&wire[fed..to]);
                    fed = to;
                }
            }
        }
    }

    /// Chunk sizes in either case, extensions, bare LF line ends, data that looks like a last
    /// chunk, and trailers, fed whole or in any size of piece; and what is refused.
    #[test]
    fn chunked_bodies_decode_in_any_split() {
        let wire: &[u8] =
            b"5;x=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n5\n0\r\n\r\n\n0\r\nx-t: 1\r\n\r\n";
        for step in [1, 2, 3, 7, 64, wire.len()] {
            assert_eq!(
                dechunk(wire, step).as_deref(),
                Ok(&b"helloabcdefghijklmnopqrstuvwxyz0\r\n\r\n"[..]),
                "{step}"
            );
        }
        assert!(dechunk(b"z\r\n", 1).is_err());
        assert!(dechunk(b"\r\n", 1).is_err());
        assert!(dechunk(b"3\r\nabcX\r\n0\r\n\r\n", 1).is_err());
        assert!(dechunk(b"ffffffffffffffff\r\n", 64).is_err());
        assert_eq!(dechunk(b"3\r\nabc\r\n", 1), Err("incomplete"));
    }

    /// A replica that answers every request head on a connection with `answer`, written in
    /// `pieces` writes, and closes the connection after the first answer when `close` (the
    /// test requests have no body); counts the connections it accepted.
    async fn scripted(
        answer: impl Into<Vec<u8>>,
        pieces: usize,
        close: bool,
    ) -> (Authority, Arc<AtomicUsize>) {
        let answer: Arc<[u8]> = answer.into().into();
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let answer = answer.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut seen = Vec::new();
                    loop {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            for (i, piece) in
                                answer.chunks(answer.len().div_ceil(pieces)).enumerate()
                            {
                                if i > 0 {
                                    tokio::task::yield_now().await;
                                }
                                if sock.write_all(piece).await.is_err() {
                                    return;
                                }
                            }
                            if close {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (Authority::try_from(addr.to_string()).unwrap(), accepted)
    }

    /// Chunked answers (after an interim 100), bodies without a length, `Connection: close`
    /// and `HEAD`: the data is what was sent, and a connection is reused exactly when the
    /// answer allows it.
    #[tokio::test]
    async fn responses_are_framed_as_sent_and_connections_reused_only_when_allowed() {
        let chunked: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\ndata\r\n7;e=x\r\n: more\n\r\n0\r\nx-trailer: t\r\n\r\n";
        for pieces in [1, 5, 40] {
            let (authority, accepted) = scripted(chunked, pieces, false).await;
            let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
            for _ in 0..3 {
                assert_eq!(read_all(&links, &authority).await, "data: more\n");
            }
            assert_eq!(accepted.load(Ordering::SeqCst), 1, "{pieces} pieces");
        }
        let cases: [(&[u8], &str, usize); 3] = [
            (b"HTTP/1.1 200 OK\r\n\r\nto the end", "to the end", 3),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                "ok",
                3,
            ),
            (
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok",
                "ok",
                1,
            ),
        ];
        for (answer, body, connections) in cases {
            let (authority, accepted) = scripted(answer, 2, false).await;
            let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
            for _ in 0..3 {
                // Bodies read to the close need the replica to close: it does when the next
                // request finds the connection gone, so each is read on its own connection.
                let resp = links
                    .send(&authority, false, get(&authority), &[], || ())
                    .await
                    .unwrap();
                if body == "to the end" {
                    let mut b = resp.body;
                    let frame = b.frame().await.unwrap().unwrap().into_data().unwrap();
                    assert_eq!(&frame[..], body.as_bytes());
                    continue;
                }
                let got = resp.body.collect().await.unwrap().to_bytes();
                assert_eq!(&got[..], body.as_bytes());
            }
            assert_eq!(accepted.load(Ordering::SeqCst), connections, "{body}");
        }
        // HEAD: a length but no body; the connection carries the next request.
        let (authority, accepted) = scripted(
            &b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n"[..],
            1,
            false,
        )
        .await;
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        for _ in 0..2 {
            let resp = links
                .send(&authority, true, head(&authority), &[], || ())
                .await
                .unwrap();
            assert_eq!(resp.headers.get("content-length"), Some(&b"9"[..]));
            assert!(resp.body.collect().await.unwrap().to_bytes().is_empty());
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error_and_nothing_is_written() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = Authority::try_from(l.local_addr().unwrap().to_string()).unwrap();
        drop(l);
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        let mut written = false;
        let err = links
            .send(&authority, false, get(&authority), &[], || written = true)
            .await
            .unwrap_err();
        assert!(err.is_connect(), "{err}");
        assert!(!written);
    }

    /// The replica answers only once `written` has run: a send that ran it after reading the
    /// response would wait forever (the test's timeout says so instead).
    #[tokio::test]
    async fn written_runs_after_the_request_is_sent_and_before_the_answer() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = Authority::try_from(l.local_addr().unwrap().to_string()).unwrap();
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let replica = tokio::spawn(async move {
            let (mut sock, _) = l.accept().await.unwrap();
            let mut got = Vec::new();
            while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                let mut buf = [0u8; 1024];
                let n = sock.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed before the request's head");
                got.extend_from_slice(&buf[..n]);
            }
            wait.await.unwrap();
            sock.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                .await
                .unwrap();
            got
        });
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        let mut go = Some(go);
        let mut runs = 0;
        let sent = links.send(&authority, false, get(&authority), &[], || {
            runs += 1;
            go.take().unwrap().send(()).unwrap();
        });
        let resp = tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .expect("the answer waited for `written`, which never ran")
            .unwrap();
        assert_eq!(runs, 1);
        let body = resp.body.collect().await.unwrap().to_bytes();
        assert_eq!(&body[..], b"ok");
        let got = replica.await.unwrap();
        assert!(got.starts_with(b"GET /x HTTP/1.1\r\n"), "{got:?}");
    }
}
