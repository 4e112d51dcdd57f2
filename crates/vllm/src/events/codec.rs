//! vLLM's KV-event batch codec: msgpack bytes ⇄ [`KvEventBatch`].
//!
//! Decoding accepts every layout vLLM has published (0.24+ maps, ≤ 0.23 positional arrays,
//! 0.11's short arrays) and is tolerant where tolerance is safe: unknown keys, extra array
//! elements and events with an unknown `type` are skipped and counted in [`DecodeStats`].
//! Anything else that is not what vLLM writes is a [`DecodeError`]; decoding never panics, never
//! recurses without a bound and never allocates more than a constant factor of the input.
//!
//! Encoding writes exactly what vLLM 0.34 (msgspec) writes, so a decoded 0.34 payload — or a
//! 0.24–0.33 map payload, via [`crate::events::MapHeader`] — re-encodes to the same bytes. The
//! rules are in `docs/events.md`.

mod decode;
mod encode;
mod reader;

use thiserror::Error;

use super::{BlockStored, KvEventBatch};

/// How deep `extra_keys` tuples may nest. vLLM sends flat tuples; the bound keeps hostile input
/// from exhausting the stack.
pub const MAX_EXTRA_KEY_DEPTH: usize = 16;

/// Why a payload could not be decoded. Offsets are byte positions in the payload.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum DecodeError {
    #[error("payload truncated at byte {offset}")]
    Truncated { offset: usize },
    #[error("{remaining} bytes after the batch, at byte {offset}")]
    TrailingBytes { offset: usize, remaining: usize },
    #[error("reserved msgpack marker 0xc1 at byte {offset}")]
    ReservedMarker { offset: usize },
    #[error("{field}: expected {expected}, found {found} at byte {offset}")]
    UnexpectedType {
        field: &'static str,
        expected: &'static str,
        found: &'static str,
        offset: usize,
    },
    #[error("{field}: integer out of range at byte {offset}")]
    IntOutOfRange { field: &'static str, offset: usize },
    #[error("{field}: invalid UTF-8 at byte {offset}")]
    InvalidUtf8 { field: &'static str, offset: usize },
    #[error("batch array has {len} elements, at least 2 (ts, events) are needed")]
    BatchTooShort { len: usize },
    #[error("event at byte {offset} has no type tag")]
    MissingTag { offset: usize },
    #[error("extra_keys nested deeper than {max} at byte {offset}", max = MAX_EXTRA_KEY_DEPTH)]
    TooDeep { offset: usize },
}

impl DecodeError {
    /// A stable, low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            DecodeError::Truncated { .. } => "truncated",
            DecodeError::TrailingBytes { .. } => "trailing_bytes",
            DecodeError::ReservedMarker { .. } => "reserved_marker",
            DecodeError::UnexpectedType { .. } => "unexpected_type",
            DecodeError::IntOutOfRange { .. } => "int_out_of_range",
            DecodeError::InvalidUtf8 { .. } => "invalid_utf8",
            DecodeError::BatchTooShort { .. } => "batch_too_short",
            DecodeError::MissingTag { .. } => "missing_tag",
            DecodeError::TooDeep { .. } => "too_deep",
        }
    }
}

/// What a successful decode tolerated. All zero for a payload vLLM 0.34 wrote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeStats {
    /// Events whose `type` tag is not `BlockStored`, `BlockRemoved` or `AllBlocksCleared`;
    /// they are not in the batch.
    pub unknown_events: usize,
    /// Map keys this codec does not know, array elements past the known fields, and batch
    /// elements past the third; all skipped.
    pub ignored_fields: usize,
    /// Events in the ≤ 0.23 positional-array layout.
    pub array_events: usize,
}

/// Decodes one payload (the third frame of a live message). Unknown events are dropped; use
/// [`decode_batch_with_stats`] to count them.
pub fn decode_batch(bytes: &[u8]) -> Result<KvEventBatch, DecodeError> {
    decode_batch_with_stats(bytes).map(|(batch, _)| batch)
}

/// Decodes one payload and reports what was skipped.
pub fn decode_batch_with_stats(bytes: &[u8]) -> Result<(KvEventBatch, DecodeStats), DecodeError> {
    let mut stats = DecodeStats::default();
    let batch = decode::batch(bytes, &mut stats)?;
    Ok((batch, stats))
}

/// Encodes a batch in vLLM 0.34's exact byte layout.
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    let mut out = Vec::new();
    encode_batch_into(batch, &mut out);
    out
}

/// Appends the encoding of `batch` to `out`, so a publisher can reuse one buffer.
pub fn encode_batch_into(batch: &KvEventBatch, out: &mut Vec<u8>) {
    encode::batch(batch, out);
}

/// How many map entries `BlockStored` is written with: the tag, the seven fields without a
/// default, and each optional field that is set.
pub(crate) fn stored_entries(s: &BlockStored) -> usize {
    let optional = [
        s.extra_keys.is_some(),
        s.group_idx.is_some(),
        s.kv_cache_spec_kind.is_some(),
        s.kv_cache_spec_sliding_window.is_some(),
        s.locality.is_some(),
        s.ownership.is_some(),
        s.session_id.is_some(),
        s.lookahead_token_ids.is_some(),
    ];
    8 + optional.iter().filter(|set| **set).count()
}

/// The largest entry count a fixmap header holds.
const FIXMAP_MAX: usize = 15;

#[cfg(test)]
mod tests;
