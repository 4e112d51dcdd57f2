//! `kinference serve --kubeconfig KC --namespace NS --inference-pool NAME` as a process, on a
//! real kube-apiserver (`KINFERENCE_K8S_KUBECONFIG`; see `common`), in front of simulated vLLM
//! replicas on the pods' loopback IPs (127.0.8.x): the binary takes its tokenizer and block
//! size from the `KinferencePool` (no `--tokenizer`, no `--block-size`), follows the pods, routes
//! a prefix's next turn to the pod that caches it, and writes the `KinferencePool`'s status.
//!
//! The binary is the one the workspace's build left beside this test
//! (`target/<profile>/kinference`, built by `cargo test --workspace` or `cargo build -p
//! kinference`; CI's test step runs before its Kubernetes step), or `KINFERENCE_BIN`. Without
//! one the test says it skips, and fails under `KINFERENCE_K8S_REQUIRED=1`.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use common::router::*;
use common::*;
use kinference_proxy::api::{ExplainResponse, Health, ReplicasResponse};
use kinference_testkit::{unused_port, WAIT};

/// The `kinference` binary to run, or `None` (after saying why) when there is none.
fn serve_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KINFERENCE_BIN") {
        return Some(PathBuf::from(p));
    }
    // target/<profile>/deps/<this test> → target/<profile>/kinference
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let bin = dir.join(format!("kinference{}", std::env::consts::EXE_SUFFIX));
    if bin.is_file() {
        return Some(bin);
    }
    let msg = format!(
        "no kinference binary at {} (cargo build -p kinference, or set KINFERENCE_BIN)",
        bin.display()
    );
    if std::env::var(REQUIRED_ENV).as_deref() == Ok("1") {
        panic!("{REQUIRED_ENV}=1 but {msg}");
    }
    println!("SKIPPED: {msg}");
    None
}

/// The router process, killed when dropped; its output goes to `log`.
struct Serve {
    child: Child,
    log: PathBuf,
}

impl Serve {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Panics with the router's output if it has exited.
    fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("kinference serve exited ({status}):\n{}", self.output());
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

async fn replicas(http: &reqwest::Client, admin: SocketAddr) -> Option<ReplicasResponse> {
    let resp = http
        .get(format!("http://{admin}/debug/replicas"))
        .send()
        .await
        .ok()?;
    resp.json().await.ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinference_serve_routes_a_kinference_pool_precisely() {
    let Some(kc) = kubeconfig() else { return };
    let Some(bin) = serve_binary() else { return };
    let client = admin(&kc).await;
    install_crds(&client).await;
    let ns = namespace(&client, "serve").await;
    let pods = [("a", "127.0.8.1"), ("b", "127.0.8.2")];
    let RoutedPool {
        reps: _replicas,
        api,
        urls: want,
    } = routed_pool(&client, &ns, routing_spec("llama"), &pods, None).await;

    // Ports chosen before the process binds them: it takes them as flags.
    let data: SocketAddr = format!("127.0.0.1:{}", unused_port()).parse().unwrap();
    let admin_addr: SocketAddr = format!("127.0.0.1:{}", unused_port()).parse().unwrap();
    let log = std::env::temp_dir().join(format!("kinference-serve-{ns}.log"));
    let out = std::fs::File::create(&log).unwrap();
    let child = Command::new(&bin)
        .arg("serve")
        .arg("--kubeconfig")
        .arg(&kc)
        .args([
            "--namespace",
            &ns,
            "--inference-pool",
            "llama",
            "--model",
            MODEL,
        ])
        .args([
            "--listen",
            &data.to_string(),
            "--admin",
            &admin_addr.to_string(),
        ])
        .args([
            "--expose-endpoint-header",
            "--scrape-interval-ms",
            "50",
            "--threads",
            "2",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", bin.display()));
    let mut serve = Serve { child, log };

    let http = reqwest::Client::new();
    let fleet = eventually(WAIT, || {
        serve.alive();
        let http = &http;
        let want = &want;
        async move {
            let s = replicas(http, admin_addr).await?;
            let mut have = urls(&s);
            have.sort();
            let up = s.pools[0].replicas.iter().all(|r| {
                r.health == Health::Up && r.workers[0].events.as_ref().is_some_and(|e| e.connected)
            });
            (have == *want && up).then_some(s)
        }
    })
    .await
    .unwrap_or_else(|| panic!("the router never routed to {want:?}:\n{}", serve.output()));
    // The tokenizer and block size came from the KinferencePool.
    assert_eq!(fleet.pools[0].block_size, BLOCK, "{fleet:#?}");

    let first = post(
        &http,
        data,
        "/v1/completions",
        &completion(MODEL, &prompt(1, "Why?")),
    )
    .await;
    assert_eq!(first.status, 200, "{}", first.body);
    let served = first.endpoint.clone().unwrap();
    let blocks = first.json()["usage"]["prompt_tokens"].as_u64().unwrap() as usize / BLOCK as usize;
    eventually(WAIT, || async {
        let s = replicas(&http, admin_addr).await?;
        let r = s.pools[0].replicas.iter().find(|r| r.url == served)?;
        (r.workers[0].index_entries >= blocks).then_some(())
    })
    .await
    .unwrap_or_else(|| panic!("{served} was never indexed:\n{}", serve.output()));
    let next = completion(MODEL, &prompt(1, "And how?"));
    let explain = post(&http, admin_addr, "/debug/explain", &next).await;
    let explain: ExplainResponse = serde_json::from_str(&explain.body).unwrap();
    assert_eq!(explain.reason, "cached_prefix", "{explain:#?}");
    assert_eq!(explain.candidates[0].replica, served, "{explain:#?}");
    let second = post(&http, data, "/v1/completions", &next).await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.endpoint.as_deref(), Some(served.as_str()));
    let cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 0, "{}", second.body);

    // The process reports on the KinferencePool as the library does.
    let generation = api.get("llama-routing").await.unwrap().metadata.generation;
    let status = eventually(WAIT, || async {
        let s = api.get("llama-routing").await.ok()?.status?;
        let holds = |ty: &str| {
            s.conditions
                .iter()
                .any(|c| c.type_ == ty && c.status == "True")
        };
        (holds("Ready") && holds("HashingVerified") && holds("Accepted") && s.replicas == Some(2))
            .then_some(s)
    })
    .await
    .unwrap_or_else(|| {
        panic!(
            "the KinferencePool status never settled:\n{}",
            serve.output()
        )
    });
    assert_eq!(status.observed_generation, generation, "{status:#?}");
    serve.alive();
}
