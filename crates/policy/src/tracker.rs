//! A router-side record of which worker was sent which blocks, each entry valid until a
//! deadline: speculative entries (short TTL, until the worker's events confirm) and the
//! approximate policy's picture of replicas without events (long TTL, bounded size).
//!
//! Invariants: an entry is live iff `now < deadline`; inserting an existing (block, worker)
//! pair moves its deadline; at most `capacity` pairs are kept, the one with the earliest
//! deadline (the least recently routed, as all entries share one TTL) leaving first. Expired
//! and superseded entries are dropped lazily by [`PrefixTracker::insert`] (and `record`) and
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
    /// Per block: (worker, deadline, stamp of the insertion that set the deadline).
    live: HashMap<BlockHash, Vec<(WorkerId, Duration, u64)>, BuildHasherDefault<MixHasher>>,
    /// Every insertion in deadline order (one TTL for all, and time only moves forward).
    /// An element is stale when the pair's current stamp differs (it was refreshed since).
    order: VecDeque<(Duration, u64, BlockHash, WorkerId)>,
    len: usize,
    stamp: u64,
}

impl PrefixTracker {
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        PrefixTracker {
            ttl,
            capacity: capacity.max(1),
            live: HashMap::default(),
            order: VecDeque::new(),
            len: 0,
            stamp: 0,
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Changes the bound; pairs beyond it go at once, the earliest deadline first.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.len > self.capacity {
            if !self.pop_oldest() {
                break;
            }
        }
    }

    /// (block, worker) pairs held, live or expired but not yet dropped.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Records that `worker` was sent `hashes` at `now`; the receipt takes it back
    /// ([`PrefixTracker::undo`]).
    ///
    /// `now` must not go backwards between calls; a call with an earlier `now` is treated as
    /// happening at the latest time seen, so deadlines stay ordered.
    pub fn insert(&mut self, worker: WorkerId, hashes: &[BlockHash], now: Duration) -> Inserted {
        let mut before = Vec::new();
        let first_stamp = self.insert_iter(worker, hashes.iter().copied(), now, Some(&mut before));
        Inserted {
            worker,
            first_stamp,
            before,
        }
    }

    /// [`PrefixTracker::insert`] without a receipt (it cannot be undone), of hashes in any
    /// order: a cache model that only ever adds keeps no record of what each insertion replaced.
    pub fn record(
        &mut self,
        worker: WorkerId,
        hashes: impl ExactSizeIterator<Item = BlockHash>,
        now: Duration,
    ) {
        self.insert_iter(worker, hashes, now, None);
    }

    /// Inserts `hashes` for `worker`, noting in `before` each pair that existed; the stamp of
    /// the first hash (hash `i` gets `first + i`), 0 when nothing was inserted.
    fn insert_iter(
        &mut self,
        worker: WorkerId,
        hashes: impl ExactSizeIterator<Item = BlockHash>,
        now: Duration,
        mut before: Option<&mut Vec<(u32, Duration, u64)>>,
    ) -> u64 {
        if self.ttl.is_zero() || hashes.len() == 0 {
            return 0;
        }
        let now = self
            .order
            .back()
            .map_or(now, |&(d, _, _, _)| now.max(d.saturating_sub(self.ttl)));
        self.expire(now);
        let deadline = now.saturating_add(self.ttl);
        let first_stamp = self.stamp + 1;
        for (i, h) in hashes.enumerate() {
            let holders = self.live.entry(h).or_default();
            self.stamp += 1;
            let stamp = self.stamp;
            match holders.iter_mut().find(|(w, _, _)| *w == worker) {
                Some(entry) => {
                    if let Some(before) = before.as_deref_mut() {
                        before.push((i as u32, entry.1, entry.2));
                    }
                    entry.1 = deadline;
                    entry.2 = stamp;
                }
                None => {
                    holders.push((worker, deadline, stamp));
                    self.len += 1;
                }
            }
            self.order.push_back((deadline, stamp, h, worker));
        }
        while self.len > self.capacity {
            if !self.pop_oldest() {
                break;
            }
        }
        // Refreshes leave stale elements behind; keep the queue within a constant factor of
        // the live set so memory stays bounded under a hot prefix.
        if self.order.len() > 2 * self.len + 4096 {
            self.compact();
        }
        first_stamp
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
            let Some(holders) = self.live.get_mut(&h) else {
                continue;
            };
            let Some(k) = holders
                .iter()
                .position(|&(w, _, s)| w == receipt.worker && s == stamp)
            else {
                continue;
            };
            match prior {
                Some((deadline, s)) if deadline > now => {
                    holders[k].1 = deadline;
                    holders[k].2 = s;
                    // The queue element of that earlier deadline may have been compacted
                    // away; one more keeps the pair expiring (a duplicate pops as stale).
                    self.order.push_back((deadline, s, h, receipt.worker));
                }
                _ => {
                    holders.swap_remove(k);
                    self.len -= 1;
                    if holders.is_empty() {
                        self.live.remove(&h);
                    }
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
        let mut removed = 0;
        self.live.retain(|_, holders| {
            let before = holders.len();
            holders.retain(|(w, _, _)| *w != worker);
            removed += before - holders.len();
            !holders.is_empty()
        });
        self.len -= removed;
        self.order.retain(|&(_, _, _, w)| w != worker);
    }

    /// How many leading blocks of `hashes` `worker` holds live at `now`.
    pub fn prefix_len(&self, worker: WorkerId, hashes: &[BlockHash], now: Duration) -> u32 {
        let mut n = 0u32;
        for h in hashes {
            let held = self
                .live
                .get(h)
                .is_some_and(|hs| hs.iter().any(|&(w, d, _)| w == worker && d > now));
            if !held {
                break;
            }
            n = n.saturating_add(1);
        }
        n
    }

    /// Workers holding block 0 of `hashes` live at `now`, each with its prefix length.
    pub fn longest_prefixes(&self, hashes: &[BlockHash], now: Duration) -> Vec<(WorkerId, u32)> {
        let Some(first) = hashes.first().and_then(|h| self.live.get(h)) else {
            return Vec::new();
        };
        first
            .iter()
            .filter(|&&(_, d, _)| d > now)
            .map(|&(w, _, _)| (w, self.prefix_len(w, hashes, now)))
            .collect()
    }

    /// Removes the front element of the queue, and its pair if the element is current.
    fn pop_oldest(&mut self) -> bool {
        let Some((_, stamp, h, worker)) = self.order.pop_front() else {
            return false;
        };
        if let Some(holders) = self.live.get_mut(&h) {
            if let Some(i) = holders
                .iter()
                .position(|&(w, _, s)| w == worker && s == stamp)
            {
                holders.swap_remove(i);
                self.len -= 1;
                if holders.is_empty() {
                    self.live.remove(&h);
                }
            }
        }
        true
    }

    /// Drops stale queue elements (pairs refreshed since).
    fn compact(&mut self) {
        let live = &self.live;
        self.order.retain(|&(_, stamp, h, worker)| {
            live.get(&h)
                .is_some_and(|hs| hs.iter().any(|&(w, _, s)| w == worker && s == stamp))
        });
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
            t.record(w, a.iter().copied(), now);
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
        t.record(w, (200..250u32).map(|i| BlockHash(u64::from(i))), now);
        assert_eq!(t.prefix_len(w, &a, now), 0);
        assert_eq!(t.prefix_len(w, &b, now), 50);
    }
}
