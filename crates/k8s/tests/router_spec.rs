//! The `KinferencePool`'s spec on a real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`; see
//! `common`): its policy and hashing win over the router's own settings at start, and a spec
//! changed later is reported (HashingVerified False, restart needed), not applied. Replicas are
//! simulated vLLM servers on the pods' loopback IPs (127.0.6.x).

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::router::*;
use common::*;
use kinference_k8s::crd::{KinferencePoolStatus, PolicyKind};
use kinference_k8s::KinferencePool;
use kinference_testkit::WAIT;
use kube::api::{Patch, PatchParams, PostParams};
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
    let mut reps = Replicas::new("127.0.6.1").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    let api = Api::<KinferencePool>::namespaced(client.clone(), &ns);
    let mut spec = routing_spec("llama");
    spec.policy.kind = PolicyKind::LeastLoad;
    api.create(
        &PostParams::default(),
        &KinferencePool::new("llama-routing", spec),
    )
    .await
    .unwrap();
    let want = vec![reps.at("127.0.6.1").await];
    ready_pod(&client, &ns, "a", "127.0.6.1").await;
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

    // A later change is reported, not applied: the tokenizer, hasher and policy are built once.
    let patch = json!({"spec": {"hashing": {"blockSize": 64}}});
    api.patch(
        "llama-routing",
        &PatchParams::default(),
        &Patch::Merge(&patch),
    )
    .await
    .unwrap();
    let status = condition_is(&api, "HashingVerified", "False").await;
    let c = status
        .conditions
        .iter()
        .find(|c| c.type_ == "HashingVerified")
        .unwrap();
    assert_eq!(c.reason, "RouterConfigDiffers", "{c:#?}");
    assert!(
        c.message.contains("blockSize is 64") && c.message.contains("restart"),
        "{c:#?}"
    );
    assert_eq!(proxy.status().pools[0].block_size, BLOCK);
    task.abort();
    proxy.shutdown().await;
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
    let mut reps = Replicas::new("127.0.6.11").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    let api = Api::<KinferencePool>::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &KinferencePool::new("llama-routing", routing_spec("llama")),
    )
    .await
    .unwrap();
    let want = vec![reps.at("127.0.6.11").await];
    ready_pod(&client, &ns, "a", "127.0.6.11").await;
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
