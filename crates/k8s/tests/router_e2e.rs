//! The router end to end on a real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`; see `common`):
//! a `kinference-proxy` in process whose pool is an `InferencePool`, followed by
//! `kinference_k8s::router`, in front of simulated vLLM replicas listening on the pods' loopback
//! IPs (127.0.N.x, one N per test) at the pool's target port. Pods are created and driven to
//! Ready through the status subresource (there is no kubelet); nothing sleeps to wait: the
//! tests await the router's state with a deadline. Measured discovery latencies are printed
//! (`--nocapture`), not asserted.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use common::router::*;
use common::*;
use kinference_k8s::KinferencePool;
use kinference_proxy::api::ExplainResponse;
use kinference_proxy::{Proxy, ReplicaSpec};
use kinference_testkit::{metric, sim, WAIT};
use kube::{Api, Client};

/// Two routers on one discovered pool: a prefix served through one is found in the index of
/// the other (both subscribe to every pod's events), and the second request lands on the
/// replica that caches it, with cached tokens; the `KinferencePool`'s status is written by
/// both without conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_route_precisely_through_a_discovered_pool() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "route").await;
    let pods = [("a", "127.0.1.1"), ("b", "127.0.1.2"), ("c", "127.0.1.3")];
    let RoutedPool {
        reps: _replicas,
        urls: want,
        ..
    } = routed_pool(&client, &ns, routing_spec("llama"), &pods, None).await;
    let (one, t1) = router(&client, &ns, "llama", None).await;
    let (two, t2) = router(&client, &ns, "llama", None).await;
    wait_fleet(&one, &want).await;
    wait_fleet(&two, &want).await;
    for doc in 0..3 {
        through_one_then_the_other(&one, &two, doc).await;
    }
    status_settles(&client, &ns).await;
    let readyz = one.readiness();
    assert!(readyz.ready, "{readyz:#?}");
    let d = one.status().pools[0].discovery.clone().unwrap();
    assert!(d.synced && d.error.is_none(), "{d:#?}");
    t1.abort();
    t2.abort();
    one.shutdown().await;
    two.shutdown().await;
}

/// A pool with `appProtocol: kubernetes.io/h2c` is spoken to with HTTP/2 prior knowledge:
/// its pods are scraped, their event sources discovered and their requests served over HTTP/2
/// (the simulated pods count them), and routing stays precise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2c_pool_is_spoken_to_with_http2() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "h2c").await;
    let ips = ["127.0.9.1", "127.0.9.2"];
    let pods = [("a", ips[0]), ("b", ips[1])];
    let RoutedPool {
        reps, urls: want, ..
    } = routed_pool(
        &client,
        &ns,
        routing_spec("llama"),
        &pods,
        Some("kubernetes.io/h2c"),
    )
    .await;
    let (proxy, task) = router(&client, &ns, "llama", None).await;
    // Up (scraped) with events connected (found through /kv_event_sources): both over HTTP/2.
    wait_fleet(&proxy, &want).await;
    for ip in ips {
        assert!(reps.server(ip).http2_requests() > 0, "{ip}");
    }
    let before: Vec<u64> = ips
        .iter()
        .map(|ip| reps.server(ip).http2_requests())
        .collect();
    through_one_then_the_other(&proxy, &proxy, 0).await;
    let after: u64 = ips.iter().map(|ip| reps.server(ip).http2_requests()).sum();
    assert!(
        after >= before.iter().sum::<u64>() + 2,
        "{before:?} then {after}"
    );
    task.abort();
    proxy.shutdown().await;
}

/// A prefix served through `one` lands on the same replica, with cached tokens, through `two`.
async fn through_one_then_the_other(one: &Proxy, two: &Proxy, doc: usize) {
    let http = reqwest::Client::new();
    // Entries the second router holds per replica before: a replica that served an earlier
    // document already has entries, which must not pass for this document's.
    let before: Vec<(String, usize)> = two.status().pools[0]
        .replicas
        .iter()
        .map(|r| (r.url.clone(), r.workers[0].index_entries))
        .collect();
    let first = post(
        &http,
        one.data_addr(),
        "/v1/completions",
        &completion(MODEL, &prompt(doc, "What is a block?")),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let served = first.endpoint.clone().unwrap();
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() / u64::from(BLOCK);
    let had = before
        .iter()
        .find(|(url, _)| *url == served)
        .map_or(0, |(_, n)| *n as u64);
    // The second router learns the blocks from the replica's events, as the first does.
    two.wait_until(WAIT, |s| {
        s.pools[0]
            .replicas
            .iter()
            .find(|r| r.url == served)
            .is_some_and(|r| r.workers[0].index_entries as u64 >= had + blocks)
    })
    .await
    .unwrap_or_else(|s| panic!("the second router never indexed {served}: {s:#?}"));
    let second_body = completion(MODEL, &prompt(doc, "And what is its hash?"));
    let explain = post(&http, two.admin_addr(), "/debug/explain", &second_body).await;
    let explain: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
    assert_eq!(explain.reason, "cached_prefix", "{explain:#?}");
    assert_eq!(explain.candidates[0].replica, served, "{explain:#?}");
    let second = post(&http, two.data_addr(), "/v1/completions", &second_body).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.endpoint.as_deref(), Some(served.as_str()));
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{}", second.body);
}

/// Both routers apply the same status as one field manager; it settles on the fleet.
async fn status_settles(client: &Client, ns: &str) {
    let api: Api<KinferencePool> = Api::namespaced(client.clone(), ns);
    let status = eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        let holds = |ty: &str| {
            s.conditions
                .iter()
                .any(|c| c.type_ == ty && c.status == "True")
        };
        // The spec's hashing is the router's, and the pods report the same cache config.
        (holds("Ready") && holds("HashingVerified") && s.replicas == Some(3)).then_some(s)
    })
    .await
    .expect("the KinferencePool status never showed 3 ready replicas with verified hashing");
    assert_eq!(status.scorable_replicas, Some(3), "{status:#?}");
}

/// Scale 4 → 8 → 2 under steady load: no request fails, joiners get traffic, leavers get no
/// new requests and leave the index; the latencies are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_4_8_2_under_load_fails_no_request() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "churn").await;
    let mut reps = Replicas::new("127.0.2.1").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    let mut fleet = Vec::new();
    for i in 0..4 {
        fleet.push(reps.at(&ip(i)).await);
        ready_pod(&client, &ns, &format!("p{i}"), &ip(i)).await;
    }
    let (proxy, task) = router(&client, &ns, "llama", None).await;
    wait_fleet(&proxy, &fleet).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (log, load) = steady_load(proxy.data_addr(), 4, stop.clone());
    scale_up(&client, &ns, &mut reps, &proxy, &log, &mut fleet).await;
    let gone_at = scale_down(&client, &ns, &proxy, &fleet).await;
    // Some more traffic on the two that remain.
    let n = log.lock().unwrap().replies.len();
    poll_until("traffic after the scale-down", || {
        log.lock().unwrap().replies.len() >= n + 20
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    no_failure_and_no_request_to_a_leaver(&log, &gone_at);
    wait_fleet(&proxy, &fleet[..2]).await;
    task.abort();
    proxy.shutdown().await;
}

fn ip(i: usize) -> String {
    format!("127.0.2.{}", i + 1)
}

/// 4 → 8, one pod at a time: each joiner is in the fleet, then serves a request.
async fn scale_up(
    client: &Client,
    ns: &str,
    reps: &mut Replicas,
    proxy: &Proxy,
    log: &Mutex<Log>,
    fleet: &mut Vec<String>,
) {
    let mut joins = Vec::new();
    let mut traffic = Vec::new();
    for i in 4..8 {
        let url = reps.at(&ip(i)).await;
        let pod = format!("p{i}");
        create_pod(client, ns, &pod, app("vllm")).await;
        // From before the status write: the API server's round trip counts.
        let ready_at = Instant::now();
        set_pod_status(client, ns, &pod, &ip(i), true).await;
        poll_until("joiner in the fleet", || {
            urls(&proxy.status()).contains(&url)
        })
        .await;
        joins.push(ready_at.elapsed());
        poll_until("joiner served a request", || {
            log.lock()
                .unwrap()
                .replies
                .iter()
                .any(|(_, _, e)| e.as_deref() == Some(url.as_str()))
        })
        .await;
        traffic.push(ready_at.elapsed());
        fleet.push(url);
    }
    println!("join: Ready -> in the router's fleet: {}", summary(joins));
    println!("join: Ready -> first request served: {}", summary(traffic));
}

/// 8 → 2, one pod at a time: each leaver is out of the fleet and of the index; when it was.
async fn scale_down(
    client: &Client,
    ns: &str,
    proxy: &Proxy,
    fleet: &[String],
) -> BTreeMap<String, Instant> {
    let mut leaves = Vec::new();
    let mut gone_at = BTreeMap::new();
    for (i, url) in fleet.iter().enumerate().skip(2) {
        let url = url.clone();
        let deleted_at = Instant::now();
        delete_pod(client, ns, &format!("p{i}")).await;
        poll_until("leaver out of the fleet and the index", || {
            let s = proxy.status();
            !urls(&s).contains(&url) && orphan_entries(&s) == 0
        })
        .await;
        gone_at.insert(url, Instant::now());
        leaves.push(deleted_at.elapsed());
    }
    println!(
        "leave: pod deleted -> out of the fleet and the index: {}",
        summary(leaves)
    );
    gone_at
}

/// Every request succeeded, and none started on a replica after it left.
fn no_failure_and_no_request_to_a_leaver(log: &Log, gone_at: &BTreeMap<String, Instant>) {
    let failed: Vec<_> = log.replies.iter().filter(|(_, s, _)| *s != 200).collect();
    println!(
        "churn: {} requests, {} failed, {} transport errors",
        log.replies.len(),
        failed.len(),
        log.errors.len()
    );
    assert!(
        failed.is_empty() && log.errors.is_empty(),
        "{failed:?} {:?}",
        log.errors
    );
    for (started, _, endpoint) in &log.replies {
        if let Some(at) = endpoint.as_ref().and_then(|e| gone_at.get(e)) {
            assert!(
                started < at,
                "a request started after {endpoint:?} left was sent to it"
            );
        }
    }
}

/// A pod turning NotReady gets no new requests; a pod whose IP changes is followed to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_and_ip_change_are_followed() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "notready").await;
    let mut reps = Replicas::new("127.0.3.1").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    let a = reps.at("127.0.3.1").await;
    let b = reps.at("127.0.3.2").await;
    ready_pod(&client, &ns, "a", "127.0.3.1").await;
    ready_pod(&client, &ns, "b", "127.0.3.2").await;
    let (proxy, task) = router(&client, &ns, "llama", None).await;
    wait_fleet(&proxy, &[a.clone(), b.clone()]).await;
    let http = reqwest::Client::new();

    set_pod_status(&client, &ns, "a", "127.0.3.1", false).await;
    wait_fleet(&proxy, std::slice::from_ref(&b)).await;
    for i in 0..10 {
        let body = completion(MODEL, &format!("while a is not ready {i}"));
        let r = post(&http, proxy.data_addr(), "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.endpoint.as_deref(), Some(b.as_str()));
    }

    let moved = reps.at("127.0.3.3").await;
    set_pod_status(&client, &ns, "b", "127.0.3.3", true).await;
    wait_fleet(&proxy, std::slice::from_ref(&moved)).await;
    for i in 0..10 {
        let body = completion(MODEL, &format!("after b moved {i}"));
        let r = post(&http, proxy.data_addr(), "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.endpoint.as_deref(), Some(moved.as_str()));
    }
    assert_eq!(orphan_entries(&proxy.status()), 0);
    task.abort();
    proxy.shutdown().await;
}

/// A router without the right to read the pool: it says which permission is missing
/// (`/readyz` 503, `/debug/replicas`, a metric), does not panic, and its other pool serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_denied_is_reported_and_other_pools_serve() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "denied").await;
    let reps = Replicas::new("127.0.4.1").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    ready_pod(&client, &ns, "a", "127.0.4.1").await;
    // The static pool's replica serves its own model.
    let other = sim::start(sim::config("static", 600, 32, 1000.0)).await;
    let static_url = format!("http://{}", other.addr);
    let nobody = as_user(&kc, "kinference-router-nobody").await;
    let (proxy, task) = router(&nobody, &ns, "llama", Some(ReplicaSpec::new(&static_url))).await;
    denial_reported(&proxy, &ns).await;
    denial_on_the_admin_port(&proxy).await;

    // The static pool beside it serves; the discovered one answers 503, not a panic.
    let http = reqwest::Client::new();
    let ok = post(
        &http,
        proxy.data_addr(),
        "/v1/completions",
        &completion("static", "hi"),
    )
    .await;
    assert_eq!(ok.status, 200, "{}", ok.body);
    let none = post(
        &http,
        proxy.data_addr(),
        "/v1/completions",
        &completion(MODEL, "hi"),
    )
    .await;
    assert_eq!(none.status, 503, "{}", none.body);
    assert!(!task.is_finished());
    task.abort();
    proxy.shutdown().await;
}

/// `/debug/replicas` names the missing permission.
async fn denial_reported(proxy: &Proxy, ns: &str) {
    // The pool's own error outranks the others once it is in (the watches fail in any order).
    let s = proxy
        .wait_until(WAIT, |s| {
            s.pools[0]
                .discovery
                .as_ref()
                .and_then(|d| d.error.as_ref())
                .is_some_and(|e| e.contains("list inferencepools"))
        })
        .await
        .unwrap_or_else(|s| panic!("the denial was never reported: {s:#?}"));
    let d = s.pools[0].discovery.clone().unwrap();
    let error = d.error.unwrap();
    println!("reported: {error}");
    assert!(error.contains("RBAC denied"), "{error}");
    assert!(
        error.contains(&format!(
            "list inferencepools (API group inference.networking.k8s.io) in namespace {ns}"
        )),
        "{error}"
    );
    assert_eq!(d.error_kind.as_deref(), Some("forbidden"));
    assert!(s.pools[0].replicas.is_empty());
}

/// `/readyz` is 503 and says why; the metrics carry the reason.
async fn denial_on_the_admin_port(proxy: &Proxy) {
    let http = reqwest::Client::new();
    let readyz = http
        .get(format!("http://{}/readyz", proxy.admin_addr()))
        .send()
        .await
        .unwrap();
    assert_eq!(readyz.status().as_u16(), 503);
    let body = readyz.text().await.unwrap();
    assert!(body.contains("list inferencepools"), "{body}");
    let page = http
        .get(format!("http://{}/metrics", proxy.admin_addr()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(
            &page,
            "kinference_pool_discovery_error{pool=\"tiny\",reason=\"forbidden\"}"
        ),
        1.0
    );
    assert_eq!(
        metric(&page, "kinference_pool_discovery_ok{pool=\"tiny\"}"),
        0.0
    );
}
