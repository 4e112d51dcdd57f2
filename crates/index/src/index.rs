//! [`Index`]: which worker (replica, DP rank) holds which block hashes, in which tier and
//! KV-cache group.
//!
//! Layout (see `holders.rs` for the bit encoding):
//!
//! ```text
//!   Table: BlockHash ──▶ value word ──┬─ 1 or 2 packed holders inline
//!                                     └─ spill[i]: sorted Vec of packed holders (3 or more)
//!   overflow: (table key, slot+tier) ──▶ exact group set, for groups >= 7 only
//!   copies: (slot, table key, tier, group) ──▶ physical copies beyond the first (rare)
//!   slots[s]: { worker, live, entries, extra_copies }   workers: WorkerId ──▶ its live slot
//! ```
//!
//! vLLM can cache several physical copies of one block under one hash and announces each with
//! its own `BlockStored` and `BlockRemoved` (see `lib.rs`), so a (block, tier, group) is held
//! while it has at least one copy. The first copy is the group's bit; only the extra ones live
//! in `copies`, which stays empty in the common case, so the compact layout is unchanged.
//!
//! Clearing a worker is O(1): its slot is retired (marked dead) and the worker gets a fresh slot
//! on its next store. Holders of a dead slot are garbage: lookups skip them, mutations of a
//! block drop the ones they meet, and an incremental sweep (a cursor over the table, advanced a
//! little on every mutation, or by [`Index::maintain`]) drops the rest. A dead slot is reused
//! only once it owns no entry, so a slot number never names two workers at once.
//!
//! Counting invariants: `live_entries` = sum of `entries` over live slots = number of live
//! holders; `garbage` = the same over dead slots; a slot is in `free_slots` iff it is dead and
//! owns nothing. `copies` names only live slots and (block, tier, group)s they hold, each
//! with a count >= 1, and a slot's `extra_copies` is the sum of its counts: retiring a slot
//! drops its copies at once (found by range, as the slot leads the key), so garbage holders
//! never carry any and a reused slot starts with none.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{BuildHasher, RandomState};

use kinference_vllm::{BlockHash, GroupIdx, KvEvent, KvEventBatch, Tier};

use crate::holders::{decode, Holder, Word, MAX_SLOTS, OVERFLOW_BIT};
use crate::table::Table;
use crate::types::{ApplyStats, ReplicaId, WorkerId};

mod copies;
mod mutate;
mod sweep;
mod validate;

/// Slots swept per block hash applied when everything is garbage; the budget scales with the
/// garbage's share of all entries. A little garbage (a restarted replica among hundreds) costs
/// only memory and is swept lazily; a lot is swept fast. With `SWEEP_PER_CALL` per mutating
/// call, garbage always drains while events flow; `Index::maintain` drains it when idle.
const SWEEP_PER_HASH: u128 = 16;
const SWEEP_PER_CALL: usize = 16;
/// Hashes touched ahead per batch and per chunk of a long store or removal: enough to keep
/// the core's outstanding cache misses busy, few enough to still be in cache when used.
const TOUCH_PER_BATCH: usize = 64;
const CHUNK: usize = 16;

#[derive(Clone, Debug)]
pub(crate) struct SlotInfo {
    pub(crate) worker: WorkerId,
    pub(crate) live: bool,
    /// (block, tier) entries owned: live ones while live, garbage once retired.
    pub(crate) entries: u64,
    /// Sum of this slot's counts in `Index::copies` (0 once retired), so that removals by
    /// workers without duplicates never search the map.
    pub(crate) extra_copies: u64,
}

/// The block index. Single-writer; `longest_prefix` takes `&self`.
#[derive(Clone)]
pub struct Index {
    pub(crate) table: Table,
    pub(crate) spill: Vec<Vec<u32>>,
    pub(crate) free_spill: Vec<usize>,
    pub(crate) overflow: BTreeMap<(u64, u32), BTreeSet<u32>>,
    /// Extra physical copies of a held (block, tier, group), keyed by (slot, table key, tier,
    /// group); see `copies.rs`.
    pub(crate) copies: BTreeMap<copies::CopyKey, u32>,
    pub(crate) slots: Vec<SlotInfo>,
    pub(crate) free_slots: Vec<u32>,
    pub(crate) workers: BTreeMap<WorkerId, u32>,
    pub(crate) live_entries: u64,
    pub(crate) garbage: u64,
    pub(crate) sweep_cursor: usize,
    /// The sweep has touched spilled lists up to here (see `sweep.rs`).
    pub(crate) sweep_touched: usize,
    /// The last worker resolved to a slot: a batch names one worker many times (vLLM sends
    /// one `BlockRemoved` per evicted hash), and this skips the map for all but the first.
    hot: Option<(WorkerId, u32)>,
}

impl Default for Index {
    fn default() -> Self {
        Index::new()
    }
}

impl fmt::Debug for Index {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Index")
            .field("workers", &self.workers.len())
            .field("entries", &self.live_entries)
            .field("garbage", &self.garbage)
            .field("blocks", &self.table.len())
            .field(
                "spilled_blocks",
                &(self.spill.len() - self.free_spill.len()),
            )
            .finish()
    }
}

impl Index {
    /// An empty index whose table layout is keyed by a per-process random seed (see
    /// `table.rs` for why). Results never depend on the seed.
    pub fn new() -> Self {
        Index::with_capacity(0)
    }

    /// An empty index with room for `blocks` distinct block hashes before its table grows.
    pub fn with_capacity(blocks: usize) -> Self {
        let seed = RandomState::new().hash_one(0x6b69_6e66_6572_656eu64);
        Index::with_capacity_and_seed(blocks, seed)
    }

    /// Like [`Index::with_capacity`] with a fixed table seed, for reproducible benchmarks.
    pub fn with_capacity_and_seed(blocks: usize, seed: u64) -> Self {
        Index {
            table: Table::with_capacity(blocks, seed),
            spill: Vec::new(),
            free_spill: Vec::new(),
            overflow: BTreeMap::new(),
            copies: BTreeMap::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            workers: BTreeMap::new(),
            live_entries: 0,
            garbage: 0,
            sweep_cursor: 0,
            sweep_touched: 0,
            hot: None,
        }
    }

    /// Applies one engine step's events from `worker`'s stream. The batch's own
    /// `data_parallel_rank` is not consulted: the caller knows which stream it read.
    pub fn apply_batch(&mut self, worker: WorkerId, batch: &KvEventBatch) -> ApplyStats {
        self.touch_batch(batch);
        let mut stats = ApplyStats::default();
        for event in &batch.events {
            stats += self.apply_one(worker, event);
        }
        self.sweep_after(stats.stored + stats.removed + stats.ignored);
        stats
    }

    pub fn apply_event(&mut self, worker: WorkerId, event: &KvEvent) -> ApplyStats {
        let stats = self.apply_one(worker, event);
        self.sweep_after(stats.stored + stats.removed + stats.ignored);
        stats
    }

    /// Touches the table slots of the batch's first hashes, across events (vLLM sends one
    /// `BlockRemoved` per evicted hash), so their cache misses overlap.
    fn touch_batch(&self, batch: &KvEventBatch) {
        let hashes = batch.events.iter().flat_map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.as_slice(),
            KvEvent::BlockRemoved(r) => r.block_hashes.as_slice(),
            KvEvent::AllBlocksCleared => &[],
        });
        for h in hashes.take(TOUCH_PER_BATCH) {
            self.table.touch(self.table.mix(h.block_hash().0));
        }
    }

    fn apply_one(&mut self, worker: WorkerId, event: &KvEvent) -> ApplyStats {
        match event {
            KvEvent::BlockStored(s) => {
                if s.block_hashes.is_empty() {
                    return ApplyStats::default();
                }
                let Some(tier) = s.tier() else {
                    return unknown_medium(s.block_hashes.len());
                };
                let group = GroupIdx(s.group_idx.unwrap_or(0));
                let parent = s.parent_block_hash.as_ref().map(|p| p.block_hash());
                let hashes = s.block_hashes.iter().map(|h| h.block_hash());
                self.store_iter(worker, tier, group, parent, hashes)
            }
            KvEvent::BlockRemoved(r) => {
                let Some(tier) = r.tier() else {
                    return unknown_medium(r.block_hashes.len());
                };
                let group = GroupIdx(r.group_idx.unwrap_or(0));
                let hashes = r.block_hashes.iter().map(|h| h.block_hash());
                self.remove_iter(worker, tier, group, hashes)
            }
            KvEvent::AllBlocksCleared => {
                self.clear_worker(worker);
                ApplyStats {
                    cleared: 1,
                    ..ApplyStats::default()
                }
            }
        }
    }

    /// Records that `worker` holds one more copy of each of `hashes` in `tier` for KV-cache
    /// `group` (a hash already held gains a copy, counted in `duplicate_copies`). `parent` only
    /// feeds the `orphan_stores` counter.
    pub fn store(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        group: GroupIdx,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
    ) -> ApplyStats {
        let stats = self.store_iter(worker, tier, group, parent, hashes.iter().copied());
        self.sweep_after(stats.stored + stats.ignored);
        stats
    }

    /// Records that `worker` dropped one copy of each of `hashes` in `tier` for `group`; the
    /// block stays held there while copies remain, and in that tier while another group still
    /// holds it. Absent ones are counted as ignored.
    pub fn remove(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        group: GroupIdx,
        hashes: &[BlockHash],
    ) -> ApplyStats {
        let stats = self.remove_iter(worker, tier, group, hashes.iter().copied());
        self.sweep_after(stats.removed + stats.ignored);
        stats
    }

    fn store_iter(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        group: GroupIdx,
        parent: Option<BlockHash>,
        hashes: impl ExactSizeIterator<Item = BlockHash>,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        if hashes.len() == 0 {
            return stats;
        }
        let Some(slot) = self.slot_for(worker) else {
            stats.ignored = hashes.len() as u64;
            return stats;
        };
        if let Some(p) = parent {
            if !self.slot_holds(slot, p, tier) {
                stats.orphan_stores = 1;
            }
        }
        let mut added = 0u64;
        for_chunks(hashes, |chunk| {
            for hash in chunk {
                self.table.touch(self.table.mix(hash.0));
            }
            for hash in chunk {
                stats.stored += 1;
                match self.add_holder(self.table.mix(hash.0), slot, tier.index(), group.0) {
                    mutate::Added::Entry => added += 1,
                    mutate::Added::Group => {}
                    mutate::Added::Copy => stats.duplicate_copies += 1,
                }
            }
        });
        self.live_entries += added;
        if let Some(info) = self.slots.get_mut(slot as usize) {
            info.entries += added;
        }
        stats
    }

    fn remove_iter(
        &mut self,
        worker: WorkerId,
        tier: Tier,
        group: GroupIdx,
        hashes: impl ExactSizeIterator<Item = BlockHash>,
    ) -> ApplyStats {
        let mut stats = ApplyStats::default();
        let Some(slot) = self.live_slot(worker) else {
            stats.ignored = hashes.len() as u64;
            return stats;
        };
        let mut dropped = 0u64;
        for_chunks(hashes, |chunk| {
            for hash in chunk {
                self.table.touch(self.table.mix(hash.0));
            }
            for hash in chunk {
                match self.remove_holder(self.table.mix(hash.0), slot, tier.index(), group.0) {
                    mutate::Removal::Absent => stats.ignored += 1,
                    mutate::Removal::Group => stats.removed += 1,
                    mutate::Removal::Copy => {
                        stats.removed += 1;
                        stats.removals_leaving_copies += 1;
                    }
                    mutate::Removal::Entry => {
                        stats.removed += 1;
                        dropped += 1;
                    }
                }
            }
        });
        self.live_entries -= dropped;
        if let Some(info) = self.slots.get_mut(slot as usize) {
            info.entries -= dropped;
        }
        stats
    }

    /// Forgets everything `worker` holds, extra copies included (`AllBlocksCleared`, or a
    /// sequence reset). O(1) plus O(log n) per extra copy it held: the entries become garbage
    /// that the sweep reclaims. Returns the number of entries dropped.
    pub fn clear_worker(&mut self, worker: WorkerId) -> usize {
        let Some(&slot) = self.workers.get(&worker) else {
            return 0;
        };
        let held = self.slots.get(slot as usize).map_or(0, |s| s.entries);
        if held == 0 {
            return 0;
        }
        self.workers.remove(&worker);
        self.retire(slot) as usize
    }

    /// Forgets every rank of `replica` at once. Returns the number of entries dropped.
    pub fn remove_replica(&mut self, replica: ReplicaId) -> usize {
        let ranks: Vec<(WorkerId, u32)> = self
            .workers
            .range(WorkerId::new(replica, Default::default())..)
            .take_while(|(w, _)| w.replica == replica)
            .map(|(w, s)| (*w, *s))
            .collect();
        let mut dropped = 0;
        for (worker, slot) in ranks {
            self.workers.remove(&worker);
            dropped += self.retire(slot) as usize;
        }
        dropped
    }

    /// (block, tier) entries `worker` holds; several groups of one block and tier count once.
    pub fn worker_entries(&self, worker: WorkerId) -> usize {
        self.workers
            .get(&worker)
            .and_then(|&s| self.slots.get(s as usize))
            .map_or(0, |s| s.entries as usize)
    }

    /// Total (block, tier, worker) entries held, garbage excluded.
    pub fn len(&self) -> usize {
        self.live_entries as usize
    }

    pub fn is_empty(&self) -> bool {
        self.live_entries == 0
    }

    /// Workers holding at least one entry, with their entry counts, in worker order.
    pub fn workers(&self) -> impl Iterator<Item = (WorkerId, usize)> + '_ {
        self.workers.iter().filter_map(|(w, &s)| {
            let n = self.slots.get(s as usize).map_or(0, |i| i.entries);
            (n > 0).then_some((*w, n as usize))
        })
    }

    /// Whether `worker` holds `hash` in `tier` (in any group).
    pub fn holds(&self, worker: WorkerId, hash: BlockHash, tier: Tier) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|&slot| self.slot_holds(slot, hash, tier))
    }

    /// Entries of cleared workers not yet reclaimed by the sweep. They are invisible to
    /// lookups and counts; they only use memory.
    pub fn garbage_entries(&self) -> usize {
        self.garbage as usize
    }

    /// Distinct block hashes in the table, garbage included.
    pub fn distinct_blocks(&self) -> usize {
        self.table.len()
    }

    /// Heap bytes used by the index's own structures (an estimate that ignores allocator
    /// overhead; measure RSS or a counting allocator for the real figure).
    pub fn heap_bytes(&self) -> usize {
        let spill: usize = self.spill.iter().map(|v| v.capacity() * 4).sum();
        // A B-tree node holds up to 11 entries; 64 bytes per entry is a generous bound.
        let overflow: usize = self.overflow.values().map(|g| 64 + g.len() * 8).sum();
        let copies = self.copies.len() * 64;
        self.table.heap_bytes()
            + self.spill.capacity() * std::mem::size_of::<Vec<u32>>()
            + spill
            + overflow
            + copies
            + self.slots.capacity() * std::mem::size_of::<SlotInfo>()
            + self.workers.len() * 48
    }

    pub(crate) fn slot_holds(&self, slot: u32, hash: BlockHash, tier: Tier) -> bool {
        let Some(val) = self.table.get(self.table.mix(hash.0)) else {
            return false;
        };
        let key = Holder::key_of(slot, tier.index());
        match decode(val) {
            Word::Inline(pair, n) => pair.iter().take(n).any(|h| h.key() == key),
            Word::Spill(i) => self
                .spill
                .get(i)
                .is_some_and(|l| l.binary_search_by_key(&key, |&w| Holder(w).key()).is_ok()),
        }
    }

    #[inline]
    pub(crate) fn is_live(&self, slot: u32) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.live)
    }

    /// The worker's live slot, allocating one (reusing a drained dead slot first) if needed.
    fn slot_for(&mut self, worker: WorkerId) -> Option<u32> {
        if let Some(slot) = self.live_slot(worker) {
            return Some(slot);
        }
        if self.free_slots.is_empty() && self.slots.len() >= MAX_SLOTS as usize {
            self.compact();
        }
        let info = SlotInfo {
            worker,
            live: true,
            entries: 0,
            extra_copies: 0,
        };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                if let Some(s) = self.slots.get_mut(slot as usize) {
                    *s = info;
                }
                slot
            }
            None if self.slots.len() < MAX_SLOTS as usize => {
                self.slots.push(info);
                (self.slots.len() - 1) as u32
            }
            None => return None,
        };
        self.workers.insert(worker, slot);
        self.hot = Some((worker, slot));
        Some(slot)
    }

    /// The worker's live slot, if it has one.
    #[inline]
    fn live_slot(&mut self, worker: WorkerId) -> Option<u32> {
        match self.hot {
            Some((w, slot)) if w == worker => Some(slot),
            _ => {
                let slot = *self.workers.get(&worker)?;
                self.hot = Some((worker, slot));
                Some(slot)
            }
        }
    }

    /// Marks a slot dead; its entries become garbage and its extra copies are dropped.
    /// Returns how many entries it owned.
    fn retire(&mut self, slot: u32) -> u64 {
        self.drop_copies(slot);
        let Some(info) = self.slots.get_mut(slot as usize) else {
            return 0;
        };
        info.live = false;
        let held = info.entries;
        if self.hot.is_some_and(|(_, s)| s == slot) {
            self.hot = None;
        }
        self.live_entries -= held;
        self.garbage += held;
        if held == 0 {
            self.free_slots.push(slot);
        }
        held
    }

    /// Accounts for a garbage holder being dropped from the block with table key `key`.
    pub(crate) fn release_dead(&mut self, key: u64, holder: Holder) {
        if holder.groups() & OVERFLOW_BIT != 0 {
            self.overflow.remove(&(key, holder.key()));
        }
        let slot = holder.slot();
        if let Some(info) = self.slots.get_mut(slot as usize) {
            info.entries -= 1;
            self.garbage -= 1;
            if info.entries == 0 {
                self.free_slots.push(slot);
            }
        }
    }

    fn sweep_after(&mut self, hashes: u64) {
        if self.garbage > 0 {
            let total = u128::from(self.garbage + self.live_entries);
            let scaled = u128::from(hashes) * SWEEP_PER_HASH * u128::from(self.garbage) / total;
            self.maintain(SWEEP_PER_CALL + scaled as usize);
        }
    }

    /// Pre-sizes the table for `additional` more distinct block hashes.
    pub fn reserve(&mut self, additional: usize) {
        self.table.reserve(additional);
    }
}

fn unknown_medium(hashes: usize) -> ApplyStats {
    ApplyStats {
        ignored: hashes as u64,
        unknown_medium: 1,
        ..ApplyStats::default()
    }
}

/// Feeds `hashes` to `f` in chunks of at most `CHUNK`, from a stack buffer.
fn for_chunks(mut hashes: impl Iterator<Item = BlockHash>, mut f: impl FnMut(&[BlockHash])) {
    let mut buf = [BlockHash(0); CHUNK];
    loop {
        let mut n = 0;
        for (dst, h) in buf.iter_mut().zip(&mut hashes) {
            *dst = h;
            n += 1;
        }
        match buf.get(..n) {
            Some(chunk) if n > 0 => f(chunk),
            _ => return,
        }
    }
}
