//! A discovered pool's membership changed while the router runs ([`PoolMembers`]), with
//! simulated replicas and no API server: a joiner is routed to and indexed at once; a leaver
//! gets no new request, its index entries are gone when `leave` returns, and the request it
//! was serving finishes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use futures_util::StreamExt;
use kinference_proxy::{Config, InferencePoolRef, PoolConfig, PoolMembers, Proxy};
use kinference_sim_server::Server;
use kinference_testkit::sim::{self, replica_with_events};
use kinference_testkit::{tokenizer_dir, WAIT};
use serde_json::{json, Value};

const MODEL: &str = "tiny";

fn prompt(doc: usize) -> String {
    let mut s = format!("Document {doc}. ");
    for i in 0..40 {
        s.push_str(&format!(
            "Section {i} of document {doc} explains block hashing. "
        ));
    }
    s
}

async fn discovered_router() -> (Proxy, PoolMembers) {
    let mut pool = PoolConfig::new(MODEL, tokenizer_dir(), 32);
    pool.policy = kinference_proxy::parse_policy("{kind: precise, speculative_ttl_ms: 0}").unwrap();
    pool.inference_pool = Some(InferencePoolRef {
        namespace: Some("models".into()),
        name: "llama".into(),
    });
    let mut cfg = Config::new(vec![pool]);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    cfg.expose_endpoint_header = true;
    cfg.scrape.interval_ms = 50;
    let proxy = Proxy::start(cfg).await.unwrap();
    let members = proxy.discovered_pools().remove(0);
    (proxy, members)
}

async fn post(proxy: &Proxy, body: &Value) -> (u16, Option<String>) {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(body)
        .send()
        .await
        .unwrap();
    let endpoint = resp
        .headers()
        .get("x-kinference-endpoint")
        .map(|v| format!("http://{}", v.to_str().unwrap()));
    let status = resp.status().as_u16();
    resp.bytes().await.unwrap();
    (status, endpoint)
}

/// Replicas with KV events: `a` generates in real time, `b` fast.
async fn replicas() -> (Server, Server) {
    let mut slow = sim::config(MODEL, 600, 32, 1.0);
    slow.kv_events = Some(sim::events_on_port_zero());
    let mut fast = sim::config(MODEL, 600, 32, 1000.0);
    fast.kv_events = Some(sim::events_on_port_zero());
    (sim::start(slow).await, sim::start(fast).await)
}

/// Reads a stream to its end (at most 60 s).
async fn read_to_end(
    mut stream: impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
    mut text: String,
) -> String {
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(chunk) = stream.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
    })
    .await;
    assert!(rest.is_ok(), "the request on the leaver never finished");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaver_finishes_its_requests_and_leaves_the_index_at_once() {
    let (a, b) = replicas().await;
    let (url_a, url_b) = (format!("http://{}", a.addr), format!("http://{}", b.addr));
    let (proxy, members) = discovered_router().await;
    assert!(proxy.status().pools[0].replicas.is_empty());
    assert!(!proxy.readiness().ready, "no replica yet");
    assert_eq!(
        post(
            &proxy,
            &json!({"model": MODEL, "prompt": "hi", "max_tokens": 1})
        )
        .await
        .0,
        503
    );

    members.join("a", &[replica_with_events(&a)]).await.unwrap();
    members.set_source_state(None);
    // The first batch after connecting can be lost (see `prime_events`): the stream is
    // primed, then a request through the router goes to the joiner and its blocks are indexed.
    sim::prime_events(&proxy, &url_a, MODEL).await;
    let before = proxy
        .wait_for_events(&url_a, 0, WAIT, |_| true)
        .await
        .unwrap()
        .entries;
    let (status, served) = post(
        &proxy,
        &json!({"model": MODEL, "prompt": prompt(0), "max_tokens": 1}),
    )
    .await;
    assert_eq!((status, served.as_deref()), (200, Some(url_a.as_str())));
    proxy
        .wait_for_events(&url_a, 0, WAIT, |h| h.entries > before)
        .await
        .unwrap();

    // A streamed request in flight on `a` while `a` leaves and `b` joins.
    let body = json!({"model": MODEL, "prompt": prompt(1), "max_tokens": 40, "stream": true});
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut stream = resp.bytes_stream();
    let text = String::from_utf8(stream.next().await.unwrap().unwrap().to_vec()).unwrap();
    members.join("b", &[replica_with_events(&b)]).await.unwrap();
    assert_eq!(proxy.in_flight(), 1, "the request on a is running");
    assert!(members.leave("a").await);
    let s = proxy.status();
    assert_eq!(s.pools[0].replicas.len(), 1);
    assert_eq!(s.pools[0].replicas[0].url, url_b);
    assert_eq!(s.pools[0].index_entries, 0, "a's entries stayed: {s:#?}");
    assert_eq!(members.keys(), ["b"]);

    for i in 0..10 {
        let (status, served) = post(
            &proxy,
            &json!({"model": MODEL, "prompt": format!("{} {i}", prompt(0)), "max_tokens": 1}),
        )
        .await;
        assert_eq!((status, served.as_deref()), (200, Some(url_b.as_str())));
    }
    let text = read_to_end(stream, text).await;
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    proxy.shutdown().await;
}

/// Per-replica series of `/metrics` (requests, durations, upstream failures) of a member that
/// left are gone when `leave` returns: churn through distinct replicas leaves the rest of the
/// page (all but the current member's series) the size it had with one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leavers_metric_series_are_removed() {
    let (proxy, members) = discovered_router().await;
    let metrics = || async {
        reqwest::get(format!("http://{}/metrics", proxy.admin_addr()))
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    // Series whose labels are known ahead are there from the start, at zero: one that first
    // appeared while members churned would look like a leak here.
    let page = metrics().await;
    for kind in ["ok", "failed", "idle"] {
        let series =
            format!("kinference_replica_scrapes_total{{pool=\"{MODEL}\",kind=\"{kind}\"}} 0");
        assert!(page.lines().any(|l| l == series), "no {series}:\n{page}");
    }
    let mut sizes = Vec::new();
    let mut left: Vec<String> = Vec::new();
    for i in 0..4 {
        let mut cfg = sim::config(MODEL, 600, 32, 1000.0);
        cfg.kv_events = Some(sim::events_on_port_zero());
        let server = sim::start(cfg).await;
        let url = format!("http://{}", server.addr);
        let key = format!("m{i}");
        members
            .join(&key, &[replica_with_events(&server)])
            .await
            .unwrap();
        let body = json!({"model": MODEL, "prompt": format!("{} {i}", prompt(0)), "max_tokens": 1});
        assert_eq!(post(&proxy, &body).await, (200, Some(url.clone())));
        let page = metrics().await;
        let ours = page.lines().filter(|l| l.contains(&url)).count();
        assert!(ours > 0, "no series of {url}:\n{page}");
        assert!(
            left.iter().all(|u| !page.contains(u.as_str())),
            "a leaver's series stayed:\n{page}"
        );
        // The member's own series depend on how far its event stream has got (a lag series,
        // and its family's HELP and TYPE lines, appear once it is synced), so the other
        // samples are what must not grow.
        sizes.push(
            page.lines()
                .filter(|l| !l.starts_with('#') && !l.contains(url.as_str()))
                .map(|l| l.split(' ').next().unwrap_or(l).to_owned())
                .collect::<std::collections::BTreeSet<String>>(),
        );
        assert!(members.leave(&key).await);
        let page = metrics().await;
        assert!(
            !page.contains(&url),
            "{url}'s series stayed after it left:\n{page}"
        );
        left.push(url);
    }
    for w in sizes.windows(2) {
        assert!(
            w[0].len() == w[1].len(),
            "/metrics grew from {} to {} samples: new {:?}, gone {:?}",
            w[0].len(),
            w[1].len(),
            w[1].difference(&w[0]).collect::<Vec<_>>(),
            w[0].difference(&w[1]).collect::<Vec<_>>()
        );
    }
    proxy.shutdown().await;
}

/// New rules while the pool routes: applied whole when they resolve (the fields that changed
/// are returned), refused with the pool untouched when they do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconfigure_replaces_the_rules_or_refuses_them_whole() {
    let (_, b) = replicas().await;
    let (proxy, members) = discovered_router().await;
    members.join("b", &[replica_with_events(&b)]).await.unwrap();
    let body = json!({"model": MODEL, "prompt": prompt(1), "max_tokens": 1});
    assert_eq!(post(&proxy, &body).await.0, 200);

    let same = members.settings();
    assert_eq!(
        members.reconfigure(&same).await.unwrap(),
        Vec::<&str>::new()
    );

    let mut next = same.clone();
    next.policy = kinference_proxy::parse_policy("least-load").unwrap();
    next.hash_algo = "xxhash".into();
    next.hash_seed = Some("0".into());
    // Not rules: the pool's identity stays as it is.
    next.models = vec!["other".into()];
    let changed = members.reconfigure(&next).await.unwrap();
    assert_eq!(changed, ["hash_algo", "hash_seed", "policy"]);
    let s = proxy.status();
    let p = &s.pools[0];
    assert_eq!(
        (p.policy.as_str(), p.hash_algo.as_str()),
        ("least-load", "xxhash")
    );
    assert_eq!(p.models, [MODEL]);
    assert_eq!(members.settings().models, [MODEL]);
    assert_eq!(post(&proxy, &body).await.0, 200);

    let mut bad = members.settings();
    bad.block_size = 0;
    bad.tokenizer = "/nonexistent/tokenizer".into();
    bad.policy = kinference_proxy::parse_policy("round-robin").unwrap();
    let err = members.reconfigure(&bad).await.unwrap_err().to_string();
    assert!(
        err.contains("block_size") && err.contains("tokenizer.json"),
        "{err}"
    );
    let s = proxy.status();
    assert_eq!(
        (s.pools[0].policy.as_str(), s.pools[0].block_size),
        ("least-load", 32)
    );
    assert_eq!(post(&proxy, &body).await.0, 200);
    proxy.shutdown().await;
}
