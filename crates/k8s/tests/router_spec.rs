//! The `KinferencePool`'s spec on a real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`; see
//! `common`): its policy and hashing win over the router's own settings at start, a spec
//! changed later is applied to the running router (policy, weights, hashing), and one that
//! cannot be applied is reported (`Accepted` False) while the router keeps its last settings.
//! Replicas are simulated vLLM servers on the pods' loopback IPs (127.0.6.x).

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::router::*;
use common::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kinference_k8s::crd::{KinferencePoolStatus, PolicyKind};
use kinference_k8s::KinferencePool;
use kinference_testkit::{metric, WAIT};
use kube::api::{Patch, PatchParams};
use kube::Api;
use serde_json::json;

/// The router is started with block size 16 and the precise policy; the KinferencePool says
/// 32 (what the replicas run) and least-load. The router routes with the KinferencePool's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kinference_pools_hashing_and_policy_win_over_the_routers() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "spec").await;
    let mut spec = routing_spec("llama");
    spec.policy.kind = PolicyKind::LeastLoad;
    let RoutedPool {
        reps: _replicas,
        api,
        urls: want,
    } = routed_pool(&client, &ns, spec, &[("a", "127.0.6.1")], None).await;
    let (proxy, task) = start_router(&client, &ns, vec![discovered(&ns, "llama", 16)]).await;
    wait_fleet(&proxy, &want).await;
    let s = proxy
        .wait_until(WAIT, |s| {
            let r = &s.pools[0].replicas[0];
            r.cache_config.is_some() && r.scorable
        })
        .await
        .unwrap_or_else(|s| panic!("the replica never became scorable: {s:#?}"));
    assert_eq!(s.pools[0].block_size, BLOCK, "{s:#?}");
    assert_eq!(s.pools[0].policy, "least-load", "{s:#?}");
    let status = condition_is(&api, "HashingVerified", "True").await;
    assert_eq!(status.scorable_replicas, Some(1), "{status:#?}");

    let g1 = generation(&api).await;
    assert_eq!(status.observed_generation, Some(g1), "{status:#?}");

    // Live: the precise policy, which reads the index.
    let patch = json!({"spec": {"policy": {"kind": "precise"}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let g2 = generation(&api).await;
    applied(&api, g2).await;
    assert_eq!(proxy.status().pools[0].policy, "precise");
    let http = reqwest::Client::new();
    let body = completion(MODEL, &prompt(3, "Why?"));
    let first = post(&http, proxy.data_addr(), "/v1/completions", &body).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() / u64::from(BLOCK);
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas[0].workers[0].index_entries as u64 >= blocks
        })
        .await
        .unwrap_or_else(|s| panic!("the prefix was never indexed: {s:#?}"));
    let explain = post(&http, proxy.admin_addr(), "/debug/explain", &body).await;
    let cached = explain.json()["candidates"][0]["gpu_blocks"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, blocks, "{}", explain.body);

    // A later change is applied live: the router hashes with the new algorithm and seed, the
    // prefix indexed under sha256 no longer matches, and the pod (still on sha256) is reported.
    let patch = json!({"spec": {"hashing": {"algorithm": "xxhash", "seed": "0"}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let g3 = generation(&api).await;
    applied(&api, g3).await;
    // The pod is judged at its next scrape, and the status written at its next interval.
    let status = condition_is(&api, "HashingVerified", "False").await;
    let c = condition(&status, "HashingVerified");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", "HashMismatch"),
        "{c:#?}"
    );
    assert!(
        c.message
            .contains("hashes with sha256, the pool with xxhash"),
        "{c:#?}"
    );
    let s = proxy.status();
    assert_eq!(s.pools[0].hash_algo, "xxhash", "{s:#?}");
    assert!(!s.pools[0].replicas[0].scorable, "{s:#?}");
    let explain = post(&http, proxy.admin_addr(), "/debug/explain", &body).await;
    let e = explain.json();
    assert_eq!(e["candidates"][0]["gpu_blocks"], 0, "{}", explain.body);
    assert_eq!(e["candidates"][0]["scorable"], false, "{}", explain.body);

    // Back to what the pod runs: scorable again, and the indexed prefix matches again.
    let patch = json!({"spec": {"hashing": {"algorithm": "sha256", "seed": null}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let g4 = generation(&api).await;
    applied(&api, g4).await;
    condition_is(&api, "HashingVerified", "True").await;
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0].hash_algo == "sha256" && s.pools[0].replicas[0].scorable
        })
        .await
        .unwrap_or_else(|s| panic!("the pod never became scorable again: {s:#?}"));
    let explain = post(&http, proxy.admin_addr(), "/debug/explain", &body).await;
    let cached = explain.json()["candidates"][0]["gpu_blocks"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, blocks, "{}", explain.body);
    task.abort();
    proxy.shutdown().await;
}

/// Policy and weights follow the spec while the router runs; a spec the router cannot apply
/// (a weight the policy refuses, a tokenizer that is not there) is `Accepted` False, keeps
/// `observedGeneration` at the last generation applied, and leaves the router on its settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_changes_apply_live_and_a_bad_spec_keeps_the_last_good_one() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "live").await;
    let RoutedPool {
        reps: _replicas,
        api,
        urls: want,
    } = routed_pool(
        &client,
        &ns,
        routing_spec("llama"),
        &[("a", "127.0.6.21")],
        None,
    )
    .await;
    let (proxy, task) = start_router(&client, &ns, vec![discovered(&ns, "llama", BLOCK)]).await;
    wait_fleet(&proxy, &want).await;
    let g = generation(&api).await;
    applied(&api, g).await;
    let http = reqwest::Client::new();
    let send = |doc| completion(MODEL, &prompt(doc, "Why?"));
    let r = post(&http, proxy.data_addr(), "/v1/completions", &send(1)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    // speculativeTtlMs 0: the precise policy records nothing of its own.
    assert_eq!(proxy.status().pools[0].tracked_entries, 0);

    // A weight: speculative entries kept for 10 minutes.
    let patch = json!({"spec": {"policy": {"weights": {"speculativeTtlMs": 600000}}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let g = generation(&api).await;
    applied(&api, g).await;
    let r = post(&http, proxy.data_addr(), "/v1/completions", &send(2)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let s = proxy.status();
    assert!(s.pools[0].tracked_entries > 0, "{s:#?}");

    // The policy itself.
    let patch = json!({"spec": {"policy": {"kind": "least-load"}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let good = generation(&api).await;
    applied(&api, good).await;
    assert_eq!(proxy.status().pools[0].policy, "least-load");
    let explain = post(&http, proxy.admin_addr(), "/debug/explain", &send(3)).await;
    assert_eq!(explain.json()["policy"], "least-load", "{}", explain.body);

    // Refused by the policy crate (the CRD schema lets it through): kept on least-load.
    let patch = json!({"spec": {"policy": {"kind": "precise", "weights": {"fairShareCap": 0.5}}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let bad = generation(&api).await;
    let status = refused(&api, bad).await;
    let c = condition(&status, "Accepted");
    assert_eq!(c.reason, "InvalidSpec", "{c:#?}");
    assert!(c.message.contains("fair_share_cap"), "{c:#?}");
    assert!(
        c.message
            .contains(&format!("routing with generation {good}")),
        "{c:#?}"
    );
    assert_eq!(status.observed_generation, Some(good), "{status:#?}");
    let s = proxy
        .wait_until(WAIT, |s| {
            s.pools[0]
                .discovery
                .as_ref()
                .is_some_and(|d| d.settings_error.is_some())
        })
        .await
        .unwrap_or_else(|s| panic!("the refusal never showed in /debug/replicas: {s:#?}"));
    assert_eq!(s.pools[0].policy, "least-load", "{s:#?}");
    let page = http
        .get(format!("http://{}/metrics", proxy.admin_addr()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&page, "kinference_pool_settings_error{pool=\"tiny\"}"),
        1.0
    );
    let r = post(&http, proxy.data_addr(), "/v1/completions", &send(4)).await;
    assert_eq!(r.status, 200, "{}", r.body);

    // A tokenizer directory that is not there: refused too, still least-load.
    let patch = json!({"spec": {"policy": {"kind": "least-load", "weights": null},
                                "tokenizer": {"path": "/nonexistent/tokenizer"}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let bad = generation(&api).await;
    let status = refused(&api, bad).await;
    let c = condition(&status, "Accepted");
    assert!(c.message.contains("/nonexistent/tokenizer"), "{c:#?}");
    assert_eq!(status.observed_generation, Some(good), "{status:#?}");
    assert_eq!(proxy.status().pools[0].policy, "least-load");

    // Fixed: applied, and the refusal is gone.
    let patch = json!({"spec": {"policy": {"kind": "round-robin"},
                                "tokenizer": {"path": kinference_testkit::tokenizer_dir()}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let g = generation(&api).await;
    applied(&api, g).await;
    let s = proxy.status();
    assert_eq!(s.pools[0].policy, "round-robin", "{s:#?}");
    assert_eq!(
        s.pools[0]
            .discovery
            .as_ref()
            .and_then(|d| d.settings_error.clone()),
        None
    );
    let r = post(&http, proxy.data_addr(), "/v1/completions", &send(5)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    task.abort();
    proxy.shutdown().await;
}

/// The KinferencePool's `metadata.generation`.
async fn generation(api: &Api<KinferencePool>) -> i64 {
    let o = api.get("llama-routing").await.unwrap();
    o.metadata.generation.unwrap()
}

fn condition<'s>(status: &'s KinferencePoolStatus, ty: &str) -> &'s Condition {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .unwrap_or_else(|| panic!("no {ty} condition: {status:#?}"))
}

/// Waits until generation `g` is applied: `observedGeneration` is `g` and `Accepted` True.
async fn applied(api: &Api<KinferencePool>, g: i64) -> KinferencePoolStatus {
    let s = eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        let accepted = s.conditions.iter().any(|c| {
            c.type_ == "Accepted" && c.status == "True" && c.observed_generation == Some(g)
        });
        (accepted && s.observed_generation == Some(g)).then_some(s)
    })
    .await;
    accepted_or_panic(api, g, s, "applied").await
}

/// Waits until generation `g` is refused: `Accepted` False for it.
async fn refused(api: &Api<KinferencePool>, g: i64) -> KinferencePoolStatus {
    let s = eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        s.conditions
            .iter()
            .any(|c| {
                c.type_ == "Accepted" && c.status == "False" && c.observed_generation == Some(g)
            })
            .then_some(s)
    })
    .await;
    accepted_or_panic(api, g, s, "refused").await
}

async fn accepted_or_panic(
    api: &Api<KinferencePool>,
    g: i64,
    got: Option<KinferencePoolStatus>,
    what: &str,
) -> KinferencePoolStatus {
    match got {
        Some(s) => s,
        None => {
            let now = api.get("llama-routing").await.unwrap().status;
            panic!("generation {g} was never {what}: {now:#?}")
        }
    }
}

/// Waits until the KinferencePool's condition `ty` has `status`.
async fn condition_is(api: &Api<KinferencePool>, ty: &str, status: &str) -> KinferencePoolStatus {
    eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        s.conditions
            .iter()
            .any(|c| c.type_ == ty && c.status == status)
            .then_some(s)
    })
    .await
    .unwrap_or_else(|| panic!("the KinferencePool's {ty} never became {status}"))
}

/// `status.hitRate.predicted` is the router's: prompt tokens the policy expected cached over
/// prompt tokens routed, in the status window. A prefix sent twice is predicted cached the
/// second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_predicted_hit_rate_is_reported() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "predicted").await;
    let RoutedPool {
        reps: _replicas,
        api,
        urls: want,
    } = routed_pool(
        &client,
        &ns,
        routing_spec("llama"),
        &[("a", "127.0.6.11")],
        None,
    )
    .await;
    let (proxy, task) = start_router(&client, &ns, vec![discovered(&ns, "llama", BLOCK)]).await;
    wait_fleet(&proxy, &want).await;
    let http = reqwest::Client::new();
    let send = |q: &'static str| completion(MODEL, &prompt(7, q));
    let first = post(&http, proxy.data_addr(), "/v1/completions", &send("Why?")).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() / u64::from(BLOCK);
    let s = proxy
        .wait_until(WAIT, |s| {
            s.pools[0].replicas[0].workers[0].index_entries as u64 >= blocks
        })
        .await
        .unwrap_or_else(|s| panic!("the prefix was never indexed: {s:#?}"));
    let n1 = s.pools[0].routed_prompt_tokens;
    assert_eq!(s.pools[0].predicted_cached_tokens, 0, "{s:#?}");
    let second = post(&http, proxy.data_addr(), "/v1/completions", &send("How?")).await;
    assert_eq!(second.status, 200, "{}", second.body);
    let s = proxy.status();
    let (n, p2) = (
        s.pools[0].routed_prompt_tokens,
        s.pools[0].predicted_cached_tokens,
    );
    assert!(p2 >= blocks * u64::from(BLOCK), "{s:#?}");
    // The status window holds the second request, with or without the first.
    let windows = [p2 as f64 / (n - n1) as f64, p2 as f64 / n as f64];
    let status = eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        s.hit_rate.as_ref()?.predicted.filter(|p| *p > 0.0)?;
        Some(s)
    })
    .await
    .expect("status.hitRate.predicted was never above 0");
    let predicted = status.hit_rate.and_then(|h| h.predicted).unwrap();
    eprintln!("predicted hit rate {predicted}; windows {windows:?}; tokens {n1} then {n}, {p2} predicted cached");
    assert!(
        windows.iter().any(|w| (w - predicted).abs() < 1e-4),
        "predicted {predicted}, windows {windows:?}"
    );
    task.abort();
    proxy.shutdown().await;
}
