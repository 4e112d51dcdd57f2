//! The gateway against a toy picker and toy upstreams: message order and end of stream on the
//! ext_proc stream, which body goes upstream per mode, endpoint order and fallback, subset hint,
//! immediate responses, the served endpoint, stream closure, fail-open/close, response streaming.

// Helpers and tests may panic: a panic is a test failure with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use bytes::Bytes;
use common::*;
use kinference_testgw::{GatewayConfig, RequestBodyMode, ResponseBodyMode};
use tokio::sync::mpsc;

fn config(picker: &ToyPicker, endpoints: &[&Upstream]) -> GatewayConfig {
    let mut c = GatewayConfig::new(
        picker.addr.to_string(),
        endpoints.iter().map(|u| u.addr).collect(),
    );
    c.chunk_size = 4;
    c
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(WAIT)
        .build()
        .expect("client")
}

async fn post(
    gw: &kinference_testgw::Gateway,
    path: &str,
    body: &'static str,
) -> reqwest::Response {
    client()
        .post(format!("http://{}{path}", gw.local_addr()))
        .header("x-remove-me", "please")
        .header("x-client", "c1")
        .body(body)
        .send()
        .await
        .expect("gateway answers")
}

fn bodies(seen: &[Seen]) -> Vec<(Vec<u8>, bool)> {
    seen.iter()
        .filter_map(|s| match s {
            Seen::RequestBody {
                body,
                end_of_stream,
            } => Some((body.clone(), *end_of_stream)),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn full_duplex_streams_chunks_in_order_and_forwards_the_pickers_body() {
    let up = Upstream::hello("a").await;
    let mut behavior = route_to(&up.addr.to_string());
    behavior.uppercase_request_body = true;
    let picker = ToyPicker::start(behavior).await;
    let gw = start_gateway(config(&picker, &[&up])).await;

    let resp = post(&gw, "/v1/completions?x=1", "abcdefghij").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.expect("body"), "hello from a");

    let seen = picker.finished_stream(0).await;
    let h = headers_of(&seen);
    assert_eq!(h[":method"], "POST");
    assert_eq!(h[":path"], "/v1/completions?x=1");
    assert_eq!(h[":authority"], gw.local_addr().to_string());
    assert_eq!(h[":scheme"], "http");
    assert_eq!(h["x-client"], "c1");
    match &seen[0] {
        Seen::RequestHeaders {
            end_of_stream,
            request_body_mode,
            ..
        } => {
            assert!(!end_of_stream);
            assert_eq!(
                *request_body_mode,
                Some(4),
                "FULL_DUPLEX_STREAMED announced"
            );
        }
        other => panic!("{other:?}"),
    }
    // 10 bytes in chunks of 4: three chunks, end of stream on the last only, nothing between.
    assert_eq!(
        bodies(&seen),
        vec![
            (b"abcd".to_vec(), false),
            (b"efgh".to_vec(), false),
            (b"ij".to_vec(), true)
        ]
    );
    assert!(matches!(
        seen[1..4],
        [
            Seen::RequestBody { .. },
            Seen::RequestBody { .. },
            Seen::RequestBody { .. }
        ]
    ));

    let got = up.received();
    assert_eq!(got.len(), 1);
    assert_eq!(
        got[0].body,
        Bytes::from_static(b"ABCDEFGHIJ"),
        "the picker's streamed body goes upstream"
    );
    assert_eq!(got[0].path, "/v1/completions?x=1");
    assert_eq!(got[0].headers["x-picker-set"], "yes");
    assert_eq!(
        got[0].headers["x-gateway-destination-endpoint"],
        up.addr.to_string().as_str()
    );
    assert_eq!(got[0].headers["content-length"], "10");
    assert!(
        got[0].headers.get("x-remove-me").is_none(),
        "removed by the picker"
    );
    assert_eq!(got[0].headers["x-client"], "c1");
}

#[tokio::test]
async fn buffered_sends_one_body_message_and_keeps_or_replaces_the_body() {
    let up = Upstream::hello("a").await;
    let picker = ToyPicker::start(route_to(&up.addr.to_string())).await;
    let mut c = config(&picker, &[&up]);
    c.request_body_mode = RequestBodyMode::Buffered;
    let gw = start_gateway(c).await;

    let resp = post(&gw, "/v1/chat/completions", "abcdefghij").await;
    assert_eq!(resp.status(), 200);
    let seen = picker.finished_stream(0).await;
    match &seen[0] {
        Seen::RequestHeaders {
            request_body_mode, ..
        } => assert_eq!(*request_body_mode, Some(2), "BUFFERED announced"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        bodies(&seen),
        vec![(b"abcdefghij".to_vec(), true)],
        "one whole body message"
    );
    assert_eq!(
        up.received()[0].body,
        Bytes::from_static(b"abcdefghij"),
        "no mutation keeps the original"
    );
    assert_eq!(up.received()[0].headers["x-picker-set"], "yes");

    let mut replacing = route_to(&up.addr.to_string());
    replacing.uppercase_request_body = true;
    picker.set_behavior(replacing);
    let resp = post(&gw, "/v1/chat/completions", "klmno").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        up.received()[1].body,
        Bytes::from_static(b"KLMNO"),
        "a body mutation replaces it"
    );
    assert_eq!(up.received()[1].headers["content-length"], "5");
}

#[tokio::test]
async fn falls_back_when_the_first_endpoint_refuses_connections() {
    let dead = refused_addr().await;
    let up = Upstream::hello("b").await;
    let picker = ToyPicker::start(route_to(&format!("{dead},{}", up.addr))).await;
    let mut c = config(&picker, &[&up]);
    c.endpoints.insert(0, dead);
    let gw = start_gateway(c).await;

    let resp = post(&gw, "/v1/completions", "hi").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()["x-gateway-destination-endpoint-served"],
        up.addr.to_string().as_str()
    );
    assert_eq!(resp.text().await.expect("body"), "hello from b");
    let seen = picker.finished_stream(0).await;
    let served = seen
        .iter()
        .find(|s| matches!(s, Seen::ResponseHeaders { .. }))
        .expect("response headers reached the picker");
    assert_eq!(
        served.header("x-gateway-destination-endpoint-served"),
        Some(up.addr.to_string().as_str())
    );
    let stats = gw.stats();
    assert_eq!(stats.fallbacks, 1);
    assert_eq!(stats.picks.get(&dead.to_string()), Some(&1));
    assert_eq!(stats.served.get(&up.addr.to_string()), Some(&1));
}

#[tokio::test]
async fn falls_back_when_the_first_endpoint_answers_503_and_keeps_the_last_503() {
    let busy = Upstream::start(Answer::Unavailable).await;
    let up = Upstream::hello("b").await;
    let picker = ToyPicker::start(route_to(&format!("{},{}", busy.addr, up.addr))).await;
    let gw = start_gateway(config(&picker, &[&busy, &up])).await;

    let resp = post(&gw, "/v1/completions", "hi").await;
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.expect("body"), "hello from b");
    assert_eq!(busy.received().len(), 1, "the first endpoint was tried");
    assert_eq!(busy.received()[0].body, Bytes::from_static(b"hi"));
    assert_eq!(
        up.received()[0].body,
        Bytes::from_static(b"hi"),
        "the retry resends the whole body"
    );

    // When the 503 comes from the last endpoint of the list it is the answer.
    picker.set_behavior(route_to(&busy.addr.to_string()));
    let resp = post(&gw, "/v1/completions", "hi").await;
    assert_eq!(resp.status(), 503);
    assert_eq!(
        resp.headers()["x-gateway-destination-endpoint-served"],
        busy.addr.to_string().as_str()
    );
    assert_eq!(gw.stats().fallbacks, 1);
}

#[tokio::test]
async fn metadata_list_wins_over_the_header_and_the_header_alone_routes() {
    let a = Upstream::hello("a").await;
    let b = Upstream::hello("b").await;
    let picker = ToyPicker::start(Behavior {
        metadata_destination: Some(format!("{},{}", b.addr, a.addr)),
        header_destination: Some(a.addr.to_string()),
        ..Default::default()
    })
    .await;
    let gw = start_gateway(config(&picker, &[&a, &b])).await;
    let resp = post(&gw, "/v1/completions", "x").await;
    assert_eq!(resp.text().await.expect("body"), "hello from b");

    picker.set_behavior(Behavior {
        header_destination: Some(a.addr.to_string()),
        ..Default::default()
    });
    let resp = post(&gw, "/v1/completions", "x").await;
    assert_eq!(resp.text().await.expect("body"), "hello from a");
    assert_eq!(a.received().len(), 1);
    assert_eq!(b.received().len(), 1);
}

#[tokio::test]
async fn subset_hint_from_config_and_from_the_request_header() {
    let up = Upstream::hello("a").await;
    let picker = ToyPicker::start(route_to(&up.addr.to_string())).await;
    let mut c = config(&picker, &[&up]);
    c.subset_hint = Some(vec![up.addr.to_string(), "10.9.9.9:80".into()]);
    let gw = start_gateway(c).await;

    post(&gw, "/", "x").await;
    let resp = client()
        .post(format!("http://{}/", gw.local_addr()))
        .header("x-test-subset", format!("{}, 10.1.1.1:8000", up.addr))
        .body("x")
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status(), 200);

    let subset = |i| match picker.stream(i).first() {
        Some(Seen::RequestHeaders {
            subset, headers, ..
        }) => {
            assert!(
                headers.iter().all(|(k, _)| k != "x-test-subset"),
                "the test header is the gateway's own"
            );
            subset.clone()
        }
        other => panic!("{other:?}"),
    };
    picker.finished_stream(1).await;
    assert_eq!(
        subset(0),
        Some(vec![up.addr.to_string(), "10.9.9.9:80".to_string()])
    );
    assert_eq!(
        subset(1),
        Some(vec![up.addr.to_string(), "10.1.1.1:8000".to_string()])
    );
}

#[tokio::test]
async fn immediate_response_goes_to_the_client() {
    let up = Upstream::hello("a").await;
    let picker = ToyPicker::start(Behavior {
        immediate: Some((429, "shed".into())),
        ..Default::default()
    })
    .await;
    let gw = start_gateway(config(&picker, &[&up])).await;
    let resp = post(&gw, "/v1/completions", "abcdefgh").await;
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-shed-by"], "toy-picker");
    assert_eq!(resp.text().await.expect("body"), "shed");
    assert!(up.received().is_empty(), "nothing went upstream");
    let seen = picker.finished_stream(0).await;
    assert_eq!(
        seen.last(),
        Some(&Seen::End),
        "closed cleanly after the immediate response"
    );
    assert!(!seen
        .iter()
        .any(|s| matches!(s, Seen::ResponseHeaders { .. })));
    assert_eq!(gw.stats().immediate_responses, 1);
}

/// One request per response body mode; checks what the picker saw after the upstream answered
/// and that the stream closed only after the response body ended.
#[tokio::test]
async fn served_endpoint_reported_and_stream_closed_after_the_response_body_in_every_mode() {
    let up = Upstream::hello("a").await;
    for (i, mode) in [
        ResponseBodyMode::None,
        ResponseBodyMode::Streamed,
        ResponseBodyMode::FullDuplexStreamed,
    ]
    .into_iter()
    .enumerate()
    {
        let mut behavior = route_to(&up.addr.to_string());
        behavior.uppercase_response_body = true;
        let picker = ToyPicker::start(behavior).await;
        let mut c = config(&picker, &[&up]);
        c.response_body_mode = mode;
        let gw = start_gateway(c).await;
        let resp = post(&gw, "/v1/completions", "q").await;
        assert_eq!(resp.status(), 200, "{mode}");
        assert_eq!(
            resp.headers()["x-picker-response"],
            "seen",
            "{mode}: response header mutation applied"
        );
        let text = resp.text().await.expect("body");
        let seen = picker.finished_stream(0).await;
        let at = seen
            .iter()
            .position(|s| matches!(s, Seen::ResponseHeaders { .. }))
            .expect("response headers sent");
        match &seen[at] {
            Seen::ResponseHeaders {
                served_metadata, ..
            } => assert_eq!(
                served_metadata.as_deref(),
                Some(up.addr.to_string().as_str()),
                "{mode}"
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(seen[at].header(":status"), Some("200"));
        assert_eq!(
            seen[at].header("x-gateway-destination-endpoint-served"),
            Some(up.addr.to_string().as_str())
        );
        let response_bodies: Vec<_> = seen[at + 1..]
            .iter()
            .filter_map(|s| match s {
                Seen::ResponseBody {
                    body,
                    end_of_stream,
                } => Some((body.clone(), *end_of_stream)),
                _ => None,
            })
            .collect();
        assert_eq!(seen.last(), Some(&Seen::End), "{mode}: clean half-close");
        match mode {
            ResponseBodyMode::None => {
                assert!(response_bodies.is_empty());
                assert_eq!(text, "hello from a");
                assert_eq!(seen.len(), at + 2, "the close follows the response headers");
            }
            _ => {
                let all: Vec<u8> = response_bodies
                    .iter()
                    .flat_map(|(b, _)| b.clone())
                    .collect();
                assert_eq!(all, b"hello from a");
                assert_eq!(
                    response_bodies.last().map(|(_, e)| *e),
                    Some(true),
                    "{mode}: end of stream last"
                );
                assert!(response_bodies[..response_bodies.len() - 1]
                    .iter()
                    .all(|(_, e)| !e));
                assert_eq!(
                    text, "HELLO FROM A",
                    "{mode}: the picker's body reaches the client"
                );
                assert!(
                    matches!(
                        seen[seen.len() - 2],
                        Seen::ResponseBody {
                            end_of_stream: true,
                            ..
                        }
                    ),
                    "{mode}: close after the body"
                );
            }
        }
        let _ = i;
    }
}

#[tokio::test]
async fn picker_down_fail_open_round_robins_and_fail_close_answers_503() {
    let a = Upstream::hello("a").await;
    let b = Upstream::hello("b").await;
    let dead = refused_addr().await;
    let mut c = GatewayConfig::new(dead.to_string(), vec![a.addr, b.addr]);
    c.fail_open = true;
    let gw = start_gateway(c.clone()).await;
    let mut served = Vec::new();
    for _ in 0..2 {
        let resp = post(&gw, "/", "x").await;
        assert_eq!(resp.status(), 200);
        served.push(resp.text().await.expect("body"));
    }
    served.sort();
    assert_eq!(served, vec!["hello from a", "hello from b"]);
    assert_eq!(
        a.received()[0].body,
        Bytes::from_static(b"x"),
        "the original body goes"
    );
    assert_eq!(gw.stats().fail_open, 2);
    assert_eq!(gw.stats().picker_errors, 2);

    c.fail_open = false;
    let gw = start_gateway(c).await;
    let resp = post(&gw, "/", "x").await;
    assert_eq!(resp.status(), 503);
    assert_eq!(gw.stats().fail_close, 1);
    assert_eq!(
        a.received().len() + b.received().len(),
        2,
        "nothing more went upstream"
    );
}

#[tokio::test]
async fn a_destination_outside_the_pool_is_503() {
    let up = Upstream::hello("a").await;
    let stranger = Upstream::hello("stranger").await;
    let picker = ToyPicker::start(route_to(&stranger.addr.to_string())).await;
    let gw = start_gateway(config(&picker, &[&up])).await;
    let resp = post(&gw, "/", "x").await;
    assert_eq!(resp.status(), 503);
    assert!(stranger.received().is_empty());
    assert!(up.received().is_empty());
    assert_eq!(gw.stats().invalid_destinations, 1);
    assert_eq!(picker.finished_stream(0).await.last(), Some(&Seen::End));
}

#[tokio::test]
async fn response_chunks_reach_the_client_before_the_upstream_finishes_in_every_mode() {
    for mode in [
        ResponseBodyMode::None,
        ResponseBodyMode::Streamed,
        ResponseBodyMode::FullDuplexStreamed,
    ] {
        let (chunks, rx) = mpsc::channel::<Bytes>(4);
        let up = Upstream::start(Answer::Stream(std::sync::Mutex::new(Some(rx)))).await;
        let picker = ToyPicker::start(route_to(&up.addr.to_string())).await;
        let mut c = config(&picker, &[&up]);
        c.response_body_mode = mode;
        let gw = start_gateway(c).await;
        let mut resp = post(&gw, "/v1/completions", "stream please").await;
        assert_eq!(resp.status(), 200);
        for event in ["data: 1\n\n", "data: 2\n\n"] {
            chunks
                .send(Bytes::from_static(event.as_bytes()))
                .await
                .expect("upstream takes it");
            // The upstream is still open: the chunk can only arrive if nothing buffers it.
            let got = tokio::time::timeout(WAIT, resp.chunk())
                .await
                .expect("chunk arrives while the upstream is open")
                .expect("chunk");
            assert_eq!(got.as_deref(), Some(event.as_bytes()), "{mode}");
        }
        assert!(
            picker.stream(0).last() != Some(&Seen::End),
            "{mode}: stream open while the response is"
        );
        drop(chunks);
        let rest = tokio::time::timeout(WAIT, resp.chunk())
            .await
            .expect("end")
            .expect("end");
        assert_eq!(rest, None, "{mode}");
        assert_eq!(
            picker.finished_stream(0).await.last(),
            Some(&Seen::End),
            "{mode}"
        );
    }
}

#[tokio::test]
async fn stats_endpoint_reports_counters_and_picker_latency() {
    let up = Upstream::hello("a").await;
    let picker = ToyPicker::start(route_to(&up.addr.to_string())).await;
    let gw = start_gateway(config(&picker, &[&up])).await;
    for _ in 0..3 {
        assert_eq!(post(&gw, "/", "abc").await.status(), 200);
    }
    // A bodiless GET: the headers message carries end of stream and the picker answers it.
    let resp = client()
        .get(format!("http://{}/v1/models", gw.local_addr()))
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status(), 200);
    let seen = picker.finished_stream(3).await;
    assert!(matches!(
        seen[0],
        Seen::RequestHeaders {
            end_of_stream: true,
            ..
        }
    ));
    assert!(bodies(&seen).is_empty());

    let json: serde_json::Value = client()
        .get(format!("http://{}/gateway/stats", gw.local_addr()))
        .send()
        .await
        .expect("stats")
        .json()
        .await
        .expect("json");
    assert_eq!(json["requests"], 4);
    assert_eq!(json["picks"][up.addr.to_string()], 4);
    assert_eq!(json["served"][up.addr.to_string()], 4);
    assert_eq!(json["picker_latency"]["count"], 4);
    assert_eq!(json["fallbacks"], 0);
    assert_eq!(gw.stats_handle().picker_latencies().len(), 4);
}
