//! Test doubles for the gateway tests: a toy endpoint picker (a tonic ext_proc server on port 0)
//! that records every message of every stream and answers as a GIE picker would, and small axum
//! upstreams that record what reached them. Invariant: waits are on recorded state (watch
//! channels), bounded only so a broken gateway fails the test instead of hanging it.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Req;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Resp;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};
use kinference_testgw::{Gateway, GatewayConfig};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;

/// Longest any condition wait may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(20);

/// Waits until `pred` holds on the watched value.
pub async fn wait_until<T>(rx: &watch::Sender<T>, what: &str, pred: impl FnMut(&T) -> bool) {
    let mut sub = rx.subscribe();
    let ok = matches!(
        tokio::time::timeout(WAIT, sub.wait_for(pred)).await,
        Ok(Ok(_))
    );
    assert!(ok, "timed out waiting for {what}");
}

/// What the toy picker saw on one stream, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    RequestHeaders {
        headers: Vec<(String, String)>,
        end_of_stream: bool,
        subset: Option<Vec<String>>,
        request_body_mode: Option<i32>,
        response_body_mode: Option<i32>,
    },
    RequestBody {
        body: Vec<u8>,
        end_of_stream: bool,
    },
    ResponseHeaders {
        headers: Vec<(String, String)>,
        end_of_stream: bool,
        served_metadata: Option<String>,
    },
    ResponseBody {
        body: Vec<u8>,
        end_of_stream: bool,
    },
    Trailers,
    /// The gateway half-closed the stream cleanly.
    End,
    /// The stream failed (reset, transport error).
    Error(String),
}

impl Seen {
    pub fn header(&self, key: &str) -> Option<&str> {
        match self {
            Seen::RequestHeaders { headers, .. } | Seen::ResponseHeaders { headers, .. } => headers
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str()),
            _ => None,
        }
    }
}

/// How the toy picker answers.
#[derive(Clone, Debug, Default)]
pub struct Behavior {
    /// Destination list put in dynamic metadata `envoy.lb`.
    pub metadata_destination: Option<String>,
    /// Destination put in the `x-gateway-destination-endpoint` header mutation.
    pub header_destination: Option<String>,
    /// Answer every request with this immediate response (status, body).
    pub immediate: Option<(u16, String)>,
    /// Full duplex: the request body streamed back is the received one upper-cased.
    /// Buffered: the body is replaced by its upper-cased form.
    pub uppercase_request_body: bool,
    /// Response body chunks come back upper-cased (streamed and full-duplex response modes).
    pub uppercase_response_body: bool,
}

/// Both destination carriers naming the same list.
pub fn route_to(list: &str) -> Behavior {
    Behavior {
        metadata_destination: Some(list.to_owned()),
        header_destination: Some(list.to_owned()),
        ..Default::default()
    }
}

pub struct ToyPicker {
    pub addr: SocketAddr,
    /// One entry per ext_proc stream, in the order streams opened.
    pub streams: Arc<watch::Sender<Vec<Vec<Seen>>>>,
    behavior: Arc<Mutex<Behavior>>,
    _stop: oneshot::Sender<()>,
}

impl ToyPicker {
    pub async fn start(behavior: Behavior) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind picker");
        let addr = listener.local_addr().expect("picker addr");
        let streams = Arc::new(watch::Sender::new(Vec::new()));
        let behavior = Arc::new(Mutex::new(behavior));
        let service = PickerService {
            streams: streams.clone(),
            behavior: behavior.clone(),
        };
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(ExternalProcessorServer::new(service))
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    async move {
                        let _ = stopped.await;
                    },
                )
                .await
                .expect("picker server");
        });
        Self {
            addr,
            streams,
            behavior,
            _stop: stop,
        }
    }

    pub fn set_behavior(&self, behavior: Behavior) {
        *self.behavior.lock().expect("behavior lock") = behavior;
    }

    pub fn stream(&self, i: usize) -> Vec<Seen> {
        self.streams.borrow()[i].clone()
    }

    /// Waits until stream `i` has ended (cleanly or not) and returns what it saw.
    pub async fn finished_stream(&self, i: usize) -> Vec<Seen> {
        wait_until(&self.streams, "the ext_proc stream to end", |s| {
            s.get(i).is_some_and(|st| {
                st.last()
                    .is_some_and(|e| matches!(e, Seen::End | Seen::Error(_)))
            })
        })
        .await;
        self.stream(i)
    }
}

struct PickerService {
    streams: Arc<watch::Sender<Vec<Vec<Seen>>>>,
    behavior: Arc<Mutex<Behavior>>,
}

fn header_pairs(h: &HttpHeaders) -> Vec<(String, String)> {
    h.headers
        .iter()
        .flat_map(|m| m.headers.iter())
        .map(|v| {
            let value = if v.raw_value.is_empty() {
                v.value.clone()
            } else {
                String::from_utf8_lossy(&v.raw_value).into_owned()
            };
            (v.key.clone(), value)
        })
        .collect()
}

fn struct_string(s: &Struct, ns: &str, key: &str) -> Option<Value> {
    let Some(Value {
        kind: Some(Kind::StructValue(inner)),
    }) = s.fields.get(ns)
    else {
        return None;
    };
    inner.fields.get(key).cloned()
}

fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.into(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        ..Default::default()
    }
}

fn string_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_owned())),
    }
}

/// The picker's answer carrying the destination (header mutation and/or metadata) plus the
/// header edits the tests look for upstream.
fn destination_response(
    b: &Behavior,
    body_phase: bool,
    body: Option<Vec<u8>>,
) -> ProcessingResponse {
    let mut set_headers = vec![set_header("x-picker-set", "yes")];
    if let Some(h) = &b.header_destination {
        set_headers.push(set_header("x-gateway-destination-endpoint", h));
    }
    let common = CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers,
            remove_headers: vec!["x-remove-me".into()],
        }),
        body_mutation: body.map(|b| BodyMutation {
            mutation: Some(Mutation::Body(b)),
        }),
        ..Default::default()
    };
    let dynamic_metadata = b.metadata_destination.as_ref().map(|d| {
        let mut lb = Struct::default();
        lb.fields
            .insert("x-gateway-destination-endpoint".into(), string_value(d));
        let mut md = Struct::default();
        md.fields.insert(
            "envoy.lb".into(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        );
        md
    });
    ProcessingResponse {
        response: Some(if body_phase {
            Resp::RequestBody(BodyResponse {
                response: Some(common),
            })
        } else {
            Resp::RequestHeaders(HeadersResponse {
                response: Some(common),
            })
        }),
        dynamic_metadata,
        ..Default::default()
    }
}

fn streamed(body: Vec<u8>, end_of_stream: bool, response: bool) -> ProcessingResponse {
    let b = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        }),
    };
    ProcessingResponse {
        response: Some(if response {
            Resp::ResponseBody(b)
        } else {
            Resp::RequestBody(b)
        }),
        ..Default::default()
    }
}

const FULL_DUPLEX: i32 = 4;
const STREAMED: i32 = 1;

#[tonic::async_trait]
impl ExternalProcessor for PickerService {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, tonic::Status>>;

    async fn process(
        &self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, tonic::Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let streams = self.streams.clone();
        let mut idx = 0;
        streams.send_modify(|s| {
            idx = s.len();
            s.push(Vec::new());
        });
        let behavior = self.behavior.lock().expect("behavior lock").clone();
        tokio::spawn(async move {
            let record = |seen: Seen| streams.send_modify(|s| s[idx].push(seen));
            let mut request_mode = 0;
            let mut response_mode = 0;
            let mut body = Vec::new();
            let reply = |m: ProcessingResponse| {
                let tx = tx.clone();
                async move {
                    let _ = tx.send(Ok(m)).await;
                }
            };
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => {
                        record(Seen::End);
                        break;
                    }
                    Err(e) => {
                        record(Seen::Error(e.to_string()));
                        break;
                    }
                };
                match msg.request {
                    Some(Req::RequestHeaders(h)) => {
                        let subset = msg
                            .metadata_context
                            .as_ref()
                            .and_then(|m| m.filter_metadata.get("envoy.lb.subset_hint"))
                            .and_then(|s| {
                                s.fields
                                    .get("x-gateway-destination-endpoint-subset")
                                    .cloned()
                            })
                            .and_then(|v| match v.kind {
                                Some(Kind::ListValue(l)) => Some(
                                    l.values
                                        .into_iter()
                                        .filter_map(|v| match v.kind {
                                            Some(Kind::StringValue(s)) => Some(s),
                                            _ => None,
                                        })
                                        .collect(),
                                ),
                                _ => None,
                            });
                        let pc = msg.protocol_config;
                        request_mode = pc.map_or(0, |p| p.request_body_mode);
                        response_mode = pc.map_or(0, |p| p.response_body_mode);
                        record(Seen::RequestHeaders {
                            headers: header_pairs(&h),
                            end_of_stream: h.end_of_stream,
                            subset,
                            request_body_mode: pc.map(|p| p.request_body_mode),
                            response_body_mode: pc.map(|p| p.response_body_mode),
                        });
                        if let Some((status, text)) = &behavior.immediate {
                            reply(ProcessingResponse {
                                response: Some(Resp::ImmediateResponse(ImmediateResponse {
                                    status: Some(HttpStatus {
                                        code: i32::from(*status),
                                    }),
                                    headers: Some(HeaderMutation {
                                        set_headers: vec![set_header("x-shed-by", "toy-picker")],
                                        remove_headers: vec![],
                                    }),
                                    body: text.clone().into_bytes(),
                                    ..Default::default()
                                })),
                                ..Default::default()
                            })
                            .await;
                        } else if h.end_of_stream {
                            reply(destination_response(&behavior, false, None)).await;
                        } else if request_mode != FULL_DUPLEX {
                            // Buffered: headers answered plainly; the pick comes with the body.
                            reply(ProcessingResponse {
                                response: Some(Resp::RequestHeaders(HeadersResponse::default())),
                                ..Default::default()
                            })
                            .await;
                        }
                    }
                    Some(Req::RequestBody(b)) => {
                        record(Seen::RequestBody {
                            body: b.body.clone(),
                            end_of_stream: b.end_of_stream,
                        });
                        body.extend_from_slice(&b.body);
                        if !b.end_of_stream || behavior.immediate.is_some() {
                            continue;
                        }
                        let out = if behavior.uppercase_request_body {
                            body.to_ascii_uppercase()
                        } else {
                            body.clone()
                        };
                        if request_mode == FULL_DUPLEX {
                            // As GIE pickers do: headers answer (with the pick) once the body is
                            // in, then the body streamed back in two pieces.
                            reply(destination_response(&behavior, false, None)).await;
                            let half = out.len() / 2;
                            reply(streamed(out[..half].to_vec(), false, false)).await;
                            reply(streamed(out[half..].to_vec(), true, false)).await;
                        } else {
                            let replacement = behavior.uppercase_request_body.then_some(out);
                            reply(destination_response(&behavior, true, replacement)).await;
                        }
                    }
                    Some(Req::ResponseHeaders(h)) => {
                        let served_metadata = msg
                            .metadata_context
                            .as_ref()
                            .and_then(|m| m.filter_metadata.get("envoy.lb"))
                            .and_then(|s| {
                                s.fields
                                    .get("x-gateway-destination-endpoint-served")
                                    .cloned()
                            })
                            .and_then(|v| match v.kind {
                                Some(Kind::StringValue(s)) => Some(s),
                                _ => None,
                            });
                        record(Seen::ResponseHeaders {
                            headers: header_pairs(&h),
                            end_of_stream: h.end_of_stream,
                            served_metadata,
                        });
                        reply(ProcessingResponse {
                            response: Some(Resp::ResponseHeaders(HeadersResponse {
                                response: Some(CommonResponse {
                                    header_mutation: Some(HeaderMutation {
                                        set_headers: vec![set_header("x-picker-response", "seen")],
                                        remove_headers: vec![],
                                    }),
                                    ..Default::default()
                                }),
                            })),
                            ..Default::default()
                        })
                        .await;
                    }
                    Some(Req::ResponseBody(b)) => {
                        record(Seen::ResponseBody {
                            body: b.body.clone(),
                            end_of_stream: b.end_of_stream,
                        });
                        let out = if behavior.uppercase_response_body {
                            b.body.to_ascii_uppercase()
                        } else {
                            b.body.clone()
                        };
                        if response_mode == FULL_DUPLEX {
                            reply(streamed(out, b.end_of_stream, true)).await;
                        } else if response_mode == STREAMED {
                            let mutation =
                                behavior.uppercase_response_body.then_some(BodyMutation {
                                    mutation: Some(Mutation::Body(out)),
                                });
                            reply(ProcessingResponse {
                                response: Some(Resp::ResponseBody(BodyResponse {
                                    response: Some(CommonResponse {
                                        body_mutation: mutation,
                                        ..Default::default()
                                    }),
                                })),
                                ..Default::default()
                            })
                            .await;
                        }
                    }
                    Some(_) => record(Seen::Trailers),
                    None => {}
                }
            }
        });
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// A request as an upstream saw it.
#[derive(Clone, Debug)]
pub struct Received {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// How an upstream answers.
pub enum Answer {
    /// 200 with body `hello from NAME`.
    Hello(String),
    /// 503 with a body, as an overloaded replica.
    Unavailable,
    /// 200 whose body chunks come from the test (taken by the first request only).
    Stream(Mutex<Option<mpsc::Receiver<Bytes>>>),
}

pub struct Upstream {
    pub addr: SocketAddr,
    pub received: Arc<watch::Sender<Vec<Received>>>,
    _stop: oneshot::Sender<()>,
}

#[derive(Clone)]
struct UpstreamState {
    answer: Arc<Answer>,
    received: Arc<watch::Sender<Vec<Received>>>,
}

async fn upstream_handler(State(st): State<UpstreamState>, req: Request<Body>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX)
        .await
        .expect("upstream body");
    st.received.send_modify(|r| {
        r.push(Received {
            path: parts
                .uri
                .path_and_query()
                .map_or("/".into(), |p| p.as_str().to_owned()),
            headers: parts.headers.clone(),
            body,
        })
    });
    match &*st.answer {
        Answer::Hello(name) => Response::builder()
            .header("content-type", "text/plain")
            .body(Body::from(format!("hello from {name}")))
            .expect("response"),
        Answer::Unavailable => Response::builder()
            .status(StatusCode::SERVICE_UNAVAILABLE)
            .body(Body::from("overloaded"))
            .expect("response"),
        Answer::Stream(rx) => {
            let rx = rx
                .lock()
                .expect("stream lock")
                .take()
                .expect("one streamed request");
            let stream =
                futures_util::StreamExt::map(ReceiverStream::new(rx), Ok::<_, std::io::Error>);
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(Body::from_stream(stream))
                .expect("response")
        }
    }
}

impl Upstream {
    pub async fn start(answer: Answer) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let received = Arc::new(watch::Sender::new(Vec::new()));
        let state = UpstreamState {
            answer: Arc::new(answer),
            received: received.clone(),
        };
        let router = axum::Router::new()
            .fallback(upstream_handler)
            .with_state(state);
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            axum::serve(listener, router)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await
                .expect("upstream server");
        });
        Self {
            addr,
            received,
            _stop: stop,
        }
    }

    pub async fn hello(name: &str) -> Self {
        Self::start(Answer::Hello(name.to_owned())).await
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.borrow().clone()
    }
}

/// An address nothing listens on: bound, then released.
pub async fn refused_addr() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    l.local_addr().expect("addr")
}

pub async fn start_gateway(config: GatewayConfig) -> Gateway {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind gateway");
    Gateway::start(config, listener)
        .await
        .expect("gateway starts")
}

pub fn headers_of(seen: &[Seen]) -> HashMap<String, String> {
    match seen.first() {
        Some(Seen::RequestHeaders { headers, .. }) => headers.iter().cloned().collect(),
        other => panic!("stream does not open with request headers: {other:?}"),
    }
}
