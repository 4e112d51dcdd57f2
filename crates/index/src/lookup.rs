//! Longest cached prefix of a block-hash chain, per worker and tier.
//!
//! The walk keeps one candidate per worker that holds block 0 (in some tier), with four
//! counters: consecutive blocks held on GPU, CPU, STORAGE, and in any tier. At block `b` a
//! counter advances to `b + 1` only if it equals `b` (the worker held every earlier block in
//! that sense) and the worker holds block `b` that way. The walk stops at the first block that
//! no candidate extends. Work per block is O(holders of that block), never O(workers).
//!
//! Two shortcuts keep long hits cheap without assuming anything about eviction order:
//! - A block whose holder list is identical to the previous block's advances exactly the same
//!   counters, so runs of identical lists (a chain cached on one worker, or a system prompt
//!   cached everywhere) are counted and applied once.
//! - Once block 0 is found, the table slots of the following blocks are touched in batches
//!   (8, 16, then 32) in a tight loop before they are probed, so their cache misses overlap
//!   instead of forming a chain; a miss on block 0 touches nothing more. Spilled holder
//!   lists of a batch are touched the same way, one level of indirection at a time.

use kinference_vllm::BlockHash;

use crate::holders::{decode, Holder, Word};
use crate::index::Index;
use crate::types::{PrefixMatches, TierCounts, WorkerId};

/// Blocks whose table slots are touched together before the walk reaches them: the first
/// batch is small so that a short match wastes little, later ones large enough to keep every
/// outstanding-miss buffer of the core busy.
const FIRST_BATCH: usize = 8;
const MAX_BATCH: usize = 32;

struct Walk<'a> {
    index: &'a Index,
    /// One row per live holder of block 0, in slot order, never reordered: the walk's state
    /// and, at the end, its result.
    rows: Vec<(WorkerId, TierCounts)>,
    /// Rows whose `any` run may still grow, in slot order (the slot is repeated here so that
    /// searching needs no indirection).
    active: Vec<Active>,
    /// The last block whose holders were applied.
    last: u32,
    /// Blocks after `last` whose holder lists equal `last`'s, not yet applied.
    pending: u32,
    prev_val: u64,
}

#[derive(Clone, Copy, Debug)]
struct Active {
    slot: u32,
    row: u32,
}

impl Index {
    /// For every worker holding block 0 of `hashes` in some tier: how many blocks from the
    /// start it holds, per tier and in any tier (see [`TierCounts`]), sorted by worker.
    /// A held block does not imply its ancestors are held: counts are consecutive from 0.
    pub fn longest_prefix(&self, hashes: &[BlockHash]) -> PrefixMatches {
        let hashes = hashes.get(..u32::MAX as usize).unwrap_or(hashes);
        let Some(first) = hashes.first() else {
            return PrefixMatches::default();
        };
        let Some(v0) = self.table.get(self.table.mix(first.0)) else {
            return PrefixMatches::default();
        };
        let Some(mut walk) = Walk::start(self, v0) else {
            return PrefixMatches::default();
        };
        let mut rest = hashes.get(1..).unwrap_or(&[]);
        let mut block = 1u32;
        let mut batch = FIRST_BATCH;
        'walk: while !rest.is_empty() {
            let (chunk, tail) = rest.split_at(rest.len().min(batch));
            for h in chunk {
                self.table.touch(self.table.mix(h.0));
            }
            let mut vals = [0u64; MAX_BATCH];
            for (v, h) in vals.iter_mut().zip(chunk) {
                *v = self.table.get(self.table.mix(h.0)).unwrap_or(0);
            }
            let vals = vals.get(..chunk.len()).unwrap_or(&[]);
            self.touch_spilled(vals);
            for &val in vals {
                if !walk.step(block, val) {
                    break 'walk;
                }
                block += 1;
            }
            rest = tail;
            batch = (batch * 2).min(MAX_BATCH);
        }
        walk.finish()
    }

    /// Spilled holder lists sit behind two dependent loads (the arena entry, then its
    /// buffer); touching each level for the whole batch overlaps those misses across blocks.
    fn touch_spilled(&self, vals: &[u64]) {
        let lists = || {
            vals.iter().filter_map(|&v| match decode(v) {
                Word::Spill(i) if v != 0 => self.spill.get(i),
                _ => None,
            })
        };
        for list in lists() {
            std::hint::black_box(list.len());
        }
        for list in lists() {
            std::hint::black_box(list.first().copied());
        }
    }

    /// The packed holders of a value word; inline ones are copied into `buf`.
    #[inline]
    fn words<'a>(&'a self, val: u64, buf: &'a mut [u32; 2]) -> &'a [u32] {
        match decode(val) {
            Word::Inline(pair, n) => {
                buf[0] = pair[0].0;
                buf[1] = pair[1].0;
                buf.get(..n).unwrap_or(&[])
            }
            Word::Spill(i) => self.spill.get(i).map_or(&[], |l| l.as_slice()),
        }
    }

    /// Whether two value words list the same holders. Raw equality: a list that differs only
    /// in garbage compares unequal, which merely skips the shortcut.
    #[inline]
    fn same_holders(&self, a: u64, b: u64) -> bool {
        if a == b {
            return true;
        }
        match (decode(a), decode(b)) {
            (Word::Spill(i), Word::Spill(j)) => match (self.spill.get(i), self.spill.get(j)) {
                (Some(x), Some(y)) => x == y,
                _ => false,
            },
            _ => false,
        }
    }
}

impl<'a> Walk<'a> {
    /// Rows from block 0's live holders (lists are sorted by slot, then tier).
    fn start(index: &'a Index, v0: u64) -> Option<Self> {
        let mut buf = [0u32; 2];
        let words = index.words(v0, &mut buf);
        let mut rows: Vec<(WorkerId, TierCounts)> = Vec::with_capacity(words.len());
        let mut active: Vec<Active> = Vec::with_capacity(words.len());
        for &w in words {
            let h = Holder(w);
            let Some(info) = index.slots.get(h.slot() as usize).filter(|s| s.live) else {
                continue;
            };
            if active.last().is_none_or(|a| a.slot != h.slot()) {
                active.push(Active {
                    slot: h.slot(),
                    row: rows.len() as u32,
                });
                let counts = TierCounts {
                    any: 1,
                    ..TierCounts::default()
                };
                rows.push((info.worker, counts));
            }
            if let Some((_, c)) = rows.last_mut() {
                *counter(c, h.tier()) = 1;
            }
        }
        (!rows.is_empty()).then_some(Walk {
            index,
            rows,
            active,
            last: 0,
            pending: 0,
            prev_val: v0,
        })
    }

    /// Applies block `block` with value word `val` (0: not in the table). Returns whether the
    /// walk goes on.
    fn step(&mut self, block: u32, val: u64) -> bool {
        if val == 0 {
            return false;
        }
        if self.index.same_holders(val, self.prev_val) {
            self.pending += 1;
            return true;
        }
        self.flush();
        let advanced = self.apply(block, val);
        self.prev_val = val;
        self.last = block;
        advanced > 0
    }

    /// Applies the pending run: every counter that advanced at `last` advances `pending` more.
    fn flush(&mut self) {
        if self.pending == 0 {
            return;
        }
        let from = self.last + 1;
        for a in &self.active {
            if let Some((_, c)) = self.rows.get_mut(a.row as usize) {
                for len in [&mut c.gpu, &mut c.cpu, &mut c.storage, &mut c.any] {
                    if *len == from {
                        *len += self.pending;
                    }
                }
            }
        }
        self.last += self.pending;
        self.pending = 0;
    }

    /// Advances rows holding block `b`; returns how many extended their `any` run.
    fn apply(&mut self, b: u32, val: u64) -> usize {
        let mut buf = [0u32; 2];
        let words = self.index.words(val, &mut buf);
        let mut advanced = 0;
        let rows = &mut self.rows;
        let mut bump = |a: &Active, h: Holder| {
            if let Some((_, c)) = rows.get_mut(a.row as usize) {
                advance(c, h, b, &mut advanced);
            }
        };
        if words.len() * 4 <= self.active.len() {
            for &w in words {
                let h = Holder(w);
                if let Ok(i) = self.active.binary_search_by_key(&h.slot(), |a| a.slot) {
                    if let Some(a) = self.active.get(i) {
                        bump(a, h);
                    }
                }
            }
        } else {
            let mut active = self.active.iter().peekable();
            for &w in words {
                let h = Holder(w);
                while active.next_if(|a| a.slot < h.slot()).is_some() {}
                match active.peek() {
                    Some(a) if a.slot == h.slot() => bump(a, h),
                    Some(_) => {}
                    None => break,
                }
            }
        }
        if advanced * 2 < self.active.len() {
            let rows = &self.rows;
            self.active
                .retain(|a| rows.get(a.row as usize).is_some_and(|(_, c)| c.any > b));
        }
        advanced
    }

    /// Rows are in slot order, which is worker order whenever workers were first seen in
    /// order; only otherwise is a sort needed.
    fn finish(mut self) -> PrefixMatches {
        self.flush();
        let mut rows = self.rows;
        if !rows.is_sorted_by_key(|(w, _)| *w) {
            rows.sort_unstable_by_key(|(w, _)| *w);
        }
        PrefixMatches { rows }
    }
}

/// A row's counter for tier index `i` (`Tier::index()`).
#[inline]
fn counter(c: &mut TierCounts, i: usize) -> &mut u32 {
    match i {
        0 => &mut c.gpu,
        1 => &mut c.cpu,
        _ => &mut c.storage,
    }
}

#[inline]
fn advance(c: &mut TierCounts, h: Holder, b: u32, advanced: &mut usize) {
    if c.any == b {
        c.any = b + 1;
        *advanced += 1;
    }
    let len = counter(c, h.tier());
    if *len == b {
        *len = b + 1;
    }
}
