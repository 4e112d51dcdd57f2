//! The engine's cache as its KV-event log announces it: the reference the index is held to.
//!
//! vLLM does not de-duplicate cached blocks (`BlockHashToBlockMap`): when a request recomputes a
//! block whose hash is already cached (the last block of a fully cached prompt, which vLLM always
//! recomputes), a second physical copy is cached and announced with a second `BlockStored`.
//! Evicting one copy publishes a `BlockRemoved` although the other copy still serves hits. So the
//! model counts copies: a hash is cached while stores minus removals since the last
//! `AllBlocksCleared` is positive. It also counts the anomalies a test wants to see (duplicate
//! stores, removals that leave copies, removals of hashes never stored).
//!
//! Invariant of [`EventLog`]: its batches are exactly seq `0..len` of one publisher, in order,
//! so folding a prefix of it gives the cache contents after that batch.

use std::collections::{BTreeSet, HashMap};

use kinference_vllm::{BlockHash, KvEvent, KvEventBatch, Tier};

use crate::error::InteropError;
use crate::replay::ReplayedBatch;

/// The contiguous log of one publisher's batches, from seq 0.
#[derive(Clone, Debug, Default)]
pub struct EventLog {
    batches: Vec<ReplayedBatch>,
}

/// One block of a `BlockStored` event, with the parent it was chained to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    pub seq: u64,
    pub hash: BlockHash,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
}

impl EventLog {
    pub fn new() -> Self {
        EventLog::default()
    }

    /// The seq the next batch must have (what to ask the replay socket for).
    pub fn next_seq(&self) -> u64 {
        self.batches.len() as u64
    }

    /// The last seq in the log.
    pub fn latest_seq(&self) -> Option<u64> {
        self.batches.last().map(|b| b.seq)
    }

    pub fn batches(&self) -> &[ReplayedBatch] {
        &self.batches
    }

    /// Appends replayed batches. Batches already in the log must be identical (a replay may
    /// overlap); the first new one must be [`EventLog::next_seq`], and the rest follow without
    /// gaps. Returns how many were new.
    pub fn extend(&mut self, replayed: Vec<ReplayedBatch>) -> Result<usize, InteropError> {
        let mut added = 0;
        for b in replayed {
            let next = self.next_seq();
            if b.seq < next {
                let known = usize::try_from(b.seq)
                    .ok()
                    .and_then(|i| self.batches.get(i));
                if known != Some(&b) {
                    return Err(InteropError::Log(format!(
                        "batch seq {} differs from the one logged before (publisher restarted?)",
                        b.seq
                    )));
                }
                continue;
            }
            if b.seq != next {
                return Err(InteropError::Log(format!(
                    "replay returned seq {} but the log needs {next} next (buffer truncated?)",
                    b.seq
                )));
            }
            self.batches.push(b);
            added += 1;
        }
        Ok(added)
    }

    /// The cache after applying batches `0..=seq` (all of them when `seq` is past the end).
    pub fn model_through(&self, seq: u64) -> CacheModel {
        let mut model = CacheModel::default();
        for b in self.batches.iter().take_while(|b| b.seq <= seq) {
            model.apply(b.seq, &b.batch);
        }
        model
    }

    /// The cache after the whole log.
    pub fn model(&self) -> CacheModel {
        self.model_through(u64::MAX)
    }

    /// Every block of every `BlockStored`, split per block with its parent. A malformed event
    /// (token count not `hashes * block_size`) is an error.
    pub fn stored_blocks(&self) -> Result<Vec<StoredBlock>, InteropError> {
        let mut out = Vec::new();
        for b in &self.batches {
            for event in &b.batch.events {
                let KvEvent::BlockStored(s) = event else {
                    continue;
                };
                let bs = s.block_size as usize;
                if bs == 0 || s.token_ids.len() != s.block_hashes.len() * bs {
                    return Err(InteropError::Log(format!(
                        "seq {}: BlockStored with {} hashes, {} tokens, block size {bs}",
                        b.seq,
                        s.block_hashes.len(),
                        s.token_ids.len()
                    )));
                }
                let mut parent = s.parent_block_hash.as_ref().map(|p| p.block_hash());
                for (hash, tokens) in s.block_hashes.iter().zip(s.token_ids.chunks(bs)) {
                    let hash = hash.block_hash();
                    out.push(StoredBlock {
                        seq: b.seq,
                        hash,
                        parent,
                        tokens: tokens.to_vec(),
                    });
                    parent = Some(hash);
                }
            }
        }
        Ok(out)
    }

    /// Seqs of the batches holding an `AllBlocksCleared`.
    pub fn clear_seqs(&self) -> Vec<u64> {
        self.batches
            .iter()
            .filter(|b| {
                b.batch
                    .events
                    .iter()
                    .any(|e| matches!(e, KvEvent::AllBlocksCleared))
            })
            .map(|b| b.seq)
            .collect()
    }
}

/// The engine's prefix cache as announced, with copy counts.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheModel {
    copies: HashMap<BlockHash, u32>,
    /// Block hashes stored (one per hash in each `BlockStored`).
    pub stores: u64,
    /// Stores of a hash that was already cached (a second physical copy).
    pub duplicate_stores: u64,
    /// Block hashes removed.
    pub removals: u64,
    /// Removals after which another copy of the hash is still cached.
    pub removals_leaving_copies: u64,
    /// Removals of a hash that was not cached (the log is inconsistent).
    pub unknown_removals: u64,
    /// `AllBlocksCleared` events applied.
    pub clears: u64,
    /// Events for a tier other than GPU or a KV-cache group other than 0 (not expected from the
    /// single-group model the tests use).
    pub foreign_events: u64,
}

impl CacheModel {
    /// Applies one batch (`seq` is only for messages).
    pub fn apply(&mut self, _seq: u64, batch: &KvEventBatch) {
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(s) => {
                    if s.tier() != Some(Tier::Gpu) || s.group_idx.unwrap_or(0) != 0 {
                        self.foreign_events += 1;
                        continue;
                    }
                    for h in &s.block_hashes {
                        let n = self.copies.entry(h.block_hash()).or_insert(0);
                        if *n > 0 {
                            self.duplicate_stores += 1;
                        }
                        *n += 1;
                        self.stores += 1;
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    if r.tier() != Some(Tier::Gpu) || r.group_idx.unwrap_or(0) != 0 {
                        self.foreign_events += 1;
                        continue;
                    }
                    for h in &r.block_hashes {
                        self.remove(h.block_hash());
                    }
                }
                KvEvent::AllBlocksCleared => {
                    self.copies.clear();
                    self.clears += 1;
                }
            }
        }
    }

    fn remove(&mut self, hash: BlockHash) {
        self.removals += 1;
        match self.copies.get_mut(&hash) {
            Some(n) if *n > 1 => {
                *n -= 1;
                self.removals_leaving_copies += 1;
            }
            Some(_) => {
                self.copies.remove(&hash);
            }
            None => self.unknown_removals += 1,
        }
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.copies.contains_key(&hash)
    }

    /// Physical copies of `hash` the engine caches.
    pub fn copies(&self, hash: BlockHash) -> u32 {
        self.copies.get(&hash).copied().unwrap_or(0)
    }

    /// The distinct hashes cached.
    pub fn held(&self) -> BTreeSet<BlockHash> {
        self.copies.keys().copied().collect()
    }

    pub fn len(&self) -> usize {
        self.copies.len()
    }

    pub fn is_empty(&self) -> bool {
        self.copies.is_empty()
    }

    /// How many leading blocks of `chain` are cached: what vLLM's prefix lookup finds.
    pub fn prefix_len(&self, chain: &[BlockHash]) -> usize {
        chain.iter().take_while(|h| self.contains(**h)).count()
    }
}

#[cfg(test)]
mod tests {
    use kinference_vllm::{BlockRemoved, BlockStored, HashValue};

    use super::*;

    fn stored(hashes: &[u64], parent: Option<u64>) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|h| HashValue::Int(*h)).collect(),
            parent_block_hash: parent.map(HashValue::Int),
            token_ids: (0..hashes.len() as u32 * 2).collect(),
            block_size: 2,
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        })
    }

    fn removed(hash: u64) -> KvEvent {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![HashValue::Int(hash)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..BlockRemoved::default()
        })
    }

    fn batch(seq: u64, events: Vec<KvEvent>) -> ReplayedBatch {
        ReplayedBatch {
            seq,
            topic: Some("kv-events".into()),
            batch: KvEventBatch {
                ts: seq as f64,
                events,
                data_parallel_rank: Some(0),
            },
        }
    }

    #[test]
    fn copies_survive_one_removal() {
        let mut log = EventLog::new();
        log.extend(vec![
            batch(0, vec![stored(&[1, 2], None)]),
            batch(1, vec![stored(&[2], Some(1))]),
            batch(2, vec![removed(2)]),
        ])
        .unwrap();
        let m = log.model();
        assert!(m.contains(BlockHash(2)), "a second copy is still cached");
        assert_eq!((m.duplicate_stores, m.removals_leaving_copies), (1, 1));
        assert_eq!(m.prefix_len(&[BlockHash(1), BlockHash(2), BlockHash(3)]), 2);
        let before = log.model_through(0);
        assert_eq!(before.copies(BlockHash(2)), 1);
    }

    #[test]
    fn clear_and_unknown_removal() {
        let mut log = EventLog::new();
        log.extend(vec![batch(
            0,
            vec![stored(&[1], None), KvEvent::AllBlocksCleared, removed(1)],
        )])
        .unwrap();
        let m = log.model();
        assert!(m.is_empty());
        assert_eq!((m.clears, m.unknown_removals), (1, 1));
        assert_eq!(log.clear_seqs(), vec![0]);
    }

    #[test]
    fn log_must_be_contiguous_and_stable() {
        let mut log = EventLog::new();
        assert!(
            log.extend(vec![batch(1, vec![])]).is_err(),
            "must start at 0"
        );
        assert_eq!(
            log.extend(vec![batch(0, vec![]), batch(1, vec![])])
                .unwrap(),
            2
        );
        assert_eq!(
            log.extend(vec![batch(1, vec![]), batch(2, vec![])])
                .unwrap(),
            1
        );
        assert!(log.extend(vec![batch(4, vec![])]).is_err(), "gap");
        assert!(
            log.extend(vec![batch(2, vec![removed(9)])]).is_err(),
            "changed content"
        );
        assert_eq!(log.latest_seq(), Some(2));
    }

    #[test]
    fn stored_blocks_chain_parents() {
        let mut log = EventLog::new();
        log.extend(vec![batch(0, vec![stored(&[5, 6], Some(4))])])
            .unwrap();
        let blocks = log.stored_blocks().unwrap();
        assert_eq!(blocks.len(), 2);
        assert_eq!(blocks[0].parent, Some(BlockHash(4)));
        assert_eq!(blocks[1].parent, Some(BlockHash(5)));
        assert_eq!(blocks[1].tokens, vec![2, 3]);
    }
}
