//! Upstream HTTP/1.1 connections driven by the request that uses them: a per-thread pool of
//! idle connections, each taken by one request at a time and polled from that request's own
//! task (while waiting for the response head, then from the response body handed to the
//! client), instead of by a connection task of its own.
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
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use parking_lot::Mutex;
use tokio::net::TcpStream;

type Conn = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One upstream connection: the request handle and the connection state machine.
struct Link {
    sender: http1::SendRequest<Full<Bytes>>,
    conn: Conn,
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
}

impl LinkError {
    pub fn is_connect(&self) -> bool {
        matches!(self, LinkError::Connect { .. })
    }
}

/// Idle connections by replica authority; one pool per data-plane thread.
#[derive(Clone)]
pub(crate) struct Links {
    idle: Arc<Mutex<HashMap<Authority, Vec<Link>>>>,
    /// HTTP/2 connections by replica authority, shared by their requests.
    h2: Arc<Mutex<HashMap<Authority, http2::SendRequest<Full<Bytes>>>>>,
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
            idle: Arc::new(Mutex::new(HashMap::new())),
            h2: Arc::new(Mutex::new(HashMap::new())),
            connect_timeout,
            idle_timeout,
            max_idle_per_host: 256,
        }
    }

    /// Sends `req` to `authority` on an idle connection, or a new one.
    /// The request's URI is sent in origin form (path and query); `Host` is the caller's.
    pub async fn send(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<LinkBody>, LinkError> {
        if let Some(pq) = req.uri().path_and_query().cloned() {
            *req.uri_mut() = http::Uri::from(pq);
        }
        // A connection just polled and ready cannot be cancelled before the request is
        // written (nothing else runs on it in between), so a failure from here on may have
        // reached the replica and is not retried.
        let mut link = match self.checkout(authority).await {
            Some(link) => link,
            None => self.connect(authority).await?,
        };
        let resp = exchange(&mut link, req).await?;
        Ok(self.body(resp, link, authority))
    }

    /// Sends `req` to `authority` over HTTP/2 (prior knowledge) on the replica's shared
    /// connection, or a new one. The request's URI must be absolute (its scheme and authority
    /// are the stream's pseudo-headers).
    pub async fn send_h2(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<LinkBody>, LinkError> {
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
        Ok(resp.map(|inner| LinkBody {
            inner,
            link: None,
            home: None,
        }))
    }

    /// The replica's open HTTP/2 connection, or a new one (its task spawned here).
    async fn h2_sender(
        &self,
        authority: &Authority,
    ) -> Result<http2::SendRequest<Full<Bytes>>, LinkError> {
        let open = self
            .h2
            .lock()
            .get(authority)
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
        self.h2.lock().insert(authority.clone(), sender.clone());
        Ok(sender)
    }

    /// Drops the cached connection of `authority` if it closed (another request may have
    /// replaced it already).
    fn forget_closed_h2(&self, authority: &Authority) {
        let mut h2 = self.h2.lock();
        if h2.get(authority).is_some_and(|s| s.is_closed()) {
            h2.remove(authority);
        }
    }

    fn body(
        &self,
        resp: Response<Incoming>,
        link: Link,
        authority: &Authority,
    ) -> Response<LinkBody> {
        resp.map(|inner| LinkBody {
            inner,
            link: Some(link),
            home: Some((self.clone(), authority.clone())),
        })
    }

    /// An idle connection that can take a request now, if there is one.
    async fn checkout(&self, authority: &Authority) -> Option<Link> {
        loop {
            let mut link = self.idle.lock().get_mut(authority)?.pop()?;
            if link.idle_since.elapsed() > self.idle_timeout {
                continue;
            }
            let usable = poll_fn(|cx| {
                if Pin::new(&mut link.conn).poll(cx).is_ready() {
                    return Poll::Ready(false);
                }
                Poll::Ready(matches!(link.sender.poll_ready(cx), Poll::Ready(Ok(()))))
            })
            .await;
            if usable {
                return Some(link);
            }
        }
    }

    fn checkin(&self, mut link: Link, authority: Authority) {
        link.idle_since = Instant::now();
        let mut idle = self.idle.lock();
        let list = idle.entry(authority).or_default();
        // The oldest first out, so that connections the replica may time out are not kept.
        list.retain(|l| l.idle_since.elapsed() <= self.idle_timeout);
        if list.len() < self.max_idle_per_host {
            list.push(link);
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Link, LinkError> {
        let err = |detail: String| LinkError::Connect {
            authority: authority.to_string(),
            detail,
        };
        let tcp = self.dial(authority).await?;
        let (sender, conn) = http1::handshake(TokioIo::new(tcp))
            .await
            .map_err(|e| err(e.to_string()))?;
        Ok(Link {
            sender,
            conn,
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

/// Writes `req` and reads the response head, polling the connection from this task.
async fn exchange(
    link: &mut Link,
    req: Request<Full<Bytes>>,
) -> Result<Response<Incoming>, LinkError> {
    let mut response = std::pin::pin!(link.sender.send_request(req));
    let conn = &mut link.conn;
    let mut conn_result: Option<Result<(), hyper::Error>> = None;
    poll_fn(|cx| {
        if let Poll::Ready(r) = response.as_mut().poll(cx) {
            return Poll::Ready(r.map_err(LinkError::from));
        }
        if conn_result.is_none() {
            if let Poll::Ready(r) = Pin::new(&mut *conn).poll(cx) {
                conn_result = Some(r);
                // The connection ended: the response future now holds the outcome.
                if let Poll::Ready(r) = response.as_mut().poll(cx) {
                    return Poll::Ready(r.map_err(LinkError::from));
                }
                return Poll::Ready(Err(match conn_result.take() {
                    Some(Err(e)) => LinkError::Http(e),
                    _ => LinkError::Closed,
                }));
            }
        }
        Poll::Pending
    })
    .await
}

/// A response body that drives its connection, and gives it back to the pool when the body
/// was read to the end.
pub(crate) struct LinkBody {
    inner: Incoming,
    link: Option<Link>,
    home: Option<(Links, Authority)>,
}

impl std::fmt::Debug for LinkBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkBody").finish_non_exhaustive()
    }
}

impl LinkBody {
    fn release(&mut self, cx: &mut Context<'_>) {
        let Some(mut link) = self.link.take() else {
            return;
        };
        // One more poll lets the connection see the message end and get ready for the next.
        if Pin::new(&mut link.conn).poll(cx).is_ready() {
            return;
        }
        if let Some((links, authority)) = self.home.take() {
            links.checkin(link, authority);
        }
    }
}

impl Body for LinkBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if let Some(link) = this.link.as_mut() {
            if let Poll::Ready(r) = Pin::new(&mut link.conn).poll(cx) {
                // Closed or failed: the body sees the end or the error itself.
                this.link = None;
                if let Err(e) = r {
                    tracing::debug!(error = %e, "upstream connection ended");
                }
            }
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => this.release(cx),
            Poll::Ready(Some(Ok(_))) if this.inner.is_end_stream() => this.release(cx),
            Poll::Ready(Some(Err(_))) => this.link = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
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
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut sock, _)) = l.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    let mut seen = Vec::new();
                    loop {
                        match sock.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                        // One answer per complete request head (the test requests have no body).
                        while let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            seen.drain(..end + 4);
                            let head = format!(
                                "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                                body.len()
                            );
                            if sock.write_all(head.as_bytes()).await.is_err()
                                || sock.write_all(body.as_bytes()).await.is_err()
                            {
                                return;
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

    fn get(authority: &Authority) -> Request<Full<Bytes>> {
        Request::builder()
            .uri(format!("http://{authority}/x"))
            .header(http::header::HOST, authority.as_str())
            .body(Full::new(Bytes::new()))
            .unwrap()
    }

    async fn read_all(links: &Links, authority: &Authority) -> String {
        let resp = links.send(authority, get(authority)).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
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
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(v))))
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
        let resp = links.send_h2(authority, get(authority)).await.unwrap();
        assert_eq!(resp.status(), 200);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
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
            .get(&authority)
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
        let resp = links.send(&authority, get(&authority)).await.unwrap();
        drop(resp);
        assert_eq!(read_all(&links, &authority).await, "a longer answer");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = Authority::try_from(l.local_addr().unwrap().to_string()).unwrap();
        drop(l);
        let links = Links::new(Duration::from_secs(2), Duration::from_secs(60));
        let err = links.send(&authority, get(&authority)).await.unwrap_err();
        assert!(err.is_connect(), "{err}");
    }
}
