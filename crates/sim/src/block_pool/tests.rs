//! Unit tests of the block pool's vLLM semantics.

use super::*;
use kinference_vllm::HashValue;

fn digest(i: u8) -> BlockDigest {
    BlockDigest::from_bytes(&[i; 32]).unwrap()
}

fn pool(n: usize) -> BlockPool {
    BlockPool::new(n, true, EventOptions::default()).unwrap()
}

fn info(tokens: &[u32], n: usize) -> StoredInfo<'_> {
    StoredInfo {
        parent: None,
        tokens,
        block_size: 2,
        extra_keys: vec![None; n],
        lora_id: None,
        lora_name: None,
    }
}

#[test]
fn null_block_is_reserved_and_usage_excludes_it() {
    let mut p = pool(5);
    assert_eq!(p.num_free(), 4);
    assert_eq!(p.usage(), 0.0);
    let got = p.allocate(4).unwrap();
    assert_eq!(got, vec![BlockId(1), BlockId(2), BlockId(3), BlockId(4)]);
    assert_eq!(p.usage(), 1.0);
    assert!(p.allocate(1).is_none());
    assert!(BlockPool::new(1, true, EventOptions::default()).is_none());
}

#[test]
fn freed_cached_blocks_evict_tail_first_and_emit_removed() {
    let mut p = pool(6);
    let blocks = p.allocate(3).unwrap(); // 1,2,3
    let toks = [1, 2, 3, 4, 5, 6];
    p.cache_full_blocks(
        &blocks,
        &[digest(1), digest(2), digest(3)],
        Some(info(&toks, 3)),
    );
    // Freed in reverse order, as a request frees its blocks.
    p.free(blocks.iter().rev().copied());
    assert_eq!(
        p.free_order(),
        vec![BlockId(4), BlockId(5), BlockId(3), BlockId(2), BlockId(1)]
    );
    let ev = p.take_events();
    assert_eq!(ev.len(), 1);
    let got = p.allocate(3).unwrap();
    assert_eq!(got, vec![BlockId(4), BlockId(5), BlockId(3)]);
    let ev = p.take_events();
    assert_eq!(ev.len(), 1, "only block 3 carried a digest");
    match &ev[0] {
        KvEvent::BlockRemoved(r) => {
            assert_eq!(
                r.block_hashes,
                vec![digest(3).to_hash_value(EventHashForm::Int)]
            );
            assert_eq!(r.medium.as_deref(), Some("GPU"));
            assert_eq!(r.group_idx, Some(0));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(p.get_cached(&digest(3)), None);
    assert_eq!(p.get_cached(&digest(2)), Some(BlockId(2)));
    p.check_invariants().unwrap();
}

#[test]
fn unhashed_blocks_are_reused_first() {
    let mut p = pool(5);
    let a = p.allocate(2).unwrap(); // 1, 2
    p.cache_full_blocks(&a[..1], &[digest(9)], None);
    p.free(a.iter().rev().copied()); // 2 (unhashed) to the front, 1 (hashed) to the back
    assert_eq!(
        p.free_order(),
        vec![BlockId(2), BlockId(3), BlockId(4), BlockId(1)]
    );
}

#[test]
fn touch_pins_and_shared_blocks_need_every_reference_freed() {
    let mut p = pool(4);
    let a = p.allocate(1).unwrap();
    p.cache_full_blocks(&a, &[digest(7)], None);
    p.free(a.clone());
    assert!(p.is_free(a[0]));
    assert_eq!(p.num_evictable(&a), 1);
    p.touch(&a);
    p.touch(&a);
    assert_eq!(p.ref_count(a[0]), Some(2));
    assert!(!p.is_free(a[0]));
    // A referenced block is never handed out, however many allocations follow.
    let rest = p.allocate(2).unwrap();
    assert!(!rest.contains(&a[0]));
    p.free(a.clone());
    assert!(!p.is_free(a[0]));
    p.free(a.clone());
    assert!(p.is_free(a[0]));
    // A third free is refused instead of going negative.
    p.free(a.clone());
    assert_eq!(p.ref_count(a[0]), Some(0));
    p.check_invariants().unwrap();
}

#[test]
fn duplicate_digests_are_kept_and_evicted_separately() {
    let mut p = pool(4);
    let a = p.allocate(2).unwrap();
    p.cache_full_blocks(&a[..1], &[digest(5)], Some(info(&[1, 2], 1)));
    p.cache_full_blocks(&a[1..], &[digest(5)], Some(info(&[1, 2], 1)));
    assert_eq!(
        p.get_cached(&digest(5)),
        Some(a[0]),
        "the oldest copy is hit"
    );
    p.free(a.clone());
    let _ = p.take_events();
    let got = p.allocate(3).unwrap();
    assert_eq!(got.len(), 3);
    let removed: Vec<_> = p
        .take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => Some(r.block_hashes),
            _ => None,
        })
        .collect();
    let h = digest(5).to_hash_value(EventHashForm::Int);
    assert_eq!(removed, vec![vec![h.clone()], vec![h]]);
    assert!(p.cached_blocks().is_empty());
}

#[test]
fn reset_refuses_while_in_use_and_clears_with_one_event() {
    let mut p = pool(4);
    let a = p.allocate(1).unwrap();
    p.cache_full_blocks(&a, &[digest(1)], None);
    assert_eq!(p.reset(), Err(1));
    p.free(a);
    let _ = p.take_events();
    assert_eq!(p.reset(), Ok(()));
    assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
    assert_eq!(p.get_cached(&digest(1)), None);
    // Evicting a block whose digest was cleared publishes nothing.
    let _ = p.allocate(3).unwrap();
    assert!(p.take_events().is_empty());
}

#[test]
fn stored_event_carries_vllm_fields() {
    let mut p = BlockPool::new(
        4,
        true,
        EventOptions {
            enabled: true,
            hash_form: EventHashForm::Bytes,
            map_header: MapHeader::Map16,
        },
    )
    .unwrap();
    let a = p.allocate(1).unwrap();
    let parent = digest(3);
    p.cache_full_blocks(
        &a,
        &[digest(4)],
        Some(StoredInfo {
            parent: Some(&parent),
            tokens: &[7, 8],
            block_size: 2,
            extra_keys: vec![Some(vec![ExtraKeyItem::Str("salt".into())])],
            lora_id: Some(3),
            lora_name: Some("ad".into()),
        }),
    );
    let ev = p.take_events();
    let KvEvent::BlockStored(s) = &ev[0] else {
        panic!("{ev:?}")
    };
    assert_eq!(s.block_hashes, vec![HashValue::Bytes(vec![4; 32])]);
    assert_eq!(s.parent_block_hash, Some(HashValue::Bytes(vec![3; 32])));
    assert_eq!(s.token_ids, vec![7, 8]);
    assert_eq!(s.block_size, 2);
    assert_eq!(s.lora_id, Some(3));
    assert_eq!(s.lora_name.as_deref(), Some("ad"));
    assert_eq!(s.medium.as_deref(), Some("GPU"));
    assert_eq!(s.group_idx, Some(0));
    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(s.map_header, MapHeader::Map16);
}
