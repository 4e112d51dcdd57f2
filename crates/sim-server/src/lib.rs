//! A vLLM replica stand-in: an HTTP + ZMQ shell around the pure `kinference-sim` engine.
//!
//! ```text
//!   HTTP handlers ──Command──▶ driver task (owns Engine, steps in scaled tokio time)
//!        ▲                          │ RequestOutput per token     │ KvEventBatch per step
//!        └──────────────────────────┘                             ▼
//!                                                   publisher (PUB live + ROUTER replay)
//! ```
//!
//! To a router it looks like a vLLM 0.32+ replica: the OpenAI endpoints, `/tokenize`,
//! `/metrics` with vLLM's names, `/kv_event_sources`, and the KV-event stream on the wire.
//! Invariants: one task owns the engine, so every command and step is serialised; events are
//! published in step order with sequence numbers from 0 and no gaps.

pub mod driver;
pub mod error;
pub mod http;
pub mod prom;
pub mod publisher;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use kinference_sim::{Engine, EngineConfig};
use kinference_tokenize::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use driver::Command;
pub use error::{ApiError, ServerError};
pub use publisher::{KvEventsConfig, PublisherEndpoints};

/// Everything a replica is started with.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The served model name (`--served-model-name`).
    pub model: String,
    pub engine: EngineConfig,
    /// A directory with `tokenizer.json` (and `tokenizer_config.json` for chat).
    pub tokenizer_dir: PathBuf,
    /// Simulated seconds per wall-clock second (1 = real time).
    pub speedup: f64,
    /// KV events on the wire; `None` publishes nothing.
    pub kv_events: Option<KvEventsConfig>,
}

/// A running replica.
#[derive(Debug)]
pub struct Server {
    pub addr: SocketAddr,
    pub endpoints: Option<PublisherEndpoints>,
    driver: mpsc::Sender<Command>,
    tasks: Vec<JoinHandle<()>>,
}

impl Server {
    /// Starts the engine, the publisher (if configured) and the HTTP server on `listener`.
    pub async fn start(cfg: ServerConfig, listener: TcpListener) -> Result<Server, ServerError> {
        let tokenizer = Tokenizer::from_dir(&cfg.tokenizer_dir)?;
        let engine = Engine::new(cfg.engine.clone())?;
        let mut tasks = Vec::new();
        let (events_tx, endpoints) = match &cfg.kv_events {
            Some(kv) => {
                let (tx, eps, t) = publisher::start(kv).await?;
                tasks.extend(t);
                (tx, Some(eps))
            }
            // Batches sent here are dropped with the receiver: events are off.
            None => (mpsc::unbounded_channel().0, None),
        };
        let (driver, handle) = driver::spawn(engine, cfg.speedup, driver::unix_now(), events_tx);
        tasks.push(handle);
        let e = &cfg.engine;
        let state = Arc::new(http::AppState {
            model: cfg.model.clone(),
            tokenizer,
            driver: driver.clone(),
            max_model_len: e.max_model_len,
            data_parallel_rank: e.data_parallel_rank.unwrap_or(0),
            cache: prom::CacheInfo {
                block_size: e.block_size,
                num_gpu_blocks: e.num_gpu_blocks,
                enable_prefix_caching: e.enable_prefix_caching,
                prefix_caching_hash_algo: e.hash_algo.as_str().to_owned(),
            },
            kv_events: cfg.kv_events.clone().zip(endpoints.clone()),
            next_id: AtomicU64::new(0),
        });
        let addr = listener.local_addr()?;
        let app = http::router(state);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "http server stopped");
            }
        }));
        Ok(Server {
            addr,
            endpoints,
            driver,
            tasks,
        })
    }

    /// Runs `f` on the engine between steps and returns its result (tests, debugging).
    pub async fn inspect<T, F>(&self, f: F) -> Option<T>
    where
        T: Send + 'static,
        F: FnOnce(&Engine) -> T + Send + 'static,
    {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let cmd = Command::Inspect(Box::new(move |e: &Engine| {
            let _ = tx.send(f(e));
        }));
        self.driver.send(cmd).await.ok()?;
        rx.await.ok()
    }

    /// Stops every task of this replica.
    pub fn shutdown(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}
