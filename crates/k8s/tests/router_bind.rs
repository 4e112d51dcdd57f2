//! `spec.events.bind` on a discovered pool, on a real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`;
//! see `common`): the router binds one endpoint, every pod's publisher connects to it (vLLM
//! `endpoint: tcp://ROUTER:PORT`) under its own topic (`kv@{host}@{model}`, the pod's IP and the
//! model), and the router attributes each pod's blocks to that pod. Replicas are simulated vLLM
//! servers on the pods' loopback IPs (127.0.7.x).

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::router::*;
use common::*;
use kinference_k8s::KinferencePool;
use kinference_proxy::api::{ExplainResponse, Health, ReplicasResponse};
use kinference_sim_server::{KvEventsConfig, Server};
use kinference_testkit::{sim, unused_port, WAIT};
use kube::api::PostParams;
use kube::Api;
use tokio::net::TcpListener;

/// A simulated pod at `ip:port` whose publisher connects to `router` under `kv@IP@tiny`.
async fn publishing_to(ip: &str, port: u16, router: &str) -> Server {
    let mut kv = KvEventsConfig::new(router);
    kv.topic = format!("kv@{ip}@{MODEL}");
    let mut cfg = sim::config(MODEL, 600, BLOCK as usize, 1000.0);
    cfg.kv_events = Some(kv);
    let listener = TcpListener::bind((ip, port)).await.unwrap();
    Server::start(cfg, listener).await.unwrap()
}

fn entries(s: &ReplicasResponse, url: &str) -> usize {
    s.pools[0]
        .replicas
        .iter()
        .find(|r| r.url == url)
        .map_or(0, |r| r.workers[0].index_entries)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_publishing_to_the_routers_endpoint_are_told_apart_by_topic() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "bind").await;
    // The router's endpoint must be known before it binds: the pods are configured with it.
    let bound = format!("tcp://127.0.0.1:{}", unused_port());
    let ips = ["127.0.7.1", "127.0.7.2"];
    let first = publishing_to(ips[0], 0, &bound).await;
    let port = first.addr.port();
    let pods = [first, publishing_to(ips[1], port, &bound).await];
    create_pool(&client, &ns, "llama", "vllm", &[port]).await;
    let mut spec = routing_spec("llama");
    spec.events.bind = Some(bound.clone());
    spec.events.topic = Some("kv@{host}@{model}".into());
    Api::<KinferencePool>::namespaced(client.clone(), &ns)
        .create(
            &PostParams::default(),
            &KinferencePool::new("llama-routing", spec),
        )
        .await
        .unwrap();
    for (pod, ip) in ["a", "b"].into_iter().zip(ips) {
        ready_pod(&client, &ns, pod, ip).await;
    }
    let want = ips.map(|ip| format!("http://{ip}:{port}"));
    let (proxy, task) = router(&client, &ns, "llama", None).await;
    let s = proxy
        .wait_until(WAIT, |s| {
            let mut have = urls(s);
            have.sort();
            have == want && s.pools[0].replicas.iter().all(|r| r.health == Health::Up)
        })
        .await
        .unwrap_or_else(|s| panic!("the fleet never became {want:?}: {s:#?}"));
    let ep = &s.pools[0].event_endpoints;
    assert_eq!(ep.len(), 1, "one bound endpoint for the pool: {ep:#?}");
    assert_eq!(ep[0].endpoint, bound);
    let topics: Vec<String> = ips.iter().map(|ip| format!("kv@{ip}@{MODEL}")).collect();
    assert_eq!(ep[0].topics, topics, "{ep:#?}");
    for r in &s.pools[0].replicas {
        assert_eq!(r.events_mode, "bind", "{r:#?}");
    }

    let http = reqwest::Client::new();
    // A PUB drops what it sends before its connection is up (vLLM's too): traffic straight to
    // each pod until one of its batches has reached the router.
    for (i, (pod, url)) in pods.iter().zip(&want).enumerate() {
        let mut n = 0;
        eventually(WAIT, || {
            n += 1;
            let body = completion(MODEL, &format!("warm-up {i}.{n}: {}", "word ".repeat(40)));
            let (http, proxy) = (&http, &proxy);
            async move {
                let r = post(http, pod.addr, "/v1/completions", &body).await;
                assert_eq!(r.status, 200, "{}", r.body);
                let s = proxy.status();
                let r = s.pools[0].replicas.iter().find(|r| r.url == *url)?;
                r.workers[0].events.as_ref()?.messages.gt(&0).then_some(())
            }
        })
        .await
        .unwrap_or_else(|| panic!("no batch of {url} reached the router's endpoint"));
    }
    // A warm-up sent while an earlier one's batch was still on its way is indexed later still.
    // One more request per pod, waited for in the index, fences them: a pod's batches arrive in
    // order on its connection, so once the fence is indexed nothing older is still coming and
    // the counts below move only with the requests they send.
    for (i, (pod, url)) in pods.iter().zip(&want).enumerate() {
        let fence = completion(MODEL, &format!("fence {i}: {}", "block ".repeat(40)));
        let r = post(&http, pod.addr, "/v1/completions", &fence).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let blocks = r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize / BLOCK as usize;
        let (http, proxy, fence) = (&http, &proxy, &fence);
        eventually(WAIT, || async move {
            let explain = post(http, proxy.admin_addr(), "/debug/explain", fence).await;
            let explain: ExplainResponse = serde_json::from_str(&explain.body).ok()?;
            explain
                .candidates
                .iter()
                .any(|c| c.replica == *url && c.gpu_blocks as usize == blocks)
                .then_some(())
        })
        .await
        .unwrap_or_else(|| panic!("{url}'s fence was never indexed"));
    }

    // Each pod's blocks are its own: a prompt served by one pod is indexed under it alone,
    // and the router sends that prompt's next turn there, with cached tokens.
    for (doc, (pod, url)) in pods.iter().zip(&want).enumerate() {
        let other = want.iter().find(|u| *u != url).unwrap();
        let before = proxy.status();
        let body = completion(MODEL, &prompt(doc, "What is a block?"));
        let r = post(&http, pod.addr, "/v1/completions", &body).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let blocks = r.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize / BLOCK as usize;
        let s = proxy
            .wait_until(WAIT, |s| entries(s, url) >= entries(&before, url) + blocks)
            .await
            .unwrap_or_else(|s| panic!("{url}'s blocks were never indexed: {s:#?}"));
        assert_eq!(entries(&s, other), entries(&before, other), "{s:#?}");
        let next = completion(MODEL, &prompt(doc, "And what is its hash?"));
        let explain = post(&http, proxy.admin_addr(), "/debug/explain", &next).await;
        let explain: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
        assert_eq!(explain.candidates[0].replica, *url, "{explain:#?}");
        assert_eq!(
            explain.candidates[0].gpu_blocks as usize, blocks,
            "{explain:#?}"
        );
        assert_eq!(explain.candidates[1].gpu_blocks, 0, "{explain:#?}");
        let routed = post(&http, proxy.data_addr(), "/v1/completions", &next).await;
        assert_eq!(routed.status, 200, "{}", routed.body);
        assert_eq!(routed.endpoint.as_deref(), Some(url.as_str()));
        let cached = routed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(cached > 0, "{}", routed.body);
    }
    task.abort();
    proxy.shutdown().await;
}
