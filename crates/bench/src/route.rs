//! Routing in simulated time: the [`SimRouter`] seam between the simulated fleet and a policy,
//! kinference's policies behind it ([`PolicyRouter`]), and the capped-greedy oracle
//! ([`OracleRouter`]), a reference that reads the engines' true cache state.
//!
//! ```text
//!   arrival ──▶ RouteInput { hashes, digests, loads } ──▶ SimRouter::route ──▶ engine index
//!   engine step ends ──▶ SimRouter::observe(engine, StepOutput)   (KV events → index)
//! ```
//!
//! What a policy sees is what a router would see: the precise policy learns each engine's
//! cache only from the KV-event batches the engine publishes at the end of its steps (so it
//! lags by up to a step, as in production); load is the engines' request gauges and the
//! router's own in-flight counts. Only the oracle reads the block pools directly.

use std::time::Duration;

use kinference_index::{Index, ReplicaId, WorkerId};
use kinference_policy::{Candidate, Load, Policy, PolicyConfig, RequestCtx};
use kinference_sim::{FleetView, StepOutput};
use kinference_vllm::{BlockDigest, BlockHash, DpRank};

use crate::error::BenchError;

/// The worker an engine publishes as: one replica per engine, data-parallel rank 0.
pub fn worker(engine: usize) -> WorkerId {
    WorkerId::new(
        ReplicaId(u32::try_from(engine).unwrap_or(u32::MAX)),
        DpRank(0),
    )
}

/// The router's own view of one engine's load.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RouterLoad {
    /// Requests routed there and not finished.
    pub in_flight: u32,
    /// Uncached prompt tokens (as predicted at routing) of requests without a first token.
    pub in_flight_prefill_tokens: u64,
    /// Requests routed there since the start.
    pub routed: u64,
}

/// Everything a simulated router gets for one request.
#[derive(Debug)]
pub struct RouteInput<'a> {
    /// Position of the request in the workload: a ticket that differs between requests.
    pub seq: u64,
    pub prompt_tokens: usize,
    pub session: Option<u64>,
    /// The prompt's full-block digests (the engines' block size, hash algorithm and seed).
    pub digests: &'a [BlockDigest],
    /// The same blocks as the integers KV events carry.
    pub hashes: &'a [BlockHash],
    pub loads: &'a [RouterLoad],
    pub block_size: usize,
}

/// What a routing decision predicts, for the router's in-flight bookkeeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routed {
    pub engine: usize,
    /// Prompt tokens the router expects the engine to find cached.
    pub predicted_cached_tokens: usize,
}

/// A routing policy driven by the simulated fleet.
pub trait SimRouter {
    fn name(&self) -> &str;
    /// Whether `route` reads `RouteInput::digests`/`hashes` (hashing is skipped otherwise).
    fn needs_hashes(&self) -> bool;
    fn route(&mut self, input: &RouteInput<'_>, view: &FleetView<'_>) -> Routed;
    /// A finished engine step, with its KV events.
    fn observe(&mut self, _engine: usize, _out: &StepOutput) {}
}

/// The policies a simulated run can use.
#[derive(Clone, Debug, PartialEq)]
pub enum SimPolicy {
    /// One of kinference's policies, reported under `label`.
    Kinference { config: PolicyConfig, label: String },
    /// Longest true cached prefix among engines whose routed-request count stays within
    /// `1 + eps` of the fair share (ties to the fewest routed).
    Oracle { eps: f64 },
}

impl SimPolicy {
    /// Parses a policy name: kinference's (`round-robin`, `least-load`, `session-affinity`,
    /// `approximate`, `precise`) or `oracle`.
    pub fn from_name(name: &str) -> Result<SimPolicy, BenchError> {
        if name == "oracle" || name == "capped-greedy-oracle" {
            return Ok(SimPolicy::Oracle { eps: 0.1 });
        }
        PolicyConfig::from_name(name)
            .map(|config| SimPolicy::Kinference {
                config,
                label: name.to_string(),
            })
            .ok_or_else(|| {
                BenchError::Config(format!(
                    "unknown policy {name:?} (round-robin, least-load, session-affinity, \
                     approximate, precise, oracle)"
                ))
            })
    }

    /// A kinference policy from its configuration as JSON (the router's config-file schema,
    /// e.g. `{"kind": "precise", "fair_share_cap": 1.5}`), reported under `label`.
    pub fn from_json(label: &str, json: &str) -> Result<SimPolicy, BenchError> {
        let config: PolicyConfig = serde_json::from_str(json)
            .map_err(|e| BenchError::Config(format!("policy {label}: {e}")))?;
        Ok(SimPolicy::Kinference {
            config,
            label: label.to_string(),
        })
    }

    /// The name results are reported under.
    pub fn name(&self) -> &str {
        match self {
            SimPolicy::Kinference { label, .. } => label,
            SimPolicy::Oracle { .. } => "oracle",
        }
    }

    pub fn router(&self) -> Result<Box<dyn SimRouter>, BenchError> {
        match self {
            SimPolicy::Kinference { config, label } => {
                let errs = config.validate();
                if !errs.is_empty() {
                    let all: Vec<String> = errs.iter().map(ToString::to_string).collect();
                    return Err(BenchError::Config(format!("{label}: {}", all.join("; "))));
                }
                Ok(Box::new(
                    PolicyRouter::new(config.clone()).with_label(label),
                ))
            }
            SimPolicy::Oracle { eps } => {
                if !(eps.is_finite() && *eps >= 0.0) {
                    return Err(BenchError::Config(format!("oracle eps {eps} must be >= 0")));
                }
                Ok(Box::new(OracleRouter { eps: *eps }))
            }
        }
    }
}

/// A kinference policy with, for the precise one, a block index fed by the engines' events.
#[derive(Debug)]
pub struct PolicyRouter {
    policy: Policy,
    label: String,
    index: Option<Index>,
    candidates: Vec<Candidate>,
    last_expire: Duration,
}

impl PolicyRouter {
    pub fn new(config: PolicyConfig) -> Self {
        let policy = Policy::new(config);
        let index = policy.uses_index().then(Index::new);
        PolicyRouter {
            label: policy.name().to_string(),
            policy,
            index,
            candidates: Vec::new(),
            last_expire: Duration::ZERO,
        }
    }

    /// Reports results under `label` instead of the policy's name.
    pub fn with_label(mut self, label: &str) -> Self {
        self.label = label.to_string();
        self
    }

    /// The event-fed index (precise policy only).
    pub fn index(&self) -> Option<&Index> {
        self.index.as_ref()
    }
}

impl SimRouter for PolicyRouter {
    fn name(&self) -> &str {
        &self.label
    }

    fn needs_hashes(&self) -> bool {
        matches!(
            self.policy.config(),
            PolicyConfig::Precise(_) | PolicyConfig::Approximate(_)
        )
    }

    fn route(&mut self, input: &RouteInput<'_>, view: &FleetView<'_>) -> Routed {
        let now = Duration::from_nanos(view.now().as_nanos());
        if now.saturating_sub(self.last_expire) >= Duration::from_secs(1) {
            self.policy.expire(now);
            self.last_expire = now;
        }
        let matches = self
            .index
            .as_ref()
            .map(|ix| ix.longest_prefix(input.hashes));
        self.candidates.clear();
        for (e, engine) in view.engines().iter().enumerate() {
            let mine = input.loads.get(e).copied().unwrap_or_default();
            let w = worker(e);
            let mut c = Candidate::new(w);
            c.load = Load {
                running: u32::try_from(engine.num_running()).unwrap_or(u32::MAX),
                waiting: u32::try_from(engine.num_waiting()).unwrap_or(u32::MAX),
                kv_usage: engine.kv_cache_usage(),
                in_flight: mine.in_flight,
                in_flight_prefill_tokens: mine.in_flight_prefill_tokens,
            };
            if let Some(m) = &matches {
                c.cache = m.get(w).unwrap_or_default();
            }
            self.candidates.push(c);
        }
        let session = input.session.map(|s| s.to_string());
        let ctx = RequestCtx {
            hashes: input.hashes,
            prompt_tokens: u32::try_from(input.prompt_tokens).unwrap_or(u32::MAX),
            block_size: u32::try_from(input.block_size).unwrap_or(u32::MAX),
            session: session.as_deref(),
            ticket: input.seq,
        };
        let decision = self.policy.select(&ctx, &self.candidates, now);
        self.policy.apply(&decision, input.hashes, now);
        let engine = decision
            .chosen()
            .map_or(0, |w| usize::try_from(w.replica.0).unwrap_or(0));
        let predicted = decision
            .chosen_score()
            .map_or(0, |s| s.predicted_cached_tokens as usize);
        Routed {
            engine,
            predicted_cached_tokens: predicted,
        }
    }

    fn observe(&mut self, engine: usize, out: &StepOutput) {
        if let (Some(ix), Some(batch)) = (self.index.as_mut(), &out.events) {
            ix.apply_batch(worker(engine), batch);
        }
    }
}

/// The capped-greedy oracle (a reference, not a deployable policy: it reads every engine's
/// block pool). Request `i` may go to an engine whose routed count plus one is at most
/// `(1 + eps) (i + 1) / n`, i.e. bounded-load consistent hashing's cap; among those it takes
/// the longest prefix cached right now, then the fewest routed, then the lowest index.
#[derive(Debug)]
pub struct OracleRouter {
    eps: f64,
}

impl SimRouter for OracleRouter {
    fn name(&self) -> &str {
        "oracle"
    }

    fn needs_hashes(&self) -> bool {
        true
    }

    fn route(&mut self, input: &RouteInput<'_>, view: &FleetView<'_>) -> Routed {
        let n = view.len().max(1);
        let total: u64 = input.loads.iter().map(|l| l.routed).sum();
        let cap = (1.0 + self.eps) * (total + 1) as f64 / n as f64;
        // vLLM serves at most `len - 1` tokens from cache.
        let max_blocks = input.prompt_tokens.saturating_sub(1) / input.block_size.max(1);
        let digests = input.digests.get(..max_blocks).unwrap_or(input.digests);
        let eligible = |e: usize| {
            input
                .loads
                .get(e)
                .is_some_and(|l| (l.routed + 1) as f64 <= cap)
        };
        let any_eligible = (0..view.len()).any(eligible);
        let mut best: Option<(usize, u64, usize)> = None;
        for (e, engine) in view.engines().iter().enumerate() {
            if any_eligible && !eligible(e) {
                continue;
            }
            let pool = engine.block_pool();
            let hit = digests
                .iter()
                .take_while(|d| pool.get_cached(d).is_some())
                .count();
            let routed = input.loads.get(e).map_or(0, |l| l.routed);
            let better = match best {
                None => true,
                Some((h, r, _)) => hit > h || (hit == h && routed < r),
            };
            if better {
                best = Some((hit, routed, e));
            }
        }
        let (hit, _, engine) = best.unwrap_or((0, 0, 0));
        Routed {
            engine,
            predicted_cached_tokens: hit * input.block_size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_name_and_from_json() {
        assert_eq!(SimPolicy::from_name("precise").unwrap().name(), "precise");
        assert_eq!(
            SimPolicy::from_name("oracle").unwrap(),
            SimPolicy::Oracle { eps: 0.1 }
        );
        assert!(SimPolicy::from_name("nope").is_err());
        let p = SimPolicy::from_json("wide", r#"{"kind":"precise","fair_share_cap":2.0}"#).unwrap();
        let SimPolicy::Kinference {
            config: PolicyConfig::Precise(c),
            label,
        } = &p
        else {
            panic!("{p:?}")
        };
        assert_eq!((c.fair_share_cap, label.as_str()), (2.0, "wide"));
        assert_eq!(p.router().unwrap().name(), "wide");
        let bad =
            SimPolicy::from_json("bad", r#"{"kind":"precise","fair_share_cap":0.5}"#).unwrap();
        assert!(bad.router().is_err());
        assert!(SimPolicy::from_json("x", r#"{"kind":"precise","nope":1}"#).is_err());
    }
}
