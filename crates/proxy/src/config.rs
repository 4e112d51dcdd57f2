//! The router's configuration: one YAML file (documented in `docs/config.md`), or the same
//! settings built from command-line flags for a one-pool fleet.
//!
//! Invariants: parsing never stops at the first problem. The file is read piecewise (top level,
//! each pool, each replica) so that structural errors in different places are all reported,
//! and [`Config::validate`] then reports every bad value at once; a [`Config`] that validates
//! can be started without further configuration errors. Durations are integer milliseconds,
//! sizes integer bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use crate::savings::{Prices, SavingsModel};
use http::uri::Authority;
use http::{HeaderName, HeaderValue};
use kinference_policy::PolicyConfig;
use kinference_vllm::{BlockHasher, ExtraKeysFormat, HashAlgo};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_yaml_ng::Value;

/// The whole router.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Data-plane address (the OpenAI API), `host:port`.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// Admin address (metrics, health, debug), `host:port`; keep it off the public network.
    #[serde(default = "default_admin")]
    pub admin: String,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub scrape: Scrape,
    #[serde(default)]
    pub admin_auth: AdminAuth,
    /// Add `x-kinference-endpoint: host:port` (and `x-kinference-dp-rank`) to responses, naming
    /// the replica that served them. Off by default: it reveals internal addresses.
    #[serde(default)]
    pub expose_endpoint_header: bool,
    /// Data-plane threads, each accepting and serving its own client connections on its own
    /// event loop (with its own upstream connections); `None` = one per CPU.
    #[serde(default)]
    pub threads: Option<usize>,
    /// What a GPU-hour costs, for the savings the admin port reports (`/dashboard`,
    /// `kinfctl savings`).
    #[serde(default)]
    pub savings: Prices,
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
}

fn default_listen() -> String {
    "127.0.0.1:8080".to_owned()
}

fn default_admin() -> String {
    "127.0.0.1:9090".to_owned()
}

/// Upstream timeouts, in milliseconds.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to a replica. A connect failure or timeout moves the request to the next
    /// replica.
    pub connect_ms: u64,
    /// From sending the request to the response head. vLLM sends the head of a non-streamed
    /// response only when generation ends, so this bounds whole non-streamed requests.
    pub first_byte_ms: u64,
    /// Longest gap between two body chunks of a response.
    pub idle_ms: u64,
    /// Upper bound on a whole response; 0 = none.
    pub total_ms: u64,
    /// On shutdown, how long running requests may take to finish before they are cut.
    pub drain_ms: u64,
    /// An idle upstream connection is reused only within this; keep it below the replicas'
    /// keep-alive (vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE`, 5 s by default), so that a replica
    /// never closes a connection as a request is being written to it.
    pub pool_idle_ms: u64,
    /// Client side: a request head must arrive whole within this, counted from its first byte
    /// (or from the connection's start, for its first request); else the connection is closed.
    pub header_read_ms: u64,
    /// Client side: a request body must arrive within this plus the time
    /// `limits.min_body_rate_bytes_per_s` allows for the bytes received so far; else 408.
    pub body_read_ms: u64,
    /// Client side: a connection with no request in flight is closed after this.
    pub keep_alive_ms: u64,
    /// Longest wait of a request queued for one of its pool's `limits.max_in_flight` places;
    /// then 429.
    pub queue_ms: u64,
    /// HTTP/2 clients: a PING after this much silence (0: none) ...
    pub h2_keep_alive_interval_ms: u64,
    /// ... and the connection is closed when its answer takes longer than this.
    pub h2_keep_alive_timeout_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: 2_000,
            first_byte_ms: 600_000,
            idle_ms: 300_000,
            total_ms: 0,
            drain_ms: 10_000,
            pool_idle_ms: 4_000,
            header_read_ms: 10_000,
            body_read_ms: 30_000,
            keep_alive_ms: 60_000,
            queue_ms: 10_000,
            h2_keep_alive_interval_ms: 20_000,
            h2_keep_alive_timeout_ms: 20_000,
        }
    }
}

impl Timeouts {
    pub fn connect(&self) -> Duration {
        Duration::from_millis(self.connect_ms)
    }
    pub fn first_byte(&self) -> Duration {
        Duration::from_millis(self.first_byte_ms)
    }
    pub fn idle(&self) -> Duration {
        Duration::from_millis(self.idle_ms)
    }
    pub fn total(&self) -> Option<Duration> {
        (self.total_ms > 0).then(|| Duration::from_millis(self.total_ms))
    }
    pub fn drain(&self) -> Duration {
        Duration::from_millis(self.drain_ms)
    }

    pub fn pool_idle(&self) -> Duration {
        Duration::from_millis(self.pool_idle_ms)
    }
    pub fn header_read(&self) -> Duration {
        Duration::from_millis(self.header_read_ms)
    }
    pub fn body_read(&self) -> Duration {
        Duration::from_millis(self.body_read_ms)
    }
    pub fn keep_alive(&self) -> Duration {
        Duration::from_millis(self.keep_alive_ms)
    }
    pub fn queue(&self) -> Duration {
        Duration::from_millis(self.queue_ms)
    }
    pub fn h2_keep_alive_interval(&self) -> Option<Duration> {
        (self.h2_keep_alive_interval_ms > 0)
            .then(|| Duration::from_millis(self.h2_keep_alive_interval_ms))
    }
    pub fn h2_keep_alive_timeout(&self) -> Duration {
        Duration::from_millis(self.h2_keep_alive_timeout_ms)
    }
}

/// Request limits.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted, bytes (larger: 413).
    pub max_body_bytes: usize,
    /// Replicas tried per request while nothing was sent upstream (the first included).
    pub max_attempts: u32,
    /// Client connections open at once on the data port; at the cap the router stops
    /// accepting (new connections wait in the kernel's backlog) until one closes.
    pub max_connections: usize,
    /// Requests of one pool forwarded at once (routed and passed through); 0: no limit.
    pub max_in_flight: usize,
    /// Requests of one pool waiting for one of its `max_in_flight` places, or for room on a
    /// replica (`max_in_flight_per_replica`); when full, 429.
    pub max_queue: usize,
    /// Requests this router has in flight on one replica engine (each DP rank of a replica)
    /// at most; a full one is not chosen while another has room, and when every replica the
    /// request may go to is full it waits in the pool's queue. 0: no limit.
    pub max_in_flight_per_replica: u32,
    /// Slowest request body accepted, bytes per second on average after
    /// `timeouts.body_read_ms`; 0: the body must arrive within `body_read_ms`.
    pub min_body_rate_bytes_per_s: u64,
    /// Streams one HTTP/2 client connection may have open at once.
    pub h2_max_concurrent_streams: u32,
    /// The `Retry-After` (seconds) of a request shed with 429 or 503.
    pub retry_after_s: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            max_attempts: 3,
            max_connections: 10_000,
            max_in_flight: 4_096,
            max_queue: 4_096,
            max_in_flight_per_replica: 0,
            min_body_rate_bytes_per_s: 1_024,
            h2_max_concurrent_streams: 256,
            retry_after_s: 1,
        }
    }
}

/// Who may use the admin port. Without a token everyone may (keep the port private); with
/// one, every path but the probes (`/livez`, `/healthz`, `/readyz`) needs
/// `Authorization: Bearer TOKEN`: `/debug/explain` answers for any prompt, `/debug/replicas`
/// names the fleet.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminAuth {
    /// A file holding the token (surrounding whitespace ignored).
    pub token_file: Option<PathBuf>,
    /// The token itself, from the environment (`KINFERENCE_ADMIN_TOKEN`) or a caller; never
    /// read from the file or the command line, where it would be seen.
    #[serde(skip)]
    pub token: Option<AdminToken>,
    /// Serve `/metrics` without the token (for a scraper that cannot send one).
    pub open_metrics: bool,
}

/// A bearer token, kept out of `Debug` output.
#[derive(Clone, PartialEq, Eq)]
pub struct AdminToken(String);

impl AdminToken {
    /// `None` for a token that is empty once trimmed.
    pub fn new(token: &str) -> Option<AdminToken> {
        let t = token.trim();
        (!t.is_empty()).then(|| AdminToken(t.to_owned()))
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// Load scraping of each replica's `/metrics`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Scrape {
    /// Milliseconds between scrapes of one replica; 0 turns scraping off (health then comes
    /// from requests alone, and load from the router's own in-flight counts).
    pub interval_ms: u64,
    /// Timeout of one scrape, milliseconds.
    pub timeout_ms: u64,
    /// Longest wait between scrapes of a quiet replica, milliseconds: one that answered its
    /// last scrape with nothing running or waiting, has no request from this router in flight
    /// or started since, and whose KV-event streams neither sent anything nor changed state.
    /// Anything else brings it back to `interval_ms`. 0 (or a value not above `interval_ms`)
    /// scrapes every replica every `interval_ms`.
    pub idle_interval_ms: u64,
}

impl Default for Scrape {
    fn default() -> Self {
        Scrape {
            interval_ms: 1_000,
            timeout_ms: 2_000,
            idle_interval_ms: 5_000,
        }
    }
}

/// A set of interchangeable replicas serving the same model(s) with one hashing setup.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Name in metrics and the admin API; defaults to the first model.
    #[serde(default)]
    pub name: Option<String>,
    /// The `model` values routed to this pool (vLLM's `--served-model-name`).
    pub models: Vec<String>,
    /// Directory with the model's `tokenizer.json` (and `tokenizer_config.json` for chat).
    /// May be left out of an `inferencePool` pool whose `KinferencePool` names one (it is
    /// applied before the configuration is checked).
    #[serde(default)]
    pub tokenizer: PathBuf,
    /// Tokens per KV block: the replicas' `--block-size`. May be left out like `tokenizer`.
    #[serde(default)]
    pub block_size: u32,
    /// The replicas' `--prefix-caching-hash-algo`: sha256, sha256_cbor, xxhash, xxhash_cbor.
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    /// The replicas' `PYTHONHASHSEED`, if set (required for the xxhash algorithms).
    #[serde(default)]
    pub hash_seed: Option<String>,
    /// `tagged` (vLLM 0.25+) or `untagged` (up to 0.24): how extra keys enter the hash.
    #[serde(default = "default_format")]
    pub extra_keys_format: String,
    /// Bytes of the tokenizer's prefix cache (a new turn of a long conversation re-encodes
    /// only its new text); 0 turns it off.
    #[serde(default = "default_tokenizer_cache")]
    pub tokenizer_cache_bytes: usize,
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Header whose value is the session key for the `session-affinity` policy.
    #[serde(default)]
    pub session_header: Option<String>,
    /// LoRA adapters served by every replica of the pool: `model` name → path as given to
    /// vLLM (`--lora-modules name=path`). The path enters the block hashes.
    #[serde(default)]
    pub lora_adapters: BTreeMap<String, String>,
    /// KV events for every replica without its own `events`: one bound endpoint that all
    /// publishers connect to, each replica told apart by its topic.
    #[serde(default)]
    pub events: Option<PoolEvents>,
    #[serde(default)]
    pub replicas: Vec<ReplicaSpec>,
    /// Discover the replicas from a Kubernetes `InferencePool` instead of listing them.
    #[serde(default, rename = "inferencePool", alias = "inference_pool")]
    pub inference_pool: Option<InferencePoolRef>,
    /// The GPU timing profile (`crates/sim/profiles`) the pool's savings are charged with:
    /// what prefilling a prompt costs on its replicas, on how many GPUs each.
    #[serde(default = "default_savings_profile")]
    pub savings_profile: String,
    /// Policies the savings are compared with (`round-robin`, `least-load`, `approximate`):
    /// each request is also decided by each of them, without sending anything, and what its
    /// choice would have found cached had it routed all the traffic is counted ("saved vs
    /// round-robin, estimated"). An empty list turns the comparison off.
    #[serde(default = "default_baselines")]
    pub baselines: Vec<String>,
    /// Cache-aware scale-in: what losing each replica would cost, and whether to tell
    /// Kubernetes (see [`ScaleIn`]).
    #[serde(default)]
    pub scale_in: ScaleIn,
    /// Hot-prefix warming: when a hot prefix spills onto a worker that lacks it, send the
    /// prefix alone to a worker so that later spills find it cached. Off by default.
    #[serde(default)]
    pub warm: WarmConfig,
}

/// Cache-aware scale-in. A replica's scale-in cost (in `/debug/replicas`) is the prefill that
/// losing it would cost: the tokens of the prefixes it recently served from cache that no
/// other replica holds (in any tier), each counted once and halved for every `half_life_s`
/// since its last hit (`kinference_policy::UniqueHits`). With
/// `pod_deletion_cost` (an `inferencePool` pool only; the router needs `patch` on pods), the
/// router keeps each pod's `controller.kubernetes.io/pod-deletion-cost` annotation at its
/// cost, so that a Deployment or LeaderWorkerSet scaling down deletes the pod whose cache is
/// worth least first.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScaleIn {
    /// Write the pods' `controller.kubernetes.io/pod-deletion-cost`. Off by default.
    pub pod_deletion_cost: bool,
    /// Seconds after which a request's contribution to the cost has halved.
    pub half_life_s: f64,
    /// Seconds between two looks at the costs; a pod's annotation is written at most once per
    /// look, and not at all while its cost stays within `hysteresis` of the value written.
    pub interval_s: f64,
    /// Relative change (of the larger of the written and the new cost) below which a pod's
    /// annotation is left as it is, so that the API server is not written for noise.
    pub hysteresis: f64,
    /// At most this many pods are written per look (the largest changes first).
    pub max_patches: usize,
}

impl Default for ScaleIn {
    fn default() -> Self {
        ScaleIn {
            pod_deletion_cost: false,
            half_life_s: 600.0,
            interval_s: 30.0,
            hysteresis: 0.25,
            max_patches: 20,
        }
    }
}

/// Which worker a spilled hot prefix is warmed on (`warm.mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmMode {
    /// No warming.
    #[default]
    Off,
    /// The worker the spilled request goes to, alongside that request.
    Chosen,
    /// The next within-cap worker lacking the prefix after the chosen one: where the next
    /// spill is likely to go.
    Next,
}

impl WarmMode {
    pub fn as_str(self) -> &'static str {
        match self {
            WarmMode::Off => "off",
            WarmMode::Chosen => "chosen",
            WarmMode::Next => "next",
        }
    }
}

impl FromStr for WarmMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "off" => Ok(WarmMode::Off),
            "chosen" => Ok(WarmMode::Chosen),
            "next" => Ok(WarmMode::Next),
            _ => Err(format!("{s:?} is not a warm mode (off, chosen, next)")),
        }
    }
}

impl ScaleIn {
    /// The setting from a flag: the YAML of `scale_in:` (`{pod_deletion_cost: true}`),
    /// checked as a configuration file's is.
    pub fn from_flag(text: &str) -> Result<ScaleIn, ConfigErrors> {
        let s: ScaleIn = serde_yaml_ng::from_str(text).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: "--scale-in".into(),
                message: format!("{text:?}: expected a YAML mapping of scale_in ({e})"),
            }])
        })?;
        let mut errs = Errors(Vec::new());
        s.check("--scale-in", &mut errs);
        if errs.0.is_empty() {
            Ok(s)
        } else {
            Err(ConfigErrors(errs.0))
        }
    }

    pub fn half_life(&self) -> Duration {
        Duration::try_from_secs_f64(self.half_life_s).unwrap_or_default()
    }

    pub fn interval(&self) -> Duration {
        Duration::try_from_secs_f64(self.interval_s).unwrap_or_default()
    }

    fn check(&self, path: &str, errs: &mut Errors) {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.half_life_s) {
            errs.push(format!("{path}.half_life_s"), "must be a number above 0");
        }
        if !positive(self.interval_s) {
            errs.push(format!("{path}.interval_s"), "must be a number above 0");
        }
        if !(self.hysteresis.is_finite() && (0.0..1.0).contains(&self.hysteresis)) {
            errs.push(
                format!("{path}.hysteresis"),
                "must be at least 0 and below 1",
            );
        }
        if self.max_patches == 0 {
            errs.push(format!("{path}.max_patches"), "must be at least 1");
        }
    }
}

/// Hot-prefix warming of one pool (see docs/config.md, "Hot-prefix warming").
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WarmConfig {
    pub mode: WarmMode,
    /// A prefix is warmed on a worker at most once per this many milliseconds.
    pub cooldown_ms: u64,
    /// Warms of the pool in flight at once; a warm beyond it is skipped.
    pub max_in_flight: u32,
    /// Warm only when the worker lacks at least this many blocks of the hot prefix.
    pub min_blocks: u32,
    /// vLLM's `priority` for warms (lower runs first; the replicas must run with
    /// `--scheduling-policy priority`, or vLLM refuses a nonzero one); none sent when unset.
    pub priority: Option<i64>,
}

impl Default for WarmConfig {
    fn default() -> Self {
        WarmConfig {
            mode: WarmMode::Off,
            cooldown_ms: 30_000,
            max_in_flight: 4,
            min_blocks: 4,
            priority: None,
        }
    }
}

impl WarmConfig {
    pub fn cooldown(&self) -> Duration {
        Duration::from_millis(self.cooldown_ms)
    }
}

fn default_savings_profile() -> String {
    crate::savings::DEFAULT_PROFILE.to_owned()
}

fn default_baselines() -> Vec<String> {
    vec!["round-robin".to_owned()]
}

/// A Kubernetes `InferencePool` (`inference.networking.k8s.io/v1`) whose ready pods are a
/// pool's replicas.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InferencePoolRef {
    /// Defaults to the router's `--namespace` (in a pod: its own).
    #[serde(default)]
    pub namespace: Option<String>,
    pub name: String,
}

fn default_algo() -> String {
    HashAlgo::Sha256.as_str().to_owned()
}

fn default_tokenizer_cache() -> usize {
    kinference_tokenize::DEFAULT_CACHE_BYTES
}

fn default_format() -> String {
    ExtraKeysFormat::Tagged.as_str().to_owned()
}

impl PoolConfig {
    /// A pool with default hashing (sha256, tagged) and policy (precise).
    pub fn new(model: &str, tokenizer: impl Into<PathBuf>, block_size: u32) -> Self {
        PoolConfig {
            name: None,
            models: vec![model.to_owned()],
            tokenizer: tokenizer.into(),
            block_size,
            hash_algo: default_algo(),
            hash_seed: None,
            extra_keys_format: default_format(),
            tokenizer_cache_bytes: default_tokenizer_cache(),
            policy: PolicyConfig::default(),
            session_header: None,
            lora_adapters: BTreeMap::new(),
            events: None,
            replicas: Vec::new(),
            inference_pool: None,
            savings_profile: default_savings_profile(),
            baselines: default_baselines(),
            scale_in: ScaleIn::default(),
            warm: WarmConfig::default(),
        }
    }

    /// Gives every replica without an `events` setting the pool's (see [`PoolEvents`]).
    pub fn apply_pool_events(&mut self) {
        let Some(pool) = &self.events else { return };
        let model = self.models.first().cloned().unwrap_or_default();
        for r in self.replicas.iter_mut().filter(|r| r.events.is_none()) {
            r.events = Some(pool.for_replica(&r.url, &model));
        }
    }

    /// The pool's name: `name`, or the first model.
    pub fn display_name(&self) -> String {
        self.name
            .clone()
            .or_else(|| self.models.first().cloned())
            .unwrap_or_default()
    }
}

/// A policy from a flag: a bare name (`precise`, `round-robin`, ...) or the YAML of the
/// `policy:` setting (`{kind: precise, load_weight_tokens: 512}`).
pub fn parse_policy(text: &str) -> Result<PolicyConfig, PolicyFlagError> {
    if let Some(p) = PolicyConfig::from_name(text.trim()) {
        return Ok(p);
    }
    let p: PolicyConfig = serde_yaml_ng::from_str(text).map_err(|e| PolicyFlagError::Syntax {
        text: text.to_owned(),
        reason: e.to_string(),
    })?;
    let errs = p.validate();
    if errs.is_empty() {
        Ok(p)
    } else {
        Err(PolicyFlagError::Invalid(
            errs.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        ))
    }
}

/// Why a `--policy` value is not a policy.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyFlagError {
    #[error("policy {text:?}: expected precise, approximate, round-robin, least-load, session-affinity or a YAML mapping ({reason})")]
    Syntax { text: String, reason: String },
    /// The mapping parsed, but some values are out of range (every one listed).
    #[error("{0}")]
    Invalid(String),
}

/// One vLLM replica (one API server, possibly several DP ranks).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Base URL, `http://host:port`.
    pub url: String,
    /// Data-parallel ranks behind this URL (vLLM's `--data-parallel-size`); each rank is routed
    /// to on its own, with vLLM's `X-data-parallel-rank` header when there is more than one.
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Where the replica's KV events come from; absent: no events (routing by load and the
    /// router's own record).
    #[serde(default)]
    pub events: Option<EventsSpec>,
    /// How the router speaks to the replica (requests, scrapes, discovery).
    #[serde(default)]
    pub protocol: UpstreamProtocol,
}

/// The HTTP version the router speaks to a replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum UpstreamProtocol {
    /// HTTP/1.1: what vLLM serves.
    #[default]
    Http,
    /// HTTP/2 with prior knowledge, without TLS (`appProtocol: kubernetes.io/h2c`).
    H2c,
}

fn one() -> u32 {
    1
}

impl ReplicaSpec {
    pub fn new(url: &str) -> Self {
        ReplicaSpec {
            url: url.to_owned(),
            dp_ranks: 1,
            events: None,
            protocol: UpstreamProtocol::Http,
        }
    }

    /// Parses the `--replica` flag: `URL[,events=tcp://H:P|discover][,bind=tcp://H:P]`
    /// `[,replay=tcp://H:P][,topic=T][,dp=N][,protocol=http|h2c]`.
    pub fn from_flag(flag: &str) -> Result<Self, ReplicaFlagError> {
        let bad = |problem: String| ReplicaFlagError {
            flag: flag.to_owned(),
            problem,
        };
        let mut parts = flag.split(',');
        let url = parts.next().unwrap_or_default().trim();
        if url.is_empty() {
            return Err(bad("the URL comes first".to_owned()));
        }
        let mut spec = ReplicaSpec::new(url);
        let mut events = EventsSpec::default();
        let mut any_events = false;
        for part in parts {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| bad(format!("expected key=value, got {part:?}")))?;
            let value = value.trim().to_owned();
            match key.trim() {
                "events" if value == "discover" => events.discover = true,
                "events" | "connect" => events.connect = Some(value),
                "bind" => events.bind = Some(value),
                "replay" => events.replay = Some(value),
                "topic" => events.topic = value,
                "dp" | "dp_ranks" => {
                    spec.dp_ranks = value
                        .parse()
                        .map_err(|_| bad("dp must be a number".to_owned()))?;
                    continue;
                }
                "protocol" => {
                    spec.protocol = match value.as_str() {
                        "http" => UpstreamProtocol::Http,
                        "h2c" => UpstreamProtocol::H2c,
                        _ => return Err(bad("protocol is http or h2c".to_owned())),
                    };
                    continue;
                }
                other => {
                    return Err(bad(format!(
                        "unknown key {other:?} (events, bind, replay, topic, dp, protocol)"
                    )))
                }
            }
            any_events = true;
        }
        if any_events {
            spec.events = Some(events);
        }
        Ok(spec)
    }
}

/// Why a `--replica` flag does not describe a replica.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--replica {flag:?}: {problem}")]
pub struct ReplicaFlagError {
    pub flag: String,
    pub problem: String,
}

/// How to reach a replica's KV-event stream (vLLM's `--kv-events-config`).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventsSpec {
    /// The publisher binds (vLLM `endpoint: tcp://*:5557`): dial this base address.
    #[serde(default)]
    pub connect: Option<String>,
    /// The publisher connects to the router (vLLM `endpoint: tcp://ROUTER:5557`): bind this
    /// base address.
    #[serde(default)]
    pub bind: Option<String>,
    /// Ask the replica's `GET /kv_event_sources` for its endpoints.
    #[serde(default)]
    pub discover: bool,
    /// The publisher's replay ROUTER base address (vLLM `replay_endpoint`); with `discover`
    /// it comes from the replica.
    #[serde(default)]
    pub replay: Option<String>,
    /// vLLM's `topic` (default empty).
    #[serde(default)]
    pub topic: String,
}

/// A pool's KV-event wiring for replicas whose publishers connect to the router (vLLM
/// `--kv-events-config '{"endpoint": "tcp://ROUTER:5557", "topic": ...}'`): the router binds one
/// endpoint for all of them and tells them apart by topic.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolEvents {
    /// The endpoint the router binds, e.g. `tcp://*:5557` or `tcp://0.0.0.0:5557`.
    pub bind: String,
    /// Each replica's vLLM `topic`: `{host}` stands for the host of the replica's URL and
    /// `{model}` for the pool's first model (llm-d's convention is `kv@{host}@{model}`).
    pub topic: String,
}

impl PoolEvents {
    /// The events setting of the replica at `url` serving `model`.
    pub fn for_replica(&self, url: &str, model: &str) -> EventsSpec {
        let host = url
            .parse::<http::Uri>()
            .ok()
            .and_then(|u| u.host().map(str::to_owned))
            .unwrap_or_default();
        EventsSpec {
            bind: Some(self.bind.clone()),
            topic: self
                .topic
                .replace("{host}", &host)
                .replace("{model}", model),
            ..EventsSpec::default()
        }
    }
}

/// The resolved event source of a validated [`EventsSpec`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EventSource {
    Connect(String),
    Bind(String),
    Discover,
}

impl EventsSpec {
    /// The one source the spec names, or why it does not name exactly one.
    pub fn source(&self) -> Result<EventSource, EventSourceError> {
        match (&self.connect, &self.bind, self.discover) {
            (Some(c), None, false) => Ok(EventSource::Connect(c.clone())),
            (None, Some(b), false) => Ok(EventSource::Bind(b.clone())),
            (None, None, true) => Ok(EventSource::Discover),
            (None, None, false) => Err(EventSourceError::None),
            _ => Err(EventSourceError::Several),
        }
    }
}

/// Why an [`EventsSpec`] does not name exactly one source.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EventSourceError {
    #[error("name one of connect, bind or discover")]
    None,
    #[error("name only one of connect, bind or discover")]
    Several,
}

/// One problem in the configuration; `path` locates it (`pools[0].replicas[1].url`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Every problem found, one per line when displayed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(
            f,
            "{n} configuration error{}:",
            if n == 1 { "" } else { "s" }
        )?;
        for e in &self.0 {
            write!(f, "\n  - {e}")?;
        }
        Ok(())
    }
}

struct Errors(Vec<ConfigError>);

impl Errors {
    fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.0.push(ConfigError {
            path: path.into(),
            message: message.into(),
        });
    }
}

impl Config {
    /// A configuration with every default and the given pools.
    pub fn new(pools: Vec<PoolConfig>) -> Self {
        Config {
            listen: default_listen(),
            admin: default_admin(),
            timeouts: Timeouts::default(),
            limits: Limits::default(),
            scrape: Scrape::default(),
            admin_auth: AdminAuth::default(),
            expose_endpoint_header: false,
            threads: None,
            savings: Prices::default(),
            pools,
        }
    }

    /// Reads and validates a file; every problem is in the error.
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                path: path.display().to_string(),
                message: e.to_string(),
            }])
        })?;
        let cfg = Self::parse(&text)?;
        cfg.check()?;
        Ok(cfg)
    }

    /// Parses YAML text without validating values. Structural errors (unknown fields, wrong
    /// types, missing fields) are collected per pool and per replica.
    pub fn parse(text: &str) -> Result<Config, ConfigErrors> {
        let mut errs = Errors(Vec::new());
        let root: Value = match serde_yaml_ng::from_str(text) {
            Ok(Value::Null) => Value::Mapping(Default::default()),
            Ok(v) => v,
            Err(e) => {
                return Err(ConfigErrors(vec![ConfigError {
                    path: String::new(),
                    message: e.to_string(),
                }]))
            }
        };
        let Value::Mapping(mut top) = root else {
            errs.push("", "the file must be a mapping of settings");
            return Err(ConfigErrors(errs.0));
        };
        let pools = top.remove("pools");
        let mut cfg: Config =
            typed(Value::Mapping(top), "", &mut errs).unwrap_or_else(|| Config::new(Vec::new()));
        match pools {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(items)) => {
                for (i, item) in items.into_iter().enumerate() {
                    if let Some(pool) = parse_pool(item, &format!("pools[{i}]"), &mut errs) {
                        cfg.pools.push(pool);
                    }
                }
            }
            Some(_) => errs.push("pools", "must be a list of pools"),
        }
        if errs.0.is_empty() {
            Ok(cfg)
        } else {
            Err(ConfigErrors(errs.0))
        }
    }

    /// [`Config::validate`] as a `Result`.
    pub fn check(&self) -> Result<(), ConfigErrors> {
        self.resolve().map(drop)
    }

    /// Every bad value, not just the first.
    pub fn validate(&self) -> Vec<ConfigError> {
        self.resolve().err().map(|e| e.0).unwrap_or_default()
    }

    /// Validates every value and returns the ones the router runs on in their parsed types:
    /// each string that names something is parsed here and nowhere else.
    pub(crate) fn resolve(&self) -> Result<Resolved, ConfigErrors> {
        let mut errs = Errors(Vec::new());
        self.validate_top(&mut errs);
        let mut names = BTreeSet::new();
        let mut models: BTreeMap<String, String> = BTreeMap::new();
        let mut pools = Vec::with_capacity(self.pools.len());
        for (i, pool) in self.pools.iter().enumerate() {
            let path = format!("pools[{i}]");
            let name = pool.display_name();
            if name.is_empty() {
                errs.push(&path, "a pool needs a name or at least one model");
            } else if !names.insert(name.clone()) {
                errs.push(
                    format!("{path}.name"),
                    format!("pool `{name}` is defined twice"),
                );
            }
            let served = pool.models.iter().chain(pool.lora_adapters.keys());
            for m in served {
                if m.is_empty() {
                    errs.push(format!("{path}.models"), "model names cannot be empty");
                } else if let Some(other) = models.insert(m.clone(), name.clone()) {
                    errs.push(
                        format!("{path}.models"),
                        format!("model `{m}` is already served by pool `{other}`"),
                    );
                }
            }
            if let Some(p) = resolve_pool(pool, &path, &mut errs) {
                pools.push(p);
            }
        }
        let admin_token = self.resolve_admin_token(&mut errs);
        if errs.0.is_empty() {
            Ok(Resolved { pools, admin_token })
        } else {
            Err(ConfigErrors(errs.0))
        }
    }

    /// The admin token: from `admin_auth.token_file`, or given as `admin_auth.token`.
    fn resolve_admin_token(&self, errs: &mut Errors) -> Option<AdminToken> {
        let a = &self.admin_auth;
        match (&a.token_file, &a.token) {
            (None, t) => t.clone(),
            (Some(_), Some(_)) => {
                errs.push(
                    "admin_auth.token_file",
                    "the token is also given by KINFERENCE_ADMIN_TOKEN: pick one",
                );
                None
            }
            (Some(path), None) => match std::fs::read_to_string(path) {
                Ok(text) => AdminToken::new(&text).or_else(|| {
                    errs.push(
                        "admin_auth.token_file",
                        format!("{} holds no token", path.display()),
                    );
                    None
                }),
                Err(e) => {
                    errs.push(
                        "admin_auth.token_file",
                        format!("reading {}: {e}", path.display()),
                    );
                    None
                }
            },
        }
    }

    fn validate_top(&self, errs: &mut Errors) {
        let listen = check_addr(&self.listen, "listen", errs);
        let admin = check_addr(&self.admin, "admin", errs);
        if let (Some(l), Some(a)) = (listen, admin) {
            if l == a && l.port() != 0 {
                errs.push("admin", "must differ from `listen`");
            }
        }
        let t = &self.timeouts;
        for (name, v) in [
            ("connect_ms", t.connect_ms),
            ("first_byte_ms", t.first_byte_ms),
            ("idle_ms", t.idle_ms),
            ("pool_idle_ms", t.pool_idle_ms),
        ] {
            if v == 0 {
                errs.push(format!("timeouts.{name}"), "must be > 0");
            }
        }
        if self.limits.max_body_bytes == 0 {
            errs.push("limits.max_body_bytes", "must be > 0");
        }
        if self.limits.max_attempts == 0 {
            errs.push("limits.max_attempts", "must be >= 1");
        }
        for (name, v) in [
            ("header_read_ms", t.header_read_ms),
            ("body_read_ms", t.body_read_ms),
            ("keep_alive_ms", t.keep_alive_ms),
            ("queue_ms", t.queue_ms),
            ("h2_keep_alive_timeout_ms", t.h2_keep_alive_timeout_ms),
        ] {
            if v == 0 {
                errs.push(format!("timeouts.{name}"), "must be > 0");
            }
        }
        let l = &self.limits;
        if l.max_connections == 0 {
            errs.push("limits.max_connections", "must be >= 1");
        }
        if l.h2_max_concurrent_streams == 0 {
            errs.push("limits.h2_max_concurrent_streams", "must be >= 1");
        }
        if self.threads == Some(0) {
            errs.push("threads", "must be >= 1 (leave it out for one per CPU)");
        }
        if self.scrape.interval_ms > 0 && self.scrape.timeout_ms == 0 {
            errs.push("scrape.timeout_ms", "must be > 0");
        }
        if let Some(problem) = self.savings.problem() {
            errs.push("savings", problem);
        }
        if self.pools.is_empty() {
            errs.push("pools", "at least one pool is needed");
        }
    }
}

/// A validated configuration's values in the types the router runs on, pool by pool in the
/// order of [`Config::pools`].
#[derive(Debug)]
pub(crate) struct Resolved {
    pub pools: Vec<ResolvedPool>,
    /// The admin port's bearer token, if it has one.
    pub admin_token: Option<AdminToken>,
}

/// One pool's parsed values.
#[derive(Debug)]
pub(crate) struct ResolvedPool {
    pub hasher: BlockHasher,
    pub session_header: Option<HeaderName>,
    pub savings: SavingsModel,
    /// In the order of [`PoolConfig::replicas`].
    pub replicas: Vec<ResolvedReplica>,
}

/// One replica's parsed values.
#[derive(Debug)]
pub(crate) struct ResolvedReplica {
    pub endpoint: Endpoint,
    pub events: Option<EventSource>,
}

/// A replica's base URL, parsed: the authority the upstream client dials and the path prefix
/// put before every forwarded path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// The URL as configured, without a trailing `/`.
    pub url: String,
    pub authority: Authority,
    /// `authority` as the `Host` header of forwarded requests (made once, not per request).
    pub host: HeaderValue,
    /// Path prefix of the base URL (empty or `/something`).
    pub prefix: String,
    /// Spoken to with HTTP/2 prior knowledge (h2c) instead of HTTP/1.1.
    pub h2c: bool,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, UrlError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| UrlError::Invalid {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        let owned = || url.to_owned();
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => return Err(UrlError::Https(owned())),
            _ => return Err(UrlError::Scheme(owned())),
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| UrlError::NoHost(owned()))?;
        if authority.port_u16().is_none() {
            return Err(UrlError::NoPort(owned()));
        }
        let host = HeaderValue::from_str(authority.as_str()).map_err(|e| UrlError::Invalid {
            url: owned(),
            reason: e.to_string(),
        })?;
        Ok(Endpoint {
            url: url.trim_end_matches('/').to_owned(),
            authority,
            host,
            prefix: uri.path().trim_end_matches('/').to_owned(),
            h2c: false,
        })
    }
}

/// Why a replica URL cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    #[error("{url:?} is not a URL: {reason}")]
    Invalid { url: String, reason: String },
    #[error("{0}: https upstreams are not supported; terminate TLS in front of the replica")]
    Https(String),
    #[error("{0:?} must start with http://")]
    Scheme(String),
    #[error("{0:?} has no host")]
    NoHost(String),
    #[error("{0:?} needs a port (vLLM serves on 8000 by default)")]
    NoPort(String),
}

fn typed<T: DeserializeOwned>(v: Value, path: &str, errs: &mut Errors) -> Option<T> {
    match serde_yaml_ng::from_value(v) {
        Ok(t) => Some(t),
        Err(e) => {
            errs.push(path, e.to_string());
            None
        }
    }
}

fn parse_pool(item: Value, path: &str, errs: &mut Errors) -> Option<PoolConfig> {
    let Value::Mapping(mut map) = item else {
        errs.push(path, "a pool must be a mapping");
        return None;
    };
    let replicas = map.remove("replicas");
    let mut pool: Option<PoolConfig> = typed(Value::Mapping(map), path, errs);
    match replicas {
        None | Some(Value::Null) => {}
        Some(Value::Sequence(items)) => {
            for (j, r) in items.into_iter().enumerate() {
                let rpath = format!("{path}.replicas[{j}]");
                // A bare string is a replica URL.
                let r = match r {
                    Value::String(s) => Some(ReplicaSpec::new(&s)),
                    other => typed(other, &rpath, errs),
                };
                if let (Some(p), Some(r)) = (pool.as_mut(), r) {
                    p.replicas.push(r);
                }
            }
        }
        Some(_) => errs.push(format!("{path}.replicas"), "must be a list of replicas"),
    }
    if let Some(p) = pool.as_mut() {
        p.apply_pool_events();
    }
    pool
}

fn check_addr(v: &str, path: &str, errs: &mut Errors) -> Option<SocketAddr> {
    match v.parse::<SocketAddr>() {
        Ok(a) => Some(a),
        Err(_) => {
            errs.push(path, format!("{v:?} is not an address like 127.0.0.1:8080"));
            None
        }
    }
}

fn resolve_pool(pool: &PoolConfig, path: &str, errs: &mut Errors) -> Option<ResolvedPool> {
    let before = errs.0.len();
    if pool.models.is_empty() {
        errs.push(format!("{path}.models"), "at least one model is needed");
    }
    if pool.tokenizer.as_os_str().is_empty() {
        errs.push(
            format!("{path}.tokenizer"),
            format!("required: the directory of the model's tokenizer.json{FROM_KINFERENCE_POOL}"),
        );
    } else if !pool.tokenizer.join("tokenizer.json").is_file() {
        errs.push(
            format!("{path}.tokenizer"),
            format!("{} has no tokenizer.json", pool.tokenizer.display()),
        );
    }
    let hasher = resolve_hasher(pool, path, errs);
    for e in pool.policy.validate() {
        errs.push(format!("{path}.policy.{}", e.field), e.problem);
    }
    let session_header = pool.session_header.as_ref().and_then(|h| {
        HeaderName::from_bytes(h.as_bytes())
            .map_err(|_| {
                errs.push(
                    format!("{path}.session_header"),
                    format!("{h:?} is not a header name"),
                )
            })
            .ok()
    });
    for (name, lora_path) in &pool.lora_adapters {
        if lora_path.is_empty() {
            errs.push(
                format!("{path}.lora_adapters.{name}"),
                "the adapter path (as given to vLLM) cannot be empty",
            );
        }
    }
    match (&pool.inference_pool, pool.replicas.is_empty()) {
        (None, true) => errs.push(
            format!("{path}.replicas"),
            "at least one replica is needed (or an inferencePool to discover them from)",
        ),
        (Some(_), false) => errs.push(
            format!("{path}.inferencePool"),
            "list replicas or name an inferencePool, not both",
        ),
        (Some(r), true) if r.name.is_empty() => {
            errs.push(format!("{path}.inferencePool.name"), "cannot be empty")
        }
        _ => {}
    }
    let mut urls = BTreeSet::new();
    let mut replicas = Vec::with_capacity(pool.replicas.len());
    for (j, r) in pool.replicas.iter().enumerate() {
        let rpath = format!("{path}.replicas[{j}]");
        if let Some(r) = resolve_replica(r, &rpath, errs) {
            if !urls.insert(r.endpoint.url.clone()) {
                errs.push(
                    format!("{rpath}.url"),
                    format!("{} is listed twice", pool.replicas[j].url),
                );
            }
            replicas.push(r);
        }
    }
    check_shared_binds(pool, path, errs);
    let mut seen = BTreeSet::new();
    for (j, b) in pool.baselines.iter().enumerate() {
        if let Err(e) = kinference_policy::Shadow::new(b, 1) {
            errs.push(format!("{path}.baselines[{j}]"), e.to_string());
        } else if !seen.insert(b.as_str()) {
            errs.push(
                format!("{path}.baselines[{j}]"),
                format!("{b} is listed twice"),
            );
        }
    }
    pool.scale_in.check(&format!("{path}.scale_in"), errs);
    if pool.scale_in.pod_deletion_cost && pool.inference_pool.is_none() {
        errs.push(
            format!("{path}.scale_in.pod_deletion_cost"),
            "needs an inferencePool: only discovered pods can be annotated",
        );
    }
    if pool.warm.mode != WarmMode::Off && pool.warm.max_in_flight == 0 {
        errs.push(
            format!("{path}.warm.max_in_flight"),
            "must be at least 1 while warming is on",
        );
    }
    let savings = SavingsModel::builtin(&pool.savings_profile)
        .map_err(|e| errs.push(format!("{path}.savings_profile"), e.to_string()))
        .ok();
    let (hasher, savings) = (hasher?, savings?);
    (errs.0.len() == before).then_some(ResolvedPool {
        hasher,
        session_header,
        savings,
        replicas,
    })
}

/// Where a discovered pool's missing tokenizer or block size can come from.
const FROM_KINFERENCE_POOL: &str =
    " (an inferencePool pool takes it from the KinferencePool naming its InferencePool, if any)";

/// The pool's hasher; each bad hash setting is reported at its own path.
fn resolve_hasher(pool: &PoolConfig, path: &str, errs: &mut Errors) -> Option<BlockHasher> {
    if pool.block_size == 0 {
        errs.push(
            format!("{path}.block_size"),
            format!("must be > 0: the replicas' --block-size{FROM_KINFERENCE_POOL}"),
        );
    }
    let algo = HashAlgo::from_str(&pool.hash_algo)
        .map_err(|e| errs.push(format!("{path}.hash_algo"), e.to_string()))
        .ok();
    let format = ExtraKeysFormat::from_str(&pool.extra_keys_format)
        .map_err(|e| errs.push(format!("{path}.extra_keys_format"), e.to_string()))
        .ok();
    let (algo, format) = (algo?, format?);
    if pool.block_size == 0 {
        return None;
    }
    BlockHasher::new(
        algo,
        pool.block_size as usize,
        pool.hash_seed.as_deref(),
        format,
    )
    .map_err(|e| errs.push(format!("{path}.hash_seed"), e.to_string()))
    .ok()
}

fn resolve_replica(r: &ReplicaSpec, path: &str, errs: &mut Errors) -> Option<ResolvedReplica> {
    let before = errs.0.len();
    let endpoint = Endpoint::parse(&r.url)
        .map_err(|e| errs.push(format!("{path}.url"), e.to_string()))
        .ok()
        .map(|e| Endpoint {
            h2c: r.protocol == UpstreamProtocol::H2c,
            ..e
        });
    if r.dp_ranks == 0 || r.dp_ranks > 1024 {
        errs.push(format!("{path}.dp_ranks"), "must be within 1..=1024");
    }
    let events = r
        .events
        .as_ref()
        .and_then(|ev| resolve_events(ev, r.dp_ranks, &format!("{path}.events"), errs));
    let endpoint = endpoint?;
    (errs.0.len() == before).then_some(ResolvedReplica { endpoint, events })
}

/// One pool resolved on its own, as `pools[i]` of a file would be: a running pool's new
/// settings ([`crate::PoolMembers::reconfigure`]). Errors are at `pool.FIELD`.
pub(crate) fn resolve_one_pool(pool: &PoolConfig) -> Result<ResolvedPool, ConfigErrors> {
    let mut errs = Errors(Vec::new());
    match resolve_pool(pool, "pool", &mut errs) {
        Some(rp) if errs.0.is_empty() => Ok(rp),
        _ => Err(ConfigErrors(errs.0)),
    }
}

/// One replica resolved on its own: a discovered pool's joiner, validated as a configured
/// replica would be.
pub(crate) fn resolve_one(r: &ReplicaSpec) -> Result<ResolvedReplica, ConfigErrors> {
    let mut errs = Errors(Vec::new());
    match resolve_replica(r, "replica", &mut errs) {
        Some(rr) if errs.0.is_empty() => Ok(rr),
        _ => Err(ConfigErrors(errs.0)),
    }
}

#[cfg(test)]
mod inference_pool_tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn pool(extra: &str) -> String {
        let tok = kinference_testkit::tokenizer_dir();
        format!(
            "pools:\n  - models: [m]\n    tokenizer: {}\n    block_size: 16\n{extra}",
            tok.display()
        )
    }

    #[test]
    fn a_pool_names_an_inference_pool_instead_of_replicas() {
        let cfg = Config::parse(&pool(
            "    inferencePool: {namespace: models, name: llama}\n",
        ))
        .unwrap();
        cfg.check().unwrap();
        let r = cfg.pools[0].inference_pool.clone().unwrap();
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_str()),
            (Some("models"), "llama")
        );

        let both =
            pool("    inferencePool: {name: llama}\n    replicas: [http://127.0.0.1:8000]\n");
        let errs = Config::parse(&both).unwrap().validate();
        assert_eq!(errs[0].path, "pools[0].inferencePool", "{errs:?}");
        let neither = Config::parse(&pool("")).unwrap().validate();
        assert!(neither[0].message.contains("inferencePool"), "{neither:?}");
    }

    #[test]
    fn scale_in_writes_pods_only_of_a_discovered_pool_and_checks_its_numbers() {
        let cfg = Config::parse(&pool(
            "    inferencePool: {name: llama}\n    scale_in: {pod_deletion_cost: true, half_life_s: 60}\n",
        ))
        .unwrap();
        cfg.check().unwrap();
        let s = &cfg.pools[0].scale_in;
        assert!(s.pod_deletion_cost);
        assert_eq!(s.half_life(), Duration::from_secs(60));
        assert_eq!(s.interval(), Duration::from_secs(30));

        let listed = pool(
            "    replicas: [http://127.0.0.1:8000]\n    scale_in: {pod_deletion_cost: true}\n",
        );
        let errs = Config::parse(&listed).unwrap().validate();
        assert_eq!(
            errs[0].path, "pools[0].scale_in.pod_deletion_cost",
            "{errs:?}"
        );
        let bad = pool(
            "    replicas: [http://127.0.0.1:8000]\n    \
             scale_in: {half_life_s: 0, interval_s: -1, hysteresis: 1, max_patches: 0}\n",
        );
        let paths: Vec<String> = Config::parse(&bad)
            .unwrap()
            .validate()
            .into_iter()
            .map(|e| e.path)
            .collect();
        for f in ["half_life_s", "interval_s", "hysteresis", "max_patches"] {
            assert!(
                paths.contains(&format!("pools[0].scale_in.{f}")),
                "{f}: {paths:?}"
            );
        }
    }

    #[test]
    fn a_discovered_pool_may_leave_tokenizer_and_block_size_to_its_kinference_pool() {
        let text = "pools:\n  - models: [m]\n    inferencePool: {name: llama}\n";
        let mut cfg = Config::parse(text).unwrap();
        // Until a KinferencePool supplies them, the check says what is missing and where from.
        let errs = cfg.validate();
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            ["pools[0].tokenizer", "pools[0].block_size"],
            "{errs:?}"
        );
        assert!(
            errs.iter().all(|e| e.message.contains("KinferencePool")),
            "{errs:?}"
        );
        // What the router does with a KinferencePool's spec before checking.
        cfg.pools[0].tokenizer = kinference_testkit::tokenizer_dir();
        cfg.pools[0].block_size = 16;
        cfg.check().unwrap();
    }

    #[test]
    fn warming_is_off_unless_a_pool_asks_for_it() {
        let replicas = "    replicas: [http://127.0.0.1:8000]\n";
        let cfg = Config::parse(&pool(replicas)).unwrap();
        assert_eq!(cfg.pools[0].warm, WarmConfig::default());
        assert_eq!(cfg.pools[0].warm.mode, WarmMode::Off);
        let on = pool(&format!(
            "{replicas}    warm: {{mode: next, cooldown_ms: 5000, priority: 1}}\n"
        ));
        let cfg = Config::parse(&on).unwrap();
        cfg.check().unwrap();
        let w = &cfg.pools[0].warm;
        assert_eq!(
            (w.mode, w.cooldown(), w.priority),
            (WarmMode::Next, Duration::from_secs(5), Some(1))
        );
        assert_eq!(w.max_in_flight, 4);
        let none_in_flight = pool(&format!(
            "{replicas}    warm: {{mode: chosen, max_in_flight: 0}}\n"
        ));
        let errs = Config::parse(&none_in_flight).unwrap().validate();
        assert_eq!(errs[0].path, "pools[0].warm.max_in_flight", "{errs:?}");
        assert!(Config::parse(&pool(&format!("{replicas}    warm: {{mode: always}}\n"))).is_err());
        assert_eq!("next".parse::<WarmMode>(), Ok(WarmMode::Next));
        assert!("hot".parse::<WarmMode>().is_err());
    }
}

fn resolve_events(
    ev: &EventsSpec,
    dp_ranks: u32,
    path: &str,
    errs: &mut Errors,
) -> Option<EventSource> {
    let source = ev
        .source()
        .map_err(|e| errs.push(path, e.to_string()))
        .ok()?;
    match &source {
        EventSource::Connect(ep) | EventSource::Bind(ep) => {
            check_endpoint(ep, dp_ranks, path, errs);
            if let Some(rep) = &ev.replay {
                check_endpoint(rep, dp_ranks, &format!("{path}.replay"), errs);
            }
        }
        EventSource::Discover if ev.replay.is_some() => errs.push(
            format!("{path}.replay"),
            "comes from the replica with `discover`; leave it out",
        ),
        EventSource::Discover => {}
    }
    Some(source)
}

/// Replicas binding one endpoint (their publishers connect to it) share its socket and are
/// told apart only by topic: each needs its own, non-empty one.
fn check_shared_binds(pool: &PoolConfig, path: &str, errs: &mut Errors) {
    let mut seen: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    let mut shared: BTreeMap<&str, usize> = BTreeMap::new();
    let binds = pool.replicas.iter().enumerate().filter_map(|(j, r)| {
        let ev = r.events.as_ref()?;
        let bind = ev.bind.as_deref().filter(|b| !b.ends_with(":0"))?;
        Some((j, bind, ev.topic.as_str()))
    });
    let binds: Vec<_> = binds.collect();
    for (_, bind, _) in &binds {
        *shared.entry(bind).or_default() += 1;
    }
    for (j, bind, topic) in binds {
        if shared[bind] < 2 {
            continue;
        }
        let tpath = format!("{path}.replicas[{j}].events.topic");
        if topic.is_empty() {
            errs.push(
                tpath,
                format!("{bind} is bound for several replicas: each needs its own topic"),
            );
        } else if let Some(first) = seen.insert((bind, topic), j) {
            errs.push(
                tpath,
                format!("topic {topic:?} at {bind} is also replica {first}'s"),
            );
        }
    }
}

fn check_endpoint(ep: &str, dp_ranks: u32, path: &str, errs: &mut Errors) {
    let Some(rest) = ep.strip_prefix("tcp://") else {
        errs.push(path, format!("{ep:?} must be a tcp:// endpoint"));
        return;
    };
    match rest.rsplit_once(':').map(|(_, p)| p.parse::<u16>()) {
        Some(Ok(port)) => {
            if port == 0 && dp_ranks > 1 {
                errs.push(
                    path,
                    format!("{ep}: port 0 leaves no base port for DP ranks above 0"),
                );
            }
        }
        _ => errs.push(path, format!("{ep:?} needs a numeric port")),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn tokenizer_dir() -> String {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/golden/real_vllm_0.32/tiny-llama-tokenizer")
            .display()
            .to_string()
    }

    #[test]
    fn example_file_parses_and_validates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/kinference.yaml");
        let text = std::fs::read_to_string(path).unwrap();
        // The example points at a model directory of a real deployment; swap in one that exists.
        let text = text.replace("/models/llama-3.1-8b-instruct", &tokenizer_dir());
        let text = text.replace("/models/qwen3-8b", &tokenizer_dir());
        let cfg = Config::parse(&text).unwrap();
        assert_eq!(cfg.validate(), vec![]);
        assert_eq!(cfg.pools.len(), 2);
        assert_eq!(cfg.pools[0].replicas.len(), 3);
        assert_eq!(cfg.pools[0].replicas[2].dp_ranks, 2);
        assert_eq!(cfg.pools[0].policy.name(), "precise");
        assert_eq!(
            cfg.pools[1].replicas[0].events.as_ref().unwrap().source(),
            Ok(EventSource::Discover)
        );
    }

    #[test]
    fn pool_events_bind_one_endpoint_and_give_each_replica_its_topic() {
        let text = format!(
            r#"
pools:
  - models: [tiny]
    tokenizer: {tok}
    block_size: 16
    events: {{bind: "tcp://*:5557", topic: "kv@{{host}}@{{model}}"}}
    replicas:
      - http://10.0.0.5:8000
      - http://10.0.0.6:8000
      - url: http://10.0.0.7:8000
        events: {{connect: tcp://10.0.0.7:5557}}
"#,
            tok = tokenizer_dir()
        );
        let cfg = Config::parse(&text).unwrap();
        assert_eq!(cfg.validate(), vec![]);
        let ev = |j: usize| cfg.pools[0].replicas[j].events.clone().unwrap();
        assert_eq!(ev(0).source(), Ok(EventSource::Bind("tcp://*:5557".into())));
        assert_eq!(ev(0).topic, "kv@10.0.0.5@tiny");
        assert_eq!(ev(1).topic, "kv@10.0.0.6@tiny");
        // A replica's own setting wins.
        assert_eq!(
            ev(2).source(),
            Ok(EventSource::Connect("tcp://10.0.0.7:5557".into()))
        );

        // One topic for all replicas of a shared endpoint cannot tell them apart.
        let same = text.replace("kv@{host}@{model}", "kv-events");
        let errs = Config::parse(&same).unwrap().validate();
        assert_eq!(errs.len(), 1, "{errs:?}");
        assert_eq!(errs[0].path, "pools[0].replicas[1].events.topic");
        let none = text.replace("kv@{host}@{model}", "");
        let errs = Config::parse(&none).unwrap().validate();
        assert_eq!(errs.len(), 2, "{errs:?}");
    }

    #[test]
    fn structural_errors_in_several_places_are_all_reported() {
        let text = format!(
            r#"
listen: 127.0.0.1:8080
pools:
  - models: [a]
    tokenizer: {tok}
    block_size: 16
    colour: blue
    replicas: [http://127.0.0.1:8001]
  - models: [b]
    tokenizer: {tok}
    block_size: 16
    replicas:
      - url: http://127.0.0.1:8002
        dp: 2
      - url: http://127.0.0.1:8003
        events: {{connect: tcp://127.0.0.1:5557}}
  - models: [c]
    tokenizer: {tok}
    block_size: sixteen
    replicas: [http://127.0.0.1:8004]
"#,
            tok = tokenizer_dir()
        );
        let errs = Config::parse(&text).unwrap_err().0;
        let paths: Vec<&str> = errs.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(
            paths,
            ["pools[0]", "pools[1].replicas[0]", "pools[2]"],
            "{errs:?}"
        );
        assert!(errs[0].message.contains("colour"), "{}", errs[0]);
        assert!(errs[1].message.contains("dp"), "{}", errs[1]);
    }

    #[test]
    fn every_bad_value_is_reported_at_once() {
        let text = format!(
            r#"
listen: nowhere
threads: 0
timeouts: {{connect_ms: 0}}
limits: {{max_attempts: 0}}
pools:
  - models: [a]
    tokenizer: /does/not/exist
    block_size: 0
    hash_algo: md5
    policy: {{kind: precise, fair_share_cap: 0.5}}
    replicas:
      - url: https://127.0.0.1:8001
      - url: http://127.0.0.1:8002
        events: {{connect: tcp://h:5557, discover: true}}
  - models: [b, a]
    tokenizer: {tok}
    block_size: 16
    hash_algo: xxhash
    replicas:
      - url: http://127.0.0.1:8003
        dp_ranks: 2
        events: {{bind: "tcp://0.0.0.0:0"}}
"#,
            tok = tokenizer_dir()
        );
        let cfg = Config::parse(&text).unwrap();
        let errs: Vec<String> = cfg.validate().iter().map(ToString::to_string).collect();
        let expect = [
            "listen:",
            "timeouts.connect_ms:",
            "limits.max_attempts:",
            "threads:",
            "pools[0].tokenizer:",
            "pools[0].block_size:",
            "pools[0].hash_algo:",
            "pools[0].policy.fair_share_cap:",
            "pools[0].replicas[0].url:",
            "pools[0].replicas[1].events:",
            "pools[1].models: model `a` is already served",
            "pools[1].hash_seed:",
            "pools[1].replicas[0].events:",
        ];
        for e in expect {
            assert!(
                errs.iter().any(|got| got.starts_with(e)),
                "missing {e:?} in {errs:#?}"
            );
        }
        assert_eq!(errs.len(), expect.len(), "{errs:#?}");
    }

    #[test]
    fn limits_and_admin_auth_parse_and_validate() {
        let dir = std::env::temp_dir().join(format!("kinf-admin-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let token = dir.join("token");
        std::fs::write(&token, "  s3cret\n").unwrap();
        let text = format!(
            r#"
timeouts: {{header_read_ms: 5000, keep_alive_ms: 30000, queue_ms: 100}}
limits: {{max_connections: 100, max_in_flight: 8, max_queue: 0, min_body_rate_bytes_per_s: 0,
         max_in_flight_per_replica: 256}}
admin_auth: {{token_file: {token}, open_metrics: true}}
pools:
  - models: [a]
    tokenizer: {tok}
    block_size: 16
    replicas: [http://127.0.0.1:8001]
"#,
            token = token.display(),
            tok = tokenizer_dir()
        );
        let cfg = Config::parse(&text).unwrap();
        assert_eq!(cfg.limits.max_in_flight, 8);
        assert_eq!(cfg.limits.max_in_flight_per_replica, 256);
        assert_eq!(
            Limits::default().max_in_flight_per_replica,
            0,
            "off by default"
        );
        assert_eq!(cfg.timeouts.header_read(), Duration::from_secs(5));
        let resolved = cfg.resolve().unwrap();
        assert_eq!(resolved.admin_token, AdminToken::new("s3cret"));
        assert_eq!(
            format!("{:?}", resolved.admin_token),
            "Some(AdminToken(..))"
        );

        let mut both = cfg.clone();
        both.admin_auth.token = AdminToken::new("other");
        assert_eq!(both.validate()[0].path, "admin_auth.token_file");
        std::fs::write(&token, "\n").unwrap();
        assert!(
            cfg.validate()[0].message.contains("no token"),
            "{:?}",
            cfg.validate()
        );
        std::fs::remove_dir_all(&dir).unwrap();

        let mut zero = cfg.clone();
        zero.admin_auth = AdminAuth::default();
        zero.limits.max_connections = 0;
        zero.timeouts.header_read_ms = 0;
        let paths: Vec<String> = zero.validate().into_iter().map(|e| e.path).collect();
        assert_eq!(
            paths,
            ["timeouts.header_read_ms", "limits.max_connections"],
            "{paths:?}"
        );
    }

    #[test]
    fn replica_flag() {
        let r = ReplicaSpec::from_flag(
            "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,replay=tcp://127.0.0.1:5558,dp=2",
        )
        .unwrap();
        assert_eq!(r.url, "http://127.0.0.1:8001");
        assert_eq!(r.dp_ranks, 2);
        let ev = r.events.unwrap();
        assert_eq!(
            ev.source(),
            Ok(EventSource::Connect("tcp://127.0.0.1:5557".into()))
        );
        assert_eq!(ev.replay.as_deref(), Some("tcp://127.0.0.1:5558"));
        let r = ReplicaSpec::from_flag("http://h:1,events=discover,topic=kv").unwrap();
        assert_eq!(
            r.events.as_ref().unwrap().source(),
            Ok(EventSource::Discover)
        );
        assert_eq!(r.events.unwrap().topic, "kv");
        assert!(ReplicaSpec::from_flag("http://h:1")
            .unwrap()
            .events
            .is_none());
        assert!(ReplicaSpec::from_flag("http://h:1,colour=blue").is_err());
        assert!(ReplicaSpec::from_flag("http://h:1,dp=x").is_err());
        let h2 = ReplicaSpec::from_flag("http://h:1,protocol=h2c").unwrap();
        assert_eq!(h2.protocol, UpstreamProtocol::H2c);
        assert!(h2.events.is_none());
        assert!(ReplicaSpec::from_flag("http://h:1,protocol=h3").is_err());
        let file: ReplicaSpec =
            serde_yaml_ng::from_str("{url: 'http://h:1', protocol: h2c}").unwrap();
        assert_eq!(file.protocol, UpstreamProtocol::H2c);
        assert!(resolve_one(&file).unwrap().endpoint.h2c);
    }

    #[test]
    fn policy_flag() {
        assert_eq!(parse_policy("round-robin").unwrap().name(), "round-robin");
        let p = parse_policy("{kind: precise, load_weight_tokens: 512}").unwrap();
        let PolicyConfig::Precise(c) = p else {
            panic!("{p:?}")
        };
        assert_eq!(c.load_weight_tokens, 512.0);
        assert!(parse_policy("fastest").is_err());
        assert!(parse_policy("{kind: precise, fair_share_cap: 0.1}").is_err());
    }
}
