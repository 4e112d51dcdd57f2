//! Client connections of both ports: the accept loop and each connection's life.
//!
//! ```text
//!  accept loop ── a place among limits.max_connections (none free: stop accepting, count a
//!       │          pause, wait for a connection to close; the kernel's backlog holds the rest)
//!       ▼
//!  connection task: on the data port, plain HTTP/1.1 requests on its own path ([`crate::h1`])
//!    until one is not plain; then, and on the admin port from the start, hyper (HTTP/1.1,
//!    or HTTP/2 with a stream cap and PINGs); either way with its watchdog:
//!    no request yet, or a head begun ── header_read_ms ──▶ closed   (slow or stalled head)
//!    idle between requests          ── keep_alive_ms  ──▶ closed   (graceful)
//!    a request in flight            ── (request timeouts are the handlers' business)
//! ```
//!
//! On the data port each data-plane thread runs an accept loop on the shared listener and
//! serves a connection it accepted only if no other thread serves fewer; otherwise the
//! connection, with its place, is handed to the thread serving fewest ([`Spread`]).
//!
//! Invariants: a connection holds its place from accept to close, however it ends (handed
//! over or not), and is counted for the thread it is meant for from the moment it is
//! accepted to its close ([`Counted`]); an accept loop never spins (at the cap it waits for a
//! place; after an accept error it backs off); the watchdog never cuts a connection with a
//! request in flight; stopping the port shuts every connection down gracefully and [`serve`]
//! returns once all have closed.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Limits, Timeouts};
use crate::h1::{self, Answer, Req};
use crate::limits::{LimitMetrics, PortLabel};

/// What a port serves: a request in, its response out, as the router's own types ([`Req`],
/// [`Answer`]), whose headers may be a head's bytes rather than a map: the data port's own
/// HTTP/1.1 path and its handlers pass headers they do not read on as bytes, and only hyper's
/// path makes maps of them. The admin port serves an axum router (its requests and responses
/// converted at the edge); the data port dispatches its few paths itself (`server::Data`),
/// which costs less per request than a router's matching, extensions and boxed futures.
pub(crate) trait App: Clone + Send + Sync + 'static {
    fn call(&self, req: Req) -> impl Future<Output = Answer> + Send + use<Self>;
}

impl App for axum::Router {
    fn call(&self, req: Req) -> impl Future<Output = Answer> + Send + use<> {
        let svc = TowerToHyperService::new(self.clone());
        let fut = hyper::service::Service::call(&svc, req.into_http());
        async move {
            match fut.await {
                Ok(resp) => Answer::from(resp),
                Err(never) => match never {},
            }
        }
    }
}

/// What every connection of a port is held to.
#[derive(Clone, Debug)]
pub(crate) struct ConnRules {
    pub header_read: Duration,
    pub keep_alive: Duration,
    pub h2_max_streams: u32,
    pub h2_ping_interval: Option<Duration>,
    pub h2_ping_timeout: Duration,
    /// Plain HTTP/1.1 requests served by [`crate::h1`] (the data port) rather than hyper.
    pub h1_fast_path: bool,
}

impl ConnRules {
    pub fn new(t: &Timeouts, l: &Limits) -> Self {
        ConnRules {
            header_read: t.header_read(),
            keep_alive: t.keep_alive(),
            h2_max_streams: l.h2_max_concurrent_streams,
            h2_ping_interval: t.h2_keep_alive_interval(),
            h2_ping_timeout: t.h2_keep_alive_timeout(),
            h1_fast_path: false,
        }
    }
}

/// The places of `limits.max_connections`, shared by every accept loop of both ports.
#[derive(Debug)]
pub(crate) struct Places(Arc<Semaphore>);

impl Places {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Places(Arc::new(Semaphore::new(
            max.clamp(1, Semaphore::MAX_PERMITS),
        ))))
    }
}

/// How a port's connections are spread over the data-plane threads, each accepting from the
/// one shared listener. Whichever thread wakes first drains the listener's backlog, so a burst
/// of connections (a client or a gateway opening its keep-alive pool) could all land on one
/// thread and stay there for their lives; so the thread that accepts a connection keeps it
/// only if no other thread serves fewer, and hands it to the one serving fewest otherwise.
/// Handing over costs a wake-up of that thread once per connection, not per request.
#[derive(Debug)]
pub(crate) struct Spread {
    /// Connections each thread serves (handed ones counted from the hand-over).
    open: Vec<AtomicUsize>,
    inboxes: Vec<mpsc::UnboundedSender<Handed>>,
}

/// A connection accepted by one thread for another, with its place and count.
#[derive(Debug)]
pub(crate) struct Handed {
    tcp: std::net::TcpStream,
    place: OwnedSemaphorePermit,
    counted: Counted,
}

/// One connection in a thread's count of a [`Spread`], until dropped.
#[derive(Debug)]
pub(crate) struct Counted {
    spread: Arc<Spread>,
    thread: usize,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.spread.open[self.thread].fetch_sub(1, Ordering::Relaxed);
    }
}

/// One thread's side of a [`Spread`].
#[derive(Debug)]
pub(crate) struct Share {
    spread: Arc<Spread>,
    me: usize,
    inbox: mpsc::UnboundedReceiver<Handed>,
}

impl Spread {
    /// A spread over `threads` threads and each thread's share of it.
    pub fn new(threads: usize) -> (Arc<Spread>, Vec<Share>) {
        let (inboxes, receivers): (Vec<_>, Vec<_>) =
            (0..threads).map(|_| mpsc::unbounded_channel()).unzip();
        let spread = Arc::new(Spread {
            open: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
            inboxes,
        });
        let shares = receivers
            .into_iter()
            .enumerate()
            .map(|(me, inbox)| Share {
                spread: spread.clone(),
                me,
                inbox,
            })
            .collect();
        (spread, shares)
    }

    /// Connections each thread serves now.
    pub fn open(&self) -> Vec<usize> {
        self.open
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }

    /// A connection counted for `thread`.
    fn count(self: &Arc<Self>, thread: usize) -> Counted {
        self.open[thread].fetch_add(1, Ordering::Relaxed);
        Counted {
            spread: self.clone(),
            thread,
        }
    }

    /// The thread that should serve a connection `me` accepted, counted for it at once (so a
    /// burst does not pick the same thread twice): `me` unless another serves fewer.
    fn pick(self: &Arc<Self>, me: usize) -> Counted {
        let load = |i: usize| self.open[i].load(Ordering::Relaxed);
        let mine = load(me);
        let to = (0..self.open.len())
            .map(|i| (load(i), i))
            .filter(|&(n, i)| i != me && n < mine)
            .min()
            .map_or(me, |(_, i)| i);
        self.count(to)
    }
}

/// What the accept loop got next.
enum Next {
    Accepted(TcpStream, OwnedSemaphorePermit),
    /// From another thread: already counted for this one.
    Handed(Handed),
    /// An accept error, handled; try again.
    Again,
    Stop,
}

/// One port's accept loop and connections, until `stop`; returns once every connection closed.
/// With a `share`, the port's connections are spread over the threads serving it ([`Spread`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn serve<A: App>(
    listener: TcpListener,
    app: A,
    stop: CancellationToken,
    port: &'static str,
    places: Arc<Places>,
    rules: ConnRules,
    metrics: LimitMetrics,
    mut share: Option<Share>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // The watchdog times heads and idleness itself: hyper's header timer would also run
    // between requests, where keep_alive_ms applies.
    builder.http1().header_read_timeout(None);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(rules.h2_max_streams)
        .keep_alive_interval(rules.h2_ping_interval)
        .keep_alive_timeout(rules.h2_ping_timeout);
    let builder = Arc::new(builder);
    let label = PortLabel { port };
    let open = metrics.connections.get_or_create(&label).clone();
    let tracker = TaskTracker::new();
    let mut paused = false;
    loop {
        let next = tokio::select! {
            biased;
            () = stop.cancelled() => Next::Stop,
            handed = handed(&mut share) => handed.map_or(Next::Stop, Next::Handed),
            next = accept(&listener, &places, &metrics, &label, &mut paused) => next,
        };
        let (tcp, place, counted) = match next {
            Next::Accepted(tcp, place) => {
                // Each SSE chunk must leave at once (Nagle + delayed ACK would add ~40 ms).
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY on an accepted socket failed");
                }
                match hand_over(&share, tcp, place) {
                    Some(kept) => kept,
                    None => continue,
                }
            }
            Next::Handed(Handed {
                tcp,
                place,
                counted,
            }) => match TcpStream::from_std(tcp) {
                Ok(tcp) => (tcp, place, Some(counted)),
                Err(e) => {
                    tracing::debug!(error = %e, "a handed-over connection could not be registered");
                    continue;
                }
            },
            Next::Again => continue,
            Next::Stop => break,
        };
        open.inc();
        let conn = Connection {
            builder: builder.clone(),
            app: app.clone(),
            rules: rules.clone(),
            // A token of its own: every request's wait on the port's one token locked that
            // token's state, shared by every connection of both data-plane threads.
            stop: stop.child_token(),
            metrics: metrics.clone(),
            port,
        };
        let open = open.clone();
        tracker.spawn(async move {
            conn.run(tcp).await;
            open.dec();
            drop((place, counted));
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// The next connection another thread handed to this one (never, without a share; `None`
/// once every sender is gone).
async fn handed(share: &mut Option<Share>) -> Option<Handed> {
    match share {
        Some(s) => s.inbox.recv().await,
        None => std::future::pending().await,
    }
}

/// Waits for a place among `limits.max_connections`, then accepts. `paused` remembers that
/// this loop is waiting for a place, so a pause is counted once however often the wait is
/// restarted.
async fn accept(
    listener: &TcpListener,
    places: &Places,
    metrics: &LimitMetrics,
    label: &PortLabel,
    paused: &mut bool,
) -> Next {
    let place = match places.0.clone().try_acquire_owned() {
        Ok(p) => p,
        Err(_) => {
            if !std::mem::replace(paused, true) {
                metrics.accept_pauses.get_or_create(label).inc();
                tracing::debug!(
                    port = label.port,
                    "limits.max_connections reached; accepting paused"
                );
            }
            match places.0.clone().acquire_owned().await {
                Ok(p) => p,
                Err(_) => return Next::Stop,
            }
        }
    };
    *paused = false;
    match listener.accept().await {
        Ok((tcp, _)) => Next::Accepted(tcp, place),
        Err(e) => {
            drop(place);
            if !is_connection_error(&e) {
                // Out of descriptors or buffers: retrying at once would spin.
                metrics.accept_errors.get_or_create(label).inc();
                tracing::warn!(port = label.port, error = %e, "accept failed; pausing 100 ms");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Next::Again
        }
    }
}

/// A connection this thread accepted and keeps, with its count (none without a share); or
/// `None` once it is handed to the thread that serves fewest (or lost on the way).
type Kept = (TcpStream, OwnedSemaphorePermit, Option<Counted>);

/// Keeps a connection this thread accepted, or hands it to the thread that serves fewest.
fn hand_over(share: &Option<Share>, tcp: TcpStream, place: OwnedSemaphorePermit) -> Option<Kept> {
    let Some(s) = share else {
        return Some((tcp, place, None));
    };
    let counted = s.spread.pick(s.me);
    let to = counted.thread;
    if to == s.me {
        return Some((tcp, place, Some(counted)));
    }
    let tcp = match tcp.into_std() {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(error = %e, "an accepted connection could not be handed over");
            return None;
        }
    };
    let handed = Handed {
        tcp,
        place,
        counted,
    };
    match s.spread.inboxes[to].send(handed) {
        Ok(()) => None,
        // That thread has stopped: serve it here after all.
        Err(mpsc::error::SendError(Handed { tcp, place, .. })) => {
            let tcp = TcpStream::from_std(tcp).ok()?;
            Some((tcp, place, Some(s.spread.count(s.me))))
        }
    }
}

/// Whether a connection ended because its HTTP/2 client left a PING unanswered past
/// `h2_keep_alive_timeout_ms`. hyper's error for it is a private type that
/// `hyper::Error::is_timeout` does not recognize, so it is known by its message (the h2 PING
/// test fails if that changes).
fn is_h2_ping_timeout(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(e);
    while let Some(c) = cause {
        if c.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_timeout)
            || c.to_string() == "keep-alive timed out"
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// Errors of one connection that was being accepted; the next accept is unaffected.
fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

struct Connection<A> {
    builder: Arc<auto::Builder<TokioExecutor>>,
    app: A,
    rules: ConnRules,
    stop: CancellationToken,
    metrics: LimitMetrics,
    port: &'static str,
}

/// Why the watchdog closes a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expiry {
    HeaderRead,
    KeepAlive,
}

impl Expiry {
    fn label(self) -> &'static str {
        match self {
            Expiry::HeaderRead => "header_read",
            Expiry::KeepAlive => "keep_alive",
        }
    }
}

/// What the fast path reports: the same state hyper's connections keep through [`Watched`]
/// and the service.
impl h1::Watch for Arc<ConnState> {
    type Active = Active;

    fn read(&self, bytes: &[u8]) {
        ConnState::read(self, bytes);
    }

    fn begin(&self) -> Active {
        Active::begin(self)
    }
}

impl<A: App> Connection<A> {
    async fn run(self, tcp: TcpStream) {
        let state = Arc::new(ConnState::new(&self.rules));
        let (tcp, replay) = if self.rules.h1_fast_path {
            let app = &self.app;
            let lean = h1::serve(tcp, &state, |req| app.call(req), &self.stop);
            // Pinned out here, so that the socket it owns closes only after the timeout is
            // counted: a client that sees the close and reads the metrics finds it there.
            tokio::pin!(lean);
            let watchdog = watchdog(&state);
            let ended = tokio::select! {
                ended = &mut lean => ended,
                // Only while no request is in flight: nothing to answer.
                expiry = watchdog => {
                    self.metrics.timeout(self.port, expiry.label());
                    return;
                }
            };
            match ended {
                h1::Ended::Closed => return,
                h1::Ended::Handover(tcp, replay) => (tcp, replay),
            }
        } else {
            (tcp, Bytes::new())
        };
        let io = TokioIo::new(Watched {
            tcp,
            replay,
            state: state.clone(),
        });
        let app = self.app.clone();
        let tracked = state.clone();
        let svc = hyper::service::service_fn(move |req: http::Request<Incoming>| {
            let active = Active::begin(&tracked);
            let fut = app.call(Req::from_http(req));
            async move {
                let resp = fut.await.into_response();
                // Not boxed again: hyper takes the wrapper as the body type.
                Ok::<_, std::convert::Infallible>(resp.map(|inner| Tracked {
                    inner,
                    _active: active,
                }))
            }
        });
        let conn = self.builder.serve_connection_with_upgrades(io, svc);
        tokio::pin!(conn);
        let watchdog = watchdog(&state);
        tokio::pin!(watchdog);
        let ended = tokio::select! {
            r = conn.as_mut() => Some(r),
            () = self.stop.cancelled() => None,
            expiry = &mut watchdog => {
                self.metrics.timeout(self.port, expiry.label());
                if expiry == Expiry::HeaderRead {
                    // Nothing to answer (no whole request): close.
                    return;
                }
                None
            }
        };
        let result = match ended {
            Some(r) => r,
            None => {
                conn.as_mut().graceful_shutdown();
                conn.await
            }
        };
        if let Err(e) = result {
            if is_h2_ping_timeout(&*e) {
                self.metrics.timeout(self.port, "h2_keep_alive");
            }
            tracing::debug!(port = self.port, error = %e, "client connection ended with an error");
        }
    }
}

/// No time recorded.
const NONE: u64 = 0;

/// What the watchdog reads of one connection; times are milliseconds since its start, plus
/// one (0 is [`NONE`]).
#[derive(Debug)]
struct ConnState {
    start: Instant,
    /// Requests whose response has not ended.
    active: AtomicU32,
    /// Requests begun on this connection.
    begun: AtomicU64,
    /// When the connection last had no request in flight.
    idle_since: AtomicU64,
    /// When the first byte of the next request head arrived ([`NONE`]: none yet).
    head_since: AtomicU64,
    /// The client speaks HTTP/2: bytes between requests are frames, not heads.
    h2: AtomicBool,
    first_read: AtomicBool,
    /// When the watchdog's timer fires next (it re-evaluates then whatever happened).
    armed: AtomicU64,
    /// Wakes the watchdog when a deadline moved before `armed` (a head began, the last
    /// request ended). A deadline at or after it needs no wake-up: the timer fires first and
    /// the watchdog finds the new deadline then. So a kept-alive connection whose heads come
    /// whole costs the watchdog nothing per request.
    changed: Notify,
    /// `header_read` and `keep_alive`, in milliseconds.
    head_ms: u64,
    idle_ms: u64,
}

impl ConnState {
    fn new(rules: &ConnRules) -> Self {
        ConnState {
            start: Instant::now(),
            active: AtomicU32::new(0),
            begun: AtomicU64::new(0),
            idle_since: AtomicU64::new(1),
            head_since: AtomicU64::new(NONE),
            h2: AtomicBool::new(false),
            first_read: AtomicBool::new(false),
            // Not armed yet: any deadline wakes it.
            armed: AtomicU64::new(u64::MAX),
            changed: Notify::new(),
            head_ms: rules.header_read.as_millis() as u64,
            idle_ms: rules.keep_alive.as_millis() as u64,
        }
    }

    /// Wakes the watchdog if `deadline` comes before its timer.
    fn moved(&self, deadline: u64) {
        if deadline < self.armed.load(Ordering::Relaxed) {
            self.changed.notify_one();
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_millis() as u64 + 1
    }

    fn at(&self, t: u64) -> Instant {
        self.start + Duration::from_millis(t.saturating_sub(1))
    }

    /// Bytes arrived from the client.
    fn read(&self, first: &[u8]) {
        if !self.first_read.swap(true, Ordering::Relaxed) && first.starts_with(b"PRI ") {
            self.h2.store(true, Ordering::Relaxed);
        }
        if self.active.load(Ordering::Relaxed) == 0
            && self.head_since.load(Ordering::Relaxed) == NONE
            && !self.h2.load(Ordering::Relaxed)
        {
            let now = self.now();
            self.head_since.store(now, Ordering::Relaxed);
            self.moved(now + self.head_ms);
        }
    }

    /// When the connection expires if nothing changes, and why (`None`: a request is in
    /// flight).
    fn deadline(&self) -> Option<(u64, Expiry)> {
        if self.active.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let head = self.head_since.load(Ordering::Relaxed);
        if head != NONE {
            return Some((head + self.head_ms, Expiry::HeaderRead));
        }
        let idle = self.idle_since.load(Ordering::Relaxed);
        if self.begun.load(Ordering::Relaxed) == 0 && !self.h2.load(Ordering::Relaxed) {
            // A connection that never sends a request is a head that never starts.
            return Some((idle + self.head_ms, Expiry::HeaderRead));
        }
        Some((idle + self.idle_ms, Expiry::KeepAlive))
    }
}

/// Waits until the connection expires; re-evaluated when the state changes, and at least
/// every `min(header_read, keep_alive)` while a request is in flight.
async fn watchdog(state: &ConnState) -> Expiry {
    let recheck = state.head_ms.min(state.idle_ms);
    // One timer for the connection's life, moved as the deadline moves.
    let timer = tokio::time::sleep(Duration::from_millis(recheck));
    tokio::pin!(timer);
    loop {
        let changed = state.changed.notified();
        let now = state.now();
        let at = match state.deadline() {
            Some((at, why)) if now >= at => return why,
            Some((at, _)) => at,
            None => now + recheck,
        };
        state.armed.store(at, Ordering::Relaxed);
        let wake = state.at(at);
        if timer.deadline() != wake {
            timer.as_mut().reset(wake);
        }
        tokio::select! {
            () = &mut timer => {}
            () = changed => {}
        }
    }
}

/// One request on the connection, from its complete head to the end of its response body.
#[derive(Debug)]
struct Active(Arc<ConnState>);

impl Active {
    fn begin(state: &Arc<ConnState>) -> Self {
        state.active.fetch_add(1, Ordering::Relaxed);
        state.begun.fetch_add(1, Ordering::Relaxed);
        state.head_since.store(NONE, Ordering::Relaxed);
        Active(state.clone())
    }
}

impl Drop for Active {
    fn drop(&mut self) {
        let s = &self.0;
        if s.active.fetch_sub(1, Ordering::Relaxed) == 1 {
            let now = s.now();
            s.idle_since.store(now, Ordering::Relaxed);
            s.moved(now + s.idle_ms);
        }
    }
}

/// A response body that keeps its request counted as in flight until it ends.
struct Tracked {
    inner: Body,
    _active: Active,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The client socket, noting when bytes of a request head arrive; first the bytes the fast
/// path had read when it handed the connection over (already noted).
struct Watched {
    tcp: TcpStream,
    replay: Bytes,
    state: Arc<ConnState>,
}

impl AsyncRead for Watched {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if !this.replay.is_empty() {
            let n = this.replay.len().min(buf.remaining());
            buf.put_slice(&this.replay.split_to(n));
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.tcp).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &r {
            let got = &buf.filled()[before..];
            if !got.is_empty() {
                this.state.read(got);
            }
        }
        r
    }
}

impl AsyncWrite for Watched {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }
}
