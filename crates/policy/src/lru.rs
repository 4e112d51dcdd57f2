//! One worker's blocks as a baseline's cache model sees them: a set of block hashes bounded by
//! the replica's KV capacity, the least recently used leaving first, nothing expiring.
//!
//! Invariants: at most `capacity` blocks are held after every call; a block's recency is the
//! stamp of its latest use; within one [`BlockLru::touch`] the request's last block is used
//! first and its first block last (vLLM frees a finished request's blocks tail first, so a
//! prefix shared by many requests outlives their suffixes). The queue holds one element per
//! use; an element is stale when its block was used again since, and stale elements are
//! skipped when popped and dropped when they outnumber the live ones by more than a constant.
//!
//! This is [`crate::tracker::PrefixTracker`] without deadlines, workers or undo: a shadow
//! touches every block of every request, so one map probe and one queue push per block are
//! what it can afford.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use kinference_vllm::BlockHash;

use crate::tracker::MixHasher;

#[derive(Clone, Debug)]
pub(crate) struct BlockLru {
    capacity: usize,
    /// Block → the stamp of its latest use.
    stamps: HashMap<BlockHash, u64, BuildHasherDefault<MixHasher>>,
    /// Every use, oldest first (stamps only grow).
    order: VecDeque<(u64, BlockHash)>,
    stamp: u64,
}

impl BlockLru {
    pub(crate) fn new(capacity: usize) -> Self {
        BlockLru {
            capacity: capacity.max(1),
            stamps: HashMap::default(),
            order: VecDeque::new(),
            stamp: 0,
        }
    }

    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        self.evict();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Uses `hashes` (one request's blocks) and returns how many leading ones were held before.
    pub(crate) fn touch(&mut self, hashes: &[BlockHash]) -> u32 {
        let n = hashes.len() as u64;
        let base = self.stamp;
        self.stamp += n;
        let mut held = 0u32;
        let mut leading = true;
        for (i, &h) in hashes.iter().enumerate() {
            // Block i of n is used (n - i)-th: the last block first.
            let stamp = base + n - i as u64;
            match self.stamps.entry(h) {
                std::collections::hash_map::Entry::Occupied(mut e) => {
                    // Every stamp from an earlier request is ≤ base; a block listed twice in
                    // this request keeps its later use (the earlier position).
                    let s = e.get_mut();
                    *s = (*s).max(stamp);
                    if leading {
                        held += 1;
                    }
                }
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(stamp);
                    leading = false;
                }
            }
        }
        self.order.extend(
            hashes
                .iter()
                .rev()
                .enumerate()
                .map(|(k, &h)| (base + 1 + k as u64, h)),
        );
        self.evict();
        if self.order.len() > 2 * self.stamps.len() + 4096 {
            let stamps = &self.stamps;
            self.order.retain(|&(s, h)| stamps.get(&h) == Some(&s));
        }
        held
    }

    fn evict(&mut self) {
        while self.stamps.len() > self.capacity {
            let Some((s, h)) = self.order.pop_front() else {
                break;
            };
            if self.stamps.get(&h) == Some(&s) {
                self.stamps.remove(&h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    use super::*;

    /// Against a naive recency list on a seeded random stream, duplicates within a request
    /// included, and the bound lowered halfway.
    #[test]
    fn matches_a_naive_lru() {
        let mut cap = 23usize;
        let mut lru = BlockLru::new(cap);
        let mut naive: Vec<BlockHash> = Vec::new(); // most recent last
        let mut source = ChaCha8Rng::seed_from_u64(7);
        for round in 0..7000 {
            if round == 3500 {
                cap = 11;
                lru.set_capacity(cap);
                while naive.len() > cap {
                    naive.remove(0);
                }
            }
            let rng: u64 = source.gen();
            let len = 1 + (rng % 9) as usize;
            let hs: Vec<BlockHash> = (0..len)
                .map(|i| BlockHash((rng >> (8 + i * 3)) % 40))
                .collect();
            let want = hs.iter().take_while(|b| naive.contains(b)).count() as u32;
            assert_eq!(lru.touch(&hs), want, "round {round}");
            for b in hs.iter().rev() {
                naive.retain(|x| x != b);
                naive.push(*b);
            }
            while naive.len() > cap {
                naive.remove(0);
            }
            assert_eq!(lru.len(), naive.len(), "round {round}");
        }
    }

    /// Many uses and no evictions (the bound above the blocks in play) compact the queue more
    /// than once; the recency order must survive it, as a lowered bound then shows.
    #[test]
    fn compaction_keeps_the_recency_order() {
        let mut lru = BlockLru::new(1000);
        let mut naive: Vec<BlockHash> = Vec::new(); // most recent last
        let mut source = ChaCha8Rng::seed_from_u64(11);
        let mut compactions = 0;
        for round in 0..6000 {
            if round == 5000 {
                lru.set_capacity(17);
                let drop = naive.len().saturating_sub(17);
                naive.drain(..drop);
            }
            let cap = if round >= 5000 { 17 } else { 1000 };
            let rng: u64 = source.gen();
            let len = 1 + (rng % 6) as usize;
            let hs: Vec<BlockHash> = (0..len)
                .map(|i| BlockHash((rng >> (8 + i * 4)) % 60))
                .collect();
            let want = hs.iter().take_while(|b| naive.contains(b)).count() as u32;
            let before = lru.order.len();
            assert_eq!(lru.touch(&hs), want, "round {round}");
            if lru.order.len() < before {
                compactions += 1;
            }
            for b in hs.iter().rev() {
                naive.retain(|x| x != b);
                naive.push(*b);
            }
            let drop = naive.len().saturating_sub(cap);
            naive.drain(..drop);
            assert_eq!(lru.len(), naive.len(), "round {round}");
        }
        assert!(compactions >= 2, "{compactions} compactions");
    }

    #[test]
    fn the_queue_stays_bounded_under_a_hot_prefix() {
        let mut lru = BlockLru::new(100);
        let hot: Vec<BlockHash> = (0..50).map(BlockHash).collect();
        assert_eq!(lru.touch(&hot), 0);
        for _ in 0..10_000 {
            assert_eq!(lru.touch(&hot), 50);
        }
        assert!(lru.order.len() <= 2 * lru.len() + 4096 + hot.len());
    }
}
