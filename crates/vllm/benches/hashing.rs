//! Cost of hashing a prompt's blocks: a 4,096-token prompt (256 blocks of 16) with each
//! algorithm, computed outright and through a warm [`HashMemo`] (the prompt hashed before, as a
//! shared prefix is on a router), a prompt whose last 6 blocks are new (a shared prefix with a
//! request's own tail), and prompts that share nothing (every lookup misses).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kinference_vllm::{BlockHasher, ExtraKeysFormat, HashAlgo, HashMemo, RequestExtras};

fn bench_hash(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..4096u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_000)
        .collect();
    let extras = RequestExtras::default();
    let mut group = c.benchmark_group("hash_4096_tokens");
    for algo in HashAlgo::ALL {
        let h = BlockHasher::new(algo, 16, Some("0"), ExtraKeysFormat::Tagged)
            .unwrap_or_else(|e| panic!("{e}"));
        group.bench_function(BenchmarkId::new("plain", algo.as_str()), |b| {
            b.iter(|| black_box(h.hash_blocks(black_box(&tokens), &extras)))
        });
        let mut memo = HashMemo::default();
        h.hash_blocks_memo(&tokens, &extras, &mut memo);
        group.bench_function(BenchmarkId::new("memo_warm", algo.as_str()), |b| {
            b.iter(|| black_box(h.hash_blocks_memo(black_box(&tokens), &extras, &mut memo)))
        });
        let mut n = 0u32;
        group.bench_function(
            BenchmarkId::new("memo_new_tail_6_blocks", algo.as_str()),
            |b| {
                let mut t = tokens.clone();
                b.iter(|| {
                    n = n.wrapping_add(1);
                    for x in &mut t[4096 - 96..] {
                        *x = x.wrapping_add(n) % 128_000;
                    }
                    black_box(h.hash_blocks_memo(black_box(&t), &extras, &mut memo))
                })
            },
        );
        // Every block new: what a memo costs on traffic that shares nothing (lookups that
        // miss in a memo the size of the data plane's, then puts).
        let mut m = 0u32;
        group.bench_function(BenchmarkId::new("memo_all_new", algo.as_str()), |b| {
            let mut t = tokens.clone();
            b.iter(|| {
                m = m.wrapping_add(1);
                t[0] = m;
                black_box(h.hash_blocks_memo(black_box(&t), &extras, &mut memo))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_hash);
criterion_main!(benches);
