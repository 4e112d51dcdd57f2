//! vLLM's `BlockPool` (vllm/v1/core/block_pool.py, 0.32): KV blocks with reference counts, the
//! free-block queue in eviction order, the prefix-cache map from block digest to blocks, and
//! the KV events those produce.
//!
//! Semantics mirrored from vLLM:
//! * Block 0 is the null block: never allocated, never free; usage is measured over the rest.
//! * Allocation pops the front of the free queue; a popped block that still carries a digest
//!   is evicted from the cache map and one `BlockRemoved` per evicted hash is queued.
//! * Freeing decrements reference counts; blocks reaching zero without a digest go to the
//!   front (reused first), blocks with a digest go to the back in the order given, so callers
//!   free a request's blocks tail first and its tail is evicted first.
//! * A prefix hit "touches" a block: a free one leaves the queue, its count goes up.
//! * Identical full blocks are not de-duplicated: two requests filling the same block each
//!   cache their own copy, and both copies are stored, hit and evicted independently.
//!
//! Invariants ([`BlockPool::check_invariants`]): a block is on the free queue exactly when its
//! count is zero (the null block excepted); every map entry points to blocks carrying that
//! digest and every digest-carrying block is in the map.

mod free_queue;

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

use kinference_vllm::{
    BlockDigest, BlockRemoved, BlockStored, EventHashForm, ExtraKeyItem, KvEvent, MapHeader,
};

use free_queue::FreeQueue;

/// An index into the pool's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

/// How (and whether) the pool publishes KV events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventOptions {
    pub enabled: bool,
    /// Integer (default) or raw-digest block hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
    pub hash_form: EventHashForm,
    /// The `BlockStored` map header width to record (0.32 captures use fixmap).
    pub map_header: MapHeader,
}

impl Default for EventOptions {
    fn default() -> Self {
        EventOptions {
            enabled: true,
            hash_form: EventHashForm::Int,
            map_header: MapHeader::FixMap,
        }
    }
}

/// What a `BlockStored` event says beyond the hashes: the caller's request data.
#[derive(Debug)]
pub struct StoredInfo<'a> {
    pub parent: Option<&'a BlockDigest>,
    /// The tokens of exactly the blocks being stored.
    pub tokens: &'a [u32],
    pub block_size: usize,
    /// One entry per block being stored.
    pub extra_keys: Vec<Option<Vec<ExtraKeyItem>>>,
    pub lora_id: Option<i64>,
    pub lora_name: Option<String>,
}

/// vLLM's medium for its own GPU block pool.
const MEDIUM_GPU: &str = "GPU";
/// vLLM annotates `BlockStored` with the KV-cache group's spec kind; one full-attention group.
const SPEC_KIND_FULL_ATTENTION: &str = "full_attention";

#[derive(Clone, Debug, Default)]
struct Meta {
    ref_cnt: u32,
    digest: Option<BlockDigest>,
}

/// Blocks cached under one digest, oldest first (Python's dict keeps insertion order, and vLLM
/// hits the first).
#[derive(Clone, Debug)]
enum Holders {
    One(BlockId),
    Many(Vec<BlockId>),
}

/// The KV block pool of one engine.
#[derive(Debug)]
pub struct BlockPool {
    metas: Vec<Meta>,
    free: FreeQueue,
    cached: HashMap<BlockDigest, Holders, DigestHashBuilder>,
    enable_caching: bool,
    events: EventOptions,
    queue: Vec<KvEvent>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks including the null block; `None` below 2 blocks or
    /// above `u32::MAX` blocks.
    pub fn new(num_blocks: usize, enable_caching: bool, events: EventOptions) -> Option<Self> {
        if num_blocks < 2 || num_blocks > u32::MAX as usize {
            return None;
        }
        Some(BlockPool {
            metas: vec![Meta::default(); num_blocks],
            free: FreeQueue::new(num_blocks, 1),
            cached: HashMap::with_hasher(DigestHashBuilder),
            enable_caching,
            events,
            queue: Vec::new(),
        })
    }

    /// All blocks, the null block included (vLLM's `num_gpu_blocks`).
    pub fn num_blocks(&self) -> usize {
        self.metas.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// vLLM's `kv_cache_usage_perc`: the share of non-null blocks not on the free queue.
    pub fn usage(&self) -> f64 {
        let total = self.metas.len() - 1;
        1.0 - self.free.len() as f64 / total as f64
    }

    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    pub fn events_enabled(&self) -> bool {
        self.events.enabled
    }

    /// The first cached block with this digest, if any.
    pub fn get_cached(&self, digest: &BlockDigest) -> Option<BlockId> {
        match self.cached.get(digest)? {
            Holders::One(b) => Some(*b),
            Holders::Many(v) => v.first().copied(),
        }
    }

    /// Takes a reference on prefix-hit blocks; free ones leave the free queue.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            let Some(meta) = self.metas.get_mut(b.0 as usize) else {
                continue;
            };
            if meta.ref_cnt == 0 && b.0 != 0 {
                self.free.remove(b.0);
            }
            meta.ref_cnt += 1;
        }
    }

    /// How many of `blocks` a touch would take off the free queue.
    pub fn num_evictable(&self, blocks: &[BlockId]) -> usize {
        blocks.iter().filter(|b| self.free.contains(b.0)).count()
    }

    /// Takes `n` blocks from the front of the free queue, evicting their cached digests;
    /// `None` (and nothing changed) if fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free.pop_front()?;
            if self.enable_caching {
                self.evict(BlockId(id));
            }
            if let Some(meta) = self.metas.get_mut(id as usize) {
                meta.ref_cnt = 1;
            }
            out.push(BlockId(id));
        }
        Some(out)
    }

    /// Drops one reference from each block, given in eviction-priority order (the first
    /// is evicted first): unhashed blocks go to the front, hashed ones to the back.
    pub fn free<I: IntoIterator<Item = BlockId>>(&mut self, ordered: I) {
        let mut first = Vec::new();
        let mut last = Vec::new();
        for b in ordered {
            if b.0 == 0 {
                continue;
            }
            let Some(meta) = self.metas.get_mut(b.0 as usize) else {
                continue;
            };
            if meta.ref_cnt == 0 {
                // A double free would drive the count negative in vLLM; refuse it here.
                continue;
            }
            meta.ref_cnt -= 1;
            if meta.ref_cnt == 0 {
                if meta.digest.is_none() || !self.enable_caching {
                    first.push(b.0);
                } else {
                    last.push(b.0);
                }
            }
        }
        self.free.push_front_all(&first);
        for id in last {
            self.free.push_back(id);
        }
    }

    /// Marks `blocks` (newly full) as cached under `digests`, skipping blocks that already
    /// carry a digest (prefix hits), and queues one `BlockStored` for them.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[BlockId],
        digests: &[BlockDigest],
        info: Option<StoredInfo<'_>>,
    ) {
        if !self.enable_caching {
            return;
        }
        let mut stored = Vec::with_capacity(blocks.len());
        for (b, d) in blocks.iter().zip(digests) {
            let Some(meta) = self.metas.get_mut(b.0 as usize) else {
                continue;
            };
            if b.0 == 0 || meta.digest.is_some() {
                continue;
            }
            meta.digest = Some(*d);
            match self.cached.entry(*d) {
                Entry::Vacant(v) => {
                    v.insert(Holders::One(*b));
                }
                Entry::Occupied(mut o) => o.get_mut().push(*b),
            }
            stored.push(d.to_hash_value(self.events.hash_form));
        }
        if let (true, Some(info)) = (self.events.enabled, info) {
            self.queue.push(KvEvent::BlockStored(BlockStored {
                block_hashes: stored,
                parent_block_hash: info.parent.map(|p| p.to_hash_value(self.events.hash_form)),
                token_ids: info.tokens.to_vec(),
                block_size: u32::try_from(info.block_size).unwrap_or(u32::MAX),
                lora_id: info.lora_id,
                medium: Some(MEDIUM_GPU.into()),
                lora_name: info.lora_name,
                extra_keys: Some(info.extra_keys),
                group_idx: Some(0),
                kv_cache_spec_kind: Some(SPEC_KIND_FULL_ATTENTION.into()),
                map_header: self.events.map_header,
                ..BlockStored::default()
            }));
        }
    }

    /// vLLM's `reset_prefix_cache`: only when no block is referenced; forgets every digest and
    /// queues one `AllBlocksCleared`. `Err(n)` with the number of referenced blocks otherwise.
    pub fn reset(&mut self) -> Result<(), usize> {
        let used = self.metas.len() - 1 - self.free.len();
        if used != 0 {
            return Err(used);
        }
        self.cached.clear();
        for m in &mut self.metas {
            m.digest = None;
        }
        if self.events.enabled {
            self.queue.push(KvEvent::AllBlocksCleared);
        }
        Ok(())
    }

    /// Takes the queued events, oldest first.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.queue)
    }

    pub fn has_pending_events(&self) -> bool {
        !self.queue.is_empty()
    }

    fn evict(&mut self, b: BlockId) {
        let Some(meta) = self.metas.get_mut(b.0 as usize) else {
            return;
        };
        let Some(digest) = meta.digest.take() else {
            return;
        };
        let removed = match self.cached.entry(digest) {
            Entry::Vacant(_) => false,
            Entry::Occupied(mut o) => {
                let (hit, empty) = match o.get_mut() {
                    Holders::One(x) => (*x == b, *x == b),
                    Holders::Many(v) => {
                        let before = v.len();
                        v.retain(|x| *x != b);
                        (v.len() != before, v.is_empty())
                    }
                };
                if empty {
                    o.remove();
                }
                hit
            }
        };
        if removed && self.events.enabled {
            self.queue.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![digest.to_hash_value(self.events.hash_form)],
                medium: Some(MEDIUM_GPU.into()),
                group_idx: Some(0),
                ..BlockRemoved::default()
            }));
        }
    }

    // ---- inspection (tests, metrics, invariant checks) ----

    pub fn ref_count(&self, b: BlockId) -> Option<u32> {
        self.metas.get(b.0 as usize).map(|m| m.ref_cnt)
    }

    pub fn digest(&self, b: BlockId) -> Option<BlockDigest> {
        self.metas.get(b.0 as usize).and_then(|m| m.digest)
    }

    pub fn is_free(&self, b: BlockId) -> bool {
        self.free.contains(b.0)
    }

    /// Free blocks, front (evicted next) to back.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.iter().map(BlockId).collect()
    }

    /// Distinct digests in the prefix cache: what a KV-event subscriber that applied every
    /// event holds for this pool (copies of one block count once, as in its index).
    pub fn num_cached_digests(&self) -> usize {
        self.cached.len()
    }

    /// Every cached (digest, block) pair.
    pub fn cached_blocks(&self) -> Vec<(BlockDigest, BlockId)> {
        let mut out = Vec::with_capacity(self.cached.len());
        for (d, h) in &self.cached {
            match h {
                Holders::One(b) => out.push((*d, *b)),
                Holders::Many(v) => out.extend(v.iter().map(|b| (*d, *b))),
            }
        }
        out
    }

    /// Checks the pool's structural invariants; the error names the first violation.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, m) in self.metas.iter().enumerate().skip(1) {
            let queued = self.free.contains(i as u32);
            if queued != (m.ref_cnt == 0) {
                return Err(format!(
                    "block {i}: ref_cnt {} but queued={queued}",
                    m.ref_cnt
                ));
            }
            if let Some(d) = m.digest {
                if !self.cached_blocks_for(&d).contains(&BlockId(i as u32)) {
                    return Err(format!("block {i} carries a digest missing from the map"));
                }
            }
        }
        if self.free.contains(0) {
            return Err("the null block is on the free queue".into());
        }
        for (d, b) in self.cached_blocks() {
            if self.digest(b) != Some(d) {
                return Err(format!(
                    "map entry {d:?} -> {b:?} but the block carries another digest"
                ));
            }
        }
        if self.free.iter().count() != self.free.len() {
            return Err("free queue length disagrees with its links".into());
        }
        Ok(())
    }

    fn cached_blocks_for(&self, d: &BlockDigest) -> Vec<BlockId> {
        match self.cached.get(d) {
            None => Vec::new(),
            Some(Holders::One(b)) => vec![*b],
            Some(Holders::Many(v)) => v.clone(),
        }
    }
}

impl Holders {
    fn push(&mut self, b: BlockId) {
        match self {
            Holders::One(a) => *self = Holders::Many(vec![*a, b]),
            Holders::Many(v) => v.push(b),
        }
    }
}

/// Digests are uniformly random bytes already: fold them cheaply instead of SipHash.
#[derive(Clone, Copy, Debug, Default)]
struct DigestHashBuilder;

#[derive(Clone, Copy, Debug, Default)]
struct DigestHasher(u64);

impl BuildHasher for DigestHashBuilder {
    type Hasher = DigestHasher;
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(0)
    }
}

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        // hashbrown takes the bucket from the low bits: avalanche them (SplitMix64's finalizer).
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.0 =
                (self.0.rotate_left(5) ^ u64::from_le_bytes(w)).wrapping_mul(0x517c_c1b7_2722_0a95);
        }
    }
}

#[cfg(test)]
mod tests;
