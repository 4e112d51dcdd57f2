//! Unit tests of every public operation and its edge cases. The randomized comparison against
//! a reference model lives in `tests/differential.rs`.

use kinference_vllm::{
    BlockHash, BlockRemoved, BlockStored, DpRank, GroupIdx, HashValue, KvEvent, KvEventBatch, Tier,
};

use crate::{ApplyStats, Index, ReplicaId, TierCounts, WorkerId};

fn w(replica: u32, rank: u32) -> WorkerId {
    WorkerId::new(ReplicaId(replica), DpRank(rank))
}

fn hs(range: std::ops::Range<u64>) -> Vec<BlockHash> {
    range.map(|i| BlockHash(0x1000 + i)).collect()
}

fn g(i: u32) -> GroupIdx {
    GroupIdx(i)
}

fn counts(gpu: u32, cpu: u32, storage: u32, any: u32) -> TierCounts {
    TierCounts {
        gpu,
        cpu,
        storage,
        any,
    }
}

fn stored(hashes: &[BlockHash], medium: Option<&str>, group: Option<u32>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|h| HashValue::Int(h.0)).collect(),
        medium: medium.map(|m| m.to_owned().into()),
        group_idx: group,
        block_size: 16,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[BlockHash], medium: Option<&str>, group: Option<u32>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().map(|h| HashValue::Int(h.0)).collect(),
        medium: medium.map(|m| m.to_owned().into()),
        group_idx: group,
        ..BlockRemoved::default()
    })
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: None,
    }
}

#[test]
fn empty_index_and_empty_query() {
    let idx = Index::new();
    assert!(idx.is_empty());
    assert_eq!(idx.len(), 0);
    assert!(idx.longest_prefix(&hs(0..4)).is_empty());
    assert!(idx.longest_prefix(&[]).is_empty());
    assert_eq!(idx.worker_entries(w(0, 0)), 0);
    idx.validate().unwrap();
}

#[test]
fn full_partial_and_missed_prefixes() {
    let mut idx = Index::new();
    let chain = hs(0..8);
    idx.store(w(1, 0), Tier::Gpu, g(0), None, &chain);
    idx.store(w(2, 0), Tier::Gpu, g(0), None, &chain[..3]);
    let m = idx.longest_prefix(&chain);
    assert_eq!(
        m.as_slice(),
        &[(w(1, 0), counts(8, 0, 0, 8)), (w(2, 0), counts(3, 0, 0, 3))]
    );
    // A query that diverges after block 2.
    let mut other = chain[..3].to_vec();
    other.push(BlockHash(99));
    let m = idx.longest_prefix(&other);
    assert_eq!(m.get(w(1, 0)), Some(counts(3, 0, 0, 3)));
    assert_eq!(m.get(w(2, 0)), Some(counts(3, 0, 0, 3)));
    // A miss on block 0 matches nobody even though later blocks are held.
    let mut missed = vec![BlockHash(7)];
    missed.extend_from_slice(&chain[1..]);
    assert!(idx.longest_prefix(&missed).is_empty());
    assert_eq!(idx.len(), 11);
    assert_eq!(idx.worker_entries(w(1, 0)), 8);
    idx.validate().unwrap();
}

#[test]
fn held_descendants_do_not_imply_ancestors() {
    let mut idx = Index::new();
    let chain = hs(0..6);
    idx.store(w(0, 0), Tier::Gpu, g(0), None, &chain);
    idx.remove(w(0, 0), Tier::Gpu, g(0), &chain[2..3]);
    assert_eq!(
        idx.longest_prefix(&chain).get(w(0, 0)),
        Some(counts(2, 0, 0, 2))
    );
    idx.remove(w(0, 0), Tier::Gpu, g(0), &chain[0..1]);
    assert!(idx.longest_prefix(&chain).is_empty());
    // Querying from block 3 on still finds the rest.
    assert_eq!(
        idx.longest_prefix(&chain[3..]).get(w(0, 0)),
        Some(counts(3, 0, 0, 3))
    );
}

#[test]
fn tiers_are_counted_separately_and_together() {
    let mut idx = Index::new();
    let chain = hs(0..6);
    let a = w(0, 0);
    idx.store(a, Tier::Gpu, g(0), None, &chain[..2]);
    idx.store(a, Tier::Cpu, g(0), None, &chain[2..4]);
    idx.store(a, Tier::Storage, g(0), None, &chain[..5]);
    let m = idx.longest_prefix(&chain);
    assert_eq!(m.get(a), Some(counts(2, 0, 5, 5)));
    assert_eq!(idx.worker_entries(a), 2 + 2 + 5);
    // Alternating tiers: any-tier runs on, each tier stops at its first gap.
    let b = w(1, 0);
    idx.store(b, Tier::Gpu, g(0), None, &[chain[0], chain[2]]);
    idx.store(b, Tier::Cpu, g(0), None, &[chain[1], chain[3]]);
    assert_eq!(idx.longest_prefix(&chain).get(b), Some(counts(1, 0, 0, 4)));
    assert_eq!(
        idx.longest_prefix(&chain[1..]).get(b),
        Some(counts(0, 1, 0, 3))
    );
    let c = idx.longest_prefix(&chain).get(b).unwrap();
    assert_eq!(c.tier(Tier::Gpu), 1);
    assert_eq!(c.tier(Tier::Storage), 0);
    idx.validate().unwrap();
}

#[test]
fn groups_hold_a_block_until_the_last_one_goes() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let chain = hs(0..3);
    idx.store(a, Tier::Gpu, g(0), None, &chain);
    idx.store(a, Tier::Gpu, g(1), None, &chain);
    assert_eq!(
        idx.worker_entries(a),
        3,
        "groups share one (block, tier) entry"
    );
    let s = idx.remove(a, Tier::Gpu, g(0), &chain[..1]);
    assert_eq!((s.removed, s.ignored), (1, 0));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(3, 0, 0, 3)));
    let s = idx.remove(a, Tier::Gpu, g(0), &chain[..1]);
    assert_eq!((s.removed, s.ignored), (0, 1), "group 0 is already gone");
    idx.remove(a, Tier::Gpu, g(1), &chain[..1]);
    assert!(idx.longest_prefix(&chain).is_empty());
    assert_eq!(idx.worker_entries(a), 2);
    idx.validate().unwrap();
}

#[test]
fn groups_beyond_the_inline_bits_are_exact() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let b = BlockHash(42);
    for group in [7, 8, 1000, u32::MAX, 3] {
        idx.store(a, Tier::Gpu, g(group), None, &[b]);
    }
    idx.validate().unwrap();
    assert_eq!(idx.worker_entries(a), 1);
    assert_eq!(idx.remove(a, Tier::Gpu, g(9), &[b]).ignored, 1);
    for group in [8, 3, u32::MAX, 1000] {
        assert_eq!(idx.remove(a, Tier::Gpu, g(group), &[b]).removed, 1);
        assert!(idx.holds(a, b, Tier::Gpu), "group 7 still holds it");
        idx.validate().unwrap();
    }
    assert_eq!(idx.remove(a, Tier::Gpu, g(7), &[b]).removed, 1);
    assert!(!idx.holds(a, b, Tier::Gpu));
    assert!(idx.is_empty());
    idx.validate().unwrap();
}

#[test]
fn duplicate_stores_add_copies_that_removals_take_away() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let chain = hs(0..4);
    let s = idx.store(a, Tier::Gpu, g(0), None, &chain);
    assert_eq!((s.stored, s.duplicate_copies), (4, 0));
    let s = idx.store(a, Tier::Gpu, g(0), None, &chain[2..]);
    assert_eq!((s.stored, s.duplicate_copies), (2, 2));
    assert_eq!(idx.worker_entries(a), 4, "a copy is not a new entry");
    assert_eq!(idx.len(), 4);
    idx.validate().unwrap();
    // One removal of a block with two copies leaves it held.
    let s = idx.remove(a, Tier::Gpu, g(0), &chain[3..]);
    assert_eq!((s.removed, s.removals_leaving_copies), (1, 1));
    assert!(idx.holds(a, chain[3], Tier::Gpu));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(4, 0, 0, 4)));
    idx.validate().unwrap();
    // The second removal drops it.
    let s = idx.remove(a, Tier::Gpu, g(0), &chain[3..]);
    assert_eq!((s.removed, s.removals_leaving_copies), (1, 0));
    assert!(!idx.holds(a, chain[3], Tier::Gpu));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(3, 0, 0, 3)));
    // A third is ignored.
    assert_eq!(idx.remove(a, Tier::Gpu, g(0), &chain[3..]).ignored, 1);
    // One event naming a hash twice removes two copies.
    let s = idx.remove(a, Tier::Gpu, g(0), &[chain[2], chain[2]]);
    assert_eq!((s.removed, s.removals_leaving_copies), (2, 1));
    assert!(!idx.holds(a, chain[2], Tier::Gpu));
    assert_eq!(idx.remove(a, Tier::Gpu, g(0), &chain[..2]).removed, 2);
    assert!(idx.is_empty());
    idx.validate().unwrap();
}

/// vLLM recomputes the last block of a fully cached prompt of whole blocks, caches a second
/// copy, and evicts the copies one at a time.
#[test]
fn recomputed_last_block_survives_one_eviction() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let chain = hs(0..2);
    let mut again = stored(&chain[1..], None, None);
    if let KvEvent::BlockStored(s) = &mut again {
        s.parent_block_hash = Some(HashValue::Int(chain[0].0));
    }
    let s = idx.apply_batch(a, &batch(vec![stored(&chain, None, None)]));
    assert_eq!(s.duplicate_copies, 0);
    let s = idx.apply_batch(a, &batch(vec![again]));
    assert_eq!((s.stored, s.duplicate_copies, s.orphan_stores), (1, 1, 0));
    let s = idx.apply_batch(a, &batch(vec![removed(&chain[1..], None, None)]));
    assert_eq!((s.removed, s.removals_leaving_copies), (1, 1));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(2, 0, 0, 2)));
    idx.apply_batch(a, &batch(vec![removed(&chain[1..], None, None)]));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(1, 0, 0, 1)));
    idx.validate().unwrap();
}

#[test]
fn copies_are_counted_per_tier_and_group() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let b = hs(0..1);
    for group in [0, 9] {
        idx.store(a, Tier::Gpu, g(group), None, &b);
        idx.store(a, Tier::Gpu, g(group), None, &b);
    }
    idx.store(a, Tier::Gpu, g(1), None, &b);
    idx.store(a, Tier::Gpu, g(8), None, &b);
    let s = idx.store(a, Tier::Cpu, g(0), None, &b);
    assert_eq!(s.duplicate_copies, 0, "another tier holds its own copies");
    idx.validate().unwrap();
    // Single-copy groups go at their first removal; the others keep one copy.
    for group in [1, 8] {
        let s = idx.remove(a, Tier::Gpu, g(group), &b);
        assert_eq!((s.removed, s.removals_leaving_copies), (1, 0));
        assert_eq!(idx.remove(a, Tier::Gpu, g(group), &b).ignored, 1);
    }
    for group in [0, 9] {
        let s = idx.remove(a, Tier::Gpu, g(group), &b);
        assert_eq!((s.removed, s.removals_leaving_copies), (1, 1));
    }
    assert_eq!(
        idx.remove(a, Tier::Cpu, g(0), &b).removals_leaving_copies,
        0
    );
    assert!(!idx.holds(a, b[0], Tier::Cpu));
    assert!(idx.holds(a, b[0], Tier::Gpu));
    idx.validate().unwrap();
    idx.remove(a, Tier::Gpu, g(0), &b);
    assert!(idx.holds(a, b[0], Tier::Gpu), "group 9 still holds it");
    idx.remove(a, Tier::Gpu, g(9), &b);
    assert!(!idx.holds(a, b[0], Tier::Gpu));
    assert!(idx.is_empty());
    idx.validate().unwrap();
}

#[test]
fn copies_of_spilled_holders_are_counted() {
    let mut idx = Index::new();
    let chain = hs(0..3);
    for r in 0..4 {
        idx.store(w(r, 0), Tier::Gpu, g(0), None, &chain);
    }
    let s = idx.store(w(2, 0), Tier::Gpu, g(0), None, &chain);
    assert_eq!(s.duplicate_copies, 3);
    idx.validate().unwrap();
    for r in 0..4 {
        idx.remove(w(r, 0), Tier::Gpu, g(0), &chain);
    }
    let m = idx.longest_prefix(&chain);
    assert_eq!(m.as_slice(), &[(w(2, 0), counts(3, 0, 0, 3))]);
    idx.validate().unwrap();
}

/// Clearing drops every copy: a reused slot must not inherit the counts of the worker that
/// owned it before.
#[test]
fn clears_drop_copies_and_reused_slots_start_clean() {
    let mut idx = Index::new();
    let (a, b) = (w(0, 0), w(1, 0));
    let chain = hs(0..4);
    for _ in 0..3 {
        idx.store(a, Tier::Gpu, g(0), None, &chain);
        idx.store(a, Tier::Cpu, g(9), None, &chain);
    }
    assert_eq!(idx.clear_worker(a), 8);
    assert!(idx.longest_prefix(&chain).is_empty());
    idx.validate().unwrap();
    // After a full sweep `a`'s old slot is free; `b` reuses it.
    idx.compact();
    idx.store(b, Tier::Gpu, g(0), None, &chain);
    idx.store(b, Tier::Cpu, g(9), None, &chain);
    idx.validate().unwrap();
    let s = idx.remove(b, Tier::Gpu, g(0), &chain);
    assert_eq!((s.removed, s.removals_leaving_copies), (4, 0));
    let s = idx.remove(b, Tier::Cpu, g(9), &chain);
    assert_eq!((s.removed, s.removals_leaving_copies), (4, 0));
    assert!(idx.is_empty());
    // `a` comes back with one copy each.
    idx.store(a, Tier::Gpu, g(0), None, &chain);
    assert_eq!(
        idx.remove(a, Tier::Gpu, g(0), &chain)
            .removals_leaving_copies,
        0
    );
    assert!(idx.is_empty());
    idx.validate().unwrap();
}

#[test]
fn all_blocks_cleared_drops_copies() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let chain = hs(0..2);
    let s = idx.apply_batch(
        a,
        &batch(vec![
            stored(&chain, None, None),
            stored(&chain, None, None),
            KvEvent::AllBlocksCleared,
            stored(&chain, None, None),
            removed(&chain, None, None),
        ]),
    );
    assert_eq!((s.duplicate_copies, s.removals_leaving_copies), (2, 0));
    assert!(idx.is_empty());
    idx.validate().unwrap();
}

#[test]
fn remove_replica_drops_copies() {
    let mut idx = Index::new();
    let chain = hs(0..3);
    for rank in 0..2 {
        idx.store(w(4, rank), Tier::Gpu, g(0), None, &chain);
        idx.store(w(4, rank), Tier::Gpu, g(0), None, &chain);
    }
    idx.store(w(5, 0), Tier::Gpu, g(0), None, &chain);
    idx.store(w(5, 0), Tier::Gpu, g(0), None, &chain);
    assert_eq!(idx.remove_replica(ReplicaId(4)), 6);
    idx.validate().unwrap();
    idx.compact();
    for rank in 0..2 {
        idx.store(w(4, rank), Tier::Gpu, g(0), None, &chain);
        let s = idx.remove(w(4, rank), Tier::Gpu, g(0), &chain);
        assert_eq!((s.removed, s.removals_leaving_copies), (3, 0));
    }
    // The other replica keeps its copies.
    let s = idx.remove(w(5, 0), Tier::Gpu, g(0), &chain);
    assert_eq!(s.removals_leaving_copies, 3);
    assert_eq!(
        idx.longest_prefix(&chain).get(w(5, 0)),
        Some(counts(3, 0, 0, 3))
    );
    idx.validate().unwrap();
}

#[test]
fn absent_removals_are_ignored_and_counted() {
    let mut idx = Index::new();
    let a = w(0, 0);
    idx.store(a, Tier::Gpu, g(0), None, &hs(0..2));
    let before = idx.longest_prefix(&hs(0..2));
    // Unknown worker, unknown hash, wrong tier, wrong group.
    assert_eq!(idx.remove(w(5, 0), Tier::Gpu, g(0), &hs(0..2)).ignored, 2);
    assert_eq!(idx.remove(a, Tier::Gpu, g(0), &hs(7..9)).ignored, 2);
    assert_eq!(idx.remove(a, Tier::Cpu, g(0), &hs(0..1)).ignored, 1);
    assert_eq!(idx.remove(a, Tier::Gpu, g(2), &hs(0..1)).ignored, 1);
    assert_eq!(idx.longest_prefix(&hs(0..2)), before);
    assert_eq!(idx.len(), 2);
}

#[test]
fn events_with_unknown_media_are_ignored_and_counted() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let s = idx.apply_event(a, &stored(&hs(0..3), Some("tape"), None));
    assert_eq!(
        s,
        ApplyStats {
            ignored: 3,
            unknown_medium: 1,
            ..ApplyStats::default()
        }
    );
    assert!(idx.is_empty());
    idx.apply_event(a, &stored(&hs(0..3), Some("GPU"), None));
    let s = idx.apply_event(a, &removed(&hs(0..3), Some("NVMe"), None));
    assert_eq!((s.ignored, s.unknown_medium, s.removed), (3, 1, 0));
    assert_eq!(idx.len(), 3);
}

#[test]
fn empty_stores_are_no_ops() {
    let mut idx = Index::new();
    let s = idx.apply_event(w(0, 0), &stored(&[], None, None));
    assert_eq!(s, ApplyStats::default());
    assert_eq!(
        idx.store(w(0, 0), Tier::Gpu, g(0), None, &[]),
        ApplyStats::default()
    );
    assert_eq!(idx.workers().count(), 0);
    idx.validate().unwrap();
}

#[test]
fn unknown_parents_are_counted_but_stored() {
    let mut idx = Index::new();
    let a = w(0, 0);
    let chain = hs(0..4);
    let s = idx.store(a, Tier::Gpu, g(0), Some(chain[0]), &chain[1..]);
    assert_eq!((s.stored, s.orphan_stores), (3, 1));
    let s = idx.store(a, Tier::Gpu, g(0), None, &chain[..1]);
    assert_eq!(s.orphan_stores, 0);
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(4, 0, 0, 4)));
    let s = idx.store(a, Tier::Gpu, g(0), Some(chain[2]), &chain[3..]);
    assert_eq!(s.orphan_stores, 0);
    // A parent held only in another tier does not count as linked.
    let s = idx.store(a, Tier::Cpu, g(0), Some(chain[2]), &chain[3..]);
    assert_eq!(s.orphan_stores, 1);
}

#[test]
fn apply_batch_maps_events_to_operations() {
    let mut idx = Index::new();
    let a = w(3, 1);
    let chain = hs(0..5);
    let mut parented = stored(&chain[2..], None, Some(0));
    if let KvEvent::BlockStored(s) = &mut parented {
        s.parent_block_hash = Some(HashValue::Int(chain[1].0));
    }
    let s = idx.apply_batch(
        a,
        &batch(vec![
            stored(&chain[..2], Some("GPU"), None),
            parented,
            stored(&chain[..1], Some("CPU"), Some(2)),
            removed(&chain[4..], None, None),
        ]),
    );
    assert_eq!(
        s,
        ApplyStats {
            stored: 6,
            removed: 1,
            ..ApplyStats::default()
        }
    );
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(4, 1, 0, 4)));
    let s = idx.apply_batch(
        a,
        &batch(vec![
            KvEvent::AllBlocksCleared,
            stored(&chain[..1], None, None),
        ]),
    );
    assert_eq!((s.cleared, s.stored), (1, 1));
    assert_eq!(idx.longest_prefix(&chain).get(a), Some(counts(1, 0, 0, 1)));
    assert_eq!(idx.len(), 1);
    idx.validate().unwrap();
}

#[test]
fn byte_hashes_use_their_last_eight_bytes() {
    let mut idx = Index::new();
    let digest: Vec<u8> = (0u8..32).collect();
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![HashValue::Bytes(digest.clone())],
        ..BlockStored::default()
    });
    idx.apply_event(w(0, 0), &event);
    let key = BlockHash::from_digest(&digest);
    assert_eq!(idx.longest_prefix(&[key]).len(), 1);
}

#[test]
fn clear_worker_forgets_only_that_worker() {
    let mut idx = Index::new();
    let chain = hs(0..10);
    for r in 0..4 {
        idx.store(w(r, 0), Tier::Gpu, g(0), None, &chain);
    }
    idx.store(w(0, 0), Tier::Cpu, g(0), None, &chain);
    assert_eq!(idx.clear_worker(w(0, 0)), 20);
    assert_eq!(idx.clear_worker(w(0, 0)), 0, "already clear");
    assert_eq!(idx.worker_entries(w(0, 0)), 0);
    assert_eq!(idx.len(), 30);
    let m = idx.longest_prefix(&chain);
    assert_eq!(m.len(), 3);
    assert!(m.get(w(0, 0)).is_none());
    idx.validate().unwrap();
    // The worker comes back on a fresh slot; its old entries stay invisible.
    idx.store(w(0, 0), Tier::Gpu, g(0), None, &chain[..2]);
    assert_eq!(
        idx.longest_prefix(&chain).get(w(0, 0)),
        Some(counts(2, 0, 0, 2))
    );
    assert_eq!(idx.worker_entries(w(0, 0)), 2);
    idx.validate().unwrap();
    idx.compact();
    assert_eq!(idx.garbage_entries(), 0);
    idx.validate().unwrap();
}

#[test]
fn remove_replica_drops_all_its_ranks() {
    let mut idx = Index::new();
    let chain = hs(0..4);
    for rank in 0..3 {
        idx.store(w(1, rank), Tier::Gpu, g(0), None, &chain);
    }
    idx.store(w(0, 0), Tier::Gpu, g(0), None, &chain);
    idx.store(w(2, 0), Tier::Gpu, g(0), None, &chain);
    assert_eq!(idx.remove_replica(ReplicaId(1)), 12);
    assert_eq!(idx.remove_replica(ReplicaId(1)), 0);
    assert_eq!(idx.remove_replica(ReplicaId(9)), 0);
    let m = idx.longest_prefix(&chain);
    let workers: Vec<_> = m.iter().map(|(w, _)| *w).collect();
    assert_eq!(workers, vec![w(0, 0), w(2, 0)]);
    assert_eq!(idx.len(), 8);
    idx.validate().unwrap();
}

#[test]
fn garbage_is_reclaimed_and_slots_reused() {
    let mut idx = Index::new();
    let chain = hs(0..1000);
    idx.store(w(0, 0), Tier::Gpu, g(0), None, &chain);
    idx.store(w(1, 0), Tier::Gpu, g(0), None, &chain[..10]);
    idx.store(w(2, 0), Tier::Gpu, g(0), None, &chain[..10]);
    idx.clear_worker(w(0, 0));
    assert_eq!(idx.garbage_entries(), 1000);
    assert_eq!(idx.distinct_blocks(), 1000);
    // Later events sweep in proportion to their size.
    for i in 0..200u64 {
        idx.store(w(3, 0), Tier::Gpu, g(0), None, &[BlockHash(i)]);
    }
    assert_eq!(idx.garbage_entries(), 0);
    assert_eq!(idx.distinct_blocks(), 10 + 200);
    idx.validate().unwrap();
    // The drained slot is handed to the next new worker.
    idx.store(w(9, 0), Tier::Gpu, g(0), None, &chain[..1]);
    assert_eq!(idx.slots.len(), 4);
    assert_eq!(
        idx.longest_prefix(&chain).get(w(9, 0)),
        Some(counts(1, 0, 0, 1))
    );
    idx.validate().unwrap();
}

#[test]
fn maintain_reclaims_without_events() {
    let mut idx = Index::new();
    idx.store(w(0, 0), Tier::Gpu, g(0), None, &hs(0..500));
    idx.clear_worker(w(0, 0));
    let mut rounds = 0;
    while idx.garbage_entries() > 0 {
        assert!(idx.maintain(64) > 0);
        rounds += 1;
        assert!(rounds < 1000);
    }
    assert_eq!(idx.maintain(64), 0);
    assert_eq!(idx.distinct_blocks(), 0);
    idx.validate().unwrap();
}

#[test]
fn shared_blocks_spill_and_shrink_back() {
    let mut idx = Index::new();
    let chain = hs(0..3);
    for r in 0..6 {
        idx.store(w(r, 0), Tier::Gpu, g(0), None, &chain);
        idx.validate().unwrap();
    }
    assert_eq!(idx.longest_prefix(&chain).len(), 6);
    for r in 0..5 {
        idx.remove(w(r, 0), Tier::Gpu, g(0), &chain);
        idx.validate().unwrap();
    }
    let m = idx.longest_prefix(&chain);
    assert_eq!(m.as_slice(), &[(w(5, 0), counts(3, 0, 0, 3))]);
    assert_eq!(idx.len(), 3);
}

/// Many workers with staggered prefixes exercise the merge path and the identical-list runs.
#[test]
fn many_workers_with_staggered_prefixes() {
    let mut idx = Index::new();
    let chain = hs(0..64);
    for r in 0..300u32 {
        let upto = 1 + (r as usize * 7) % 64;
        idx.store(w(r / 3, r % 3), Tier::Gpu, g(0), None, &chain[..upto]);
        if r % 5 == 0 {
            idx.store(w(r / 3, r % 3), Tier::Cpu, g(0), None, &chain);
        }
    }
    idx.validate().unwrap();
    let m = idx.longest_prefix(&chain);
    assert_eq!(m.len(), 300);
    for r in 0..300u32 {
        let upto = 1 + (r * 7) % 64;
        let cpu = if r % 5 == 0 { 64 } else { 0 };
        let any = upto.max(cpu);
        assert_eq!(
            m.get(w(r / 3, r % 3)),
            Some(counts(upto, cpu, 0, any)),
            "r={r}"
        );
    }
    let sorted: Vec<_> = m.iter().map(|(w, _)| *w).collect();
    let mut expect = sorted.clone();
    expect.sort();
    assert_eq!(sorted, expect);
}

#[test]
fn repeated_hashes_in_a_query() {
    let mut idx = Index::new();
    let a = w(0, 0);
    idx.store(a, Tier::Gpu, g(0), None, &[BlockHash(1)]);
    let q = [BlockHash(1), BlockHash(1), BlockHash(1), BlockHash(2)];
    assert_eq!(idx.longest_prefix(&q).get(a), Some(counts(3, 0, 0, 3)));
}

#[test]
fn growth_keeps_everything_findable() {
    let mut idx = Index::with_capacity_and_seed(0, 1);
    for r in 0..4u32 {
        let chain: Vec<_> = (0..20_000u64)
            .map(|i| BlockHash(i * 4 + u64::from(r % 2)))
            .collect();
        idx.store(w(r, 0), Tier::Gpu, g(0), None, &chain);
    }
    idx.validate().unwrap();
    assert_eq!(idx.len(), 80_000);
    assert_eq!(idx.distinct_blocks(), 40_000);
    let q: Vec<_> = (0..100u64).map(|i| BlockHash(i * 4)).collect();
    let m = idx.longest_prefix(&q);
    assert_eq!(m.len(), 2);
    assert!(m.iter().all(|(_, c)| c.gpu == 100));
}

/// Readers share the index across threads while one writer owns updates.
#[test]
fn index_is_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<Index>();
    shareable::<crate::PrefixMatches>();
}
