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
//!
//! A model of a large cache holds a sample of the blocks (spatial sampling, as SHARDS builds
//! miss-ratio curves: Waldspurger et al., FAST '15): a block is modelled when its mixed hash
//! falls in the first 1/2^`shift` of the range, and the model holds `capacity / 2^shift` of
//! them. A replica holds tens of thousands of blocks and more; modelled one by one they cost
//! two cache-missing probes per block of every request (the router's largest single cost in
//! the policy crate on real chat text) and a megabyte or more per worker. Sampling keeps the
//! order among the modelled blocks, and a block's ancestors are always used after it (they
//! precede it in every request that holds it, and a request's head is used last), so the held
//! blocks of a request are a prefix in the model as in the cache: a request's leading held
//! blocks lie between its last held modelled block and its first modelled block not held, and
//! the midpoint is the guess. Caches of under [`SAMPLE_ABOVE`] blocks are modelled whole, and
//! no fewer than one block in 2^[`MAX_SHIFT`] is modelled, so a request's guess is off by a few
//! blocks at most where the sampled model agrees with the whole one.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasherDefault;

use kinference_vllm::BlockHash;

use crate::tracker::MixHasher;

/// Caches this large or larger are sampled (each sample still models 4,096 blocks or more).
pub(crate) const SAMPLE_ABOVE: usize = 8192;
/// At least one block in 4 is modelled: a request of a few dozen blocks still has several
/// modelled ones to bracket its held prefix (one in 8 guessed 2–4 % short where requests end
/// in short private tails; BENCHMARKS.md).
pub(crate) const MAX_SHIFT: u32 = 2;

/// How many halvings of the block range a cache of `capacity` blocks is modelled at.
fn shift_for(capacity: usize) -> u32 {
    let mut shift = 0;
    while shift < MAX_SHIFT && capacity >> shift >= SAMPLE_ABOVE {
        shift += 1;
    }
    shift
}

/// Whether a block is in the sample of rate 1/2^`shift` (the top bits of a Fibonacci mix, so
/// that consecutive ids, as traces and tests use, spread as well as vLLM's digests do).
fn modelled(h: BlockHash, shift: u32) -> bool {
    shift == 0 || h.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - shift) == 0
}

#[derive(Clone, Debug)]
pub(crate) struct BlockLru {
    /// Modelled blocks held at most: the worker's capacity scaled by the sample's rate.
    capacity: usize,
    shift: u32,
    /// Modelled block → the stamp of its latest use.
    stamps: HashMap<BlockHash, u64, BuildHasherDefault<MixHasher>>,
    /// Every use of a modelled block, oldest first (stamps only grow).
    order: VecDeque<(u64, BlockHash)>,
    stamp: u64,
}

impl BlockLru {
    /// A model of a worker that holds `capacity` blocks, sampled if it is large.
    pub(crate) fn new(capacity: usize) -> Self {
        Self::with_shift(capacity, shift_for(capacity))
    }

    fn with_shift(capacity: usize, shift: u32) -> Self {
        BlockLru {
            capacity: Self::scaled(capacity, shift),
            shift,
            stamps: HashMap::default(),
            order: VecDeque::new(),
            stamp: 0,
        }
    }

    fn scaled(capacity: usize, shift: u32) -> usize {
        capacity.div_ceil(1 << shift).max(1)
    }

    /// Changes the bound. A coarser sample keeps the blocks of the new one; a finer one learns
    /// the blocks it adds as requests use them (until then it guesses short).
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        let shift = shift_for(capacity);
        if shift > self.shift {
            self.stamps.retain(|&h, _| modelled(h, shift));
            let stamps = &self.stamps;
            self.order.retain(|&(s, h)| stamps.get(&h) == Some(&s));
        }
        self.shift = shift;
        self.capacity = Self::scaled(capacity, shift);
        self.evict();
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.stamps.len()
    }

    /// Uses `hashes` (one request's blocks) and returns how many leading ones were held before
    /// (exact when the cache is modelled whole; the midpoint of the bracket when sampled).
    pub(crate) fn touch(&mut self, hashes: &[BlockHash]) -> u32 {
        let (low, high) = self.touch_bracket(hashes);
        u32::try_from(low.midpoint(high)).unwrap_or(u32::MAX)
    }

    /// [`BlockLru::touch`]'s bracket: the request's leading held blocks are at least the first
    /// and at most the second (equal when every block is modelled).
    fn touch_bracket(&mut self, hashes: &[BlockHash]) -> (usize, usize) {
        let n = hashes.len() as u64;
        let base = self.stamp;
        self.stamp += n;
        let (mut low, mut high) = (0, hashes.len());
        let mut leading = true;
        let shift = self.shift;
        for (i, &h) in hashes.iter().enumerate() {
            if !modelled(h, shift) {
                continue;
            }
            // Block i of n is used (n - i)-th: the last block first.
            let stamp = base + n - i as u64;
            match self.stamps.entry(h) {
                Entry::Occupied(mut e) => {
                    // Every stamp from an earlier request is ≤ base; a block listed twice in
                    // this request keeps its later use (the earlier position).
                    let s = e.get_mut();
                    *s = (*s).max(stamp);
                    if leading {
                        low = i + 1;
                    }
                }
                Entry::Vacant(e) => {
                    e.insert(stamp);
                    if leading {
                        high = i;
                        leading = false;
                    }
                }
            }
        }
        self.order.extend(
            hashes
                .iter()
                .enumerate()
                .rev()
                .filter(|&(_, &h)| modelled(h, shift))
                .map(|(i, &h)| (base + n - i as u64, h)),
        );
        self.evict();
        if self.order.len() > 2 * self.stamps.len() + 4096 {
            let stamps = &self.stamps;
            self.order.retain(|&(s, h)| stamps.get(&h) == Some(&s));
        }
        (low, high)
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

    /// A chained stream (each block's hash names its whole prefix, as vLLM's do): groups of
    /// a shared prefix of their own length, picked unevenly, each request with a private tail.
    fn chained_stream(seed: u64, requests: usize) -> Vec<Vec<BlockHash>> {
        let mut source = ChaCha8Rng::seed_from_u64(seed);
        let lens: Vec<usize> = (0..64).map(|_| source.gen_range(1..80)).collect();
        let chain = |prev: u64, x: u64| {
            (prev ^ x)
                .wrapping_mul(0xff51_afd7_ed55_8ccd)
                .rotate_left(29)
        };
        (0..requests)
            .map(|r| {
                // Squaring skews the pick towards the first groups.
                let g = (source.gen_range(0.0f64..1.0).powi(2) * 64.0) as usize;
                let tail = source.gen_range(0..24);
                let mut h = g as u64 + 1;
                (0..lens[g] + tail)
                    .map(|i| {
                        let x = if i < lens[g] {
                            i as u64
                        } else {
                            (r as u64) << 20 | i as u64
                        };
                        h = chain(h, x);
                        BlockHash(h)
                    })
                    .collect()
            })
            .collect()
    }

    /// With nothing evicted the sample holds exactly the modelled blocks the whole model
    /// holds, so the whole model's answer must lie in every request's bracket, and the
    /// bracket spans no more than the gaps between modelled blocks allow.
    #[test]
    fn a_sample_brackets_the_whole_models_answer() {
        let mut whole = BlockLru::with_shift(1 << 22, 0);
        let mut sample = BlockLru::new(1 << 22);
        assert_eq!(sample.shift, MAX_SHIFT);
        let (mut inside, mut width) = (0usize, 0usize);
        for (r, hs) in chained_stream(5, 4000).iter().enumerate() {
            let exact = whole.touch(hs) as usize;
            let (low, high) = sample.touch_bracket(hs);
            assert!(
                low <= exact && exact <= high,
                "request {r}: {exact} not in {low}..={high}"
            );
            inside += 1;
            width += high - low;
        }
        assert_eq!(inside, 4000);
        // A gap between modelled blocks is 2^shift on average.
        let mean = width as f64 / 4000.0;
        assert!(
            mean > 1.0 && mean < 2.0 * f64::from(1u32 << MAX_SHIFT),
            "mean width {mean}"
        );
    }

    /// Small caches are modelled whole, large ones sampled at no less than 1 in 2^MAX_SHIFT;
    /// a coarser bound keeps only the blocks of its sample.
    #[test]
    fn the_sample_follows_the_bound() {
        assert_eq!(shift_for(SAMPLE_ABOVE - 1), 0);
        assert_eq!(shift_for(SAMPLE_ABOVE), 1);
        assert_eq!(shift_for(usize::MAX), MAX_SHIFT);
        let mut lru = BlockLru::new(4096);
        let hs: Vec<BlockHash> = (0..4000).map(BlockHash).collect();
        lru.touch(&hs);
        assert_eq!(lru.len(), 4000);
        lru.set_capacity(1 << 20);
        let kept = lru.len();
        let expected = 4000 >> MAX_SHIFT;
        assert!(
            kept > expected * 3 / 4 && kept < expected * 5 / 4,
            "{kept} of 4000 kept at 1 in {}",
            1 << MAX_SHIFT
        );
        assert!(lru.stamps.keys().all(|&h| modelled(h, MAX_SHIFT)));
        assert_eq!(lru.order.len(), kept);
    }

    /// The Mooncake conversation trace's requests as 16-token blocks: its ids name
    /// prefix-chained 512-token blocks, each split here into 32 keys, and vLLM hashes full
    /// blocks only.
    fn mooncake_blocks() -> Vec<Vec<BlockHash>> {
        use kinference_bench::workload::Prompt;
        let path = kinference_testkit::shared("data/traces/mooncake/conversation_trace.jsonl");
        let trace = kinference_bench::sources::read_mooncake(&path, 512, usize::MAX).unwrap();
        trace
            .requests
            .iter()
            .map(|r| {
                let Prompt::Blocks { ids, len, .. } = &r.prompt else {
                    panic!("a Mooncake request without block ids");
                };
                ids.iter()
                    .flat_map(|id| (0..32).map(move |j| BlockHash(id * 32 + j)))
                    .take(len / 16)
                    .collect()
            })
            .collect()
    }

    /// The blocks found cached in all by round-robin over four workers (a baseline's routing),
    /// by the whole model and by the sample of a cache of `capacity` blocks per worker.
    fn whole_and_sampled(stream: &[Vec<BlockHash>], capacity: usize) -> (u64, u64) {
        let mut whole: Vec<BlockLru> = (0..4).map(|_| BlockLru::with_shift(capacity, 0)).collect();
        let mut sample: Vec<BlockLru> = (0..4).map(|_| BlockLru::new(capacity)).collect();
        assert_eq!(sample[0].shift, MAX_SHIFT);
        let (mut w, mut s) = (0u64, 0u64);
        for (r, hs) in stream.iter().enumerate() {
            w += u64::from(whole[r % 4].touch(hs));
            s += u64::from(sample[r % 4].touch(hs));
        }
        (w, s)
    }

    /// The sample's total against the whole model's within 3 % (measured: −1.4 % on the
    /// synthetic stream, +1.8 % and +0.6 % on the trace), on the Mooncake trace with and
    /// without much eviction and on a stream of long shared prefixes with short private tails
    /// (where a request's held prefix often runs to its last modelled block).
    #[test]
    fn the_samples_total_is_within_three_percent_of_the_whole_models() {
        let trace = mooncake_blocks();
        let synthetic = chained_stream(9, 40_000);
        for (name, stream, capacity) in [
            ("mooncake", &trace, 16_384),
            ("mooncake", &trace, 131_072),
            ("synthetic", &synthetic, 16_384),
        ] {
            let (w, s) = whole_and_sampled(stream, capacity);
            let err = (s as f64 - w as f64) / w as f64;
            // BENCHMARKS.md quotes these (`-- --nocapture`).
            eprintln!(
                "{name} at {capacity}: whole {w}, sample {s}, {:+.2} %",
                100.0 * err
            );
            assert!(
                w > 100_000 && err.abs() < 0.03,
                "{name} at {capacity}: whole {w}, sample {s}"
            );
        }
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
