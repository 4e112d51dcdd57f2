//! A full consistency check of the index's internal invariants, for tests and debugging.
//! O(size of the index); never called on the data path.

use std::collections::BTreeSet;

use crate::holders::{decode, group_bit, Holder, Word, INLINE_GROUPS, OVERFLOW_BIT};
use crate::index::Index;

impl Index {
    /// Checks every structural and counting invariant; returns the first violation found.
    #[doc(hidden)]
    pub fn validate(&self) -> Result<(), String> {
        self.table.validate()?;
        let mut per_slot = vec![0u64; self.slots.len()];
        let mut spill_used = vec![false; self.spill.len()];
        let mut overflow_keys = 0usize;
        for idx in 0..self.table.capacity() {
            let Some(slot) = self.table.slot(idx) else {
                continue;
            };
            let holders = self.holders_checked(slot.val, &mut spill_used)?;
            let mut prev_key = None;
            for h in holders {
                if prev_key.is_some_and(|k| k >= h.key()) {
                    return Err(format!("block {:#x}: holders unsorted", slot.key));
                }
                prev_key = Some(h.key());
                if h.groups() == 0 || h.tier() > 2 {
                    return Err(format!("block {:#x}: bad holder {:#x}", slot.key, h.0));
                }
                let count = per_slot
                    .get_mut(h.slot() as usize)
                    .ok_or_else(|| format!("block {:#x}: unknown slot {}", slot.key, h.slot()))?;
                *count += 1;
                let in_map = self
                    .overflow
                    .get(&(slot.key, h.key()))
                    .is_some_and(|g| !g.is_empty() && g.iter().all(|&x| x >= 7));
                if (h.groups() & OVERFLOW_BIT != 0) != in_map {
                    return Err(format!("block {:#x}: overflow bit disagrees", slot.key));
                }
                overflow_keys += usize::from(in_map);
            }
        }
        if overflow_keys != self.overflow.len() {
            return Err(format!(
                "overflow map has {} keys, holders flag {overflow_keys}",
                self.overflow.len()
            ));
        }
        for &i in &self.free_spill {
            if spill_used.get(i).copied().unwrap_or(true)
                || self.spill.get(i).is_none_or(|l| !l.is_empty())
            {
                return Err(format!("free spill list {i} is in use or not empty"));
            }
        }
        self.validate_copies()?;
        self.validate_slots(&per_slot)
    }

    /// Every extra copy names a live slot that holds its (block, tier, group), with a count of
    /// at least 1, and each slot's `extra_copies` is the sum of its counts.
    fn validate_copies(&self) -> Result<(), String> {
        let mut per_slot = vec![0u64; self.slots.len()];
        for (&(slot, key, tier, group), &n) in &self.copies {
            let at = format!("copies of block {key:#x} slot {slot} tier {tier} group {group}");
            if n == 0 {
                return Err(format!("{at}: zero count"));
            }
            if !self.is_live(slot) {
                return Err(format!("{at}: slot is not live"));
            }
            let want = Holder::key_of(slot, tier as usize);
            let holder = match self.table.get(key).map(decode) {
                Some(Word::Inline(pair, n)) => pair.into_iter().take(n).find(|h| h.key() == want),
                Some(Word::Spill(i)) => self
                    .spill
                    .get(i)
                    .and_then(|l| l.iter().map(|&w| Holder(w)).find(|h| h.key() == want)),
                None => None,
            }
            .ok_or_else(|| format!("{at}: no such holder"))?;
            let held = if group < INLINE_GROUPS {
                holder.groups() & group_bit(group) != 0
            } else {
                self.overflow
                    .get(&(key, holder.key()))
                    .is_some_and(|g| g.contains(&group))
            };
            if !held {
                return Err(format!("{at}: group not held"));
            }
            if let Some(c) = per_slot.get_mut(slot as usize) {
                *c += u64::from(n);
            }
        }
        for (s, (info, &counted)) in self.slots.iter().zip(&per_slot).enumerate() {
            if info.extra_copies != counted {
                return Err(format!(
                    "slot {s}: {} extra copies recorded, {counted} in the map",
                    info.extra_copies
                ));
            }
        }
        Ok(())
    }

    fn holders_checked(&self, val: u64, spill_used: &mut [bool]) -> Result<Vec<Holder>, String> {
        match decode(val) {
            Word::Inline(pair, n) => Ok(pair.get(..n).unwrap_or(&[]).to_vec()),
            Word::Spill(i) => {
                let list = self.spill.get(i).ok_or(format!("spill {i} missing"))?;
                let used = spill_used.get_mut(i).ok_or(format!("spill {i} missing"))?;
                if *used {
                    return Err(format!("spill list {i} shared by two blocks"));
                }
                *used = true;
                if list.len() < 3 {
                    return Err(format!("spill list {i} has {} holders", list.len()));
                }
                Ok(list.iter().map(|&w| Holder(w)).collect())
            }
        }
    }

    fn validate_slots(&self, per_slot: &[u64]) -> Result<(), String> {
        let (mut live, mut dead) = (0u64, 0u64);
        let free: BTreeSet<u32> = self.free_slots.iter().copied().collect();
        if free.len() != self.free_slots.len() {
            return Err("a slot is free twice".into());
        }
        for (s, (info, &counted)) in self.slots.iter().zip(per_slot).enumerate() {
            if info.entries != counted {
                return Err(format!(
                    "slot {s}: {} entries recorded, {counted} held",
                    info.entries
                ));
            }
            if info.live {
                live += counted;
                if self.workers.get(&info.worker) != Some(&(s as u32)) {
                    return Err(format!("live slot {s} not mapped from {}", info.worker));
                }
            } else {
                dead += counted;
            }
            if free.contains(&(s as u32)) != (!info.live && counted == 0) {
                return Err(format!("slot {s}: free list disagrees"));
            }
        }
        if live != self.live_entries || dead != self.garbage {
            return Err(format!(
                "counts: live {live} vs {}, garbage {dead} vs {}",
                self.live_entries, self.garbage
            ));
        }
        let live_slots = self.slots.iter().filter(|s| s.live).count();
        if live_slots != self.workers.len() {
            return Err(format!(
                "{live_slots} live slots, {} workers",
                self.workers.len()
            ));
        }
        Ok(())
    }
}
