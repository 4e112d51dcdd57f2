//! Newtypes for the identifiers that cross crate boundaries.
//!
//! A [`BlockHash`] is the 64-bit value vLLM puts in KV events: the last 8 bytes of the block's
//! digest, big-endian. Byte-form event hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`) map to
//! the same value, so the index only ever sees `BlockHash`.

use std::fmt;

/// The 64-bit block identity vLLM publishes in KV events (last 8 digest bytes, big-endian).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct BlockHash(pub u64);

impl BlockHash {
    /// The event value of a full digest: its last 8 bytes read big-endian. A digest shorter than
    /// 8 bytes is read as a big-endian integer, as Python's `int.from_bytes` would.
    pub fn from_digest(digest: &[u8]) -> Self {
        // One load for every full digest: the router converts each block of each request.
        if let Some(tail) = digest.last_chunk::<8>() {
            return BlockHash(u64::from_be_bytes(*tail));
        }
        BlockHash(
            digest
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b)),
        )
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:#018x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A data-parallel rank of one replica; each rank has its own publisher and sequence.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct DpRank(pub u32);

/// A KV-cache group index (hybrid models publish the same hashes once per group).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
pub struct GroupIdx(pub u32);

/// Where a cached block lives, from vLLM's `medium` field.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub enum Tier {
    Gpu,
    Cpu,
    Storage,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// The `medium` values vLLM and its offloading connectors send, as they spell them, with
    /// the tier each names (the event decoder keeps these without an allocation).
    pub const MEDIA: [(&'static str, Tier); 4] = [
        ("GPU", Tier::Gpu),
        ("CPU", Tier::Cpu),
        ("STORAGE", Tier::Storage),
        ("DISK", Tier::Storage),
    ];

    /// vLLM's `medium` string, in any case. `None` means GPU: vLLM's own block pool always
    /// says "GPU", and only offloading connectors name other media. Unknown media are `None`
    /// so callers can count them instead of guessing.
    pub fn from_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(m) = medium else {
            return Some(Tier::Gpu);
        };
        Tier::MEDIA
            .iter()
            .find(|(name, _)| m.eq_ignore_ascii_case(name))
            .map(|&(_, tier)| tier)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Gpu => "GPU",
            Tier::Cpu => "CPU",
            Tier::Storage => "STORAGE",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_value_is_last_eight_bytes_big_endian() {
        let digest: Vec<u8> = (0u8..32).collect();
        assert_eq!(BlockHash::from_digest(&digest).0, 0x18191a1b1c1d1e1f);
        assert_eq!(BlockHash::from_digest(&[1, 2]).0, 0x0102);
        // Every length, as Python's `int.from_bytes(digest[-8:], "big")` reads it.
        for len in 0..=40u8 {
            let digest: Vec<u8> = (0..len).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
            let python = digest[digest.len().saturating_sub(8)..]
                .iter()
                .fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
            assert_eq!(BlockHash::from_digest(&digest).0, python, "{len} bytes");
        }
    }

    #[test]
    fn medium_maps_to_tier() {
        assert_eq!(Tier::from_medium(None), Some(Tier::Gpu));
        assert_eq!(Tier::from_medium(Some("CPU")), Some(Tier::Cpu));
        assert_eq!(Tier::from_medium(Some("STORAGE")), Some(Tier::Storage));
        assert_eq!(Tier::from_medium(Some("disk")), Some(Tier::Storage));
        assert_eq!(Tier::from_medium(Some("gpu")), Some(Tier::Gpu));
        assert_eq!(Tier::from_medium(Some("tape")), None);
    }
}
