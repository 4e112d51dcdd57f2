//! `tokenizer.json` through HF's `tokenizers` library, as transformers' fast tokenizers use it
//! (no truncation, no padding), plus what the prefix cache needs to know about it.
//!
//! Split-point invariant (why the cache is exact): `tokenizers` first cuts the input at added
//! tokens matched on the raw text, then normalizes, pre-tokenizes and runs the model on each
//! piece on its own; with `add_special_tokens = false` the post-processor changes no ids. So if
//! position `p` ends an added token matched on the raw text (not `normalized`, unless the
//! normalizer is the identity; no lstrip/rstrip/single-word flags)
//! and every match decision before `p` only reads bytes the two texts share, then
//! `encode(T) = encode(T[..p]) ++ encode(T[p..])`. That needs a normalizer and pre-tokenizer
//! that treat every piece alike (no "only at offset 0" rule such as Metaspace's
//! `prepend_scheme: "first"`), which [`Encoder::split_safe`] checks from the file.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value as Json;
use tokenizers::Tokenizer as HfTokenizer;

use crate::error::{Result, TokenizeError};

/// A place where tokenization may restart: `byte` ends an added token whose id is at
/// `token - 1`, so `ids[..token]` are exactly the ids of `text[..byte]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitPoint {
    pub byte: u32,
    pub token: u32,
}

/// `tokenizer.json`, loaded.
#[derive(Debug)]
pub(crate) struct Encoder {
    tk: HfTokenizer,
    /// Per id: may a split point follow this added token.
    split_after: Vec<bool>,
    /// Longest added-token text in bytes (how far back a match decision can reach).
    pub max_added_len: usize,
    /// Whether split points are exact for this tokenizer (see the module docs).
    pub split_safe: bool,
    /// Ids the post-processor puts before and after the text when special tokens are added.
    /// `None`: not a plain prefix/suffix, so the cache is not used with special tokens.
    special_affixes: Option<(Vec<u32>, Vec<u32>)>,
}

#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    normalizer: Option<Json>,
    #[serde(default)]
    pre_tokenizer: Option<Json>,
    #[serde(default)]
    model: Option<ModelProbe>,
}

#[derive(Deserialize)]
struct ModelProbe {
    #[serde(default)]
    dropout: Option<Json>,
}

impl Encoder {
    /// Loads `path` (a `tokenizer.json`).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| TokenizeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let load_err = |detail: String| TokenizeError::TokenizerLoad {
            path: path.to_path_buf(),
            detail,
        };
        let mut tk: HfTokenizer = text.parse().map_err(|e| load_err(format!("{e}")))?;
        // transformers calls the fast tokenizer with truncation and padding off.
        tk.with_truncation(None)
            .map_err(|e| load_err(format!("{e}")))?;
        tk.with_padding(None);
        let probe: Probe = serde_json::from_str(&text).map_err(|e| load_err(e.to_string()))?;
        let added = tk.get_added_tokens_decoder();
        let max_id = added.keys().copied().max().map_or(0, |m| m as usize + 1);
        let mut split_after = vec![false; max_id];
        let mut any_strip = false;
        // Tokens matched on normalized text are as good as raw ones when normalizing changes
        // nothing (no normalizer, or an empty sequence): the normalized text is the raw text.
        let identity = probe.normalizer.as_ref().is_none_or(normalizer_is_identity);
        for (id, t) in &added {
            any_strip |= t.lstrip || t.rstrip;
            let matched_raw = !t.normalized || identity;
            if matched_raw && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty() {
                split_after[*id as usize] = true;
            }
        }
        let max_added_len = added.values().map(|t| t.content.len()).max().unwrap_or(0);
        let dropout = probe
            .model
            .and_then(|m| m.dropout)
            .is_some_and(|d| !d.is_null());
        let split_safe = !any_strip
            && !dropout
            && probe
                .normalizer
                .as_ref()
                .is_none_or(normalizer_is_per_piece)
            && probe
                .pre_tokenizer
                .as_ref()
                .is_none_or(pre_tokenizer_is_per_piece);
        let mut enc = Encoder {
            tk,
            split_after,
            max_added_len,
            split_safe,
            special_affixes: None,
        };
        enc.special_affixes = enc.probe_special_affixes();
        Ok(enc)
    }

    /// Token ids of `text`, as `tokenizer.encode(text, add_special_tokens=...)` gives them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tk
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids of `text` without special tokens, and the split points in it.
    pub fn encode_with_splits(&self, text: &str) -> Result<(Vec<u32>, Vec<SplitPoint>)> {
        let enc = self
            .tk
            .encode(text, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let ids = enc.get_ids().to_vec();
        let mut splits = Vec::new();
        for (i, (&id, &(start, end))) in ids.iter().zip(enc.get_offsets()).enumerate() {
            if !self.split_after.get(id as usize).copied().unwrap_or(false) {
                continue;
            }
            // Only where the token really came from its own text (not merged by the model).
            let content_len = self.tk.id_to_token(id).map_or(usize::MAX, |t| t.len());
            if end.saturating_sub(start) == content_len && text.get(start..end).is_some() {
                if let (Ok(byte), Ok(token)) = (u32::try_from(end), u32::try_from(i + 1)) {
                    splits.push(SplitPoint { byte, token });
                }
            }
        }
        Ok((ids, splits))
    }

    /// Wraps ids of a text without special tokens as `add_special_tokens=True` would, when the
    /// post-processor only adds a fixed prefix and suffix.
    pub fn add_special_affixes(&self, core: Vec<u32>) -> Option<Vec<u32>> {
        let (pre, suf) = self.special_affixes.as_ref()?;
        if pre.is_empty() && suf.is_empty() {
            return Some(core);
        }
        let mut out = Vec::with_capacity(pre.len() + core.len() + suf.len());
        out.extend_from_slice(pre);
        out.extend_from_slice(&core);
        out.extend_from_slice(suf);
        Some(out)
    }

    fn probe_special_affixes(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
        for probe in ["a", "Hello world", "x y z 123"] {
            let with = self.encode(probe, true).ok()?;
            let core = self.encode(probe, false).ok()?;
            let at = (0..=with.len().checked_sub(core.len())?)
                .find(|&i| with[i..i + core.len()] == core[..])?;
            let affixes = (with[..at].to_vec(), with[at + core.len()..].to_vec());
            if found.as_ref().is_some_and(|f| *f != affixes) {
                return None;
            }
            found = Some(affixes);
        }
        found
    }
}

fn node_type(v: &Json) -> &str {
    v.get("type").and_then(Json::as_str).unwrap_or_default()
}

/// A normalizer that leaves every text as it is.
fn normalizer_is_identity(v: &Json) -> bool {
    v.is_null()
        || (node_type(v) == "Sequence"
            && v.get("normalizers")
                .and_then(Json::as_array)
                .is_some_and(|ns| ns.iter().all(normalizer_is_identity)))
}

/// Normalizers that work on each piece alone.
fn normalizer_is_per_piece(v: &Json) -> bool {
    if v.is_null() {
        return true;
    }
    match node_type(v) {
        "Sequence" => v
            .get("normalizers")
            .and_then(Json::as_array)
            .is_some_and(|ns| ns.iter().all(normalizer_is_per_piece)),
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" | "Strip" | "StripAccents" | "Replace"
        | "Prepend" | "Nmt" | "Precompiled" | "BertNormalizer" | "ByteLevel" => true,
        _ => false,
    }
}

/// Pre-tokenizers that work on each piece alone.
fn pre_tokenizer_is_per_piece(v: &Json) -> bool {
    if v.is_null() {
        return true;
    }
    match node_type(v) {
        "Sequence" => v
            .get("pretokenizers")
            .and_then(Json::as_array)
            .is_some_and(|ps| ps.iter().all(pre_tokenizer_is_per_piece)),
        "Metaspace" => v.get("prepend_scheme").and_then(Json::as_str) != Some("first"),
        "ByteLevel" | "Split" | "Digits" | "Punctuation" | "Whitespace" | "WhitespaceSplit"
        | "BertPreTokenizer" | "UnicodeScripts" | "CharDelimiterSplit" => true,
        _ => false,
    }
}
