//! Which replica holds which KV-cache blocks (pure; no I/O, no async runtime).
//!
//! The [`Index`] maps vLLM block hashes to the workers — a replica's data-parallel rank, one
//! KV-event stream each — that hold them, per tier (GPU, CPU, STORAGE) and KV-cache group, and
//! answers the router's question: for a request's block-hash chain, how many blocks from the
//! start does each worker hold ([`Index::longest_prefix`])?
//!
//! Invariants:
//! - A block counts as held in a tier if any of its KV-cache groups holds it there; removing
//!   one group leaves it held by the others. Removing what is not held changes nothing and is
//!   counted.
//! - Copies are counted per (worker, block, tier, group): each stored hash adds one copy, each
//!   removed hash takes one away, and the block leaves that (tier, group) only when none is
//!   left. vLLM's block pool can cache several physical copies of one block under one hash
//!   (a fully cached prompt that is a whole number of blocks recomputes its last block and
//!   caches it again, announced by another `BlockStored`), and evicting one copy sends one
//!   `BlockRemoved` while the others keep serving hits. `AllBlocksCleared`,
//!   [`Index::clear_worker`] and [`Index::remove_replica`] drop every copy of the worker.
//!   Known trade-off: a request with `kv_cache_report_mode: "full"` makes vLLM re-announce its
//!   cache hits as `BlockStored` (parent `None`) although no copy was made, so such blocks are
//!   over-counted and can stay held after their real eviction until the worker is cleared.
//!   That mode is opt-in per request and rare; telling the two kinds of store apart is not
//!   possible from the event alone.
//! - Prefixes are consecutive from block 0. Hash `k` commits to blocks `0..k`, but eviction is
//!   per block, so holding block `k` never implies holding its ancestors.
//! - A `BlockStored` is applied whatever its parent: vLLM re-announces cache hits with no
//!   parent (counted as copies, as above), and a replay may start mid-chain. The parent only
//!   feeds a counter.
//! - Results are deterministic: rows are sorted by worker, and nothing observable depends on
//!   the table's seed or on insertion order.
//!
//! Hashes are only comparable within one (model, block size, hash algorithm, seed) space;
//! keeping one index per such space is the caller's job.
//!
//! Costs (see `BENCHMARKS.md` at the repository root for measurements):
//! - store / remove: expected O(1) per hash; a block held by many workers keeps a sorted list,
//!   so changing it is O(log n) to find plus a move of the list's tail. A store or removal
//!   of a copy beyond the first adds an O(log n) step in a side map.
//! - `clear_worker` / `remove_replica`: O(1), plus O(log n) per extra copy the worker held;
//!   the dropped entries become garbage that later mutations (or [`Index::maintain`]) sweep
//!   incrementally, invisible to every query meanwhile.
//! - `longest_prefix`: one table probe per block until the match ends, plus work in
//!   proportion to the holders of blocks whose holder list differs from the previous block's.
//! - Memory: a block with one or two holders costs one 16-byte table slot (20 to 30 bytes at
//!   the table's load); a block with more holders adds a list of 4 bytes per holder. Each
//!   copy beyond the first adds a side-map entry (about 64 bytes); there are none unless the
//!   engine caches duplicates.
//! - `Index` is `Send + Sync`: lookups take `&self`, so readers can share it behind a lock
//!   or a snapshot while one writer applies events.

mod holders;
mod index;
mod lookup;
mod table;
mod types;

pub use index::Index;
pub use types::{ApplyStats, PrefixMatches, ReplicaId, TierCounts, WorkerId};

#[cfg(test)]
mod tests;
