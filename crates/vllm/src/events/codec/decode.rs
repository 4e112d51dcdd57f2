//! Payload → [`KvEventBatch`]: both event layouts, field by field, in one pass.
//!
//! Invariants: a field is read by the same function whichever layout it came from (map key or
//! array position), so both layouts apply identical type rules; a value is either fully consumed
//! or the whole decode fails; buffers are sized by header counts that the reader has already
//! checked against the bytes left.

use std::borrow::Cow;

use rmp::Marker;

use super::reader::{Int, Reader};
use super::{stored_entries, DecodeError, DecodeStats, FIXMAP_MAX, MAX_EXTRA_KEY_DEPTH};
use crate::events::{
    BlockRemoved, BlockStored, ExtraKeyItem, HashValue, KvEvent, KvEventBatch, MapHeader,
};
use crate::ids::Tier;

/// `BlockStored` fields in declaration order, which is also the ≤ 0.23 array order.
const STORED_FIELDS: [&[u8]; 15] = [
    b"block_hashes",
    b"parent_block_hash",
    b"token_ids",
    b"block_size",
    b"lora_id",
    b"medium",
    b"lora_name",
    b"extra_keys",
    b"group_idx",
    b"kv_cache_spec_kind",
    b"kv_cache_spec_sliding_window",
    b"locality",
    b"ownership",
    b"session_id",
    b"lookahead_token_ids",
];

/// The shortest encoding of a known event: `["BlockStored"]`, 13 bytes.
const MIN_EVENT_LEN: usize = 13;

/// `BlockRemoved` fields in declaration order.
const REMOVED_FIELDS: [&[u8]; 5] = [
    b"block_hashes",
    b"medium",
    b"group_idx",
    b"locality",
    b"ownership",
];

pub(super) fn batch(bytes: &[u8], stats: &mut DecodeStats) -> Result<KvEventBatch, DecodeError> {
    let mut r = Reader::new(bytes);
    let len = r.array_len("batch")?;
    if len < 2 {
        return Err(DecodeError::BatchTooShort { len });
    }
    let ts = r.f64("ts")?;
    let events = events(&mut r, stats)?;
    let data_parallel_rank = if len >= 3 {
        opt(&mut r, |r| r.i64("data_parallel_rank"))?
    } else {
        None
    };
    if len > 3 {
        r.skip_values(len - 3)?;
        stats.ignored_fields += len - 3;
    }
    if r.remaining() != 0 {
        return Err(DecodeError::TrailingBytes {
            offset: r.pos(),
            remaining: r.remaining(),
        });
    }
    Ok(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn events(r: &mut Reader<'_>, stats: &mut DecodeStats) -> Result<Vec<KvEvent>, DecodeError> {
    let n = r.array_len("events")?;
    // An event value is hundreds of bytes in memory but at least MIN_EVENT_LEN on the wire;
    // sizing by the latter keeps a hostile count from reserving far more than the input.
    let mut out = Vec::with_capacity(n.min(r.remaining() / MIN_EVENT_LEN));
    for _ in 0..n {
        match event(r, stats)? {
            Some(ev) => out.push(ev),
            None => stats.unknown_events += 1,
        }
    }
    Ok(out)
}

/// What a tag names; `None` for a tag this codec does not know.
#[derive(Clone, Copy)]
enum Kind {
    Stored,
    Removed,
    Cleared,
}

impl Kind {
    fn from_tag(tag: &[u8]) -> Option<Kind> {
        match tag {
            b"BlockStored" => Some(Kind::Stored),
            b"BlockRemoved" => Some(Kind::Removed),
            b"AllBlocksCleared" => Some(Kind::Cleared),
            _ => None,
        }
    }
}

/// An event being filled in, field by field.
enum Sink {
    Stored(BlockStored),
    Removed(BlockRemoved),
    Cleared,
}

impl Sink {
    fn new(kind: Kind) -> Sink {
        match kind {
            Kind::Stored => Sink::Stored(BlockStored::default()),
            Kind::Removed => Sink::Removed(BlockRemoved::default()),
            Kind::Cleared => Sink::Cleared,
        }
    }

    /// Reads the value of `key` if this event has such a field; `Ok(false)` (nothing consumed)
    /// otherwise.
    fn field(&mut self, r: &mut Reader<'_>, key: &[u8]) -> Result<bool, DecodeError> {
        match self {
            Sink::Stored(s) => stored_field(r, key, s),
            Sink::Removed(s) => removed_field(r, key, s),
            Sink::Cleared => Ok(false),
        }
    }

    fn fields(&self) -> &'static [&'static [u8]] {
        match self {
            Sink::Stored(_) => &STORED_FIELDS,
            Sink::Removed(_) => &REMOVED_FIELDS,
            Sink::Cleared => &[],
        }
    }

    fn finish(self) -> KvEvent {
        match self {
            Sink::Stored(s) => KvEvent::BlockStored(s),
            Sink::Removed(s) => KvEvent::BlockRemoved(s),
            Sink::Cleared => KvEvent::AllBlocksCleared,
        }
    }
}

fn event(r: &mut Reader<'_>, stats: &mut DecodeStats) -> Result<Option<KvEvent>, DecodeError> {
    let at = r.pos();
    match r.peek_marker()? {
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let (n, fixmap) = r.map_len("event")?;
            map_event(r, n, fixmap, stats)
        }
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = r.array_len("event")?;
            stats.array_events += 1;
            array_event(r, n, stats)
        }
        _ => Err(r.unexpected("event", "map or array", at)),
    }
}

/// A map event: `{"type": tag, field: value, ...}`, keys in any order.
fn map_event(
    r: &mut Reader<'_>,
    n: usize,
    fixmap: bool,
    stats: &mut DecodeStats,
) -> Result<Option<KvEvent>, DecodeError> {
    let at = r.pos();
    // vLLM writes the tag first, so this look-ahead normally reads one entry.
    let tag = find_tag(*r, n)?.ok_or(DecodeError::MissingTag { offset: at })?;
    let Some(kind) = Kind::from_tag(tag) else {
        r.skip_values(n.saturating_mul(2))?;
        return Ok(None);
    };
    let mut sink = Sink::new(kind);
    for _ in 0..n {
        let known = match key(r)? {
            Some(b"type") => {
                r.skip_values(1)?;
                true
            }
            Some(k) => sink.field(r, k)?,
            None => false,
        };
        if !known {
            r.skip_values(1)?;
            stats.ignored_fields += 1;
        }
    }
    if let Sink::Stored(s) = &mut sink {
        s.map_header = if fixmap && stored_entries(s) <= FIXMAP_MAX {
            MapHeader::FixMap
        } else {
            MapHeader::Map16
        };
    }
    Ok(Some(sink.finish()))
}

/// The first `type` value among the next `n` map entries of a copy of the reader.
fn find_tag(mut r: Reader<'_>, n: usize) -> Result<Option<&[u8]>, DecodeError> {
    for _ in 0..n {
        if matches!(key(&mut r)?, Some(b"type")) {
            return r.str_bytes("type").map(Some);
        }
        r.skip_values(1)?;
    }
    Ok(None)
}

/// A map key as bytes, or `None` (key already skipped) for a key that is not a string.
fn key<'a>(r: &mut Reader<'a>) -> Result<Option<&'a [u8]>, DecodeError> {
    match r.peek_marker()? {
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
            r.str_bytes("key").map(Some)
        }
        _ => r.skip_values(1).map(|()| None),
    }
}

/// A positional event: `[tag, field1, field2, ...]` in declaration order; missing trailing
/// fields keep their defaults (0.11 sent 7 and 3 elements, 0.23 sent 12 and 4).
fn array_event(
    r: &mut Reader<'_>,
    n: usize,
    stats: &mut DecodeStats,
) -> Result<Option<KvEvent>, DecodeError> {
    if n == 0 {
        return Err(DecodeError::MissingTag { offset: r.pos() });
    }
    let tag = r.str_bytes("type")?;
    let Some(kind) = Kind::from_tag(tag) else {
        r.skip_values(n - 1)?;
        return Ok(None);
    };
    let mut sink = Sink::new(kind);
    let fields = sink.fields();
    for i in 0..n - 1 {
        let known = match fields.get(i) {
            Some(k) => sink.field(r, k)?,
            None => false,
        };
        if !known {
            r.skip_values(1)?;
            stats.ignored_fields += 1;
        }
    }
    Ok(Some(sink.finish()))
}

fn stored_field(r: &mut Reader<'_>, key: &[u8], s: &mut BlockStored) -> Result<bool, DecodeError> {
    match key {
        b"block_hashes" => s.block_hashes = hashes(r, "block_hashes")?,
        b"parent_block_hash" => s.parent_block_hash = opt(r, |r| hash(r, "parent_block_hash"))?,
        b"token_ids" => s.token_ids = u32s(r, "token_ids")?,
        b"block_size" => s.block_size = r.u32("block_size")?,
        b"lora_id" => s.lora_id = opt(r, |r| r.i64("lora_id"))?,
        b"medium" => s.medium = opt(r, |r| known_or_owned(r, "medium", media()))?,
        b"lora_name" => s.lora_name = opt_string(r, "lora_name")?,
        b"extra_keys" => s.extra_keys = opt(r, extra_keys)?,
        b"group_idx" => s.group_idx = opt(r, |r| r.u32("group_idx"))?,
        b"kv_cache_spec_kind" => {
            s.kv_cache_spec_kind = opt(r, |r| known_or_owned(r, "kv_cache_spec_kind", SPEC_KINDS))?
        }
        b"kv_cache_spec_sliding_window" => {
            s.kv_cache_spec_sliding_window = opt(r, |r| r.u32("kv_cache_spec_sliding_window"))?
        }
        b"locality" => s.locality = opt_string(r, "locality")?,
        b"ownership" => s.ownership = opt_string(r, "ownership")?,
        b"session_id" => s.session_id = opt_string(r, "session_id")?,
        b"lookahead_token_ids" => s.lookahead_token_ids = opt(r, lookahead)?,
        _ => return Ok(false),
    }
    Ok(true)
}

fn removed_field(
    r: &mut Reader<'_>,
    key: &[u8],
    s: &mut BlockRemoved,
) -> Result<bool, DecodeError> {
    match key {
        b"block_hashes" => s.block_hashes = hashes(r, "block_hashes")?,
        b"medium" => s.medium = opt(r, |r| known_or_owned(r, "medium", media()))?,
        b"group_idx" => s.group_idx = opt(r, |r| r.u32("group_idx"))?,
        b"locality" => s.locality = opt_string(r, "locality")?,
        b"ownership" => s.ownership = opt_string(r, "ownership")?,
        _ => return Ok(false),
    }
    Ok(true)
}

/// A string field with a few values vLLM sends on every event (a medium, a cache spec's kind):
/// those without an allocation, any other as sent (the text is kept either way, so
/// re-encoding is exact).
fn known_or_owned(
    r: &mut Reader<'_>,
    field: &'static str,
    known: impl IntoIterator<Item = &'static str>,
) -> Result<Cow<'static, str>, DecodeError> {
    let v = r.str(field)?;
    Ok(match known.into_iter().find(|k| *k == v) {
        Some(k) => Cow::Borrowed(k),
        None => Cow::Owned(v.to_owned()),
    })
}

/// The media as vLLM spells them (exact text, so that re-encoding is byte for byte).
fn media() -> impl Iterator<Item = &'static str> {
    Tier::MEDIA.iter().map(|&(name, _)| name)
}

const SPEC_KINDS: [&str; 2] = ["full_attention", "sliding_window"];

/// `None` for nil, else the value `f` reads.
fn opt<'a, T>(
    r: &mut Reader<'a>,
    f: impl FnOnce(&mut Reader<'a>) -> Result<T, DecodeError>,
) -> Result<Option<T>, DecodeError> {
    if r.take_nil()? {
        Ok(None)
    } else {
        f(r).map(Some)
    }
}

fn opt_string(r: &mut Reader<'_>, field: &'static str) -> Result<Option<String>, DecodeError> {
    opt(r, |r| r.str(field).map(str::to_owned))
}

/// A block hash: an unsigned integer, or raw digest bytes. A negative integer (a Python
/// `hash()` from before vLLM fixed its hashes) is kept as its two's-complement bits.
fn hash(r: &mut Reader<'_>, field: &'static str) -> Result<HashValue, DecodeError> {
    let at = r.pos();
    match r.peek_marker()? {
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
            r.bin(field).map(|b| HashValue::Bytes(b.to_vec()))
        }
        _ => match r.int(field) {
            Ok(Int::U(v)) => Ok(HashValue::Int(v)),
            Ok(Int::I(v)) => Ok(HashValue::Int(v as u64)),
            Err(_) => Err(r.unexpected(field, "integer or bytes", at)),
        },
    }
}

fn hashes(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<HashValue>, DecodeError> {
    let n = r.array_len(field)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(hash(r, field)?);
    }
    Ok(out)
}

fn u32s(r: &mut Reader<'_>, field: &'static str) -> Result<Vec<u32>, DecodeError> {
    let n = r.array_len(field)?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(r.u32(field)?);
    }
    Ok(out)
}

fn lookahead(r: &mut Reader<'_>) -> Result<Vec<Vec<u32>>, DecodeError> {
    let n = r.array_len("lookahead_token_ids")?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(u32s(r, "lookahead_token_ids")?);
    }
    Ok(out)
}

/// `extra_keys`: one entry per block, each a tuple (array) or nil.
fn extra_keys(r: &mut Reader<'_>) -> Result<Vec<Option<Vec<ExtraKeyItem>>>, DecodeError> {
    let n = r.array_len("extra_keys")?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(opt(r, |r| extra_tuple(r, 1))?);
    }
    Ok(out)
}

fn extra_tuple(r: &mut Reader<'_>, depth: usize) -> Result<Vec<ExtraKeyItem>, DecodeError> {
    if depth > MAX_EXTRA_KEY_DEPTH {
        return Err(DecodeError::TooDeep { offset: r.pos() });
    }
    let n = r.array_len("extra_keys")?;
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(extra_item(r, depth)?);
    }
    Ok(out)
}

/// One tuple element. Integers that fit `i64` are `Int`, larger ones `UInt`, so a decoded value
/// has one canonical form.
fn extra_item(r: &mut Reader<'_>, depth: usize) -> Result<ExtraKeyItem, DecodeError> {
    const FIELD: &str = "extra_keys";
    let at = r.pos();
    let item = match r.peek_marker()? {
        Marker::Null => {
            r.take_nil()?;
            ExtraKeyItem::Nil
        }
        Marker::True | Marker::False => {
            let b = r.peek_marker()? == Marker::True;
            r.skip_values(1)?;
            ExtraKeyItem::Bool(b)
        }
        Marker::F32 | Marker::F64 => ExtraKeyItem::Float(r.f64(FIELD)?),
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32 => {
            ExtraKeyItem::Str(r.str(FIELD)?.to_owned())
        }
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => ExtraKeyItem::Bytes(r.bin(FIELD)?.to_vec()),
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            ExtraKeyItem::Array(extra_tuple(r, depth + 1)?)
        }
        _ => match r.int(FIELD) {
            Ok(Int::U(v)) => i64::try_from(v).map_or(ExtraKeyItem::UInt(v), ExtraKeyItem::Int),
            Ok(Int::I(v)) => ExtraKeyItem::Int(v),
            Err(_) => {
                return Err(r.unexpected(FIELD, "nil, bool, number, string, bytes or array", at))
            }
        },
    };
    Ok(item)
}
