//! Identifiers and result types of the index: who holds blocks, and what a lookup or an
//! applied event batch reports.

use std::fmt;
use std::ops::{Add, AddAssign};

use kinference_vllm::{DpRank, Tier};

/// One serving replica (one vLLM deployment behind one endpoint), interned by the caller.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct ReplicaId(pub u32);

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica-{}", self.0)
    }
}

/// One KV-event stream: a replica's data-parallel rank. Each rank has its own block pool, so
/// blocks are held per worker, and ordering is by replica, then rank.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct WorkerId {
    pub replica: ReplicaId,
    pub rank: DpRank,
}

impl WorkerId {
    pub fn new(replica: ReplicaId, rank: DpRank) -> Self {
        WorkerId { replica, rank }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/dp{}", self.replica, self.rank.0)
    }
}

/// Counters from applying events. Units are block hashes except where noted, so a
/// `BlockStored` of 4 hashes adds 4 to `stored`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct ApplyStats {
    /// Hashes applied from stores, duplicate copies included (this counts work, not new
    /// entries).
    pub stored: u64,
    /// Stored hashes whose (tier, group) this worker already held: each adds a physical copy
    /// (vLLM caches duplicates of a block under one hash), so one more removal is needed before
    /// the block goes. Also counted in `stored`.
    pub duplicate_copies: u64,
    /// Hashes whose copy in (tier, group) was removed, last copies and others alike.
    pub removed: u64,
    /// Removed hashes that still had other copies in that (tier, group), so the block stays
    /// held. Also counted in `removed`.
    pub removals_leaving_copies: u64,
    /// `AllBlocksCleared` events (and `clear_worker` calls) applied.
    pub cleared: u64,
    /// Hashes not applied: an unknown medium, a removal of a (block, tier, group) not held, or a
    /// worker that could not be given a slot.
    pub ignored: u64,
    /// Events (not hashes) ignored because their medium is unknown; also counted in `ignored`.
    pub unknown_medium: u64,
    /// `BlockStored` events (not hashes) whose parent this worker did not hold in that tier.
    /// Informational: such blocks are still stored, since vLLM re-announces hits with no parent
    /// and replays may start mid-chain.
    pub orphan_stores: u64,
}

impl AddAssign for ApplyStats {
    fn add_assign(&mut self, rhs: Self) {
        self.stored += rhs.stored;
        self.duplicate_copies += rhs.duplicate_copies;
        self.removed += rhs.removed;
        self.removals_leaving_copies += rhs.removals_leaving_copies;
        self.cleared += rhs.cleared;
        self.ignored += rhs.ignored;
        self.unknown_medium += rhs.unknown_medium;
        self.orphan_stores += rhs.orphan_stores;
    }
}

impl Add for ApplyStats {
    type Output = ApplyStats;
    fn add(mut self, rhs: Self) -> Self {
        self += rhs;
        self
    }
}

/// How many blocks from the start of a query one worker holds, per tier.
///
/// For a tier `t`, `tier(t)` is the largest `k` such that blocks `0..k` of the query are all
/// held in tier `t` (in any KV-cache group). `any` is the largest `k` such that each of blocks
/// `0..k` is held in some tier (tiers may differ block to block), so `any >= gpu, cpu, storage`.
/// A policy can credit `gpu` blocks fully and the `any - gpu` remainder at a discount.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Default)]
pub struct TierCounts {
    pub gpu: u32,
    pub cpu: u32,
    pub storage: u32,
    pub any: u32,
}

impl TierCounts {
    pub fn tier(&self, tier: Tier) -> u32 {
        match tier {
            Tier::Gpu => self.gpu,
            Tier::Cpu => self.cpu,
            Tier::Storage => self.storage,
        }
    }
}

/// The result of [`crate::Index::longest_prefix`]: one row per worker that holds at least block
/// 0 of the query in some tier, sorted by worker.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct PrefixMatches {
    pub(crate) rows: Vec<(WorkerId, TierCounts)>,
}

impl PrefixMatches {
    pub fn as_slice(&self) -> &[(WorkerId, TierCounts)] {
        &self.rows
    }

    pub fn iter(&self) -> std::slice::Iter<'_, (WorkerId, TierCounts)> {
        self.rows.iter()
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The counts of one worker, if it matched at least one block.
    pub fn get(&self, worker: WorkerId) -> Option<TierCounts> {
        self.rows
            .binary_search_by_key(&worker, |(w, _)| *w)
            .ok()
            .and_then(|i| self.rows.get(i))
            .map(|(_, c)| *c)
    }

    pub fn into_vec(self) -> Vec<(WorkerId, TierCounts)> {
        self.rows
    }
}

impl<'a> IntoIterator for &'a PrefixMatches {
    type Item = &'a (WorkerId, TierCounts);
    type IntoIter = std::slice::Iter<'a, (WorkerId, TierCounts)>;
    fn into_iter(self) -> Self::IntoIter {
        self.rows.iter()
    }
}
