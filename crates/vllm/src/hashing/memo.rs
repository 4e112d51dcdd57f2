//! A memo of block digests already computed: a router hashes the same shared prefixes (system
//! prompts, documents, a conversation's history) for request after request, and serialising and
//! digesting a block costs far more than finding it again.
//!
//! Invariants: a hit is returned only when the whole key matches — algorithm, parent digest
//! and every token of the block — so a memoized chain is byte for byte the computed one (the
//! parent digest already carries the seed and every earlier token). Blocks with extra keys
//! (LoRA, cache salt, multimodal items) are never memoized: their digest depends on more than
//! the key. Direct-mapped with a fixed number of slots: memory is bounded, a newer block
//! simply replaces the one in its slot, and a lookup is one probe.

use super::{BlockDigest, HashAlgo};

/// Slots of a memo made with [`HashMemo::default`]: 8,192 blocks (128k tokens at vLLM's
/// default block size), 1.1 MiB. Small on purpose: a memo that does not fit in the CPU's
/// caches costs a memory access per block on traffic that shares nothing, about what
/// digesting the block costs (`benches/hashing.rs`, `memo_all_new`).
pub const DEFAULT_MEMO_SLOTS: usize = 1 << 13;

/// Block digests by (algorithm, parent digest, block tokens). Not shared: keep one per thread.
#[derive(Debug, Clone)]
pub struct HashMemo {
    slots: Vec<Slot>,
    mask: usize,
    hits: u64,
    misses: u64,
}

/// Blocks of at most this many tokens are memoized (vLLM's default block size is 16); the
/// tokens live in the slot, so a lookup or a put touches one place in memory.
pub const MEMO_MAX_BLOCK_TOKENS: usize = 16;

#[derive(Debug, Clone, Default)]
struct Slot {
    /// `None` while the slot is empty.
    algo: Option<HashAlgo>,
    len: u8,
    parent: BlockDigest,
    digest: BlockDigest,
    tokens: [u32; MEMO_MAX_BLOCK_TOKENS],
}

impl Slot {
    fn tokens(&self) -> &[u32] {
        &self.tokens[..usize::from(self.len)]
    }
}

impl Default for HashMemo {
    fn default() -> Self {
        HashMemo::with_slots(DEFAULT_MEMO_SLOTS)
    }
}

impl HashMemo {
    /// A memo of `slots` blocks (rounded up to a power of two, at least 1).
    pub fn with_slots(slots: usize) -> Self {
        let n = slots.max(1).next_power_of_two();
        HashMemo {
            slots: vec![Slot::default(); n],
            mask: n - 1,
            hits: 0,
            misses: 0,
        }
    }

    /// (hits, misses) so far.
    pub fn stats(&self) -> (u64, u64) {
        (self.hits, self.misses)
    }

    fn index(&self, parent: &BlockDigest, tokens: &[u32]) -> usize {
        // Digest bytes are uniform already; the tokens are mixed in so that siblings (one
        // parent, different continuations) land apart.
        // Four tokens a step in two independent lanes: a short dependency chain.
        let mut a = u64::from_le_bytes(parent.bytes[..8].try_into().unwrap_or_default());
        let mut b = 0x2545_f491_4f6c_dd1d_u64;
        let mut quads = tokens.chunks_exact(4);
        for q in &mut quads {
            a = (a ^ (u64::from(q[0]) << 32 | u64::from(q[1]))).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            b = (b ^ (u64::from(q[2]) << 32 | u64::from(q[3]))).wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
            a ^= a >> 29;
            b ^= b >> 31;
        }
        for &t in quads.remainder() {
            a = (a ^ u64::from(t)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
        let h = a ^ b.rotate_left(23);
        (h ^ (h >> 32)) as usize & self.mask
    }

    pub(super) fn get(
        &mut self,
        algo: HashAlgo,
        parent: &BlockDigest,
        tokens: &[u32],
    ) -> Option<BlockDigest> {
        if tokens.len() > MEMO_MAX_BLOCK_TOKENS {
            return None;
        }
        let slot = &self.slots[self.index(parent, tokens)];
        if slot.algo == Some(algo) && slot.parent == *parent && slot.tokens() == tokens {
            self.hits += 1;
            Some(slot.digest)
        } else {
            self.misses += 1;
            None
        }
    }

    pub(super) fn put(
        &mut self,
        algo: HashAlgo,
        parent: &BlockDigest,
        tokens: &[u32],
        digest: BlockDigest,
    ) {
        if tokens.len() > MEMO_MAX_BLOCK_TOKENS {
            return;
        }
        let i = self.index(parent, tokens);
        let slot = &mut self.slots[i];
        slot.algo = Some(algo);
        slot.parent = *parent;
        slot.digest = digest;
        slot.len = tokens.len() as u8;
        slot.tokens[..tokens.len()].copy_from_slice(tokens);
    }
}
