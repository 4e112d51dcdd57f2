//! The router while kube-apiserver is stopped for 10 s and started again (etcd keeps the
//! data): routing goes on over the last known fleet without a failed request, the pool is
//! reported unreadable meanwhile, and afterwards the same router follows changes again with
//! no restart. Needs `KINFERENCE_K8S_DIR` and the test-environment script (see `common`). Its
//! own test binary: it takes the API server away from everything else.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::router::*;
use common::*;
use kinference_proxy::Proxy;
use kinference_testkit::WAIT;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routing_survives_an_api_server_restart() {
    let Some(kc) = kubeconfig() else { return };
    let Some((script, dir)) = testenv() else {
        return;
    };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "router-restart").await;
    let mut reps = Replicas::new("127.0.5.1").await;
    create_pool(&client, &ns, "llama", "vllm", &[reps.port]).await;
    let a = reps.at("127.0.5.1").await;
    let b = reps.at("127.0.5.2").await;
    ready_pod(&client, &ns, "a", "127.0.5.1").await;
    ready_pod(&client, &ns, "b", "127.0.5.2").await;
    let (proxy, task) = router(&client, &ns, "llama", None).await;
    wait_fleet(&proxy, &[a.clone(), b.clone()]).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (log, load) = steady_load(proxy.data_addr(), 2, stop.clone());

    let served_during = outage(&script, &dir, &proxy, &log).await;
    wait_fleet(&proxy, &[a.clone(), b.clone()]).await;
    testenv_cmd(&script, "apiserver-start", &dir);
    let started = Instant::now();

    // Changes made after the restart reach the same router.
    let client = admin(&kc).await;
    let c = reps.at("127.0.5.3").await;
    set_pod_status(&client, &ns, "b", "127.0.5.2", false).await;
    ready_pod(&client, &ns, "c", "127.0.5.3").await;
    followed(&proxy, &[a, c]).await;
    println!(
        "kube-apiserver down 10 s: {served_during} requests routed meanwhile; after it came back, \
         changes followed in {:.2} s",
        started.elapsed().as_secs_f64()
    );
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.await.unwrap();
    }
    let log = std::mem::take(&mut *log.lock().unwrap());
    let failed: Vec<_> = log.replies.iter().filter(|(_, s, _)| *s != 200).collect();
    assert!(
        failed.is_empty() && log.errors.is_empty(),
        "{failed:?} {:?}",
        log.errors
    );
    task.abort();
    proxy.shutdown().await;
}

/// Stops the API server, waits until the router reports it, and keeps it down for 10 s;
/// returns the requests served meanwhile.
async fn outage(script: &PathBuf, dir: &str, proxy: &Proxy, log: &Mutex<Log>) -> usize {
    testenv_cmd(script, "apiserver-stop", dir);
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0]
                .discovery
                .as_ref()
                .and_then(|d| d.error.as_ref())
                .is_some_and(|e| e.contains("unreachable"))
        })
        .await
        .unwrap_or_else(|s| panic!("the outage was never reported: {s:#?}"));
    let served_before = log.lock().unwrap().replies.len();
    // Down for 10 s, as an upgrade or a crash of the API server would be.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let served_during = log.lock().unwrap().replies.len() - served_before;
    assert!(
        served_during > 0,
        "nothing was routed while the API server was down"
    );
    served_during
}

/// Waits (at most 60 s) until the fleet is `want` and the pool is readable again.
async fn followed(proxy: &Proxy, want: &[String]) {
    let s = proxy
        .wait_until(Duration::from_secs(60), |s| {
            let mut have = urls(s);
            have.sort();
            have == want
                && s.pools[0]
                    .discovery
                    .as_ref()
                    .is_some_and(|d| d.error.is_none())
        })
        .await
        .unwrap_or_else(|s| panic!("no recovery within 60 s: {s:#?}"));
    assert!(s.pools[0].discovery.as_ref().unwrap().synced);
}
