//! The endpoint picker on the wire: `Proxy::start_front` with the ext_proc server on port 0 in
//! front of simulated vLLM replicas (real HTTP and ZMQ KV events), driven message by message by
//! a tonic ext_proc client as a gateway would. Proves the answers each body mode calls for, the
//! destination header and `envoy.lb` list, the subset hint, immediate responses, served-endpoint
//! accounting and that no stream — cut, garbage or refused — leaks an in-flight claim. Nothing
//! sleeps to wait: tests wait on the router's state or the next message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, CommonResponse, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct};
use kinference_epp::wire;
use kinference_proxy::{Config, PoolConfig, Proxy};
use kinference_sim_server::Server;
use kinference_testkit::{metric, sim, tokenizer_dir, WAIT};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

mod common;

use common::{admin_metrics, sims, wait_no_in_flight, MODEL};

/// A long shared prefix (about 1,000 tokens) and a question that differs per request.
fn prompt(doc: usize, question: &str) -> String {
    let mut s = format!("Document {doc}. ");
    for i in 0..120 {
        s.push_str(&format!(
            "Section {i} of document {doc} explains block hashing. "
        ));
    }
    s.push_str(question);
    s
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 4})).unwrap()
}

/// The picker in front of `sims`, the precise policy without speculation (a cache hit can only
/// come from the replicas' KV events), gateways that do not say their mode taken as full duplex.
async fn picker(sims: &[Server], speculative_ms: u64) -> Proxy {
    let mut p = PoolConfig::new(MODEL, tokenizer_dir(), 32);
    p.policy = kinference_proxy::parse_policy(&format!(
        "{{kind: precise, speculative_ttl_ms: {speculative_ms}}}"
    ))
    .unwrap();
    p.replicas = sims.iter().map(sim::replica_with_events).collect();
    let mut cfg = Config::new(vec![p]);
    cfg.scrape.interval_ms = 50;
    cfg.limits.max_body_bytes = 64 << 10;
    // Streams the tests leave open would hold shutdown for the whole drain time.
    cfg.timeouts.drain_ms = 100;
    let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxy = Proxy::start_front(
        cfg,
        front,
        admin,
        kinference_epp::front(kinference_epp::Settings::default()),
    )
    .await
    .unwrap();
    proxy
        .wait_until(WAIT, |s| {
            s.readiness().pools[0].healthy_replicas == sims.len()
        })
        .await
        .unwrap_or_else(|s| panic!("replicas never came up: {s:#?}"));
    // Events published before the subscription is up are lost until the next gap check.
    for s in sims {
        proxy
            .wait_for_events(&format!("http://{}", s.addr), 0, WAIT, |h| h.connected)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{e}: {:#?}",
                    proxy.status().pools[0]
                        .replicas
                        .iter()
                        .map(|r| (
                            r.url.clone(),
                            r.events_error.clone(),
                            r.workers[0].events.clone()
                        ))
                        .collect::<Vec<_>>()
                )
            });
    }
    proxy
}

/// One ext_proc stream: what the test sends, and what the picker answers.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

async fn open(proxy: &Proxy) -> Stream {
    let channel = Channel::from_shared(format!("http://{}", proxy.data_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let (tx, rx) = mpsc::channel(64);
    let rx = ExternalProcessorClient::new(channel)
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    Stream { tx, rx }
}

impl Stream {
    async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    async fn next(&mut self) -> processing_response::Response {
        self.next_full().await.response.unwrap()
    }

    async fn next_full(&mut self) -> ProcessingResponse {
        tokio::time::timeout(WAIT, self.rx.message())
            .await
            .expect("the picker did not answer")
            .unwrap()
            .expect("the picker closed the stream")
    }
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}

fn request_headers(path: &str, end_of_stream: bool) -> ProcessingRequest {
    request_headers_with(path, end_of_stream, &[])
}

fn request_headers_with(
    path: &str,
    end_of_stream: bool,
    extra: &[(&str, &str)],
) -> ProcessingRequest {
    let mut all = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gateway"),
        ("content-type", "application/json"),
    ];
    all.extend_from_slice(extra);
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(headers(&all)),
            end_of_stream,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn with_mode(mut msg: ProcessingRequest, mode: BodySendMode) -> ProcessingRequest {
    msg.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: mode as i32,
        response_body_mode: mode as i32,
        ..ProtocolConfiguration::default()
    });
    msg
}

fn with_subset(mut msg: ProcessingRequest, subset: &[String]) -> ProcessingRequest {
    let mut md = Metadata::default();
    md.filter_metadata.insert(
        wire::SUBSET_NAMESPACE.to_owned(),
        Struct {
            fields: HashMap::from([(wire::SUBSET_KEY.to_owned(), wire::string_list(subset))]),
        },
    );
    msg.metadata_context = Some(md);
    msg
}

fn body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_headers(status: u16, served: &str) -> ProcessingRequest {
    let status = status.to_string();
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(headers(&[
                (":status", &status),
                ("content-type", "application/json"),
                (wire::SERVED, served),
            ])),
            end_of_stream: false,
            ..HttpHeaders::default()
        })),
        ..ProcessingRequest::default()
    }
}

fn response_body(chunk: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: chunk.to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })),
        ..ProcessingRequest::default()
    }
}

/// The destination header's value and the `envoy.lb` list of a picker's answer.
fn destination(common: &CommonResponse, msg: &ProcessingResponse) -> (String, Vec<String>) {
    let header = common
        .header_mutation
        .as_ref()
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == wire::DESTINATION)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .expect("no destination header");
    let md = msg.dynamic_metadata.as_ref().expect("no dynamic metadata");
    let Some(Kind::StructValue(lb)) = md.fields[wire::LB_NAMESPACE].kind.clone() else {
        panic!("envoy.lb is not a struct: {md:?}");
    };
    let Some(Kind::StringValue(list)) = lb.fields[wire::DESTINATION].kind.clone() else {
        panic!("the endpoint list is not a string: {lb:?}");
    };
    (header, wire::split_list(&list))
}

/// Sends a request in full-duplex style (headers, then the body in `chunks` pieces) and returns
/// the picked endpoints, checking that the body streamed back is the body sent.
async fn pick_full_duplex(
    s: &mut Stream,
    path: &str,
    payload: &[u8],
    chunks: usize,
) -> Vec<String> {
    s.send(request_headers(path, false)).await;
    let size = payload.len().div_ceil(chunks);
    let pieces: Vec<&[u8]> = payload.chunks(size).collect();
    for (i, c) in pieces.iter().enumerate() {
        s.send(body(c, i + 1 == pieces.len())).await;
    }
    let first = s.next_full().await;
    let Some(processing_response::Response::RequestHeaders(h)) = &first.response else {
        panic!("expected the request-headers answer first, got {first:?}");
    };
    let common = h.response.as_ref().unwrap();
    assert!(common.clear_route_cache);
    let (header, list) = destination(common, &first);
    assert_eq!(header.split(',').next(), list.first().map(String::as_str));
    let mut echoed = Vec::new();
    loop {
        let processing_response::Response::RequestBody(b) = s.next().await else {
            panic!("expected streamed body answers");
        };
        let Some(body_mutation::Mutation::StreamedResponse(sr)) =
            b.response.unwrap().body_mutation.unwrap().mutation
        else {
            panic!("a full-duplex body answer must be a streamed response");
        };
        echoed.extend_from_slice(&sr.body);
        if sr.end_of_stream {
            break;
        }
    }
    assert_eq!(echoed, payload, "the body streamed back differs");
    list
}

/// Forwards `payload` to `endpoint` as the gateway would, returning the status and body.
async fn forward(endpoint: &str, payload: &[u8]) -> (u16, Vec<u8>) {
    let r = reqwest::Client::new()
        .post(format!("http://{endpoint}/v1/completions"))
        .header("content-type", "application/json")
        .body(payload.to_vec())
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.bytes().await.unwrap().to_vec())
}

fn in_flight_of(proxy: &Proxy, endpoint: &str) -> u32 {
    let url = format!("http://{endpoint}");
    proxy.status().pools[0]
        .replicas
        .iter()
        .find(|r| r.url == url)
        .map(|r| r.workers[0].load.in_flight)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_duplex_picks_after_the_body_and_a_repeated_prefix_goes_where_it_is_cached() {
    let sims = sims(3).await;
    let proxy = picker(&sims, 0).await;
    let payload = completion(&prompt(1, "What is a block?"));

    let mut s = open(&proxy).await;
    let list = pick_full_duplex(&mut s, "/v1/completions", &payload, 7).await;
    assert_eq!(list.len(), 3, "every replica, best first: {list:?}");
    let first = list[0].clone();
    assert_eq!(
        in_flight_of(&proxy, &first),
        1,
        "the claim is on the first pick"
    );
    let (status, resp) = forward(&first, &payload).await;
    assert_eq!(status, 200);
    s.send(response_headers(200, &first)).await;
    assert!(matches!(
        s.next().await,
        processing_response::Response::ResponseHeaders(_)
    ));
    s.send(response_body(&resp, true)).await;
    let processing_response::Response::ResponseBody(b) = s.next().await else {
        panic!("expected the response-body answer");
    };
    let Some(body_mutation::Mutation::StreamedResponse(sr)) =
        b.response.unwrap().body_mutation.unwrap().mutation
    else {
        panic!("the response body is streamed back in full duplex");
    };
    assert_eq!(sr.body, resp);
    assert!(sr.end_of_stream);
    wait_no_in_flight(&proxy).await;
    drop(s);

    // The replica's KV events put the prefix in the index; the same prefix is then picked
    // there first, as `kinference serve` would route it.
    let usage: serde_json::Value = serde_json::from_slice(&resp).unwrap();
    let blocks = usage["usage"]["prompt_tokens"].as_u64().unwrap() as usize / 32;
    assert!(blocks >= 20, "{usage}");
    let url = format!("http://{first}");
    proxy
        .wait_for_events(&url, 0, WAIT, |h| h.entries >= blocks && !h.stale)
        .await
        .unwrap();
    // The admin API is the router's: /debug/explain says what the picker will choose.
    let explain: serde_json::Value = reqwest::Client::new()
        .post(format!("http://{}/debug/explain", proxy.admin_addr()))
        .body(completion(&prompt(1, "Explain?")))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(explain["reason"], "cached_prefix", "{explain}");
    assert_eq!(explain["candidates"][0]["replica"], url, "{explain}");
    for q in ["And the hash?", "And the seed?"] {
        let mut s = open(&proxy).await;
        let again =
            pick_full_duplex(&mut s, "/v1/completions", &completion(&prompt(1, q)), 3).await;
        assert_eq!(again[0], first, "{again:?}");
    }
    wait_no_in_flight(&proxy).await;
    let page = admin_metrics(&proxy).await;
    assert_eq!(
        metric(
            &page,
            "kinference_picker_served_total{pool=\"tiny\",kind=\"first\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(
            &page,
            "kinference_picker_served_total{pool=\"tiny\",kind=\"unreported\"}"
        ),
        2.0
    );
    assert!(
        metric(
            &page,
            "kinference_decisions_total{pool=\"tiny\",policy=\"precise\",reason=\"cached_prefix\"}"
        ) >= 2.0,
        "{page}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffered_mode_answers_every_message_and_puts_the_destination_on_the_body_answer() {
    let sims = sims(2).await;
    let proxy = picker(&sims, 0).await;
    let payload = completion(&prompt(2, "Buffered?"));
    let mut s = open(&proxy).await;
    s.send(with_mode(
        request_headers("/v1/completions", false),
        BodySendMode::Buffered,
    ))
    .await;
    let processing_response::Response::RequestHeaders(h) = s.next().await else {
        panic!("buffered: the headers are answered at once");
    };
    assert!(h.response.is_none(), "continue unchanged: {h:?}");
    s.send(body(&payload, true)).await;
    let msg = s.next_full().await;
    let Some(processing_response::Response::RequestBody(b)) = &msg.response else {
        panic!("expected the body answer: {msg:?}");
    };
    let common = b.response.as_ref().unwrap();
    assert!(common.body_mutation.is_none(), "buffered: the body is kept");
    let (header, list) = destination(common, &msg);
    assert_eq!(list.len(), 2);
    assert!(header.starts_with(&list[0]));
    // The response path in buffered/streamed mode: each message answered, nothing echoed.
    s.send(response_headers(200, &list[0])).await;
    assert!(matches!(
        s.next().await,
        processing_response::Response::ResponseHeaders(_)
    ));
    s.send(response_body(b"{}", true)).await;
    let processing_response::Response::ResponseBody(b) = s.next().await else {
        panic!("expected the response-body answer");
    };
    assert!(b.response.is_none());
    wait_no_in_flight(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subset_hint_limits_the_pick_and_an_empty_subset_is_an_immediate_503() {
    let sims = sims(3).await;
    let proxy = picker(&sims, 0).await;
    let only = vec![sims[1].addr.to_string(), sims[2].addr.to_string()];
    let payload = completion(&prompt(3, "Subset?"));
    for _ in 0..4 {
        let mut s = open(&proxy).await;
        s.send(with_subset(
            request_headers("/v1/completions", false),
            &only,
        ))
        .await;
        s.send(body(&payload, true)).await;
        let first = s.next_full().await;
        let Some(processing_response::Response::RequestHeaders(h)) = &first.response else {
            panic!("{first:?}");
        };
        let (_, list) = destination(h.response.as_ref().unwrap(), &first);
        let mut sorted = list.clone();
        sorted.sort();
        let mut want = only.clone();
        want.sort();
        assert_eq!(sorted, want, "only the subset: {list:?}");
    }
    let mut s = open(&proxy).await;
    s.send(with_subset(
        request_headers("/v1/completions", false),
        &["10.255.0.1:8000".to_owned()],
    ))
    .await;
    s.send(body(&payload, true)).await;
    let processing_response::Response::ImmediateResponse(ir) = s.next().await else {
        panic!("expected an immediate response");
    };
    assert_eq!(ir.status.unwrap().code, 503);
    let err: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
    assert_eq!(err["error"]["code"], 503, "{err}");
    wait_no_in_flight(&proxy).await;
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_immediate_openai_errors() {
    let sims = sims(1).await;
    let proxy = picker(&sims, 0).await;
    let cases: Vec<(Vec<u8>, u16)> = vec![
        (
            serde_json::to_vec(&json!({"model": "nope", "prompt": "x"})).unwrap(),
            404,
        ),
        (b"{not json".to_vec(), 400),
        (vec![b' '; 65 << 10], 413),
    ];
    for (payload, want) in cases {
        let mut s = open(&proxy).await;
        s.send(request_headers("/v1/completions", false)).await;
        for c in payload.chunks(16 << 10) {
            s.send(body(c, false)).await;
        }
        s.send(body(b"", true)).await;
        let processing_response::Response::ImmediateResponse(ir) = s.next().await else {
            panic!("expected an immediate {want}");
        };
        assert_eq!(ir.status.unwrap().code, i32::from(want));
        let err: serde_json::Value = serde_json::from_slice(&ir.body).unwrap();
        assert_eq!(err["error"]["code"], want, "{err}");
    }
    let page = admin_metrics(&proxy).await;
    assert_eq!(
        metric(&page, "kinference_router_errors_total{kind=\"too_large\"}"),
        1.0
    );
    assert_eq!(
        metric(
            &page,
            "kinference_router_errors_total{kind=\"unknown_model\"}"
        ),
        1.0
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_the_gateway_reports_takes_the_claim_and_the_speculative_entries() {
    let sims = sims(2).await;
    // Speculation on: the first pick records the prefix at the first endpoint until the
    // gateway reports another one served.
    let proxy = picker(&sims, 60_000).await;
    let payload = completion(&prompt(4, "Fallback?"));
    let mut s = open(&proxy).await;
    let list = pick_full_duplex(&mut s, "/v1/completions", &payload, 2).await;
    let (first, second) = (list[0].clone(), list[1].clone());
    s.send(response_headers(200, &second)).await;
    assert!(matches!(
        s.next().await,
        processing_response::Response::ResponseHeaders(_)
    ));
    assert_eq!(
        in_flight_of(&proxy, &second),
        1,
        "the claim moved to the endpoint that served"
    );
    assert_eq!(in_flight_of(&proxy, &first), 0);
    // The prefix is now expected at the fallback: the next request with it goes there.
    let mut s2 = open(&proxy).await;
    let next = pick_full_duplex(
        &mut s2,
        "/v1/completions",
        &completion(&prompt(4, "Again?")),
        1,
    )
    .await;
    assert_eq!(next[0], second, "{next:?}");
    drop(s2);
    s.send(response_body(b"{}", true)).await;
    let _ = s.next().await;
    wait_no_in_flight(&proxy).await;
    let page = admin_metrics(&proxy).await;
    assert_eq!(
        metric(
            &page,
            "kinference_picker_served_total{pool=\"tiny\",kind=\"fallback\"}"
        ),
        1.0
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_and_cut_streams_end_cleanly_without_leaking_claims() {
    let sims = sims(2).await;
    let proxy = picker(&sims, 0).await;
    let payload = completion(&prompt(5, "Cut?"));

    // A body before any headers: a clean gRPC error.
    let mut s = open(&proxy).await;
    s.send(body(b"{}", true)).await;
    let err = tokio::time::timeout(WAIT, s.rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    // A message without a request.
    let mut s = open(&proxy).await;
    s.send(ProcessingRequest::default()).await;
    let err = tokio::time::timeout(WAIT, s.rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    // Headers twice.
    let mut s = open(&proxy).await;
    s.send(request_headers("/v1/completions", false)).await;
    s.send(request_headers("/v1/completions", false)).await;
    let err = tokio::time::timeout(WAIT, s.rx.message())
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err}");

    // Picked, then the gateway goes away mid-response and mid-request.
    for cut_after_response_head in [true, false] {
        let mut s = open(&proxy).await;
        let list = pick_full_duplex(&mut s, "/v1/completions", &payload, 4).await;
        if cut_after_response_head {
            s.send(response_headers(200, &list[0])).await;
            let _ = s.next().await;
        }
        assert_eq!(in_flight_of(&proxy, &list[0]), 1);
        drop(s);
        wait_no_in_flight(&proxy).await;
    }
    // Half a body, then gone.
    let s = open(&proxy).await;
    s.send(request_headers("/v1/completions", false)).await;
    s.send(body(&payload[..10], false)).await;
    drop(s);
    wait_no_in_flight(&proxy).await;
    assert_eq!(proxy.in_flight(), 0);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_a_body_is_picked_on_its_headers_and_health_says_serving() {
    let sims = sims(2).await;
    let proxy = picker(&sims, 0).await;
    let mut s = open(&proxy).await;
    s.send(request_headers("/v1/models", true)).await;
    let first = s.next_full().await;
    let Some(processing_response::Response::RequestHeaders(h)) = &first.response else {
        panic!("{first:?}");
    };
    let (_, list) = destination(h.response.as_ref().unwrap(), &first);
    assert_eq!(list.len(), 2);
    drop(s);
    wait_no_in_flight(&proxy).await;

    let channel = Channel::from_shared(format!("http://{}", proxy.data_addr()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    // Health.Watch streams every status change: wait on it, not on a timer.
    for service in ["", "envoy.service.ext_proc.v3.ExternalProcessor"] {
        let mut updates = health
            .watch(tonic_health::pb::HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .unwrap()
            .into_inner();
        let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
        tokio::time::timeout(WAIT, async {
            while let Some(update) = updates.message().await.unwrap() {
                if update.status == serving {
                    return;
                }
            }
            panic!("{service:?}: the health stream ended before SERVING");
        })
        .await
        .unwrap_or_else(|_| panic!("{service:?} never served"));
    }
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_rewrite_routes_as_the_new_model_and_rewrites_the_body() {
    let sims = sims(1).await;
    let proxy = picker(&sims, 0).await;
    let payload =
        serde_json::to_vec(&json!({"model": "alias", "prompt": "Rewrite me", "max_tokens": 2}))
            .unwrap();
    for mode in [BodySendMode::FullDuplexStreamed, BodySendMode::Buffered] {
        let mut s = open(&proxy).await;
        s.send(with_mode(
            request_headers_with("/v1/completions", false, &[(wire::MODEL_REWRITE, MODEL)]),
            mode,
        ))
        .await;
        if mode == BodySendMode::Buffered {
            assert!(matches!(
                s.next().await,
                processing_response::Response::RequestHeaders(_)
            ));
        }
        s.send(body(&payload, true)).await;
        let msg = s.next_full().await;
        let (common, sent) = match msg.response.clone().unwrap() {
            processing_response::Response::RequestHeaders(h) => {
                let processing_response::Response::RequestBody(b) = s.next().await else {
                    panic!("expected the streamed body");
                };
                let Some(body_mutation::Mutation::StreamedResponse(sr)) =
                    b.response.unwrap().body_mutation.unwrap().mutation
                else {
                    panic!("not streamed");
                };
                (h.response.unwrap(), sr.body)
            }
            processing_response::Response::RequestBody(b) => {
                let c = b.response.unwrap();
                let Some(body_mutation::Mutation::Body(sent)) =
                    c.body_mutation.clone().unwrap().mutation
                else {
                    panic!("buffered: the body is replaced whole");
                };
                (c, sent)
            }
            other => panic!("{mode:?}: {other:?}"),
        };
        let (_, list) = destination(&common, &msg);
        assert_eq!(list, vec![sims[0].addr.to_string()]);
        let v: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["prompt"], "Rewrite me");
        let m = common.header_mutation.unwrap();
        let len = m
            .set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == "content-length")
            .map(|h| String::from_utf8(h.raw_value.clone()).unwrap());
        assert_eq!(len, Some(sent.len().to_string()));
        assert_eq!(m.remove_headers, vec![wire::MODEL_REWRITE.to_owned()]);
    }
    wait_no_in_flight(&proxy).await;
    proxy.shutdown().await;
}
