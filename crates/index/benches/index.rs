//! Criterion benchmarks of the index: event ingest (block hashes per second through
//! `apply_batch`) and `longest_prefix` on a cluster of 1,000 replicas x 100k blocks.
//!
//! `cargo bench -p kinference-index --bench index` runs the full sizes (the lookup cluster
//! needs about 3 GiB and half a minute to build); without `--bench` (as under `cargo test
//! --benches`) everything runs once on small sizes. `KINFERENCE_BENCH_REPLICAS` and
//! `KINFERENCE_BENCH_BLOCKS` override the cluster size.

#[path = "support/workload.rs"]
mod workload;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use kinference_index::Index;
use workload::{Churn, Cluster};

fn full_size() -> bool {
    std::env::args().any(|a| a == "--bench")
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn bench_ingest(c: &mut Criterion) {
    let mut group = c.benchmark_group("ingest");
    // (label, workers, depth in steps, blocks per step)
    let shapes: &[(&str, u32, u64, usize)] = if full_size() {
        &[
            ("64k_entries/16_per_step", 64, 64, 16),
            ("1M_entries/16_per_step", 64, 1024, 16),
            ("10M_entries/16_per_step", 1000, 640, 16),
            ("1M_entries/4_per_step", 64, 4096, 4),
        ]
    } else {
        &[("small", 4, 16, 4)]
    };
    for &(label, workers, depth, per_step) in shapes {
        let mut churn = Churn::new(workers, depth, per_step);
        let mut index = Index::with_capacity_and_seed(churn.entries(), 1);
        churn.prefill(&mut index);
        group.throughput(Throughput::Elements(churn.hashes_per_batch()));
        group.bench_function(BenchmarkId::new("apply_batch", label), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                for _ in 0..iters {
                    let (w, batch) = churn.next_batch();
                    black_box(index.apply_batch(w, batch));
                }
                start.elapsed()
            })
        });
        assert_eq!(index.len(), churn.entries(), "steady state drifted");
    }
    group.finish();
}

fn bench_lookup(c: &mut Criterion) {
    let (replicas, blocks) = if full_size() {
        (
            env_or("KINFERENCE_BENCH_REPLICAS", 1000),
            env_or("KINFERENCE_BENCH_BLOCKS", 100_000),
        )
    } else {
        (8, 2_000)
    };
    let cluster = Cluster::new(replicas as u32, blocks);
    // Built on first use, so that a filter excluding every lookup skips the build.
    let mut built: Option<Index> = None;
    let mut group = c.benchmark_group("lookup_256");
    for (name, make) in workload::QUERY_CASES {
        let queries: Vec<_> = (0..1024).map(|n| make(&cluster, n)).collect();
        let mut i = 0usize;
        group.bench_function(name, |b| {
            let index = built.get_or_insert_with(|| build(&cluster));
            b.iter(|| {
                i = (i + 1) % queries.len();
                black_box(index.longest_prefix(&queries[i]))
            })
        });
    }
    group.finish();
}

fn build(cluster: &Cluster) -> Index {
    let mut index = Index::with_capacity_and_seed(cluster.distinct_blocks(), 1);
    let t = Instant::now();
    cluster.populate(&mut index);
    eprintln!(
        "lookup cluster: {} replicas, {} entries, {} distinct blocks, built in {:.1?}",
        cluster.replicas,
        index.len(),
        index.distinct_blocks(),
        t.elapsed()
    );
    index
}

fn main() {
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    bench_ingest(&mut c);
    bench_lookup(&mut c);
    c.final_summary();
}
