//! One ext_proc stream (one HTTP request through the gateway), as a state machine: request
//! headers → body chunks (collected) → the pick → the answers the body mode calls for →
//! response headers (which endpoint served) → response body chunks → end.
//!
//! ```text
//!  request_headers ─(no body)──────────────────────────▶ pick → headers answer (destination)
//!        │ body follows
//!        ├─ full duplex: nothing yet; body chunks collected; last chunk (or trailers)
//!        │               ▶ pick → headers answer (destination) + the body streamed back
//!        └─ buffered / streamed: headers answer (continue); chunks answered (continue);
//!                        last chunk ▶ pick → body answer (destination)
//!  response_headers ▶ Pick::response_head(served endpoint, status) → continue
//!  response_body    ▶ Pick::response_chunk → echoed (full duplex) or continue; last ▶ finish
//! ```
//!
//! Invariants: every message gets the answers its mode requires, in order; a request the router
//! refuses ends in one immediate response carrying the router's JSON error; the [`Pick`] (and
//! with it the in-flight claim, the gate's place and the speculative entries) is settled however
//! the stream ends — garbage or an error from the gateway is a gRPC error status, never a panic
//! or a leaked claim. A body larger than `max_body_bytes` is refused with 413 before it grows
//! further.

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use kinference_proxy::{Pick, PickRequest, Picker, RequestError};
use tonic::Status;

use crate::wire;
use crate::Settings;

/// How the gateway sends a body, as far as the picker's answers go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyMode {
    /// Chunks stream in without waiting; the picker streams the body back (what GIE gateways
    /// use).
    FullDuplex,
    /// Every chunk (or the one buffered body) waits for its answer.
    Acked,
}

impl BodyMode {
    fn from_proto(mode: i32) -> Option<BodyMode> {
        match BodySendMode::try_from(mode).ok()? {
            BodySendMode::FullDuplexStreamed => Some(BodyMode::FullDuplex),
            BodySendMode::Streamed | BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                Some(BodyMode::Acked)
            }
            BodySendMode::None | BodySendMode::Grpc => None,
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing yet.
    Start,
    /// Request headers seen, body chunks coming.
    Body,
    /// The request was answered (picked, or refused at once); the response path follows.
    Answered,
}

/// The state of one stream.
#[derive(Debug)]
pub struct Exchange {
    picker: Picker,
    phase: Phase,
    request_mode: BodyMode,
    response_mode: BodyMode,
    observe_only: bool,
    head: wire::Head,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    pick: Option<Pick>,
}

impl Exchange {
    pub fn new(picker: Picker, settings: &Settings) -> Self {
        Exchange {
            picker,
            request_mode: settings.request_body_mode,
            response_mode: settings.response_body_mode,
            phase: Phase::Start,
            observe_only: false,
            head: wire::Head::default(),
            subset: None,
            body: Vec::new(),
            pick: None,
        }
    }

    /// Handles one message from the gateway; the answers to send, in order.
    pub async fn on_message(
        &mut self,
        msg: ProcessingRequest,
    ) -> Result<Vec<ProcessingResponse>, Status> {
        if let Some(pc) = &msg.protocol_config {
            self.configure(pc);
        }
        self.observe_only |= msg.observability_mode;
        let md = msg.metadata_context.as_ref();
        let out = match msg.request {
            Some(Request::RequestHeaders(h)) => {
                let subset = wire::subset_hint(md);
                self.request_headers(h, subset).await?
            }
            Some(Request::RequestBody(b)) => self.request_body(b).await?,
            Some(Request::RequestTrailers(_)) => self.request_trailers().await?,
            Some(Request::ResponseHeaders(h)) => {
                let head = wire::head(h.headers.as_ref());
                let served = wire::served(md, &head.headers);
                if let Some(p) = self.pick.as_mut() {
                    p.response_head(served.as_deref(), head.status.unwrap_or(200));
                    if h.end_of_stream {
                        p.finish();
                    }
                }
                vec![wire::response_headers()]
            }
            Some(Request::ResponseBody(b)) => self.response_body(b),
            Some(Request::ResponseTrailers(_)) => {
                if let Some(p) = self.pick.as_mut() {
                    p.finish();
                }
                vec![wire::response_trailers()]
            }
            None => {
                return Err(Status::invalid_argument(
                    "a ProcessingRequest without a request, headers, body or trailers",
                ))
            }
        };
        Ok(if self.observe_only { Vec::new() } else { out })
    }

    /// The gateway's stream ended: `clean` when it closed it, else it broke.
    pub fn end(&mut self, clean: bool) {
        if let Some(p) = self.pick.as_mut() {
            p.abandon(clean);
        }
    }

    fn configure(&mut self, pc: &ProtocolConfiguration) {
        if let Some(m) = BodyMode::from_proto(pc.request_body_mode) {
            self.request_mode = m;
        }
        if let Some(m) = BodyMode::from_proto(pc.response_body_mode) {
            self.response_mode = m;
        }
    }

    async fn request_headers(
        &mut self,
        h: HttpHeaders,
        subset: Option<Vec<String>>,
    ) -> Result<Vec<ProcessingResponse>, Status> {
        if self.phase != Phase::Start {
            return Err(Status::invalid_argument("request headers came twice"));
        }
        self.head = wire::head(h.headers.as_ref());
        self.subset = subset;
        if h.end_of_stream {
            return Ok(self.decide(false).await);
        }
        self.phase = Phase::Body;
        Ok(match self.request_mode {
            BodyMode::FullDuplex => Vec::new(),
            BodyMode::Acked => vec![wire::request_headers(None)],
        })
    }

    async fn request_body(&mut self, b: HttpBody) -> Result<Vec<ProcessingResponse>, Status> {
        match self.phase {
            Phase::Body => {}
            Phase::Start => {
                return Err(Status::invalid_argument(
                    "a request body chunk before the request headers",
                ))
            }
            // Refused already: the gateway may still be sending what it had.
            Phase::Answered => {
                return Ok(match self.request_mode {
                    BodyMode::FullDuplex => Vec::new(),
                    BodyMode::Acked => vec![wire::request_body(None)],
                })
            }
        }
        let limit = self.picker.max_body_bytes();
        if self.body.len() + b.body.len() > limit {
            self.phase = Phase::Answered;
            let err = RequestError::TooLarge { limit };
            self.picker.count_rejected(&err);
            return Ok(vec![refusal(&err)]);
        }
        self.body.extend_from_slice(&b.body);
        if !b.end_of_stream {
            return Ok(match self.request_mode {
                BodyMode::FullDuplex => Vec::new(),
                BodyMode::Acked => vec![wire::request_body(None)],
            });
        }
        Ok(self.decide(true).await)
    }

    async fn request_trailers(&mut self) -> Result<Vec<ProcessingResponse>, Status> {
        let mut out = Vec::new();
        if self.phase == Phase::Body {
            // The body ended with trailers rather than a last chunk.
            out = self.decide(true).await;
        }
        out.push(wire::request_trailers());
        Ok(out)
    }

    /// Picks for the request (headers, and the body when `with_body`), and answers as the
    /// body mode requires.
    async fn decide(&mut self, with_body: bool) -> Vec<ProcessingResponse> {
        self.phase = Phase::Answered;
        let mut body = std::mem::take(&mut self.body);
        let rewrite = self
            .head
            .headers
            .get(wire::MODEL_REWRITE)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .map(str::to_owned);
        let mut rewritten = false;
        if let Some(model) = &rewrite {
            match wire::rewrite_model(&body, model) {
                Some(b) if with_body => {
                    body = b;
                    rewritten = true;
                }
                _ => {
                    let err = RequestError::BadRequest(format!(
                        "{} asks for model `{model}`, but the request has no JSON body to rewrite",
                        wire::MODEL_REWRITE
                    ));
                    self.picker.count_rejected(&err);
                    return vec![refusal(&err)];
                }
            }
        }
        let picked = self
            .picker
            .pick(PickRequest {
                path: &self.head.path,
                headers: &self.head.headers,
                body: &body,
                subset: self.subset.take(),
            })
            .await;
        let pick = match picked {
            Ok(p) => p,
            Err(e) => return vec![refusal(&e)],
        };
        let mut common = wire::destination_common(pick.endpoints(), pick.dp_rank());
        if rewritten {
            wire::rewritten(&mut common, body.len());
        }
        let metadata = wire::destination_metadata(pick.endpoints());
        self.pick = Some(pick);
        let mut out = Vec::new();
        match (with_body, self.request_mode) {
            (false, _) => {
                let mut r = wire::request_headers(Some(common));
                r.dynamic_metadata = Some(metadata);
                out.push(r);
            }
            (true, BodyMode::FullDuplex) => {
                let mut r = wire::request_headers(Some(common));
                r.dynamic_metadata = Some(metadata);
                out.push(r);
                out.extend(wire::request_body_streamed(&body));
            }
            (true, BodyMode::Acked) => {
                if rewritten {
                    wire::replace_body(&mut common, body);
                }
                let mut r = wire::request_body(Some(common));
                r.dynamic_metadata = Some(metadata);
                out.push(r);
            }
        }
        out
    }

    fn response_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        if let Some(p) = self.pick.as_mut() {
            p.response_chunk(&b.body);
            if b.end_of_stream {
                p.finish();
            }
        }
        match self.response_mode {
            BodyMode::FullDuplex => vec![wire::response_body_streamed(b.body, b.end_of_stream)],
            BodyMode::Acked => vec![wire::response_body()],
        }
    }
}

/// The immediate response for a request the router refuses.
fn refusal(err: &RequestError) -> ProcessingResponse {
    let body = serde_json::to_vec(&err.body()).unwrap_or_default();
    let status = err.status().as_u16();
    let retry_after = err.retry_after_s();
    wire::immediate(status, body, retry_after, err.label())
}
