//! Open-addressing hash table from a block hash (`u64`) to a non-zero 64-bit holder word.
//!
//! Robin Hood linear probing with backward-shift deletion, one 16-byte slot per key, so a
//! lookup touches one cache line in the common case. The capacity is any size, not a power of
//! two (the home slot is a multiply-shift of the mixed key into `0..capacity`), so the table
//! grows by half and the load stays between 8/15 and 4/5: 20 to 30 bytes per key. (A higher
//! ceiling saves memory but lengthens the runs that insertions and deletions move.)
//!
//! Invariants:
//! - `slots.len()` is 0 or `>= MIN_CAPACITY`; `len <= slots.len() * 4 / 5`.
//! - A slot is empty iff its `val` is 0: callers never store 0 (any key, 0 included, is valid).
//! - Robin Hood order: walking from a key's home slot, every occupied slot before it has a
//!   displacement at least as large as the key's own at that point. A probe can therefore stop
//!   at the first slot whose occupant is closer to home than the probe, which keeps misses short.
//! - No tombstones: deletion shifts the following run back by one, so the table never degrades
//!   under churn.
//!
//! Keys are block hashes passed through [`Table::mix`]. Block hashes are digests, but a fixed
//! public mapping from hash to slot would let a client who can make a replica hash chosen
//! prompts (vLLM 0.34's sha256 seed is public) grind hashes into one probe run. The mix is
//! seeded per index, costs a few cycles, and leaves no such lever without the seed.

/// Smallest non-empty table.
const MIN_CAPACITY: usize = 16;

/// Odd constants with well-spread bits (pi's and e's fractional parts), so multiplying by
/// them is a bijection on u64.
const MULTIPLIER: u64 = 0x243f_6a88_85a3_08d3;
const MULTIPLIER_2: u64 = 0xb7e1_5162_8aed_2a6b;

#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub(crate) struct Slot {
    pub(crate) key: u64,
    /// 0 means empty.
    pub(crate) val: u64,
}

#[derive(Clone, Debug)]
pub(crate) struct Table {
    slots: Vec<Slot>,
    len: usize,
    seed: u64,
}

fn capacity_for(entries: usize) -> usize {
    if entries == 0 {
        return 0;
    }
    // Sized for a load of 2/3, leaving room before the 4/5 growth point.
    entries.saturating_mul(3).div_ceil(2).max(MIN_CAPACITY)
}

impl Table {
    pub(crate) fn with_capacity(entries: usize, seed: u64) -> Self {
        let cap = capacity_for(entries);
        Table {
            slots: vec![Slot::default(); cap],
            len: 0,
            seed,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<Slot>()
    }

    /// The table's key for a block hash: a seeded bijective mix (xor-shift-multiply rounds,
    /// each invertible), so distinct hashes keep distinct keys. Storing the mixed value rather
    /// than the hash means a probe step needs one multiply to find an occupant's home.
    #[inline]
    pub(crate) fn mix(&self, hash: u64) -> u64 {
        let mut x = hash ^ self.seed;
        x = (x ^ (x >> 32)).wrapping_mul(MULTIPLIER);
        x = (x ^ (x >> 29)).wrapping_mul(MULTIPLIER_2);
        x ^ (x >> 32)
    }

    /// Home slot of a mixed key: its position scaled into `0..capacity` (monotone in the key,
    /// which is what Robin Hood order relies on).
    #[inline]
    fn home(&self, key: u64) -> usize {
        ((u128::from(key) * self.slots.len() as u128) >> 64) as usize
    }

    /// The slot after `pos`, wrapping at the end.
    #[inline]
    fn next(&self, pos: usize) -> usize {
        if pos + 1 >= self.slots.len() {
            0
        } else {
            pos + 1
        }
    }

    /// How far `pos` is past `home`, wrapping at the end.
    #[inline]
    fn dist(&self, pos: usize, home: usize) -> usize {
        if pos >= home {
            pos - home
        } else {
            pos + self.slots.len() - home
        }
    }

    /// The slot index holding `key`, if any.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut pos = self.home(key);
        let mut dist = 0usize;
        loop {
            let slot = self.slots.get(pos)?;
            if slot.val == 0 {
                return None;
            }
            if slot.key == key {
                return Some(pos);
            }
            if self.dist(pos, self.home(slot.key)) < dist {
                return None;
            }
            pos = self.next(pos);
            dist += 1;
        }
    }

    /// Loads `key`'s home slot so that a later probe finds it in cache. Independent touches
    /// overlap their cache misses, which a chain of probes interleaved with mutations cannot.
    /// `black_box` keeps the otherwise unused load: a safe stand-in for a prefetch
    /// instruction (only speed depends on it, never a result).
    /// A probe usually ends within two slots of home, which may lie on the next cache line,
    /// so that slot is touched too.
    #[inline]
    pub(crate) fn touch(&self, key: u64) {
        let home = self.home(key);
        if let (Some(a), Some(b)) = (
            self.slots.get(home),
            self.slots.get(self.next(self.next(home))),
        ) {
            std::hint::black_box(a.key ^ b.key);
        }
    }

    /// The value stored for `key` (never 0), if any.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<u64> {
        self.find(key)
            .and_then(|i| self.slots.get(i))
            .map(|s| s.val)
    }

    /// The slot at `idx` if it is occupied.
    #[inline]
    pub(crate) fn slot(&self, idx: usize) -> Option<Slot> {
        self.slots.get(idx).copied().filter(|s| s.val != 0)
    }

    /// Overwrites the value of an occupied slot. `val` must be non-zero; use `remove_at` to
    /// delete.
    #[inline]
    pub(crate) fn set_val(&mut self, idx: usize, val: u64) {
        debug_assert!(val != 0, "0 marks an empty slot");
        if let Some(slot) = self.slots.get_mut(idx) {
            slot.val = val;
        }
    }

    /// Inserts a key known to be absent. `val` must be non-zero.
    pub(crate) fn insert_new(&mut self, key: u64, val: u64) {
        debug_assert!(val != 0, "0 marks an empty slot");
        debug_assert!(self.find(key).is_none(), "insert_new of a present key");
        if (self.len + 1) * 5 > self.slots.len() * 4 {
            self.grow();
        }
        self.place(Slot { key, val });
        self.len += 1;
    }

    /// Robin Hood placement into a table with at least one empty slot. Runs are sorted by
    /// home, so placing a key is: find the first slot whose occupant's home lies after the
    /// key's (or an empty slot), then move the rest of the run up by one slot in bulk.
    fn place(&mut self, new: Slot) {
        let mut pos = self.home(new.key);
        let mut dist = 0usize;
        loop {
            match self.slots.get(pos) {
                None => return,
                Some(s) if s.val == 0 => break,
                Some(s) if self.dist(pos, self.home(s.key)) < dist => {
                    let end = self.next_empty(pos);
                    self.shift_up(pos, end);
                    break;
                }
                Some(_) => {}
            }
            pos = self.next(pos);
            dist += 1;
        }
        if let Some(slot) = self.slots.get_mut(pos) {
            *slot = new;
        }
    }

    /// The first empty slot after `pos` (one exists: the load is below 1).
    fn next_empty(&self, pos: usize) -> usize {
        let mut end = self.next(pos);
        while self.slots.get(end).is_some_and(|s| s.val != 0) {
            end = self.next(end);
        }
        end
    }

    /// Moves the slots from `from` up to (not including) the empty slot `end` up by one,
    /// wrapping at the end of the table; `from` is left as it was (the caller overwrites it).
    fn shift_up(&mut self, from: usize, end: usize) {
        let n = self.slots.len();
        if from < end {
            self.slots.copy_within(from..end, from + 1);
        } else if n > 0 {
            self.slots.copy_within(0..end, 1);
            if let Some(&last) = self.slots.last() {
                if let Some(first) = self.slots.first_mut() {
                    *first = last;
                }
            }
            self.slots.copy_within(from..n - 1, from + 1);
        }
    }

    /// Deletes the occupied slot `idx`, moving the rest of its run (up to an empty slot or a
    /// key at its home) down by one. An element from later in the run may land in `idx`, so
    /// a caller scanning forward re-examines it.
    pub(crate) fn remove_at(&mut self, idx: usize) {
        if self.slot(idx).is_none() {
            return;
        }
        let mut end = self.next(idx);
        while let Some(s) = self.slots.get(end) {
            if s.val == 0 || self.dist(end, self.home(s.key)) == 0 {
                break;
            }
            end = self.next(end);
        }
        let n = self.slots.len();
        let last = if idx < end || end == 0 {
            // No wrap: [idx + 1, end) moves to [idx, end - 1).
            let stop = if end == 0 { n } else { end };
            self.slots.copy_within(idx + 1..stop, idx);
            stop - 1
        } else {
            // Wrapped: [idx + 1, n) then [0, end) move down by one.
            self.slots.copy_within(idx + 1..n, idx);
            if let Some(&first) = self.slots.first() {
                if let Some(last) = self.slots.last_mut() {
                    *last = first;
                }
            }
            self.slots.copy_within(1..end, 0);
            end - 1
        };
        if let Some(slot) = self.slots.get_mut(last) {
            *slot = Slot::default();
        }
        self.len -= 1;
    }

    /// Makes room for `additional` more keys without further growth.
    pub(crate) fn reserve(&mut self, additional: usize) {
        let cap = capacity_for(self.len.saturating_add(additional));
        if cap > self.slots.len() {
            self.rehash(cap);
        }
    }

    fn grow(&mut self) {
        let cap = (self.slots.len() + self.slots.len() / 2).max(MIN_CAPACITY);
        self.rehash(cap);
    }

    fn rehash(&mut self, cap: usize) {
        let old = std::mem::replace(&mut self.slots, vec![Slot::default(); cap]);
        for slot in old.into_iter().filter(|s| s.val != 0) {
            self.place(slot);
        }
    }

    /// Checks the Robin Hood invariants; for tests.
    pub(crate) fn validate(&self) -> Result<(), String> {
        let mut count = 0;
        for (pos, slot) in self.slots.iter().enumerate() {
            if slot.val == 0 {
                continue;
            }
            count += 1;
            if self.find(slot.key) != Some(pos) {
                return Err(format!("key {:#x} at {pos} is not found there", slot.key));
            }
            let dist = self.dist(pos, self.home(slot.key));
            let prev = pos.checked_sub(1).unwrap_or(self.slots.len() - 1);
            if dist > 0 {
                let p = self.slots.get(prev).copied().unwrap_or_default();
                let pdist = self.dist(prev, self.home(p.key));
                if p.val == 0 || pdist + 1 < dist {
                    return Err(format!("Robin Hood order broken before slot {pos}"));
                }
            }
        }
        if count != self.len {
            return Err(format!("len {} but {count} occupied slots", self.len));
        }
        if self.len * 5 > self.slots.len() * 4 {
            return Err(format!(
                "load above 4/5: {} in {}",
                self.len,
                self.slots.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    #[test]
    fn empty_table_finds_nothing() {
        let t = Table::with_capacity(0, 1);
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(u64::MAX), None);
        assert_eq!(t.capacity(), 0);
    }

    #[test]
    fn zero_and_max_keys_are_ordinary() {
        let mut t = Table::with_capacity(0, 7);
        t.insert_new(0, 5);
        t.insert_new(u64::MAX, 6);
        assert_eq!(t.get(0), Some(5));
        assert_eq!(t.get(u64::MAX), Some(6));
        let i = t.find(0).unwrap();
        t.remove_at(i);
        assert_eq!(t.get(0), None);
        assert_eq!(t.get(u64::MAX), Some(6));
        t.validate().unwrap();
    }

    /// Keys for the churn test: mixed (spread out), small (all at home slot 0: one long
    /// run), or near `u64::MAX` (all at the last slot: a run that wraps around the end).
    fn test_key(t: &Table, seed: u64, raw: u64) -> u64 {
        match seed % 3 {
            0 => t.mix(raw),
            1 => raw,
            _ => u64::MAX - raw,
        }
    }

    /// Random inserts, updates and deletes against `HashMap`, on a tiny key space, with keys
    /// spread out, clustered at the start, or clustered at the wrap.
    #[test]
    fn matches_std_hashmap_under_churn() {
        for seed in 0..6u64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut t = Table::with_capacity(0, seed.wrapping_mul(0x9e37_79b9));
            let mut m: HashMap<u64, u64> = HashMap::new();
            for step in 0..20_000 {
                let raw = rng.gen_range(0..600u64);
                let key = test_key(&t, seed, raw);
                match rng.gen_range(0..3) {
                    0 | 1 => {
                        let val = rng.gen_range(1..u64::MAX);
                        match t.find(key) {
                            Some(i) => t.set_val(i, val),
                            None => t.insert_new(key, val),
                        }
                        m.insert(key, val);
                    }
                    _ => {
                        if let Some(i) = t.find(key) {
                            t.remove_at(i);
                        }
                        m.remove(&key);
                    }
                }
                if step % 1000 == 0 {
                    t.validate().unwrap();
                }
                assert_eq!(t.len(), m.len());
            }
            t.validate().unwrap();
            for raw in 0..700u64 {
                let key = test_key(&t, seed, raw);
                assert_eq!(t.get(key), m.get(&key).copied(), "seed {seed} key {raw}");
            }
        }
    }

    #[test]
    fn mix_is_injective_and_seeded() {
        let a = Table::with_capacity(0, 1);
        let b = Table::with_capacity(0, 2);
        let keys: std::collections::HashSet<u64> = (0..100_000u64).map(|k| a.mix(k)).collect();
        assert_eq!(keys.len(), 100_000);
        assert_ne!(a.mix(42), b.mix(42));
    }

    #[test]
    fn reserve_avoids_growth() {
        let mut t = Table::with_capacity(0, 3);
        t.reserve(1000);
        let cap = t.capacity();
        for k in 0..1000u64 {
            t.insert_new(t.mix(k), k + 1);
        }
        assert_eq!(t.capacity(), cap);
        t.validate().unwrap();
    }
}
