//! vLLM's prefix-cache block hashing (`vllm/v1/core/kv_cache_utils.py`), byte-exact.
//!
//! `digest(block) = hash_fn((parent_digest or NONE_HASH, tuple(block_tokens), extra_keys or None))`
//! with `NONE_HASH = hash_fn(seed)`. `hash_fn` serialises with pickle protocol 5 (`sha256`,
//! `xxhash`) or canonical CBOR (`sha256_cbor`, `xxhash_cbor`) and digests with SHA-256 (32 bytes)
//! or XXH3-128 (16 bytes, big-endian). The KV-event value of a digest is its last 8 bytes read
//! big-endian ([`BlockDigest::event_hash`]).
//!
//! Invariants (also in `docs/hashing.md`): only full blocks are hashed; a digest depends on the
//! block size, the algorithm, the seed, every earlier token and the extra keys, so digests are
//! comparable only between hashers built with the same four settings.

mod cbor;
mod keys;
mod memo;
mod pickle;

use std::cell::RefCell;
use std::fmt;
use std::str::FromStr;

use sha2::{Digest as _, Sha256};

use crate::events::{ExtraKeyItem, HashValue};
use crate::ids::BlockHash;
pub use memo::{HashMemo, DEFAULT_MEMO_SLOTS, MEMO_MAX_BLOCK_TOKENS};
use pickle::{Memo, Pickler, Shared};

/// The seed vLLM 0.34 uses for the sha256 variants when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SHA256_SEED: &str = "vllm-none-hash";

/// Errors from building a hasher or from malformed input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HashError {
    #[error("unknown hash algorithm {0:?} (expected sha256, sha256_cbor, xxhash or xxhash_cbor)")]
    UnknownAlgo(String),
    #[error("unknown extra-keys format {0:?} (expected tagged or untagged)")]
    UnknownExtraKeysFormat(String),
    #[error("block size must be at least 1")]
    ZeroBlockSize,
    #[error(
        "{0} without PYTHONHASHSEED uses a random NONE_HASH in vLLM: pass the replica's \
         PYTHONHASHSEED to reproduce its hashes"
    )]
    SeedRequired(HashAlgo),
    #[error("a block of {len} tokens is not full (block size {block_size}); partial blocks are never hashed")]
    PartialBlock { len: usize, block_size: usize },
    #[error("a block digest is 16 or 32 bytes, got {0}")]
    DigestLength(usize),
    #[error("invalid hex digest")]
    InvalidHex,
}

impl HashError {
    /// A stable label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            HashError::UnknownAlgo(_) => "unknown_algo",
            HashError::UnknownExtraKeysFormat(_) => "unknown_extra_keys_format",
            HashError::ZeroBlockSize => "zero_block_size",
            HashError::SeedRequired(_) => "seed_required",
            HashError::PartialBlock { .. } => "partial_block",
            HashError::DigestLength(_) => "digest_length",
            HashError::InvalidHex => "invalid_hex",
        }
    }
}

/// `--prefix-caching-hash-algo`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    /// Pickle protocol 5 + SHA-256 (vLLM's default).
    #[default]
    Sha256,
    /// Canonical CBOR + SHA-256.
    Sha256Cbor,
    /// Pickle protocol 5 + XXH3-128.
    Xxhash,
    /// Canonical CBOR + XXH3-128.
    XxhashCbor,
}

impl HashAlgo {
    pub const ALL: [HashAlgo; 4] = [
        HashAlgo::Sha256,
        HashAlgo::Sha256Cbor,
        HashAlgo::Xxhash,
        HashAlgo::XxhashCbor,
    ];

    /// vLLM's name for the algorithm.
    pub fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::Xxhash => "xxhash",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Digest length in bytes: 32 for SHA-256, 16 for XXH3-128.
    pub fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => 32,
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => 16,
        }
    }

    /// Whether the hash input is canonical CBOR (otherwise pickle protocol 5).
    pub fn uses_cbor(self) -> bool {
        matches!(self, HashAlgo::Sha256Cbor | HashAlgo::XxhashCbor)
    }

    /// The NONE_HASH seed vLLM 0.34 uses when `PYTHONHASHSEED` is unset; `None` where it draws
    /// a random one (the xxhash variants).
    pub fn default_seed(self) -> Option<&'static str> {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => Some(DEFAULT_SHA256_SEED),
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => None,
        }
    }

    fn digest(self, input: &[u8]) -> BlockDigest {
        match self {
            HashAlgo::Sha256 | HashAlgo::Sha256Cbor => {
                let mut bytes = [0u8; 32];
                bytes.copy_from_slice(&Sha256::digest(input));
                BlockDigest { bytes, len: 32 }
            }
            HashAlgo::Xxhash | HashAlgo::XxhashCbor => {
                // Python's xxh3_128_digest is the canonical (big-endian) form of the u128.
                let mut bytes = [0u8; 32];
                bytes[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(input).to_be_bytes());
                BlockDigest { bytes, len: 16 }
            }
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        HashAlgo::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| HashError::UnknownAlgo(s.to_string()))
    }
}

/// How extra keys are laid out in the hash input.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum ExtraKeysFormat {
    /// vLLM 0.34: `("lora", name, path)`, `("mm", id, offset)`, `("cache_salt", salt)`,
    /// `("prompt_embeds", digest)`.
    #[default]
    Tagged,
    /// vLLM ≤ 0.24: `name`, `(id, offset)`, `salt`, `digest` (no LoRA path).
    Untagged,
}

impl ExtraKeysFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            ExtraKeysFormat::Tagged => "tagged",
            ExtraKeysFormat::Untagged => "untagged",
        }
    }
}

impl fmt::Display for ExtraKeysFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ExtraKeysFormat {
    type Err = HashError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tagged" => Ok(ExtraKeysFormat::Tagged),
            "untagged" => Ok(ExtraKeysFormat::Untagged),
            _ => Err(HashError::UnknownExtraKeysFormat(s.to_string())),
        }
    }
}

/// Which form a digest takes in KV events (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum EventHashForm {
    /// `1` (default): the last 8 digest bytes as a big-endian u64.
    #[default]
    Int,
    /// `0`: the digest bytes themselves.
    Bytes,
}

/// A full block digest: 32 bytes (SHA-256) or 16 bytes (XXH3-128). `Copy`, no allocation.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct BlockDigest {
    bytes: [u8; 32],
    len: u8,
}

impl BlockDigest {
    /// A digest from its bytes; only 16 and 32 bytes are digests vLLM produces.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HashError> {
        if bytes.len() != 16 && bytes.len() != 32 {
            return Err(HashError::DigestLength(bytes.len()));
        }
        let mut out = [0u8; 32];
        out[..bytes.len()].copy_from_slice(bytes);
        Ok(BlockDigest {
            bytes: out,
            len: bytes.len() as u8,
        })
    }

    pub fn from_hex(s: &str) -> Result<Self, HashError> {
        let raw = s.as_bytes();
        if !raw.len().is_multiple_of(2) {
            return Err(HashError::InvalidHex);
        }
        let mut bytes = Vec::with_capacity(raw.len() / 2);
        for pair in raw.chunks_exact(2) {
            let hi = hex_val(pair[0]).ok_or(HashError::InvalidHex)?;
            let lo = hex_val(pair[1]).ok_or(HashError::InvalidHex)?;
            bytes.push(hi << 4 | lo);
        }
        Self::from_bytes(&bytes)
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// The KV-event value: the last 8 bytes, big-endian.
    pub fn event_hash(&self) -> BlockHash {
        BlockHash::from_digest(self.as_bytes())
    }

    /// The value a KV event carries for this digest.
    pub fn to_hash_value(&self, form: EventHashForm) -> HashValue {
        match form {
            EventHashForm::Int => HashValue::Int(self.event_hash().0),
            EventHashForm::Bytes => HashValue::Bytes(self.as_bytes().to_vec()),
        }
    }

    /// Lower-case hex of the digest bytes.
    pub fn to_hex(&self) -> String {
        self.to_string()
    }
}

fn hex_val(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

impl fmt::Display for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.as_bytes() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({self})")
    }
}

/// A LoRA adapter as it enters the hash: `--lora-modules name=path`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Lora {
    pub name: String,
    pub path: String,
}

/// One multimodal item: its identifier (vLLM's `mm_hash`) and its placeholder token range.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MmItem {
    pub identifier: String,
    /// First placeholder token, as an index into the request's token ids.
    pub offset: usize,
    /// Number of placeholder tokens.
    pub length: usize,
}

/// Everything besides token ids that enters a request's block hashes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct RequestExtras {
    pub lora: Option<Lora>,
    /// Sorted by offset and disjoint, as vLLM's placeholders are.
    pub mm: Vec<MmItem>,
    /// Keys block 0 only (later blocks inherit it through the parent chain); empty means none.
    pub cache_salt: Option<String>,
    /// One SHA-256 digest of the block's prompt-embedding bytes per block index
    /// (see [`prompt_embeds_block_digests`]); blocks past the end get no prompt-embeds key.
    pub prompt_embeds_digests: Vec<Vec<u8>>,
}

impl RequestExtras {
    /// True when no block of this request has extra keys.
    pub fn is_empty(&self) -> bool {
        self.lora.is_none()
            && self.mm.is_empty()
            && self.cache_salt.as_deref().is_none_or(str::is_empty)
            && self.prompt_embeds_digests.is_empty()
    }
}

/// vLLM's per-block prompt-embeds key: SHA-256 of the raw tensor bytes of each full block's
/// rows (`tensor_data(prompt_embeds[start:end])`), `bytes_per_token` bytes per row.
pub fn prompt_embeds_block_digests(
    embeds: &[u8],
    bytes_per_token: usize,
    block_size: usize,
) -> Vec<Vec<u8>> {
    let block_bytes = bytes_per_token.saturating_mul(block_size);
    if block_bytes == 0 {
        return Vec::new();
    }
    embeds
        .chunks_exact(block_bytes)
        .map(|chunk| Sha256::digest(chunk).to_vec())
        .collect()
}

/// Per-thread serialisation buffers, reused so hashing a block allocates nothing once warm.
#[derive(Debug, Default)]
struct Scratch {
    buf: Vec<u8>,
    memo: Memo,
}

/// Buffers above this size are released after use rather than kept per thread.
const SCRATCH_KEEP_BYTES: usize = 1 << 20;

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut scratch) => {
            let r = f(&mut scratch);
            if scratch.buf.capacity() > SCRATCH_KEEP_BYTES {
                scratch.buf = Vec::new();
            }
            r
        }
        Err(_) => f(&mut Scratch::default()),
    })
}

/// Hashes token blocks exactly as one vLLM configuration does. Immutable and cheap to clone;
/// share one per (block size, algorithm, seed, format) across threads.
#[derive(Clone, Debug)]
pub struct BlockHasher {
    algo: HashAlgo,
    block_size: usize,
    format: ExtraKeysFormat,
    seed: String,
    none_hash: BlockDigest,
}

impl BlockHasher {
    /// `seed` is the replica's `PYTHONHASHSEED` if set. Without it the sha256 variants use
    /// `"vllm-none-hash"` (vLLM 0.34); the xxhash variants draw a random NONE_HASH in vLLM, so
    /// they cannot be reproduced and this returns [`HashError::SeedRequired`]. vLLM ≤ 0.24
    /// randomised every algorithm without `PYTHONHASHSEED`: pass the seed for those replicas.
    pub fn new(
        algo: HashAlgo,
        block_size: usize,
        seed: Option<&str>,
        format: ExtraKeysFormat,
    ) -> Result<Self, HashError> {
        if block_size == 0 {
            return Err(HashError::ZeroBlockSize);
        }
        let seed = seed
            .or(algo.default_seed())
            .ok_or(HashError::SeedRequired(algo))?
            .to_string();
        let none_hash = with_scratch(|s| {
            seed_input(algo, &seed, s);
            algo.digest(&s.buf)
        });
        Ok(BlockHasher {
            algo,
            block_size,
            format,
            seed,
            none_hash,
        })
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn format(&self) -> ExtraKeysFormat {
        self.format
    }

    /// The seed NONE_HASH was derived from (hashed as a Python `str`).
    pub fn seed(&self) -> &str {
        &self.seed
    }

    /// The parent of block 0: `hash_fn(seed)`.
    pub fn none_hash(&self) -> &BlockDigest {
        &self.none_hash
    }

    /// The serialised seed that NONE_HASH digests.
    pub fn none_hash_input_bytes(&self) -> Vec<u8> {
        with_scratch(|s| {
            seed_input(self.algo, &self.seed, s);
            s.buf.clone()
        })
    }

    /// Digests of every full block of `tokens`, from block 0; a partial tail is not hashed.
    pub fn hash_blocks(&self, tokens: &[u32], extras: &RequestExtras) -> Vec<BlockDigest> {
        self.hash_blocks_from(None, tokens, 0, extras)
    }

    /// Continues a chain: digests of the full blocks `first_block..` of `tokens` (the whole
    /// token sequence, so that block positions stay absolute), given the digest of block
    /// `first_block - 1` as `parent` (`None` when `first_block` is 0).
    pub fn hash_blocks_from(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[u32],
        first_block: usize,
        extras: &RequestExtras,
    ) -> Vec<BlockDigest> {
        let full = tokens.len() / self.block_size;
        let mut out = Vec::with_capacity(full.saturating_sub(first_block));
        let mut parent = parent.copied();
        with_scratch(|s| {
            for (index, block) in tokens
                .chunks_exact(self.block_size)
                .enumerate()
                .skip(first_block)
            {
                self.block_input(parent.as_ref(), block, index, extras, s);
                let digest = self.algo.digest(&s.buf);
                out.push(digest);
                parent = Some(digest);
            }
        });
        out
    }

    /// [`BlockHasher::hash_blocks`] through `memo`: blocks without extra keys whose (parent,
    /// tokens) the memo holds are not serialised and digested again, and the ones computed
    /// are put in it. The result equals `hash_blocks`'s (see [`HashMemo`]).
    pub fn hash_blocks_memo(
        &self,
        tokens: &[u32],
        extras: &RequestExtras,
        memo: &mut HashMemo,
    ) -> Vec<BlockDigest> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        let mut parent = self.none_hash;
        let no_keys = extras.is_empty();
        // Two lookups missed in a row: the chain has left what the memo holds (a later
        // block's parent is a digest it has not seen), so the rest is not looked up: a lookup
        // that misses costs a cache line from memory, about what digesting the block costs.
        // One miss alone may be a slot taken by another block.
        let mut misses_in_a_row = 0;
        with_scratch(|s| {
            for (index, block) in tokens.chunks_exact(self.block_size).enumerate() {
                let n_keys = if no_keys {
                    0
                } else {
                    keys::count(extras, self.format, index, self.block_size)
                };
                let plain = n_keys == 0;
                let found = if plain && misses_in_a_row < 2 {
                    let found = memo.get(self.algo, &parent, block);
                    misses_in_a_row = if found.is_some() {
                        0
                    } else {
                        misses_in_a_row + 1
                    };
                    found
                } else {
                    None
                };
                let digest = match found {
                    Some(d) => d,
                    None => {
                        self.block_input_keyed(Some(&parent), block, index, extras, n_keys, s);
                        let d = self.algo.digest(&s.buf);
                        if plain {
                            memo.put(self.algo, &parent, block, d);
                        }
                        d
                    }
                };
                out.push(digest);
                parent = digest;
            }
        });
        out
    }

    /// The digest of one full block at `block_index`, child of `parent` (`None` for block 0).
    pub fn hash_block(
        &self,
        parent: Option<&BlockDigest>,
        block_tokens: &[u32],
        block_index: usize,
        extras: &RequestExtras,
    ) -> Result<BlockDigest, HashError> {
        self.check_full(block_tokens)?;
        Ok(with_scratch(|s| {
            self.block_input(parent, block_tokens, block_index, extras, s);
            self.algo.digest(&s.buf)
        }))
    }

    /// The exact bytes `hash_fn` digests for one block (pickle or CBOR).
    pub fn hash_input_bytes(
        &self,
        parent: Option<&BlockDigest>,
        block_tokens: &[u32],
        block_index: usize,
        extras: &RequestExtras,
    ) -> Result<Vec<u8>, HashError> {
        self.check_full(block_tokens)?;
        Ok(with_scratch(|s| {
            self.block_input(parent, block_tokens, block_index, extras, s);
            s.buf.clone()
        }))
    }

    /// The extra keys of block `block_index` as they enter the hash, in this hasher's format.
    pub fn hash_extra_keys(
        &self,
        block_index: usize,
        extras: &RequestExtras,
    ) -> Option<Vec<ExtraKeyItem>> {
        keys::hash_items(extras, self.format, block_index, self.block_size)
    }

    /// The extra keys vLLM publishes for block `block_index` in `BlockStored.extra_keys`
    /// (untagged, LoRA name without path); `None` when the block has none.
    pub fn event_extra_keys(
        &self,
        block_index: usize,
        extras: &RequestExtras,
    ) -> Option<Vec<ExtraKeyItem>> {
        keys::event_items(extras, block_index, self.block_size)
    }

    fn check_full(&self, block_tokens: &[u32]) -> Result<(), HashError> {
        if block_tokens.len() == self.block_size {
            Ok(())
        } else {
            Err(HashError::PartialBlock {
                len: block_tokens.len(),
                block_size: self.block_size,
            })
        }
    }

    fn block_input(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[u32],
        index: usize,
        extras: &RequestExtras,
        s: &mut Scratch,
    ) {
        let n_keys = keys::count(extras, self.format, index, self.block_size);
        self.block_input_keyed(parent, tokens, index, extras, n_keys, s);
    }

    /// [`BlockHasher::block_input`] for a block whose extra keys were counted already.
    fn block_input_keyed(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[u32],
        index: usize,
        extras: &RequestExtras,
        n_keys: usize,
        s: &mut Scratch,
    ) {
        let parent = parent.unwrap_or(&self.none_hash).as_bytes();
        if self.algo.uses_cbor() {
            s.buf.clear();
            self.cbor_input(parent, tokens, index, extras, n_keys, &mut s.buf);
        } else {
            self.pickle_input(parent, tokens, index, extras, n_keys, s);
        }
    }

    fn pickle_input(
        &self,
        parent: &[u8],
        tokens: &[u32],
        index: usize,
        extras: &RequestExtras,
        n_keys: usize,
        s: &mut Scratch,
    ) {
        s.buf.reserve(tokens.len() * 5 + 64);
        let mut p = Pickler::new(&mut s.buf, &mut s.memo);
        p.tuple_begin(3);
        p.save_bytes(parent);
        p.tuple_begin(tokens.len());
        p.save_u32_run(tokens);
        p.tuple_end(tokens.len());
        if n_keys == 0 {
            p.save_none();
        } else {
            p.tuple_begin(n_keys);
            keys::for_each_key(extras, self.format, index, self.block_size, |key| {
                let atoms = key.atoms();
                if key.is_tuple() {
                    p.tuple_begin(atoms.len());
                }
                for atom in atoms {
                    pickle_atom(&mut p, atom);
                }
                if key.is_tuple() {
                    p.tuple_end(atoms.len());
                }
            });
            p.tuple_end(n_keys);
        }
        p.tuple_end(3);
        p.finish();
    }

    fn cbor_input(
        &self,
        parent: &[u8],
        tokens: &[u32],
        index: usize,
        extras: &RequestExtras,
        n_keys: usize,
        out: &mut Vec<u8>,
    ) {
        out.reserve(tokens.len() * 5 + 64);
        cbor::array(out, 3);
        cbor::bytes(out, parent);
        cbor::array(out, tokens.len());
        cbor::uint_run(out, tokens);
        if n_keys == 0 {
            cbor::null(out);
            return;
        }
        cbor::array(out, n_keys);
        keys::for_each_key(extras, self.format, index, self.block_size, |key| {
            let atoms = key.atoms();
            if key.is_tuple() {
                cbor::array(out, atoms.len());
            }
            for atom in atoms {
                match *atom {
                    keys::Atom::Tag(t) => cbor::text(out, t),
                    keys::Atom::Str(t) => cbor::text(out, t),
                    keys::Atom::Bytes(b) => cbor::bytes(out, b),
                    keys::Atom::Int(i) => cbor::int(out, i),
                }
            }
        });
    }
}

fn pickle_atom(p: &mut Pickler<'_>, atom: &keys::Atom<'_>) {
    match *atom {
        keys::Atom::Tag(t) => p.save_str(t, Some(Shared::Tag(t))),
        keys::Atom::Str(t) => p.save_str(t, Shared::of_runtime_str(t)),
        keys::Atom::Bytes(b) => p.save_bytes(b),
        keys::Atom::Int(i) => p.save_int(i128::from(i)),
    }
}

/// Appends each value's encoding, given as the low `len` bytes of a little-endian word (at most
/// 8), writing whole words into a pre-sized tail: one bounds check per value, no reallocation.
fn pack_words(out: &mut Vec<u8>, values: &[u32], word: impl Fn(u32) -> (u64, usize)) {
    let start = out.len();
    out.resize(start + values.len() * 8 + 8, 0);
    let mut pos = start;
    for &v in values {
        let (w, len) = word(v);
        if let Some(slot) = out.get_mut(pos..pos + 8) {
            slot.copy_from_slice(&w.to_le_bytes());
        }
        pos += len;
    }
    out.truncate(pos);
}

/// `hash_fn(seed)`'s input: the seed as a Python `str`.
fn seed_input(algo: HashAlgo, seed: &str, s: &mut Scratch) {
    if algo.uses_cbor() {
        s.buf.clear();
        cbor::text(&mut s.buf, seed);
    } else {
        let mut p = Pickler::new(&mut s.buf, &mut s.memo);
        p.save_str(seed, None);
        p.finish();
    }
}

#[cfg(test)]
mod tests;
