//! The steppable engine: one vLLM instance (one DP rank) as a pure state machine.
//!
//! ```text
//!   add_request(req, now)          abort(id)            reset_prefix_cache()
//!          │                          │                        │
//!          ▼                          ▼                        ▼
//!   ┌─────────────┐  step(now)  ┌──────────┐  events   ┌────────────────┐
//!   │  scheduler  │────────────▶│ kv cache │──────────▶│ KvEventBatch   │
//!   └─────────────┘             └──────────┘           │ (one per step) │
//!          │ batch shape                               └────────────────┘
//!          ▼
//!   timing model ──▶ StepOutput { started_at, duration, outputs, events }
//! ```
//!
//! `step(now)` runs one engine step starting at `max(now, end of the previous step)`: it
//! schedules, charges the step's simulated duration, samples one pseudo-token for every
//! request whose computed tokens caught up, finishes requests that reached `max_tokens` (or
//! `max_model_len`), frees their blocks, and returns every KV event of the step in one batch
//! stamped with the step's end. The caller owns the clock: it should deliver the outputs and
//! publish the batch at `finished_at`, and call `step` again no earlier than that. State is
//! updated at the start of the step, so a snapshot taken mid-step already shows its effect.

use std::sync::Arc;
use std::time::Duration;

use kinference_vllm::{BlockHasher, ExtraKeysFormat, HashAlgo, KvEventBatch, RequestExtras};

use crate::block_pool::{BlockPool, EventOptions};
use crate::error::{AddRequestError, ConfigError, ResetError};
use crate::kv_cache::KvCacheManager;
use crate::metrics::EngineMetrics;
use crate::profile::Profile;
use crate::request::{ReqState, Request, Status};
use crate::scheduler::{SchedCtx, Scheduled, Scheduler, SchedulerConfig};
use crate::time::SimTime;
use crate::timing::{BatchItem, TimingModel};

/// One engine's settings, named as vLLM names them.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block (`--block-size`; 16 by default on GPUs in vLLM 0.32).
    pub block_size: usize,
    /// KV blocks including vLLM's reserved null block (`num_gpu_blocks`).
    pub num_gpu_blocks: usize,
    /// Most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Token budget of one step (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    pub enable_chunked_prefill: bool,
    /// Prefill chunk cap when several requests compete (`--long-prefill-token-threshold`).
    pub long_prefill_token_threshold: usize,
    /// Context length, tokens (`--max-model-len`).
    pub max_model_len: usize,
    pub enable_prefix_caching: bool,
    /// `--prefix-caching-hash-algo`.
    pub hash_algo: HashAlgo,
    /// `PYTHONHASHSEED`, if the replica sets one.
    pub hash_seed: Option<String>,
    pub extra_keys_format: ExtraKeysFormat,
    pub events: EventOptions,
    /// Published as the batch's `data_parallel_rank`.
    pub data_parallel_rank: Option<i64>,
    /// Pseudo-tokens are drawn from `0..vocab_size`.
    pub vocab_size: u32,
    pub timing: TimingModel,
}

impl EngineConfig {
    /// vLLM 0.32's OpenAI-server defaults on an H100-class GPU (block size 16,
    /// `max_num_batched_tokens` 8192, `max_num_seqs` 1024, chunked prefill and prefix caching
    /// on, sha256), with the profile's KV capacity, context length and timing.
    pub fn from_profile(p: &Profile) -> Self {
        let block_size = 16;
        EngineConfig {
            block_size,
            num_gpu_blocks: usize::try_from(p.kv_cache.tokens).unwrap_or(usize::MAX) / block_size,
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            max_model_len: p.model.max_model_len as usize,
            enable_prefix_caching: true,
            hash_algo: HashAlgo::Sha256,
            hash_seed: None,
            extra_keys_format: ExtraKeysFormat::Tagged,
            events: EventOptions::default(),
            data_parallel_rank: Some(0),
            vocab_size: p.model.vocab_size,
            timing: TimingModel::from_profile(p),
        }
    }

    /// A small engine for tests: `num_gpu_blocks` blocks of `block_size`, 10 ms steps.
    pub fn small(num_gpu_blocks: usize, block_size: usize) -> Self {
        EngineConfig {
            block_size,
            num_gpu_blocks,
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            max_model_len: num_gpu_blocks.saturating_sub(1) * block_size,
            enable_prefix_caching: true,
            hash_algo: HashAlgo::Sha256,
            hash_seed: None,
            extra_keys_format: ExtraKeysFormat::Tagged,
            events: EventOptions::default(),
            data_parallel_rank: Some(0),
            vocab_size: 32_000,
            timing: TimingModel::fixed(Duration::from_millis(10)),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("block_size", self.block_size),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
            ("max_model_len", self.max_model_len),
        ] {
            if v == 0 {
                return Err(ConfigError::Zero(name));
            }
        }
        if self.num_gpu_blocks < 2 || self.num_gpu_blocks > u32::MAX as usize {
            return Err(ConfigError::TooFewBlocks(self.num_gpu_blocks));
        }
        let capacity = (self.num_gpu_blocks - 1).saturating_mul(self.block_size);
        if self.max_model_len > capacity {
            return Err(ConfigError::ModelLenExceedsCache {
                max_model_len: self.max_model_len,
                capacity,
            });
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            return Err(ConfigError::BudgetBelowModelLen {
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
            });
        }
        Ok(())
    }
}

/// Why a request stopped (vLLM's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens` or `max_model_len` (the simulator never samples a stop token).
    Length,
    /// Stopped by the caller on a stop condition it checks itself (vLLM's frontend matches
    /// stop strings on detokenized text and then aborts the request in the engine core).
    Stop,
    /// Aborted by the caller (a client disconnect).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// The OpenAI `usage` of a finished request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens`: prefix-cache hit at first scheduling.
    pub cached_tokens: usize,
}

/// How and when a request finished.
#[derive(Clone, Debug, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
    pub arrival: SimTime,
    pub first_scheduled: Option<SimTime>,
    pub first_token: Option<SimTime>,
    pub finished_at: SimTime,
    pub num_preemptions: u32,
}

/// One request's progress in a step: a newly generated token, and whether it finished.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestOutput {
    pub request_id: Arc<str>,
    pub token: u32,
    /// Position among the generated tokens; 0 is the first token.
    pub index: usize,
    pub finished: Option<Finished>,
}

/// Everything one step produced.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOutput {
    pub started_at: SimTime,
    pub duration: Duration,
    pub finished_at: SimTime,
    pub outputs: Vec<RequestOutput>,
    /// The step's KV events, stamped `finished_at`; `None` when it had none.
    pub events: Option<KvEventBatch>,
    pub scheduled_requests: usize,
    pub scheduled_tokens: usize,
    pub num_preempted: usize,
}

/// One simulated vLLM engine.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    hasher: Option<BlockHasher>,
    pool: BlockPool,
    kv: KvCacheManager,
    sched: Scheduler,
    metrics: EngineMetrics,
    busy_until: SimTime,
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Result<Engine, ConfigError> {
        cfg.validate()?;
        let hasher = if cfg.enable_prefix_caching {
            Some(BlockHasher::new(
                cfg.hash_algo,
                cfg.block_size,
                cfg.hash_seed.as_deref(),
                cfg.extra_keys_format,
            )?)
        } else {
            None
        };
        let pool = BlockPool::new(cfg.num_gpu_blocks, cfg.enable_prefix_caching, cfg.events)
            .ok_or(ConfigError::TooFewBlocks(cfg.num_gpu_blocks))?;
        let kv = KvCacheManager {
            block_size: cfg.block_size,
            max_model_len: cfg.max_model_len,
        };
        let sched = Scheduler::new(SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_num_batched_tokens: cfg.max_num_batched_tokens,
            chunked_prefill: cfg.enable_chunked_prefill,
            long_prefill_token_threshold: cfg.long_prefill_token_threshold,
        });
        Ok(Engine {
            cfg,
            hasher,
            pool,
            kv,
            sched,
            metrics: EngineMetrics::new(),
            busy_until: SimTime::ZERO,
        })
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The block hasher this engine uses (`None` without prefix caching).
    pub fn hasher(&self) -> Option<&BlockHasher> {
        self.hasher.as_ref()
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// When the last step ends; `step` never starts earlier.
    pub fn busy_until(&self) -> SimTime {
        self.busy_until
    }

    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }

    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }

    pub fn kv_cache_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Whether `step` has anything to do: requests to run or events to publish.
    pub fn has_work(&self) -> bool {
        self.sched.num_running() > 0
            || self.sched.num_waiting() > 0
            || self.pool.has_pending_events()
    }

    /// Queues a request (vLLM's input validation first).
    pub fn add_request(&mut self, req: Request, now: SimTime) -> Result<(), AddRequestError> {
        if self.sched.contains(&req.id) {
            return Err(AddRequestError::DuplicateId(req.id));
        }
        if req.prompt.is_empty() {
            return Err(AddRequestError::EmptyPrompt);
        }
        if req.max_tokens == 0 {
            return Err(AddRequestError::ZeroMaxTokens);
        }
        if req.prompt.len() > self.cfg.max_model_len {
            return Err(AddRequestError::PromptTooLong {
                prompt_len: req.prompt.len(),
                max_model_len: self.cfg.max_model_len,
            });
        }
        let st = ReqState::new(req, now, self.hasher.as_ref());
        self.sched.insert(st);
        Ok(())
    }

    /// Aborts a request wherever it is and frees its blocks (they stay cached). False if the
    /// id is unknown or already finished.
    pub fn abort(&mut self, request_id: &str) -> bool {
        let Some(slot) = self.sched.slot_of(request_id) else {
            return false;
        };
        let Some(mut st) = self.sched.remove(slot) else {
            return false;
        };
        self.kv.free(&mut self.pool, &mut st);
        self.metrics.requests_aborted += 1;
        true
    }

    /// Finishes a request early with [`FinishReason::Stop`] (a stop string matched) and frees
    /// its blocks (they stay cached). Counted as a finished request, as vLLM's frontend counts
    /// it, with latencies ending at its last token (or `now` if it has none). `None` if the id
    /// is unknown or already finished.
    pub fn stop(&mut self, request_id: &str, now: SimTime) -> Option<Finished> {
        let slot = self.sched.slot_of(request_id)?;
        let mut st = self.sched.remove(slot)?;
        self.kv.free(&mut self.pool, &mut st);
        let end = st.last_token.unwrap_or(now);
        Some(finish(&mut self.metrics, &st, end, FinishReason::Stop))
    }

    /// vLLM's `reset_prefix_cache` without preempting anyone: refused while any request holds
    /// blocks; on success one `AllBlocksCleared` goes out with the next step's batch.
    pub fn reset_prefix_cache(&mut self) -> Result<(), ResetError> {
        self.pool.reset().map_err(ResetError::BlocksInUse)
    }

    /// The longest cached prefix of `prompt` here, in tokens, as admission would find it now
    /// (capped at `len - 1` like vLLM). Pure: touches nothing.
    pub fn cached_prefix_tokens(&self, prompt: &[u32], extras: &RequestExtras) -> usize {
        let Some(h) = self.hasher.as_ref() else {
            return 0;
        };
        let max_blocks = prompt.len().saturating_sub(1) / self.cfg.block_size;
        let digests = h.hash_blocks(&prompt[..max_blocks * self.cfg.block_size], extras);
        let hit = digests
            .iter()
            .take_while(|d| self.pool.get_cached(d).is_some())
            .count();
        hit * self.cfg.block_size
    }

    /// A snapshot of gauges, counters and histograms.
    pub fn metrics(&self) -> EngineMetrics {
        let mut m = self.metrics.clone();
        m.num_running = self.sched.num_running();
        m.num_waiting = self.sched.num_waiting();
        m.kv_cache_usage = self.pool.usage();
        m
    }

    /// Runs one engine step starting at `max(now, busy_until)`.
    pub fn step(&mut self, now: SimTime) -> StepOutput {
        let start = now.max(self.busy_until);
        let outcome = {
            let mut ctx = SchedCtx {
                pool: &mut self.pool,
                kv: &self.kv,
                hasher: self.hasher.as_ref(),
                now: start,
                metrics: &mut self.metrics,
            };
            self.sched.schedule(&mut ctx)
        };
        let items = self.batch_items(&outcome.scheduled);
        let duration = self.cfg.timing.step_duration(&items);
        let end = start.saturating_add(duration);
        if !outcome.scheduled.is_empty() {
            self.busy_until = end;
            self.metrics.steps += 1;
        }
        let outputs = self.sample(&outcome.scheduled, end);
        let events = self.take_batch(end);
        StepOutput {
            started_at: start,
            duration,
            finished_at: end,
            outputs,
            events,
            scheduled_requests: outcome.scheduled.len(),
            scheduled_tokens: items.iter().map(|i| i.new_tokens as usize).sum(),
            num_preempted: outcome.num_preempted,
        }
    }

    fn batch_items(&self, scheduled: &[Scheduled]) -> Vec<BatchItem> {
        scheduled
            .iter()
            .map(|s| {
                let samples = self
                    .sched
                    .get(s.slot)
                    .is_some_and(|r| r.num_computed >= r.num_tokens());
                BatchItem {
                    new_tokens: u32::try_from(s.new_tokens).unwrap_or(u32::MAX),
                    context_tokens: u32::try_from(s.context).unwrap_or(u32::MAX),
                    samples,
                }
            })
            .collect()
    }

    /// Samples a token for every scheduled request that caught up, then finishes those done.
    fn sample(&mut self, scheduled: &[Scheduled], end: SimTime) -> Vec<RequestOutput> {
        let mut outputs = Vec::new();
        let mut done: Vec<(usize, usize)> = Vec::new();
        for s in scheduled {
            let Some(req) = self.sched.get_mut(s.slot) else {
                continue;
            };
            if req.num_computed < req.num_tokens() {
                continue;
            }
            let index = req.num_output();
            let token = req.append_output(self.cfg.vocab_size, self.hasher.as_ref());
            record_token(&mut self.metrics, req, end);
            if req.num_output() >= req.max_tokens || req.num_tokens() >= self.cfg.max_model_len {
                done.push((s.slot, outputs.len()));
            }
            outputs.push(RequestOutput {
                request_id: Arc::clone(&req.id),
                token,
                index,
                finished: None,
            });
        }
        let slots: Vec<usize> = done.iter().map(|d| d.0).collect();
        for (slot, mut st) in self.sched.remove_finished(&slots) {
            self.kv.free(&mut self.pool, &mut st);
            let fin = finish(&mut self.metrics, &st, end, FinishReason::Length);
            let at = done.iter().find(|d| d.0 == slot).map(|d| d.1);
            if let Some(o) = at.and_then(|i| outputs.get_mut(i)) {
                o.finished = Some(fin);
            }
        }
        outputs
    }

    fn take_batch(&mut self, end: SimTime) -> Option<KvEventBatch> {
        let events = self.pool.take_events();
        if events.is_empty() {
            return None;
        }
        Some(KvEventBatch {
            ts: end.as_secs_f64(),
            events,
            data_parallel_rank: self.cfg.data_parallel_rank,
        })
    }

    /// Checks the engine's invariants across scheduler and pool (for tests and debugging):
    /// pool structure, one reference per request holding a block, limits respected.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        if self.sched.num_running() > self.cfg.max_num_seqs {
            return Err(format!(
                "{} running > max_num_seqs",
                self.sched.num_running()
            ));
        }
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for st in self.sched.states() {
            if st.status != Status::Running && !st.blocks.is_empty() {
                return Err(format!("{} holds blocks while not running", st.id));
            }
            if st.blocks.len() * self.cfg.block_size < st.num_computed {
                return Err(format!("{} computed tokens exceed its blocks", st.id));
            }
            // A block in use is never evicted: the cached prefix of a request keeps its digests.
            for (i, b) in st.blocks.iter().take(st.num_cached_blocks).enumerate() {
                if self.hasher.is_some() && self.pool.digest(*b) != st.digests.get(i).copied() {
                    return Err(format!(
                        "{}: block {} lost its digest while in use",
                        st.id, b.0
                    ));
                }
            }
            for b in &st.blocks {
                if let Some(r) = refs.get_mut(b.0 as usize) {
                    *r += 1;
                }
            }
        }
        for (i, r) in refs.iter().enumerate().skip(1) {
            let actual = self
                .pool
                .ref_count(crate::block_pool::BlockId(i as u32))
                .unwrap_or(0);
            if actual != *r {
                return Err(format!("block {i}: ref_cnt {actual} but {r} holders"));
            }
        }
        Ok(())
    }
}

fn record_token(m: &mut EngineMetrics, req: &mut ReqState, end: SimTime) {
    m.generation_tokens += 1;
    match req.last_token {
        None => {
            m.ttft
                .observe(end.saturating_since(req.arrival).as_secs_f64());
            m.prompt_tokens += req.num_prompt as u64;
            req.first_token = Some(end);
        }
        Some(prev) => m.itl.observe(end.saturating_since(prev).as_secs_f64()),
    }
    req.last_token = Some(end);
}

fn finish(m: &mut EngineMetrics, st: &ReqState, end: SimTime, reason: FinishReason) -> Finished {
    match reason {
        FinishReason::Stop => m.requests_finished_stop += 1,
        FinishReason::Abort => m.requests_aborted += 1,
        FinishReason::Length => m.requests_finished_length += 1,
    }
    m.e2e
        .observe(end.saturating_since(st.arrival).as_secs_f64());
    if let Some(s) = st.first_scheduled {
        m.queue_time
            .observe(s.saturating_since(st.arrival).as_secs_f64());
        if let Some(f) = st.first_token {
            m.prefill_time.observe(f.saturating_since(s).as_secs_f64());
        }
    }
    if let Some(f) = st.first_token {
        m.decode_time.observe(end.saturating_since(f).as_secs_f64());
    }
    Finished {
        reason,
        usage: Usage {
            prompt_tokens: st.num_prompt,
            completion_tokens: st.num_output(),
            cached_tokens: st.num_cached_tokens.unwrap_or(0),
        },
        arrival: st.arrival,
        first_scheduled: st.first_scheduled,
        first_token: st.first_token,
        finished_at: end,
        num_preemptions: st.num_preemptions,
    }
}
