//! The router's live view of its fleet: pools, replicas, DP-rank workers, their load and health,
//! and the guard that keeps the router's own in-flight counts exact.
//!
//! ```text
//!  Fleet ─┬─ Pool (Rules: tokenizer, hasher, Mutex<Policy>; index handle, EventPlane)
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
//! * A pool's replica set is an immutable `Vec` swapped whole (configured once, or changed by
//!   discovery through `members`): a leaver is out of the set before its index entries are
//!   cleared, and requests already routed to it hold their own `Arc` and finish. Replica ids
//!   are never reused.
//! * A pool's [`Rules`] (tokenizer, hashing, policy, session header) are one immutable value
//!   swapped whole ([`Pool::set_rules`]): a request takes them once and tokenizes, hashes,
//!   scores and records its speculative entries with the same set, even when they are replaced
//!   meanwhile.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use kinference_events::{EventPlane, EventPlaneConfig, ReplicaConfig, WorkerConfig};
use kinference_index::{Index, ReplicaId, WorkerId};
use kinference_policy::{Load, Policy, Shadow, UniqueHits, CAPACITY_UNKNOWN};
use kinference_tokenize::{Tokenizer, TokenizerOptions};
use kinference_vllm::{BlockHash, BlockHasher, DpRank, Lora};
use parking_lot::{Mutex, RwLock};
use tokio::sync::{watch, Notify};

use crate::api::{CacheConfigStatus, Health, LoadStatus, ScrapeCounts};
use crate::config::{
    Config, Endpoint, EventSource, InferencePoolRef, Limits, PoolConfig, ReplicaSpec, Resolved,
    ResolvedPool, ResolvedReplica, Timeouts,
};
use crate::error::{RequestError, StartError};
use crate::limits::{Gate, QueueLabel};
use crate::metrics::{Metrics, ReplicaSeries};
use crate::savings::{BaselineGuess, Saved, SavingsModel};
use crate::upstream::Upstream;
use crate::warm::Warmer;

/// Settings the request path reads.
#[derive(Clone, Debug)]
pub(crate) struct Settings {
    pub timeouts: Timeouts,
    pub limits: Limits,
    pub max_body_bytes: usize,
    pub max_attempts: u32,
    pub expose_endpoint_header: bool,
    pub scrape_interval: Option<Duration>,
    /// Longest wait between scrapes of a quiet replica (never below `scrape_interval`).
    pub scrape_idle_interval: Duration,
    pub scrape_timeout: Duration,
}

/// Everything the handlers share.
#[derive(Debug)]
pub(crate) struct Fleet {
    pub pools: Vec<Arc<Pool>>,
    /// `model` → (pool index, LoRA adapter when the name is one).
    models: HashMap<String, (usize, Option<Lora>), ahash::RandomState>,
    started: tokio::time::Instant,
    pub changed: Arc<watch::Sender<u64>>,
    pub metrics: Metrics,
    pub upstream: Upstream,
    pub settings: Settings,
    /// The next [`ReplicaId`] to hand out: ids are never reused, so that a leaver's index
    /// entries and policy records can never be mistaken for a joiner's.
    next_id: AtomicU32,
}

impl Fleet {
    /// Time since start on tokio's clock: the policies' time axis.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// A routed response of `pool` whose replica reported `actual` of its `prompt_tokens`
    /// served from cache, where the policy predicted `predicted` and the baselines guessed
    /// `baselines`.
    pub fn record_usage(
        &self,
        pool: &str,
        prompt_tokens: u32,
        predicted: u32,
        actual: u64,
        baselines: &[BaselineGuess],
    ) {
        let Some(p) = self.pools.iter().find(|p| p.name == pool) else {
            return;
        };
        let saved_with = p.savings.saved_for(prompt_tokens);
        let saved = saved_with(actual);
        let guesses: Vec<(&'static str, Saved)> = baselines
            .iter()
            .map(|b| (b.policy, saved_with(u64::from(b.cached_tokens))))
            .collect();
        self.metrics
            .record_usage(pool, prompt_tokens, predicted, actual, saved, &guesses);
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

    /// Router-wide in-flight requests (to replicas still in the fleet).
    pub fn in_flight(&self) -> u64 {
        self.pools
            .iter()
            .flat_map(|p| p.replicas().iter().cloned().collect::<Vec<_>>())
            .flat_map(|r| {
                r.workers
                    .iter()
                    .map(|w| u64::from(w.in_flight.load(Ordering::Relaxed)))
                    .collect::<Vec<_>>()
            })
            .sum()
    }

    /// A fresh replica id.
    pub fn new_replica_id(&self) -> ReplicaId {
        ReplicaId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Removes the metric series of replicas no longer in any pool (left, or changed address).
    /// A request still running on a leaver may write its series again when it ends; the next
    /// call removes them, so churn never grows `/metrics` without bound.
    pub fn forget_left_replicas(&self) -> usize {
        let live: std::collections::HashSet<String> = self
            .pools
            .iter()
            .flat_map(|p| {
                p.replicas()
                    .iter()
                    .map(|r| r.url().to_owned())
                    .collect::<Vec<_>>()
            })
            .collect();
        self.metrics.forget_replicas(&|url| live.contains(url))
    }

    /// The position of `pool` in [`Fleet::pools`].
    pub fn pool_index(&self, pool: &Pool) -> Option<usize> {
        self.pools.iter().position(|p| std::ptr::eq(&**p, pool))
    }
}

/// Bumps the generation only while someone waits on it: the request path calls this three
/// times per request, and nothing but tests and tools wait.
fn bump(changed: &watch::Sender<u64>) {
    if changed.receiver_count() > 0 {
        changed.send_modify(|g| *g = g.wrapping_add(1));
    }
}

/// `id`'s replica in `replicas`, which is sorted by id (as [`Pool::replicas`] is): a decision
/// ranks every candidate, so at a thousand replicas a linear search per target was a million
/// comparisons per request.
pub(crate) fn find_replica(replicas: &[Arc<Replica>], id: ReplicaId) -> Option<&Arc<Replica>> {
    replicas
        .binary_search_by_key(&id, |r| r.id)
        .ok()
        .and_then(|i| replicas.get(i))
}

/// One pool: interchangeable replicas with one tokenizer and one hash space.
#[derive(Debug)]
pub(crate) struct Pool {
    pub name: String,
    pub models: Vec<String>,
    /// How requests are tokenized, hashed and placed; replaced whole, see [`Rules`].
    rules: RwLock<Arc<Rules>>,
    pub index: Arc<RwLock<Index>>,
    /// At most `limits.max_in_flight` of the pool's requests are forwarded at once.
    pub gate: Gate,
    /// `limits.max_in_flight_per_replica`: requests in flight per worker (DP rank) before it
    /// is passed over; 0: no limit.
    pub worker_cap: u32,
    /// With a `worker_cap`: signalled once per in-flight request that ends on one of the
    /// pool's replicas (and when replicas join), waking the first request waiting for room.
    pub room: Option<Arc<Notify>>,
    /// Taken out at shutdown.
    plane: Mutex<Option<Arc<EventPlane>>>,
    /// The replicas requests may go to. Replaced as a whole when the fleet changes, so the
    /// request path reads it with one short read lock and an `Arc` clone, and a request keeps
    /// the set it was routed with.
    replicas: RwLock<Arc<Vec<Arc<Replica>>>>,
    /// Where a discovered pool's replicas come from; `None` for a configured list.
    pub source: Option<InferencePoolRef>,
    /// A discovered pool's members by key (pod name), with their background tasks.
    pub members: Mutex<BTreeMap<String, Member>>,
    /// Why the pool's replicas cannot be read now (a discovered pool only).
    pub discovery: Mutex<DiscoveryState>,
    tickets: AtomicU64,
    /// What a cache hit on this pool's replicas saves (`savings_profile`).
    pub savings: SavingsModel,
    /// Prompt tokens of the requests the policy placed and a replica took, and of those the
    /// tokens the policy expected the chosen replica to have cached (the predicted hit rate).
    routed_prompt_tokens: AtomicU64,
    predicted_cached_tokens: AtomicU64,
    /// Hot-prefix warming's cooldowns and warms in flight (`warm`).
    pub warmer: Warmer,
}

/// How a pool's requests are tokenized, hashed and placed: the settings a discovered pool's
/// declared configuration (a `KinferencePool`) may change while the router runs.
#[derive(Debug)]
pub(crate) struct Rules {
    /// The settings these were built from (the pool's whole configuration).
    pub config: PoolConfig,
    pub tokenizer: Arc<Tokenizer>,
    pub hasher: BlockHasher,
    pub block_size: u32,
    /// Shared with the next rules when neither the policy's settings nor the hashing change,
    /// so that its records (speculative entries, the approximate policy's view) carry over.
    pub policy: Arc<Mutex<Policy>>,
    /// The baselines the savings are compared with (`baselines`), each with its own picture of
    /// the caches; carried over like `policy` when the hashing and the list stay the same.
    pub shadows: Arc<Mutex<Vec<Shadow>>>,
    pub policy_name: &'static str,
    pub uses_index: bool,
    pub session_header: Option<HeaderName>,
}

impl Rules {
    /// Rules for `pc`, reusing `previous`'s tokenizer when its directory and cache size are
    /// the same and its policy when the policy's settings, the tokenizer and the hashing are.
    /// Loading a tokenizer reads and parses files: call from a blocking context.
    pub fn build(
        pc: &PoolConfig,
        hasher: BlockHasher,
        session_header: Option<HeaderName>,
        previous: Option<&Rules>,
    ) -> Result<Rules, kinference_tokenize::TokenizeError> {
        let same_tokenizer = previous.filter(|p| {
            p.config.tokenizer == pc.tokenizer
                && p.config.tokenizer_cache_bytes == pc.tokenizer_cache_bytes
        });
        let tokenizer = match same_tokenizer {
            Some(p) => p.tokenizer.clone(),
            None => {
                let options = TokenizerOptions {
                    cache_capacity_bytes: pc.tokenizer_cache_bytes,
                    ..TokenizerOptions::default()
                };
                Arc::new(Tokenizer::from_dir_with(&pc.tokenizer, options)?)
            }
        };
        let same_hashing = same_tokenizer.filter(|p| {
            p.block_size == pc.block_size
                && p.hasher.algo() == hasher.algo()
                && p.hasher.seed() == hasher.seed()
                && p.config.extra_keys_format == pc.extra_keys_format
        });
        let policy = match same_hashing.filter(|p| p.config.policy == pc.policy) {
            Some(p) => p.policy.clone(),
            None => Arc::new(Mutex::new(Policy::new(pc.policy.clone()))),
        };
        let shadows = match same_hashing.filter(|p| p.config.baselines == pc.baselines) {
            Some(p) => p.shadows.clone(),
            // The names were checked with the configuration; one that fails here is left out.
            None => Arc::new(Mutex::new(
                pc.baselines
                    .iter()
                    .filter_map(|b| Shadow::new(b, CAPACITY_UNKNOWN).ok())
                    .collect(),
            )),
        };
        let (policy_name, uses_index) = {
            let p = policy.lock();
            (p.name(), p.uses_index())
        };
        Ok(Rules {
            config: pc.clone(),
            tokenizer,
            hasher,
            block_size: pc.block_size,
            policy,
            shadows,
            policy_name,
            uses_index,
            session_header,
        })
    }
}

/// One member of a discovered pool: its replicas (one per target port) and their tasks.
#[derive(Debug, Default)]
pub(crate) struct Member {
    pub replicas: Vec<Arc<Replica>>,
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// Whether a discovered pool's source can be read.
#[derive(Clone, Debug, Default)]
pub(crate) struct DiscoveryState {
    /// Something was read at least once.
    pub synced: bool,
    /// (bounded metric label, message naming the fix) while reading fails.
    pub error: Option<(String, String)>,
    /// Why the pool's declared settings cannot be applied, while they cannot.
    pub settings_error: Option<String>,
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

    /// Counts a placed request that a replica took: its prompt tokens and the ones the policy
    /// expected that replica to have cached.
    pub fn count_routed(&self, prompt_tokens: u32, predicted_cached: u32) {
        self.routed_prompt_tokens
            .fetch_add(u64::from(prompt_tokens), Ordering::Relaxed);
        self.predicted_cached_tokens.fetch_add(
            u64::from(predicted_cached.min(prompt_tokens)),
            Ordering::Relaxed,
        );
    }

    /// (prompt tokens routed, of those predicted cached) since start.
    pub fn routed_tokens(&self) -> (u64, u64) {
        (
            self.routed_prompt_tokens.load(Ordering::Relaxed),
            self.predicted_cached_tokens.load(Ordering::Relaxed),
        )
    }

    /// The rules requests are placed by now.
    pub fn rules(&self) -> Arc<Rules> {
        self.rules.read().clone()
    }

    /// The KV blocks of one engine (DP rank) of the pool, on average over the replicas that
    /// reported theirs, or `None` while none has.
    pub fn blocks_per_worker(&self) -> Option<u64> {
        let (blocks, n) = self
            .replicas()
            .iter()
            .filter_map(|r| r.info.lock().cache_config.as_ref()?.num_gpu_blocks)
            .fold((0u64, 0u64), |(b, n), x| (b.saturating_add(x), n + 1));
        (n > 0).then(|| blocks / n)
    }

    /// Once a second: the policy's and the baselines' expired records go, and the baselines'
    /// cache bound follows the pool's KV capacity (replicas leave without a scrape).
    pub fn tick(&self, now: Duration) {
        let rules = self.rules();
        rules.policy.lock().expire(now);
        for s in rules.shadows.lock().iter_mut() {
            s.expire(now);
        }
        self.fit_baselines();
    }

    /// Bounds the baselines' cache models by the replicas' KV capacity; called when a scrape
    /// reports a capacity that changed, so the first requests after a replica is read already
    /// count against it.
    pub fn fit_baselines(&self) {
        let capacity = self.blocks_per_worker().map_or(CAPACITY_UNKNOWN, |b| {
            usize::try_from(b).unwrap_or(usize::MAX)
        });
        for s in self.rules().shadows.lock().iter_mut() {
            s.set_capacity(capacity);
        }
    }

    /// Replaces the rules; requests already prepared finish with the ones they took.
    pub fn set_rules(&self, rules: Rules) {
        *self.rules.write() = Arc::new(rules);
    }

    /// The replicas requests may go to now.
    pub fn replicas(&self) -> Arc<Vec<Arc<Replica>>> {
        self.replicas.read().clone()
    }

    pub fn replica(&self, id: ReplicaId) -> Option<Arc<Replica>> {
        find_replica(&self.replicas.read(), id).cloned()
    }

    /// Adds replicas to the set requests may go to.
    pub fn add_replicas(&self, added: &[Arc<Replica>]) {
        let mut guard = self.replicas.write();
        let mut next: Vec<Arc<Replica>> = guard.as_ref().clone();
        next.extend(added.iter().cloned());
        // Kept sorted by id, so that a request finds its replicas by binary search.
        next.sort_by_key(|r| r.id);
        *guard = Arc::new(next);
        drop(guard);
        if let Some(room) = &self.room {
            // New replicas are new room: every waiter looks again.
            room.notify_waiters();
        }
    }

    /// Takes replicas out of the set requests may go to; requests already routed to them
    /// keep their own references and finish.
    pub fn remove_replicas(&self, ids: &[ReplicaId]) {
        let mut guard = self.replicas.write();
        let next: Vec<Arc<Replica>> = guard
            .iter()
            .filter(|r| !ids.contains(&r.id))
            .cloned()
            .collect();
        *guard = Arc::new(next);
    }

    /// (entries, distinct blocks) in the index.
    pub fn index_size(&self) -> (usize, usize) {
        let idx = self.index.read();
        (idx.len(), idx.distinct_blocks())
    }

    pub fn tracked_entries(&self) -> usize {
        self.rules().policy.lock().tracked_entries()
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
    pub scrapes: ScrapeCounts,
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
    /// The pool's [`Pool::room`].
    room: Option<Arc<Notify>>,
    health: AtomicU8,
    scorable: AtomicBool,
    pub info: Mutex<ReplicaInfo>,
    /// Recent prefixes this replica served from cache that no other replica held
    /// (`scale_in`), on the fleet's clock ([`Fleet::now`]).
    scale_in: Mutex<UniqueHits>,
    /// Its series of the request path's metric families.
    pub series: ReplicaSeries,
}

impl Replica {
    pub fn new(
        id: ReplicaId,
        spec: &ReplicaSpec,
        resolved: &ResolvedReplica,
        room: Option<Arc<Notify>>,
    ) -> Self {
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
            room,
            health: AtomicU8::new(UNKNOWN),
            scorable: AtomicBool::new(true),
            info: Mutex::new(ReplicaInfo::default()),
            scale_in: Mutex::new(UniqueHits::new(SCALE_IN_PREFIXES)),
            series: ReplicaSeries::default(),
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
        if self.health.swap(UP, Ordering::Relaxed) != UP {
            self.health_changed();
        }
    }

    /// Marks the replica down; returns whether it was not down before.
    pub fn set_down(&self, error: String) -> bool {
        let was = self.health.swap(DOWN, Ordering::Relaxed);
        self.info.lock().last_error = Some(error);
        if was != DOWN {
            self.health_changed();
        }
        was != DOWN
    }

    /// A replica coming up is new room; one going down can be too (when every replica is
    /// down, requests may go to all of them): requests waiting for room look again.
    fn health_changed(&self) {
        if let Some(room) = &self.room {
            room.notify_waiters();
        }
    }

    /// Records a request served `tokens` from cache that no other replica held, from the
    /// block `first` on (`now` on the fleet's clock).
    pub fn add_unique_hit(&self, first: BlockHash, tokens: u32, now: Duration) {
        self.scale_in.lock().record(first, tokens, now);
    }

    /// What losing this replica would cost (see `scale_in` in the pool's configuration): the
    /// tokens of its recently hit prefixes that `index` still shows on its GPU and on no
    /// other replica, each halved for every `half_life` since its last hit.
    pub fn scale_in_cost(&self, index: &Index, now: Duration, half_life: Duration) -> f64 {
        self.scale_in.lock().cost(now, half_life, |first| {
            let holders = index.longest_prefix(&[first]);
            let mut own = false;
            for (w, tiers) in holders.iter() {
                if w.replica != self.id {
                    return false;
                }
                own |= tiers.gpu > 0;
            }
            own
        })
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

/// Prefixes remembered per replica for its scale-in cost: reading the cost looks each up in
/// the index, and a replica rarely has more distinct prefixes hit recently that no other holds.
const SCALE_IN_PREFIXES: usize = 4096;

/// One DP rank's load: scraped gauges plus the router's own counts.
#[derive(Debug, Default)]
pub(crate) struct WorkerLoad {
    pub running: AtomicU32,
    pub waiting: AtomicU32,
    /// `f64` bits.
    pub kv_usage: AtomicU64,
    pub in_flight: AtomicU32,
    pub prefill: AtomicU64,
    /// Requests this router started on the worker, ever (tells the scraper it was used).
    pub started: AtomicU64,
    /// Scrapes recorded so far.
    scrapes: AtomicU64,
    /// This router's requests that started before the last scrape and have ended since.
    ended_since_scrape: AtomicU32,
}

impl WorkerLoad {
    /// The load a decision sees. The scraped gauges are a snapshot until the next scrape; this
    /// router's own requests that started before it and have ended since are taken off them
    /// (running first), so a request that a scrape caught running does not weigh on the worker
    /// after it ended. (A request that started just before a scrape but had not reached the
    /// engine is taken off too: the gauges may then read one low until the next scrape, while
    /// the router's own count of what it has in flight stays exact.)
    pub fn load(&self) -> Load {
        let ended = self.ended_since_scrape.load(Ordering::Relaxed);
        let running = self.running.load(Ordering::Relaxed);
        let waiting = self.waiting.load(Ordering::Relaxed);
        let off_running = ended.min(running);
        Load {
            running: running - off_running,
            waiting: waiting.saturating_sub(ended - off_running),
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

    /// Whether the router has fewer than `cap` requests in flight here (`cap` 0: no limit).
    pub fn has_room(&self, cap: u32) -> bool {
        cap == 0 || self.in_flight.load(Ordering::Relaxed) < cap
    }

    pub fn set_scraped(&self, running: u32, waiting: u32, kv_usage: f64) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.kv_usage.store(kv_usage.to_bits(), Ordering::Relaxed);
        self.ended_since_scrape.store(0, Ordering::Relaxed);
        self.scrapes.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request of this router's as started; returns the scrape count it started at.
    fn begin(&self, prefill: u64) -> u64 {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.prefill.fetch_add(prefill, Ordering::Relaxed);
        self.started.fetch_add(1, Ordering::Relaxed);
        self.scrapes.load(Ordering::Relaxed)
    }

    /// Counts a request that [`WorkerLoad::begin`] started (at scrape count `scrapes`) as
    /// ended, with `prefill` tokens of it still counted as prefilling.
    fn end(&self, scrapes: u64, prefill: u64) {
        if prefill > 0 {
            self.prefill.fetch_sub(prefill, Ordering::Relaxed);
        }
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
        if self.scrapes.load(Ordering::Relaxed) != scrapes {
            self.ended_since_scrape.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One request's claim on a worker. Dropping it releases the claim.
#[derive(Debug)]
pub(crate) struct InFlight {
    replica: Arc<Replica>,
    rank: usize,
    prefill: u64,
    /// The worker's scrape count when the request started.
    scrapes: u64,
    changed: Arc<watch::Sender<u64>>,
}

impl InFlight {
    pub fn new(
        replica: Arc<Replica>,
        rank: usize,
        prefill: u64,
        changed: Arc<watch::Sender<u64>>,
    ) -> Self {
        let scrapes = replica.workers.get(rank).map_or(0, |w| w.begin(prefill));
        bump(&changed);
        InFlight {
            replica,
            rank,
            prefill,
            scrapes,
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
            w.end(self.scrapes, self.prefill);
        }
        if let Some(room) = &self.replica.room {
            // One request ended, one place freed: one waiter (the first) looks again.
            room.notify_one();
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
    let mut models = HashMap::default();
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
        metrics.open_pool(&pc.display_name());
        let queued = metrics.limits.queued.get_or_create(&QueueLabel {
            pool: pc.display_name(),
        });
        let gate = Gate::new(
            cfg.limits.max_in_flight,
            cfg.limits.max_queue,
            cfg.timeouts.queue(),
            queued.clone(),
        );
        let cap = cfg.limits.max_in_flight_per_replica;
        let pool = build_pool(pc, rp, gate, cap, &mut next_id).await?;
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
        limits: cfg.limits.clone(),
        max_body_bytes: cfg.limits.max_body_bytes,
        max_attempts: cfg.limits.max_attempts,
        expose_endpoint_header: cfg.expose_endpoint_header,
        scrape_interval: (cfg.scrape.interval_ms > 0)
            .then(|| Duration::from_millis(cfg.scrape.interval_ms)),
        scrape_idle_interval: Duration::from_millis(
            cfg.scrape.idle_interval_ms.max(cfg.scrape.interval_ms),
        ),
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
        next_id: AtomicU32::new(next_id),
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
    gate: Gate,
    worker_cap: u32,
    next_id: &mut u32,
) -> Result<Built, StartError> {
    let name = pc.display_name();
    let rules = Rules::build(pc, rp.hasher, rp.session_header, None).map_err(|source| {
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
    let room = (worker_cap > 0).then(|| Arc::new(Notify::new()));
    let mut replicas = Vec::with_capacity(rp.replicas.len());
    let mut discover = Vec::new();
    for (spec, rr) in pc.replicas.iter().zip(rp.replicas) {
        let id = ReplicaId(*next_id);
        *next_id += 1;
        let replica = Arc::new(Replica::new(id, spec, &rr, room.clone()));
        if subscribe(&plane, &replica, spec, rr.events.as_ref())
            .await
            .map_err(events_error)?
        {
            discover.push(replica.clone());
        }
        replicas.push(replica);
    }
    let pool = Pool {
        name: name.clone(),
        models: pc
            .models
            .iter()
            .chain(pc.lora_adapters.keys())
            .cloned()
            .collect(),
        rules: RwLock::new(Arc::new(rules)),
        index: plane.index(),
        gate,
        worker_cap,
        room,
        plane: Mutex::new(Some(Arc::new(plane))),
        replicas: RwLock::new(Arc::new(replicas)),
        source: pc.inference_pool.clone(),
        members: Mutex::new(BTreeMap::new()),
        discovery: Mutex::new(DiscoveryState::default()),
        tickets: AtomicU64::new(0),
        savings: rp.savings,
        routed_prompt_tokens: AtomicU64::new(0),
        predicted_cached_tokens: AtomicU64::new(0),
        warmer: Warmer::default(),
    };
    Ok(Built { pool, discover })
}

/// Subscribes `replica` to the event stream its spec names explicitly; returns whether its
/// endpoints are to be discovered instead (`GET /kv_event_sources`, once the fleet runs).
pub(crate) async fn subscribe(
    plane: &EventPlane,
    replica: &Replica,
    spec: &ReplicaSpec,
    source: Option<&EventSource>,
) -> Result<bool, kinference_events::EventsError> {
    let id = replica.id;
    let base = match source {
        None => return Ok(false),
        Some(EventSource::Discover) => return Ok(true),
        Some(EventSource::Connect(a)) => WorkerConfig::connect(id, DpRank(0), a),
        Some(EventSource::Bind(a)) => WorkerConfig::bind(id, DpRank(0), a),
    };
    let mut base = base.with_topic(&replica.topic);
    if let Some(rep) = spec.events.as_ref().and_then(|e| e.replay.as_deref()) {
        base = base.with_replay(rep);
    }
    let rcfg = ReplicaConfig {
        base,
        dp_size: spec.dp_ranks,
    };
    plane.add_replica(rcfg).await?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request a scrape caught running stops weighing on the worker when it ends; requests
    /// that started after the scrape, and other clients' load, stay counted until the next.
    #[test]
    fn requests_ended_since_a_scrape_leave_its_gauges() {
        let w = WorkerLoad::default();
        let a = w.begin(100);
        let b = w.begin(0);
        // The scrape sees both of ours running and one other client's request waiting.
        w.set_scraped(2, 1, 0.5);
        let c = w.begin(0);
        let l = w.load();
        assert_eq!((l.running, l.waiting, l.in_flight), (2, 1, 3));
        w.end(a, 100);
        let l = w.load();
        assert_eq!(
            (
                l.running,
                l.waiting,
                l.in_flight,
                l.in_flight_prefill_tokens
            ),
            (1, 1, 2, 0)
        );
        // `c` started after the scrape, which did not count it: its end changes no gauge.
        w.end(c, 0);
        assert_eq!((w.load().running, w.load().waiting), (1, 1));
        // More ended than the scrape saw running: the rest comes off waiting, never below 0.
        w.end(b, 0);
        let d = w.begin(0);
        w.set_scraped(0, 1, 0.5);
        w.end(d, 0);
        let l = w.load();
        assert_eq!((l.running, l.waiting, l.in_flight), (0, 0, 0));
        // A new scrape starts the count again.
        w.set_scraped(1, 0, 0.5);
        assert_eq!(w.load().running, 1);
    }
}
