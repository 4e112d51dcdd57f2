//! The endpoint picker end to end behind the Envoy-like test gateway (`kinference-testgw`):
//! simulated vLLM replicas on port 0 with real HTTP and ZMQ KV events, `Proxy::start_front` with
//! the ext_proc server, the gateway forwarding what the picker chose. Proves the picker places a
//! workload as `kinference serve` does (same cache hits), that the gateway's fallback is
//! accounted to the replica that served, and that subset hints hold. Nothing sleeps to wait.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;

use kinference_proxy::{Config, PoolConfig, Proxy, ReplicaSpec};
use kinference_testgw::{Gateway, GatewayConfig, RequestBodyMode, ResponseBodyMode};
use kinference_testkit::{metric, sim, tokenizer_dir, WAIT};
use serde_json::{json, Value};

mod common;

use common::{admin_metrics, sims, wait_no_in_flight, MODEL};

fn prompt(doc: usize, question: usize) -> String {
    let mut s = format!("Document {doc}. ");
    for i in 0..120 {
        s.push_str(&format!(
            "Section {i} of document {doc} explains block hashing. "
        ));
    }
    s.push_str(&format!("Question {question}: what does it say?"));
    s
}

fn config(replicas: Vec<ReplicaSpec>, scrape_ms: u64) -> Config {
    let mut p = PoolConfig::new(MODEL, tokenizer_dir(), 32);
    p.policy = kinference_proxy::parse_policy("precise").unwrap();
    p.replicas = replicas;
    let mut cfg = Config::new(vec![p]);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    cfg.scrape.interval_ms = scrape_ms;
    cfg.timeouts.drain_ms = 100;
    cfg
}

async fn wait_up(proxy: &Proxy, n: usize) {
    let s = proxy
        .wait_until(WAIT, |s| s.readiness().pools[0].healthy_replicas == n)
        .await
        .unwrap_or_else(|s| panic!("replicas never came up: {s:#?}"));
    // Events published before the subscription is up are lost until the next gap check.
    for r in &s.pools[0].replicas {
        if r.workers[0].events.is_some() {
            proxy
                .wait_for_events(&r.url, 0, WAIT, |h| h.connected)
                .await
                .unwrap();
        }
    }
}

async fn epp(cfg: Config) -> Proxy {
    let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Proxy::start_front(
        cfg,
        front,
        admin,
        kinference_epp::front(kinference_epp::Settings::default()),
    )
    .await
    .unwrap()
}

async fn gateway(
    picker: &Proxy,
    endpoints: Vec<SocketAddr>,
    f: impl FnOnce(&mut GatewayConfig),
) -> Gateway {
    let mut c = GatewayConfig::new(picker.data_addr().to_string(), endpoints);
    f(&mut c);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    Gateway::start(c, l).await.unwrap()
}

/// Prompt and cached tokens over a sequential multi-turn workload sent to `addr`: four
/// documents, three questions each, interleaved so that each document's later questions
/// come after other documents' requests.
async fn workload(addr: SocketAddr) -> (u64, u64, Vec<String>) {
    let client = reqwest::Client::new();
    let (mut prompt_tokens, mut cached) = (0, 0);
    let mut served = Vec::new();
    for question in 0..3 {
        for doc in 0..4 {
            let r = client
                .post(format!("http://{addr}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": prompt(doc, question), "max_tokens": 4}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let ep = r
                .headers()
                .get("x-gateway-destination-endpoint-served")
                .map(|v| v.to_str().unwrap().to_owned());
            served.extend(ep);
            let v: Value = r.json().await.unwrap();
            prompt_tokens += v["usage"]["prompt_tokens"].as_u64().unwrap();
            cached += v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0);
        }
    }
    (prompt_tokens, cached, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_gateway_the_picker_gets_the_cache_hits_serve_gets() {
    // The same workload on two fresh fleets: one behind `kinference serve`, one behind the
    // gateway and the picker (both modes of request body).
    let serve_sims = sims(3).await;
    let serve = Proxy::start(config(
        serve_sims.iter().map(sim::replica_with_events).collect(),
        50,
    ))
    .await
    .unwrap();
    wait_up(&serve, 3).await;
    let (serve_prompt, serve_cached, _) = workload(serve.data_addr()).await;
    let serve_rate = serve_cached as f64 / serve_prompt as f64;
    // Each document's second and third questions find its prefix: about 2/3 of the tokens.
    assert!(serve_rate > 0.55, "serve hit rate {serve_rate}");

    for (mode, without_waiting) in [
        (RequestBodyMode::FullDuplexStreamed, false),
        (RequestBodyMode::Buffered, false),
        // Envoy's send_body_without_waiting_for_header_response: the body arrives before
        // the headers were answered.
        (RequestBodyMode::Buffered, true),
    ] {
        let sims = sims(3).await;
        let picker = epp(config(
            sims.iter().map(sim::replica_with_events).collect(),
            50,
        ))
        .await;
        wait_up(&picker, 3).await;
        let gw = gateway(&picker, sims.iter().map(|s| s.addr).collect(), |c| {
            c.request_body_mode = mode;
            c.send_body_without_waiting = without_waiting;
            c.chunk_size = 1024;
        })
        .await;
        let (prompt, cached, served) = workload(gw.local_addr()).await;
        assert_eq!(prompt, serve_prompt);
        let rate = cached as f64 / prompt as f64;
        assert!(
            (rate - serve_rate).abs() < 0.02,
            "{mode:?}: picker {rate} vs serve {serve_rate}"
        );
        assert_eq!(served.len(), 12, "the gateway names the serving endpoint");
        let stats = gw.stats();
        assert_eq!(stats.requests, 12);
        assert_eq!(stats.fallbacks, 0);
        assert_eq!(stats.picker_latency.count, 12);
        wait_no_in_flight(&picker).await;
        let page = admin_metrics(&picker).await;
        assert_eq!(
            metric(
                &page,
                "kinference_picker_served_total{pool=\"tiny\",kind=\"first\"}"
            ),
            12.0,
            "{page}"
        );
        let ok: f64 = sims
            .iter()
            .map(|s| {
                metric(
                    &page,
                    &format!(
                        "kinference_requests_total{{route=\"completions\",replica=\"http://{}\",status=\"200\"}}",
                        s.addr
                    ),
                )
            })
            .sum();
        assert_eq!(ok, 12.0, "{page}");
        // The replicas' usage passed through the picker on the response path.
        assert!(
            metric(
                &page,
                "kinference_cached_tokens_total{pool=\"tiny\",kind=\"actual\"}"
            ) as u64
                == cached,
            "{page}"
        );
    }
    serve.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_falls_back_past_a_dead_first_choice_and_the_picker_accounts_the_fallback() {
    let live = sims(1).await;
    // A replica that is gone: its port was bound once and closed. Scraping is off, so the
    // picker does not know; only the gateway finds out, and reports where requests went.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut replicas = vec![sim::replica_with_events(&live[0])];
    replicas.push(ReplicaSpec::new(&format!("http://{dead}")));
    let picker = epp(config(replicas, 0)).await;
    let gw = gateway(&picker, vec![live[0].addr, dead], |_| {}).await;
    let client = reqwest::Client::new();
    for q in 0..6 {
        let r = client
            .post(format!("http://{}/v1/completions", gw.local_addr()))
            .json(&json!({"model": MODEL, "prompt": format!("short {q}"), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let stats = gw.stats();
    assert!(
        stats.fallbacks >= 1,
        "the dead replica was never first: {stats:?}"
    );
    assert_eq!(stats.served.get(&live[0].addr.to_string()), Some(&6));
    let page = admin_metrics(&picker).await;
    let fell_back = metric(
        &page,
        "kinference_picker_served_total{pool=\"tiny\",kind=\"fallback\"}",
    );
    assert_eq!(fell_back, stats.fallbacks as f64, "{page}");
    assert_eq!(picker.in_flight(), 0);
    picker.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subset_hints_hold_through_the_gateway() {
    let sims = sims(3).await;
    let picker = epp(config(
        sims.iter().map(sim::replica_with_events).collect(),
        50,
    ))
    .await;
    wait_up(&picker, 3).await;
    let only = vec![sims[0].addr.to_string(), sims[2].addr.to_string()];
    let gw = gateway(&picker, sims.iter().map(|s| s.addr).collect(), |c| {
        c.subset_hint = Some(only.clone());
        c.response_body_mode = ResponseBodyMode::None;
    })
    .await;
    let (_, _, served) = workload(gw.local_addr()).await;
    assert_eq!(served.len(), 12);
    for ep in &served {
        assert!(only.contains(ep), "{ep} is outside the subset {only:?}");
    }
    picker.shutdown().await;
}
