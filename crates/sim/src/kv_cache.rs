//! vLLM's `KVCacheManager` for one full-attention group: per-request block tables over the
//! [`BlockPool`] — prefix lookup (`get_computed_blocks`), slot allocation (`allocate_slots`),
//! caching of newly full blocks, and freeing.
//!
//! Invariants: a request is never served its last prompt token from the cache (the hit is
//! capped at `num_tokens - 1`, rounded down to a block boundary, because the model must run on
//! at least one token to produce logits); blocks are cached, and their `BlockStored` queued,
//! in the step that schedules their last token; a request's blocks are freed tail first.

use kinference_vllm::BlockHasher;

use crate::block_pool::{BlockId, BlockPool, StoredInfo};
use crate::request::ReqState;

/// Block-table operations; stateless beyond the engine's settings.
#[derive(Clone, Debug)]
pub(crate) struct KvCacheManager {
    pub block_size: usize,
    pub max_model_len: usize,
}

impl KvCacheManager {
    /// The longest cached prefix of `req`, as blocks and tokens (vLLM's
    /// `get_computed_blocks` / `find_longest_cache_hit`).
    pub(crate) fn computed_blocks(
        &self,
        pool: &BlockPool,
        req: &ReqState,
    ) -> (Vec<BlockId>, usize) {
        if !pool.caching_enabled() {
            return (Vec::new(), 0);
        }
        let max_blocks = req.num_tokens().saturating_sub(1) / self.block_size;
        let mut hits = Vec::new();
        for d in req.digests.iter().take(max_blocks) {
            match pool.get_cached(d) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        let tokens = hits.len() * self.block_size;
        (hits, tokens)
    }

    /// Makes room for `num_new_tokens` more tokens of `req` on top of its computed tokens and
    /// the prefix-hit blocks `hits` (empty for a running request); caches the blocks that
    /// these tokens fill. False, with nothing changed, when the free blocks do not suffice.
    pub(crate) fn allocate_slots(
        &self,
        pool: &mut BlockPool,
        req: &mut ReqState,
        num_new_tokens: usize,
        hits: &[BlockId],
        hasher: Option<&BlockHasher>,
    ) -> bool {
        let computed = req.num_computed + hits.len() * self.block_size;
        let need = (computed + num_new_tokens).min(self.max_model_len);
        let required = need.div_ceil(self.block_size);
        let have = req.blocks.len() + hits.len();
        // Touching a free hit block takes it off the free queue: it counts against capacity.
        let to_allocate = required.saturating_sub(have) + pool.num_evictable(hits);
        if to_allocate > pool.num_free() {
            return false;
        }
        if !hits.is_empty() {
            pool.touch(hits);
            req.blocks.extend_from_slice(hits);
            req.num_cached_blocks = req.blocks.len();
        }
        let fresh = required.saturating_sub(req.blocks.len());
        if fresh > 0 {
            match pool.allocate(fresh) {
                Some(b) => req.blocks.extend(b),
                None => return false,
            }
        }
        let to_cache = (computed + num_new_tokens).min(req.num_tokens());
        self.cache_blocks(pool, req, to_cache, hasher);
        true
    }

    /// Caches the blocks full within the first `num_tokens` tokens that are not cached yet.
    fn cache_blocks(
        &self,
        pool: &mut BlockPool,
        req: &mut ReqState,
        num_tokens: usize,
        hasher: Option<&BlockHasher>,
    ) {
        let bs = self.block_size;
        let from = req.num_cached_blocks;
        let to = (num_tokens / bs).min(req.blocks.len());
        if from >= to || req.digests.len() < to {
            return;
        }
        let info = match (pool.events_enabled(), hasher) {
            (true, Some(h)) => Some(StoredInfo {
                parent: from.checked_sub(1).and_then(|i| req.digests.get(i)),
                tokens: &req.tokens[from * bs..to * bs],
                block_size: bs,
                extra_keys: (from..to)
                    .map(|i| h.event_extra_keys(i, &req.extras))
                    .collect(),
                lora_id: req.extras.lora.as_ref().and(req.lora_id),
                lora_name: req.extras.lora.as_ref().map(|l| l.name.clone()),
            }),
            _ => None,
        };
        pool.cache_full_blocks(&req.blocks[from..to], &req.digests[from..to], info);
        req.num_cached_blocks = to;
    }

    /// Returns all of `req`'s blocks to the pool, tail first.
    pub(crate) fn free(&self, pool: &mut BlockPool, req: &mut ReqState) {
        pool.free(req.blocks.iter().rev().copied());
        req.blocks.clear();
        req.num_cached_blocks = 0;
    }
}
