//! [`KvEventBatch`] → bytes, exactly as vLLM 0.34's msgspec encoder writes them.
//!
//! msgspec's choices, which this mirrors: the batch is an array of 3 (`array_like`, defaults not
//! omitted); events are maps, `"type"` first, then fields in declaration order; fields without
//! a default are always written (nil when None), None-default fields are left out; integers take
//! their smallest form, non-negative ones unsigned; floats are always float64; strings and bytes
//! take the smallest of str8/bin8 and up; map headers are sized by the class's field count (see
//! [`MapHeader`]). Collections longer than `u32::MAX` — which msgpack cannot represent and vLLM
//! cannot produce — are cut at `u32::MAX` elements, so the output is always valid msgpack.

use rmp::Marker;

use super::{stored_entries, FIXMAP_MAX};
use crate::events::{
    BlockRemoved, BlockStored, ExtraKeyItem, HashValue, KvEvent, KvEventBatch, MapHeader,
};

pub(super) fn batch(batch: &KvEventBatch, out: &mut Vec<u8>) {
    let mut w = Writer(out);
    w.array_len(3);
    w.f64(batch.ts);
    let n = w.array_len(batch.events.len());
    for ev in batch.events.iter().take(n) {
        match ev {
            KvEvent::BlockStored(s) => stored(&mut w, s),
            KvEvent::BlockRemoved(s) => removed(&mut w, s),
            KvEvent::AllBlocksCleared => {
                w.map_fix(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    match batch.data_parallel_rank {
        Some(rank) => w.int(rank),
        None => w.nil(),
    }
}

fn stored(w: &mut Writer<'_>, s: &BlockStored) {
    let entries = stored_entries(s);
    if s.map_header == MapHeader::FixMap && entries <= FIXMAP_MAX {
        w.map_fix(entries);
    } else {
        w.map16(entries);
    }
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.hashes(&s.block_hashes);
    w.str("parent_block_hash");
    match &s.parent_block_hash {
        Some(h) => w.hash(h),
        None => w.nil(),
    }
    w.str("token_ids");
    w.u32s(&s.token_ids);
    w.str("block_size");
    w.uint(u64::from(s.block_size));
    w.str("lora_id");
    match s.lora_id {
        Some(v) => w.int(v),
        None => w.nil(),
    }
    w.str("medium");
    w.opt_str(s.medium.as_deref());
    w.str("lora_name");
    w.opt_str(s.lora_name.as_deref());
    if let Some(keys) = &s.extra_keys {
        w.str("extra_keys");
        let n = w.array_len(keys.len());
        for entry in keys.iter().take(n) {
            match entry {
                Some(items) => w.extra_items(items),
                None => w.nil(),
            }
        }
    }
    w.opt_u32_field("group_idx", s.group_idx);
    w.opt_str_field("kv_cache_spec_kind", s.kv_cache_spec_kind.as_deref());
    w.opt_u32_field(
        "kv_cache_spec_sliding_window",
        s.kv_cache_spec_sliding_window,
    );
    w.opt_str_field("locality", s.locality.as_deref());
    w.opt_str_field("ownership", s.ownership.as_deref());
    w.opt_str_field("session_id", s.session_id.as_deref());
    if let Some(lists) = &s.lookahead_token_ids {
        w.str("lookahead_token_ids");
        let n = w.array_len(lists.len());
        for list in lists.iter().take(n) {
            w.u32s(list);
        }
    }
}

fn removed(w: &mut Writer<'_>, s: &BlockRemoved) {
    let optional = [
        s.group_idx.is_some(),
        s.locality.is_some(),
        s.ownership.is_some(),
    ];
    // BlockRemoved has 5 fields + tag, always a fixmap.
    w.map_fix(3 + optional.iter().filter(|set| **set).count());
    w.str("type");
    w.str("BlockRemoved");
    w.str("block_hashes");
    w.hashes(&s.block_hashes);
    w.str("medium");
    w.opt_str(s.medium.as_deref());
    w.opt_u32_field("group_idx", s.group_idx);
    w.opt_str_field("locality", s.locality.as_deref());
    w.opt_str_field("ownership", s.ownership.as_deref());
}

/// A msgpack writer over a `Vec<u8>`, which cannot fail.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn marker(&mut self, m: Marker) {
        self.0.push(m.to_u8());
    }

    fn nil(&mut self) {
        self.marker(Marker::Null);
    }

    fn uint(&mut self, v: u64) {
        if v < 0x80 {
            self.0.push(v as u8);
        } else if v <= u64::from(u8::MAX) {
            self.marker(Marker::U8);
            self.0.push(v as u8);
        } else if v <= u64::from(u16::MAX) {
            self.marker(Marker::U16);
            self.0.extend_from_slice(&(v as u16).to_be_bytes());
        } else if v <= u64::from(u32::MAX) {
            self.marker(Marker::U32);
            self.0.extend_from_slice(&(v as u32).to_be_bytes());
        } else {
            self.marker(Marker::U64);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    /// A signed integer: unsigned forms when non-negative, as msgspec does.
    fn int(&mut self, v: i64) {
        if v >= 0 {
            self.uint(v as u64);
        } else if v >= -32 {
            self.0.push(v as u8);
        } else if v >= i64::from(i8::MIN) {
            self.marker(Marker::I8);
            self.0.push(v as u8);
        } else if v >= i64::from(i16::MIN) {
            self.marker(Marker::I16);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.marker(Marker::I32);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.marker(Marker::I64);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn f64(&mut self, v: f64) {
        self.marker(Marker::F64);
        self.0.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    /// Writes a header of the fix/16/32 families (arrays) and returns the clamped length.
    fn array_len(&mut self, len: usize) -> usize {
        let len = len.min(u32::MAX as usize);
        if len <= 15 {
            self.0.push(0x90 | len as u8);
        } else if len <= usize::from(u16::MAX) {
            self.marker(Marker::Array16);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.marker(Marker::Array32);
            self.0.extend_from_slice(&(len as u32).to_be_bytes());
        }
        len
    }

    fn map_fix(&mut self, len: usize) {
        self.0.push(0x80 | (len.min(FIXMAP_MAX) as u8));
    }

    fn map16(&mut self, len: usize) {
        self.marker(Marker::Map16);
        self.0
            .extend_from_slice(&(len.min(usize::from(u16::MAX)) as u16).to_be_bytes());
    }

    /// A header of the 8/16/32 families (str and bin); returns the clamped length.
    fn sized_header(&mut self, len: usize, markers: [Marker; 3]) -> usize {
        let [m8, m16, m32] = markers;
        let len = len.min(u32::MAX as usize);
        if len <= usize::from(u8::MAX) {
            self.marker(m8);
            self.0.push(len as u8);
        } else if len <= usize::from(u16::MAX) {
            self.marker(m16);
            self.0.extend_from_slice(&(len as u16).to_be_bytes());
        } else {
            self.marker(m32);
            self.0.extend_from_slice(&(len as u32).to_be_bytes());
        }
        len
    }

    fn str(&mut self, s: &str) {
        let bytes = s.as_bytes();
        let n = if bytes.len() <= 31 {
            self.0.push(0xa0 | bytes.len() as u8);
            bytes.len()
        } else {
            self.sized_header(bytes.len(), [Marker::Str8, Marker::Str16, Marker::Str32])
        };
        self.0.extend_from_slice(bytes.get(..n).unwrap_or_default());
    }

    fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    fn bin(&mut self, b: &[u8]) {
        let n = self.sized_header(b.len(), [Marker::Bin8, Marker::Bin16, Marker::Bin32]);
        self.0.extend_from_slice(b.get(..n).unwrap_or_default());
    }

    fn hash(&mut self, h: &HashValue) {
        match h {
            HashValue::Int(v) => self.uint(*v),
            HashValue::Bytes(b) => self.bin(b),
        }
    }

    fn hashes(&mut self, hashes: &[HashValue]) {
        let n = self.array_len(hashes.len());
        self.0.reserve(n * 9);
        for h in hashes.iter().take(n) {
            self.hash(h);
        }
    }

    fn u32s(&mut self, values: &[u32]) {
        let n = self.array_len(values.len());
        self.0.reserve(n * 5);
        for v in values.iter().take(n) {
            self.uint(u64::from(*v));
        }
    }

    fn extra_items(&mut self, items: &[ExtraKeyItem]) {
        let n = self.array_len(items.len());
        for item in items.iter().take(n) {
            match item {
                ExtraKeyItem::Nil => self.nil(),
                ExtraKeyItem::Bool(b) => self.marker(if *b { Marker::True } else { Marker::False }),
                ExtraKeyItem::Int(v) => self.int(*v),
                ExtraKeyItem::UInt(v) => self.uint(*v),
                ExtraKeyItem::Float(v) => self.f64(*v),
                ExtraKeyItem::Str(s) => self.str(s),
                ExtraKeyItem::Bytes(b) => self.bin(b),
                ExtraKeyItem::Array(a) => self.extra_items(a),
            }
        }
    }

    fn opt_u32_field(&mut self, key: &str, v: Option<u32>) {
        if let Some(v) = v {
            self.str(key);
            self.uint(u64::from(v));
        }
    }

    fn opt_str_field(&mut self, key: &str, v: Option<&str>) {
        if let Some(v) = v {
            self.str(key);
            self.str(v);
        }
    }
}
