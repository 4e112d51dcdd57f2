//! A missing CRD is a clear error, and the watch recovers once it is installed, without a
//! restart. Its own test binary: it deletes the shared CRDs, which no other test in the same
//! process may be using (cargo runs test binaries one after another).

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kinference_k8s::{InferencePool, PoolError, PoolState, PoolWatcher, WatchConfig};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, CustomResourceExt};

async fn remove_crd(client: &Client, name: &str) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let _ = crds.delete(name, &DeleteParams::default()).await;
    let gone = eventually(Duration::from_secs(60), || async {
        crds.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(gone.is_some(), "CRD {name} still there");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_crds_are_reported_and_recovered_from() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "nocrd").await;
    remove_crd(&client, InferencePool::crd_name()).await;

    let w = PoolWatcher::start(client.clone(), WatchConfig::new(&ns, "p"));
    let mut rx = w.subscribe();
    let s = snapshot_where(&mut rx, "CRD missing", |s| {
        matches!(
            s.state,
            PoolState::Error(PoolError::CrdMissing {
                resource: "inferencepools",
                ..
            })
        )
    })
    .await;
    let PoolState::Error(e) = &s.state else {
        unreachable!()
    };
    eprintln!("InferencePool CRD missing: {e}");
    assert!(
        e.to_string()
            .contains("inferencepools.inference.networking.k8s.io/v1"),
        "{e}"
    );

    // Installed later: the same watcher picks the pool up.
    install_crds(&client).await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    create_pod(&client, &ns, "a", app("vllm")).await;
    set_pod_status(&client, &ns, "a", "127.0.0.71", true).await;
    snapshot_where(&mut rx, "recovered", |s| {
        s.state == PoolState::Ready && s.endpoints.contains_key("a")
    })
    .await;

    our_crd_missing(&client, &ns).await;
    install_crds(&client).await;
    // Leave the API as the other test binaries expect it.
    let api: Api<kinference_k8s::KinferencePool> = Api::namespaced(client.clone(), &ns);
    assert!(api.list(&ListParams::default()).await.is_ok());
}

/// Our own CRD missing: reported, while the pool's endpoints stay routable.
async fn our_crd_missing(client: &Client, ns: &str) {
    let ours = kinference_k8s::KinferencePool::crd_name();
    remove_crd(client, ours).await;
    let w2 = PoolWatcher::start(client.clone(), WatchConfig::new(ns, "p"));
    let mut rx2 = w2.subscribe();
    let s = snapshot_where(&mut rx2, "routing CRD missing, pod a routable", |s| {
        let ours_missing = matches!(
            s.state,
            PoolState::Error(PoolError::CrdMissing {
                group: "kinference.io",
                ..
            })
        );
        ours_missing && s.endpoints.contains_key("a")
    })
    .await;
    assert_eq!(
        s.endpoints["a"].events,
        kinference_k8s::EventSource::Discover
    );
}
