//! Cost of one routing decision: `select` over N candidates for a 256-block prompt with
//! speculative entries live, and `apply` of the decision; then percentiles of individually
//! timed decisions over 1,000 candidates (Criterion reports means only); and one baseline's
//! `Shadow::observe` per request on a stream like the router-latency bench's (8 shared prefixes
//! of 58 blocks, 6 blocks of its own per request, 4 workers), and the same with caches larger than
//! the CPU's (`observe-large`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{criterion_group, BenchmarkGroup, BenchmarkId, Criterion};
use kinference_index::{ReplicaId, TierCounts, WorkerId};
use kinference_policy::{Candidate, Load, Policy, PolicyConfig, RequestCtx, Shadow};
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
    for n in [8u32, 64, 256, 1000] {
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

/// `select` + `apply` over `n` candidates, each decision timed alone, for a stream of
/// prompts that vary (each shares a prefix with one of 64 earlier ones), with speculative
/// entries accumulating as under load and expired once a (simulated) second, as the router
/// does. Prints p50, p99, p99.9 and the maximum.
fn decision_percentiles(n: u32, decisions: u64) {
    let mut cands = candidates(n);
    let mut policy = Policy::new(PolicyConfig::default());
    let mut samples = Vec::with_capacity(decisions as usize);
    let mut cpu_samples = Vec::with_capacity(decisions as usize);
    for t in 0..decisions {
        let hs: Vec<BlockHash> = (0..256)
            .map(|b| {
                BlockHash(if b < 128 {
                    (t % 64) * 1000 + b
                } else {
                    t * 1000 + b
                })
            })
            .collect();
        // The cache counts the index lookup would give: the prefix's holders change.
        for (i, c) in cands.iter_mut().enumerate() {
            let held = (i as u64 + t).is_multiple_of(64);
            c.cache.gpu = if held { 128 } else { 0 };
            c.cache.any = c.cache.gpu;
        }
        let req = RequestCtx {
            hashes: &hs,
            prompt_tokens: 4096,
            block_size: 16,
            session: None,
            ticket: t,
        };
        let now = Duration::from_millis(t);
        // The router expires speculative entries once a second (`t` is in ms).
        if t.is_multiple_of(1000) {
            policy.expire(now);
        }
        let start = Instant::now();
        let cpu = thread_cpu();
        let d = policy.select(&req, &cands, now);
        policy.apply(&d, &hs, now);
        cpu_samples.push(thread_cpu().saturating_sub(cpu));
        samples.push(start.elapsed());
        black_box(d);
    }
    for (clock, samples) in [("wall", &mut samples), ("thread CPU", &mut cpu_samples)] {
        samples.sort_unstable();
        let at = |p: f64| samples[((samples.len() - 1) as f64 * p).round() as usize];
        println!(
            "decision over {n} candidates ({decisions} timed, {clock}): p50 {:?} p99 {:?} \
             p99.9 {:?} max {:?}",
            at(0.5),
            at(0.99),
            at(0.999),
            samples[samples.len() - 1]
        );
    }
}

/// This thread's CPU time: unlike the wall clock, it does not count the time the thread was
/// preempted, which on a shared 2-core machine makes most of a wall-clock tail.
fn thread_cpu() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        u64::try_from(ts.tv_sec).unwrap_or(0),
        u32::try_from(ts.tv_nsec).unwrap_or(0),
    )
}

/// Request `t` of a stream: 58 blocks of the shared prefix `prefix`, then 6 of its own,
/// numbered from `own`.
fn request_blocks(t: u64, prefix: u64, own: u64) -> Vec<BlockHash> {
    (0..64u64)
        .map(|b| {
            BlockHash(if b < 58 {
                prefix * 1000 + b
            } else {
                own + t * 64 + b
            })
        })
        .collect()
}

/// Fills `shadow` with `warm` requests of the stream `blocks`, then times one more per
/// iteration.
fn bench_observe(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: BenchmarkId,
    mut shadow: Shadow,
    warm: usize,
    blocks: impl Fn(u64) -> Vec<BlockHash>,
) {
    let cands = candidates(4);
    let mut t = 0u64;
    let mut observe = || {
        t += 1;
        let hs = blocks(t);
        let req = RequestCtx {
            hashes: &hs,
            prompt_tokens: 1024,
            block_size: 16,
            session: None,
            ticket: t,
        };
        shadow.observe(&req, &cands, Duration::from_millis(t))
    };
    for _ in 0..warm {
        observe();
    }
    group.bench_function(id, |b| b.iter(|| black_box(observe())));
}

fn bench_shadow(c: &mut Criterion) {
    let mut group = c.benchmark_group("shadow");
    for name in ["round-robin", "approximate"] {
        // Caches of 2,048 blocks per worker, filled by the same stream first.
        let shadow = Shadow::new(name, 2048).unwrap_or_else(|e| panic!("{e}"));
        bench_observe(
            &mut group,
            BenchmarkId::new("observe", name),
            shadow,
            10_000,
            |t| request_blocks(t, t % 8, 1_000_000),
        );
    }
    // Caches larger than the CPU's: 4,096 shared prefixes of 58 blocks, 262,144 blocks per
    // worker, every worker holding most of them once filled (a replica's KV capacity is of
    // this order, and each block probe then misses the caches).
    let shadow = Shadow::new("round-robin", 1 << 18).unwrap_or_else(|e| panic!("{e}"));
    let id = BenchmarkId::new("observe-large", "round-robin");
    bench_observe(&mut group, id, shadow, 40_000, |t| {
        request_blocks(t, (t * 2_654_435_761) % 4096, 1 << 40)
    });
    group.finish();
}

criterion_group!(benches, bench_select, bench_shadow);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    // Full size only under `cargo bench` (which passes --bench); a smoke size otherwise.
    let full = std::env::args().any(|a| a == "--bench");
    decision_percentiles(1000, if full { 100_000 } else { 100 });
}
