//! Adding and removing one holder (slot, tier, group) of one block.
//!
//! Keeps the encoding invariants of `holders.rs`: lists sorted by (slot, tier) with distinct
//! keys, one or two holders inline, three or more spilled, groups >= 7 mirrored exactly in the
//! overflow map, and copies beyond the first counted in the copy map (`copies.rs`): a store of a
//! (block, tier, group) already held adds a copy, a removal takes one away and drops the group
//! only at the last. Garbage holders met on the inline path are dropped on the way (it costs
//! nothing there); spilled lists are left to the sweep.

use crate::holders::{
    decode, encode_inline, encode_spill, group_bit, Holder, Word, INLINE_GROUPS, OVERFLOW_BIT,
};
use crate::index::Index;

/// What storing one copy of a (block, tier, group) did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Added {
    /// A new (block, tier) entry appeared for the slot.
    Entry,
    /// The entry existed; the group joined it.
    Group,
    /// The group already held the block: one more copy.
    Copy,
}

/// What removing one copy of a (block, tier, group) did.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Removal {
    /// Not held: nothing changed.
    Absent,
    /// One of several copies was dropped; the group still holds the block.
    Copy,
    /// The group was dropped; other groups still hold the block in that tier.
    Group,
    /// The last group was dropped: the (block, tier) entry is gone.
    Entry,
}

/// Up to three holders on the stack: an inline pair plus one being added.
#[derive(Clone, Copy)]
pub(crate) struct Small {
    items: [Holder; 3],
    len: usize,
}

impl Small {
    pub(crate) fn new() -> Self {
        Small {
            items: [Holder(0); 3],
            len: 0,
        }
    }

    pub(crate) fn push(&mut self, h: Holder) {
        if let Some(slot) = self.items.get_mut(self.len) {
            *slot = h;
            self.len += 1;
        }
    }

    pub(crate) fn as_slice(&self) -> &[Holder] {
        self.items.get(..self.len).unwrap_or(&[])
    }

    /// Inserts `h` in key order (the list is sorted and has room).
    fn insert_sorted(&mut self, h: Holder) {
        self.push(h);
        let mut i = self.len.saturating_sub(1);
        while i > 0 && self.items[i - 1] > self.items[i] {
            self.items.swap(i - 1, i);
            i -= 1;
        }
    }
}

impl Index {
    /// Adds one copy of `group` of (`slot`, `tier`) to the block with table key `hash` (mixed).
    pub(crate) fn add_holder(&mut self, hash: u64, slot: u32, tier: usize, group: u32) -> Added {
        let new = Holder::new(slot, tier, group_bit(group));
        let prior = match self.table.find(hash) {
            None => {
                self.table.insert_new(hash, u64::from(new.0));
                None
            }
            Some(idx) => self.add_to_existing(hash, idx, new),
        };
        let held_before = if group >= INLINE_GROUPS {
            !self
                .overflow
                .entry((hash, new.key()))
                .or_default()
                .insert(group)
        } else {
            prior.is_some_and(|groups| groups & new.groups() != 0)
        };
        match prior {
            None => Added::Entry,
            Some(_) if held_before => {
                self.add_copy(hash, slot, tier, group);
                Added::Copy
            }
            Some(_) => Added::Group,
        }
    }

    /// Merges `new` into the block's holders. Returns the group bits the slot's (block, tier)
    /// entry had before, or `None` if the entry is new.
    fn add_to_existing(&mut self, hash: u64, idx: usize, new: Holder) -> Option<u32> {
        let val = self.table.slot(idx).map_or(0, |s| s.val);
        match decode(val) {
            Word::Inline(pair, n) => {
                let mut small = Small::new();
                let mut prior = None;
                for h in pair.into_iter().take(n) {
                    if !self.is_live(h.slot()) {
                        self.release_dead(hash, h);
                    } else if h.key() == new.key() {
                        small.push(h.with_groups(h.groups() | new.groups()));
                        prior = Some(h.groups());
                    } else {
                        small.push(h);
                    }
                }
                if prior.is_none() {
                    small.insert_sorted(new);
                }
                self.write_small(idx, small.as_slice());
                prior
            }
            Word::Spill(i) => {
                // A missing list cannot happen (`validate` checks); reporting an existing entry
                // without the group changes no count.
                let Some(list) = self.spill.get_mut(i) else {
                    return Some(0);
                };
                match list.binary_search_by_key(&new.key(), |&w| Holder(w).key()) {
                    Ok(pos) => Some(list.get_mut(pos).map_or(0, |w| {
                        let before = Holder(*w).groups();
                        *w |= new.groups();
                        before
                    })),
                    Err(pos) => {
                        list.insert(pos, new.0);
                        None
                    }
                }
            }
        }
    }

    /// Removes `group` of (`slot`, `tier`) from the block with table key `hash` (mixed).
    pub(crate) fn remove_holder(
        &mut self,
        hash: u64,
        slot: u32,
        tier: usize,
        group: u32,
    ) -> Removal {
        let Some(idx) = self.table.find(hash) else {
            return Removal::Absent;
        };
        let key = Holder::key_of(slot, tier);
        let val = self.table.slot(idx).map_or(0, |s| s.val);
        let current = match decode(val) {
            Word::Inline(pair, n) => pair.into_iter().take(n).find(|h| h.key() == key),
            Word::Spill(i) => self.spill.get(i).and_then(|l| {
                l.binary_search_by_key(&key, |&w| Holder(w).key())
                    .ok()
                    .and_then(|p| l.get(p))
                    .map(|&w| Holder(w))
            }),
        };
        let Some(holder) = current else {
            return Removal::Absent;
        };
        if self.take_copy(hash, slot, tier, group) {
            return Removal::Copy;
        }
        let Some(groups) = self.groups_after_removal(hash, holder, group) else {
            return Removal::Absent;
        };
        if groups != 0 {
            self.replace_holder(idx, val, holder.with_groups(groups));
            return Removal::Group;
        }
        self.drop_holder(hash, idx, val, key);
        Removal::Entry
    }

    /// The holder's group bits once `group` is gone, or `None` if it did not hold `group`.
    fn groups_after_removal(&mut self, hash: u64, holder: Holder, group: u32) -> Option<u32> {
        let bits = holder.groups();
        if group < INLINE_GROUPS {
            let bit = group_bit(group);
            return (bits & bit != 0).then_some(bits & !bit);
        }
        let map_key = (hash, holder.key());
        let set = self.overflow.get_mut(&map_key)?;
        if !set.remove(&group) {
            return None;
        }
        if set.is_empty() {
            self.overflow.remove(&map_key);
            Some(bits & !OVERFLOW_BIT)
        } else {
            Some(bits)
        }
    }

    /// Rewrites one holder's group bits in place (its key is unchanged, so order holds).
    fn replace_holder(&mut self, idx: usize, val: u64, updated: Holder) {
        match decode(val) {
            Word::Inline(mut pair, n) => {
                for h in pair.iter_mut().take(n) {
                    if h.key() == updated.key() {
                        *h = updated;
                    }
                }
                if let Some(v) = encode_inline(pair.get(..n).unwrap_or(&[])) {
                    self.table.set_val(idx, v);
                }
            }
            Word::Spill(i) => {
                if let Some(list) = self.spill.get_mut(i) {
                    if let Ok(p) = list.binary_search_by_key(&updated.key(), |&w| Holder(w).key()) {
                        if let Some(w) = list.get_mut(p) {
                            *w = updated.0;
                        }
                    }
                }
            }
        }
    }

    /// Deletes the holder with `key` from the block's list, shrinking the encoding as needed.
    fn drop_holder(&mut self, hash: u64, idx: usize, val: u64, key: u32) {
        match decode(val) {
            Word::Inline(pair, n) => {
                let mut small = Small::new();
                for h in pair.into_iter().take(n) {
                    if h.key() == key {
                        continue;
                    }
                    if self.is_live(h.slot()) {
                        small.push(h);
                    } else {
                        self.release_dead(hash, h);
                    }
                }
                self.write_small(idx, small.as_slice());
            }
            Word::Spill(i) => {
                let Some(list) = self.spill.get_mut(i) else {
                    return;
                };
                if let Ok(p) = list.binary_search_by_key(&key, |&w| Holder(w).key()) {
                    list.remove(p);
                }
                if list.len() <= 2 {
                    let mut small = Small::new();
                    for &w in list.iter() {
                        small.push(Holder(w));
                    }
                    self.free_spill_list(i);
                    self.write_small(idx, small.as_slice());
                }
            }
        }
    }

    /// Stores a list of at most three holders at table slot `idx`: deletes the block when
    /// empty, inlines one or two, spills three.
    pub(crate) fn write_small(&mut self, idx: usize, holders: &[Holder]) {
        if holders.is_empty() {
            self.table.remove_at(idx);
        } else if let Some(v) = encode_inline(holders) {
            self.table.set_val(idx, v);
        } else {
            let i = self.alloc_spill_list(holders);
            self.table.set_val(idx, encode_spill(i));
        }
    }

    fn alloc_spill_list(&mut self, holders: &[Holder]) -> usize {
        let words = holders.iter().map(|h| h.0);
        if let Some(i) = self.free_spill.pop() {
            if let Some(list) = self.spill.get_mut(i) {
                list.clear();
                list.extend(words);
                return i;
            }
        }
        self.spill.push(words.collect());
        self.spill.len() - 1
    }

    /// Returns a spill list to the free pool; small buffers are kept for reuse, large ones
    /// released so one hot block does not pin memory after it cools down.
    pub(crate) fn free_spill_list(&mut self, i: usize) {
        if let Some(list) = self.spill.get_mut(i) {
            if list.capacity() > 8 {
                *list = Vec::new();
            } else {
                list.clear();
            }
            self.free_spill.push(i);
        }
    }
}
