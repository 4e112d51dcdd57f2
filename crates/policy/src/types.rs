//! The values a policy reads (candidates, request context) and returns (a [`Decision`]).

use kinference_index::{TierCounts, WorkerId};
use kinference_vllm::BlockHash;
use serde::Serialize;

/// What the caller knows about one worker's load when a request arrives.
///
/// `running`, `waiting` and `kv_usage` are scraped from the replica's `/metrics` (so they lag);
/// `in_flight` and `in_flight_prefill_tokens` are the router's own, exact and immediate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Load {
    pub running: u32,
    pub waiting: u32,
    /// Fraction of KV-cache blocks in use, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub kv_usage: f64,
    /// Requests this router sent that have not finished.
    pub in_flight: u32,
    /// Uncached prompt tokens of this router's requests still waiting for their first token.
    pub in_flight_prefill_tokens: u64,
}

impl Load {
    /// Outstanding requests: the larger of the replica's own count and the router's, since
    /// the scrape lags and other clients may share the replica.
    pub fn outstanding(&self) -> f64 {
        f64::from(
            self.in_flight
                .max(self.running.saturating_add(self.waiting)),
        )
    }
}

/// One worker the request may go to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    pub worker: WorkerId,
    pub load: Load,
    /// The request's cached prefix on this worker from the event-fed index, in blocks.
    pub cache: TierCounts,
    /// False when the router cannot reproduce this worker's block hashes (block size, hash
    /// algorithm or seed differ): its cache is ignored and it is routed by load only.
    pub scorable: bool,
}

impl Candidate {
    pub fn new(worker: WorkerId) -> Self {
        Candidate {
            worker,
            load: Load::default(),
            cache: TierCounts::default(),
            scorable: true,
        }
    }
}

/// The request as the policy sees it.
#[derive(Clone, Copy, Debug)]
pub struct RequestCtx<'a> {
    /// The request's block hashes, in prompt order (full blocks only).
    pub hashes: &'a [BlockHash],
    pub prompt_tokens: u32,
    pub block_size: u32,
    /// The session key (e.g. a header value) for session affinity.
    pub session: Option<&'a str>,
    /// A number that differs between consecutive requests (a request counter): breaks ties
    /// between equal candidates by rotation, so cold requests do not all pick the same worker,
    /// and drives round-robin — without the policy keeping a counter of its own.
    pub ticket: u64,
}

/// Why the first-ranked worker won.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It holds the longest cached prefix among workers within the load cap.
    CachedPrefix,
    /// Some worker within the load cap holds more of the prefix, but is busier by more than
    /// the cache is worth.
    LoadOverCache,
    /// A worker over the load cap holds more of the prefix: the prefix is hot and spreads.
    PrefixSpread,
    /// Nothing of the prefix is cached anywhere (or nowhere scorable): least loaded wins.
    NoCache,
    RoundRobin,
    LeastLoad,
    SessionAffinity,
    /// Session affinity without a session key: least loaded wins.
    NoSession,
    /// No available candidate.
    NoCandidates,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CachedPrefix => "cached_prefix",
            Reason::LoadOverCache => "load_over_cache",
            Reason::PrefixSpread => "prefix_spread",
            Reason::NoCache => "no_cache",
            Reason::RoundRobin => "round_robin",
            Reason::LeastLoad => "least_load",
            Reason::SessionAffinity => "session_affinity",
            Reason::NoSession => "no_session",
            Reason::NoCandidates => "no_candidates",
        }
    }
}

/// One candidate's evaluation, for explanation and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Score {
    #[serde(serialize_with = "ser_worker")]
    pub worker: WorkerId,
    /// Prefix blocks the policy credited as cached on the GPU (index, or router-side record).
    pub gpu_blocks: u32,
    /// Further prefix blocks cached in a lower tier (CPU, storage), credited at a discount.
    pub offloaded_blocks: u32,
    /// Prefix blocks assumed present because a recent request with them was sent here.
    pub speculative_blocks: u32,
    /// Prompt tokens the policy expects the worker to serve from cache.
    pub predicted_cached_tokens: u32,
    /// Outstanding requests (see [`Load::outstanding`]).
    pub load: f64,
    /// Above the fair-share cap: ranked after every worker within it.
    pub over_cap: bool,
    pub scorable: bool,
    /// Higher is better; comparable only within one decision.
    pub value: f64,
}

fn ser_worker<S: serde::Serializer>(w: &WorkerId, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(w)
}

/// The outcome of [`crate::Policy::select`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Best first; the caller falls back down the list while nothing was sent upstream.
    #[serde(serialize_with = "ser_workers")]
    pub ranked: Vec<WorkerId>,
    pub reason: Reason,
    /// In the order of `ranked`.
    pub scores: Vec<Score>,
    /// The policy's name (`precise`, `approximate`, ...).
    pub policy: &'static str,
}

fn ser_workers<S: serde::Serializer>(ws: &[WorkerId], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(ws.iter().map(|w| w.to_string()))
}

impl Decision {
    /// The chosen worker, if any candidate was available.
    pub fn chosen(&self) -> Option<WorkerId> {
        self.ranked.first().copied()
    }

    /// The chosen worker's score.
    pub fn chosen_score(&self) -> Option<&Score> {
        self.scores.first()
    }

    pub(crate) fn empty(policy: &'static str) -> Self {
        Decision {
            ranked: Vec::new(),
            reason: Reason::NoCandidates,
            scores: Vec::new(),
            policy,
        }
    }
}
