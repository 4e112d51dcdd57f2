//! Discovery and status against a real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`; see
//! `common`): pods joining, leaving, turning unready, changing IP or labels; a deleted pool
//! next to a healthy one; RBAC denial naming the missing permission; the `KinferencePool`'s
//! event settings; status applied by two routers. Run with `--nocapture` to see the measured
//! discovery latencies.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kinference_k8s::crd::{Hashing, PoolRef, TokenizerSource};
use kinference_k8s::snapshot::{diff, EventSource};
use kinference_k8s::status::Verdict;
use kinference_k8s::{
    InferencePool, KinferencePool, KinferencePoolSpec, PoolError, PoolState, PoolWatcher,
    StatusReport, StatusWriter, WatchConfig, FIELD_MANAGER,
};
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

fn start(client: &Client, ns: &str, pool: &str) -> PoolWatcher {
    PoolWatcher::start(client.clone(), WatchConfig::new(ns, pool))
}

fn ready(s: &kinference_k8s::PoolSnapshot) -> bool {
    s.state == PoolState::Ready
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_follows_pods() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "follow").await;
    create_pool(&client, &ns, "llama", "vllm", &[8000, 8001]).await;
    for (pod, ip) in [("a", "127.0.0.11"), ("b", "127.0.0.12")] {
        create_pod(&client, &ns, pod, app("vllm")).await;
        set_pod_status(&client, &ns, pod, ip, true).await;
    }
    create_pod(&client, &ns, "stranger", app("other")).await;
    set_pod_status(&client, &ns, "stranger", "127.0.0.19", true).await;

    let w = start(&client, &ns, "llama");
    let mut rx = w.subscribe();
    let s0 = snapshot_where(&mut rx, "a and b", |s| ready(s) && s.endpoints.len() == 2).await;
    assert_eq!(
        s0.endpoints["a"].urls,
        ["http://127.0.0.11:8000", "http://127.0.0.11:8001"]
    );
    assert_eq!(s0.endpoints["b"].events, EventSource::Discover);

    set_pod_status(&client, &ns, "a", "127.0.0.11", false).await;
    let s1 = snapshot_where(&mut rx, "a unready", |s| !s.endpoints.contains_key("a")).await;
    assert_eq!(diff(&s0, &s1).left, ["a"]);
    assert!(s1.revision > s0.revision);

    set_pod_status(&client, &ns, "b", "127.0.0.13", true).await;
    let s2 = snapshot_where(&mut rx, "b's new IP", |s| {
        s.endpoints
            .get("b")
            .is_some_and(|e| e.ip.to_string() == "127.0.0.13")
    })
    .await;
    let d = diff(&s1, &s2);
    assert_eq!(d.changed.len(), 1);
    assert_eq!(d.changed[0].2.urls[0], "http://127.0.0.13:8000");

    set_pod_status(&client, &ns, "a", "127.0.0.11", true).await;
    snapshot_where(&mut rx, "a ready again", |s| s.endpoints.contains_key("a")).await;
    label_pod(&client, &ns, "a", app("elsewhere")).await;
    snapshot_where(&mut rx, "a relabelled out", |s| {
        !s.endpoints.contains_key("a")
    })
    .await;
    label_pod(&client, &ns, "a", app("vllm")).await;
    snapshot_where(&mut rx, "a relabelled in", |s| {
        s.endpoints.contains_key("a")
    })
    .await;

    delete_pod(&client, &ns, "b").await;
    let s = snapshot_where(&mut rx, "b deleted", |s| !s.endpoints.contains_key("b")).await;
    assert_eq!(s.endpoints.keys().collect::<Vec<_>>(), ["a"]);
    assert_eq!(s.state, PoolState::Ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_pod_leaves_at_once() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "terminating").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    create_pod(&client, &ns, "a", app("vllm")).await;
    set_pod_status(&client, &ns, "a", "127.0.0.16", true).await;
    let w = start(&client, &ns, "p");
    let mut rx = w.subscribe();
    snapshot_where(&mut rx, "a", |s| ready(s) && s.endpoints.contains_key("a")).await;
    // A graceful delete: the pod stays (Terminating, no kubelet to finish it) but leaves at once.
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    pods.delete("a", &DeleteParams::default()).await.unwrap();
    let s = snapshot_where(&mut rx, "a terminating", |s| s.endpoints.is_empty()).await;
    assert_eq!(s.state, PoolState::Ready);
    let a = pods.get("a").await.unwrap();
    assert!(
        a.metadata.deletion_timestamp.is_some(),
        "a is still there, terminating"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selector_change_moves_the_pool() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "selector").await;
    create_pool(&client, &ns, "p", "blue", &[8000]).await;
    for (pod, label, ip) in [("b1", "blue", "127.0.0.21"), ("g1", "green", "127.0.0.22")] {
        create_pod(&client, &ns, pod, app(label)).await;
        set_pod_status(&client, &ns, pod, ip, true).await;
    }
    let w = start(&client, &ns, "p");
    let mut rx = w.subscribe();
    snapshot_where(&mut rx, "blue", |s| {
        ready(s) && s.endpoints.contains_key("b1")
    })
    .await;
    let api: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    let patch = serde_json::json!({"spec": {"selector": {"matchLabels": {"app": "green"}}}});
    api.patch("p", &Default::default(), &kube::api::Patch::Merge(&patch))
        .await
        .unwrap();
    let s = snapshot_where(&mut rx, "green", |s| s.endpoints.contains_key("g1")).await;
    assert_eq!(s.endpoints.len(), 1);
    assert!(s.pool_generation >= Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_pool_is_an_error_and_other_pools_carry_on() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "deleted").await;
    create_pool(&client, &ns, "one", "one", &[8000]).await;
    create_pool(&client, &ns, "two", "two", &[8000]).await;
    for (pod, label, ip) in [("p1", "one", "127.0.0.31"), ("p2", "two", "127.0.0.32")] {
        create_pod(&client, &ns, pod, app(label)).await;
        set_pod_status(&client, &ns, pod, ip, true).await;
    }
    let (w1, w2) = (start(&client, &ns, "one"), start(&client, &ns, "two"));
    let (mut rx1, mut rx2) = (w1.subscribe(), w2.subscribe());
    snapshot_where(&mut rx1, "one ready", |s| {
        ready(s) && s.endpoints.len() == 1
    })
    .await;
    let two = snapshot_where(&mut rx2, "two ready", |s| {
        ready(s) && s.endpoints.len() == 1
    })
    .await;

    let api: Api<InferencePool> = Api::namespaced(client.clone(), &ns);
    api.delete("one", &DeleteParams::default()).await.unwrap();
    let gone = snapshot_where(&mut rx1, "one gone", |s| {
        matches!(s.state, PoolState::Error(PoolError::PoolNotFound { .. }))
    })
    .await;
    assert!(gone.endpoints.is_empty());
    assert_eq!(
        gone.state,
        PoolState::Error(PoolError::PoolNotFound {
            namespace: ns.clone(),
            name: "one".into()
        })
    );
    // The other pool saw nothing: same content, same revision.
    assert_eq!(*rx2.borrow(), two);

    // A pool that comes back is followed again.
    create_pool(&client, &ns, "one", "one", &[8000]).await;
    snapshot_where(&mut rx1, "one back", |s| ready(s) && s.endpoints.len() == 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn never_created_pool_is_reported() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "absent").await;
    let w = start(&client, &ns, "nope");
    let mut rx = w.subscribe();
    let s = snapshot_where(&mut rx, "not found", |s| s.state != PoolState::Syncing).await;
    assert_eq!(
        s.state.clone(),
        PoolState::Error(PoolError::PoolNotFound {
            namespace: ns,
            name: "nope".into()
        })
    );
}

async fn grant(client: &Client, ns: &str, user: &str, rules: Vec<PolicyRule>) {
    let meta = |n: &str| ObjectMeta {
        name: Some(n.to_owned()),
        namespace: Some(ns.to_owned()),
        ..ObjectMeta::default()
    };
    let role = Role {
        metadata: meta(user),
        rules: Some(rules),
    };
    Api::<Role>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &role)
        .await
        .unwrap();
    let binding = RoleBinding {
        metadata: meta(user),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: user.to_owned(),
        },
        subjects: Some(vec![Subject {
            kind: "User".into(),
            name: user.to_owned(),
            api_group: Some("rbac.authorization.k8s.io".into()),
            ..Subject::default()
        }]),
    };
    Api::<RoleBinding>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &binding)
        .await
        .unwrap();
}

fn denied(s: &kinference_k8s::PoolSnapshot, resource: &str) -> bool {
    matches!(&s.state, PoolState::Error(PoolError::Forbidden { access, .. }) if access.resource == resource)
}

fn rule(group: &str, resource: &str) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.to_owned()]),
        resources: Some(vec![resource.to_owned()]),
        verbs: ["get", "list", "watch"].map(String::from).to_vec(),
        ..PolicyRule::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rbac_denial_names_the_missing_permission() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "rbac").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    create_pod(&client, &ns, "a", app("vllm")).await;
    set_pod_status(&client, &ns, "a", "127.0.0.41", true).await;

    // No rights at all: the pool itself cannot be listed.
    let nobody = as_user(&kc, "kinference-nobody").await;
    let w = start(&nobody, &ns, "p");
    let mut rx = w.subscribe();
    // The pool's own error outranks the others once it is in (the watches fail in any order).
    let s = snapshot_where(&mut rx, "pool forbidden", |s| denied(s, "inferencepools")).await;
    let PoolState::Error(err) = &s.state else {
        unreachable!()
    };
    let text = err.to_string();
    eprintln!("no rights: {text}");
    assert_eq!(err.metric_label(), "forbidden");
    assert!(
        text.contains(&format!(
            "list inferencepools (API group inference.networking.k8s.io) in namespace {ns}"
        )),
        "{text}"
    );

    // Pools and routing readable, pods not: the error names pods.
    let user = "kinference-no-pods";
    grant(
        &client,
        &ns,
        user,
        vec![
            rule("inference.networking.k8s.io", "inferencepools"),
            rule("kinference.io", "kinferencepools"),
        ],
    )
    .await;
    let w = start(&as_user(&kc, user).await, &ns, "p");
    let mut rx = w.subscribe();
    let s = snapshot_where(&mut rx, "pods forbidden", |s| denied(s, "pods")).await;
    let text = format!("{:?}", s.state);
    eprintln!(
        "no pods: {}",
        match &s.state {
            PoolState::Error(e) => e.to_string(),
            _ => text.clone(),
        }
    );
    assert!(text.contains("resource: \"pods\""), "{text}");
    assert!(text.contains("verb: \"list\""), "{text}");
    assert!(s.endpoints.is_empty());
}

fn routing_spec(pool: &str, port: Option<u16>) -> KinferencePoolSpec {
    KinferencePoolSpec {
        pool_ref: PoolRef { name: pool.into() },
        models: vec!["m".into()],
        tokenizer: TokenizerSource {
            path: "/tok".into(),
        },
        hashing: Hashing {
            block_size: 16,
            algorithm: "sha256".into(),
            seed: None,
        },
        policy: Default::default(),
        events: kinference_k8s::crd::EventsSettings {
            port,
            ..Default::default()
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinference_pool_sets_event_endpoints_and_annotation_overrides() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "routing").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    let api: Api<KinferencePool> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &KinferencePool::new("p-routing", routing_spec("p", Some(5557))),
    )
    .await
    .unwrap();
    create_pod(&client, &ns, "a", app("vllm")).await;
    set_pod_status(&client, &ns, "a", "127.0.0.51", true).await;
    let w = start(&client, &ns, "p");
    let mut rx = w.subscribe();
    let s = snapshot_where(&mut rx, "a", |s| ready(s) && s.endpoints.contains_key("a")).await;
    assert_eq!(
        s.routing.as_ref().map(|r| r.name.as_str()),
        Some("p-routing")
    );
    assert_eq!(
        s.endpoints["a"].events,
        EventSource::Connect {
            endpoint: "tcp://127.0.0.51:5557".into(),
            replay: None,
            topic: String::new()
        }
    );
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let patch = serde_json::json!({"metadata": {"annotations": {
        kinference_k8s::ANNOTATION_KV_EVENTS: "tcp://*:6000"}}});
    pods.patch("a", &Default::default(), &kube::api::Patch::Merge(&patch))
        .await
        .unwrap();
    snapshot_where(&mut rx, "annotation override", |s| {
        s.endpoints.get("a").is_some_and(|e| {
            matches!(&e.events, EventSource::Connect { endpoint, .. } if endpoint == "tcp://127.0.0.51:6000")
        })
    })
    .await;
}

fn report(replicas: i32) -> StatusReport {
    StatusReport {
        ready: Verdict::True {
            reason: "Routing".into(),
            message: format!("{replicas} endpoints"),
        },
        hashing_verified: Verdict::Unknown {
            reason: "NoEvents".into(),
            message: "no KV events yet".into(),
        },
        accepted: Verdict::True {
            reason: "Applied".into(),
            message: "the router routes with generation 1".into(),
        },
        generation: None,
        // A new object's first generation.
        applied_generation: Some(1),
        replicas,
        scorable_replicas: replicas,
        predicted_hit_rate: Some(0.5),
        reported_hit_rate: Some(0.48),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_routers_apply_status_without_conflict() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "status").await;
    let api: Api<KinferencePool> = Api::namespaced(client.clone(), &ns);
    api.create(
        &PostParams::default(),
        &KinferencePool::new("r", routing_spec("p", None)),
    )
    .await
    .unwrap();
    let router_a = StatusWriter::new(admin(&kc).await, &ns);
    let router_b = StatusWriter::new(admin(&kc).await, &ns);
    let now = k8s_openapi::jiff::Timestamp::now();

    let a = router_a.apply("r", &report(3), now).await.unwrap();
    let b = router_b
        .apply(
            "r",
            &report(3),
            now + k8s_openapi::jiff::SignedDuration::from_secs(5),
        )
        .await
        .unwrap();
    // The same view applied twice, later, by another replica: nothing written.
    assert_eq!(a.metadata.resource_version, b.metadata.resource_version);
    assert_eq!(a.status, b.status);

    // Views differ: the last apply wins, no 409 between replicas.
    let (two, four) = (report(2), report(4));
    let (ra, rb) = tokio::join!(
        router_a.apply("r", &two, now),
        router_b.apply("r", &four, now)
    );
    ra.unwrap();
    rb.unwrap();
    let last = router_a.apply("r", &report(4), now).await.unwrap();
    let status = last.status.unwrap();
    assert_eq!(status.replicas, Some(4));
    assert_eq!(status.observed_generation, last.metadata.generation);
    let ready = &status.conditions[0];
    assert_eq!(
        (ready.type_.as_str(), ready.status.as_str()),
        ("Ready", "True")
    );
    let managers: Vec<String> = last
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.subresource.as_deref() == Some("status"))
        .filter_map(|m| m.manager.clone())
        .collect();
    assert_eq!(managers, [FIELD_MANAGER]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_latency() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "latency").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    create_pod(&client, &ns, "a", app("vllm")).await;
    let w = start(&client, &ns, "p");
    let mut rx = w.subscribe();
    snapshot_where(&mut rx, "synced", ready).await;
    let (mut joins, mut leaves) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let t = Instant::now();
        set_pod_status(&client, &ns, "a", "127.0.0.61", true).await;
        snapshot_where(&mut rx, "join", |s| s.endpoints.contains_key("a")).await;
        joins.push(t.elapsed());
        let t = Instant::now();
        set_pod_status(&client, &ns, "a", "127.0.0.61", false).await;
        snapshot_where(&mut rx, "leave", |s| !s.endpoints.contains_key("a")).await;
        leaves.push(t.elapsed());
    }
    let (j, l) = (summary(joins.clone()), summary(leaves.clone()));
    println!("discovery latency, status update -> snapshot: join {j}; leave {l}");
    let max = joins
        .iter()
        .chain(&leaves)
        .max()
        .copied()
        .unwrap_or_default();
    assert!(
        max < Duration::from_secs(1),
        "a change took {max:?} to reach the snapshot"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_up_and_down_latency() {
    let Some(kc) = kubeconfig() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "scale").await;
    create_pool(&client, &ns, "p", "vllm", &[8000]).await;
    let names: Vec<String> = (0..8).map(|i| format!("r{i}")).collect();
    for n in &names {
        create_pod(&client, &ns, n, app("vllm")).await;
    }
    let w = start(&client, &ns, "p");
    let mut rx = w.subscribe();
    snapshot_where(&mut rx, "synced", ready).await;
    // 0 -> 8 Ready at once (concurrent status updates), then 8 -> 2.
    let t = Instant::now();
    let ups = names.iter().enumerate().map(|(i, n)| {
        let (client, ns) = (client.clone(), ns.clone());
        let ip = format!("127.0.1.{}", i + 1);
        async move { set_pod_status(&client, &ns, n, &ip, true).await }
    });
    futures::future::join_all(ups).await;
    snapshot_where(&mut rx, "8 endpoints", |s| s.endpoints.len() == 8).await;
    let up = t.elapsed();
    let t = Instant::now();
    let downs = names[2..].iter().map(|n| {
        let (client, ns) = (client.clone(), ns.clone());
        async move { delete_pod(&client, &ns, n).await }
    });
    futures::future::join_all(downs).await;
    snapshot_where(&mut rx, "2 endpoints", |s| s.endpoints.len() == 2).await;
    let down = t.elapsed();
    println!(
        "scale: 0 -> 8 Ready in {:.1} ms, 8 -> 2 (6 deleted) in {:.1} ms (first update to last snapshot)",
        up.as_secs_f64() * 1e3,
        down.as_secs_f64() * 1e3
    );
    assert!(up < Duration::from_secs(1) && down < Duration::from_secs(1));
}
