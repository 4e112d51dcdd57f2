//! [`Policy`]: one pool's routing policy with the state it keeps between requests.

use std::time::Duration;

use kinference_index::WorkerId;
use kinference_vllm::BlockHash;

use crate::config::{PolicyConfig, PreciseConfig};
use crate::score::{self, Credit};
use crate::tracker::{Inserted, PrefixTracker};
use crate::types::{Candidate, Decision, Reason, RequestCtx};

/// What one [`Policy::apply`] recorded, to take back with [`Policy::undo`] (empty for
/// policies that keep no record): the receipt, and the position of the first block recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied(Option<(usize, Inserted)>);

/// A configured policy. `select` is pure; `apply` records a decision's effects.
#[derive(Clone, Debug)]
pub struct Policy {
    config: PolicyConfig,
    /// Precise: speculative entries. Approximate: the record of routed prefixes.
    tracker: Option<PrefixTracker>,
}

impl Policy {
    pub fn new(config: PolicyConfig) -> Self {
        let tracker = match &config {
            PolicyConfig::Precise(p) if !p.speculative_ttl.is_zero() => Some(PrefixTracker::new(
                p.speculative_ttl,
                p.speculative_capacity,
            )),
            PolicyConfig::Approximate(a) => Some(PrefixTracker::new(a.ttl, a.capacity)),
            _ => None,
        };
        Policy { config, tracker }
    }

    pub fn config(&self) -> &PolicyConfig {
        &self.config
    }

    pub fn name(&self) -> &'static str {
        self.config.name()
    }

    /// Whether this policy reads `Candidate::cache` (the caller can skip the index lookup
    /// otherwise).
    pub fn uses_index(&self) -> bool {
        matches!(self.config, PolicyConfig::Precise(_))
    }

    /// Ranks the candidates for one request. Pure: the same inputs give the same decision.
    pub fn select(
        &self,
        req: &RequestCtx<'_>,
        candidates: &[Candidate],
        now: Duration,
    ) -> Decision {
        let name = self.name();
        if candidates.is_empty() {
            return Decision::empty(name);
        }
        match &self.config {
            PolicyConfig::Precise(cfg) => {
                let credits = self.precise_credits(req, candidates, now);
                self.rank(cfg, candidates, &credits, req)
            }
            PolicyConfig::Approximate(a) => {
                let credits: Vec<Credit> = candidates
                    .iter()
                    .map(|c| Credit {
                        gpu: self.speculative_prefix(c, req, now),
                        ..Credit::default()
                    })
                    .collect();
                self.rank(&a.scoring, candidates, &credits, req)
            }
            PolicyConfig::RoundRobin => round_robin(name, candidates, req.ticket),
            PolicyConfig::LeastLoad => least_load(name, Reason::LeastLoad, candidates, req.ticket),
            PolicyConfig::SessionAffinity => match req.session {
                Some(key) => session_affinity(name, candidates, key),
                None => least_load(name, Reason::NoSession, candidates, req.ticket),
            },
        }
    }

    /// The worker [`Policy::select`] would rank first, for callers that need only that (a
    /// baseline deciding every request beside the real policy): the load-only policies find
    /// it in one pass over the candidates instead of ranking them all.
    pub fn choose(
        &self,
        req: &RequestCtx<'_>,
        candidates: &[Candidate],
        now: Duration,
    ) -> Option<WorkerId> {
        let n = candidates.len();
        match &self.config {
            _ if n == 0 => None,
            PolicyConfig::RoundRobin => candidates.get((req.ticket % n as u64) as usize),
            PolicyConfig::LeastLoad => {
                score::first_in_order(n, req.ticket, |a, b| by_load(candidates, a, b))
                    .and_then(|i| candidates.get(i))
            }
            _ => return self.select(req, candidates, now).chosen(),
        }
        .map(|c| c.worker)
    }

    /// Blocks of the request's prefix the router-side record places on `c` (0 without one).
    #[inline]
    fn speculative_prefix(&self, c: &Candidate, req: &RequestCtx<'_>, now: Duration) -> u32 {
        self.tracker
            .as_ref()
            .map_or(0, |t| t.prefix_len(c.worker, req.hashes, now))
    }

    /// The precise policy's credits: the index's prefix, lengthened on GPU by speculative
    /// entries the events have not confirmed yet.
    fn precise_credits(
        &self,
        req: &RequestCtx<'_>,
        candidates: &[Candidate],
        now: Duration,
    ) -> Vec<Credit> {
        candidates
            .iter()
            .map(|c| {
                // Only a speculative prefix longer than the index's changes the credit.
                let spec = self.tracker.as_ref().map_or(0, |t| {
                    t.prefix_len_beyond(c.worker, req.hashes, c.cache.gpu, now)
                });
                let gpu = c.cache.gpu.max(spec);
                Credit {
                    gpu,
                    offloaded: c.cache.any.max(gpu) - gpu,
                    speculative: spec.saturating_sub(c.cache.gpu),
                }
            })
            .collect()
    }

    /// Records a decision's effects on this policy's state: the chosen worker is assumed to
    /// hold the request's blocks from `now` (speculatively, or in the approximate record).
    /// The precise policy records only the blocks past those the index confirmed for that
    /// worker when it was scored (its credits read the record from there on,
    /// [`PrefixTracker::prefix_len_beyond`]): the confirmed ones are the events' to keep, and
    /// recording them again would cost a probe each and would keep crediting a block the
    /// worker evicted meanwhile. The receipt takes it back ([`Policy::undo`]) if the worker
    /// never ran the request.
    pub fn apply(&mut self, decision: &Decision, hashes: &[BlockHash], now: Duration) -> Applied {
        let Some(w) = decision.chosen() else {
            return Applied(None);
        };
        let confirmed = match self.config {
            PolicyConfig::Precise(_) => decision
                .scores
                .iter()
                .find(|s| s.worker == w)
                .map_or(0, |s| s.gpu_blocks.saturating_sub(s.speculative_blocks)),
            _ => 0,
        };
        self.record(w, hashes, confirmed as usize, now)
    }

    /// Records that `worker` is assumed to hold all of `hashes` from `now` (a request sent
    /// there without a decision, such as a warm-up).
    pub fn apply_to(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Duration) -> Applied {
        self.record(worker, hashes, 0, now)
    }

    fn record(
        &mut self,
        worker: WorkerId,
        hashes: &[BlockHash],
        from: usize,
        now: Duration,
    ) -> Applied {
        let from = from.min(hashes.len());
        match self.tracker.as_mut() {
            Some(t) => Applied(Some((from, t.insert(worker, &hashes[from..], now)))),
            None => Applied(None),
        }
    }

    /// Takes back what [`Policy::apply`] recorded for a request its worker refused or failed
    /// before answering (`hashes` as given to `apply`): entries a later request refreshed stay.
    pub fn undo(&mut self, applied: Applied, hashes: &[BlockHash], now: Duration) {
        if let (Some(t), Some((from, receipt))) = (self.tracker.as_mut(), applied.0) {
            if let Some(rest) = hashes.get(from..) {
                t.undo(receipt, rest, now);
            }
        }
    }

    /// Drops expired router-side entries; call now and then (e.g. once a second).
    pub fn expire(&mut self, now: Duration) {
        if let Some(t) = self.tracker.as_mut() {
            t.expire(now);
        }
    }

    /// Forgets a worker that left the pool.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        if let Some(t) = self.tracker.as_mut() {
            t.remove_worker(worker);
        }
    }

    /// Router-side (block, worker) entries held: speculative or approximate.
    pub fn tracked_entries(&self) -> usize {
        self.tracker.as_ref().map_or(0, PrefixTracker::len)
    }

    fn rank(
        &self,
        cfg: &PreciseConfig,
        candidates: &[Candidate],
        credits: &[Credit],
        req: &RequestCtx<'_>,
    ) -> Decision {
        score::rank_by_cache(
            cfg,
            self.name(),
            candidates,
            credits,
            req.prompt_tokens,
            req.block_size,
            req.ticket,
        )
    }
}

fn least_load(
    name: &'static str,
    reason: Reason,
    candidates: &[Candidate],
    ticket: u64,
) -> Decision {
    let scores = score::load_scores(candidates);
    let order = score::sorted_order(candidates.len(), ticket, |a, b| by_load(candidates, a, b));
    score::decision_from(name, reason, scores, &order)
}

/// Least loaded first: outstanding requests, then uncached prompt tokens in flight.
fn by_load(candidates: &[Candidate], a: usize, b: usize) -> std::cmp::Ordering {
    let (a, b) = (&candidates[a].load, &candidates[b].load);
    a.outstanding()
        .total_cmp(&b.outstanding())
        .then(a.in_flight_prefill_tokens.cmp(&b.in_flight_prefill_tokens))
}

/// In turn by ticket: the ticket picks the first candidate, the rest follow in order.
fn round_robin(name: &'static str, candidates: &[Candidate], ticket: u64) -> Decision {
    let scores = score::load_scores(candidates);
    let n = candidates.len();
    let start = (ticket % n as u64) as usize;
    let order: Vec<usize> = (0..n).map(|i| (start + i) % n).collect();
    score::decision_from(name, Reason::RoundRobin, scores, &order)
}

/// Highest rendezvous weight of (session, worker) first: a session stays on its worker
/// while that worker is a candidate.
fn session_affinity(name: &'static str, candidates: &[Candidate], key: &str) -> Decision {
    let scores = score::load_scores(candidates);
    let weights: Vec<u64> = candidates
        .iter()
        .map(|c| score::rendezvous_weight(key, c.worker))
        .collect();
    let order = score::sorted_order(candidates.len(), 0, |a, b| weights[b].cmp(&weights[a]));
    score::decision_from(name, Reason::SessionAffinity, scores, &order)
}
