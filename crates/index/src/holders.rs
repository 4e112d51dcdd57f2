//! The compact encoding of who holds one block: packed holders and the table's value word.
//!
//! A holder is one `(worker slot, tier)` entry with its KV-cache group set, packed in a `u32`:
//!
//! ```text
//!  31                    10 9   8 7        0
//! +------------------------+-----+----------+
//! |   slot (22 bits)       |tier | groups   |   groups: bit g = group g for g < 7,
//! +------------------------+-----+----------+           bit 7 = "some group >= 7", kept exactly
//!                                                       in the index's overflow map
//! ```
//!
//! A holder's group bits are never all zero, so a packed holder is never 0. The table's value
//! word for a block is one of:
//!
//! ```text
//!   lo = holder A, hi = 0          one holder
//!   lo = holder A, hi = holder B   two holders, A.key() < B.key()
//!   lo = 0,        hi = i + 1      three or more: spill list i (sorted by key, len >= 3)
//! ```
//!
//! so a value is never 0, which the table uses to mark empty slots. Every holder list, inline
//! or spilled, is sorted by `key()` = (slot, tier) with no duplicate keys.

/// Bits for the worker slot; 4,194,304 slots (live workers plus retired ones still owning
/// entries) is far beyond any deployment.
pub(crate) const SLOT_BITS: u32 = 22;
pub(crate) const MAX_SLOTS: u32 = 1 << SLOT_BITS;
/// Groups `0..INLINE_GROUPS` have their own bit.
pub(crate) const INLINE_GROUPS: u32 = 7;
pub(crate) const OVERFLOW_BIT: u32 = 1 << INLINE_GROUPS;
const TIER_SHIFT: u32 = 8;
const SLOT_SHIFT: u32 = 10;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(crate) struct Holder(pub(crate) u32);

impl Holder {
    #[inline]
    pub(crate) fn new(slot: u32, tier: usize, groups: u32) -> Holder {
        debug_assert!(slot < MAX_SLOTS && tier < 3 && groups != 0 && groups <= 0xff);
        Holder((slot << SLOT_SHIFT) | ((tier as u32) << TIER_SHIFT) | groups)
    }

    /// (slot, tier), the sort key of holder lists.
    #[inline]
    pub(crate) fn key(self) -> u32 {
        self.0 >> TIER_SHIFT
    }

    #[inline]
    pub(crate) fn key_of(slot: u32, tier: usize) -> u32 {
        (slot << (SLOT_SHIFT - TIER_SHIFT)) | tier as u32
    }

    #[inline]
    pub(crate) fn slot(self) -> u32 {
        self.0 >> SLOT_SHIFT
    }

    #[inline]
    pub(crate) fn tier(self) -> usize {
        ((self.0 >> TIER_SHIFT) & 3) as usize
    }

    #[inline]
    pub(crate) fn groups(self) -> u32 {
        self.0 & 0xff
    }

    #[inline]
    pub(crate) fn with_groups(self, groups: u32) -> Holder {
        Holder((self.0 & !0xff) | groups)
    }
}

/// The group bit standing for `group`: its own bit, or the shared overflow bit.
#[inline]
pub(crate) fn group_bit(group: u32) -> u32 {
    if group < INLINE_GROUPS {
        1 << group
    } else {
        OVERFLOW_BIT
    }
}

/// A decoded value word.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Word {
    Inline([Holder; 2], usize),
    Spill(usize),
}

#[inline]
pub(crate) fn decode(val: u64) -> Word {
    let lo = val as u32;
    let hi = (val >> 32) as u32;
    if lo == 0 {
        Word::Spill(hi.wrapping_sub(1) as usize)
    } else if hi == 0 {
        Word::Inline([Holder(lo), Holder(lo)], 1)
    } else {
        Word::Inline([Holder(lo), Holder(hi)], 2)
    }
}

/// Encodes one or two holders (sorted, distinct keys). Returns `None` for any other count.
#[inline]
pub(crate) fn encode_inline(holders: &[Holder]) -> Option<u64> {
    match holders {
        [a] => Some(u64::from(a.0)),
        [a, b] => Some(u64::from(a.0) | (u64::from(b.0) << 32)),
        _ => None,
    }
}

#[inline]
pub(crate) fn encode_spill(idx: usize) -> u64 {
    ((idx as u64) + 1) << 32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_fields_round_trip() {
        let h = Holder::new(MAX_SLOTS - 1, 2, 0x81);
        assert_eq!(h.slot(), MAX_SLOTS - 1);
        assert_eq!(h.tier(), 2);
        assert_eq!(h.groups(), 0x81);
        assert_eq!(h.key(), Holder::key_of(MAX_SLOTS - 1, 2));
        assert_eq!(h.with_groups(1).groups(), 1);
        assert_eq!(h.with_groups(1).key(), h.key());
    }

    #[test]
    fn keys_sort_by_slot_then_tier() {
        assert!(Holder::key_of(1, 2) < Holder::key_of(2, 0));
        assert!(Holder::key_of(2, 0) < Holder::key_of(2, 1));
    }

    #[test]
    fn words_round_trip_and_are_never_zero() {
        let a = Holder::new(0, 0, 1);
        let b = Holder::new(0, 1, 1);
        let one = encode_inline(&[a]).unwrap();
        let two = encode_inline(&[a, b]).unwrap();
        assert_ne!(one, 0);
        assert_eq!(decode(one), Word::Inline([a, a], 1));
        assert_eq!(decode(two), Word::Inline([a, b], 2));
        assert_eq!(decode(encode_spill(0)), Word::Spill(0));
        assert_ne!(encode_spill(0), 0);
        assert_eq!(encode_inline(&[a, b, a]), None);
    }

    #[test]
    fn group_bits() {
        assert_eq!(group_bit(0), 1);
        assert_eq!(group_bit(6), 64);
        assert_eq!(group_bit(7), OVERFLOW_BIT);
        assert_eq!(group_bit(u32::MAX), OVERFLOW_BIT);
    }
}
