//! Counterfactual routing: what another policy would have chosen for each request had it
//! routed the pool's whole traffic, and how many of the request's blocks its choice would have
//! found cached. The router reports the live policy's savings against such a baseline
//! (round-robin by default) on the operator's own traffic.
//!
//! Invariants: a [`Shadow`] never changes a live decision and is never sent anything; it sees
//! the same requests, in the same order, with the same candidates (loads included) as the live
//! policy. Its cache model is its own, not the fleet's: the blocks it routed to each worker, none
//! expiring, at most `capacity` per worker (the replica's KV blocks), the least recently routed
//! leaving first and, within a request, its last block first: vLLM's LRU eviction of free
//! blocks (a finished request's blocks are freed tail first, so a prefix shared by many
//! requests outlives their suffixes). Reading the live fleet's caches instead would credit a baseline with
//! the placements of the policy it is compared with. A worker of a replica's size is modelled
//! on a sample of the blocks ([`crate::lru`]): its guesses are then estimates, within a few
//! blocks per request and 2 % in total of the whole model on the traces measured.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Duration;

use kinference_index::WorkerId;

use crate::config::PolicyConfig;
use crate::lru::{BlockLru, SAMPLE_ABOVE};
use crate::policy::Policy;
use crate::tracker::MixHasher;
use crate::types::{Candidate, RequestCtx};

/// The bound for a baseline whose replicas have not reported their KV capacity yet: the
/// largest cache modelled whole. Learning the capacity then only ever makes the model coarser
/// or smaller, and a coarser sample keeps the blocks it has (a finer one would guess short
/// until its prefixes are used again).
pub const CAPACITY_UNKNOWN: usize = SAMPLE_ABOVE - 1;

/// One baseline policy with its own picture of the caches.
#[derive(Clone, Debug)]
pub struct Shadow {
    policy: Policy,
    /// Per worker: the blocks this baseline sent it.
    caches: HashMap<WorkerId, BlockLru, BuildHasherDefault<MixHasher>>,
    capacity: usize,
}

/// What a baseline would have done with one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Guess {
    pub worker: Option<WorkerId>,
    /// Leading blocks of the request its chosen worker would have held.
    pub cached_blocks: u32,
}

/// Why a policy cannot be a baseline.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShadowError {
    #[error("unknown baseline policy {0:?} (expected round-robin, least-load or approximate)")]
    Unknown(String),
    #[error(
        "the precise policy cannot be a baseline: it reads the fleet's caches, which a policy \
         that did not route the traffic would not have"
    )]
    Precise,
}

impl Shadow {
    /// A baseline by policy name (`round-robin`, `least-load`, `approximate`, with their
    /// default settings) whose cache model holds at most `capacity` blocks per worker.
    pub fn new(name: &str, capacity: usize) -> Result<Shadow, ShadowError> {
        let config =
            PolicyConfig::from_name(name).ok_or_else(|| ShadowError::Unknown(name.to_owned()))?;
        if matches!(config, PolicyConfig::Precise(_)) {
            return Err(ShadowError::Precise);
        }
        Ok(Shadow {
            policy: Policy::new(config),
            caches: HashMap::default(),
            capacity: capacity.max(1),
        })
    }

    pub fn name(&self) -> &'static str {
        self.policy.name()
    }

    /// Sets the bound per worker; blocks beyond it go at once, least recently routed first.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        for c in self.caches.values_mut() {
            c.set_capacity(self.capacity);
        }
    }

    /// Decides as the baseline would, records the choice in its own state and cache model,
    /// and says what its choice would have found cached. `candidates` are the live ones (only
    /// their availability and load are read: a baseline does not see the fleet's caches).
    pub fn observe(
        &mut self,
        req: &RequestCtx<'_>,
        candidates: &[Candidate],
        now: Duration,
    ) -> Guess {
        let Some(worker) = self.policy.choose(req, candidates, now) else {
            return Guess::default();
        };
        let _ = self.policy.apply_to(worker, req.hashes, now);
        let capacity = self.capacity;
        let cached_blocks = self
            .caches
            .entry(worker)
            .or_insert_with(|| BlockLru::new(capacity))
            .touch(req.hashes);
        Guess {
            worker: Some(worker),
            cached_blocks,
        }
    }

    /// Forgets a worker that left the pool.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.policy.remove_worker(worker);
        self.caches.remove(&worker);
    }

    /// Drops the baseline policy's own expired records (the approximate policy's).
    pub fn expire(&mut self, now: Duration) {
        self.policy.expire(now);
    }
}

#[cfg(test)]
mod tests {
    use kinference_index::ReplicaId;
    use kinference_vllm::{BlockHash, DpRank};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    fn worker(i: u32) -> WorkerId {
        WorkerId {
            replica: ReplicaId(i),
            rank: DpRank(0),
        }
    }

    fn ctx<'a>(hashes: &'a [BlockHash], ticket: u64) -> RequestCtx<'a> {
        RequestCtx {
            hashes,
            prompt_tokens: 16 * hashes.len() as u32,
            block_size: 16,
            session: None,
            ticket,
        }
    }

    fn hashes(prefix: u64, n: u64) -> Vec<BlockHash> {
        (0..n).map(|i| BlockHash(prefix * 1000 + i)).collect()
    }

    #[test]
    fn round_robin_finds_a_prefix_only_where_it_sent_it() {
        // Small enough to be modelled whole, so the guesses are exact.
        let mut s = Shadow::new("round-robin", 4096).unwrap();
        let cands: Vec<Candidate> = (0..2).map(|i| Candidate::new(worker(i))).collect();
        let h = hashes(1, 4);
        let now = Duration::ZERO;
        // Tickets 0, 1, 2: worker 0 cold, worker 1 cold, worker 0 warm.
        let g: Vec<Guess> = (0..3)
            .map(|t| s.observe(&ctx(&h, t), &cands, now))
            .collect();
        assert_eq!(g[0].cached_blocks, 0);
        assert_eq!(g[1].cached_blocks, 0);
        assert_ne!(g[0].worker, g[1].worker);
        assert_eq!(g[2].worker, g[0].worker);
        assert_eq!(g[2].cached_blocks, 4);
    }

    #[test]
    fn the_live_fleets_caches_are_not_read() {
        let mut s = Shadow::new("least-load", 4096).unwrap();
        let mut c = Candidate::new(worker(0));
        c.cache.gpu = 8;
        c.cache.any = 8;
        let h = hashes(2, 8);
        assert_eq!(
            s.observe(&ctx(&h, 0), &[c], Duration::ZERO).cached_blocks,
            0
        );
    }

    #[test]
    fn the_cache_model_evicts_the_least_recently_routed_first() {
        let mut s = Shadow::new("round-robin", 6).unwrap();
        let one = [Candidate::new(worker(0))];
        let (a, b) = (hashes(1, 4), hashes(2, 4));
        let now = Duration::ZERO;
        s.observe(&ctx(&a, 0), &one, now);
        s.observe(&ctx(&b, 1), &one, now);
        // 8 blocks routed, 6 kept: a's last two went (a request's tail goes first), so its
        // first two are still there.
        assert_eq!(s.observe(&ctx(&a, 2), &one, now).cached_blocks, 2);
        s.set_capacity(4);
        // a was routed again last: only its 4 blocks are left.
        assert_eq!(s.observe(&ctx(&a, 3), &one, now).cached_blocks, 4);
        assert_eq!(s.observe(&ctx(&b, 4), &one, now).cached_blocks, 0);
    }

    /// Until the capacity is known the model is whole (exact guesses); learning a large one
    /// leaves it guessing as a model built at that capacity from the start would.
    #[test]
    fn learning_a_large_capacity_keeps_what_the_model_holds() {
        let one = [Candidate::new(worker(0))];
        let now = Duration::ZERO;
        let mut learnt = Shadow::new("round-robin", CAPACITY_UNKNOWN).unwrap();
        let mut known = Shadow::new("round-robin", 28_000).unwrap();
        let requests: Vec<Vec<BlockHash>> = (0..40).map(|p| hashes(p % 10, 30 + p)).collect();
        for (t, h) in requests.iter().enumerate().take(20) {
            let guess = learnt.observe(&ctx(h, t as u64), &one, now).cached_blocks;
            // Whole: a prefix seen before is found to its last block (each group's length
            // grows, so the earlier request's blocks are all there).
            let want = if t >= 10 { h.len() as u32 - 10 } else { 0 };
            assert_eq!(guess, want, "request {t}");
            known.observe(&ctx(h, t as u64), &one, now);
        }
        learnt.set_capacity(28_000);
        for (t, h) in requests.iter().enumerate().skip(20) {
            let a = learnt.observe(&ctx(h, t as u64), &one, now);
            let b = known.observe(&ctx(h, t as u64), &one, now);
            assert_eq!(a, b, "request {t}");
        }
    }

    #[test]
    fn precise_and_unknown_names_are_refused() {
        assert_eq!(Shadow::new("precise", 1).unwrap_err(), ShadowError::Precise);
        assert!(matches!(
            Shadow::new("fastest", 1),
            Err(ShadowError::Unknown(_))
        ));
    }

    /// Against a naive model: round-robin over a fixed worker set, an LRU of blocks per
    /// worker (a request's blocks used tail to head), on a seeded random stream of prefixes.
    #[test]
    fn round_robin_guesses_match_a_naive_model() {
        let n_workers = 3u32;
        let cap = 14usize;
        let mut s = Shadow::new("round-robin", cap).unwrap();
        let cands: Vec<Candidate> = (0..n_workers).map(|i| Candidate::new(worker(i))).collect();
        // naive: list of (block, worker) in recency order, most recent last
        let mut lru: Vec<(BlockHash, WorkerId)> = Vec::new();
        let mut source = ChaCha8Rng::seed_from_u64(11);
        for ticket in 0..2000u64 {
            let rng: u64 = source.gen();
            let h = hashes(rng % 7, 1 + (rng >> 8) % 6);
            let g = s.observe(&ctx(&h, ticket), &cands, Duration::ZERO);
            let w = g.worker.unwrap();
            assert_eq!(w, worker((ticket % u64::from(n_workers)) as u32));
            let want = h
                .iter()
                .take_while(|b| lru.iter().any(|&(x, y)| x == **b && y == w))
                .count() as u32;
            assert_eq!(g.cached_blocks, want, "ticket {ticket}");
            for b in h.iter().rev() {
                lru.retain(|&(x, y)| !(x == *b && y == w));
                lru.push((*b, w));
            }
            while lru.iter().filter(|&&(_, y)| y == w).count() > cap {
                let oldest = lru.iter().position(|&(_, y)| y == w).unwrap();
                lru.remove(oldest);
            }
        }
    }
}
