//! The router in process, following an InferencePool on the real kube-apiserver, in front of
//! simulated vLLM replicas on the pods' loopback IPs: what the router tests share.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kinference_k8s::crd::{Hashing, PolicyWeights, PoolRef, RoutingPolicy, TokenizerSource};
use kinference_k8s::{KinferencePool, KinferencePoolSpec};
use kinference_proxy::api::{Health, ReplicasResponse};
use kinference_proxy::{Config, InferencePoolRef, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::Server;
use kinference_testkit::{sim, tokenizer_dir, WAIT};
use kube::api::PostParams;
use kube::{Api, Client};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::{app, create_pod, create_pool_with, eventually, set_pod_status};

pub const MODEL: &str = "tiny";
pub const BLOCK: u32 = 32;

/// A simulated replica with KV events (published on `tcp://*:0`, found by the router through
/// `/kv_event_sources`) listening on `ip:port`; port 0 picks one.
pub async fn replica_at(ip: &str, port: u16) -> Server {
    let mut cfg = sim::config(MODEL, 600, BLOCK as usize, 1000.0);
    cfg.kv_events = Some(sim::events_on_port_zero());
    let listener = TcpListener::bind((ip, port))
        .await
        .unwrap_or_else(|e| panic!("cannot listen on {ip}:{port}: {e}"));
    Server::start(cfg, listener).await.unwrap()
}

/// Replicas at the pods' IPs; the first picks the pool's one target port.
pub struct Replicas {
    pub port: u16,
    servers: BTreeMap<String, Server>,
}

impl Replicas {
    pub async fn new(first_ip: &str) -> Replicas {
        let s = replica_at(first_ip, 0).await;
        let port = s.addr.port();
        Replicas {
            port,
            servers: [(first_ip.to_owned(), s)].into(),
        }
    }

    /// The replica listening on `ip`.
    pub fn server(&self, ip: &str) -> &Server {
        &self.servers[ip]
    }

    pub async fn at(&mut self, ip: &str) -> String {
        if !self.servers.contains_key(ip) {
            let s = replica_at(ip, self.port).await;
            self.servers.insert(ip.to_owned(), s);
        }
        format!("http://{ip}:{}", self.port)
    }
}

/// A routed InferencePool on the apiserver: `llama` in its namespace (pods labelled
/// `app: vllm`), the KinferencePool `llama-routing` with its spec, one Ready pod per
/// `(name, ip)` and a simulated replica behind each.
pub struct RoutedPool {
    pub reps: Replicas,
    pub api: Api<KinferencePool>,
    /// The replicas' URLs, sorted.
    pub urls: Vec<String>,
}

/// Creates a [`RoutedPool`]; `app_protocol` is the InferencePool's target port protocol
/// (`kubernetes.io/h2c`), if any.
pub async fn routed_pool(
    client: &Client,
    ns: &str,
    spec: KinferencePoolSpec,
    pods: &[(&str, &str)],
    app_protocol: Option<&str>,
) -> RoutedPool {
    let first = pods.first().map_or("127.0.0.1", |p| p.1);
    let mut reps = Replicas::new(first).await;
    create_pool_with(client, ns, "llama", "vllm", &[reps.port], app_protocol).await;
    let api = Api::<KinferencePool>::namespaced(client.clone(), ns);
    api.create(
        &PostParams::default(),
        &KinferencePool::new("llama-routing", spec),
    )
    .await
    .unwrap();
    let mut urls = Vec::new();
    for (pod, ip) in pods {
        urls.push(reps.at(ip).await);
        ready_pod(client, ns, pod, ip).await;
    }
    urls.sort();
    RoutedPool { reps, api, urls }
}

/// A pod of the pool, Ready at `ip`.
pub async fn ready_pod(client: &Client, ns: &str, name: &str, ip: &str) {
    create_pod(client, ns, name, app("vllm")).await;
    set_pod_status(client, ns, name, ip, true).await;
}

/// A router whose one pool is the InferencePool `ns/pool`, following it with `client`; an
/// optional static pool beside it (model `static`).
pub async fn router(
    client: &Client,
    ns: &str,
    pool: &str,
    static_replica: Option<ReplicaSpec>,
) -> (Proxy, JoinHandle<()>) {
    let mut pools = vec![discovered(ns, pool, BLOCK)];
    if let Some(r) = static_replica {
        let mut s = PoolConfig::new("static", tokenizer_dir(), BLOCK);
        s.replicas = vec![r];
        pools.push(s);
    }
    start_router(client, ns, pools).await
}

/// The router's settings for a pool discovered from the InferencePool `ns/pool`.
pub fn discovered(ns: &str, pool: &str, block: u32) -> PoolConfig {
    let mut p = PoolConfig::new(MODEL, tokenizer_dir(), block);
    p.policy = kinference_proxy::parse_policy("{kind: precise, speculative_ttl_ms: 0}").unwrap();
    p.inference_pool = Some(InferencePoolRef {
        namespace: Some(ns.to_owned()),
        name: pool.to_owned(),
    });
    p
}

/// Starts a router as `kinference serve` does: the KinferencePools' settings applied, then
/// the first pool followed with `client`.
pub async fn start_router(
    client: &Client,
    ns: &str,
    mut pools: Vec<PoolConfig>,
) -> (Proxy, JoinHandle<()>) {
    kinference_k8s::settings::apply_to_pools(client, &mut pools, ns).await;
    let mut cfg = Config::new(pools);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    cfg.expose_endpoint_header = true;
    cfg.scrape.interval_ms = 50;
    cfg.threads = Some(2);
    let proxy = Proxy::start(cfg).await.unwrap();
    let members = proxy.discovered_pools().remove(0);
    let task = kinference_k8s::router::spawn_pool(client.clone(), members, ns);
    (proxy, task)
}

pub fn urls(s: &ReplicasResponse) -> Vec<String> {
    s.pools[0].replicas.iter().map(|r| r.url.clone()).collect()
}

/// Waits until the discovered pool's replicas are exactly `want`, each up with its event
/// stream connected.
pub async fn wait_fleet(proxy: &Proxy, want: &[String]) -> ReplicasResponse {
    let mut want = want.to_vec();
    want.sort();
    proxy
        .wait_until(WAIT, |s| {
            let mut have = urls(s);
            have.sort();
            have == want
                && s.pools[0].replicas.iter().all(|r| {
                    r.health == Health::Up
                        && r.workers[0].events.as_ref().is_some_and(|e| e.connected)
                })
        })
        .await
        .unwrap_or_else(|s| panic!("the fleet never became {want:?}: {s:#?}"))
}

pub fn prompt(doc: usize, question: &str) -> String {
    let mut s = format!("Document {doc}. ");
    for i in 0..40 {
        s.push_str(&format!(
            "Section {i} of document {doc} explains block hashing. "
        ));
    }
    s.push_str(question);
    s
}

pub struct Reply {
    pub status: u16,
    pub endpoint: Option<String>,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

pub async fn post(http: &reqwest::Client, addr: SocketAddr, path: &str, body: &Value) -> Reply {
    match try_post(http, addr, path, body).await {
        Ok(r) => r,
        Err(e) => panic!("POST {path}: {e}"),
    }
}

pub async fn try_post(
    http: &reqwest::Client,
    addr: SocketAddr,
    path: &str,
    body: &Value,
) -> Result<Reply, reqwest::Error> {
    let resp = http
        .post(format!("http://{addr}{path}"))
        .json(body)
        .send()
        .await?;
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-kinference-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(|v| format!("http://{v}"));
    Ok(Reply {
        status,
        endpoint,
        body: resp.text().await?,
    })
}

pub fn completion(model: &str, text: &str) -> Value {
    json!({"model": model, "prompt": text, "max_tokens": 2})
}

pub fn routing_spec(pool: &str) -> KinferencePoolSpec {
    KinferencePoolSpec {
        pool_ref: PoolRef { name: pool.into() },
        models: vec![MODEL.into()],
        tokenizer: TokenizerSource {
            path: tokenizer_dir().display().to_string(),
        },
        hashing: Hashing {
            block_size: BLOCK,
            algorithm: "sha256".into(),
            seed: None,
        },
        // What the router's own settings say too (see `router`).
        policy: RoutingPolicy {
            weights: Some(PolicyWeights {
                speculative_ttl_ms: Some(0),
                ..PolicyWeights::default()
            }),
            ..RoutingPolicy::default()
        },
        events: Default::default(),
    }
}

/// What the steady load saw: every reply's start time, status and serving replica.
#[derive(Default)]
pub struct Log {
    pub replies: Vec<(Instant, u16, Option<String>)>,
    pub errors: Vec<String>,
}

/// `clients` loops sending distinct prompts until `stop`.
pub fn steady_load(
    addr: SocketAddr,
    clients: usize,
    stop: Arc<AtomicBool>,
) -> (Arc<Mutex<Log>>, Vec<JoinHandle<()>>) {
    let log = Arc::new(Mutex::new(Log::default()));
    let tasks = (0..clients)
        .map(|c| {
            let (log, stop) = (log.clone(), stop.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::new();
                let mut i = 0usize;
                while !stop.load(Ordering::Relaxed) {
                    let body = completion(MODEL, &format!("client {c} request {i}: hello"));
                    let started = Instant::now();
                    match try_post(&http, addr, "/v1/completions", &body).await {
                        Ok(r) => log
                            .lock()
                            .unwrap()
                            .replies
                            .push((started, r.status, r.endpoint)),
                        Err(e) => log.lock().unwrap().errors.push(e.to_string()),
                    }
                    i += 1;
                }
            })
        })
        .collect();
    (log, tasks)
}

/// Polls until `f` holds (at most `WAIT`).
pub async fn poll_until(what: &str, mut f: impl FnMut() -> bool) {
    eventually(WAIT, || {
        let ok = f();
        async move { ok.then_some(()) }
    })
    .await
    .unwrap_or_else(|| panic!("{what}: not within {WAIT:?}"));
}

/// Entries in the pool's index that belong to no replica of the fleet (a leaver's).
pub fn orphan_entries(s: &ReplicasResponse) -> usize {
    let p = &s.pools[0];
    let held: usize = p
        .replicas
        .iter()
        .flat_map(|r| &r.workers)
        .map(|w| w.index_entries)
        .sum();
    p.index_entries.saturating_sub(held)
}
