//! Word split points (a letter then a space, in plain text) against full tokenization, on every
//! tokenizer: the split invariant itself at every such boundary of adversarial and real text,
//! then the prefix cache with texts that share prefixes cut at adversarial places. Seeded and
//! deterministic; a failure prints the tokenizer, seed and text.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kinference_tokenize::Tokenizer;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::*;

/// Every tokenizer, and whether word splits must be on for it (see the encoder's docs).
const ALL: [(&str, bool); 9] = [
    ("gpt2", true),
    ("@tiny", true),
    ("llama3", true),
    ("llama3.1", true),
    ("qwen2", true),
    ("qwen3", true),
    ("deepseek-v3", true),
    ("mistral-v1", false),
    ("mistral-v3", false),
];

const WORDS: &[&str] = &[
    "the",
    "a",
    "I",
    "x",
    "Hello",
    "world",
    "don",
    "it",
    "is",
    "s",
    "t",
    "re",
    "ll",
    "QWERTY",
    "Zebra",
    "ab",
    "zz",
    "Iñtërnâtiônàl",
    "naïve",
    "straße",
];

/// Pieces that stress the regexes, normalizers and added-token matching around a boundary.
const ODD: &[&str] = &[
    " ",
    " ",
    " ",
    "  ",
    "   ",
    "\t",
    " \t",
    "\n",
    "\r\n",
    "\n\n",
    " \n",
    "\r",
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "'S",
    "'LL",
    "’s",
    "'",
    "''",
    "1",
    "12",
    "123",
    "12345",
    "3.14",
    ".",
    ",",
    "!?",
    "...",
    "--",
    "(",
    ")",
    "\"",
    "#",
    "@",
    "_",
    "é",
    "ß",
    "ñ",
    "Ω",
    "ж",
    "e\u{301}",
    "\u{301}",
    "\u{308}",
    " \u{301}",
    "\u{0627}\u{0644}",
    "日本語",
    "中文",
    "ひらがな",
    "カタカナ",
    "한국어",
    "\u{1100}\u{1161}\u{11A8}",
    "😀",
    "👍🏽",
    "👨\u{200D}👩\u{200D}👧",
    "\u{200D}",
    "\u{00A0}",
    "\u{3000}",
    "\u{2028}",
    "\u{212A}",
    "ſ",
    "ﬆ",
    "▁",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<s>",
    "</s>",
    "[INST]",
    "<|im_start",
    "<｜User｜>",
    "<｜end▁of▁sentence｜>",
    "<|reserved_special_token_5|>",
    "<",
    "|>",
];

/// Random text, mostly words separated by single spaces (so word boundaries abound), with odd
/// pieces mixed in.
fn random_text(rng: &mut ChaCha8Rng, len: usize) -> String {
    let mut s = String::new();
    while s.len() < len {
        if rng.gen_bool(0.6) {
            s.push_str(WORDS[rng.gen_range(0..WORDS.len())]);
            if rng.gen_bool(0.7) {
                s.push(' ');
            }
        } else {
            s.push_str(ODD[rng.gen_range(0..ODD.len())]);
        }
    }
    s
}

/// Byte positions `b` with an ASCII letter at `b - 1` and a space at `b`.
fn word_boundaries(s: &str) -> Vec<usize> {
    let b = s.as_bytes();
    (1..b.len())
        .filter(|&i| b[i] == b' ' && b[i - 1].is_ascii_alphabetic())
        .collect()
}

/// A cut point, half the time right around a word boundary (where a wrong restart would show).
fn cut_point(rng: &mut ChaCha8Rng, s: &str) -> usize {
    let wb = word_boundaries(s);
    let mut at = if !wb.is_empty() && rng.gen_bool(0.5) {
        let b = wb[rng.gen_range(0..wb.len())] as i64 + rng.gen_range(-2i64..=3);
        b.clamp(0, s.len() as i64) as usize
    } else {
        rng.gen_range(0..=s.len())
    };
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// `encode(S[..b]) ++ encode(S[b..]) == encode(S)` at every word boundary `b` of `text`;
/// returns how many boundaries were checked and how many broke the invariant.
fn check_boundaries(tok: &Tokenizer, text: &str, limit: usize) -> (usize, usize) {
    let whole = tok.encode_uncached(text, false).unwrap();
    let (mut checked, mut broken) = (0, 0);
    for b in word_boundaries(text).into_iter().take(limit) {
        let mut joined = tok.encode_uncached(&text[..b], false).unwrap();
        joined.extend(tok.encode_uncached(&text[b..], false).unwrap());
        checked += 1;
        broken += usize::from(joined != whole);
    }
    (checked, broken)
}

/// The invariant word splits rest on, checked directly (no cache) at every boundary: it must
/// hold for every tokenizer with word splits, and it does fail for the excluded ones (which is
/// why they are excluded).
#[test]
fn every_word_boundary_splits_exactly() {
    let convs = sharegpt();
    std::thread::scope(|s| {
        for (k, (name, word)) in ALL.iter().enumerate() {
            let convs = &convs;
            s.spawn(move || {
                let tok = load(name, 0);
                assert_eq!(
                    tok.word_splits_supported(),
                    *word,
                    "{name}: word splits should be {}",
                    if *word { "on" } else { "off" }
                );
                let mut rng = ChaCha8Rng::seed_from_u64(3000 + k as u64);
                let (mut checked, mut broken) = (0, 0);
                for i in 0..120 {
                    let len = rng.gen_range(20..400);
                    let text = random_text(&mut rng, len);
                    let (c, b) = check_boundaries(&tok, &text, usize::MAX);
                    assert!(
                        !*word || b == 0,
                        "{name}: text {i} splits wrongly at a word boundary: {text:?}"
                    );
                    checked += c;
                    broken += b;
                }
                for (i, conv) in convs.iter().step_by(97).take(30).enumerate() {
                    let text: String = conv.iter().map(|(_, t)| t.as_str()).collect();
                    let (c, b) = check_boundaries(&tok, &text, 60);
                    assert!(
                        !*word || b == 0,
                        "{name}: ShareGPT text {i} splits wrongly at a word boundary"
                    );
                    checked += c;
                    broken += b;
                }
                assert!(checked > 3000, "{name}: only {checked} boundaries");
                assert!(
                    *word || broken > 0,
                    "{name}: the invariant never failed; word splits might be safe after all"
                );
                println!("{name}: {checked} word boundaries checked, {broken} not exact");
            });
        }
    });
}

/// Texts sharing prefixes cut at adversarial places, through a hot cache: every result equals
/// full tokenization, and the tokenizers with word splits do restart at them.
#[test]
fn adversarial_shared_prefixes_equal_full_tokenization() {
    std::thread::scope(|s| {
        for (k, (name, word)) in ALL.iter().enumerate() {
            s.spawn(move || {
                let tok = load(name, 64 << 20);
                let seed = 4000 + k as u64;
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut pool: Vec<String> = Vec::new();
                let mut checks = 0u64;
                for step in 0..500 {
                    let text = if pool.is_empty() || rng.gen_bool(0.1) {
                        let len = rng.gen_range(256..3000);
                        random_text(&mut rng, len)
                    } else {
                        let base = &pool[rng.gen_range(0..pool.len())];
                        let cut = cut_point(&mut rng, base);
                        let mut t = base[..cut].to_string();
                        let more = rng.gen_range(0..300);
                        t.push_str(&random_text(&mut rng, more));
                        while t.len() < 256 {
                            t.push_str(&random_text(&mut rng, 64));
                        }
                        t
                    };
                    for attempt in 0..1 + usize::from(rng.gen_bool(0.1)) {
                        let add = rng.gen_bool(0.5);
                        let want = tok.encode_uncached(&text, add).unwrap();
                        let got = tok.encode_text(&text, add).unwrap();
                        assert!(
                            got == want,
                            "{name} seed {seed} step {step} attempt {attempt}: cached ids differ \
                             for {text:?}"
                        );
                        checks += 1;
                    }
                    pool.push(text);
                    if pool.len() > 12 {
                        pool.remove(0);
                    }
                }
                assert_word_split_use(&tok, name, *word, checks, "adversarial");
            });
        }
    });
}

/// ShareGPT conversations as one growing plain prompt (random cut points, sometimes a branch
/// that continues with another conversation), through a hot cache.
#[test]
fn growing_sharegpt_prompts_equal_full_tokenization() {
    let convs = sharegpt();
    std::thread::scope(|s| {
        for (k, (name, word)) in ALL.iter().enumerate() {
            let convs = &convs;
            s.spawn(move || {
                let tok = load(name, 64 << 20);
                let seed = 5000 + k as u64;
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let mut checks = 0u64;
                for round in 0..12 {
                    let conv = &convs[rng.gen_range(0..convs.len())];
                    let full: String = conv.iter().map(|(_, t)| format!("{t}\n\n")).collect();
                    let full = &full[..(0..=full.len().min(30_000))
                        .rev()
                        .find(|&i| full.is_char_boundary(i))
                        .unwrap()];
                    let mut cut = 0;
                    while cut < full.len() {
                        cut = (cut + rng.gen_range(1..1500)).min(full.len());
                        while !full.is_char_boundary(cut) {
                            cut += 1;
                        }
                        let mut prompt = full[..cut].to_string();
                        if rng.gen_bool(0.2) {
                            let other = &convs[rng.gen_range(0..convs.len())];
                            let t = &other[0].1;
                            let end = (0..=t.len().min(400))
                                .rev()
                                .find(|&i| t.is_char_boundary(i))
                                .unwrap();
                            prompt.push_str(&t[..end]);
                        }
                        let add = rng.gen_bool(0.5);
                        let want = tok.encode_uncached(&prompt, add).unwrap();
                        let got = tok.encode_text(&prompt, add).unwrap();
                        assert!(
                            got == want,
                            "{name} seed {seed} round {round}: cached ids differ (len {})",
                            prompt.len()
                        );
                        checks += 1;
                    }
                }
                assert_word_split_use(&tok, name, *word, checks, "ShareGPT");
            });
        }
    });
}

/// The cache must have restarted at word splits often (so a passing run is not vacuous) where
/// they are on, and never where they are off.
fn assert_word_split_use(tok: &Tokenizer, name: &str, word: bool, checks: u64, what: &str) {
    let st = tok.cache_stats();
    if word {
        assert!(
            st.word_split_hits >= checks / 8,
            "{name}: too few word-split restarts: {checks} checks, {st:?}"
        );
    } else {
        assert_eq!(st.word_split_hits, 0, "{name}: {st:?}");
    }
    println!("{name}: {checks} {what} checks, {st:?}");
}
