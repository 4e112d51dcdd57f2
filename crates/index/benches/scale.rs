//! The index at cluster scale, measured directly rather than through Criterion: heap bytes per
//! (block, replica) entry from a counting allocator and RSS, `longest_prefix` latency
//! percentiles over many individually timed lookups, ingest into the full-size index, and the
//! cost of dropping a replica and sweeping its garbage.
//!
//! `cargo bench -p kinference-index --bench scale` runs 1,000 replicas x 100k blocks (about
//! 3 GiB at peak); `KINFERENCE_BENCH_REPLICAS`, `KINFERENCE_BENCH_BLOCKS` and
//! `KINFERENCE_BENCH_LOOKUPS` change the sizes. Without `--bench` it runs a small smoke size.

#[path = "support/workload.rs"]
mod workload;

use std::alloc::System;
use std::hint::black_box;
use std::time::{Duration, Instant};

use kinference_index::{Index, ReplicaId};
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use workload::{Churn, Cluster};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Resident set size from /proc/self/statm (Linux), in bytes.
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

fn gib(b: f64) -> String {
    format!("{:.2} GiB", b / (1u64 << 30) as f64)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

fn timer_overhead() -> Duration {
    let mut samples: Vec<Duration> = (0..10_000)
        .map(|_| {
            let t = Instant::now();
            t.elapsed()
        })
        .collect();
    samples.sort();
    percentile(&samples, 0.5)
}

fn build(cluster: &Cluster) -> Index {
    let rss0 = rss_bytes().unwrap_or(0);
    let region = Region::new(GLOBAL);
    let t = Instant::now();
    let mut index = Index::with_capacity_and_seed(cluster.distinct_blocks(), 1);
    cluster.populate(&mut index);
    let took = t.elapsed();
    let stats = region.change();
    // `stats_alloc` already counts a reallocation's growth in `bytes_allocated` (and its
    // shrinkage in `bytes_deallocated`); `bytes_reallocated` repeats it, so it stays out.
    let heap = stats.bytes_allocated as f64 - stats.bytes_deallocated as f64;
    let rss = rss_bytes().unwrap_or(0).saturating_sub(rss0) as f64;
    let entries = index.len() as f64;
    println!("## build");
    println!(
        "replicas {}, entries {}, distinct blocks {}, built in {:.1?} ({:.2} M entries/s via store)",
        cluster.replicas,
        index.len(),
        index.distinct_blocks(),
        took,
        entries / took.as_secs_f64() / 1e6
    );
    println!("## memory");
    println!("| measure | total | bytes per entry |");
    println!("|---|---|---|");
    println!(
        "| heap (counting allocator) | {} | {:.1} |",
        gib(heap),
        heap / entries
    );
    println!(
        "| RSS growth (/proc/self/statm) | {} | {:.1} |",
        gib(rss),
        rss / entries
    );
    let est = index.heap_bytes() as f64;
    println!(
        "| index's own estimate | {} | {:.1} |",
        gib(est),
        est / entries
    );
    index
}

fn latencies(index: &Index, cluster: &Cluster, lookups: usize) {
    let overhead = timer_overhead();
    println!("## longest_prefix latency ({lookups} lookups per case, timer overhead {overhead:?} included)");
    println!("| case | rows | p50 | p90 | p99 | p99.9 | max | mean |");
    println!("|---|---|---|---|---|---|---|---|");

    for (name, make) in workload::QUERY_CASES {
        let queries: Vec<_> = (0..4096u64).map(|n| make(cluster, n)).collect();
        let mut samples = Vec::with_capacity(lookups);
        let mut rows = 0usize;
        // Visit queries in a scrambled order so consecutive lookups share no cache lines.
        for i in 0..lookups {
            let q = &queries[(workload::mix(i as u64) % queries.len() as u64) as usize];
            let t = Instant::now();
            let m = black_box(index.longest_prefix(q));
            samples.push(t.elapsed());
            rows += m.len();
        }
        let mean = samples.iter().sum::<Duration>() / samples.len().max(1) as u32;
        samples.sort();
        println!(
            "| {name} | {:.0} | {:.2?} | {:.2?} | {:.2?} | {:.2?} | {:.2?} | {:.2?} |",
            rows as f64 / lookups as f64,
            percentile(&samples, 0.5),
            percentile(&samples, 0.9),
            percentile(&samples, 0.99),
            percentile(&samples, 0.999),
            samples.last().copied().unwrap_or_default(),
            mean
        );
    }
}

fn ingest(index: &mut Index, churn: &mut Churn, batches: usize, label: &str) {
    let hashes = churn.hashes_per_batch() * batches as u64;
    let garbage = index.garbage_entries();
    let t = Instant::now();
    for _ in 0..batches {
        let (w, batch) = churn.next_batch();
        black_box(index.apply_batch(w, batch));
    }
    let took = t.elapsed();
    println!(
        "{label}: {batches} batches of {} stored + {} removed hashes over {} workers in {:.1?}: {:.2} M block events/s (garbage entries {} -> {})",
        churn.per_step,
        churn.per_step,
        churn.workers,
        took,
        hashes as f64 / took.as_secs_f64() / 1e6,
        garbage,
        index.garbage_entries()
    );
}

fn drop_replica(index: &mut Index, churn: &mut Churn, batches: usize) {
    let before = index.len();
    let t = Instant::now();
    let dropped = index.remove_replica(ReplicaId(0));
    let removal = t.elapsed();
    println!("## dropping a replica");
    println!("remove_replica(0): {dropped} of {before} entries in {removal:?}");
    ingest(
        index,
        churn,
        batches,
        "ingest while the sweep reclaims them",
    );
    let t = Instant::now();
    index.compact();
    println!("compact() of what remained: {:.1?}", t.elapsed());
}

/// The machine's floor for a 256-block lookup: 256 independent random 16-byte reads from an
/// array the size of the index, timed like the lookups (no index code involved).
fn memory_floor(bytes: usize, lookups: usize) {
    let n = (bytes / 16).max(1);
    let array: Vec<[u64; 2]> = (0..n as u64).map(|i| [workload::mix(i), i]).collect();
    let mut samples = Vec::with_capacity(lookups);
    let mut acc = 0u64;
    for q in 0..lookups as u64 {
        let t = Instant::now();
        for j in 0..workload::QUERY_BLOCKS as u64 {
            let i = ((u128::from(workload::mix(q << 16 | j)) * n as u128) >> 64) as usize;
            acc ^= array.get(i).map_or(0, |s| s[0]);
        }
        samples.push(t.elapsed());
    }
    black_box(acc);
    samples.sort();
    println!("## memory floor");
    println!(
        "256 independent random 16-byte reads from a {} array: p50 {:.2?}, p99 {:.2?}",
        gib(bytes as f64),
        percentile(&samples, 0.5),
        percentile(&samples, 0.99)
    );
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let replicas = env_or("KINFERENCE_BENCH_REPLICAS", if full { 1000 } else { 8 });
    let blocks = env_or(
        "KINFERENCE_BENCH_BLOCKS",
        if full { 100_000 } else { 2_000 },
    );
    let lookups = env_or(
        "KINFERENCE_BENCH_LOOKUPS",
        if full { 100_000 } else { 1_000 },
    );
    let cluster = Cluster::new(replicas as u32, blocks);
    let mut index = build(&cluster);
    assert_eq!(index.len(), cluster.entries());
    latencies(&index, &cluster, lookups);
    let batches = if full { 300_000 } else { 1_000 };
    let mut churn = Churn::new(replicas as u32, 64, 16);
    churn.prefill(&mut index);
    println!("## ingest into the full index");
    ingest(&mut index, &mut churn, batches, "steady state");
    drop_replica(&mut index, &mut churn, batches);
    let table_bytes = index.heap_bytes();
    drop(index);
    memory_floor(table_bytes, lookups.min(20_000));
    if let Some(rss) = rss_bytes() {
        println!("final RSS {}", gib(rss as f64));
    }
}
