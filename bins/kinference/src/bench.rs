//! `kinference bench`: replays a workload against routing policies and reports TTFT, hit
//! rate, balance and GPU time: in simulated time (N simulated engines, the policies
//! in-process) or live over HTTP against OpenAI endpoints. Writes `results.json`,
//! `report.md` and PNG plots to `--out`, and prints the report.
//!
//! ```text
//! kinference bench --trace FILE --replicas 8 --mode sim --policies round-robin,precise --out DIR
//! kinference bench --workload sharegpt --replicas 4 --load 0.5,0.8
//! kinference bench --mode live --workload shared-prefix --target kinference=http://127.0.0.1:8000 \
//!     --replica-metrics http://127.0.0.1:8001/metrics --replica-metrics http://127.0.0.1:8002/metrics
//! ```
//!
//! The flags and the orchestration are `kinference_bench::cli`'s; this module only hands
//! them the command line.

/// Flags of `kinference bench`.
pub use kinference_bench::cli::BenchArgs;

/// Runs the benchmark.
pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    kinference_bench::cli::run(&a, &command)?;
    Ok(())
}
