//! Shared by the tests against a real kube-apiserver: the kubeconfig from
//! `KINFERENCE_K8S_KUBECONFIG` (skip without it, fail without it when
//! `KINFERENCE_K8S_REQUIRED=1`), per-test namespaces, CRD installation, and pods driven to
//! Ready through the status subresource (there is no kubelet).
// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

pub mod router;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSpec};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kinference_k8s::gie::{InferencePoolSpec, PoolSelector, TargetPort};
use kinference_k8s::{InferencePool, PoolSnapshot};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client, CustomResourceExt};
use serde_json::json;
use tokio::sync::watch;

pub const KUBECONFIG_ENV: &str = "KINFERENCE_K8S_KUBECONFIG";
pub const REQUIRED_ENV: &str = "KINFERENCE_K8S_REQUIRED";
const TEST_MANAGER: &str = "kinference-tests";

/// The kubeconfig, or `None` (after saying why) when these tests are to be skipped.
pub fn kubeconfig() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(KUBECONFIG_ENV) {
        return Some(PathBuf::from(p));
    }
    let msg = format!(
        "{KUBECONFIG_ENV} is not set: no kube-apiserver to test against \
         (scripts/k8s-testenv.sh up DIR, then {KUBECONFIG_ENV}=DIR/kubeconfig)"
    );
    if std::env::var(REQUIRED_ENV).as_deref() == Ok("1") {
        panic!("{REQUIRED_ENV}=1 but {msg}");
    }
    println!("SKIPPED: {msg}");
    None
}

pub async fn admin(path: &std::path::Path) -> Client {
    kinference_k8s::client(Some(path)).await.unwrap()
}

/// A client acting as `user` (the admin impersonates it), with no groups but authenticated.
pub async fn as_user(path: &std::path::Path, user: &str) -> Client {
    let kc = kube::config::Kubeconfig::read_from(path).unwrap();
    let mut cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    cfg.auth_info.impersonate = Some(user.to_owned());
    cfg.auth_info.impersonate_groups = Some(vec!["system:authenticated".to_owned()]);
    Client::try_from(cfg).unwrap()
}

/// A fresh namespace per test; names are unique per process and test.
pub async fn namespace(client: &Client, test: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let name = format!("kt-{test}-{}-{nanos}", std::process::id());
    let api: Api<Namespace> = Api::all(client.clone());
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    api.create(&PostParams::default(), &ns).await.unwrap();
    name
}

/// Installs (server-side apply) and waits until the API serves it.
pub async fn install_crd(client: &Client, crd: CustomResourceDefinition) {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.metadata.name.clone().unwrap();
    let pp = PatchParams::apply(TEST_MANAGER).force();
    api.patch(&name, &pp, &Patch::Apply(&crd)).await.unwrap();
    eventually(Duration::from_secs(30), || async {
        let c = api.get(&name).await.ok()?;
        let established = c
            .status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        established.then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("CRD {name} not established"));
}

/// The InferencePool CRD the charts ship (upstream's schema) when this checkout has it, else
/// the one derived from our type: with the chart's, every pool the tests create also passes
/// upstream's validation, which keeps `gie.rs` honest.
fn inference_pool_crd() -> CustomResourceDefinition {
    let chart = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../charts/kinference-crds/files/inference.networking.k8s.io_inferencepools.yaml");
    let path = std::env::var_os("KINFERENCE_K8S_INFERENCEPOOL_CRD")
        .map(PathBuf::from)
        .unwrap_or(chart);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        }
        Err(_) => InferencePool::crd(),
    }
}

pub async fn install_crds(client: &Client) {
    install_crd(client, inference_pool_crd()).await;
    for crd in kinference_k8s::crds() {
        install_crd(client, crd).await;
    }
}

/// Polls `f` until it returns `Some` or `limit` passes.
pub async fn eventually<T, F, Fut>(limit: Duration, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits (without polling: on the channel) for a snapshot satisfying `pred`.
pub async fn snapshot_where(
    rx: &mut watch::Receiver<PoolSnapshot>,
    what: &str,
    pred: impl Fn(&PoolSnapshot) -> bool,
) -> PoolSnapshot {
    let wait = rx.wait_for(|s| pred(s));
    let got = tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .ok()
        .and_then(|r| r.ok().map(|s| s.clone()));
    match got {
        Some(s) => s,
        None => panic!(
            "no snapshot with {what} within 30 s; last: {:#?}",
            *rx.borrow()
        ),
    }
}

pub async fn create_pool(client: &Client, ns: &str, name: &str, app: &str, ports: &[u16]) {
    create_pool_with(client, ns, name, app, ports, None).await;
}

/// [`create_pool`] with a `spec.appProtocol`.
pub async fn create_pool_with(
    client: &Client,
    ns: &str,
    name: &str,
    app: &str,
    ports: &[u16],
    app_protocol: Option<&str>,
) {
    let api: Api<InferencePool> = Api::namespaced(client.clone(), ns);
    let pool = InferencePool::new(
        name,
        InferencePoolSpec {
            selector: PoolSelector {
                match_labels: [("app".to_owned(), app.to_owned())].into(),
            },
            target_ports: ports.iter().map(|&number| TargetPort { number }).collect(),
            app_protocol: app_protocol.map(str::to_owned),
            endpoint_picker_ref: None,
        },
    );
    api.create(&PostParams::default(), &pool).await.unwrap();
}

/// Creates a pod (scheduled on a fake node, so deleting it needs no kubelet's confirmation
/// when done with grace 0).
pub async fn create_pod(client: &Client, ns: &str, name: &str, labels: BTreeMap<String, String>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("fake-node".to_owned()),
            containers: vec![Container {
                name: "vllm".to_owned(),
                image: Some("vllm/vllm-openai".to_owned()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: None,
    };
    api.create(&PostParams::default(), &pod).await.unwrap();
}

pub fn app(app: &str) -> BTreeMap<String, String> {
    [("app".to_owned(), app.to_owned())].into()
}

/// Sets phase, IP and the Ready condition through the status subresource, as a kubelet would.
pub async fn set_pod_status(client: &Client, ns: &str, name: &str, ip: &str, ready: bool) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let ready = if ready { "True" } else { "False" };
    let status = json!({
        "apiVersion": "v1", "kind": "Pod",
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}],
            "conditions": [{"type": "Ready", "status": ready}]
        }
    });
    api.patch_status(
        name,
        &PatchParams::apply(TEST_MANAGER).force(),
        &Patch::Apply(&status),
    )
    .await
    .unwrap();
}

pub async fn delete_pod(client: &Client, ns: &str, name: &str) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        ..DeleteParams::default()
    };
    api.delete(name, &dp).await.unwrap();
}

pub async fn label_pod(client: &Client, ns: &str, name: &str, labels: BTreeMap<String, String>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), ns);
    let patch = json!({"metadata": {"labels": labels}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .unwrap();
}

/// p50 / p95 / max of durations, in milliseconds.
pub fn summary(mut xs: Vec<Duration>) -> String {
    xs.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let at = |q: f64| xs[((xs.len() as f64 - 1.0) * q).round() as usize];
    format!(
        "n={} p50={:.1} ms p95={:.1} ms max={:.1} ms",
        xs.len(),
        ms(at(0.5)),
        ms(at(0.95)),
        ms(xs[xs.len() - 1])
    )
}

/// The test-environment script and `KINFERENCE_K8S_DIR`, to stop and start kube-apiserver;
/// `None` (after saying why) when these tests are to be skipped.
pub fn testenv() -> Option<(PathBuf, String)> {
    let script = std::env::var_os("KINFERENCE_K8S_TESTENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/k8s-testenv.sh")
        });
    let dir = std::env::var("KINFERENCE_K8S_DIR").ok();
    match (script.exists(), dir) {
        (true, Some(dir)) => Some((script, dir)),
        _ => {
            let msg = format!(
                "needs KINFERENCE_K8S_DIR and {} to stop and start kube-apiserver",
                script.display()
            );
            if std::env::var(REQUIRED_ENV).as_deref() == Ok("1") {
                panic!("{REQUIRED_ENV}=1 but this test {msg}");
            }
            println!("SKIPPED: {msg}");
            None
        }
    }
}

/// Runs `scripts/k8s-testenv.sh VERB DIR`; panics with its stderr when it fails.
pub fn testenv_cmd(script: &PathBuf, verb: &str, dir: &str) {
    let out = Command::new("bash")
        .arg(script)
        .arg(verb)
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{verb}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
