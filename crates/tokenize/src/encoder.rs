//! `tokenizer.json` through HF's `tokenizers` library, as transformers' fast tokenizers use it
//! (no truncation, no padding), plus what the prefix cache needs to know about it.
//!
//! Byte-level BPE files the `fast_bpe` module fully implements (gpt2, llama3/3.1, qwen2/3,
//! deepseek-v3, tiny-llama) encode through it instead, ids and split points alike; it is
//! tested equal to the `tokenizers` pipeline (`encode_reference`,
//! `encode_with_splits_reference`), which every other file keeps (mistral's). Where it cannot
//! place split points exactly (a piece that NFC changes), `encode_with_splits` uses the
//! reference for that text.
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
//!
//! Word split points (plain text has no added tokens, so the above alone never splits a
//! completions prompt): position `b` with `text[b - 1]` an ASCII letter and `text[b] == ' '`.
//! They are exact, `encode(S) = encode(T)[..k] ++ encode(S[b..])` whenever `S` and `T` share
//! bytes `0..=b` and `k` tokens of `T` end at `b`, for tokenizers built only from parts where
//! each step below holds; [`Encoder::word_splits`] checks them from the file:
//!
//! - Added tokens: none contains a space, none is `single_word`/`lstrip`/`rstrip`. So no
//!   added-token match covers byte `b`, a match that starts before `b` ends before it in both
//!   texts, and none looks at the byte before its start: `b` lies in a piece between added
//!   tokens, and the pieces after `b` are those of `S[b..]` alone.
//! - Normalizer: none, an empty sequence, or NFC. A space has canonical combining class 0 and
//!   never composes with what precedes or follows it, so NFC(x ++ " " ++ y) =
//!   NFC(x) ++ " " ++ NFC(y) when x ends with a letter: the letter and the space stay put.
//! - Pre-tokenizer: one or more `Split`s (behavior `Isolated`, not inverted) whose regexes are
//!   listed in [`WORD_SAFE_REGEXES`], then `ByteLevel` without regex and without a prefix space;
//!   or `ByteLevel` with its built-in GPT-2 regex (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
//!   ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`) and without a prefix space. For each of those regexes
//!   no path of the matcher consumes an ASCII letter and then a space (a path that has consumed
//!   a letter goes on with letters or marks only, or ends), no alternative matches the empty
//!   string, and there is no lookbehind, anchor or `\b`. Hence no match contains both
//!   `b - 1` and `b`; a match attempt starting before `b` reads at most byte `b` (lookahead or a
//!   failed class test), so the matches before `b` are the same in `S` and `T`; and the search
//!   in `S` resumes at `b` exactly as a search of `S[b..]` starts. `ByteLevel`'s byte mapping
//!   works char by char. Stages compose: each stage cuts each piece the same way.
//! - Model: BPE without dropout, run on each pre-token on its own; so tokens never cross `b`.
//!
//! With those, `b` is a boundary of the final pre-tokens in both texts and everything before it
//! is tokenized alike. The first token starting at `b` (offsets are byte offsets into the
//! original text; `ByteLevel` maps a char's bytes to that char's range, and the char at `b` is
//! one byte) is `k`. Which shared tokenizers pass (`tokenizer.json` of each):
//!
//! - gpt2 and tiny-llama: `ByteLevel` with the GPT-2 regex, no normalizer.
//! - llama3, llama3.1: the cl100k-style `Split` regex + `ByteLevel`, no normalizer.
//! - qwen2, qwen3: the same regex with single digits + `ByteLevel`, NFC.
//! - deepseek-v3: three `Split`s (digit runs of up to 3, CJK runs, then its word regex whose
//!   letter alternatives are `[punct][A-Za-z]+` and `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`),
//!   then `ByteLevel`, identity normalizer. Digit and CJK runs never hold an ASCII letter or a
//!   space, so those stages leave `b - 1` and `b` in one gap and cut after `b` as alone.
//! - Not mistral-v1/v3: the normalizer prepends `▁` to every piece, so `S[b..]` encoded alone
//!   gets a `▁` that `S` does not have there (the tests see the invariant fail at every word
//!   boundary), and with no pre-tokenizer a whole piece is one BPE word whose merges could
//!   cross a space anyway.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value as Json;
use tokenizers::Tokenizer as HfTokenizer;

use crate::error::{Result, TokenizeError};
use crate::fast_bpe::FastBpe;
use crate::pretok::{
    SplitPoint, DEEPSEEK_CJK_REGEX, DEEPSEEK_DIGITS_REGEX, DEEPSEEK_WORD_REGEX, LLAMA3_REGEX,
    QWEN_REGEX, WORD_SPLIT_SPACING,
};

/// `Split` regexes checked against the argument in the module docs, exactly as they appear in
/// `tokenizer.json` (after JSON unescaping).
const WORD_SAFE_REGEXES: [&str; 5] = [
    LLAMA3_REGEX,
    QWEN_REGEX,
    DEEPSEEK_DIGITS_REGEX,
    DEEPSEEK_CJK_REGEX,
    DEEPSEEK_WORD_REGEX,
];

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
    /// Whether word split points are exact too (see the module docs).
    pub word_splits: bool,
    /// Ids the post-processor puts before and after the text when special tokens are added.
    /// `None`: not a plain prefix/suffix, so the cache is not used with special tokens.
    special_affixes: Option<(Vec<u32>, Vec<u32>)>,
    /// The exact fast path (see `fast_bpe`), or why this tokenizer keeps the reference.
    fast: std::result::Result<FastBpe, String>,
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
    #[serde(default, rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    dropout: Option<Json>,
}

/// What the added tokens allow, from the tokenizer's added-token table.
struct AddedFacts {
    /// Per id: may a split point follow this added token.
    split_after: Vec<bool>,
    /// Some added token strips whitespace next to it.
    any_strip: bool,
    max_added_len: usize,
    /// No added token can change how the words around it split.
    word_safe: bool,
}

impl AddedFacts {
    /// `identity`: normalizing changes nothing, so tokens matched on normalized text are as
    /// good as raw ones.
    fn of(tk: &HfTokenizer, identity: bool) -> Self {
        let added = tk.get_added_tokens_decoder();
        let max_id = added.keys().copied().max().map_or(0, |m| m as usize + 1);
        let mut split_after = vec![false; max_id];
        let mut any_strip = false;
        for (id, t) in &added {
            any_strip |= t.lstrip || t.rstrip;
            let matched_raw = !t.normalized || identity;
            if matched_raw && !t.lstrip && !t.rstrip && !t.single_word && !t.content.is_empty() {
                split_after[*id as usize] = true;
            }
        }
        AddedFacts {
            split_after,
            any_strip,
            max_added_len: added.values().map(|t| t.content.len()).max().unwrap_or(0),
            word_safe: added
                .values()
                .all(|t| !t.single_word && !t.lstrip && !t.rstrip && !t.content.contains(' ')),
        }
    }
}

impl Probe {
    /// Whether split points are exact (see the module docs).
    fn split_safe(&self, added: &AddedFacts) -> bool {
        let dropout = self
            .model
            .as_ref()
            .and_then(|m| m.dropout.as_ref())
            .is_some_and(|d| !d.is_null());
        !added.any_strip
            && !dropout
            && self.normalizer.as_ref().is_none_or(normalizer_is_per_piece)
            && self
                .pre_tokenizer
                .as_ref()
                .is_none_or(pre_tokenizer_is_per_piece)
    }

    /// Whether word split points are exact too (see the module docs).
    fn word_splits(&self, added: &AddedFacts) -> bool {
        let bpe = self
            .model
            .as_ref()
            .is_some_and(|m| m.kind.as_deref() == Some("BPE"));
        self.split_safe(added)
            && added.word_safe
            && bpe
            && self.normalizer.as_ref().is_none_or(normalizer_is_word_safe)
            && self
                .pre_tokenizer
                .as_ref()
                .is_some_and(pre_tokenizer_is_word_safe)
    }
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
        // Tokens matched on normalized text are as good as raw ones when normalizing changes
        // nothing (no normalizer, or an empty sequence): the normalized text is the raw text.
        let identity = probe.normalizer.as_ref().is_none_or(normalizer_is_identity);
        let added = AddedFacts::of(&tk, identity);
        let split_safe = probe.split_safe(&added);
        let word_splits = probe.word_splits(&added);
        let fast = FastBpe::new(&tk, probe.normalizer.as_ref(), probe.pre_tokenizer.as_ref());
        let mut enc = Encoder {
            tk,
            split_after: added.split_after,
            max_added_len: added.max_added_len,
            split_safe,
            word_splits,
            special_affixes: None,
            fast,
        };
        enc.special_affixes = enc.probe_special_affixes();
        Ok(enc)
    }

    /// Whether the fast path is used, or why not.
    pub fn fast_path(&self) -> std::result::Result<(), &str> {
        self.fast.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// Token ids of `text`, as `tokenizer.encode(text, add_special_tokens=...)` gives them.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        if let Ok(fast) = &self.fast {
            if !add_special_tokens {
                return Ok(fast.encode(text));
            }
            if let Some(ids) = self.add_special_affixes(fast.encode(text)) {
                return Ok(ids);
            }
        }
        self.encode_reference(text, add_special_tokens)
    }

    /// [`Encoder::encode`] through `tokenizers` alone.
    pub fn encode_reference(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .tk
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Ids of `text` without special tokens, and the split points in it.
    pub fn encode_with_splits(&self, text: &str) -> Result<(Vec<u32>, Vec<SplitPoint>)> {
        if let Ok(fast) = &self.fast {
            if let Some(out) = fast.encode_with_splits(text, &self.split_after, self.word_splits) {
                return Ok(out);
            }
        }
        self.encode_with_splits_reference(text)
    }

    /// [`Encoder::encode_with_splits`] through `tokenizers` alone (offsets give the splits).
    pub fn encode_with_splits_reference(&self, text: &str) -> Result<(Vec<u32>, Vec<SplitPoint>)> {
        let enc = self
            .tk
            .encode(text, false)
            .map_err(|e| TokenizeError::Encode(e.to_string()))?;
        let ids = enc.get_ids().to_vec();
        let bytes = text.as_bytes();
        let mut splits = Vec::new();
        let mut last_word = 0;
        let mut prev_end = usize::MAX;
        for (i, (&id, &(start, end))) in ids.iter().zip(enc.get_offsets()).enumerate() {
            // The first token starting right where the previous one ended at a letter-space
            // boundary (tokens of one multibyte char share its range, so "first" matters).
            if self.word_splits
                && start == prev_end
                && start >= last_word + WORD_SPLIT_SPACING
                && bytes.get(start) == Some(&b' ')
                && start
                    .checked_sub(1)
                    .and_then(|p| bytes.get(p))
                    .is_some_and(u8::is_ascii_alphabetic)
            {
                if let (Ok(byte), Ok(token)) = (u32::try_from(start), u32::try_from(i)) {
                    splits.push(SplitPoint {
                        byte,
                        token,
                        word: true,
                    });
                    last_word = start;
                }
            }
            prev_end = end;
            if !self.split_after.get(id as usize).copied().unwrap_or(false) {
                continue;
            }
            // Only where the token really came from its own text (not merged by the model).
            let content_len = self.tk.id_to_token(id).map_or(usize::MAX, |t| t.len());
            if end.saturating_sub(start) == content_len && text.get(start..end).is_some() {
                if let (Ok(byte), Ok(token)) = (u32::try_from(end), u32::try_from(i + 1)) {
                    splits.push(SplitPoint {
                        byte,
                        token,
                        word: false,
                    });
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

    /// How many special tokens [`Encoder::add_special_affixes`] puts in front, when it can.
    pub fn special_prefix_len(&self) -> Option<usize> {
        self.special_affixes.as_ref().map(|(pre, _)| pre.len())
    }

    fn probe_special_affixes(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let mut found: Option<(Vec<u32>, Vec<u32>)> = None;
        for probe in ["a", "Hello world", "x y z 123"] {
            let with = self.encode_reference(probe, true).ok()?;
            let core = self.encode_reference(probe, false).ok()?;
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

#[cfg(test)]
impl Encoder {
    /// The fast path, for tests of its parts.
    pub(crate) fn fast_bpe(&self) -> Option<&FastBpe> {
        self.fast.as_ref().ok()
    }

    /// Every added token's text.
    pub(crate) fn added_contents(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .tk
            .get_added_tokens_decoder()
            .into_values()
            .map(|t| t.content)
            .collect();
        out.sort();
        out
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

/// Normalizers under which a letter followed by a space stays where it is (see the module docs).
fn normalizer_is_word_safe(v: &Json) -> bool {
    normalizer_is_identity(v) || node_type(v) == "NFC"
}

/// Pre-tokenizers that never put an ASCII letter and a following space in one pre-token, and
/// cut the text after such a space as they cut it alone (see the module docs).
fn pre_tokenizer_is_word_safe(v: &Json) -> bool {
    let flag = |node: &Json, key: &str| node.get(key).and_then(Json::as_bool);
    let byte_level = |node: &Json, regex: bool| {
        node_type(node) == "ByteLevel"
            && flag(node, "add_prefix_space") == Some(false)
            && flag(node, "use_regex").unwrap_or(true) == regex
    };
    let safe_split = |node: &Json| {
        node_type(node) == "Split"
            && node.get("behavior").and_then(Json::as_str) == Some("Isolated")
            && flag(node, "invert") == Some(false)
            && node
                .get("pattern")
                .and_then(|p| p.get("Regex"))
                .and_then(Json::as_str)
                .is_some_and(|r| WORD_SAFE_REGEXES.contains(&r))
    };
    if byte_level(v, true) {
        return true;
    }
    if node_type(v) != "Sequence" {
        return false;
    }
    let Some(steps) = v.get("pretokenizers").and_then(Json::as_array) else {
        return false;
    };
    match steps.split_last() {
        Some((last, splits)) => {
            !splits.is_empty() && byte_level(last, false) && splits.iter().all(safe_split)
        }
        None => false,
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

#[cfg(test)]
mod tests {
    // Test code: a failed unwrap is a failed test with its message.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn load(name: &str) -> Encoder {
        let path = kinference_testkit::shared("data/tokenizers")
            .join(name)
            .join("tokenizer.json");
        Encoder::from_file(&path).unwrap()
    }

    /// Every recorded split point, of either kind, cuts the ids exactly where encoding the two
    /// halves on their own would; the text is heavy in multibyte chars so that byte offsets
    /// and char offsets differ everywhere.
    #[test]
    fn split_points_cut_ids_exactly() {
        const PIECES: &[&str] = &[
            "word",
            "Ab",
            "z",
            " ",
            " ",
            "  ",
            "\n",
            "é",
            "日本",
            "😀",
            "e\u{301}",
            "'s",
            "12",
            ".",
            "<|im_end|>",
            "<|eot_id|>",
            "<|endoftext|>",
            "ß",
            "\u{212A}",
            "\t",
        ];
        for name in ["gpt2", "llama3", "qwen3", "deepseek-v3", "mistral-v3"] {
            let enc = load(name);
            assert_eq!(enc.word_splits, name != "mistral-v3", "{name}");
            let mut rng = ChaCha8Rng::seed_from_u64(11);
            let mut words = 0;
            for _ in 0..40 {
                let mut text = String::new();
                while text.len() < 1500 {
                    text.push_str(PIECES[rng.gen_range(0..PIECES.len())]);
                }
                let (ids, splits) = enc.encode_with_splits(&text).unwrap();
                assert_eq!(ids, enc.encode(&text, false).unwrap(), "{name}");
                let mut last_word = 0;
                for sp in splits {
                    let (b, t) = (sp.byte as usize, sp.token as usize);
                    assert_eq!(
                        ids[..t],
                        enc.encode(&text[..b], false).unwrap()[..],
                        "{name}"
                    );
                    assert_eq!(
                        ids[t..],
                        enc.encode(&text[b..], false).unwrap()[..],
                        "{name}"
                    );
                    if sp.word {
                        assert!(b >= last_word + WORD_SPLIT_SPACING, "{name}: too dense");
                        last_word = b;
                        words += 1;
                    }
                }
            }
            assert_eq!(words > 0, enc.word_splits, "{name}: {words} word splits");
        }
    }
}
