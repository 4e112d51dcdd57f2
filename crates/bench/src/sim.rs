//! Simulated-time runs: a workload replayed on N `kinference-sim` engines in virtual time,
//! routed by a [`SimRouter`], every figure taken from the engines themselves.
//!
//! ```text
//!   Workload ──(tokens, lazily)──▶ Fleet::run_with(route, sink)
//!        route: hash the prompt once ──▶ SimRouter::route ──▶ in-flight bookkeeping
//!        sink:  every finished step ──▶ SimRouter::observe (KV events), ITL samples,
//!               first tokens and completions ──▶ in-flight counts, load timeline, progress
//! ```
//!
//! Hit rates come from the engines' prefix-cache counters (vLLM's definition: prompt tokens
//! found in cache at first admission over prompt tokens looked up), latencies from the
//! engines' request timestamps, GPU time from the profile's timing model. Nothing reads the
//! wall clock; the caller's progress callback may.

use std::cell::RefCell;

use kinference_sim::timing::BatchItem;
use kinference_sim::{
    Arrival, Engine, EngineConfig, Fleet, FleetReport, FleetView, Profile, Request, SimTime,
    StepOutput, TimingModel,
};
use kinference_vllm::{BlockDigest, BlockHash, BlockHasher, RequestExtras};

use crate::error::BenchError;
use crate::route::{RouteInput, RouterLoad, SimPolicy, SimRouter};
use crate::stats::{imbalance, Costs, LoadTimeline, PolicyResult};
use crate::text::sim_tokens;
use crate::workload::Workload;

/// The simulated fleet: N identical engines.
#[derive(Clone, Debug)]
pub struct SimSetup {
    pub replicas: usize,
    pub engine: EngineConfig,
    /// GPUs behind one engine (its profile's tensor-parallel degree): GPU-seconds count each.
    pub gpus_per_replica: u32,
    /// The profile's name, for reports.
    pub profile: String,
}

impl SimSetup {
    /// `replicas` engines of a built-in profile, optionally with `kv_tokens` of KV cache each
    /// instead of the profile's.
    pub fn from_profile(
        profile: &str,
        replicas: usize,
        kv_tokens: Option<u64>,
    ) -> Result<SimSetup, BenchError> {
        if replicas == 0 {
            return Err(BenchError::Config("at least one replica is needed".into()));
        }
        let p = Profile::builtin(profile)?;
        let mut engine = EngineConfig::from_profile(&p);
        if let Some(tokens) = kv_tokens {
            let blocks = usize::try_from(tokens).unwrap_or(usize::MAX) / engine.block_size;
            engine.num_gpu_blocks = blocks + 1;
            engine.max_model_len = engine
                .max_model_len
                .min(blocks.saturating_mul(engine.block_size));
        }
        // Validate now, not at the first run.
        Engine::new(engine.clone())?;
        Ok(SimSetup {
            replicas,
            engine,
            gpus_per_replica: p.hardware.tensor_parallel,
            profile: p.name,
        })
    }

    /// KV blocks one engine can cache (vLLM's null block excluded).
    pub fn blocks_per_replica(&self) -> usize {
        self.engine.num_gpu_blocks.saturating_sub(1)
    }
}

/// A progress report, sent at most once per percent of the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Progress<'a> {
    pub label: &'a str,
    pub done: usize,
    pub total: usize,
    /// Simulated (or, live, elapsed) seconds so far.
    pub secs: f64,
}

/// One simulated run: its result plus the raw series the plots need.
#[derive(Clone, Debug)]
pub struct SimRun {
    pub result: PolicyResult,
    pub ttft_samples: Vec<f64>,
    pub timeline: LoadTimeline,
    /// Requests left out because their prompt exceeds the engines' `max_model_len`.
    pub skipped: usize,
}

/// Seconds of GPU compute the timing model charges for prefilling `prompt - cached` tokens on
/// top of `cached` tokens already in the KV cache ([`TimingModel::request_prefill_seconds`],
/// which the router's savings counters use too).
pub fn prefill_secs(timing: &TimingModel, prompt: usize, cached: usize) -> f64 {
    timing.request_prefill_seconds(prompt, cached)
}

/// Engine-seconds the workload would cost with no cache hits: each prompt's prefill plus its
/// output tokens at the per-token cost of a 64-request decode batch at the mean prompt length.
/// An estimate of offered work, used to set a target load; the runs measure the real one.
pub fn estimate_work_secs(w: &Workload, timing: &TimingModel) -> f64 {
    let lens: Vec<usize> = w
        .requests
        .iter()
        .filter_map(|r| r.prompt.known_len())
        .collect();
    let mean = lens.iter().sum::<usize>() as f64 / lens.len().max(1) as f64;
    let batch = vec![
        BatchItem {
            new_tokens: 1,
            context_tokens: mean as u32,
            samples: true,
        };
        64
    ];
    let per_token = timing.step_duration(&batch).as_secs_f64() / 64.0;
    let prefill: f64 = lens.iter().map(|&l| prefill_secs(timing, l, 0)).sum();
    prefill + w.output_tokens() as f64 * per_token
}

/// The arrival speed-up that makes offered work `load` times the fleet's capacity.
pub fn speedup_for_load(w: &Workload, setup: &SimSetup, load: f64) -> Result<f64, BenchError> {
    if !(load.is_finite() && load > 0.0) {
        return Err(BenchError::Config(format!(
            "load must be positive, got {load}"
        )));
    }
    let work = estimate_work_secs(w, &setup.engine.timing);
    let span = w.span_secs();
    if work <= 0.0 || span <= 0.0 {
        return Err(BenchError::Config(
            "cannot target a load: the workload has no span or no work".into(),
        ));
    }
    Ok(load * setup.replicas as f64 * span / work)
}

/// Runs `w` (chat prompts already tokenized) on a fresh fleet routed by `policy`.
pub fn run_policy(
    setup: &SimSetup,
    w: &Workload,
    policy: &SimPolicy,
    costs: &Costs,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<SimRun, BenchError> {
    let mut router = policy.router()?;
    run_with_router(setup, w, router.as_mut(), costs, progress)
}

/// Per-run mutable state shared by the fleet's router and sink callbacks.
struct RunState<'r, 'p> {
    router: &'r mut dyn SimRouter,
    hasher: Option<BlockHasher>,
    block_size: usize,
    loads: Vec<RouterLoad>,
    /// Per request: engine it went to, predicted uncached tokens still to prefill.
    engine_of: Vec<usize>,
    pending_prefill: Vec<u64>,
    last_token: Vec<Option<SimTime>>,
    sessions: Vec<Option<u64>>,
    itl: Vec<f64>,
    busy_secs: f64,
    done: usize,
    total: usize,
    next_report: usize,
    timeline: LoadTimeline,
    sample_every: f64,
    next_sample: f64,
    label: String,
    progress: &'p mut dyn FnMut(&Progress<'_>),
    digests: Vec<BlockDigest>,
    hashes: Vec<BlockHash>,
    extras: RequestExtras,
}

impl RunState<'_, '_> {
    fn route(&mut self, view: &FleetView<'_>, req: &Request) -> usize {
        let idx = req.id.parse::<usize>().unwrap_or(0);
        self.digests.clear();
        self.hashes.clear();
        if let (true, Some(h)) = (self.router.needs_hashes(), &self.hasher) {
            let full = req.prompt.len() / self.block_size * self.block_size;
            let tokens = req.prompt.get(..full).unwrap_or(&[]);
            self.digests = h.hash_blocks(tokens, &self.extras);
            self.hashes
                .extend(self.digests.iter().map(BlockDigest::event_hash));
        }
        let input = RouteInput {
            seq: idx as u64,
            prompt_tokens: req.prompt.len(),
            session: self.sessions.get(idx).copied().flatten(),
            digests: &self.digests,
            hashes: &self.hashes,
            loads: &self.loads,
            block_size: self.block_size,
        };
        let routed = self.router.route(&input, view);
        let e = routed.engine.min(view.len().saturating_sub(1));
        let uncached = req
            .prompt
            .len()
            .saturating_sub(routed.predicted_cached_tokens) as u64;
        if let Some(l) = self.loads.get_mut(e) {
            l.in_flight += 1;
            l.routed += 1;
            l.in_flight_prefill_tokens += uncached;
        }
        if let (Some(slot), Some(p)) = (
            self.engine_of.get_mut(idx),
            self.pending_prefill.get_mut(idx),
        ) {
            *slot = e;
            *p = uncached;
        }
        e
    }

    fn sink(&mut self, e: usize, out: &StepOutput) {
        if out.scheduled_requests > 0 {
            self.busy_secs += out.duration.as_secs_f64();
        }
        self.router.observe(e, out);
        let now = out.finished_at;
        for o in &out.outputs {
            let idx = o.request_id.parse::<usize>().unwrap_or(0);
            let engine = self.engine_of.get(idx).copied().unwrap_or(e);
            if o.index == 0 {
                let p = self.pending_prefill.get(idx).copied().unwrap_or(0);
                if let Some(l) = self.loads.get_mut(engine) {
                    l.in_flight_prefill_tokens = l.in_flight_prefill_tokens.saturating_sub(p);
                }
            }
            if let Some(last) = self.last_token.get_mut(idx) {
                if let Some(prev) = *last {
                    self.itl.push(now.saturating_since(prev).as_secs_f64());
                }
                *last = if o.finished.is_some() {
                    None
                } else {
                    Some(now)
                };
            }
            if o.finished.is_some() {
                if let Some(l) = self.loads.get_mut(engine) {
                    l.in_flight = l.in_flight.saturating_sub(1);
                }
                self.done += 1;
            }
        }
        let t = now.as_secs_f64();
        while t >= self.next_sample {
            let outstanding: Vec<u32> = self.loads.iter().map(|l| l.in_flight).collect();
            self.timeline.push(self.next_sample, &outstanding);
            self.next_sample += self.sample_every;
        }
        if self.done >= self.next_report {
            (self.progress)(&Progress {
                label: &self.label,
                done: self.done,
                total: self.total,
                secs: t,
            });
            self.next_report = self.done + (self.total / 100).max(1);
        }
    }
}

/// Runs `w` on a fresh fleet routed by `router`.
pub fn run_with_router(
    setup: &SimSetup,
    w: &Workload,
    router: &mut dyn SimRouter,
    costs: &Costs,
    progress: &mut dyn FnMut(&Progress<'_>),
) -> Result<SimRun, BenchError> {
    let cfg = &setup.engine;
    let engines: Vec<Engine> = (0..setup.replicas)
        .map(|_| Engine::new(cfg.clone()))
        .collect::<Result<_, _>>()?;
    let mut fleet = Fleet::new(engines)?;
    let state = RefCell::new(RunState::new(setup, w, router, progress)?);
    let skipped = std::cell::Cell::new(0usize);
    let vocab = cfg.vocab_size;
    let max_len = cfg.max_model_len;
    let arrivals = w.requests.iter().enumerate().filter_map(|(i, r)| {
        let tokens = sim_tokens(&r.prompt, vocab);
        if tokens.is_empty() || tokens.len() >= max_len {
            skipped.set(skipped.get() + 1);
            return None;
        }
        Some(Arrival {
            at: SimTime::from_secs_f64(r.at),
            request: Request::new(i.to_string(), tokens, r.max_tokens.max(1)),
        })
    });
    // The fleet calls the router and the sink one at a time, never one inside the other, so
    // the two mutable borrows never overlap.
    let mut route = |v: &FleetView<'_>, r: &Request| state.borrow_mut().route(v, r);
    let mut sink = |e: usize, out: &StepOutput| state.borrow_mut().sink(e, out);
    let report = fleet.run_with(arrivals, &mut route, &mut sink)?;
    let st = state.into_inner();
    let skipped = skipped.get();
    let (res, ttft) = result_of(setup, costs, &report, &st, w.len() - skipped);
    let mut timeline = st.timeline;
    let outstanding: Vec<u32> = st.loads.iter().map(|l| l.in_flight).collect();
    timeline.push(report.ended_at.as_secs_f64(), &outstanding);
    Ok(SimRun {
        result: res,
        ttft_samples: ttft,
        timeline,
        skipped,
    })
}

impl<'r, 'p> RunState<'r, 'p> {
    /// Fresh state for `w` on `setup`'s fleet: nothing routed, nothing in flight.
    fn new(
        setup: &SimSetup,
        w: &Workload,
        router: &'r mut dyn SimRouter,
        progress: &'p mut dyn FnMut(&Progress<'_>),
    ) -> Result<Self, BenchError> {
        let cfg = &setup.engine;
        let n = w.len();
        let hasher = if cfg.enable_prefix_caching {
            Some(
                BlockHasher::new(
                    cfg.hash_algo,
                    cfg.block_size,
                    cfg.hash_seed.as_deref(),
                    cfg.extra_keys_format,
                )
                .map_err(|e| BenchError::Sim(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(RunState {
            label: router.name().to_string(),
            router,
            hasher,
            block_size: cfg.block_size.max(1),
            loads: vec![RouterLoad::default(); setup.replicas],
            engine_of: vec![0; n],
            pending_prefill: vec![0; n],
            last_token: vec![None; n],
            sessions: w.requests.iter().map(|r| r.session).collect(),
            itl: Vec::new(),
            busy_secs: 0.0,
            done: 0,
            total: n,
            next_report: 0,
            timeline: LoadTimeline::new(setup.replicas),
            sample_every: (w.span_secs() / 300.0).max(0.05),
            next_sample: 0.0,
            progress,
            digests: Vec::new(),
            hashes: Vec::new(),
            extras: RequestExtras::default(),
        })
    }
}

/// The run's figures from the engines' records and counters; also the TTFT samples.
fn result_of(
    setup: &SimSetup,
    costs: &Costs,
    report: &FleetReport,
    st: &RunState<'_, '_>,
    requests: usize,
) -> (PolicyResult, Vec<f64>) {
    let mut res = PolicyResult::empty(st.router.name());
    res.requests = requests;
    res.completed = report.records.len();
    res.failed = res.requests.saturating_sub(res.completed);
    let m = &report.engine_metrics;
    res.set_hits(
        m.iter().map(|x| x.prefix_cache_queries).sum(),
        m.iter().map(|x| x.prefix_cache_hits).sum(),
        "engine counters",
    );
    let ttft: Vec<f64> = report
        .records
        .iter()
        .filter_map(|r| r.ttft_secs())
        .collect();
    let e2e: Vec<f64> = report
        .records
        .iter()
        .map(|r| r.finished_at.saturating_since(r.arrival).as_secs_f64())
        .collect();
    res.set_latencies(&ttft, &st.itl, &e2e);
    let duration = report.simulated_secs();
    res.duration_s = duration;
    if duration > 0.0 {
        res.throughput_rps = res.completed as f64 / duration;
        let out: usize = report.records.iter().map(|r| r.completion_tokens).sum();
        res.output_tok_s = out as f64 / duration;
        res.utilization = Some(st.busy_secs / (setup.replicas as f64 * duration));
    }
    res.imbalance = Some(imbalance(&report.routed));
    res.per_replica_requests = report.routed.clone();
    set_costs(&mut res, setup, costs, report, st.busy_secs);
    (res, ttft)
}

/// Prefill GPU time (from the timing model), its energy and price, busy GPU time, preemptions.
fn set_costs(
    res: &mut PolicyResult,
    setup: &SimSetup,
    costs: &Costs,
    report: &FleetReport,
    busy_secs: f64,
) {
    let gpus = f64::from(setup.gpus_per_replica.max(1));
    let prefill: f64 = report
        .records
        .iter()
        .map(|r| prefill_secs(&setup.engine.timing, r.prompt_tokens, r.cached_tokens))
        .sum::<f64>()
        * gpus;
    res.prefill_gpu_s = Some(prefill);
    res.prefill_kwh = Some(costs.kwh(prefill));
    res.prefill_usd = Some(costs.usd(prefill));
    res.busy_gpu_s = Some(busy_secs * gpus);
    res.preemptions = Some(
        report
            .engine_metrics
            .iter()
            .map(|x| x.num_preemptions)
            .sum(),
    );
}
