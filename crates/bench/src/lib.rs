//! kinference-bench: workloads, simulated-time and live HTTP runners, statistics and reports
//! for comparing routing policies on a vLLM fleet.
//!
//! ```text
//!   sources (Mooncake, ShareGPT, Azure) ─┐
//!   synth (shared prefix, multi-turn,  ──┼─▶ Workload ──▶ Arrivals::apply ──┬─▶ sim::run_policy  (virtual time)
//!          prefix-ratio sweeps)        ──┘                                  └─▶ live::run_targets (HTTP, tokio)
//!                                                                                   │
//!                          PolicyResult per policy ◀────────────────────────────────┘
//!                          ──▶ report (results.json, report.md) + plots (PNG)
//! ```
//!
//! Everything but [`live`] is pure: no sockets, no async runtime, no wall clock (progress
//! callbacks may read one). Prompts stay descriptions until a runner issues them, and expand
//! deterministically, so every policy of a comparison sees identical requests at identical
//! times.

pub mod bounds;
#[cfg(feature = "cli")]
pub mod cli;
pub mod error;
#[cfg(feature = "live")]
pub mod live;
pub mod peers;
#[cfg(feature = "plots")]
pub mod plot;
pub mod report;
pub mod route;
pub mod sim;
pub mod sources;
pub mod stats;
pub mod synth;
pub mod text;
pub mod workload;

pub use error::BenchError;
pub use report::{PolicyRun, Report, RunReport, WorkloadSummary};
pub use route::{SimPolicy, SimRouter};
pub use sim::{run_policy, Progress, SimRun, SimSetup};
pub use stats::{Costs, LoadTimeline, PolicyResult};
pub use workload::{Arrivals, Message, Prompt, WorkRequest, Workload};

/// A summary of `w` for reports.
pub fn summarize(w: &Workload, arrivals: &Arrivals) -> WorkloadSummary {
    WorkloadSummary {
        name: w.name.clone(),
        requests: w.len(),
        prompt_tokens: w.known_prompt_tokens() as u64,
        output_tokens: w.output_tokens(),
        span_s: w.span_secs(),
        arrivals: arrivals.label(),
    }
}

/// Runs every policy on `w` in simulated time, one after the other on fresh fleets, and
/// fills in the savings against round-robin when it is among them.
pub fn compare_sim(
    setup: &SimSetup,
    w: &Workload,
    policies: &[SimPolicy],
    costs: &Costs,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<Vec<PolicyRun>, BenchError> {
    let mut runs = Vec::new();
    for p in policies {
        let r = run_policy(setup, w, p, costs, progress)?;
        runs.push(PolicyRun {
            result: r.result,
            ttft_samples: r.ttft_samples,
            timeline: Some(r.timeline),
        });
    }
    let mut results: Vec<PolicyResult> = runs.iter().map(|r| r.result.clone()).collect();
    stats::fill_savings(&mut results, "round-robin", costs);
    for (r, x) in runs.iter_mut().zip(results) {
        r.result = x;
    }
    Ok(runs)
}
