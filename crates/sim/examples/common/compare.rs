//! One trace replayed twice on identical simulated fleets: routed round-robin, then routed
//! cache-aware from kinference's own block index, fed only by the engines' KV events.
//!
//! ```text
//!   trace ──▶ Fleet::run_with(router, sink)
//!               router: hash the prompt (the engines' block size and hash algorithm)
//!                       ──▶ Index::longest_prefix ──▶ GPU blocks cached per engine ──▶ pick
//!               sink:   each finished step's KvEventBatch ──▶ Index::apply_batch
//! ```
//!
//! The index learns only what a real router learns: the batches an engine publishes when its
//! step ends. It never reads an engine's block pool, so it lags the engines by up to a step,
//! as it would in production. The policy is a preview of the router's precise policy:
//!
//! * score = GPU blocks of the prompt's prefix cached on the engine
//!   − `load_weight` × (the engine's running + waiting requests ÷ the fleet mean);
//! * engines whose load exceeds `fair_share_cap` × the fair share of outstanding requests
//!   (this one included) are skipped, unless every engine is;
//! * ties go to the least loaded engine, then the lowest index, so requests with nothing
//!   cached anywhere spread by load instead of piling onto one engine.
//!
//! Both runs share everything else: the engines' configuration, the trace, the arrival times.

use std::cell::RefCell;
use std::error::Error;
use std::time::{Duration, Instant};

use kinference_index::{ApplyStats, Index, ReplicaId, WorkerId};
use kinference_sim::timing::BatchItem;
use kinference_sim::{
    Engine, EngineConfig, Fleet, FleetReport, FleetView, Request, StepOutput, TimingModel,
};
use kinference_vllm::{BlockHash, BlockHasher, DpRank, Tier};

use super::trace::{arrival, TraceLine, TRACE_BLOCK};

/// A routing policy of the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    RoundRobin,
    CacheAware,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::CacheAware => "cache-aware",
        }
    }
}

/// The cache-aware policy's two knobs.
#[derive(Clone, Copy, Debug)]
pub struct CacheAwareOptions {
    /// Blocks of cached prefix worth one fleet-mean of load.
    pub load_weight: f64,
    /// Engines above this multiple of the fair share of outstanding requests are skipped.
    pub fair_share_cap: f64,
}

impl Default for CacheAwareOptions {
    fn default() -> Self {
        // 64 blocks = 1,024 tokens: a cached prefix shorter than that does not justify going
        // to an engine a whole fleet-mean busier. The cap of 1.25 keeps the busiest engine
        // within a quarter of the fair share.
        CacheAwareOptions {
            load_weight: 64.0,
            fair_share_cap: 1.25,
        }
    }
}

/// The worker an engine publishes as: one replica per engine, data-parallel rank 0.
pub fn worker(engine: usize) -> WorkerId {
    WorkerId::new(
        ReplicaId(u32::try_from(engine).unwrap_or(u32::MAX)),
        DpRank(0),
    )
}

/// The cache-aware router's state: the index, the hasher, scratch space.
#[derive(Debug)]
pub struct CacheAware {
    pub index: Index,
    hasher: BlockHasher,
    opts: CacheAwareOptions,
    hashes: Vec<BlockHash>,
    loads: Vec<usize>,
    /// What applying the engines' event batches reported, summed.
    pub applied: ApplyStats,
    pub batches: u64,
}

impl CacheAware {
    /// A router for engines configured as `cfg` (the same block size, hash algorithm and seed,
    /// so its hashes are the ones the engines publish).
    pub fn new(cfg: &EngineConfig, opts: CacheAwareOptions) -> Result<Self, Box<dyn Error>> {
        let hasher = BlockHasher::new(
            cfg.hash_algo,
            cfg.block_size,
            cfg.hash_seed.as_deref(),
            cfg.extra_keys_format,
        )?;
        Ok(CacheAware {
            index: Index::new(),
            hasher,
            opts,
            hashes: Vec::new(),
            loads: Vec::new(),
            applied: ApplyStats::default(),
            batches: 0,
        })
    }

    /// Feeds one finished engine step's KV events to the index.
    pub fn observe(&mut self, engine: usize, out: &StepOutput) {
        if let Some(batch) = &out.events {
            self.applied += self.index.apply_batch(worker(engine), batch);
            self.batches += 1;
        }
    }

    /// The engine for `req`, from the index and the engines' request gauges.
    pub fn route(&mut self, view: &FleetView<'_>, req: &Request) -> usize {
        self.hash_prompt(req);
        let matches = self.index.longest_prefix(&self.hashes);
        self.loads.clear();
        self.loads.extend(
            view.engines()
                .iter()
                .map(|e| e.num_running() + e.num_waiting()),
        );
        let n = self.loads.len().max(1) as f64;
        let total: usize = self.loads.iter().sum();
        let mean = total as f64 / n;
        let cap = self.opts.fair_share_cap * (total + 1) as f64 / n;
        let all_over = self.loads.iter().all(|&l| l as f64 > cap);
        let mut best: Option<(f64, usize, usize)> = None;
        for (e, &load) in self.loads.iter().enumerate() {
            if !all_over && load as f64 > cap {
                continue;
            }
            let cached = matches.get(worker(e)).map_or(0, |c| c.gpu);
            let relative = if mean > 0.0 { load as f64 / mean } else { 0.0 };
            let score = f64::from(cached) - self.opts.load_weight * relative;
            let better = match best {
                None => true,
                Some((s, l, _)) => score > s || (score == s && load < l),
            };
            if better {
                best = Some((score, load, e));
            }
        }
        best.map_or(0, |(_, _, e)| e)
    }

    /// The prompt's block hashes as the engine would look them up: full blocks of all but
    /// the last token (vLLM never serves the whole prompt from cache).
    fn hash_prompt(&mut self, req: &Request) {
        let bs = self.hasher.block_size().max(1);
        let full = req.prompt.len().saturating_sub(1) / bs * bs;
        let tokens = req.prompt.get(..full).unwrap_or(&[]);
        self.hashes.clear();
        self.hashes.extend(
            self.hasher
                .hash_blocks(tokens, &req.extras)
                .iter()
                .map(|d| d.event_hash()),
        );
    }
}

/// What one replay produced.
#[derive(Debug)]
pub struct RunResult {
    pub policy: Policy,
    pub report: FleetReport,
    /// The engines at the end, for inspection.
    pub engines: Vec<Engine>,
    /// The cache-aware router at the end (`None` for round-robin).
    pub router: Option<CacheAware>,
    /// Σ simulated step durations over all engines: GPU time the fleet was computing.
    pub busy_gpu_secs: f64,
    pub wall: Duration,
}

/// Replays `lines` on `engines` fresh engines configured as `cfg`, routed by `policy`.
pub fn run(
    policy: Policy,
    cfg: &EngineConfig,
    engines: usize,
    lines: &[TraceLine],
    opts: CacheAwareOptions,
) -> Result<RunResult, Box<dyn Error>> {
    let fleet_engines: Vec<Engine> = (0..engines)
        .map(|_| Engine::new(cfg.clone()))
        .collect::<Result<_, _>>()?;
    let mut fleet = Fleet::new(fleet_engines)?;
    let vocab = cfg.vocab_size;
    let arrivals = lines.iter().enumerate().map(|(i, l)| arrival(i, l, vocab));
    let mut busy = 0.0f64;
    let wall = Instant::now();
    let (report, router) = match policy {
        Policy::RoundRobin => {
            let mut next = 0usize;
            let mut route = |v: &FleetView<'_>, _: &Request| {
                next += 1;
                (next - 1) % v.len().max(1)
            };
            let mut sink = |_: usize, out: &StepOutput| busy += step_busy(out);
            (fleet.run_with(arrivals, &mut route, &mut sink)?, None)
        }
        Policy::CacheAware => {
            // The fleet calls the router and the sink one at a time, never one inside the
            // other, so the two mutable borrows never overlap.
            let state = RefCell::new(CacheAware::new(cfg, opts)?);
            let mut route = |v: &FleetView<'_>, r: &Request| state.borrow_mut().route(v, r);
            let mut sink = |e: usize, out: &StepOutput| {
                busy += step_busy(out);
                state.borrow_mut().observe(e, out);
            };
            let report = fleet.run_with(arrivals, &mut route, &mut sink)?;
            (report, Some(state.into_inner()))
        }
    };
    Ok(RunResult {
        policy,
        report,
        engines: fleet.into_engines(),
        router,
        busy_gpu_secs: busy,
        wall: wall.elapsed(),
    })
}

fn step_busy(out: &StepOutput) -> f64 {
    if out.scheduled_requests > 0 {
        out.duration.as_secs_f64()
    } else {
        0.0
    }
}

/// The figures the comparison prints for one run.
#[derive(Clone, Debug, PartialEq)]
pub struct Summary {
    pub requests: usize,
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache ÷ prompt tokens looked up, from the
    /// engines' own counters (first admissions).
    pub hit_rate: f64,
    pub ttft: [Option<f64>; 3],
    pub e2e_p50: Option<f64>,
    /// Compute the timing model charges for the uncached part of every prompt, seconds.
    pub prefill_gpu_secs: f64,
    pub busy_gpu_secs: f64,
    /// Most requests routed to one engine ÷ the mean.
    pub imbalance: f64,
    pub preemptions: u64,
    pub simulated_secs: f64,
}

impl Summary {
    pub fn of(r: &RunResult, timing: &TimingModel) -> Summary {
        let rep = &r.report;
        let m = &rep.engine_metrics;
        let e2e: Vec<f64> = rep
            .records
            .iter()
            .map(|x| x.finished_at.saturating_since(x.arrival).as_secs_f64())
            .collect();
        let prefill = rep
            .records
            .iter()
            .map(|x| prefill_secs(timing, x.prompt_tokens, x.cached_tokens))
            .sum();
        let routed_max = rep.routed.iter().copied().max().unwrap_or(0) as f64;
        let routed_mean = rep.routed.iter().sum::<u64>() as f64 / rep.routed.len().max(1) as f64;
        Summary {
            requests: rep.records.len(),
            prompt_tokens: m.iter().map(|x| x.prefix_cache_queries).sum(),
            hit_rate: rep.prefix_hit_rate(),
            ttft: [0.5, 0.9, 0.99].map(|q| rep.ttft_quantile(q)),
            e2e_p50: quantile(e2e, 0.5),
            prefill_gpu_secs: prefill,
            busy_gpu_secs: r.busy_gpu_secs,
            imbalance: if routed_mean > 0.0 {
                routed_max / routed_mean
            } else {
                0.0
            },
            preemptions: m.iter().map(|x| x.num_preemptions).sum(),
            simulated_secs: rep.simulated_secs(),
        }
    }
}

/// Seconds of GPU compute the timing model charges for prefilling `prompt - cached` tokens on
/// top of `cached` tokens already in the KV cache: the request's linear and attention work,
/// measured as the difference it makes to a compute-bound reference step, so the per-step
/// overhead and the weight-streaming floor (paid by every step, prefill or not) cancel out.
pub fn prefill_secs(timing: &TimingModel, prompt: usize, cached: usize) -> f64 {
    let reference = BatchItem {
        new_tokens: 8192,
        context_tokens: 0,
        samples: false,
    };
    let item = BatchItem {
        new_tokens: u32::try_from(prompt.saturating_sub(cached)).unwrap_or(u32::MAX),
        context_tokens: u32::try_from(cached).unwrap_or(u32::MAX),
        samples: true,
    };
    let with = timing.step_duration(&[reference, item]).as_secs_f64();
    let without = timing.step_duration(&[reference]).as_secs_f64();
    (with - without).max(0.0)
}

/// Nearest-rank quantile, as `FleetReport::ttft_quantile` computes it.
pub fn quantile(mut v: Vec<f64>, q: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let rank = (q.clamp(0.0, 1.0) * (v.len() - 1) as f64).round() as usize;
    v.get(rank).copied()
}

/// Checks that what the index says each engine holds on GPU is exactly that engine's
/// prefix cache: every cached block is indexed, and the index holds nothing more.
pub fn index_matches_engines(index: &Index, engines: &[Engine]) -> Result<(), String> {
    for (e, engine) in engines.iter().enumerate() {
        let w = worker(e);
        let mut cached: Vec<BlockHash> = engine
            .block_pool()
            .cached_blocks()
            .iter()
            .map(|(d, _)| d.event_hash())
            .collect();
        cached.sort_unstable();
        cached.dedup();
        if let Some(h) = cached.iter().find(|h| !index.holds(w, **h, Tier::Gpu)) {
            return Err(format!("engine {e} caches {h:?} but the index misses it"));
        }
        let indexed = index.worker_entries(w);
        if indexed != cached.len() {
            return Err(format!(
                "engine {e}: the index holds {indexed} entries, the engine caches {} blocks",
                cached.len()
            ));
        }
    }
    Ok(())
}

/// Prompt tokens of `lines` that an unbounded prefix cache could serve, from the trace's own
/// hash ids: a request's leading ids seen in any earlier request, capped like vLLM's lookup
/// at all but the last token, rounded down to whole `block_size` blocks. An upper bound on
/// any routing policy's hit rate on this slice.
pub fn reuse_ceiling_tokens(lines: &[TraceLine], block_size: usize) -> usize {
    let bs = block_size.max(1);
    let mut seen = std::collections::HashSet::new();
    let mut cached = 0;
    for l in lines {
        let k = l.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
        let hit = (k * TRACE_BLOCK).min(l.input_length.saturating_sub(1));
        cached += hit / bs * bs;
        seen.extend(l.hash_ids.iter().copied());
    }
    cached
}
