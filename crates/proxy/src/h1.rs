//! The data port's HTTP/1.1 path for plain requests: heads parsed with `httparse` (the parser
//! hyper uses), the handler called in the connection's own task, its response written in as
//! few writes as its frames allow. Anything else on a connection is handed, with the bytes
//! already read, to hyper's server for the rest of that connection's life.
//!
//! Why: hyper's server does more than these requests need (the request body through a
//! channel, a dispatcher polling the service, a protocol sniffer and a larger state per
//! connection); this path measured 3–4 % fewer router instructions per request on kept-alive
//! connections and about half of what opening a connection costs (BENCHMARKS.md, "the data
//! port's HTTP/1.1 fast path").
//!
//! What this path serves, and what it hands to hyper: a request is served here only if its
//! head parses, is HTTP/1.1, `GET` or `POST`, has an origin-form target, at most one
//! `Content-Length` and no `Transfer-Encoding`, `Expect`, `Upgrade`, or a `Connection` other
//! than `keep-alive` or `close`. The first request that is not (HTTP/2's preface, HTTP/1.0, a
//! chunked or `100-continue` body, a malformed or oversized head, any other method) hands the
//! connection over before anything of that request is answered, so hyper answers it exactly
//! as it would have; the connection stays with hyper.
//!
//! Invariants: requests are answered in order, one at a time (pipelined bytes wait in the
//! buffer); a request's body is read from the socket only by its [`LeanBody`], and the
//! connection reads nothing else until that body is whole; while a whole request waits for
//! its response, the connection watches the socket and drops the handler (which drops the
//! upstream request) when the client closes, as hyper does without half-close; a response
//! whose body ends short of its `Content-Length`, a body the handler left unread beyond what
//! can be drained, and `Connection: close` on either side end the connection after that
//! response; stopping the port closes an idle connection and lets one in flight finish its
//! response first.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri};
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::heads::{Headers, Place, WireHeaders};
use crate::sock::{self, READ_CHUNK};

/// Heads larger than this are left to hyper (which answers 431 past its own limit).
const MAX_HEAD: usize = 64 * 1024;
/// Headers of one head parsed here; more: left to hyper (its limit is 100).
const MAX_HEADERS: usize = 64;
/// A body the handler left unread is read and dropped up to this much before the next
/// request; beyond it the connection closes.
const MAX_DRAIN: u64 = 256 * 1024;

/// A request body: hyper's, or one read by this path.
#[derive(Debug)]
pub(crate) enum ReqBody {
    Hyper(Incoming),
    Lean(LeanBody),
}

impl Body for ReqBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.get_mut() {
            ReqBody::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ReqBody::Lean(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ReqBody::Hyper(b) => b.is_end_stream(),
            ReqBody::Lean(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            ReqBody::Hyper(b) => b.size_hint(),
            ReqBody::Lean(b) => b.size_hint(),
        }
    }
}

/// A request as a port's handler gets it from either HTTP path: this path hands its head's
/// headers on as bytes ([`Headers::Raw`]), hyper's path its map.
#[derive(Debug)]
pub(crate) struct Req {
    pub method: Method,
    pub uri: Uri,
    pub headers: Headers,
    pub body: ReqBody,
}

impl Req {
    /// A request hyper read.
    pub fn from_http(req: Request<Incoming>) -> Self {
        let (parts, body) = req.into_parts();
        Req {
            method: parts.method,
            uri: parts.uri,
            headers: Headers::Map(parts.headers),
            body: ReqBody::Hyper(body),
        }
    }

    /// The same request for a handler that takes `http`'s (the admin port's router).
    pub fn into_http(self) -> Request<ReqBody> {
        let mut req = Request::new(self.body);
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers.into_map();
        req
    }
}

/// A response as a port's handler gives it: `headers`, then `wire` (a replica's end-to-end
/// headers, as bytes), then the body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub wire: Option<WireHeaders>,
    pub body: axum::body::Body,
}

impl From<Response<axum::body::Body>> for Answer {
    fn from(resp: Response<axum::body::Body>) -> Self {
        let (parts, body) = resp.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            wire: None,
            body,
        }
    }
}

impl Answer {
    /// The response as hyper sends it: the wire headers turned back into the map.
    pub fn into_response(self) -> Response<axum::body::Body> {
        let mut headers = self.headers;
        if let Some(wire) = self.wire {
            wire.into_map(&mut headers);
        }
        let mut resp = Response::new(self.body);
        *resp.status_mut() = self.status;
        *resp.headers_mut() = headers;
        resp
    }
}

/// The client socket, shared by the connection and the body of its current request, and how
/// many bytes of that body are still to be read from it.
#[derive(Debug)]
struct Socket {
    tcp: TcpStream,
    left: AtomicU64,
}

/// A `Content-Length` body: what came with the head, then the rest read from the socket.
#[derive(Debug)]
pub(crate) struct LeanBody {
    first: Option<Bytes>,
    socket: Option<Arc<Socket>>,
}

impl LeanBody {
    fn left(&self) -> u64 {
        self.socket
            .as_ref()
            .map_or(0, |s| s.left.load(Ordering::Relaxed))
    }
}

impl Body for LeanBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, std::io::Error>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(Frame::data(first))));
        }
        let Some(socket) = self.socket.as_ref() else {
            return Poll::Ready(None);
        };
        let left = socket.left.load(Ordering::Relaxed);
        if left == 0 {
            return Poll::Ready(None);
        }
        // Never past this body: the next request's bytes are the connection's to read.
        let want = left.min(READ_CHUNK as u64) as usize;
        let mut buf = BytesMut::new();
        match ready!(sock::poll_read_at_most(&socket.tcp, &mut buf, want, cx)) {
            Ok(0) => Poll::Ready(Some(Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the client closed the connection before the end of the body",
            )))),
            Ok(n) => {
                socket.left.store(left - n as u64, Ordering::Relaxed);
                Poll::Ready(Some(Ok(Frame::data(buf.freeze()))))
            }
            Err(e) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.left() == 0
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.first.as_ref().map_or(0, |b| b.len() as u64) + self.left())
    }
}

/// What the connection reports to its watchdog.
pub(crate) trait Watch {
    /// A request in flight until dropped.
    type Active;
    /// A head began but is not whole (or the connection goes to hyper): `bytes` are all
    /// those buffered since the last request, from the first (repeated calls are harmless).
    fn read(&self, bytes: &[u8]);
    /// A whole head arrived: its request is in flight.
    fn begin(&self) -> Self::Active;
}

/// How a connection left this path.
pub(crate) enum Ended {
    /// Closed (by either side, or for good reason); nothing more to do.
    Closed,
    /// The next request is not one this path serves: hyper takes the socket and the bytes
    /// read from it so far.
    Handover(TcpStream, Bytes),
}

/// Serves `tcp` until it closes or a request needs hyper.
pub(crate) async fn serve<W, C, F>(
    tcp: TcpStream,
    watch: &W,
    call: C,
    stop: &CancellationToken,
) -> Ended
where
    W: Watch,
    C: Fn(Req) -> F,
    F: Future<Output = Answer>,
{
    let socket = Arc::new(Socket {
        tcp,
        left: AtomicU64::new(0),
    });
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    let mut out: Vec<u8> = Vec::with_capacity(4096);
    // The handler's future lives in one box for the connection's life (as in hyper's
    // dispatcher): kept inline, it would make every connection's task as large as a routed
    // request's state, copied whole when the task is spawned.
    let mut in_flight: Pin<Box<Option<F>>> = Box::pin(None);
    // One wait for the connection's life: a fresh one per head registers with the token and
    // leaves it again under the token's lock.
    let stopped = stop.cancelled();
    tokio::pin!(stopped);
    loop {
        // The watchdog hears of a head only when it does not come whole: one that does is in
        // flight at once, and timing it would cost a wake-up per request.
        let mut head = loop {
            if !buf.is_empty() {
                match parse(&buf) {
                    Parsed::Complete(h) => break h,
                    Parsed::Partial if buf.len() <= MAX_HEAD => watch.read(&buf),
                    Parsed::Partial | Parsed::Other => {
                        watch.read(&buf);
                        return handover(socket, buf);
                    }
                }
            }
            tokio::select! {
                biased;
                () = &mut stopped => return Ended::Closed,
                r = read_more(&socket.tcp, &mut buf) => match r {
                    Ok(0) | Err(_) => return Ended::Closed,
                    Ok(_) => {}
                },
            }
        };
        let bytes = buf.split_to(head.len).freeze();
        let Some((method, uri, headers)) = head_parts(&mut head, bytes.clone()) else {
            // The head goes back in front of what followed it, for hyper to read.
            let mut all = BytesMut::with_capacity(bytes.len() + buf.len());
            all.extend_from_slice(&bytes);
            all.extend_from_slice(&buf);
            watch.read(&all);
            return handover(socket, all);
        };
        let close = head.close;
        let active = watch.begin();
        let req = Req {
            method,
            uri,
            headers,
            body: request_body(&head, &mut buf, &socket),
        };
        in_flight.set(Some(call(req)));
        let resp = or_gone(&socket, &mut buf, |cx| {
            match in_flight.as_mut().as_pin_mut() {
                Some(fut) => fut.poll(cx),
                None => Poll::Pending,
            }
        })
        .await;
        in_flight.set(None);
        let Some(resp) = resp else {
            return Ended::Closed;
        };
        let close = close || stop.is_cancelled();
        let kept = write_response(&socket, &mut buf, &mut out, resp, close).await;
        drop(active);
        if !kept || close || stop.is_cancelled() || !drain(&socket, &mut buf).await {
            return Ended::Closed;
        }
    }
}

/// Hands the socket to hyper, unless a body of an earlier request still holds it (then the
/// connection closes).
fn handover(socket: Arc<Socket>, buf: BytesMut) -> Ended {
    match Arc::try_unwrap(socket) {
        Ok(s) => Ended::Handover(s.tcp, buf.freeze()),
        Err(_) => Ended::Closed,
    }
}

/// Polls `f` until it is ready; meanwhile, once the request's body is whole, reads what the
/// client sends: bytes are the next request's (kept in `buf`), EOF or an error means the client
/// left (`None`: hyper without half-close does the same).
async fn or_gone<T>(
    socket: &Socket,
    buf: &mut BytesMut,
    mut f: impl FnMut(&mut Context<'_>) -> Poll<T>,
) -> Option<T> {
    poll_fn(|cx| {
        if let Poll::Ready(r) = f(cx) {
            return Poll::Ready(Some(r));
        }
        if socket.left.load(Ordering::Relaxed) == 0 && buf.len() < MAX_HEAD {
            loop {
                match sock::poll_read_buf(&socket.tcp, buf, cx) {
                    Poll::Pending => break,
                    Poll::Ready(Ok(0) | Err(_)) => return Poll::Ready(None),
                    Poll::Ready(Ok(_)) if buf.len() >= MAX_HEAD => break,
                    Poll::Ready(Ok(_)) => {}
                }
            }
        }
        Poll::Pending
    })
    .await
}

async fn read_more(tcp: &TcpStream, buf: &mut BytesMut) -> std::io::Result<usize> {
    poll_fn(|cx| sock::poll_read_buf(tcp, buf, cx)).await
}

/// Reads and drops what the handler left of its body (up to [`MAX_DRAIN`]); whether the
/// connection can carry the next request.
async fn drain(socket: &Socket, buf: &mut BytesMut) -> bool {
    let left = socket.left.load(Ordering::Relaxed);
    if left == 0 {
        return true;
    }
    if left > MAX_DRAIN {
        return false;
    }
    let mut left = left as usize;
    while left > 0 {
        if buf.is_empty() {
            match read_more(&socket.tcp, buf).await {
                Ok(0) | Err(_) => return false,
                Ok(_) => {}
            }
        }
        let n = left.min(buf.len());
        let _ = buf.split_to(n);
        left -= n;
    }
    socket.left.store(0, Ordering::Relaxed);
    true
}

/// A parsed head: where its parts lie in the buffer.
struct Head {
    len: usize,
    method: Method,
    target: (usize, usize),
    headers: Vec<Place>,
    content_length: u64,
    close: bool,
}

enum Parsed {
    Complete(Head),
    Partial,
    /// Not a request this path serves.
    Other,
}

fn parse(buf: &[u8]) -> Parsed {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut slots);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Parsed::Partial,
        Err(_) => return Parsed::Other,
    };
    let method = match req.method {
        Some("POST") => Method::POST,
        Some("GET") => Method::GET,
        _ => return Parsed::Other,
    };
    let (Some(1), Some(path)) = (req.version, req.path) else {
        return Parsed::Other;
    };
    if !path.starts_with('/') {
        return Parsed::Other;
    }
    let at = |s: &[u8]| {
        let start = s.as_ptr() as usize - buf.as_ptr() as usize;
        (start, start + s.len())
    };
    let mut content_length = None;
    let mut close = false;
    let mut headers = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        let name = h.name.as_bytes();
        if name.eq_ignore_ascii_case(b"content-length") {
            match (sock::content_length(h.value), content_length) {
                (Some(n), None) => content_length = Some(n),
                _ => return Parsed::Other,
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding")
            || name.eq_ignore_ascii_case(b"expect")
            || name.eq_ignore_ascii_case(b"upgrade")
        {
            return Parsed::Other;
        } else if name.eq_ignore_ascii_case(b"connection") {
            if h.value.eq_ignore_ascii_case(b"close") {
                close = true;
            } else if !h.value.eq_ignore_ascii_case(b"keep-alive") {
                return Parsed::Other;
            }
        }
        headers.push((at(name), at(h.value)));
    }
    let content_length = content_length.unwrap_or(0);
    if method == Method::GET && content_length > 0 {
        return Parsed::Other;
    }
    Parsed::Complete(Head {
        len,
        method,
        target: at(path.as_bytes()),
        headers,
        content_length,
        close,
    })
}

/// The method, target and headers of a parsed head, whose bytes are `bytes`, or `None` if the
/// target is not one `http` accepts (hyper then answers it). The headers stay the head's
/// bytes and their places in them ([`Headers::Raw`]): `httparse` has checked each name and
/// value as `http` would, so none needs a map's checks again.
fn head_parts(head: &mut Head, bytes: Bytes) -> Option<(Method, Uri, Headers)> {
    let (t0, t1) = head.target;
    bytes.get(t0..t1)?;
    let uri = Uri::from_maybe_shared(bytes.slice(t0..t1)).ok()?;
    let at = std::mem::take(&mut head.headers);
    Some((head.method.clone(), uri, Headers::Raw { bytes, at }))
}

/// What the fuzz target and the property test check of any bytes: parsing them never panics,
/// a complete head lies inside them, and its parts either build (with its method) or send the
/// connection to hyper. Whether the head was complete.
pub fn check_head(bytes: &[u8]) -> bool {
    let Parsed::Complete(h) = parse(bytes) else {
        return false;
    };
    let inside = |(a, b): (usize, usize)| a <= b && b <= h.len;
    assert!(h.len <= bytes.len(), "a head longer than its input");
    assert!(
        inside(h.target) && h.headers.iter().all(|&(n, v)| inside(n) && inside(v)),
        "a part of the head outside it"
    );
    let mut h = h;
    let method = h.method.clone();
    let head = Bytes::copy_from_slice(&bytes[..h.len]);
    if let Some((m, _, headers)) = head_parts(&mut h, head) {
        assert_eq!(m, method);
        assert_eq!(
            headers.iter().count(),
            headers.count(),
            "a header outside its head"
        );
    }
    true
}

/// The body of `head`'s request (the head already taken off the front of `buf`): what came of
/// it with the head, then the rest from the socket.
fn request_body(head: &Head, buf: &mut BytesMut, socket: &Arc<Socket>) -> ReqBody {
    let n = head.content_length.min(buf.len() as u64) as usize;
    let first = (n > 0).then(|| buf.split_to(n).freeze());
    let rest = head.content_length - n as u64;
    socket.left.store(rest, Ordering::Relaxed);
    ReqBody::Lean(LeanBody {
        first,
        socket: (rest > 0).then(|| socket.clone()),
    })
}

/// Writes a response (saying `connection: close` when `closing`, as hyper does); whether the
/// connection can carry another request.
async fn write_response(
    socket: &Socket,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    answer: Answer,
    closing: bool,
) -> bool {
    let Answer {
        status,
        headers,
        wire,
        body,
    } = answer;
    let no_body = status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
        || status.is_informational();
    let declared = match &wire {
        Some(w) => w.content_length,
        None => headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok()),
    };
    let length = if no_body {
        Some(0)
    } else {
        declared.or(body.size_hint().exact())
    };
    let mut close = false;
    let mut has_connection = false;
    out.clear();
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(b"\r\n");
    let mut dated = false;
    if let Some(w) = &wire {
        out.extend_from_slice(&w.lines);
        dated = w.dated;
    }
    for (name, value) in &headers {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        if name == header::CONNECTION {
            close |= value.as_bytes().eq_ignore_ascii_case(b"close");
            has_connection = true;
        }
        dated |= name == header::DATE;
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match length {
        Some(n) if !no_body => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa(n, &mut [0u8; 20]));
            out.extend_from_slice(b"\r\n");
        }
        Some(_) => {}
        None => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if closing && !has_connection {
        out.extend_from_slice(b"connection: close\r\n");
    }
    if !dated {
        out.extend_from_slice(b"date: ");
        date(out);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"\r\n");
    if no_body {
        return sock::write_all(&socket.tcp, out).await.is_ok() && !close;
    }
    write_body(socket, buf, out, body, length).await && !close
}

/// The body's next frame: at once if it is ready; otherwise `out` is written first, then the
/// frame is waited for while watching for the client leaving. `None`: the write failed or the
/// client left.
async fn next_frame(
    socket: &Socket,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    body: &mut axum::body::Body,
) -> Option<Option<Result<Frame<Bytes>, axum::Error>>> {
    if let Poll::Ready(f) = poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx))).await {
        return Some(f);
    }
    sock::write_all(&socket.tcp, out).await.ok()?;
    out.clear();
    or_gone(socket, buf, |cx| Pin::new(&mut *body).poll_frame(cx)).await
}

/// Appends the body's frames to `out`, writing whenever the next one is not ready yet (and
/// watching for the client leaving while it waits): as they are when the body is `Some(n)`
/// bytes (exactly: more is cut at `n` and ends the connection, fewer fails it), else each a
/// chunk, then the last chunk. A broken body ends without the last chunk (or short), so the
/// client sees it did not end. Whether the body went out whole.
async fn write_body(
    socket: &Socket,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    mut body: axum::body::Body,
    length: Option<u64>,
) -> bool {
    let tcp = &socket.tcp;
    let mut sent = 0u64;
    loop {
        let Some(next) = next_frame(socket, buf, out, &mut body).await else {
            return false;
        };
        match next {
            Some(Ok(frame)) => {
                let Ok(data) = frame.into_data() else {
                    continue;
                };
                sent += data.len() as u64;
                match length {
                    Some(n) if sent > n => {
                        // More than declared: what was declared goes out, then the connection ends.
                        let over = (sent - n) as usize;
                        out.extend_from_slice(&data[..data.len() - over]);
                        let _ = sock::write_all(tcp, out).await;
                        return false;
                    }
                    Some(_) => out.extend_from_slice(&data),
                    None if data.is_empty() => {}
                    None => {
                        let mut hex = [0u8; 16];
                        out.extend_from_slice(hex_len(data.len(), &mut hex));
                        out.extend_from_slice(b"\r\n");
                        out.extend_from_slice(&data);
                        out.extend_from_slice(b"\r\n");
                    }
                }
            }
            Some(Err(_)) => {
                let _ = sock::write_all(tcp, out).await;
                return false;
            }
            None => {
                if length.is_none() {
                    out.extend_from_slice(b"0\r\n\r\n");
                }
                return sock::write_all(tcp, out).await.is_ok() && length.is_none_or(|n| sent == n);
            }
        }
    }
}

fn itoa(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

fn hex_len(mut n: usize, buf: &mut [u8; 16]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b"0123456789abcdef"[n % 16];
        n /= 16;
        if n == 0 {
            return &buf[i..];
        }
    }
}

/// Appends the current time as an HTTP date, formatted once per second per thread.
fn date(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: RefCell<(u64, String)> = const { RefCell::new((u64::MAX, String::new())) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with_borrow_mut(|(at, text)| {
        if *at != secs {
            *at = secs;
            *text = httpdate::fmt_http_date(now);
        }
        out.extend_from_slice(text.as_bytes());
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(raw: &str) -> Option<Head> {
        match parse(raw.as_bytes()) {
            Parsed::Complete(h) => Some(h),
            _ => None,
        }
    }

    #[test]
    fn plain_requests_are_served_here_and_everything_else_is_handed_over() {
        let ok =
            head("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\n\r\n")
                .map(|h| (h.method, h.content_length, h.close, h.headers.len()));
        assert_eq!(ok, Some((Method::POST, 12, false, 2)));
        let close = head("GET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n");
        assert!(close.is_some_and(|h| h.close && h.content_length == 0));
        for other in [
            "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
            "GET / HTTP/1.0\r\n\r\n",
            "PUT / HTTP/1.1\r\n\r\n",
            "HEAD /v1/models HTTP/1.1\r\n\r\n",
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
            "POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
            "POST / HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
            "GET / HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
            "GET / HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
            "GET http://x/ HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        ] {
            assert!(
                matches!(parse(other.as_bytes()), Parsed::Other),
                "{other:?} should be handed over"
            );
        }
        assert!(matches!(
            parse(b"POST /v1/completions HTTP/1.1\r\nHost"),
            Parsed::Partial
        ));
    }

    /// A target `httparse` takes and `http` does not (`<`, `>` and a backtick are such bytes):
    /// the head is whole here, and its parts do not build (the connection goes to hyper).
    #[test]
    fn a_target_http_refuses_goes_to_hyper() {
        let raw = b"GET /v1/models<x> HTTP/1.1\r\nhost: x\r\n\r\n";
        let Parsed::Complete(mut h) = parse(raw) else {
            panic!("not a whole head here");
        };
        assert!(head_parts(&mut h, Bytes::from_static(raw)).is_none());
        let Parsed::Complete(mut ok) = parse(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n") else {
            panic!("not a whole head here");
        };
        let (method, uri, headers) = head_parts(
            &mut ok,
            Bytes::from_static(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"),
        )
        .unwrap();
        assert_eq!((method, uri.path()), (Method::GET, "/v1/models"));
        assert_eq!(headers.get("host"), Some(&b"x"[..]));
    }

    /// [`check_head`] over seeded random heads: valid ones with bytes changed, cut or
    /// repeated, and plain noise.
    #[test]
    fn random_heads_never_panic_and_stay_in_bounds() {
        let mut next = kinference_testkit::xorshift(17);
        let valid: &[u8] = b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: r\r\nContent-Length: 12\r\nConnection: keep-alive\r\nX-A: b\tc\r\n\r\n{\"model\":1}";
        let alphabet = b"\r\n :/?%#\t\x00\x7f\xffAPOSTGEHTP1.0-";
        let mut complete = 0;
        for _ in 0..200_000 {
            let mut b = valid.to_vec();
            match next() % 4 {
                0 => {
                    for _ in 0..1 + next() % 4 {
                        let i = (next() as usize) % b.len();
                        b[i] = alphabet[(next() as usize) % alphabet.len()];
                    }
                }
                1 => b.truncate((next() as usize) % b.len()),
                2 => {
                    let i = (next() as usize) % b.len();
                    let extra = b[i..].to_vec();
                    b.splice(i..i, extra);
                }
                _ => {
                    b = (0..next() % 96)
                        .map(|_| alphabet[(next() as usize) % alphabet.len()])
                        .collect();
                }
            }
            complete += usize::from(check_head(&b));
        }
        assert!(
            complete > 10_000,
            "{complete} complete heads: the mutations are too harsh"
        );
    }

    #[test]
    fn numbers_are_written_in_decimal_and_chunk_sizes_in_hex() {
        assert_eq!(itoa(0, &mut [0; 20]), b"0");
        assert_eq!(itoa(u64::MAX, &mut [0; 20]), b"18446744073709551615");
        assert_eq!(hex_len(0, &mut [0; 16]), b"0");
        assert_eq!(hex_len(0x1a2f, &mut [0; 16]), b"1a2f");
    }
}
