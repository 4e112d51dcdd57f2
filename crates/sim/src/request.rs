//! Requests: what a caller submits ([`Request`]) and what the engine tracks per request
//! (`ReqState`), plus the deterministic pseudo-tokens the simulator "generates".
//!
//! Invariants of `ReqState`: `digests` holds the digest of every full block of `tokens`
//! (prompt and output) when prefix caching is on; `num_computed <= tokens.len()`;
//! `blocks` covers at least `num_computed` tokens while the request runs and is empty
//! otherwise; `blocks[..num_cached_blocks]` carry their digests in the pool.

use std::sync::Arc;

use kinference_vllm::{BlockDigest, BlockHasher, RequestExtras};

use crate::block_pool::BlockId;
use crate::time::SimTime;

/// A completion request as the engine sees it: token ids in, `max_tokens` tokens out.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub id: String,
    pub prompt: Vec<u32>,
    /// Tokens to generate; the simulator never samples an end-of-sequence token, so it
    /// generates exactly this many unless `max_model_len` stops it first.
    pub max_tokens: u32,
    /// LoRA adapter, cache salt, multimodal items: everything that enters block hashes.
    pub extras: RequestExtras,
    /// The adapter's integer id as vLLM publishes it in `BlockStored.lora_id`.
    pub lora_id: Option<i64>,
}

impl Request {
    pub fn new(id: impl Into<String>, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Request {
            id: id.into(),
            prompt,
            max_tokens,
            extras: RequestExtras::default(),
            lora_id: None,
        }
    }

    pub fn with_extras(mut self, extras: RequestExtras) -> Self {
        self.extras = extras;
        self
    }

    pub fn with_lora_id(mut self, lora_id: i64) -> Self {
        self.lora_id = Some(lora_id);
        self
    }
}

/// SplitMix64: a cheap, well-mixed step for deterministic pseudo-random streams.
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of a request id: the seed of its generated tokens.
pub fn seed_of(id: &str) -> u64 {
    id.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The `index`-th pseudo-token of the stream `seed`, in `0..vocab` (`vocab` 0 is read as 1).
pub fn pseudo_token(seed: u64, index: u64, vocab: u32) -> u32 {
    let r = splitmix64(seed ^ splitmix64(index));
    (r % u64::from(vocab.max(1))) as u32
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Running,
    Preempted,
}

/// The engine's per-request state.
#[derive(Debug)]
pub(crate) struct ReqState {
    pub id: Arc<str>,
    pub tokens: Vec<u32>,
    pub num_prompt: usize,
    pub max_tokens: usize,
    pub extras: RequestExtras,
    pub lora_id: Option<i64>,
    pub digests: Vec<BlockDigest>,
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    pub num_cached_blocks: usize,
    pub status: Status,
    pub num_preemptions: u32,
    /// Prompt tokens served from the prefix cache at first scheduling (`cached_tokens`).
    pub num_cached_tokens: Option<usize>,
    pub seed: u64,
    pub arrival: SimTime,
    pub first_scheduled: Option<SimTime>,
    pub first_token: Option<SimTime>,
    pub last_token: Option<SimTime>,
}

impl ReqState {
    pub(crate) fn new(req: Request, arrival: SimTime, hasher: Option<&BlockHasher>) -> Self {
        let seed = seed_of(&req.id);
        let num_prompt = req.prompt.len();
        let mut s = ReqState {
            id: Arc::from(req.id),
            tokens: req.prompt,
            num_prompt,
            max_tokens: req.max_tokens as usize,
            extras: req.extras,
            lora_id: req.lora_id,
            digests: Vec::new(),
            num_computed: 0,
            blocks: Vec::new(),
            num_cached_blocks: 0,
            status: Status::Waiting,
            num_preemptions: 0,
            num_cached_tokens: None,
            seed,
            arrival,
            first_scheduled: None,
            first_token: None,
            last_token: None,
        };
        if let Some(h) = hasher {
            s.extend_digests(h);
        }
        s
    }

    pub(crate) fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn num_output(&self) -> usize {
        self.tokens.len() - self.num_prompt
    }

    /// Hashes the full blocks of `tokens` not yet hashed.
    pub(crate) fn extend_digests(&mut self, hasher: &BlockHasher) {
        let full = self.tokens.len() / hasher.block_size();
        if full <= self.digests.len() {
            return;
        }
        let more = hasher.hash_blocks_from(
            self.digests.last(),
            &self.tokens,
            self.digests.len(),
            &self.extras,
        );
        self.digests.extend(more);
    }

    /// Appends the next pseudo-token and hashes a block it completes.
    pub(crate) fn append_output(&mut self, vocab: u32, hasher: Option<&BlockHasher>) -> u32 {
        let t = pseudo_token(self.seed, self.num_output() as u64, vocab);
        self.tokens.push(t);
        if let Some(h) = hasher {
            self.extend_digests(h);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_vllm::{ExtraKeysFormat, HashAlgo};

    #[test]
    fn pseudo_tokens_are_deterministic_and_in_range() {
        let a: Vec<u32> = (0..100)
            .map(|i| pseudo_token(seed_of("r1"), i, 1000))
            .collect();
        let b: Vec<u32> = (0..100)
            .map(|i| pseudo_token(seed_of("r1"), i, 1000))
            .collect();
        let c: Vec<u32> = (0..100)
            .map(|i| pseudo_token(seed_of("r2"), i, 1000))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|&t| t < 1000));
        assert_eq!(pseudo_token(1, 1, 0), 0);
    }

    #[test]
    fn digests_follow_tokens_including_outputs() {
        let h = BlockHasher::new(HashAlgo::Sha256Cbor, 4, None, ExtraKeysFormat::Tagged).unwrap();
        let mut s = ReqState::new(
            Request::new("x", (0..10).collect(), 8),
            SimTime::ZERO,
            Some(&h),
        );
        assert_eq!(s.digests.len(), 2);
        s.append_output(50, Some(&h));
        assert_eq!(s.digests.len(), 2);
        s.append_output(50, Some(&h));
        assert_eq!(s.digests.len(), 3);
        assert_eq!(
            s.digests,
            h.hash_blocks(&s.tokens, &RequestExtras::default())
        );
    }
}
