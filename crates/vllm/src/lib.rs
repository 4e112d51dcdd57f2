//! vLLM's contracts as pure Rust: identifiers, block hashing and the KV-event wire format.
//!
//! Invariants (see `docs/hashing.md`): a [`BlockHash`] is only comparable within one
//! (model, block size, hash algorithm, NONE_HASH seed, extra keys) space; the event value is the
//! last 8 bytes of the digest read big-endian. Nothing here does I/O or needs an async runtime.

pub mod events;
pub mod ids;

pub use events::{BlockRemoved, BlockStored, HashValue, KvEvent, KvEventBatch};
pub use ids::{BlockHash, DpRank, GroupIdx, Tier};
