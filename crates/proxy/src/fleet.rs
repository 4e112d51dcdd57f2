//! The router's live view of its fleet: pools, replicas, DP-rank workers, their load and health,
//! and the guard that keeps the router's own in-flight counts exact.
//!
//! ```text
//!  Fleet ─┬─ Pool (tokenizer, hasher, Mutex<Policy>, index handle, EventPlane)
//!         │    └─ Replica (URL, health, scorable) ── WorkerLoad per DP rank (atomics)
//!         └─ watch<u64> "changed": bumped on load/health changes while anyone waits on it
//! ```
//!
//! Invariants:
//! * Load and health are atomics written by one scraper task per replica and by request
//!   guards; the request path reads them without a lock.
//! * Every increment of a worker's in-flight counters is made by [`InFlight::new`] and undone
//!   by its `Drop`, so the counts return to zero on every path: success, upstream error,
//!   timeout, client disconnect (the response body, which owns the guard, is dropped).
//! * The prefill part of a guard is released at most once: at the first response byte, or at
//!   drop if no byte came.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use kinference_events::{EventPlane, EventPlaneConfig, ReplicaConfig, WorkerConfig};
use kinference_index::{Index, ReplicaId, WorkerId};
use kinference_policy::{Load, Policy};
use kinference_tokenize::{Tokenizer, TokenizerOptions};
use kinference_vllm::{BlockHasher, DpRank, Lora};
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::api::{CacheConfigStatus, Health, LoadStatus};
use crate::config::{
    Config, Endpoint, EventSource, PoolConfig, ReplicaSpec, Resolved, ResolvedPool,
    ResolvedReplica, Timeouts,
};
use crate::error::{RequestError, StartError};
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// Settings the request path reads.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub timeouts: Timeouts,
    pub max_body_bytes: usize,
    pub max_attempts: u32,
    pub expose_endpoint_header: bool,
    pub scrape_interval: Option<Duration>,
    pub scrape_timeout: Duration,
}

/// Everything the handlers share.
#[derive(Debug)]
pub(crate) struct Fleet {
    pub pools: Vec<Arc<Pool>>,
    /// `model` → (pool index, LoRA adapter when the name is one).
    models: HashMap<String, (usize, Option<Lora>)>,
    started: tokio::time::Instant,
    pub changed: Arc<watch::Sender<u64>>,
    pub metrics: Metrics,
    pub upstream: Upstream,
    pub settings: Settings,
}

impl Fleet {
    /// Time since start on tokio's clock: the policies' time axis.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// The pool serving `model` (the first pool when the request names none).
    pub fn lookup(&self, model: Option<&str>) -> Result<(&Arc<Pool>, Option<&Lora>), RequestError> {
        match model {
            None => self
                .pools
                .first()
                .map(|p| (p, None))
                .ok_or_else(|| RequestError::UnknownModel(String::new())),
            Some(m) => {
                let (i, lora) = self
                    .models
                    .get(m)
                    .ok_or_else(|| RequestError::UnknownModel(m.to_owned()))?;
                let pool = self
                    .pools
                    .get(*i)
                    .ok_or_else(|| RequestError::UnknownModel(m.to_owned()))?;
                Ok((pool, lora.as_ref()))
            }
        }
    }

    /// Tells waiters ([`crate::Proxy::wait_until`]) that the state changed.
    pub fn bump(&self) {
        bump(&self.changed);
    }

    /// Router-wide in-flight requests.
    pub fn in_flight(&self) -> u64 {
        self.pools
            .iter()
            .flat_map(|p| p.replicas.iter())
            .flat_map(|r| r.workers.iter())
            .map(|w| u64::from(w.in_flight.load(Ordering::Relaxed)))
            .sum()
    }
}

/// Bumps the generation only while someone waits on it: the request path calls this three
/// times per request, and nothing but tests and tools wait.
fn bump(changed: &watch::Sender<u64>) {
    if changed.receiver_count() > 0 {
        changed.send_modify(|g| *g = g.wrapping_add(1));
    }
}

/// One pool: interchangeable replicas with one tokenizer and one hash space.
#[derive(Debug)]
pub(crate) struct Pool {
    pub name: String,
    pub models: Vec<String>,
    pub tokenizer: Tokenizer,
    pub hasher: BlockHasher,
    pub block_size: u32,
    pub policy: Mutex<Policy>,
    pub policy_name: &'static str,
    pub uses_index: bool,
    pub session_header: Option<HeaderName>,
    pub index: Arc<RwLock<Index>>,
    /// Taken out at shutdown.
    plane: Mutex<Option<Arc<EventPlane>>>,
    pub replicas: Vec<Arc<Replica>>,
    tickets: AtomicU64,
}

impl Pool {
    pub fn plane(&self) -> Option<Arc<EventPlane>> {
        self.plane.lock().clone()
    }

    pub fn take_plane(&self) -> Option<Arc<EventPlane>> {
        self.plane.lock().take()
    }

    pub fn ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed)
    }

    /// The ticket the next request will take.
    pub fn peek_ticket(&self) -> u64 {
        self.tickets.load(Ordering::Relaxed)
    }

    pub fn replica(&self, id: ReplicaId) -> Option<&Arc<Replica>> {
        self.replicas.iter().find(|r| r.id == id)
    }

    /// (entries, distinct blocks) in the index.
    pub fn index_size(&self) -> (usize, usize) {
        let idx = self.index.read();
        (idx.len(), idx.distinct_blocks())
    }

    pub fn tracked_entries(&self) -> usize {
        self.policy.lock().tracked_entries()
    }
}

/// Health as stored in an atomic.
const UNKNOWN: u8 = 0;
const UP: u8 = 1;
const DOWN: u8 = 2;

/// Scraped and observed facts about a replica that are not on the request path.
#[derive(Debug, Default)]
pub(crate) struct ReplicaInfo {
    pub last_error: Option<String>,
    pub unscorable_reason: Option<String>,
    pub cache_config: Option<CacheConfigStatus>,
    pub events_error: Option<String>,
    pub prefix_cache_hits: Option<f64>,
    pub prefix_cache_queries: Option<f64>,
}

/// One vLLM API server with `workers.len()` DP ranks.
#[derive(Debug)]
pub(crate) struct Replica {
    pub id: ReplicaId,
    pub endpoint: Endpoint,
    pub workers: Vec<WorkerLoad>,
    pub events_mode: &'static str,
    /// The event spec's topic, for discovery.
    pub topic: String,
    health: AtomicU8,
    scorable: AtomicBool,
    pub info: Mutex<ReplicaInfo>,
}

impl Replica {
    fn new(id: ReplicaId, spec: &ReplicaSpec, resolved: &ResolvedReplica) -> Self {
        let events_mode = match &resolved.events {
            None => "none",
            Some(EventSource::Connect(_)) => "connect",
            Some(EventSource::Bind(_)) => "bind",
            Some(EventSource::Discover) => "discover",
        };
        Replica {
            id,
            endpoint: resolved.endpoint.clone(),
            workers: (0..spec.dp_ranks).map(|_| WorkerLoad::default()).collect(),
            events_mode,
            topic: spec
                .events
                .as_ref()
                .map(|e| e.topic.clone())
                .unwrap_or_default(),
            health: AtomicU8::new(UNKNOWN),
            scorable: AtomicBool::new(true),
            info: Mutex::new(ReplicaInfo::default()),
        }
    }

    /// The base URL, as configured (without a trailing `/`).
    pub fn url(&self) -> &str {
        &self.endpoint.url
    }

    pub fn worker(&self, rank: usize) -> WorkerId {
        WorkerId::new(self.id, DpRank(rank as u32))
    }

    pub fn dp_size(&self) -> usize {
        self.workers.len()
    }

    pub fn health(&self) -> Health {
        match self.health.load(Ordering::Relaxed) {
            UP => Health::Up,
            DOWN => Health::Down,
            _ => Health::Unknown,
        }
    }

    pub fn set_up(&self) {
        self.health.store(UP, Ordering::Relaxed);
    }

    /// Marks the replica down; returns whether it was not down before.
    pub fn set_down(&self, error: String) -> bool {
        let was = self.health.swap(DOWN, Ordering::Relaxed);
        self.info.lock().last_error = Some(error);
        was != DOWN
    }

    pub fn is_scorable(&self) -> bool {
        self.scorable.load(Ordering::Relaxed)
    }

    /// Records why the replica's hashes cannot be reproduced (`None`: they can); returns
    /// whether scorability changed.
    pub fn set_unscorable(&self, reason: Option<String>) -> bool {
        let ok = reason.is_none();
        self.info.lock().unscorable_reason = reason;
        self.scorable.swap(ok, Ordering::Relaxed) != ok
    }
}

/// One DP rank's load: scraped gauges plus the router's own counts.
#[derive(Debug, Default)]
pub(crate) struct WorkerLoad {
    pub running: AtomicU32,
    pub waiting: AtomicU32,
    /// `f64` bits.
    pub kv_usage: AtomicU64,
    pub in_flight: AtomicU32,
    pub prefill: AtomicU64,
}

impl WorkerLoad {
    pub fn load(&self) -> Load {
        Load {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_usage: f64::from_bits(self.kv_usage.load(Ordering::Relaxed)),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            in_flight_prefill_tokens: self.prefill.load(Ordering::Relaxed),
        }
    }

    pub fn snapshot(&self) -> LoadStatus {
        let l = self.load();
        LoadStatus {
            running: l.running,
            waiting: l.waiting,
            kv_usage: l.kv_usage,
            in_flight: l.in_flight,
            in_flight_prefill_tokens: l.in_flight_prefill_tokens,
        }
    }

    pub fn set_scraped(&self, running: u32, waiting: u32, kv_usage: f64) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.kv_usage.store(kv_usage.to_bits(), Ordering::Relaxed);
    }
}

/// One request's claim on a worker. Dropping it releases the claim.
#[derive(Debug)]
pub(crate) struct InFlight {
    replica: Arc<Replica>,
    rank: usize,
    prefill: u64,
    changed: Arc<watch::Sender<u64>>,
}

impl InFlight {
    pub fn new(
        replica: Arc<Replica>,
        rank: usize,
        prefill: u64,
        changed: Arc<watch::Sender<u64>>,
    ) -> Self {
        if let Some(w) = replica.workers.get(rank) {
            w.in_flight.fetch_add(1, Ordering::Relaxed);
            w.prefill.fetch_add(prefill, Ordering::Relaxed);
        }
        bump(&changed);
        InFlight {
            replica,
            rank,
            prefill,
            changed,
        }
    }

    /// The first response byte arrived: the prompt is prefilled.
    pub fn release_prefill(&mut self) {
        if self.prefill > 0 {
            if let Some(w) = self.replica.workers.get(self.rank) {
                w.prefill.fetch_sub(self.prefill, Ordering::Relaxed);
            }
            self.prefill = 0;
            bump(&self.changed);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(w) = self.replica.workers.get(self.rank) {
            if self.prefill > 0 {
                w.prefill.fetch_sub(self.prefill, Ordering::Relaxed);
            }
            w.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        bump(&self.changed);
    }
}

/// A replica whose event endpoints must be discovered once the fleet runs.
#[derive(Debug)]
pub(crate) struct Discovery {
    pub pool: usize,
    pub replica: Arc<Replica>,
}

/// Builds the fleet from a configuration and its resolved values: loads tokenizers, starts one
/// event plane per pool, and subscribes to every explicitly configured event stream.
pub(crate) async fn build(
    cfg: &Config,
    resolved: Resolved,
    metrics: Metrics,
    upstream: Upstream,
) -> Result<(Fleet, Vec<Discovery>), StartError> {
    let mut pools = Vec::new();
    let mut models = HashMap::new();
    let mut discoveries = Vec::new();
    let mut next_id = 0u32;
    for (pi, (pc, rp)) in cfg.pools.iter().zip(resolved.pools).enumerate() {
        for m in &pc.models {
            models.insert(m.clone(), (pi, None));
        }
        for (n, path) in &pc.lora_adapters {
            let lora = Lora {
                name: n.clone(),
                path: path.clone(),
            };
            models.insert(n.clone(), (pi, Some(lora)));
        }
        let pool = build_pool(pc, rp, &mut next_id).await?;
        discoveries.extend(
            pool.discover
                .into_iter()
                .map(|replica| Discovery { pool: pi, replica }),
        );
        pools.push(Arc::new(pool.pool));
    }
    let (changed, _) = watch::channel(0u64);
    let settings = Settings {
        timeouts: cfg.timeouts.clone(),
        max_body_bytes: cfg.limits.max_body_bytes,
        max_attempts: cfg.limits.max_attempts,
        expose_endpoint_header: cfg.expose_endpoint_header,
        scrape_interval: (cfg.scrape.interval_ms > 0)
            .then(|| Duration::from_millis(cfg.scrape.interval_ms)),
        scrape_timeout: Duration::from_millis(cfg.scrape.timeout_ms.max(1)),
    };
    let fleet = Fleet {
        pools,
        models,
        started: tokio::time::Instant::now(),
        changed: Arc::new(changed),
        metrics,
        upstream,
        settings,
    };
    Ok((fleet, discoveries))
}

/// A pool and the replicas of it whose event endpoints are to be discovered.
struct Built {
    pool: Pool,
    discover: Vec<Arc<Replica>>,
}

async fn build_pool(
    pc: &PoolConfig,
    rp: ResolvedPool,
    next_id: &mut u32,
) -> Result<Built, StartError> {
    let name = pc.display_name();
    let options = TokenizerOptions {
        cache_capacity_bytes: pc.tokenizer_cache_bytes,
        ..TokenizerOptions::default()
    };
    let tokenizer = Tokenizer::from_dir_with(&pc.tokenizer, options).map_err(|source| {
        StartError::Tokenizer {
            pool: name.clone(),
            dir: pc.tokenizer.display().to_string(),
            source,
        }
    })?;
    let events_error = |source| StartError::Events {
        pool: name.clone(),
        source,
    };
    let plane = EventPlane::start(EventPlaneConfig::default()).map_err(events_error)?;
    let mut replicas = Vec::with_capacity(rp.replicas.len());
    let mut discover = Vec::new();
    for (spec, rr) in pc.replicas.iter().zip(rp.replicas) {
        let id = ReplicaId(*next_id);
        *next_id += 1;
        let replica = Arc::new(Replica::new(id, spec, &rr));
        let base = match &rr.events {
            None => None,
            Some(EventSource::Discover) => {
                discover.push(replica.clone());
                None
            }
            Some(EventSource::Connect(a)) => Some(WorkerConfig::connect(id, DpRank(0), a)),
            Some(EventSource::Bind(a)) => Some(WorkerConfig::bind(id, DpRank(0), a)),
        };
        if let Some(base) = base {
            let mut base = base.with_topic(&replica.topic);
            if let Some(rep) = spec.events.as_ref().and_then(|e| e.replay.as_deref()) {
                base = base.with_replay(rep);
            }
            let rcfg = ReplicaConfig {
                base,
                dp_size: spec.dp_ranks,
            };
            plane.add_replica(rcfg).await.map_err(events_error)?;
        }
        replicas.push(replica);
    }
    let policy = Policy::new(pc.policy.clone());
    let pool = Pool {
        name: name.clone(),
        models: pc
            .models
            .iter()
            .chain(pc.lora_adapters.keys())
            .cloned()
            .collect(),
        tokenizer,
        hasher: rp.hasher,
        block_size: pc.block_size,
        policy_name: policy.name(),
        uses_index: policy.uses_index(),
        policy: Mutex::new(policy),
        session_header: rp.session_header,
        index: plane.index(),
        plane: Mutex::new(Some(Arc::new(plane))),
        replicas,
        tickets: AtomicU64::new(0),
    };
    Ok(Built { pool, discover })
}
