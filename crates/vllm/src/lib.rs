//! vLLM's contracts as pure Rust: identifiers, block hashing, the KV-event wire format and the
//! Prometheus metrics a router reads.
//!
//! Invariants (see `docs/hashing.md`): a [`BlockHash`] is only comparable within one
//! (model, block size, hash algorithm, NONE_HASH seed, extra keys) space; the event value is the
//! last 8 bytes of the digest read big-endian. Nothing here does I/O or needs an async runtime.

pub mod events;
pub mod hashing;
pub mod ids;
pub mod metrics;

pub use events::codec::{
    decode_batch, decode_batch_with_stats, encode_batch, encode_batch_into, DecodeError,
    DecodeStats,
};
pub use events::frames::{parse_live, parse_replay, FrameError, LiveMessage, ReplayFrame};
pub use events::{
    BlockRemoved, BlockStored, ExtraKeyItem, HashValue, KvEvent, KvEventBatch, MapHeader,
};
pub use hashing::{
    BlockDigest, BlockHasher, EventHashForm, ExtraKeysFormat, HashAlgo, HashError, HashMemo, Lora,
    MmItem, RequestExtras, DEFAULT_MEMO_SLOTS, MEMO_MAX_BLOCK_TOKENS,
};
pub use ids::{BlockHash, DpRank, GroupIdx, Tier};
