//! The JSON the router's admin port answers (`/debug/explain`, `/debug/replicas`, `/readyz`)
//! and the error body both ports use, as plain serde types so that tools (the operator CLI)
//! can read them back.
//!
//! Invariant: these types carry no live handles; each response is a snapshot taken when it was
//! requested, and every field name here is part of the admin API (renaming one breaks readers).

use serde::{Deserialize, Serialize};

/// `{"error": {"message", "type", "param", "code"}}`, as OpenAI and vLLM answer errors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// The inner object of an [`ErrorBody`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    /// vLLM's error class names: `BadRequestError`, `NotFoundError`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, if one is (`model` for an unknown model).
    pub param: Option<String>,
    /// The HTTP status code.
    pub code: u16,
}

/// `POST /debug/explain`: how a request body would be routed, without forwarding it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExplainResponse {
    pub pool: String,
    /// The `model` of the request (the pool's first model when the request names none).
    pub model: String,
    /// `chat` or `completions`.
    pub api: String,
    /// Prompt tokens (of the first prompt for a batch of completions prompts).
    pub prompt_tokens: u32,
    pub block_size: u32,
    /// Full blocks hashed: the part of the prompt the replicas can cache.
    pub blocks: usize,
    /// Why the prompt could not be tokenized (then it is routed by load only), if it could not.
    pub tokenize_error: Option<String>,
    pub policy: String,
    /// Why the first candidate won (`cached_prefix`, `prefix_spread`, `no_cache`, ...).
    pub reason: String,
    /// The chosen worker (`replica-N/dpR`), if any candidate was available.
    pub chosen: Option<String>,
    /// Every available worker, best first.
    pub candidates: Vec<CandidateScore>,
}

/// One worker's evaluation in an [`ExplainResponse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateScore {
    /// `replica-N/dpR`.
    pub worker: String,
    /// The replica's base URL.
    pub replica: String,
    pub rank: u32,
    /// Prefix blocks credited as cached on GPU (events or a recent routing decision).
    pub gpu_blocks: u32,
    /// Further prefix blocks cached in CPU or storage tiers.
    pub offloaded_blocks: u32,
    /// Prefix blocks assumed cached because a request with them was just sent there.
    pub speculative_blocks: u32,
    pub predicted_cached_tokens: u32,
    /// Outstanding requests as the policy counts them.
    pub load: f64,
    /// Above the fair-share cap: ranked after every worker within it.
    pub over_cap: bool,
    pub scorable: bool,
    /// Higher is better; comparable within one decision only.
    pub value: f64,
}

/// `GET /debug/replicas`: every pool with its replicas' state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicasResponse {
    pub pools: Vec<PoolStatus>,
}

impl ReplicasResponse {
    /// What `/readyz` answers for this state: ready when every pool has at least one replica
    /// that answered its last scrape or request.
    pub fn readiness(&self) -> ReadyResponse {
        let pools: Vec<PoolReady> = self
            .pools
            .iter()
            .map(|p| PoolReady {
                name: p.name.clone(),
                healthy_replicas: p.replicas.iter().filter(|r| r.health == Health::Up).count(),
                replicas: p.replicas.len(),
                discovery_error: p.discovery.as_ref().and_then(|d| d.error.clone()),
            })
            .collect();
        ReadyResponse {
            ready: pools.iter().all(|p| p.healthy_replicas > 0),
            pools,
        }
    }
}

/// One pool in a [`ReplicasResponse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub name: String,
    pub models: Vec<String>,
    pub block_size: u32,
    pub hash_algo: String,
    pub policy: String,
    /// (block, worker, tier, group) entries in the pool's index.
    pub index_entries: usize,
    /// Distinct block hashes in the pool's index.
    pub index_blocks: usize,
    /// Router-side entries (speculative, or the approximate policy's record).
    pub tracked_entries: usize,
    pub replicas: Vec<ReplicaStatus>,
    /// Prompt tokens of the requests the policy placed and a replica took, since start.
    #[serde(default)]
    pub routed_prompt_tokens: u64,
    /// Of those, the tokens the policy expected the chosen replica to have cached: over a
    /// window, `predicted_cached_tokens / routed_prompt_tokens` is the predicted hit rate.
    #[serde(default)]
    pub predicted_cached_tokens: u64,
    /// Where a discovered pool's replicas come from, and whether it can be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery: Option<DiscoveryStatus>,
    /// The KV-event endpoints the router binds for this pool (publishers connect to them),
    /// with their topics and what arrived under topics of no replica.
    #[serde(default)]
    pub event_endpoints: Vec<EventEndpointStatus>,
    /// The pool tokenizer's prefix cache, since the tokenizer was loaded.
    #[serde(default)]
    pub tokenizer_cache: TokenizerCacheStatus,
}

/// What the prefix cache of a pool's tokenizer saved (`PoolStatus::tokenizer_cache`): prompt
/// texts of 256 bytes or more are looked up (shorter ones are encoded without a lookup and
/// not counted), and each of their bytes is counted once, as reused (its token ids came from
/// an earlier prompt), encoded on a hit, or encoded on a miss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerCacheStatus {
    pub hits: u64,
    pub misses: u64,
    pub bytes_reused: u64,
    pub bytes_encoded_on_hits: u64,
    pub bytes_encoded_on_misses: u64,
    /// Entries held now, and their bytes (texts, token ids, split points, block digests).
    pub entries: u64,
    pub bytes: u64,
    pub evictions: u64,
}

impl From<kinference_tokenize::CacheStats> for TokenizerCacheStatus {
    fn from(s: kinference_tokenize::CacheStats) -> Self {
        TokenizerCacheStatus {
            hits: s.hits,
            misses: s.misses,
            bytes_reused: s.bytes_reused,
            bytes_encoded_on_hits: s.bytes_encoded_on_hits,
            bytes_encoded_on_misses: s.bytes_encoded_on_misses,
            entries: s.entries,
            bytes: s.bytes,
            evictions: s.evictions,
        }
    }
}

/// A discovered pool's source (`PoolStatus::discovery`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiscoveryStatus {
    /// `inferencepool/NAMESPACE/NAME`.
    pub source: String,
    /// The source was read at least once.
    pub synced: bool,
    /// Why it cannot be read now (naming the missing permission or resource), if it cannot;
    /// routing goes on with the replicas last read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A stable label for `error` (metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_kind: Option<String>,
    /// Why the pool's declared settings (a `KinferencePool`'s spec) cannot be applied, if
    /// they cannot; the pool routes on with the last settings that could be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings_error: Option<String>,
}

/// One bound KV-event endpoint, possibly shared by many replicas told apart by topic.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventEndpointStatus {
    /// As configured (`bind`).
    pub endpoint: String,
    /// Actually bound (real port).
    pub local_endpoint: String,
    /// The replicas' topics routed here.
    pub topics: Vec<String>,
    /// Messages under a topic no replica is configured with (dropped, not merged).
    pub unknown_topic_messages: u64,
    /// Those topics (up to 64) with their message counts.
    pub unknown_topics: std::collections::BTreeMap<String, u64>,
}

/// Whether a replica answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Not scraped or contacted yet.
    Unknown,
    /// The last scrape (or request) reached it.
    Up,
    /// The last scrape failed, or a connection to it was refused.
    Down,
}

/// One replica in a [`PoolStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaStatus {
    pub url: String,
    /// The replica's identifier in the index (`replica-N`).
    pub id: String,
    pub dp_ranks: u32,
    pub health: Health,
    /// The last scrape or connection error, if the replica is down.
    pub last_error: Option<String>,
    /// False when the router cannot reproduce this replica's block hashes: it is routed by
    /// load only.
    pub scorable: bool,
    pub unscorable_reason: Option<String>,
    /// What the replica reports in `vllm:cache_config_info`, once scraped.
    pub cache_config: Option<CacheConfigStatus>,
    /// How the event stream is found: `none`, `connect`, `bind` or `discover`.
    pub events_mode: String,
    /// Why event discovery or subscription failed, while it does.
    pub events_error: Option<String>,
    /// `vllm:prefix_cache_hits_total` and `vllm:prefix_cache_queries_total` (tokens), summed
    /// over ranks, as last scraped.
    pub prefix_cache_hits: Option<f64>,
    pub prefix_cache_queries: Option<f64>,
    /// This router's scrapes of the replica's `/metrics` since it joined.
    #[serde(default)]
    pub scrapes: ScrapeCounts,
    /// What losing the replica would cost: the tokens of the prefixes it recently served from
    /// cache that no other replica holds, each counted once and halved for every
    /// `scale_in.half_life_s` of the pool since its last hit.
    /// The lowest is the one to remove when scaling in. Given by `/debug/replicas` (not
    /// computed for probes and metrics).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale_in_cost: Option<f64>,
    pub workers: Vec<WorkerStatus>,
}

/// Scrape ticks of one replica by outcome ([`ReplicaStatus::scrapes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScrapeCounts {
    pub ok: u64,
    pub failed: u64,
    /// Ticks that skipped the replica because it was quiet (`scrape.idle_interval_ms`).
    pub idle: u64,
}

/// The labels of `vllm:cache_config_info` the router checks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheConfigStatus {
    pub block_size: Option<u32>,
    /// KV blocks of one engine (`num_gpu_blocks`).
    #[serde(default)]
    pub num_gpu_blocks: Option<u64>,
    pub hash_algo: Option<String>,
    pub prefix_caching: Option<bool>,
}

/// One DP rank of a replica.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub rank: u32,
    /// `replica-N/dpR`.
    pub worker: String,
    pub load: LoadStatus,
    /// Entries the index holds for this worker.
    pub index_entries: usize,
    /// The KV-event stream, once subscribed.
    pub events: Option<EventStreamStatus>,
}

/// A worker's load as the router sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoadStatus {
    /// Scraped `vllm:num_requests_running`.
    pub running: u32,
    /// Scraped `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// Scraped `vllm:kv_cache_usage_perc` (0..=1).
    pub kv_usage: f64,
    /// Requests this router has sent there and not finished.
    pub in_flight: u32,
    /// Uncached prompt tokens of this router's requests there still waiting for a first byte.
    pub in_flight_prefill_tokens: u64,
}

/// A worker's KV-event stream.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventStreamStatus {
    pub endpoint: String,
    pub local_endpoint: Option<String>,
    pub connected: bool,
    /// `connecting`, `synced`, `resynced` or `stale`.
    pub sync: String,
    pub last_seq: Option<u64>,
    pub applied_seq: Option<u64>,
    pub messages: u64,
    pub batches_applied: u64,
    pub gaps: u64,
    pub replays_attempted: u64,
    pub replays_succeeded: u64,
    pub replayed_batches: u64,
    pub unrecoverable_gaps: u64,
    pub resets: u64,
    /// Live messages behind the stream that the replay proved to be copies (not a restart).
    #[serde(default)]
    pub repeats: u64,
    pub decode_errors: u64,
    pub socket_errors: u64,
    /// Milliseconds since the last live event, if one arrived.
    pub last_event_age_ms: Option<u64>,
    /// `block_size` of the last `BlockStored` received.
    #[serde(default)]
    pub stored_block_size: Option<u32>,
    /// Whether the recent root blocks the worker announced hash as the pool computes them
    /// (one match suffices); `None` until two have arrived.
    #[serde(default)]
    pub root_hashes_match: Option<bool>,
}

/// `GET /readyz`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadyResponse {
    /// True when every pool has at least one healthy replica.
    pub ready: bool,
    pub pools: Vec<PoolReady>,
}

/// One pool in a [`ReadyResponse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolReady {
    pub name: String,
    pub healthy_replicas: usize,
    pub replicas: usize,
    /// A discovered pool whose source cannot be read: why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub discovery_error: Option<String>,
}

/// `GET /debug/savings`: what the replicas' cache hits saved since the router started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavingsResponse {
    /// Seconds since the router started.
    pub uptime_secs: f64,
    /// The price of a GPU-hour the money is computed with (`savings.usd_per_gpu_hour`).
    pub usd_per_gpu_hour: f64,
    /// The power of one GPU the energy is computed with (`savings.gpu_watts`).
    pub gpu_watts: f64,
    /// Every pool together.
    pub total: SavingsFigures,
    /// Every pool together, against each baseline some pool compares with.
    #[serde(default)]
    pub baselines: Vec<BaselineSavings>,
    pub pools: Vec<PoolSavings>,
}

/// The savings against a baseline policy (`baselines`), estimated over the same requests as
/// [`SavingsFigures`]: what the baseline would have found cached had it routed all the
/// traffic itself, from its own decisions and cache model (never sent anything).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BaselineSavings {
    /// `round-robin`, `least-load` or `approximate`.
    pub policy: String,
    /// Prompt tokens the baseline would have found cached.
    pub cached_tokens: u64,
    /// The prefill GPU-seconds the baseline would have saved.
    pub gpu_seconds: f64,
    /// Saved against the baseline: the measured savings minus the baseline's (negative when
    /// the baseline would have done better).
    pub saved_vs_gpu_seconds: f64,
    pub saved_vs_kwh: f64,
    pub saved_vs_usd: f64,
}

/// One pool's part of a [`SavingsResponse`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolSavings {
    pub name: String,
    /// The timing profile the GPU time is charged with (`savings_profile`).
    pub profile: String,
    /// GPUs per replica in that profile (all counted).
    pub gpus_per_replica: u32,
    #[serde(flatten)]
    pub figures: SavingsFigures,
    #[serde(default)]
    pub baselines: Vec<BaselineSavings>,
}

/// Savings since start. The tokens are those the replicas reported served from cache
/// (`usage.prompt_tokens_details.cached_tokens`); a response that reports none adds nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SavingsFigures {
    /// Routed requests whose response reported its cached tokens.
    pub requests_observed: u64,
    /// Their prompt tokens (the hit rate's denominator).
    #[serde(default)]
    pub prompt_tokens: u64,
    /// Prefill tokens not recomputed.
    pub saved_prefill_tokens: u64,
    /// GPU-seconds of prefill they would have cost.
    pub saved_gpu_seconds: f64,
    pub saved_kwh: f64,
    pub saved_usd: f64,
}

/// `GET /debug/dashboard`: what the `/dashboard` page and `kinfctl top` show.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DashboardResponse {
    pub savings: SavingsResponse,
    pub fleet: ReplicasResponse,
    /// Routing decisions since start, by the reason the chosen worker won (all pools).
    pub reasons: std::collections::BTreeMap<String, u64>,
    /// Seconds between two [`HistoryPoint`]s.
    pub interval_secs: f64,
    /// The last samples, oldest first (a bounded window).
    pub history: Vec<HistoryPoint>,
}

/// One sample of the fleet-wide rates, over the interval that ends at `t`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HistoryPoint {
    /// Seconds since the router started.
    pub t: f64,
    /// Requests answered per second (every route and status).
    pub requests_per_s: f64,
    /// Cached prompt tokens the policy predicted, over routed prompt tokens (`None`: none
    /// routed in the interval).
    pub predicted_hit_rate: Option<f64>,
    /// Cached prompt tokens the replicas reported, over routed prompt tokens.
    pub reported_hit_rate: Option<f64>,
    /// Time to the first response byte as the router sees it, milliseconds, over the
    /// interval's responses (from the `kinference_first_byte_seconds` buckets).
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Saved prefill GPU-seconds since start, at `t`.
    pub saved_gpu_seconds: f64,
    /// Per replica: load at `t`.
    pub load: Vec<ReplicaLoad>,
}

/// A replica's load in a [`HistoryPoint`], summed over its DP ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaLoad {
    pub replica: String,
    pub running: u32,
    pub waiting: u32,
    pub in_flight: u32,
    /// The highest KV usage of its ranks (0..=1).
    pub kv_usage: f64,
}
