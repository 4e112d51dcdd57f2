//! Extra physical copies of a held (block, tier, group): the side map behind copy counting.
//!
//! A holder's group bit stands for the first copy; `Index::copies` counts the ones beyond it,
//! keyed by (slot, table key, tier, group) so that all of one slot's copies form one key range.
//! Invariants: every key names a live slot holding that (block, tier, group), no count is
//! zero, and `SlotInfo::extra_copies` is the sum of the slot's counts. Duplicates are rare, so
//! the map is usually empty and both checks below stop at a length or a per-slot counter.

use crate::index::Index;

/// (slot, table key, tier, group).
pub(crate) type CopyKey = (u32, u64, u32, u32);

impl Index {
    /// Records one more copy of a (block, tier, group) the slot already holds.
    pub(crate) fn add_copy(&mut self, hash: u64, slot: u32, tier: usize, group: u32) {
        let n = self
            .copies
            .entry((slot, hash, tier as u32, group))
            .or_insert(0);
        // 2^32 copies of one block cannot exist; saturating keeps the sum exact regardless.
        if *n < u32::MAX {
            *n += 1;
            if let Some(info) = self.slots.get_mut(slot as usize) {
                info.extra_copies += 1;
            }
        }
    }

    /// Drops one extra copy of a held (block, tier, group), if it has one. Returns whether it
    /// did, in which case the group still holds the block.
    pub(crate) fn take_copy(&mut self, hash: u64, slot: u32, tier: usize, group: u32) -> bool {
        if self.copies.is_empty() {
            return false;
        }
        let Some(info) = self.slots.get_mut(slot as usize) else {
            return false;
        };
        if info.extra_copies == 0 {
            return false;
        }
        let key = (slot, hash, tier as u32, group);
        let Some(n) = self.copies.get_mut(&key) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            self.copies.remove(&key);
        }
        info.extra_copies -= 1;
        true
    }

    /// Forgets every extra copy of `slot` (it is being retired): O(log n) per copy dropped.
    pub(crate) fn drop_copies(&mut self, slot: u32) {
        let Some(info) = self.slots.get_mut(slot as usize) else {
            return;
        };
        if info.extra_copies == 0 {
            return;
        }
        info.extra_copies = 0;
        let range = (slot, 0, 0, 0)..=(slot, u64::MAX, u32::MAX, u32::MAX);
        let keys: Vec<CopyKey> = self.copies.range(range).map(|(k, _)| *k).collect();
        for key in keys {
            self.copies.remove(&key);
        }
    }
}
