//! What the encoder and the fast path share: the pre-tokenizer regexes both know by heart
//! (the encoder proves word splits safe for them, the fast path implements them) and the split
//! points of a tokenized text that the prefix cache restarts from.

/// A place where tokenization may restart: `ids[..token]` are exactly the ids of
/// `text[..byte]`, and the rest are those of `text[byte..]` on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SplitPoint {
    pub byte: u32,
    pub token: u32,
    /// A word split (see the `encoder` module) rather than the end of an added token.
    pub word: bool,
}

/// Word split points are kept at least this many bytes apart: a restart at a word split
/// re-encodes about this much shared text plus the word the texts part in, and an entry of a
/// 4 kB prompt holds some 250 of them (12 bytes each). 64 cost the router-latency workload's
/// completions prompts ~40 more bytes of encoding per request (criterion `llama3_plain`).
pub(crate) const WORD_SPLIT_SPACING: usize = 16;

/// llama3 / llama3.1 (cl100k-style): letters only after the optional non-letter first char.
pub(crate) const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// qwen2 / qwen3: the same with single digits.
pub(crate) const QWEN_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// deepseek-v3, stage 1: digit runs; never a letter or a space.
pub(crate) const DEEPSEEK_DIGITS_REGEX: &str = r"\p{N}{1,3}";
/// deepseek-v3, stage 2: CJK runs; never a letter or a space.
pub(crate) const DEEPSEEK_CJK_REGEX: &str =
    "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+";
/// deepseek-v3, stage 3: after a letter only ASCII letters or letters/marks follow.
pub(crate) const DEEPSEEK_WORD_REGEX: &str = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";
