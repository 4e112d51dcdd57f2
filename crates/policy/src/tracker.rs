//! A router-side record of which worker was sent which blocks, each entry valid until a
//! deadline: speculative entries (short TTL, until the worker's events confirm) and the
//! approximate policy's picture of replicas without events (long TTL, bounded size).
//!
//! Invariants: an entry is live iff `now < deadline`; inserting an existing (block, worker)
//! pair moves its deadline; at most `capacity` pairs are kept, the one with the earliest
//! deadline (the least recently routed, as all entries share one TTL) leaving first. Expired
//! and superseded entries are dropped lazily by [`PrefixTracker::insert`] and
//! [`PrefixTracker::expire`], so lookups never mutate. An insertion can be taken back
//! ([`PrefixTracker::undo`], with the [`Inserted`] receipt `insert` returned): each pair it set
//! and that nothing has refreshed since returns to what it was before (absent, or its earlier
//! deadline), so a guess about a request that never ran leaves nothing behind.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;

use kinference_index::WorkerId;
use kinference_vllm::BlockHash;

/// Block → workers with a deadline each.
#[derive(Clone, Debug)]
pub struct PrefixTracker {
    ttl: Duration,
    capacity: usize,
    /// Per (block, worker) pair: (deadline, stamp of the insertion that set the deadline).
    /// One flat map rather than a list of workers per block: no allocation per new block,
    /// and a lookup is one probe (a chat prompt inserts and reads hundreds of blocks).
    live: HashMap<(BlockHash, WorkerId), (Duration, u64), BuildHasherDefault<MixHasher>>,
    /// Every insertion in deadline order (one TTL for all, and time only moves forward).
    /// An element is stale when the pair's current stamp differs (it was refreshed since).
    order: VecDeque<(Duration, u64, BlockHash, WorkerId)>,
    stamp: u64,
}

impl PrefixTracker {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        PrefixTracker {
            ttl,
            capacity: capacity.max(1),
            live: HashMap::default(),
            order: VecDeque::new(),
            stamp: 0,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Changes the bound; pairs beyond it go at once, the earliest deadline first.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.live.len() > self.capacity {
            if !self.pop_oldest() {
                break;
            }
        }
    }

    /// (block, worker) pairs held, live or expired but not yet dropped.
    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    /// Records that `worker` was sent `hashes` at `now`; the receipt takes it back
    /// ([`PrefixTracker::undo`]).
    ///
    /// `now` must not go backwards between calls; a call with an earlier `now` is treated as
    /// happening at the latest time seen, so deadlines stay ordered.
    pub fn insert(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Duration) -> Inserted {
        let mut before = Vec::new();
        if self.ttl.is_zero() || hashes.is_empty() {
            return Inserted {
                worker,
                first_stamp: 0,
                before,
            };
        }
        let now = self
            .order
            .back()
            .map_or(now, |&(d, _, _, _)| now.max(d.saturating_sub(self.ttl)));
        self.expire(now);
        let deadline = now.saturating_add(self.ttl);
        let first_stamp = self.stamp + 1;
        for (i, &h) in hashes.iter().enumerate() {
            self.stamp += 1;
            let stamp = self.stamp;
            if let Some(prior) = self.live.insert((h, worker), (deadline, stamp)) {
                before.push((i as u32, prior.0, prior.1));
            }
            self.order.push_back((deadline, stamp, h, worker));
        }
        while self.live.len() > self.capacity {
            if !self.pop_oldest() {
                break;
            }
        }
        // Refreshes leave stale elements behind; keep the queue within a constant factor of
        // the live set so memory stays bounded under a hot prefix.
        if self.order.len() > 2 * self.live.len() + 4096 {
            self.compact();
        }
        Inserted {
            worker,
            first_stamp,
            before,
        }
    }

    /// Takes back the insertion `receipt` records, `hashes` being the ones it was given: each
    /// pair it set that nothing refreshed since is removed, or set back to its earlier
    /// deadline when that is still ahead of `now`. Pairs refreshed by a later insertion belong
    /// to that one and stay.
    pub fn undo(&mut self, receipt: Inserted, hashes: &[BlockHash], now: Duration) {
        if receipt.first_stamp == 0 {
            return;
        }
        let mut before = receipt.before.iter().rev().peekable();
        // Backwards, so that a hash listed twice ends as it was before the first listing.
        for (i, &h) in hashes.iter().enumerate().rev() {
            let stamp = receipt.first_stamp + i as u64;
            let prior = match before.peek() {
                Some(&&(j, deadline, s)) if j as usize == i => {
                    before.next();
                    Some((deadline, s))
                }
                _ => None,
            };
            let key = (h, receipt.worker);
            let Some(entry) = self.live.get_mut(&key).filter(|e| e.1 == stamp) else {
                continue;
            };
            match prior {
                Some((deadline, s)) if deadline > now => {
                    *entry = (deadline, s);
                    // The queue element of that earlier deadline may have been compacted
                    // away; one more keeps the pair expiring (a duplicate pops as stale).
                    self.order.push_back((deadline, s, h, receipt.worker));
                }
                _ => {
                    self.live.remove(&key);
                }
            }
        }
    }

    /// Drops every entry whose deadline has passed.
    pub fn expire(&mut self, now: Duration) {
        while let Some(&(deadline, _, _, _)) = self.order.front() {
            if deadline > now {
                break;
            }
            self.pop_oldest();
        }
    }

    /// Forgets a worker (it left the pool).
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.live.retain(|&(_, w), _| w != worker);
        self.order.retain(|&(_, _, _, w)| w != worker);
    }

    /// How many leading blocks of `hashes` `worker` holds live at `now`.
    pub fn prefix_len(&self, worker: WorkerId, hashes: &[BlockHash], now: Duration) -> u32 {
        let mut n = 0u32;
        for h in hashes {
            let held = self.live.get(&(*h, worker)).is_some_and(|&(d, _)| d > now);
            if !held {
                break;
            }
            n = n.saturating_add(1);
        }
        n
    }

    /// How far the record lengthens a prefix of `known` leading blocks that the caller
    /// already credits `worker` with (from the index): `known` plus the run of blocks
    /// `worker` holds live from block `known` on, or 0 when it holds not even block `known`.
    /// The record need not hold the first `known` blocks: the precise policy records only
    /// what the index did not confirm when it routed ([`crate::Policy::apply`]). One probe
    /// (block `known`) answers most calls.
    pub fn prefix_len_beyond(
        &self,
        worker: WorkerId,
        hashes: &[BlockHash],
        known: u32,
        now: Duration,
    ) -> u32 {
        let Some(rest) = hashes.get(known as usize..) else {
            return 0;
        };
        match self.prefix_len(worker, rest, now) {
            0 => 0,
            n => known.saturating_add(n),
        }
    }

    /// Removes the front element of the queue, and its pair if the element is current.
    fn pop_oldest(&mut self) -> bool {
        let Some((_, stamp, h, worker)) = self.order.pop_front() else {
            return false;
        };
        if self.live.get(&(h, worker)).is_some_and(|e| e.1 == stamp) {
            self.live.remove(&(h, worker));
        }
        true
    }

    /// Drops stale queue elements (pairs refreshed since).
    fn compact(&mut self) {
        let live = &self.live;
        self.order
            .retain(|&(_, stamp, h, worker)| live.get(&(h, worker)).is_some_and(|e| e.1 == stamp));
    }
}

/// What one [`PrefixTracker::insert`] changed, to take it back with [`PrefixTracker::undo`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inserted {
    worker: WorkerId,
    /// The stamp of the first hash; hash `i` got `first_stamp + i` (0: nothing inserted).
    first_stamp: u64,
    /// (position, deadline, stamp) of the pairs that existed before, in position order.
    before: Vec<(u32, Duration, u64)>,
}

/// Block hashes are already uniformly distributed digests: one multiply spreads them over the
/// table, where SipHash would cost more than the rest of a lookup. Not DoS-resistant — the keys
/// come from vLLM's hashing (SHA-256 or XXH3 of the prompt) — so a client cannot choose them
/// without breaking the digest.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 ^= self.0 >> 29;
    }

    // A worker (replica and rank ids) in a key: one step each instead of four byte steps.
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
}

#[cfg(test)]
mod tests {
    use kinference_index::ReplicaId;
    use kinference_vllm::DpRank;

    use super::*;

    /// Compaction is where refreshes' stale queue elements go; the model-based property test
    /// rarely reaches it (capacity pops clear a short queue first), so it is checked here.
    #[test]
    fn compaction_keeps_one_current_element_per_pair_in_order() {
        let w = WorkerId::new(ReplicaId(0), DpRank(0));
        let now = Duration::ZERO;
        let mut t = PrefixTracker::new(Duration::MAX, 1_000);
        let a: Vec<BlockHash> = (0..50).map(BlockHash).collect();
        let b: Vec<BlockHash> = (100..150).map(BlockHash).collect();
        // 20,000 refreshes of 100 pairs: compacted along the way, the queue stays bounded.
        for _ in 0..200 {
            t.insert(w, &a, now);
            t.insert(w, &b, now);
        }
        assert_eq!(t.len(), 100);
        assert!(
            t.order.len() <= 2 * t.len() + 4096 + 50,
            "{}",
            t.order.len()
        );
        t.compact();
        assert_eq!(t.order.len(), 100);
        let in_order: Vec<BlockHash> = t.order.iter().map(|&(_, _, h, _)| h).collect();
        assert_eq!(in_order, [a.clone(), b.clone()].concat());
        // After compaction the least recently refreshed still go first: `a`'s pairs.
        t.set_capacity(100);
        let c: Vec<BlockHash> = (200..250).map(BlockHash).collect();
        t.insert(w, &c, now);
        assert_eq!(t.prefix_len(w, &a, now), 0);
        assert_eq!(t.prefix_len(w, &b, now), 50);
    }
}
