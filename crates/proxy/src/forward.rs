//! Forwarding one request: try the ranked replicas in order while nothing was sent, then
//! stream the chosen replica's response back chunk by chunk.
//!
//! ```text
//!  targets[0] ──connect refused / 503 head──▶ targets[1] ──▶ ... (max_attempts)
//!      │ response head
//!      ▼
//!  UpstreamBody: frame ──▶ client   (then: usage scan, prefill release, idle deadline moved)
//!      ├─ end of body   → metrics, in-flight guard dropped
//!      ├─ upstream error / idle / total timeout → SSE error event (streams) or reset
//!      └─ dropped early (client gone) → upstream connection dropped, guard dropped
//! ```
//!
//! Invariants: a request moves to another replica only when the attempt failed to connect, or
//! the replica answered 503 before any body byte reached the client; after a response head is
//! passed on, the request is never replayed. Each frame is handed on as soon as it arrives
//! (nothing waits for more bytes), and the in-flight guard lives in the response body, so it is
//! released however the response ends.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::uri::PathAndQuery;
use http::HeaderMap;
use http::{Method, StatusCode};
use http_body::{Body as _, Frame, SizeHint};
use prometheus_client::metrics::histogram::Histogram;
use tokio::time::{Instant, Sleep};

use crate::decide::Target;
use crate::error::RequestError;
use crate::fleet::{Fleet, InFlight, Pool, Replica};
use crate::h1::Answer;
use crate::heads::Headers;
use crate::limits::Admitted;
use crate::link::{LinkBody, Reply};
use crate::metrics::{PoolKind, ReplicaKind, RouteLabel};
use crate::savings::BaselineGuess;
use crate::upstream::{client_headers, error_chain, Outgoing, SendError, Upstream};
use crate::usage::UsageScanner;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// What a forwarded request carries besides its targets.
#[derive(Debug)]
pub(crate) struct Forward {
    /// The `route` metric label.
    pub route: &'static str,
    /// The request's pool (named in the error when no replica takes it).
    pub pool: Arc<Pool>,
    pub accounting: Accounting,
    pub method: Method,
    pub path_and_query: PathAndQuery,
    pub headers: Headers,
    pub body: Bytes,
    pub start: Instant,
    /// The request's place at its pool's gate, held until the response ends.
    pub admitted: Admitted,
}

/// How a forwarded request is accounted.
#[derive(Debug)]
pub(crate) enum Accounting {
    /// Placed by the pool's policy: its prompt's uncached tokens count as prefill in flight
    /// until the first byte, and the cached tokens the replica reports are compared with the
    /// prediction.
    Routed { prompt_tokens: u32 },
    /// Passed through by load: nothing predicted, nothing to compare.
    Passthrough,
}

impl Accounting {
    fn routed(&self) -> bool {
        matches!(self, Accounting::Routed { .. })
    }

    fn prompt_tokens(&self) -> u32 {
        match self {
            Accounting::Routed { prompt_tokens, .. } => *prompt_tokens,
            Accounting::Passthrough => 0,
        }
    }

    /// Predicted uncached prompt tokens for a target.
    fn prefill(&self, t: &Target) -> u64 {
        match self {
            Accounting::Routed { prompt_tokens, .. } => {
                u64::from(prompt_tokens.saturating_sub(t.predicted_cached))
            }
            Accounting::Passthrough => 0,
        }
    }
}

/// Sends the request to the first target that takes it; the index of that target comes back
/// with the response. An error is for the caller to answer: nothing reached the client.
///
/// `observe` answers the baselines' guesses for a routed request (none for a passed-through
/// one), which the response body counts with the request's usage: run once, while the first
/// replica tried works on the request (else before the answer), also when every replica
/// fails, since the baselines saw every routed request. A request whose client leaves before
/// it is sent (this future dropped) is not observed.
pub(crate) async fn forward(
    fleet: &Arc<Fleet>,
    upstream: &Upstream,
    req: Forward,
    targets: &[Target],
    observe: impl FnOnce() -> Vec<BaselineGuess>,
) -> Result<(Answer, usize), RequestError> {
    let attempts = targets
        .len()
        .min(fleet.settings.max_attempts.max(1) as usize);
    let mut failures: Vec<String> = Vec::new();
    let mut observe = Some(observe);
    let mut guesses = Vec::new();
    for (i, t) in targets.iter().take(attempts).enumerate() {
        let more = i + 1 < attempts;
        let written = || observe_once(&mut observe, &mut guesses);
        let tried = attempt(fleet, upstream, &req, t, more, &mut failures, written).await;
        // Not written (refused, or failed before the write): observed now.
        observe_once(&mut observe, &mut guesses);
        if let Some((guard, resp)) = tried? {
            return Ok((respond(fleet, req, t, guard, resp, guesses), i));
        }
    }
    // No replica to try.
    observe_once(&mut observe, &mut guesses);
    let pool = req.pool.name.clone();
    let detail = if failures.is_empty() {
        "no replica is configured".to_owned()
    } else {
        failures.join("; ")
    };
    Err(RequestError::NoReplica {
        pool,
        detail,
        retry_after_s: fleet.settings.limits.retry_after_s,
    })
}

/// Runs `observe`, if it has not run yet, into `guesses`.
fn observe_once(
    observe: &mut Option<impl FnOnce() -> Vec<BaselineGuess>>,
    guesses: &mut Vec<BaselineGuess>,
) {
    if let Some(observe) = observe.take() {
        *guesses = observe();
    }
}

/// One attempt at target `t`: its response head with the in-flight guard, `None` when the
/// next target may be tried (why is pushed to `failures`), or an error that ends the request.
/// `more` says whether another target follows.
async fn attempt(
    fleet: &Arc<Fleet>,
    upstream: &Upstream,
    req: &Forward,
    t: &Target,
    more: bool,
    failures: &mut Vec<String>,
    written: impl FnOnce(),
) -> Result<Option<(InFlight, Reply)>, RequestError> {
    let settings = &fleet.settings;
    let prefill = req.accounting.prefill(t);
    let guard = InFlight::new(t.replica.clone(), t.rank, prefill, fleet.changed.clone());
    let out = Outgoing {
        method: &req.method,
        path_and_query: &req.path_and_query,
        headers: &req.headers,
        body: &req.body,
        rank: t.pin_rank.then_some(t.rank),
    };
    let first_byte = settings.timeouts.first_byte();
    let sent = tokio::time::timeout(
        first_byte,
        upstream.send(&t.replica.endpoint, &out, written),
    )
    .await;
    match sent {
        Err(_) => {
            fail_count(fleet, &t.replica, "first_byte_timeout");
            Err(RequestError::Timeout {
                replica: t.replica.url().to_owned(),
                timeout_ms: settings.timeouts.first_byte_ms,
            })
        }
        Ok(Err(SendError::Uri(e))) => {
            failures.push(format!("{}: {e}", t.replica.url()));
            Ok(None)
        }
        Ok(Err(SendError::Link(e))) if e.is_connect() => {
            let msg = error_chain(&e);
            connect_failed(fleet, req, t, more, &msg);
            failures.push(format!("{}: {msg}", t.replica.url()));
            Ok(None)
        }
        Ok(Err(SendError::Link(e))) => {
            // Sent (at least partly): the replica may have started on it, so no retry.
            fail_count(fleet, &t.replica, "request");
            Err(RequestError::Upstream {
                replica: t.replica.url().to_owned(),
                detail: error_chain(&e),
            })
        }
        Ok(Ok(resp)) => {
            if resp.status == StatusCode::SERVICE_UNAVAILABLE && more {
                fail_count(fleet, &t.replica, "unavailable");
                count_retry(fleet, req, "unavailable");
                failures.push(format!("{}: answered 503", t.replica.url()));
                return Ok(None);
            }
            if t.replica.health() != crate::api::Health::Up {
                t.replica.set_up();
                fleet.bump();
            }
            Ok(Some((guard, resp)))
        }
    }
}

/// `t`'s replica refused the connection: counted, and marked down (once) with `msg`.
fn connect_failed(fleet: &Fleet, req: &Forward, t: &Target, more: bool, msg: &str) {
    fail_count(fleet, &t.replica, "connect");
    if t.replica.set_down(msg.to_owned()) {
        tracing::warn!(replica = %t.replica.url(), error = %msg, "replica unreachable; marked down");
        fleet.bump();
    }
    if more {
        count_retry(fleet, req, "connect");
    }
}

fn fail_count(fleet: &Fleet, replica: &Replica, kind: &'static str) {
    fleet
        .metrics
        .upstream_failures
        .get_or_create(&ReplicaKind {
            replica: replica.url().to_owned(),
            kind,
        })
        .inc();
}

fn count_retry(fleet: &Fleet, req: &Forward, kind: &'static str) {
    fleet
        .metrics
        .retries
        .get_or_create(&PoolKind {
            pool: if req.accounting.routed() {
                req.pool.name.clone()
            } else {
                String::new()
            },
            kind,
        })
        .inc();
}

fn respond(
    fleet: &Arc<Fleet>,
    req: Forward,
    t: &Target,
    guard: InFlight,
    resp: Reply,
    baselines: Vec<BaselineGuess>,
) -> Answer {
    let Reply {
        status,
        headers,
        body: incoming,
    } = resp;
    let m = &fleet.metrics;
    m.replica_requests(
        &t.replica.series,
        t.replica.url(),
        req.route,
        status.as_u16(),
    )
    .inc();
    let (first_byte, duration) = m.replica_timing(&t.replica.series, t.replica.url(), req.route);
    let (wire, sse) = if fleet.settings.expose_endpoint_header {
        let rank = t.rank.to_string();
        let endpoint = t.replica.endpoint.authority.as_str().as_bytes();
        let extra = [
            ("x-kinference-endpoint", endpoint),
            ("x-kinference-dp-rank", rank.as_bytes()),
        ];
        client_headers(&headers, &extra)
    } else {
        client_headers(&headers, &[])
    };
    // The head's bytes share the connection's read buffer: released now, the buffer can take
    // the body's bytes in place instead of growing.
    drop(headers);
    let timeouts = &fleet.settings.timeouts;
    let idle_deadline = Instant::now() + timeouts.idle();
    let body = UpstreamBody {
        inner: incoming,
        guard: Some(guard),
        admitted: Some(req.admitted),
        idle: None,
        idle_deadline,
        idle_after: timeouts.idle(),
        total: timeouts
            .total()
            .map(|d| Box::pin(tokio::time::sleep_until(req.start + d))),
        scanner: req.accounting.routed().then(UsageScanner::default),
        sse,
        first_seen: false,
        finished: false,
        obs: Observer {
            fleet: fleet.clone(),
            route: req.route,
            replica: t.replica.clone(),
            first_byte,
            duration,
            pool: req.accounting.routed().then(|| req.pool.clone()),
            prompt_tokens: req.accounting.prompt_tokens(),
            predicted_cached: t.predicted_cached,
            baselines,
            start: req.start,
        },
    };
    Answer {
        status,
        headers: HeaderMap::new(),
        wire: Some(wire),
        body: Body::new(body),
    }
}

/// What the body records when it ends.
#[derive(Debug)]
struct Observer {
    fleet: Arc<Fleet>,
    route: &'static str,
    replica: Arc<Replica>,
    first_byte: Histogram,
    duration: Histogram,
    pool: Option<Arc<Pool>>,
    prompt_tokens: u32,
    predicted_cached: u32,
    baselines: Vec<BaselineGuess>,
    start: Instant,
}

/// The replica's response body on its way to the client.
#[derive(Debug)]
struct UpstreamBody {
    inner: LinkBody,
    guard: Option<InFlight>,
    admitted: Option<Admitted>,
    /// Fires at or before `idle_deadline`; re-armed to it only when it fires early. Made at
    /// the first wait for data: a response whose body is all there by then needs none.
    idle: Option<Pin<Box<Sleep>>>,
    /// When the response has gone `idle_after` without data.
    idle_deadline: Instant,
    idle_after: Duration,
    total: Option<Pin<Box<Sleep>>>,
    scanner: Option<UsageScanner>,
    /// An event stream without a length: a failure can be reported as a last SSE event.
    sse: bool,
    first_seen: bool,
    finished: bool,
    obs: Observer,
}

impl UpstreamBody {
    /// The response ended normally.
    fn finish(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.obs
            .duration
            .observe(self.obs.start.elapsed().as_secs_f64());
        if let (Some(pool), Some(actual)) = (
            &self.obs.pool,
            self.scanner.as_ref().and_then(UsageScanner::cached_tokens),
        ) {
            self.obs.fleet.record_usage(
                &pool.name,
                self.obs.prompt_tokens,
                self.obs.predicted_cached,
                actual,
                &self.obs.baselines,
            );
        }
        self.guard = None;
        self.admitted = None;
    }

    /// The response cannot go on: an SSE stream gets a last error event, anything else is cut.
    fn fail(
        &mut self,
        kind: &'static str,
        detail: String,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.finished = true;
        self.guard = None;
        self.admitted = None;
        let m = &self.obs.fleet.metrics;
        m.upstream_failures
            .get_or_create(&ReplicaKind {
                replica: self.obs.replica.url().to_owned(),
                kind,
            })
            .inc();
        tracing::warn!(replica = %self.obs.replica.url(), kind, error = %detail, "response cut short");
        let message = format!(
            "replica {} failed mid-response ({kind}): {detail}",
            self.obs.replica.url()
        );
        if self.sse {
            let body = RequestError::Upstream {
                replica: self.obs.replica.url().to_owned(),
                detail: message,
            }
            .body();
            let json = serde_json::to_string(&body).unwrap_or_default();
            let event = Bytes::from(format!("data: {json}\n\n"));
            Poll::Ready(Some(Ok(Frame::data(event))))
        } else {
            Poll::Ready(Some(Err(message.into())))
        }
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(None);
        }
        if let Some(total) = this.total.as_mut() {
            if total.as_mut().poll(cx).is_ready() {
                return this.fail("total_timeout", "the response took too long".to_owned());
            }
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    if !this.first_seen && !data.is_empty() {
                        this.first_seen = true;
                        if let Some(g) = this.guard.as_mut() {
                            g.release_prefill();
                        }
                        this.obs
                            .first_byte
                            .observe(this.obs.start.elapsed().as_secs_f64());
                    }
                    if let Some(s) = this.scanner.as_mut() {
                        s.feed(data);
                    }
                }
                // Only noted here: resetting a timer per frame re-registers it with the runtime's
                // timer wheel (and wakes the driver), a cost on every response.
                this.idle_deadline = Instant::now() + this.idle_after;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => this.fail("stream", error_chain(&*e)),
            Poll::Ready(None) => {
                this.finish();
                Poll::Ready(None)
            }
            Poll::Pending => {
                let deadline = this.idle_deadline;
                let idle = this
                    .idle
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                while idle.as_mut().poll(cx).is_ready() {
                    if Instant::now() >= this.idle_deadline {
                        let ms = this.idle_after.as_millis();
                        return this.fail("idle_timeout", format!("no data for {ms} ms"));
                    }
                    // Data came since the timer was set: wait out the rest of the new period.
                    idle.as_mut().reset(this.idle_deadline);
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.finished {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        if self.inner.is_end_stream() {
            // The server saw the end through `is_end_stream` and stopped polling.
            self.finish();
            return;
        }
        // The client went away: dropping `inner` closes the upstream connection, which makes
        // the replica abort the request; the guard releases the in-flight counts.
        self.obs
            .fleet
            .metrics
            .client_disconnects
            .get_or_create(&RouteLabel {
                route: self.obs.route,
            })
            .inc();
        tracing::debug!(replica = %self.obs.replica.url(), "client disconnected; upstream request dropped");
    }
}
