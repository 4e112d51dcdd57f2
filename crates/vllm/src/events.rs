//! KV-event data types, mirroring `vllm/distributed/kv_events.py` (0.34) field for field.
//!
//! These are plain values; the msgpack codec lives in `events/codec.rs`. Optional fields keep
//! the distinction between "absent" and "present" only where vLLM's encoder does (see the codec),
//! so a decoded 0.34 batch re-encodes to the same bytes.

use std::borrow::Cow;

use crate::ids::{BlockHash, Tier};

pub mod codec;
pub mod frames;
pub mod zmtp;

/// A block hash as it appears on the wire: an integer (default) or raw digest bytes
/// (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum HashValue {
    Int(u64),
    Bytes(Vec<u8>),
}

impl HashValue {
    /// The index key: the integer itself, or the last 8 bytes of a byte digest.
    pub fn block_hash(&self) -> BlockHash {
        match self {
            HashValue::Int(v) => BlockHash(*v),
            HashValue::Bytes(b) => BlockHash::from_digest(b),
        }
    }
}

/// One element of an event's extra-keys tuple (LoRA name, multimodal identifier and offset,
/// cache salt, ...). vLLM sends tuples of strings and integers; other msgpack scalars are kept
/// so that nothing decoded is lost.
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKeyItem {
    Nil,
    Bool(bool),
    Int(i64),
    UInt(u64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Array(Vec<ExtraKeyItem>),
}

/// The msgpack map header width a `BlockStored` event is written with.
///
/// msgspec sizes a struct's map header by the number of fields the class *could* write (its
/// fields plus the `type` tag), not by how many it does write. vLLM 0.34's `BlockStored` has 15
/// fields, so 16 possible keys: a map16 header (`0xde 0x00 N`) even for ten entries. Earlier
/// map-layout classes with at most 14 fields — vLLM 0.32's, as the real captures show — get a
/// fixmap header. The codec keeps this so a decoded payload re-encodes to the same bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum MapHeader {
    /// map16 header, as vLLM 0.34 writes (the encoder's default).
    #[default]
    Map16,
    /// fixmap header, as map-layout vLLM before 0.34 (0.32 captured) wrote. The encoder falls
    /// back to map16 when an event has more than 15 entries, which a fixmap cannot hold.
    FixMap,
}

/// `BlockStored`: blocks that became full (and so hashable) in one engine step.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockStored {
    pub block_hashes: Vec<HashValue>,
    pub parent_block_hash: Option<HashValue>,
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    /// vLLM's own values ("GPU", "CPU", ...) are borrowed: every event carries one, and the
    /// router decodes every event of every replica.
    pub medium: Option<Cow<'static, str>>,
    pub lora_name: Option<String>,
    /// One entry per block; `None` for a block without extra keys.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKeyItem>>>>,
    pub group_idx: Option<u32>,
    /// As `medium`: vLLM's known kinds borrowed, any other kept as sent.
    pub kv_cache_spec_kind: Option<Cow<'static, str>>,
    pub kv_cache_spec_sliding_window: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
    pub session_id: Option<String>,
    pub lookahead_token_ids: Option<Vec<Vec<u32>>>,
    /// Wire detail kept for byte-exact re-encoding; carries no meaning for the index.
    pub map_header: MapHeader,
}

/// `BlockRemoved`: one per evicted hash in practice, but a list on the wire.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct BlockRemoved {
    pub block_hashes: Vec<HashValue>,
    /// As [`BlockStored::medium`].
    pub medium: Option<Cow<'static, str>>,
    pub group_idx: Option<u32>,
    pub locality: Option<String>,
    pub ownership: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// One engine step's events: `[ts, events, data_parallel_rank]` on the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub data_parallel_rank: Option<i64>,
}

impl BlockStored {
    pub fn tier(&self) -> Option<Tier> {
        Tier::from_medium(self.medium.as_deref())
    }
}

impl BlockRemoved {
    pub fn tier(&self) -> Option<Tier> {
        Tier::from_medium(self.medium.as_deref())
    }
}
