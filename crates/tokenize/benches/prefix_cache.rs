//! A new turn of a long conversation: ~100k tokens of ShareGPT history (qwen3 and llama3
//! tokenizers) plus ~1k new tokens, through the prefix cache, against full tokenization.
//! Two different new turns alternate, so every iteration reuses the long prefix and encodes
//! the new part (the cache holds the previous one, never the same text).
//!
//! Also a plain completions prompt (no special tokens in it): one of 8 shared ~4,000-character
//! prefixes plus a ~100-character suffix no request repeats, as the router-latency benchmark
//! sends them, with the cache on and off, and the cache's miss path (a text it has no prefix of).
//!
//! And full tokenization of a ~2 kB and a ~4 kB text, reference pipeline against the fast path
//! (`bench_encode`).
//!
//! Run: `cargo bench -p kinference-tokenize --bench prefix_cache` (one group: append
//! `-- encode_`).

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Read;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use kinference_testkit::shared_dir;
use kinference_tokenize::{ChatMessage, ChatRequest, MessageContent, Tokenizer, TokenizerOptions};

// The kinference binary's allocator: with glibc's, a heap holding hundreds of MiB of cache
// entries makes the tokenizer's many small allocations markedly slower (perf: malloc and free
// took ~40% of a cache hit), which the router does not see.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn content_text(m: &ChatMessage<'_>) -> String {
    match &m.content {
        Some(MessageContent::Text(t)) => t.to_string(),
        _ => String::new(),
    }
}

fn sharegpt_texts() -> Vec<String> {
    let path = shared_dir().join("data/traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz");
    let mut text = String::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_string(&mut text)
        .unwrap();
    text.lines()
        .flat_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["value"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// History of about `tokens` tokens (alternating user/assistant), then two different new turns
/// (an assistant reply and a user message, about 1k tokens together).
fn conversations(
    tok: &Tokenizer,
    texts: &[String],
    tokens: usize,
) -> (
    ChatRequest<'static>,
    ChatRequest<'static>,
    ChatRequest<'static>,
) {
    let mut msgs = vec![ChatMessage::text("system", "You are a helpful assistant.")];
    let mut it = texts.iter();
    let mut approx = 0;
    while approx < tokens {
        let t = it.next().unwrap();
        let role = if msgs.len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        approx += t.len() / 4;
        msgs.push(ChatMessage::text(role, t));
    }
    if msgs.len() % 2 == 0 {
        msgs.push(ChatMessage::text("user", "Go on."));
    }
    let base = ChatRequest::from_messages(msgs.clone());
    let turn = |a: &str, b: &str| {
        let mut m = msgs.clone();
        m.push(ChatMessage::text("assistant", a));
        m.push(ChatMessage::text("user", b));
        ChatRequest::from_messages(m)
    };
    let new: Vec<&String> = it.filter(|t| t.len() > 2200).take(4).collect();
    let cut = |s: &str| {
        s.char_indices()
            .nth(2000)
            .map_or(s.to_string(), |(i, _)| s[..i].to_string())
    };
    let (b1, b2) = (
        turn(&cut(new[0]), &cut(new[1])),
        turn(&cut(new[2]), &cut(new[3])),
    );
    let n0 = tok.encode_chat(&base).unwrap().len();
    let n1 = tok.encode_chat(&b1).unwrap().len();
    let n2 = tok.encode_chat(&b2).unwrap().len();
    println!(
        "history {n0} tokens; new turns +{} / +{} tokens",
        n1 - n0,
        n2 - n0
    );
    (base, b1, b2)
}

fn bench(c: &mut Criterion) {
    let texts = sharegpt_texts();
    for name in ["qwen3", "llama3"] {
        let tok = Tokenizer::from_dir(shared_dir().join("data/tokenizers").join(name)).unwrap();
        let (base, b1, b2) = conversations(&tok, &texts, 100_000);
        let t1 = tok.render_chat(&b1).unwrap();
        let mut g = c.benchmark_group(format!("{name}_100k_plus_1k"));
        g.sample_size(50);

        // The history is in the cache (as after serving turn N); each iteration serves a turn
        // N+1 the cache has not seen (a counter in the new user message), so it reuses the
        // history and encodes the new turn. Building the input is not timed.
        tok.encode_chat(&base).unwrap();
        let n = std::cell::Cell::new(0u64);
        let fresh = |req: &ChatRequest<'static>| {
            n.set(n.get() + 1);
            let n = n.get();
            let mut r = req.clone();
            if let Some(last) = r.messages.last_mut() {
                last.content = Some(MessageContent::Text(
                    format!("(turn {n}) {}", content_text(last)).into(),
                ));
            }
            r
        };
        g.bench_function("encode_text_cached", |b| {
            b.iter_batched(
                || {
                    tok.render_chat(&fresh(if n.get().is_multiple_of(2) { &b1 } else { &b2 }))
                        .unwrap()
                },
                |text| tok.encode_text_reuse(&text, false).unwrap(),
                BatchSize::LargeInput,
            )
        });
        g.bench_function("encode_chat_cached", |b| {
            b.iter_batched(
                || fresh(if n.get().is_multiple_of(2) { &b1 } else { &b2 }),
                |req| tok.encode_chat_reuse(&req).unwrap(),
                BatchSize::LargeInput,
            )
        });
        g.bench_function("render_chat", |b| b.iter(|| tok.render_chat(&b1).unwrap()));
        g.bench_function("encode_chat_exact_repeat", |b| {
            b.iter(|| tok.encode_chat_reuse(&b1).unwrap())
        });
        g.sample_size(10);
        g.bench_function("encode_text_uncached", |b| {
            b.iter(|| tok.encode_uncached(&t1, false).unwrap())
        });
        g.finish();
        println!("{name}: {:?}", tok.cache_stats());
    }
}

/// 8 plain prompts of about 4,000 characters (ShareGPT texts joined by blank lines).
fn plain_prefixes(texts: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = texts
        .iter()
        .filter(|t| !t.contains("<|") && !t.contains("<s>"));
    for _ in 0..8 {
        let mut p = String::new();
        while p.len() < 4000 {
            p.push_str(it.next().unwrap());
            p.push_str("\n\n");
        }
        let end = (0..=4000).rev().find(|&i| p.is_char_boundary(i)).unwrap();
        p.truncate(end);
        out.push(p);
    }
    out
}

fn bench_plain(c: &mut Criterion) {
    let texts = sharegpt_texts();
    let prefixes = plain_prefixes(&texts);
    for name in ["qwen3", "llama3"] {
        let mut g = c.benchmark_group(format!("{name}_plain_4k_plus_100"));
        for (label, capacity) in [("cache_on", 256usize << 20), ("cache_off", 0)] {
            let tok = Tokenizer::from_dir_with(
                shared_dir().join("data/tokenizers").join(name),
                TokenizerOptions {
                    cache_capacity_bytes: capacity,
                    ..TokenizerOptions::default()
                },
            )
            .unwrap();
            // Every prefix has been served once, with its own suffix, before timing starts.
            for (i, p) in prefixes.iter().enumerate() {
                tok.encode_text(&format!("{p} warm-up request {i}"), true)
                    .unwrap();
            }
            let n = std::cell::Cell::new(0u64);
            g.bench_function(label, |b| {
                b.iter_batched(
                    || {
                        n.set(n.get() + 1);
                        let n = n.get();
                        format!(
                            "{} Request {n}: summarize the text above in three short bullet points, \
                             then list open questions.",
                            prefixes[(n % 8) as usize]
                        )
                    },
                    |text| tok.encode_text(&text, true).unwrap(),
                    BatchSize::SmallInput,
                )
            });
            if capacity > 0 {
                // A text no entry shares a first block with: the whole miss path (full
                // encode with offsets, split points, insert and eviction).
                g.bench_function("cache_on_miss", |b| {
                    b.iter_batched(
                        || {
                            n.set(n.get() + 1);
                            let n = n.get();
                            format!("Request {n}. {}", prefixes[(n % 8) as usize])
                        },
                        |text| tok.encode_text(&text, true).unwrap(),
                        BatchSize::SmallInput,
                    )
                });
            }
            println!("{name} {label}: {:?}", tok.cache_stats());
        }
        g.finish();
    }
}

/// Full tokenization of one text, no cache: a ~2 kB ShareGPT message and a ~4,000-character
/// prompt (as `plain_prefixes`), through `tokenizers` directly (`encode` with offsets and
/// `encode_fast`), the crate's reference path (`encode_reference`: `encode_fast` plus the id
/// copy) and the crate's default path (`encode_uncached`: the byte-level BPE fast path where the
/// tokenizer has one).
fn bench_encode(c: &mut Criterion) {
    let texts = sharegpt_texts();
    let chat = texts
        .iter()
        .find(|t| (1900..=2100).contains(&t.len()) && !t.contains("<|"))
        .unwrap()
        .clone();
    let prose = plain_prefixes(&texts).swap_remove(0);
    for name in ["llama3.1", "qwen3", "deepseek-v3"] {
        let dir = shared_dir().join("data/tokenizers").join(name);
        let hf = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let tok = Tokenizer::from_dir_with(
            &dir,
            TokenizerOptions {
                cache_capacity_bytes: 0,
                ..TokenizerOptions::default()
            },
        )
        .unwrap();
        println!("{name}: fast path {:?}", tok.fast_path());
        let mut g = c.benchmark_group(format!("encode_{name}"));
        for (label, text) in [("sharegpt_2k", &chat), ("prose_4k", &prose)] {
            assert_eq!(
                tok.encode_uncached(text, false).unwrap(),
                tok.encode_reference(text, false).unwrap()
            );
            g.bench_function(format!("{label}/hf_encode_offsets"), |b| {
                b.iter(|| hf.encode(text.as_str(), false).unwrap())
            });
            g.bench_function(format!("{label}/hf_encode_fast"), |b| {
                b.iter(|| hf.encode_fast(text.as_str(), false).unwrap())
            });
            g.bench_function(format!("{label}/reference"), |b| {
                b.iter(|| tok.encode_reference(text, false).unwrap())
            });
            g.bench_function(format!("{label}/default"), |b| {
                b.iter(|| tok.encode_uncached(text, false).unwrap())
            });
            // Both paths keep per-thread word caches, warm above; a new thread starts them
            // cold (only the encode inside it is timed).
            let cold = |b: &mut criterion::Bencher, f: &(dyn Fn() -> Vec<u32> + Sync)| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            std::thread::scope(|s| {
                                s.spawn(|| {
                                    let t = std::time::Instant::now();
                                    std::hint::black_box(f());
                                    t.elapsed()
                                })
                                .join()
                                .unwrap()
                            })
                        })
                        .sum()
                })
            };
            g.bench_function(format!("{label}/reference_cold_thread"), |b| {
                cold(b, &|| tok.encode_reference(text, false).unwrap())
            });
            g.bench_function(format!("{label}/default_cold_thread"), |b| {
                cold(b, &|| tok.encode_uncached(text, false).unwrap())
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench_encode, bench_plain, bench);
criterion_main!(benches);
