//! A vLLM replica stand-in: an HTTP + ZMQ shell around the pure `kinference-sim` engine.
//!
//! ```text
//!                      ┌─▶ driver task, DP rank 0 (owns an Engine) ─▶ publisher (PUB + ROUTER)
//!   HTTP handlers ─────┼─▶ driver task, DP rank 1 (owns an Engine) ─▶ publisher (port + 1)
//!   (rank: header or   └─▶ ...
//!    least outstanding)     ▲ RequestOutput per token, back to the waiting handler
//! ```
//!
//! To a router it looks like a vLLM 0.32+ replica: the OpenAI endpoints (with `n`, stop
//! strings, logprobs, LoRA adapters and `cache_salt`), `/tokenize`, `/metrics` with vLLM's
//! names, `/kv_event_sources`, and the KV-event stream on the wire (plus `/debug/cache`, the
//! simulator's own: each rank's cached blocks and published batches, for harnesses). With
//! `data_parallel_size` D it is one API server in front of D engines, as vLLM's internal
//! load balancing runs them: each rank has its own engine, publisher (endpoint port + rank)
//! and `engine` metric label, and `X-data-parallel-rank` picks one.
//! The HTTP server speaks HTTP/1.1 and HTTP/2 with prior knowledge (h2c, as a pool with
//! `appProtocol: kubernetes.io/h2c` is reached); [`Server::http2_requests`] counts the latter.
//! Invariants: one task owns each engine, so its commands and steps are serialised; each
//! rank's events are published in step order with sequence numbers from 0 and no gaps.
//! [`cli`] turns command-line flags into [`ServerConfig`]s (one per replica).

pub mod cli;
pub mod driver;
pub mod error;
pub mod http;
pub mod prom;
pub mod publisher;
pub mod text;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;

use axum::serve::ListenerExt;
use kinference_sim::{Engine, EngineConfig};
use kinference_tokenize::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

pub use driver::Command;
pub use error::{ApiError, ServerError};
pub use publisher::{EventFaults, KvEventsConfig, PublisherEndpoints};

/// A LoRA adapter served under its own model name (vLLM's `--lora-modules name=path`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// The model name requests use to select it (and the `lora_name` in events).
    pub name: String,
    /// The adapter's path: part of every block hash, listed as `root` in `/v1/models`.
    pub path: String,
    /// Listed as `parent` in `/v1/models`; the served model name when `None`.
    pub base_model_name: Option<String>,
}

/// Everything a replica is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The served model name (`--served-model-name`).
    pub model: String,
    /// The engine of the first DP rank; rank r gets the same with `data_parallel_rank` + r.
    pub engine: EngineConfig,
    /// A directory with `tokenizer.json` (and `tokenizer_config.json` for chat).
    pub tokenizer_dir: PathBuf,
    /// Simulated seconds per wall-clock second (1 = real time).
    pub speedup: f64,
    /// KV events on the wire, for the first rank (rank r offsets both ports by r);
    /// `None` publishes nothing.
    pub kv_events: Option<KvEventsConfig>,
    /// Engines behind this API server (`--data-parallel-size`), at least 1.
    pub data_parallel_size: usize,
    /// Adapters, given LoRA ids 1, 2, ... in this order as vLLM numbers them.
    pub lora_modules: Vec<LoraModule>,
}

impl ServerConfig {
    /// A single-rank replica without events or adapters.
    pub fn new(model: &str, engine: EngineConfig, tokenizer_dir: PathBuf, speedup: f64) -> Self {
        ServerConfig {
            model: model.to_owned(),
            engine,
            tokenizer_dir,
            speedup,
            kv_events: None,
            data_parallel_size: 1,
            lora_modules: Vec::new(),
        }
    }
}

/// One DP rank of a running replica.
#[derive(Debug)]
struct RankHandle {
    rank: i64,
    driver: mpsc::Sender<Command>,
    progress: watch::Receiver<u64>,
    endpoints: Option<PublisherEndpoints>,
    events: Option<RankEvents>,
    published: Option<watch::Receiver<u64>>,
}

/// Where one DP rank's KV events go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEvents {
    /// The bound PUB endpoint (ephemeral ports resolved), or the endpoint the PUB connects to.
    pub events: String,
    /// Whether the PUB bound `events` (else it connects there and the subscriber binds).
    pub binds: bool,
    pub replay: Option<String>,
}

/// A running replica.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    /// The first rank's event endpoints (see [`Server::rank_endpoints`] for the others).
    pub endpoints: Option<PublisherEndpoints>,
    ranks: Vec<RankHandle>,
    tasks: Vec<JoinHandle<()>>,
    http2_requests: Arc<AtomicU64>,
}

impl Server {
    /// Starts the engines, their publishers (if configured) and the HTTP server on `listener`.
    pub async fn start(cfg: ServerConfig, listener: TcpListener) -> Result<Server, ServerError> {
        let tokenizer = Arc::new(Tokenizer::from_dir(&cfg.tokenizer_dir)?);
        Server::start_with_tokenizer(cfg, listener, tokenizer).await
    }

    /// [`Server::start`] with a tokenizer already loaded from `cfg.tokenizer_dir`, shared with
    /// other replicas of the process: a tokenizer is read-only apart from its prefix cache,
    /// whose results equal a full encode whoever filled it, so one per process serves every
    /// replica (instead of a vocabulary and a cache per replica).
    pub async fn start_with_tokenizer(
        cfg: ServerConfig,
        listener: TcpListener,
        tokenizer: Arc<Tokenizer>,
    ) -> Result<Server, ServerError> {
        if cfg.data_parallel_size == 0 {
            return Err(ServerError::Config(
                "data_parallel_size must be at least 1".into(),
            ));
        }
        let first_rank = cfg.engine.data_parallel_rank.unwrap_or(0);
        let mut tasks = Vec::new();
        let mut ranks = Vec::new();
        let mut states = Vec::new();
        for i in 0..cfg.data_parallel_size {
            let rank = first_rank + i64::try_from(i).unwrap_or(i64::MAX);
            let mut engine_cfg = cfg.engine.clone();
            engine_cfg.data_parallel_rank = Some(rank);
            let engine = Engine::new(engine_cfg)?;
            let mut published = None;
            let (events_tx, endpoints, kv): (_, _, Option<(KvEventsConfig, _)>) =
                match &cfg.kv_events {
                    Some(kv) => {
                        // vLLM offsets by the global rank, so a process started at rank R with
                        // base port P publishes rank R on P + R.
                        let by = u16::try_from(rank).map_err(|_| {
                            ServerError::Config(format!("DP rank {rank} cannot offset a port"))
                        })?;
                        let kv = kv.offset(by)?;
                        let p = publisher::start(&kv).await?;
                        tasks.extend(p.tasks);
                        published = Some(p.published);
                        (
                            Some(p.batches),
                            Some(p.endpoints.clone()),
                            Some((kv, p.endpoints)),
                        )
                    }
                    None => (None, None, None),
                };
            let d = driver::spawn(engine, cfg.speedup, driver::unix_now(), events_tx);
            tasks.push(d.task);
            states.push(http::RankState {
                rank,
                driver: d.commands.clone(),
                outstanding: AtomicUsize::new(0),
                kv_events: kv.clone(),
                published: published.clone(),
            });
            let events = kv.as_ref().map(|(c, eps)| RankEvents {
                events: eps.events.clone().unwrap_or_else(|| c.endpoint.clone()),
                binds: eps.events.is_some(),
                replay: eps.replay.clone(),
            });
            ranks.push(RankHandle {
                rank,
                driver: d.commands,
                progress: d.progress,
                endpoints,
                events,
                published,
            });
        }
        let e = &cfg.engine;
        let loras = cfg
            .lora_modules
            .iter()
            .enumerate()
            .map(|(i, m)| http::LoraAdapter {
                name: m.name.clone(),
                path: m.path.clone(),
                parent: m
                    .base_model_name
                    .clone()
                    .unwrap_or_else(|| cfg.model.clone()),
                id: i64::try_from(i).unwrap_or(i64::MAX).saturating_add(1),
            })
            .collect();
        let state = Arc::new(http::AppState {
            model: cfg.model.clone(),
            loras,
            tokenizer,
            max_model_len: e.max_model_len,
            cache: prom::CacheInfo {
                block_size: e.block_size,
                num_gpu_blocks: e.num_gpu_blocks,
                enable_prefix_caching: e.enable_prefix_caching,
                prefix_caching_hash_algo: e.hash_algo.as_str().to_owned(),
            },
            ranks: states,
            next_id: AtomicU64::new(0),
            id_key: std::collections::hash_map::RandomState::new(),
        });
        let addr = listener.local_addr()?;
        let http2_requests = Arc::new(AtomicU64::new(0));
        let counter = http2_requests.clone();
        let app = http::router(state).layer(axum::middleware::map_request(
            move |req: axum::extract::Request| {
                if req.version() == axum::http::Version::HTTP_2 {
                    counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                std::future::ready(req)
            },
        ));
        tasks.push(tokio::spawn(async move {
            // Like uvicorn on asyncio (vLLM's server): every SSE event leaves at once instead of
            // waiting out Nagle against the client's delayed ACK (~40 ms per streamed request).
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY on an accepted socket failed");
                }
            });
            // Routes made into services once here: handed a `Router` itself, `axum::serve`
            // rebuilds its route table for every accepted connection (`with_state(())`), a
            // cost a replica pays per connection the router opens to it.
            let app: axum::Router = app.with_state(());
            if let Err(e) = axum::serve(listener, app.into_make_service()).await {
                tracing::error!(error = %e, "http server stopped");
            }
        }));
        Ok(Server {
            addr,
            endpoints: ranks.first().and_then(|r| r.endpoints.clone()),
            ranks,
            tasks,
            http2_requests,
        })
    }

    /// Requests that came over HTTP/2 (h2c) since start.
    pub fn http2_requests(&self) -> u64 {
        self.http2_requests
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The DP ranks this replica serves, in order.
    pub fn ranks(&self) -> Vec<i64> {
        self.ranks.iter().map(|r| r.rank).collect()
    }

    /// The event endpoints of each DP rank (index = position in [`Server::ranks`]).
    pub fn rank_endpoints(&self) -> Vec<Option<PublisherEndpoints>> {
        self.ranks.iter().map(|r| r.endpoints.clone()).collect()
    }

    /// Each DP rank's event endpoints, `None` for a rank without events.
    pub fn event_endpoints(&self) -> Vec<Option<RankEvents>> {
        self.ranks.iter().map(|r| r.events.clone()).collect()
    }

    /// Runs `f` on the first rank's engine between steps (tests, debugging).
    pub async fn inspect<T, F>(&self, f: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce(&Engine) -> T + Send + 'static,
    {
        self.inspect_rank(0, f).await
    }

    /// Runs `f` on the engine at position `index` of [`Server::ranks`] between steps; `None`
    /// if there is no such rank or its driver stopped.
    pub async fn inspect_rank<T, F>(&self, index: usize, f: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce(&Engine) -> T + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cmd = Command::Inspect(Box::new(move |e: &Engine| {
            let _ = tx.send(f(e));
        }));
        self.ranks.get(index)?.driver.send(cmd).await.ok()?;
        rx.await.ok()
    }

    /// Waits until `pred` holds on the engine at position `index`, checking it after every
    /// step and every change: no polling, no sleeping. `false` if the driver stopped first.
    pub async fn wait_until<F>(&self, index: usize, pred: F) -> bool
    where
        F: Fn(&Engine) -> bool + Clone + Send + 'static,
    {
        let Some(rank) = self.ranks.get(index) else {
            return false;
        };
        let mut progress = rank.progress.clone();
        loop {
            // Mark the current tick seen before looking, so a change made after the look
            // wakes the wait below.
            progress.borrow_and_update();
            let p = pred.clone();
            match self.inspect_rank(index, move |e| p(e)).await {
                Some(true) => return true,
                Some(false) => {}
                None => return false,
            }
            if progress.changed().await.is_err() {
                return false;
            }
        }
    }

    /// Waits until the publisher of the rank at position `index` has published (buffered for
    /// replay and sent) every batch of the steps its engine ran so far. `false` if the rank
    /// has no events or stopped.
    pub async fn events_published(&self, index: usize) -> bool {
        let Some(rank) = self.ranks.get(index) else {
            return false;
        };
        let Some(mut published) = rank.published.clone() else {
            return false;
        };
        let (tx, rx) = tokio::sync::oneshot::channel();
        if rank.driver.send(Command::BatchesSent(tx)).await.is_err() {
            return false;
        }
        let Ok(sent) = rx.await else {
            return false;
        };
        let reached = published.wait_for(|n| *n >= sent).await.is_ok();
        reached
    }

    /// Stops every task of this replica.
    pub fn shutdown(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}
