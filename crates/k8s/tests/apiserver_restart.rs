//! kube-apiserver stopped and started again (etcd keeps the data): the last known endpoints
//! stay published while it is down, the error says it is unreachable, and the same watcher
//! follows changes afterwards. Needs `KINFERENCE_K8S_DIR` (from `source DIR/env`) and the
//! test-environment script (`scripts/k8s-testenv.sh`, or `KINFERENCE_K8S_TESTENV`). Its own
//! test binary: it takes the API server away from everything else.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use kinference_k8s::{PoolError, PoolState, PoolWatcher, WatchConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_survives_an_api_server_restart() {
    let Some(kc) = kubeconfig() else { return };
    let Some((script, dir)) = testenv() else {
        return;
    };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "restart").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    for (pod, ip) in [("a", "127.0.0.81"), ("b", "127.0.0.82")] {
        create_pod(&client, &ns, pod, app("vllm")).await;
        set_pod_status(&client, &ns, pod, ip, true).await;
    }
    let w = PoolWatcher::start(client.clone(), WatchConfig::new(&ns, "p"));
    let mut rx = w.subscribe();
    let before = snapshot_where(&mut rx, "a and b", |s| {
        s.state == PoolState::Ready && s.endpoints.len() == 2
    })
    .await;

    testenv_cmd(&script, "apiserver-stop", &dir);
    let down = snapshot_where(&mut rx, "unreachable", |s| {
        matches!(s.state, PoolState::Error(PoolError::Unreachable(_)))
    })
    .await;
    assert_eq!(down.endpoints, before.endpoints, "last known fleet kept");
    // Down for 10 s, as an upgrade or a crash of the API server would be.
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(rx.borrow().endpoints, before.endpoints);
    testenv_cmd(&script, "apiserver-start", &dir);
    let started = Instant::now();

    let client = admin(&kc).await;
    set_pod_status(&client, &ns, "b", "127.0.0.82", false).await;
    let s = tokio::time::timeout(
        Duration::from_secs(60),
        rx.wait_for(|s| s.state == PoolState::Ready && !s.endpoints.contains_key("b")),
    )
    .await
    .expect("no recovery within 60 s")
    .map(|s| s.clone())
    .unwrap();
    println!(
        "after kube-apiserver came back: change followed and state Ready in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(s.endpoints.keys().collect::<Vec<_>>(), ["a"]);
}
