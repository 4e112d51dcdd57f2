//! The gateway: for each client request, one ext_proc stream to the picker carrying the request
//! headers and body, the upstream response headers and (per mode) its body, then a clean close;
//! the request goes to the endpoints the picker listed, in order. Invariants: the client body is
//! read whole first (the picker sees the same messages Envoy would send, only not paced by the
//! client) and the upstream body is held whole so a fallback resends it; the response streams to
//! the client frame by frame, never buffered; the ext_proc stream closes only after the client's
//! response body has ended (the picker releases its in-flight count on that close).

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};
use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse,
};
use http::header::{CONTENT_LENGTH, HOST};
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body as _;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::config::{GatewayConfig, RequestBodyMode, ResponseBodyMode};
use crate::exchange::{self, Exchange, LastSent, Outbox, PickerError};
use crate::extproc::{self, HeaderList};
use crate::stats::{Event, Stats, StatsSnapshot};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("invalid picker address {0:?}: {1}")]
    Picker(String, #[source] tonic::transport::Error),
    #[error("listener: {0}")]
    Io(#[from] io::Error),
}

/// A running gateway. Dropping it stops the server (in-flight requests finish).
#[derive(Debug)]
pub struct Gateway {
    addr: SocketAddr,
    stats: Arc<Stats>,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Gateway {
    /// Serves on `listener` (bind it to port 0 in tests). The picker connection is lazy: an
    /// unreachable picker shows per request (fail-open or 503), not here.
    pub async fn start(config: GatewayConfig, listener: TcpListener) -> Result<Self, GatewayError> {
        let addr = listener.local_addr()?;
        let uri = config.picker_uri();
        let channel = Endpoint::from_shared(uri.clone())
            .map_err(|e| GatewayError::Picker(uri.clone(), e))?
            .connect_timeout(config.upstream_connect_timeout)
            .connect_lazy();
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(config.upstream_connect_timeout));
        connector.set_nodelay(true);
        let upstream = Client::builder(TokioExecutor::new()).build(connector);
        let stats = Arc::new(Stats::default());
        let shared = Arc::new(Shared {
            config,
            picker: ExternalProcessorClient::new(channel),
            upstream,
            stats: stats.clone(),
            round_robin: AtomicUsize::new(0),
            request_ids: AtomicU64::new(0),
        });
        let router = Router::new()
            .route("/gateway/stats", get(stats_handler))
            .fallback(proxy_handler)
            .with_state(shared);
        let (shutdown, stop) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, router).with_graceful_shutdown(async move {
                let _ = stop.await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "gateway server stopped");
            }
        });
        Ok(Self {
            addr,
            stats,
            shutdown: Some(shutdown),
            task: Some(task),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The live counters (picker latency samples included).
    pub fn stats_handle(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Stops accepting and waits for in-flight requests to finish.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Debug)]
struct Shared {
    config: GatewayConfig,
    picker: ExternalProcessorClient<Channel>,
    upstream: Client<HttpConnector, Full<Bytes>>,
    stats: Arc<Stats>,
    round_robin: AtomicUsize,
    request_ids: AtomicU64,
}

/// What the picker decided for one request.
enum Decision {
    Route {
        destinations: Vec<String>,
        headers: HeaderList,
        body: Bytes,
    },
    Immediate(ImmediateResponse),
}

/// Connection-specific headers a proxy never forwards.
const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
];

fn is_hop_by_hop(key: &str) -> bool {
    HOP_BY_HOP.iter().any(|h| key.eq_ignore_ascii_case(h))
}

async fn stats_handler(State(shared): State<Arc<Shared>>) -> Json<StatsSnapshot> {
    Json(shared.stats.snapshot())
}

async fn proxy_handler(State(shared): State<Arc<Shared>>, req: Request<Body>) -> Response<Body> {
    shared.stats.count(Event::Request);
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return local_reply(StatusCode::BAD_REQUEST, &format!("reading body: {e}")),
    };
    let id = shared.request_ids.fetch_add(1, Ordering::Relaxed);
    let (headers, subset) = shared.request_headers(&parts, id);

    let (exchange, destinations, up_headers, up_body) =
        match shared.pick(headers.clone(), body.clone(), subset).await {
            Ok((ex, Decision::Immediate(i))) => {
                shared.stats.count(Event::Immediate);
                tokio::spawn(ex.close());
                return immediate_reply(&i);
            }
            Ok((
                ex,
                Decision::Route {
                    destinations,
                    headers,
                    body,
                },
            )) => {
                if let Some(first) = destinations.first() {
                    shared.stats.pick(first);
                }
                if destinations.is_empty() {
                    shared.stats.count(Event::NoDestination);
                    tokio::spawn(ex.close());
                    return local_reply(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "picker named no destination",
                    );
                }
                match shared.validate(&destinations) {
                    Ok(eps) => (Some(ex), eps, headers, body),
                    Err(bad) => {
                        shared.stats.count(Event::InvalidDestination);
                        tokio::spawn(ex.close());
                        return local_reply(
                            StatusCode::SERVICE_UNAVAILABLE,
                            &format!("picker named an unknown endpoint {bad:?}"),
                        );
                    }
                }
            }
            Err(e) => {
                shared.stats.count(Event::PickerError);
                tracing::warn!(error = %e, "picker failed");
                match shared.fail_open_endpoint() {
                    Some(ep) => {
                        shared.stats.count(Event::FailOpen);
                        (None, vec![ep], headers, body)
                    }
                    None => {
                        shared.stats.count(Event::FailClose);
                        return local_reply(
                            StatusCode::SERVICE_UNAVAILABLE,
                            &format!("endpoint picker unavailable: {e}"),
                        );
                    }
                }
            }
        };

    let Some((resp, served)) = shared.forward(&destinations, &up_headers, up_body).await else {
        shared.stats.count(Event::UpstreamFailure);
        if let Some(ex) = exchange {
            tokio::spawn(ex.close());
        }
        return local_reply(
            StatusCode::SERVICE_UNAVAILABLE,
            "upstream connect error: no endpoint answered",
        );
    };
    let served = served.to_string();
    shared.stats.served(&served);
    match exchange {
        None => {
            let (parts, body) = resp.into_parts();
            let list = response_headers(&parts, &served, true);
            client_response(&list, Body::new(body))
        }
        Some(ex) => shared.clone().respond(ex, resp, served).await,
    }
}

impl Shared {
    /// The header list Envoy would send (pseudo headers first, `host` folded into
    /// `:authority`, a request id added) and the request's subset hint.
    fn request_headers(
        &self,
        parts: &http::request::Parts,
        id: u64,
    ) -> (HeaderList, Option<Vec<String>>) {
        let authority = parts
            .uri
            .authority()
            .map(|a| a.as_str().as_bytes().to_vec())
            .or_else(|| parts.headers.get(HOST).map(|h| h.as_bytes().to_vec()))
            .unwrap_or_default();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .as_bytes()
            .to_vec();
        let mut list: HeaderList = vec![
            (":method".into(), parts.method.as_str().as_bytes().to_vec()),
            (":path".into(), path),
            (":authority".into(), authority),
            (":scheme".into(), b"http".to_vec()),
        ];
        let mut subset = self.config.subset_hint.clone();
        for (k, v) in &parts.headers {
            let key = k.as_str();
            if key == extproc::TEST_SUBSET_HEADER {
                subset = Some(extproc::split_list(&String::from_utf8_lossy(v.as_bytes())));
            } else if key != HOST.as_str() && !is_hop_by_hop(key) {
                list.push((key.to_owned(), v.as_bytes().to_vec()));
            }
        }
        if extproc::get(&list, "x-request-id").is_none() {
            list.push(("x-request-id".into(), format!("testgw-{id}").into_bytes()));
        }
        (list, subset)
    }

    /// Runs the request half of the exchange until the picker has answered the headers and
    /// given back the whole body (or answered immediately).
    async fn pick(
        &self,
        headers: HeaderList,
        body: Bytes,
        subset: Option<Vec<String>>,
    ) -> Result<(Exchange, Decision), PickerError> {
        let mode = self.config.request_body_mode;
        let outbox = Outbox::new();
        let headers_msg = ProcessingRequest {
            request: Some(Req::RequestHeaders(HttpHeaders {
                headers: Some(extproc::header_map(&headers)),
                end_of_stream: body.is_empty(),
                ..Default::default()
            })),
            metadata_context: subset.as_deref().map(extproc::subset_metadata),
            protocol_config: Some(extproc::protocol_config(
                mode,
                self.config.response_body_mode,
                self.config.send_body_without_waiting,
            )),
            ..Default::default()
        };
        match mode {
            RequestBodyMode::FullDuplexStreamed => {
                // Headers and every chunk go out without waiting for any answer.
                let tx = outbox.tx.clone();
                let last_sent = outbox.last_sent.clone();
                let chunks = split(&body, self.config.chunk_size);
                tokio::spawn(async move {
                    if exchange::send(&tx, &last_sent, headers_msg).await.is_err() {
                        return;
                    }
                    let n = chunks.len();
                    for (i, chunk) in chunks.into_iter().enumerate() {
                        let msg = body_request(chunk, i + 1 == n, false);
                        if exchange::send(&tx, &last_sent, msg).await.is_err() {
                            return;
                        }
                    }
                });
            }
            RequestBodyMode::Buffered => {
                exchange::send(&outbox.tx, &outbox.last_sent, headers_msg).await?;
                if self.config.send_body_without_waiting && !body.is_empty() {
                    let msg = body_request(body.clone(), true, false);
                    exchange::send(&outbox.tx, &outbox.last_sent, msg).await?;
                }
            }
        }
        let mut ex = outbox
            .open(&self.picker, self.config.picker_timeout)
            .await?;

        let mut state = RequestState {
            headers,
            original: body.clone(),
            body: BytesMut::new(),
            mutated: false,
            from_metadata: None,
            from_header: None,
            latency_recorded: false,
        };
        let mut headers_answered = false;
        let mut body_done = body.is_empty();
        let mut body_sent = body.is_empty()
            || mode == RequestBodyMode::FullDuplexStreamed
            || self.config.send_body_without_waiting;
        while !(headers_answered && body_done) {
            let resp = ex.recv().await?;
            state.note_metadata(&resp, &ex.last_sent, &self.stats);
            match resp.response {
                Some(Resp::RequestHeaders(h)) => {
                    if headers_answered {
                        return Err(protocol("a second request_headers response"));
                    }
                    headers_answered = true;
                    if let Some(c) = &h.response {
                        state.apply_headers(c, &ex.last_sent, &self.stats);
                    }
                    if !body_sent {
                        // Buffered: the body goes once the headers were answered, as Envoy does.
                        body_sent = true;
                        ex.send(body_request(body.clone(), true, false)).await?;
                    }
                }
                Some(Resp::RequestBody(b)) => {
                    if !headers_answered {
                        return Err(protocol("request_body response before request_headers"));
                    }
                    if body_done {
                        return Err(protocol("request_body response after the body ended"));
                    }
                    if let Some(c) = &b.response {
                        state.apply_headers(c, &ex.last_sent, &self.stats);
                    }
                    body_done = state.apply_body(mode, b.response.as_ref())?;
                }
                Some(Resp::ImmediateResponse(i)) => return Ok((ex, Decision::Immediate(i))),
                Some(Resp::RequestTrailers(_)) => {}
                Some(_) => return Err(protocol("a response-path message during the request")),
                None => return Err(protocol("a response with no message")),
            }
        }
        let body = match mode {
            RequestBodyMode::FullDuplexStreamed => state.body.freeze(),
            RequestBodyMode::Buffered if state.mutated => state.body.freeze(),
            RequestBodyMode::Buffered => state.original,
        };
        let destinations = state
            .from_metadata
            .or(state.from_header)
            .unwrap_or_default();
        Ok((
            ex,
            Decision::Route {
                destinations,
                headers: state.headers,
                body,
            },
        ))
    }

    /// Every destination parsed and in the known pool (when one is configured), or the first
    /// offender.
    fn validate(&self, destinations: &[String]) -> Result<Vec<SocketAddr>, String> {
        destinations
            .iter()
            .map(|d| match d.parse::<SocketAddr>() {
                Ok(ep)
                    if self.config.endpoints.is_empty() || self.config.endpoints.contains(&ep) =>
                {
                    Ok(ep)
                }
                _ => Err(d.clone()),
            })
            .collect()
    }

    fn fail_open_endpoint(&self) -> Option<SocketAddr> {
        if !self.config.fail_open || self.config.endpoints.is_empty() {
            return None;
        }
        let i = self.round_robin.fetch_add(1, Ordering::Relaxed);
        Some(self.config.endpoints[i % self.config.endpoints.len()])
    }

    /// Tries the endpoints in order; moves on when one cannot be reached or answers 503 (the
    /// last one's 503 is the answer). None when no endpoint produced a response head.
    async fn forward(
        &self,
        endpoints: &[SocketAddr],
        headers: &HeaderList,
        body: Bytes,
    ) -> Option<(Response<Incoming>, SocketAddr)> {
        let n = endpoints.len();
        for (i, &ep) in endpoints.iter().enumerate() {
            let last = i + 1 == n;
            let req = match upstream_request(ep, headers, body.clone()) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot build the upstream request");
                    return None;
                }
            };
            let outcome = tokio::time::timeout(
                self.config.upstream_response_timeout,
                self.upstream.request(req),
            )
            .await;
            match outcome {
                Ok(Ok(resp)) if resp.status() != StatusCode::SERVICE_UNAVAILABLE || last => {
                    return Some((resp, ep));
                }
                Ok(Ok(_)) => tracing::debug!(%ep, "endpoint answered 503; trying the next"),
                Ok(Err(e)) => tracing::debug!(%ep, error = %e, "endpoint failed"),
                Err(_) => tracing::debug!(%ep, "endpoint timed out"),
            }
            if !last {
                self.stats.count(Event::Fallback);
            }
        }
        None
    }

    /// The response half: response headers to the picker, its answer applied, then the body
    /// per mode on a task that closes the stream when the client's body has ended.
    async fn respond(
        self: Arc<Self>,
        mut ex: Exchange,
        resp: Response<Incoming>,
        served: String,
    ) -> Response<Body> {
        let mode = self.config.response_body_mode;
        let (parts, body) = resp.into_parts();
        let mut list = response_headers(&parts, &served, mode == ResponseBodyMode::None);
        let ended = body.is_end_stream();
        let msg = ProcessingRequest {
            request: Some(Req::ResponseHeaders(HttpHeaders {
                headers: Some(extproc::header_map(&list)),
                end_of_stream: ended,
                ..Default::default()
            })),
            metadata_context: Some(extproc::served_metadata(&served)),
            ..Default::default()
        };
        if let Err(e) = ex.send(msg).await {
            return self.response_failure(e);
        }
        let (mut upstream_body, duplex_sender) = match mode {
            ResponseBodyMode::FullDuplexStreamed if !ended => {
                let (tx, last_sent) = ex.sender();
                let task = tokio::spawn(stream_response_body(body, tx, last_sent));
                (None, Some(task))
            }
            _ => (Some(body), None),
        };
        let answer = match ex.recv().await {
            Ok(ProcessingResponse {
                response: Some(Resp::ResponseHeaders(h)),
                ..
            }) => h,
            Ok(ProcessingResponse {
                response: Some(Resp::ImmediateResponse(i)),
                ..
            }) => {
                abort(duplex_sender);
                self.stats.count(Event::Immediate);
                tokio::spawn(ex.close());
                return immediate_reply(&i);
            }
            Ok(_) => {
                abort(duplex_sender);
                return self.response_failure(protocol("expected a response_headers response"));
            }
            Err(e) => {
                abort(duplex_sender);
                return self.response_failure(e);
            }
        };
        if let Some(m) = answer
            .response
            .as_ref()
            .and_then(|c| c.header_mutation.as_ref())
        {
            extproc::apply_mutation(&mut list, m);
        }
        let (client_tx, client_rx) = mpsc::channel::<Result<Bytes, io::Error>>(16);
        match (mode, upstream_body.take(), duplex_sender) {
            (_, _, _) if ended => {
                tokio::spawn(ex.close());
            }
            (ResponseBodyMode::None, Some(body), _) => {
                tokio::spawn(pass_body(ex, body, client_tx));
            }
            (ResponseBodyMode::Streamed, Some(body), _) => {
                tokio::spawn(streamed_body(ex, body, client_tx));
            }
            (_, _, Some(sender)) => {
                tokio::spawn(duplex_body(ex, sender, client_tx));
            }
            _ => {
                // Unreachable by construction: each mode kept what it needs above.
                tokio::spawn(ex.close());
            }
        }
        client_response(&list, Body::from_stream(ReceiverStream::new(client_rx)))
    }

    fn response_failure(&self, e: PickerError) -> Response<Body> {
        self.stats.count(Event::PickerError);
        tracing::warn!(error = %e, "picker failed on the response path");
        local_reply(
            StatusCode::BAD_GATEWAY,
            &format!("endpoint picker failed on the response: {e}"),
        )
    }
}

/// Per-request bookkeeping while the picker answers the request half.
struct RequestState {
    headers: HeaderList,
    original: Bytes,
    body: BytesMut,
    mutated: bool,
    from_metadata: Option<Vec<String>>,
    from_header: Option<Vec<String>>,
    latency_recorded: bool,
}

impl RequestState {
    fn record_latency(&mut self, last_sent: &LastSent, stats: &Stats) {
        if !self.latency_recorded {
            self.latency_recorded = true;
            stats.picker_latency(Instant::now().saturating_duration_since(last_sent.get()));
        }
    }

    fn note_metadata(&mut self, resp: &ProcessingResponse, last_sent: &LastSent, stats: &Stats) {
        if self.from_metadata.is_some() {
            return;
        }
        if let Some(d) = resp
            .dynamic_metadata
            .as_ref()
            .and_then(extproc::destination_from_metadata)
        {
            self.from_metadata = Some(d);
            self.record_latency(last_sent, stats);
        }
    }

    fn apply_headers(&mut self, c: &CommonResponse, last_sent: &LastSent, stats: &Stats) {
        let Some(m) = &c.header_mutation else { return };
        if self.from_header.is_none() {
            if let Some(d) = extproc::destination_from_mutation(m) {
                self.from_header = Some(d);
                self.record_latency(last_sent, stats);
            }
        }
        extproc::apply_mutation(&mut self.headers, m);
    }

    /// Applies a request_body answer; true once the body is complete.
    fn apply_body(
        &mut self,
        mode: RequestBodyMode,
        c: Option<&CommonResponse>,
    ) -> Result<bool, PickerError> {
        let mutation = c
            .and_then(|c| c.body_mutation.as_ref())
            .and_then(|m| m.mutation.as_ref());
        match (mode, mutation) {
            (RequestBodyMode::FullDuplexStreamed, Some(Mutation::StreamedResponse(s))) => {
                self.body.extend_from_slice(&s.body);
                Ok(s.end_of_stream)
            }
            (RequestBodyMode::FullDuplexStreamed, None) => Ok(false),
            (RequestBodyMode::FullDuplexStreamed, Some(_)) => Err(protocol(
                "full-duplex body answers must carry streamed_response",
            )),
            (RequestBodyMode::Buffered, Some(Mutation::Body(b))) => {
                self.mutated = true;
                self.body = BytesMut::from(&b[..]);
                Ok(true)
            }
            (RequestBodyMode::Buffered, Some(Mutation::ClearBody(clear))) => {
                if *clear {
                    self.mutated = true;
                    self.body.clear();
                }
                Ok(true)
            }
            (RequestBodyMode::Buffered, None) => Ok(true),
            (RequestBodyMode::Buffered, Some(Mutation::StreamedResponse(_))) => {
                Err(protocol("streamed_response in buffered mode"))
            }
        }
    }
}

fn protocol(what: &str) -> PickerError {
    PickerError::Protocol(what.to_owned())
}

fn abort(task: Option<JoinHandle<()>>) {
    if let Some(t) = task {
        t.abort();
    }
}

fn split(body: &Bytes, chunk_size: usize) -> Vec<Bytes> {
    let size = chunk_size.max(1);
    (0..body.len())
        .step_by(size)
        .map(|start| body.slice(start..(start + size).min(body.len())))
        .collect()
}

fn body_request(body: Bytes, end_of_stream: bool, response: bool) -> ProcessingRequest {
    let b = HttpBody {
        body: body.to_vec(),
        end_of_stream,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(if response {
            Req::ResponseBody(b)
        } else {
            Req::RequestBody(b)
        }),
        ..Default::default()
    }
}

fn upstream_request(
    ep: SocketAddr,
    headers: &HeaderList,
    body: Bytes,
) -> Result<Request<Full<Bytes>>, http::Error> {
    let method = extproc::get(headers, ":method")
        .and_then(|m| Method::from_bytes(m).ok())
        .unwrap_or(Method::GET);
    let path = extproc::get(headers, ":path")
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .unwrap_or_else(|| "/".into());
    let mut b = Request::builder()
        .method(method)
        .uri(format!("http://{ep}{path}"));
    if let Some(authority) = extproc::get(headers, ":authority").filter(|a| !a.is_empty()) {
        b = b.header(HOST, authority);
    }
    for (k, v) in headers {
        // The body may have changed: hyper sets the length of the body actually sent.
        if k.starts_with(':')
            || is_hop_by_hop(k)
            || k == CONTENT_LENGTH.as_str()
            || k == HOST.as_str()
        {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            b = b.header(name, value);
        }
    }
    b.body(Full::new(body))
}

/// The upstream response as a header list for the picker: `:status` first, the served endpoint
/// last. Content-length goes when the picker may rewrite the body.
fn response_headers(parts: &http::response::Parts, served: &str, keep_length: bool) -> HeaderList {
    let mut list: HeaderList = vec![(":status".into(), parts.status.as_str().as_bytes().to_vec())];
    for (k, v) in &parts.headers {
        let key = k.as_str();
        if is_hop_by_hop(key) || (!keep_length && key == CONTENT_LENGTH.as_str()) {
            continue;
        }
        list.push((key.to_owned(), v.as_bytes().to_vec()));
    }
    list.push((extproc::SERVED_HEADER.into(), served.as_bytes().to_vec()));
    list
}

fn client_response(list: &HeaderList, body: Body) -> Response<Body> {
    let status = extproc::get(list, ":status")
        .and_then(|s| StatusCode::from_bytes(s).ok())
        .unwrap_or(StatusCode::OK);
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    for (k, v) in list {
        if k.starts_with(':') || is_hop_by_hop(k) {
            continue;
        }
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(k.as_bytes()),
            HeaderValue::from_bytes(v),
        ) {
            resp.headers_mut().append(name, value);
        }
    }
    resp
}

fn immediate_reply(i: &ImmediateResponse) -> Response<Body> {
    let mut list: HeaderList = Vec::new();
    if let Some(m) = &i.headers {
        extproc::apply_mutation(&mut list, m);
    }
    let status = i
        .status
        .as_ref()
        .and_then(|s| u16::try_from(s.code).ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::OK);
    list.retain(|(k, _)| k != ":status");
    list.insert(0, (":status".into(), status.as_str().as_bytes().to_vec()));
    client_response(&list, Body::from(i.body.clone()))
}

fn local_reply(status: StatusCode, message: &str) -> Response<Body> {
    let mut resp = Response::new(Body::from(format!("{message}\n")));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    resp
}

/// Next upstream body frame's data: `Some(Ok((data, ended)))`, `None` at the end. Trailers are
/// skipped (HTTP/1.1 upstreams practically never send them).
async fn next_data(body: &mut Incoming) -> Option<Result<(Bytes, bool), hyper::Error>> {
    loop {
        match body.frame().await? {
            Err(e) => return Some(Err(e)),
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    return Some(Ok((data, body.is_end_stream())));
                }
            }
        }
    }
}

/// `NONE`: the upstream body goes to the client untouched; the stream closes after it.
async fn pass_body(
    ex: Exchange,
    mut body: Incoming,
    client: mpsc::Sender<Result<Bytes, io::Error>>,
) {
    while let Some(next) = next_data(&mut body).await {
        match next {
            Ok((data, _)) => {
                if client.send(Ok(data)).await.is_err() {
                    break;
                }
            }
            Err(e) => {
                let _ = client.send(Err(io::Error::other(e))).await;
                break;
            }
        }
    }
    drop(client);
    ex.close().await;
}

/// `STREAMED`: each chunk to the picker, its answer (or the chunk) to the client.
async fn streamed_body(
    mut ex: Exchange,
    mut body: Incoming,
    client: mpsc::Sender<Result<Bytes, io::Error>>,
) {
    loop {
        let (data, ended) = match next_data(&mut body).await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                let _ = client.send(Err(io::Error::other(e))).await;
                return;
            }
            // The end showed only after the last chunk: tell the picker with an empty chunk.
            None => (Bytes::new(), true),
        };
        if let Err(e) = ex.send(body_request(data.clone(), ended, true)).await {
            let _ = client.send(Err(io::Error::other(e))).await;
            return;
        }
        let out = match ex.recv().await {
            Ok(ProcessingResponse {
                response: Some(Resp::ResponseBody(b)),
                ..
            }) => match b
                .response
                .as_ref()
                .and_then(|c| c.body_mutation.as_ref())
                .and_then(|m| m.mutation.as_ref())
            {
                Some(Mutation::Body(new)) => Bytes::from(new.clone()),
                Some(Mutation::ClearBody(true)) => Bytes::new(),
                Some(Mutation::StreamedResponse(s)) => Bytes::from(s.body.clone()),
                _ => data,
            },
            Ok(_) => {
                let e = protocol("expected a response_body response");
                let _ = client.send(Err(io::Error::other(e))).await;
                return;
            }
            Err(e) => {
                let _ = client.send(Err(io::Error::other(e))).await;
                return;
            }
        };
        if !out.is_empty() && client.send(Ok(out)).await.is_err() {
            break;
        }
        if ended {
            break;
        }
    }
    drop(client);
    ex.close().await;
}

/// `FULL_DUPLEX_STREAMED` send side: every upstream chunk to the picker without waiting.
async fn stream_response_body(
    mut body: Incoming,
    tx: mpsc::Sender<ProcessingRequest>,
    last_sent: LastSent,
) {
    loop {
        let (data, ended) = match next_data(&mut body).await {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "upstream body failed");
                return;
            }
            None => (Bytes::new(), true),
        };
        if exchange::send(&tx, &last_sent, body_request(data, ended, true))
            .await
            .is_err()
            || ended
        {
            return;
        }
    }
}

/// `FULL_DUPLEX_STREAMED` receive side: what the picker streams back goes to the client until
/// its end of stream; then the stream closes.
async fn duplex_body(
    mut ex: Exchange,
    sender: JoinHandle<()>,
    client: mpsc::Sender<Result<Bytes, io::Error>>,
) {
    let failure = loop {
        match ex.recv().await {
            Ok(ProcessingResponse {
                response: Some(Resp::ResponseBody(b)),
                ..
            }) => {
                let streamed = b
                    .response
                    .and_then(|c| c.body_mutation)
                    .and_then(|m| m.mutation);
                let Some(Mutation::StreamedResponse(s)) = streamed else {
                    continue;
                };
                if !s.body.is_empty() && client.send(Ok(Bytes::from(s.body))).await.is_err() {
                    break None;
                }
                if s.end_of_stream {
                    break None;
                }
            }
            Ok(ProcessingResponse {
                response: Some(Resp::ResponseTrailers(_)),
                ..
            }) => {}
            Ok(_) => break Some(protocol("expected a response_body response")),
            Err(e) => break Some(e),
        }
    };
    // The picker has ended the body (or failed): nothing more of the upstream body is needed.
    sender.abort();
    let _ = sender.await;
    match failure {
        Some(e) => {
            let _ = client.send(Err(io::Error::other(e))).await;
        }
        None => {
            drop(client);
            ex.close().await;
        }
    }
}
