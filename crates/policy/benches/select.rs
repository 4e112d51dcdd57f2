//! Cost of one routing decision: `select` over N candidates for a 256-block prompt with
//! speculative entries live, and `apply` of the decision.

use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use kinference_index::{ReplicaId, TierCounts, WorkerId};
use kinference_policy::{Candidate, Load, Policy, PolicyConfig, RequestCtx};
use kinference_vllm::{BlockHash, DpRank};

fn candidates(n: u32) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            worker: WorkerId::new(ReplicaId(i), DpRank(0)),
            load: Load {
                running: i % 7,
                waiting: i % 3,
                kv_usage: f64::from(i % 10) / 10.0,
                in_flight: i % 5,
                in_flight_prefill_tokens: u64::from(i % 4) * 1000,
            },
            cache: TierCounts {
                gpu: (i * 37) % 256,
                cpu: 0,
                storage: 0,
                any: (i * 37) % 256,
            },
            scorable: true,
        })
        .collect()
}

fn bench_select(c: &mut Criterion) {
    let hashes: Vec<BlockHash> = (0..256).map(BlockHash).collect();
    let mut group = c.benchmark_group("select");
    for n in [8u32, 64, 256] {
        let cands = candidates(n);
        let mut policy = Policy::new(PolicyConfig::default());
        // A few hundred recent decisions' speculative entries, as under load.
        for t in 0..300u64 {
            let hs: Vec<BlockHash> = (0..256).map(|b| BlockHash(t * 1000 + b)).collect();
            let req = RequestCtx {
                hashes: &hs,
                prompt_tokens: 4096,
                block_size: 16,
                session: None,
                ticket: t,
            };
            let d = policy.select(&req, &cands, Duration::from_millis(t));
            policy.apply(&d, &hs, Duration::from_millis(t));
        }
        let req = RequestCtx {
            hashes: &hashes,
            prompt_tokens: 4096,
            block_size: 16,
            session: None,
            ticket: 7,
        };
        group.bench_with_input(BenchmarkId::new("precise", n), &n, |b, _| {
            b.iter(|| black_box(policy.select(&req, &cands, Duration::from_millis(400))))
        });
        group.bench_with_input(BenchmarkId::new("precise+apply", n), &n, |b, _| {
            let mut p = policy.clone();
            let mut t = 400u64;
            b.iter(|| {
                t += 1;
                let d = p.select(&req, &cands, Duration::from_millis(t));
                p.apply(&d, &hashes, Duration::from_millis(t));
                black_box(d)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_select);
criterion_main!(benches);
