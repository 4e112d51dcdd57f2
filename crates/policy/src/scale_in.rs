//! What losing a replica would cost, for cache-aware scale-in.
//!
//! When a replica goes, each prefix only it held is prefilled again the next time it is asked
//! for: once, however popular it is (measured on a real API server: weighting a prefix by its
//! number of hits ordered pods wrongly, a pod with three rarely used prefixes lost more than
//! one with a single very hot one). So a replica's cost is the sum, over the prefixes it served
//! from cache that no other replica held ([`unique_span`]), of the tokens only it held, each
//! weighted by the chance it is asked for again, taken to halve with every `half_life` since
//! it was last hit ([`UniqueHits`]). A prefix another replica has cached meanwhile, or that
//! this one evicted, no longer counts: the caller checks that against the index when it reads
//! the cost.
//!
//! Invariants: pure (time is the caller's [`Duration`] from any fixed origin); a prefix is
//! served from cache only up to its first missing block, so the tokens only one replica can
//! serve are those beyond the longest prefix any *other* replica holds (in any tier), and
//! another DP rank of the same replica goes away with it; a prefix is keyed by its first block
//! only that replica holds, so the turns of one conversation count once; at most `capacity`
//! prefixes are remembered per replica, the least recently hit forgotten first.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;
use std::time::Duration;

use kinference_index::ReplicaId;
use kinference_vllm::BlockHash;

use crate::tracker::MixHasher;
use crate::types::Candidate;

/// The blocks of a request only one replica holds: `start..end`, where `start` is the longest
/// prefix another replica holds and `end` the chosen replica's cached prefix on GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UniqueSpan {
    pub start: u32,
    pub end: u32,
}

impl UniqueSpan {
    pub fn blocks(&self) -> u32 {
        self.end - self.start
    }
}

/// The prefix blocks of a request that `chosen`'s replica holds on its GPU and no other replica
/// holds in any tier: what would have to be prefilled again if that replica were gone. `None`
/// when there are none (or `chosen` is not among the candidates).
pub fn unique_span(candidates: &[Candidate], chosen: ReplicaId) -> Option<UniqueSpan> {
    let mut own = None;
    let mut others = 0u32;
    for c in candidates {
        if c.worker.replica == chosen {
            own = Some(own.unwrap_or(0).max(c.cache.gpu));
        } else {
            others = others.max(c.cache.any.max(c.cache.gpu));
        }
    }
    let end = own?;
    (end > others).then_some(UniqueSpan { start: others, end })
}

/// One replica's recently hit prefixes that only it held (see the module's doc).
#[derive(Clone, Debug)]
pub struct UniqueHits {
    /// First unique block → (unique tokens, when last hit).
    prefixes: HashMap<BlockHash, (u32, Duration), BuildHasherDefault<MixHasher>>,
    capacity: usize,
}

impl UniqueHits {
    pub fn new(capacity: usize) -> Self {
        UniqueHits {
            prefixes: HashMap::default(),
            capacity: capacity.max(1),
        }
    }

    /// A request at `now` was served `tokens` only this replica held, from the block `first`
    /// on. The longest span seen under one first block is kept (a conversation grows).
    pub fn record(&mut self, first: BlockHash, tokens: u32, now: Duration) {
        if self.prefixes.len() >= self.capacity && !self.prefixes.contains_key(&first) {
            self.forget_oldest();
        }
        let e = self.prefixes.entry(first).or_insert((0, now));
        e.0 = e.0.max(tokens);
        e.1 = e.1.max(now);
    }

    /// The cost at `now`: each prefix's tokens halved for every `half_life` since its last hit,
    /// counting only those `still_unique` says this replica alone still holds. Prefixes whose
    /// weight fell below 1/1024 are forgotten.
    pub fn cost(
        &mut self,
        now: Duration,
        half_life: Duration,
        mut still_unique: impl FnMut(BlockHash) -> bool,
    ) -> f64 {
        let h = half_life.as_secs_f64();
        let weight = |last: Duration| {
            let age = now.saturating_sub(last).as_secs_f64();
            if h > 0.0 {
                (-age / h).exp2()
            } else if age == 0.0 {
                1.0
            } else {
                0.0
            }
        };
        self.prefixes
            .retain(|_, (_, last)| weight(*last) >= 1.0 / 1024.0);
        self.prefixes
            .iter()
            .filter(|(first, _)| still_unique(**first))
            .map(|(_, (tokens, last))| f64::from(*tokens) * weight(*last))
            .sum()
    }

    pub fn len(&self) -> usize {
        self.prefixes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prefixes.is_empty()
    }

    /// Forgets the least recently hit half, so that a full record costs O(1) per request
    /// amortised.
    fn forget_oldest(&mut self) {
        let mut times: Vec<Duration> = self.prefixes.values().map(|(_, t)| *t).collect();
        let mid = times.len() / 2;
        let (_, cut, _) = times.select_nth_unstable(mid);
        let cut = *cut;
        let mut keep = self.capacity / 2;
        self.prefixes.retain(|_, (_, t)| {
            // Strictly newer than the median stay; ties at the median fill what is left.
            if *t > cut {
                return true;
            }
            if *t == cut && keep > 0 {
                keep -= 1;
                return true;
            }
            false
        });
        if self.prefixes.len() >= self.capacity {
            self.prefixes.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use kinference_index::{TierCounts, WorkerId};
    use kinference_vllm::DpRank;

    use super::*;

    fn cand(replica: u32, rank: u32, gpu: u32, any: u32) -> Candidate {
        let mut c = Candidate::new(WorkerId::new(ReplicaId(replica), DpRank(rank)));
        c.cache = TierCounts {
            gpu,
            any,
            ..TierCounts::default()
        };
        c
    }

    fn span(start: u32, end: u32) -> Option<UniqueSpan> {
        Some(UniqueSpan { start, end })
    }

    #[test]
    fn only_blocks_beyond_every_other_replicas_prefix_are_unique() {
        let cs = [cand(0, 0, 10, 10), cand(1, 0, 4, 4), cand(2, 0, 0, 7)];
        // Replica 2 holds 7 blocks offloaded: they could be served from there.
        assert_eq!(unique_span(&cs, ReplicaId(0)), span(7, 10));
        assert_eq!(unique_span(&cs, ReplicaId(1)), None);
        assert_eq!(unique_span(&cs, ReplicaId(2)), None);
        assert_eq!(unique_span(&cs, ReplicaId(9)), None);
        assert_eq!(unique_span(&[], ReplicaId(0)), None);
        assert_eq!(span(7, 10).unwrap().blocks(), 3);
    }

    #[test]
    fn another_rank_of_the_same_replica_goes_with_it() {
        let cs = [cand(0, 0, 2, 2), cand(0, 1, 8, 8), cand(1, 0, 5, 5)];
        assert_eq!(unique_span(&cs, ReplicaId(0)), span(5, 8));
    }

    fn h(n: u64) -> BlockHash {
        BlockHash(n)
    }

    #[test]
    fn a_prefix_counts_once_however_often_it_is_hit_and_halves_every_half_life() {
        let half = Duration::from_secs(10);
        let mut u = UniqueHits::new(16);
        for t in 0..5 {
            u.record(h(1), 100, Duration::from_secs(t));
        }
        // A later turn of the same conversation: a longer span under the same first block.
        u.record(h(1), 160, Duration::from_secs(5));
        u.record(h(2), 40, Duration::from_secs(5));
        assert_eq!(u.len(), 2);
        assert_eq!(u.cost(Duration::from_secs(5), half, |_| true), 200.0);
        assert!((u.cost(Duration::from_secs(15), half, |_| true) - 100.0).abs() < 1e-9);
        // Another replica holds it now, or this one evicted it: it no longer counts.
        assert!((u.cost(Duration::from_secs(15), half, |b| b != h(1)) - 20.0).abs() < 1e-9);
        // Ten half-lives on, both are forgotten.
        assert!(u.cost(Duration::from_secs(106), half, |_| true) < 1e-9);
        assert!(u.is_empty());
    }

    #[test]
    fn a_full_record_forgets_the_least_recently_hit_first() {
        let half = Duration::from_secs(1_000_000);
        let mut u = UniqueHits::new(4);
        for n in 0..4 {
            u.record(h(n), 10, Duration::from_secs(n));
        }
        u.record(h(0), 10, Duration::from_secs(9));
        u.record(h(7), 10, Duration::from_secs(10));
        assert!(u.len() <= 4, "{}", u.len());
        let mut kept = Vec::new();
        u.cost(Duration::from_secs(10), half, |b| {
            kept.push(b.0);
            true
        });
        kept.sort_unstable();
        assert!(kept.contains(&0) && kept.contains(&7), "{kept:?}");
        assert!(!kept.contains(&1), "{kept:?}");
    }

    #[test]
    fn without_a_half_life_only_this_moment_counts() {
        let mut u = UniqueHits::new(4);
        u.record(h(1), 3, Duration::from_secs(1));
        assert_eq!(
            u.cost(Duration::from_secs(1), Duration::ZERO, |_| true),
            3.0
        );
        assert_eq!(
            u.cost(Duration::from_secs(2), Duration::ZERO, |_| true),
            0.0
        );
    }
}
