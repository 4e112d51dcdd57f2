//! Decoding rules at the edges (tolerated vs rejected input) and encoder byte choices.

use super::*;
use crate::events::{BlockRemoved, ExtraKeyItem, HashValue, KvEvent, MapHeader};

/// A msgpack builder for hand-made inputs, on top of rmp's own encoder.
#[derive(Default)]
struct B(Vec<u8>);

impl B {
    fn arr(mut self, n: u32) -> Self {
        rmp::encode::write_array_len(&mut self.0, n).unwrap();
        self
    }
    fn map(mut self, n: u32) -> Self {
        rmp::encode::write_map_len(&mut self.0, n).unwrap();
        self
    }
    fn s(mut self, s: &str) -> Self {
        rmp::encode::write_str(&mut self.0, s).unwrap();
        self
    }
    fn u(mut self, v: u64) -> Self {
        rmp::encode::write_uint(&mut self.0, v).unwrap();
        self
    }
    fn i(mut self, v: i64) -> Self {
        rmp::encode::write_sint(&mut self.0, v).unwrap();
        self
    }
    fn f(mut self, v: f64) -> Self {
        rmp::encode::write_f64(&mut self.0, v).unwrap();
        self
    }
    fn nil(mut self) -> Self {
        self.0.push(0xc0);
        self
    }
    fn bin(mut self, b: &[u8]) -> Self {
        rmp::encode::write_bin(&mut self.0, b).unwrap();
        self
    }
    fn raw(mut self, b: &[u8]) -> Self {
        self.0.extend_from_slice(b);
        self
    }
    /// `[ts, [<n events follow>` — callers append the events and then the rank.
    fn batch(n_events: u32) -> Self {
        B::default().arr(3).f(1.5).arr(n_events)
    }
}

/// A 0.32-style `BlockStored` map with its 8 always-present entries; the caller appends
/// `extra` more entries.
fn stored_map(b: B, extra: u32) -> B {
    b.map(8 + extra)
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .arr(1)
        .u(7)
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .arr(2)
        .u(1)
        .u(2)
        .s("block_size")
        .u(2)
        .s("lora_id")
        .nil()
        .s("medium")
        .s("GPU")
        .s("lora_name")
        .nil()
}

fn stored_of(ev: &KvEvent) -> &BlockStored {
    match ev {
        KvEvent::BlockStored(s) => s,
        other => panic!("not BlockStored: {other:?}"),
    }
}

#[test]
fn tag_anywhere_and_unknown_keys_are_ignored_and_counted() {
    let bytes = B::batch(1)
        .map(4)
        .s("future_field")
        .arr(2)
        .u(1)
        .map(0)
        .s("block_hashes")
        .arr(1)
        .u(9)
        .s("type")
        .s("BlockRemoved")
        .u(42) // a non-string key
        .s("ignored value")
        .u(0)
        .0;
    let (batch, stats) = decode_batch_with_stats(&bytes).unwrap();
    assert_eq!(
        batch.events,
        vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![HashValue::Int(9)],
            ..Default::default()
        })]
    );
    assert_eq!(stats.ignored_fields, 2);
    assert_eq!(batch.data_parallel_rank, Some(0));
}

#[test]
fn unknown_event_types_are_skipped_and_counted_in_both_layouts() {
    let bytes = B::batch(4)
        .map(2)
        .s("type")
        .s("BlockPinned")
        .s("block_hashes")
        .s("not even a list")
        .arr(3)
        .s("SomethingElse")
        .nil()
        .arr(1)
        .u(1)
        .map(1)
        .s("type")
        .s("AllBlocksCleared")
        .arr(1)
        .s("AllBlocksCleared")
        .u(3)
        .0;
    let (batch, stats) = decode_batch_with_stats(&bytes).unwrap();
    assert_eq!(
        batch.events,
        vec![KvEvent::AllBlocksCleared, KvEvent::AllBlocksCleared]
    );
    assert_eq!(stats.unknown_events, 2);
    assert_eq!(stats.array_events, 2);
    assert_eq!(batch.data_parallel_rank, Some(3));
}

#[test]
fn vllm_011_short_arrays_and_two_element_batches_decode() {
    let bytes = B::default()
        .arr(2)
        .f(2.0)
        .arr(3)
        .arr(7)
        .s("BlockStored")
        .arr(2)
        .u(u64::MAX)
        .i(-5)
        .u(11)
        .arr(1)
        .u(100_000)
        .u(1)
        .nil()
        .nil()
        .arr(3)
        .s("BlockRemoved")
        .arr(1)
        .u(5)
        .s("CPU")
        .arr(1)
        .s("AllBlocksCleared")
        .0;
    let batch = decode_batch(&bytes).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    let s = stored_of(&batch.events[0]);
    // A negative (Python hash()) value keeps its bits.
    assert_eq!(
        s.block_hashes,
        vec![HashValue::Int(u64::MAX), HashValue::Int(-5i64 as u64)]
    );
    assert_eq!(s.parent_block_hash, Some(HashValue::Int(11)));
    assert_eq!(
        (s.token_ids.as_slice(), s.block_size),
        (&[100_000u32][..], 1)
    );
    assert_eq!(
        (s.medium.as_deref(), s.group_idx, s.extra_keys.as_ref()),
        (None, None, None)
    );
    let KvEvent::BlockRemoved(r) = &batch.events[1] else {
        panic!()
    };
    assert_eq!((r.medium.as_deref(), r.group_idx), (Some("CPU"), None));
    assert_eq!(batch.events[2], KvEvent::AllBlocksCleared);
}

#[test]
fn long_arrays_and_long_batches_are_tolerated() {
    let mut b = B::default().arr(4).u(7).arr(1).arr(19).s("BlockStored");
    b = b.arr(0).nil().arr(0).u(16).nil().s("GPU").nil().nil().u(0);
    b = b
        .s("full_attention")
        .u(4096)
        .s("local")
        .s("owner")
        .s("sess")
        .arr(0);
    b = b
        .s("extra-1")
        .map(1)
        .s("k")
        .s("v")
        .f(0.5)
        .u(1)
        .s("trailing batch element");
    let (batch, stats) = decode_batch_with_stats(&b.0).unwrap();
    assert_eq!(batch.ts, 7.0); // an integer ts is accepted, as msgspec does for float fields
    let s = stored_of(&batch.events[0]);
    assert_eq!(s.kv_cache_spec_sliding_window, Some(4096));
    assert_eq!(s.session_id.as_deref(), Some("sess"));
    assert_eq!(s.lookahead_token_ids, Some(vec![]));
    assert_eq!(stats.ignored_fields, 3 + 1);
    assert_eq!(batch.data_parallel_rank, Some(1));
}

#[test]
fn byte_hashes_and_extra_key_items_decode_to_canonical_forms() {
    let bytes = stored_map(B::batch(1), 2)
        .s("parent_block_hash")
        .bin(&[1, 2, 3])
        .s("extra_keys")
        .arr(2)
        .arr(6)
        .s("lora")
        .i(-3)
        .u(u64::MAX)
        .raw(&[0xca, 0x3f, 0x80, 0, 0]) // float32 1.0
        .raw(&[0xc3])
        .arr(1)
        .bin(b"x")
        .nil()
        .u(0)
        .0;
    let batch = decode_batch(&bytes).unwrap();
    let s = stored_of(&batch.events[0]);
    assert_eq!(s.parent_block_hash, Some(HashValue::Bytes(vec![1, 2, 3])));
    assert_eq!(
        s.extra_keys,
        Some(vec![
            Some(vec![
                ExtraKeyItem::Str("lora".into()),
                ExtraKeyItem::Int(-3),
                ExtraKeyItem::UInt(u64::MAX),
                ExtraKeyItem::Float(1.0),
                ExtraKeyItem::Bool(true),
                ExtraKeyItem::Array(vec![ExtraKeyItem::Bytes(b"x".to_vec())]),
            ]),
            None,
        ])
    );
    // Re-encoding writes float64 and the canonical widths; decoding that gives the same value.
    assert_eq!(decode_batch(&encode_batch(&batch)).unwrap(), batch);
}

fn assert_errors(cases: Vec<(Vec<u8>, &str)>) {
    for (bytes, label) in cases {
        let err = decode_batch(&bytes).unwrap_err();
        assert_eq!(err.metric_label(), label, "{bytes:02x?}: {err}");
    }
}

#[test]
fn out_of_range_and_mistyped_fields_are_errors() {
    assert_errors(vec![
        // token id above u32
        (
            B::batch(1)
                .arr(5)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(1)
                .u(1 << 32)
                .u(16)
                .u(0)
                .0,
            "int_out_of_range",
        ),
        // negative token id
        (
            B::batch(1)
                .arr(5)
                .s("BlockStored")
                .arr(0)
                .nil()
                .arr(1)
                .i(-1)
                .u(16)
                .u(0)
                .0,
            "int_out_of_range",
        ),
        // string hash
        (
            B::batch(1).arr(2).s("BlockRemoved").arr(1).s("abc").u(0).0,
            "unexpected_type",
        ),
        // dp rank above i64
        (B::batch(0).u(u64::MAX).0, "int_out_of_range"),
    ]);
}

#[test]
fn malformed_structure_is_an_error() {
    assert_errors(vec![
        // map event without a tag
        (
            B::batch(1).map(1).s("block_hashes").arr(0).u(0).0,
            "missing_tag",
        ),
        // empty array event
        (B::batch(1).arr(0).u(0).0, "missing_tag"),
        // non-string tag
        (B::batch(1).map(1).s("type").u(1).u(0).0, "unexpected_type"),
        // an event that is neither map nor array
        (B::batch(1).u(1).u(0).0, "unexpected_type"),
        // one-element batch
        (B::default().arr(1).f(1.0).0, "batch_too_short"),
        // not an array at all
        (B::default().map(0).0, "unexpected_type"),
        // invalid UTF-8 medium
        (
            B::batch(1)
                .arr(3)
                .s("BlockRemoved")
                .arr(0)
                .raw(&[0xa2, 0xff, 0xfe])
                .u(0)
                .0,
            "invalid_utf8",
        ),
        // reserved marker in a skipped value
        (
            B::batch(1)
                .map(2)
                .s("type")
                .s("AllBlocksCleared")
                .s("x")
                .raw(&[0xc1])
                .u(0)
                .0,
            "reserved_marker",
        ),
        // trailing bytes
        (B::batch(0).u(0).nil().0, "trailing_bytes"),
        // empty input
        (Vec::new(), "truncated"),
    ]);
}

#[test]
fn huge_length_headers_fail_fast_without_allocating() {
    for header in [
        [0xdd, 0xff, 0xff, 0xff, 0xff],
        [0xdf, 0xff, 0xff, 0xff, 0xff],
        [0xc6, 0xff, 0xff, 0xff, 0xff],
    ] {
        let bytes = B::batch(1).arr(2).s("BlockRemoved").raw(&header).0;
        assert!(matches!(
            decode_batch(&bytes),
            Err(DecodeError::Truncated { .. } | DecodeError::UnexpectedType { .. })
        ));
        let bytes = B::batch(1).map(2).s("type").s("X").s("k").raw(&header).0;
        assert!(matches!(
            decode_batch(&bytes),
            Err(DecodeError::Truncated { .. })
        ));
    }
}

#[test]
fn deep_nesting_is_bounded_in_extra_keys_and_skipped_values() {
    let nest =
        |depth: usize| -> Vec<u8> { std::iter::repeat_n(0x91, depth).chain([0xc0]).collect() };
    let extra = |depth: usize| {
        stored_map(B::batch(1), 1)
            .s("extra_keys")
            .arr(1)
            .raw(&nest(depth))
            .u(0)
            .0
    };
    assert!(decode_batch(&extra(MAX_EXTRA_KEY_DEPTH)).is_ok());
    assert_eq!(
        decode_batch(&extra(MAX_EXTRA_KEY_DEPTH + 1))
            .unwrap_err()
            .metric_label(),
        "too_deep"
    );
    // An unknown key's value is skipped iteratively, however deep.
    let bytes = B::batch(1)
        .map(2)
        .s("type")
        .s("AllBlocksCleared")
        .s("deep")
        .raw(&nest(200_000))
        .u(0)
        .0;
    assert_eq!(
        decode_batch(&bytes).unwrap().events,
        vec![KvEvent::AllBlocksCleared]
    );
}

#[test]
fn present_nil_optional_fields_decode_as_absent() {
    // msgspec never writes a None-default field as nil; such a field is read as absent.
    let bytes = stored_map(B::batch(1), 1).s("session_id").nil().u(0).0;
    let batch = decode_batch(&bytes).unwrap();
    assert_eq!(stored_of(&batch.events[0]).session_id, None);
    assert_eq!(stored_of(&batch.events[0]).map_header, MapHeader::FixMap);
}

fn one_event(ev: KvEvent, rank: Option<i64>) -> Vec<u8> {
    encode_batch(&KvEventBatch {
        ts: 0.25,
        events: vec![ev],
        data_parallel_rank: rank,
    })
}

#[test]
fn encoder_picks_msgspec_widths() {
    let stored = BlockStored {
        block_hashes: vec![
            HashValue::Int(1 << 63),
            HashValue::Int(127),
            HashValue::Bytes(vec![0xab; 2]),
        ],
        token_ids: vec![128, 65_536],
        block_size: 300,
        lora_id: Some(-200),
        lora_name: Some("a".repeat(40)),
        ..Default::default()
    };
    let bytes = one_event(KvEvent::BlockStored(stored.clone()), None);
    let expected = B::default()
        .arr(3)
        .f(0.25)
        .arr(1)
        .raw(&[0xde, 0x00, 0x08]) // map16 even for 8 entries
        .s("type")
        .s("BlockStored")
        .s("block_hashes")
        .raw(&[
            0x93, 0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0, 0x7f, 0xc4, 0x02, 0xab, 0xab,
        ])
        .s("parent_block_hash")
        .nil()
        .s("token_ids")
        .raw(&[0x92, 0xcc, 0x80, 0xce, 0, 1, 0, 0])
        .s("block_size")
        .raw(&[0xcd, 0x01, 0x2c])
        .s("lora_id")
        .raw(&[0xd1, 0xff, 0x38])
        .s("medium")
        .nil()
        .s("lora_name")
        .raw(&[0xd9, 40])
        .raw("a".repeat(40).as_bytes())
        .nil()
        .0;
    assert_eq!(bytes, expected);
    assert_eq!(
        decode_batch(&bytes).unwrap().events,
        vec![KvEvent::BlockStored(stored)]
    );
}

#[test]
fn fixmap_header_is_kept_when_it_fits_and_widened_when_not() {
    let mut s = BlockStored {
        map_header: MapHeader::FixMap,
        ..Default::default()
    };
    let bytes = one_event(KvEvent::BlockStored(s.clone()), Some(0));
    assert_eq!(bytes[11], 0x88);
    assert_eq!(
        decode_batch(&bytes).unwrap().events,
        vec![KvEvent::BlockStored(s.clone())]
    );
    s.extra_keys = Some(vec![]);
    s.group_idx = Some(0);
    s.kv_cache_spec_kind = Some("k".into());
    s.kv_cache_spec_sliding_window = Some(1);
    s.locality = Some("l".into());
    s.ownership = Some("o".into());
    s.session_id = Some("s".into());
    s.lookahead_token_ids = Some(vec![]);
    let bytes = one_event(KvEvent::BlockStored(s.clone()), Some(0));
    assert_eq!(&bytes[11..14], &[0xde, 0x00, 16]);
    // A 16-entry event cannot be a fixmap, so it decodes as map16.
    s.map_header = MapHeader::Map16;
    assert_eq!(
        decode_batch(&bytes).unwrap().events,
        vec![KvEvent::BlockStored(s)]
    );
}

#[test]
fn removed_and_cleared_use_fixmaps_and_rank_none_is_nil() {
    let removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![HashValue::Int(5)],
        medium: Some("GPU".into()),
        group_idx: Some(1),
        ..Default::default()
    });
    let bytes = one_event(removed, None);
    assert_eq!(bytes[11], 0x84);
    assert_eq!(*bytes.last().unwrap(), 0xc0);
    let bytes = one_event(KvEvent::AllBlocksCleared, Some(-1));
    assert_eq!(
        &bytes[11..],
        [
            &[0x81, 0xa4][..],
            b"type",
            &[0xb0],
            b"AllBlocksCleared",
            &[0xff]
        ]
        .concat()
    );
}

/// vLLM's media and cache-spec kinds decode without an allocation, any other as sent; both
/// re-encode to the bytes they came from.
#[test]
fn known_media_and_kinds_are_borrowed_and_every_value_round_trips() {
    use std::borrow::Cow;
    // `event` encoded alone, decoded: `field` of it is `value`, borrowed exactly when `known`,
    // and the batch re-encodes to the same bytes.
    fn check(
        event: KvEvent,
        field: fn(&KvEvent) -> Option<&Cow<'static, str>>,
        value: &str,
        known: bool,
    ) {
        let bytes = one_event(event, None);
        let batch = decode_batch(&bytes).unwrap();
        let got = field(&batch.events[0]);
        assert_eq!(got.map(|v| v.as_ref()), Some(value));
        assert_eq!(matches!(got, Some(Cow::Borrowed(_))), known, "{value}");
        assert_eq!(encode_batch(&batch), bytes, "{value}");
    }
    fn medium_of(e: &KvEvent) -> Option<&Cow<'static, str>> {
        match e {
            KvEvent::BlockRemoved(r) => r.medium.as_ref(),
            _ => None,
        }
    }
    fn kind_of(e: &KvEvent) -> Option<&Cow<'static, str>> {
        stored_of(e).kv_cache_spec_kind.as_ref()
    }
    for (medium, known) in [
        ("GPU", true),
        ("CPU", true),
        ("STORAGE", true),
        ("DISK", true),
        ("gpu", false),
        ("NVMe-tier-2", false),
        ("", false),
    ] {
        let removed = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![HashValue::Int(9)],
            medium: Some(medium.to_owned().into()),
            ..BlockRemoved::default()
        });
        check(removed, medium_of, medium, known);
    }
    for (kind, known) in [
        ("full_attention", true),
        ("sliding_window", true),
        ("mamba", false),
    ] {
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![HashValue::Int(9)],
            token_ids: vec![1; 16],
            block_size: 16,
            medium: Some("GPU".into()),
            kv_cache_spec_kind: Some(kind.to_owned().into()),
            ..BlockStored::default()
        });
        check(stored, kind_of, kind, known);
    }
}
