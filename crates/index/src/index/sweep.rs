//! Reclaiming the entries of retired slots: an incremental sweep over the table.
//!
//! The cursor walks table slots in order, wrapping around, and drops holders whose slot is
//! dead. Deleting a block shifts the rest of its probe run back into the current slot, so the
//! cursor stays put after a deletion. An element can only move backwards by one slot, into a
//! slot at or after the cursor (or, at the wrap, to the end of the table), so one full pass
//! sees every element that was there when it started.

use crate::holders::{decode, Holder, Word};
use crate::index::mutate::Small;
use crate::index::Index;

/// Table slots whose spilled lists are touched together ahead of the sweep: a few percent of
/// blocks are spilled, so this range holds enough of them to overlap their misses.
const SWEEP_AHEAD: usize = 256;

impl Index {
    /// Sweeps up to about `budget` table slots (a spilled list costs more in proportion to its
    /// length) while garbage remains. Returns the work done. Call it when idle to reclaim
    /// memory sooner; mutations already call it with a budget in proportion to their size.
    pub fn maintain(&mut self, budget: usize) -> usize {
        let mut work = 0;
        while self.garbage > 0 && work < budget && self.table.capacity() > 0 {
            if self.sweep_cursor >= self.table.capacity() {
                self.sweep_cursor = 0;
                self.sweep_touched = 0;
            }
            if self.sweep_cursor >= self.sweep_touched {
                self.sweep_touched = self.touch_spilled_from(self.sweep_cursor);
            }
            let (cost, deleted) = self.sweep_slot(self.sweep_cursor);
            work += cost;
            if !deleted {
                self.sweep_cursor += 1;
            }
        }
        work
    }

    /// Drops all garbage now: one full pass over the table.
    pub fn compact(&mut self) {
        let mut idx = 0;
        let mut touched = 0;
        while idx < self.table.capacity() && self.garbage > 0 {
            if idx >= touched {
                touched = self.touch_spilled_from(idx);
            }
            let (_, deleted) = self.sweep_slot(idx);
            if !deleted {
                idx += 1;
            }
        }
        self.sweep_cursor = 0;
        self.sweep_touched = 0;
    }

    /// Touches the spilled lists of the `SWEEP_AHEAD` table slots from `from`, header then
    /// buffer, so that their cache misses overlap (the scan of the table itself is sequential;
    /// the lists are not). Returns the end of the touched range.
    fn touch_spilled_from(&self, from: usize) -> usize {
        let end = from.saturating_add(SWEEP_AHEAD).min(self.table.capacity());
        let lists = || {
            (from..end).filter_map(|idx| match decode(self.table.slot(idx)?.val) {
                Word::Spill(i) => self.spill.get(i),
                Word::Inline(..) => None,
            })
        };
        for list in lists() {
            std::hint::black_box(list.len());
        }
        for list in lists() {
            std::hint::black_box(list.first().copied());
        }
        end
    }

    /// Drops the garbage holders of table slot `idx`. Returns (work, whether the block was
    /// deleted, which pulls the next element of its run into `idx`).
    fn sweep_slot(&mut self, idx: usize) -> (usize, bool) {
        let Some(slot) = self.table.slot(idx) else {
            return (1, false);
        };
        match decode(slot.val) {
            Word::Inline(pair, n) => {
                let holders = pair.get(..n).unwrap_or(&[]);
                if holders.iter().all(|h| self.is_live(h.slot())) {
                    return (1, false);
                }
                let mut small = Small::new();
                for &h in holders {
                    if self.is_live(h.slot()) {
                        small.push(h);
                    } else {
                        self.release_dead(slot.key, h);
                    }
                }
                self.write_small(idx, small.as_slice());
                (1, small.as_slice().is_empty())
            }
            Word::Spill(i) => self.sweep_spilled(slot.key, idx, i),
        }
    }

    fn sweep_spilled(&mut self, hash: u64, idx: usize, i: usize) -> (usize, bool) {
        let Some(list) = self.spill.get_mut(i) else {
            return (1, false);
        };
        let mut list = std::mem::take(list);
        let cost = 1 + list.len() / 8;
        let mut dead = Vec::new();
        list.retain(|&w| {
            let h = Holder(w);
            let live = self.slots.get(h.slot() as usize).is_some_and(|s| s.live);
            if !live {
                dead.push(h);
            }
            live
        });
        for h in dead {
            self.release_dead(hash, h);
        }
        if list.len() > 2 {
            if let Some(dst) = self.spill.get_mut(i) {
                *dst = list;
            }
            return (cost, false);
        }
        let mut small = Small::new();
        for &w in &list {
            small.push(Holder(w));
        }
        self.free_spill_list(i);
        self.write_small(idx, small.as_slice());
        (cost, small.as_slice().is_empty())
    }
}
