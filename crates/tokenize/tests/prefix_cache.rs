//! The prefix cache against full tokenization: seeded random multi-turn conversations from
//! ShareGPT (turn after turn, retries, edited history, dropped turns) on every tokenizer, plus
//! completions prompts that grow, with special tokens spliced in. Every cached result must equal
//! encoding the whole text; a failure prints the seed, tokenizer and step.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use kinference_tokenize::{ChatMessage, ChatRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::*;

const CHAT_DIRS: [&str; 4] = ["llama3", "qwen3", "deepseek-v3", "llama3.1"];
const ALL_DIRS: [&str; 9] = [
    "llama3",
    "llama3.1",
    "qwen2",
    "qwen3",
    "deepseek-v3",
    "gpt2",
    "mistral-v1",
    "mistral-v3",
    "@tiny",
];

fn request(msgs: &[(bool, String)], system: Option<&str>) -> ChatRequest<'static> {
    let mut m: Vec<ChatMessage> = system
        .map(|s| ChatMessage::text("system", s))
        .into_iter()
        .collect();
    m.extend(
        msgs.iter()
            .map(|(h, t)| ChatMessage::text(if *h { "user" } else { "assistant" }, t)),
    );
    ChatRequest::from_messages(m)
}

/// Plays conversations turn by turn through a cached tokenizer and checks each result.
fn play_chats(name: &str, seed: u64, convs: &[Vec<(bool, String)>], capacity: usize) -> (u64, u64) {
    let tok = load(name, capacity);
    assert!(
        tok.prefix_cache_supported(),
        "{name}: the cache should apply"
    );
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut checks = 0;
    for step in 0..40 {
        let conv = &convs[rng.gen_range(0..convs.len())];
        let system = rng
            .gen_bool(0.5)
            .then_some(SYSTEM_PROMPTS[rng.gen_range(0..3)]);
        let mut history: Vec<(bool, String)> = Vec::new();
        for (i, turn) in conv.iter().enumerate() {
            history.push(turn.clone());
            if !turn.0 {
                continue;
            }
            let mut msgs = history.clone();
            match rng.gen_range(0..10) {
                // Edit an earlier message (a branch): the cache must not reuse past the edit.
                0 if i > 1 => {
                    let j = rng.gen_range(0..i);
                    let text = &mut msgs[j].1;
                    let mid = (0..=text.len() / 2)
                        .rev()
                        .find(|&m| text.is_char_boundary(m))
                        .unwrap_or(0);
                    text.insert_str(mid, " <|im_end|> edited ");
                }
                // Drop the last exchange (a shorter conversation than the cached one).
                1 if msgs.len() > 3 => msgs.truncate(msgs.len() - 2),
                _ => {}
            }
            let req = request(&msgs, system);
            let want = tok
                .encode_uncached(&tok.render_chat(&req).unwrap(), false)
                .unwrap();
            for attempt in 0..1 + usize::from(rng.gen_bool(0.2)) {
                let got = tok.encode_chat(&req).unwrap();
                assert!(
                    got == want,
                    "{name} seed {seed} step {step} turn {i} attempt {attempt}: cached ids differ"
                );
                checks += 1;
            }
        }
    }
    let stats = tok.cache_stats();
    assert!(
        stats.hits > 0,
        "{name}: the cache was never used: {stats:?}"
    );
    assert!(
        capacity == 0 || stats.bytes <= capacity as u64,
        "{name}: over capacity: {stats:?}"
    );
    (checks, stats.hits)
}

#[test]
fn chat_turns_equal_full_tokenization() {
    let convs = sharegpt();
    std::thread::scope(|s| {
        for (k, name) in CHAT_DIRS.iter().enumerate() {
            let convs = &convs;
            s.spawn(move || {
                let (checks, hits) = play_chats(name, 1000 + k as u64, convs, 64 << 20);
                println!("{name}: {checks} chat checks, {hits} cache hits");
            });
        }
    });
}

#[test]
fn small_cache_evicts_and_stays_exact() {
    let convs = sharegpt();
    let (checks, hits) = play_chats("qwen3", 7, &convs, 40_000);
    println!("qwen3 with a 40 kB cache: {checks} checks, {hits} hits");
}

/// Completions prompts that grow by appending text, with special tokens of the tokenizer and
/// look-alikes spliced in at random places (they are where the cache restarts).
#[test]
fn growing_prompts_equal_full_tokenization() {
    let convs = sharegpt();
    std::thread::scope(|s| {
        for (k, name) in ALL_DIRS.iter().enumerate() {
            let convs = &convs;
            s.spawn(move || {
                let tok = load(name, 32 << 20);
                let mut rng = ChaCha8Rng::seed_from_u64(2000 + k as u64);
                let specials = [
                    "<|im_start|>",
                    "<|im_end|>",
                    "<|eot_id|>",
                    "<|begin_of_text|>",
                    "<s>",
                    "</s>",
                    "<|endoftext|>",
                    "<｜User｜>",
                    "<|im_start",
                    " ",
                    "\n\n",
                    "é",
                ];
                let mut checks = 0;
                for round in 0..30 {
                    let conv = &convs[rng.gen_range(0..convs.len())];
                    let mut prompt = String::new();
                    for (_, text) in conv {
                        let cut = text
                            .char_indices()
                            .nth(rng.gen_range(0..=text.chars().count().min(600)));
                        prompt.push_str(&text[..cut.map_or(text.len(), |(i, _)| i)]);
                        prompt.push_str(specials[rng.gen_range(0..specials.len())]);
                        let add = rng.gen_bool(0.5);
                        let want = tok.encode_uncached(&prompt, add).unwrap();
                        let got = tok.encode_text(&prompt, add).unwrap();
                        assert!(
                            got == want,
                            "{name} round {round}: cached ids differ (len {})",
                            prompt.len()
                        );
                        checks += 1;
                    }
                }
                println!("{name}: {checks} prompt checks, {:?}", tok.cache_stats());
            });
        }
    });
}

/// Prompts that share a cached prompt exactly up to a letter-space boundary, or one or two
/// bytes past it, then go on with text that could glue onto the shared part ("s", "'s", digits,
/// an added token, more spaces): the tightest cases of the restart rule, where a word split
/// point may sit right before the divergence.
#[test]
fn prompts_diverging_at_a_word_boundary_equal_full_tokenization() {
    let convs = sharegpt();
    let bases: Vec<String> = convs
        .iter()
        .flatten()
        .map(|(_, t)| t)
        .filter(|t| t.len() >= 1200 && t.is_char_boundary(1200))
        .take(6)
        .map(|t| t[..1200].to_string())
        .collect();
    assert_eq!(
        bases.len(),
        6,
        "ShareGPT should hold 6 texts of 1,200 bytes"
    );
    let tails = [
        "s and more",
        "'s own",
        "12 34",
        "<|eot_id|>x",
        "<|im_end|> y",
        "  two",
        "\nnew line",
        "é accent",
        "-dash",
        "S capital",
        " ",
        "x",
    ];
    std::thread::scope(|s| {
        for (k, name) in ALL_DIRS.iter().enumerate() {
            let (bases, tails) = (&bases, &tails);
            s.spawn(move || {
                let tok = load(name, 32 << 20);
                let mut rng = ChaCha8Rng::seed_from_u64(3000 + k as u64);
                let mut checks = 0;
                for (case, base) in bases.iter().cycle().take(150).enumerate() {
                    // A first line no other case has: the cached `base` is the only match.
                    let base = format!("Case {case}.\n{base}");
                    tok.encode_text(&base, false).unwrap();
                    let b = base.as_bytes();
                    let spaces: Vec<usize> = (300..b.len())
                        .filter(|&i| b[i] == b' ' && b[i - 1].is_ascii_alphabetic())
                        .collect();
                    let at = spaces[rng.gen_range(0..spaces.len())];
                    let cut = at + rng.gen_range(0..3);
                    let cut = if base.is_char_boundary(cut) { cut } else { at };
                    let tail = tails[rng.gen_range(0..tails.len())];
                    let prompt = format!("{}{tail}", &base[..cut]);
                    let want = tok.encode_uncached(&prompt, false).unwrap();
                    let got = tok.encode_text(&prompt, false).unwrap();
                    assert!(
                        got == want,
                        "{name}: cached ids differ for a prompt cut at byte {cut} + {tail:?}"
                    );
                    checks += 1;
                }
                let stats = tok.cache_stats();
                // Word splits are the restart points under test wherever the tokenizer has them.
                if !name.starts_with("mistral") {
                    assert!(stats.word_split_hits >= 100, "{name}: {stats:?}");
                }
                println!("{name}: {checks} checks, {stats:?}");
            });
        }
    });
}

/// What a caller attaches to a cache entry comes back with a later request that reuses the
/// entry's ids, for as many leading ids as the entry gave; it counts against the capacity; an
/// entry that left the cache takes nothing.
#[test]
fn attachments_come_back_with_the_ids_they_were_made_from() {
    let t = load("qwen3", 1 << 20);
    let history = "Tell me about the history of tea in detail. ".repeat(20);
    let first = request(&[(true, history.clone())], Some("Be brief."));
    let (ids1, reuse1) = t.encode_chat_reuse(&first).unwrap();
    assert!(reuse1.from.is_none());
    let stored = reuse1.stored.expect("a long text is stored");
    let before = t.cache_stats().bytes;
    t.attach(&stored, Box::new(ids1.to_vec()), 10_000);
    assert_eq!(t.cache_stats().bytes, before + 10_000);
    // A second attachment is refused: the first stays.
    t.attach(&stored, Box::new(Vec::<u32>::new()), 5);
    assert_eq!(t.cache_stats().bytes, before + 10_000);

    let next = request(
        &[
            (true, history.clone()),
            (false, "Tea came from China. ".repeat(10)),
            (true, "More?".into()),
        ],
        Some("Be brief."),
    );
    let (ids2, reuse2) = t.encode_chat_reuse(&next).unwrap();
    let (entry, n) = reuse2.from.expect("the first turn's entry is reused");
    let attached = entry
        .attached()
        .and_then(|a| a.downcast_ref::<Vec<u32>>())
        .unwrap();
    assert_eq!(attached, &*ids1);
    assert!(n > 0 && n <= ids1.len());
    assert_eq!(ids2[..n], ids1[..n]);
    assert_eq!(
        *ids2,
        t.encode_uncached(&t.render_chat(&next).unwrap(), false)
            .unwrap()
    );

    // The second turn's entry took the place of the first's (it extends it); repeating the
    // second turn exactly hands that entry back, whole, as both `from` and `stored`, and its
    // ids are the ones the second turn got (shared, not copied).
    let stored2 = reuse2.stored.unwrap();
    t.attach(&stored2, Box::new(7u64), 100);
    let (ids3, reuse3) = t.encode_chat_reuse(&next).unwrap();
    let (entry, n) = reuse3.from.unwrap();
    assert_eq!((ids3.len(), n), (ids2.len(), ids2.len()));
    assert!(Arc::ptr_eq(&ids3, &ids2));
    assert_eq!(
        entry.attached().and_then(|a| a.downcast_ref::<u64>()),
        Some(&7)
    );
    assert!(reuse3.stored.unwrap().attached().is_some());

    // A cache too small to keep the entry once something is attached drops it.
    let small = load("qwen3", 20_000);
    let (_, r) = small.encode_chat_reuse(&first).unwrap();
    let stored = r.stored.unwrap();
    small.attach(&stored, Box::new(0u8), 30_000);
    assert_eq!(small.cache_stats().entries, 0);
    small.attach(&stored, Box::new(0u8), 1);
    assert_eq!(small.cache_stats().bytes, 0);
}

/// A request that adds only a short tail to a cached one reuses it without becoming an entry
/// itself; one that adds more is stored, and both stay exact, as does a later request extending
/// the unstored one (it restarts from the entry that is there).
#[test]
fn short_tails_reuse_without_being_stored() {
    let t = load("qwen3", 1 << 20);
    let doc = "The tea plant grows best on high, wet slopes in warm weather. ".repeat(60);
    let turns = |n: usize| {
        let mut msgs = vec![(true, doc.clone())];
        for k in 0..n {
            msgs.push((false, format!("Answer {k}.")));
            msgs.push((true, format!("Question {k}?")));
        }
        request(&msgs, None)
    };
    let exact = |req: &ChatRequest, ids: &[u32]| {
        let text = t.render_chat(req).unwrap();
        assert_eq!(ids, t.encode_uncached(&text, false).unwrap());
    };
    let (_, first) = t.encode_chat_reuse(&turns(0)).unwrap();
    assert!(first.stored.is_some() && first.from.is_none());
    let entries = t.cache_stats().entries;

    // Each turn adds ~60 bytes: the first two are not stored and restart from the first
    // entry; by the third the tail since that entry is long enough to be stored.
    for n in 1..=2 {
        let req = turns(n);
        let (ids, r) = t.encode_chat_reuse(&req).unwrap();
        exact(&req, &ids);
        let (_, reused) = r.from.expect("the first turn's entry is reused");
        assert!(
            reused > 0 && r.stored.is_none(),
            "turn {n}: a short tail is stored"
        );
        assert_eq!(t.cache_stats().entries, entries);
    }
    let mut n = 3;
    loop {
        let req = turns(n);
        let (ids, r) = t.encode_chat_reuse(&req).unwrap();
        exact(&req, &ids);
        assert!(r.from.is_some());
        if r.stored.is_some() {
            break;
        }
        n += 1;
        assert!(n < 8, "a tail of {n} turns is still not stored");
    }
}

/// The counters a router exports: every byte of a looked-up text is counted once, as reused,
/// encoded on a hit or encoded on a miss; texts too short for a lookup are not counted.
#[test]
fn every_looked_up_byte_is_counted_once() {
    let t = load("qwen3", 1 << 20);
    let doc = "The tea plant grows best on high, wet slopes in warm weather. ".repeat(20);
    let other = "Coffee beans are the seeds of a cherry that ripens in the tropics. ".repeat(20);
    let texts = [
        doc.clone(),                                              // miss, stored
        format!("{doc}Why?"),                                     // hit, short tail: not stored
        doc.clone(), // exact repeat: hit, nothing encoded
        format!("{doc}{}", "And where is it grown? ".repeat(20)), // hit, stored
        other.clone(), // miss
        "Too short for a lookup.".to_owned(), // not looked up
    ];
    let mut looked_up = 0u64;
    for text in &texts {
        assert_eq!(
            t.encode_text(text, false).unwrap(),
            t.encode_uncached(text, false).unwrap()
        );
        if text.len() >= 256 {
            looked_up += text.len() as u64;
        }
    }
    let s = t.cache_stats();
    assert_eq!((s.hits, s.misses), (3, 2), "{s:?}");
    assert_eq!(
        s.bytes_encoded_on_misses,
        (doc.len() + other.len()) as u64,
        "{s:?}"
    );
    assert_eq!(
        s.bytes_reused + s.bytes_encoded_on_hits + s.bytes_encoded_on_misses,
        looked_up,
        "{s:?}"
    );
    // The repeat reused all of `doc`; the two extensions reused most of it.
    assert!(s.bytes_reused > 2 * doc.len() as u64, "{s:?}");
    assert!(s.bytes_encoded_on_hits < 600, "{s:?}");
}
