//! Chat requests as the router sees them on real text: the last 1,000 conversations of
//! ../shared's ShareGPT sample, each human turn with its whole history as one request, bodies up
//! to 16 kB (as `scripts/router-latency.sh WORKLOAD=chat` builds them: 4,461 requests, mean
//! 3.6 kB of messages). Every 10th of them, so the sample keeps the mix of short and long ones.
//!
//! - `chat_render/<tokenizer>/default`: `Tokenizer::render_chat` over the whole sample, per
//!   iteration (the native renderer where the template has one, see `src/native.rs`);
//!   `.../minijinja`: `Tokenizer::render_chat_reference` (building the template context and
//!   rendering the chat template with minijinja).
//! - `chat_parse`: `ChatRequest::from_json` of the same requests' bodies.
//!
//! Before timing, every one of the 4,461 requests is rendered with each template, both ways, and
//! a SHA-256 of the outputs is printed: the two ways must print the same digest, and a change
//! that is meant to be a speed-up only must print the same digests as before it.
//!
//! Run: `cargo bench -p kinference-tokenize --bench chat_render`.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kinference_tokenize::{ChatRequest, Tokenizer};
use sha2::{Digest, Sha256};

#[path = "../tests/common/mod.rs"]
mod common;

// The kinference binary's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TOKENIZERS: [&str; 3] = ["llama3.1", "qwen3", "deepseek-v3"];
const SAMPLE_EVERY: usize = 10;

/// The request bodies of router-latency.sh's chat workload, in its order.
fn chat_bodies() -> Vec<String> {
    // Per conversation: the `messages` JSON of each human turn, written as the script's
    // json.dumps(ensure_ascii=False) writes it (serde_json escapes the same characters).
    let turns: Vec<Vec<String>> = common::sharegpt()[2000..]
        .iter()
        .map(|c| {
            let mut msgs: Vec<String> = Vec::new();
            let mut mine = Vec::new();
            for (human, value) in c {
                let role = if *human { "user" } else { "assistant" };
                let content = serde_json::to_string(value).unwrap();
                msgs.push(format!(r#"{{"role": "{role}", "content": {content}}}"#));
                if *human {
                    mine.push(format!("[{}]", msgs.join(", ")));
                }
            }
            mine
        })
        .collect();
    let rounds = turns.iter().map(Vec::len).max().unwrap_or(0);
    let mut bodies = Vec::new();
    for k in 0..rounds {
        for t in turns.iter().filter(|t| k < t.len()) {
            let messages = &t[k];
            if messages.len() + r#""messages":"#.len() <= 16384 {
                bodies.push(format!(
                    r#"{{"model":"bench","messages":{messages},"max_tokens":8,"temperature":0}}"#
                ));
            }
        }
    }
    bodies
}

fn bench(c: &mut Criterion) {
    let bodies = chat_bodies();
    let all: Vec<ChatRequest> = bodies
        .iter()
        .map(|b| ChatRequest::from_json(b.as_bytes()).unwrap())
        .collect();
    let sample: Vec<&ChatRequest> = all.iter().step_by(SAMPLE_EVERY).collect();
    let sample_bodies: Vec<&String> = bodies.iter().step_by(SAMPLE_EVERY).collect();
    let body_bytes: usize = sample_bodies.iter().map(|b| b.len()).sum();
    println!(
        "{} requests, {} in the sample, mean body {} bytes",
        all.len(),
        sample.len(),
        body_bytes / sample.len()
    );

    let mut g = c.benchmark_group("chat_render");
    g.throughput(Throughput::Elements(sample.len() as u64));
    g.sample_size(20);
    for name in TOKENIZERS {
        let tok = common::load(name, 0);
        // The default path (native where the template has a native renderer) and minijinja
        // alone; both digests are printed and must agree.
        for (path, render) in [
            (
                "default",
                Tokenizer::render_chat as fn(&Tokenizer, &ChatRequest) -> _,
            ),
            ("minijinja", Tokenizer::render_chat_reference),
        ] {
            let mut digest = Sha256::new();
            for req in &all {
                digest.update(render(&tok, req).unwrap().as_bytes());
                digest.update([0]);
            }
            let digest = digest.finalize();
            let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
            println!(
                "{name} {path}: rendered {} requests, sha256 {hex}",
                all.len()
            );
            g.bench_function(format!("{name}/{path}"), |b| {
                b.iter(|| {
                    for req in &sample {
                        std::hint::black_box(render(&tok, req).unwrap());
                    }
                })
            });
        }
    }
    g.finish();

    let mut g = c.benchmark_group("chat_parse");
    g.throughput(Throughput::Elements(sample.len() as u64));
    g.sample_size(20);
    g.bench_function("from_json", |b| {
        b.iter(|| {
            for body in &sample_bodies {
                std::hint::black_box(ChatRequest::from_json(body.as_bytes()).unwrap());
            }
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
