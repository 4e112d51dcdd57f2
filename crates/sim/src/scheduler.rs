//! vLLM v1's scheduler (vllm/v1/core/sched/scheduler.py, 0.32), first-come-first-served:
//! continuous batching under a token budget, chunked prefill, and recompute preemption.
//!
//! One call to `schedule` is one engine step's decision:
//! 1. Running requests in order get `num_tokens - num_computed` tokens (one for a decode, a
//!    chunk for an unfinished prefill), capped by the budget. When their blocks cannot be
//!    allocated, the last running request is preempted — its blocks freed (they stay cached
//!    until evicted), its progress reset, and it goes to the front of the waiting queue —
//!    until the allocation fits or the request preempts itself.
//! 2. Only if nobody was preempted, waiting requests are admitted in order while the budget,
//!    `max_num_seqs` and the free blocks allow; each first looks up its cached prefix.
//!
//! Invariants: at most `max_num_seqs` requests run; the scheduled tokens never exceed
//! `max_num_batched_tokens`; without chunked prefill a prompt is never split.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kinference_vllm::BlockHasher;

use crate::block_pool::BlockPool;
use crate::kv_cache::KvCacheManager;
use crate::metrics::EngineMetrics;
use crate::request::{ReqState, Status};
use crate::time::SimTime;

/// The scheduler's limits (vLLM's `SchedulerConfig`).
#[derive(Clone, Debug)]
pub(crate) struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub chunked_prefill: bool,
    /// Caps one prefill chunk when more than one request is eligible (0: no cap).
    pub long_prefill_token_threshold: usize,
}

/// One request's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scheduled {
    pub slot: usize,
    pub new_tokens: usize,
    /// Tokens already in its KV cache (computed or hit) before this step.
    pub context: usize,
}

#[derive(Debug, Default)]
pub(crate) struct ScheduleOutcome {
    pub scheduled: Vec<Scheduled>,
    pub num_preempted: usize,
}

/// What `schedule` needs from the engine.
pub(crate) struct SchedCtx<'a> {
    pub pool: &'a mut BlockPool,
    pub kv: &'a KvCacheManager,
    pub hasher: Option<&'a BlockHasher>,
    pub now: SimTime,
    pub metrics: &'a mut EngineMetrics,
}

/// Request table and queues.
#[derive(Debug)]
pub(crate) struct Scheduler {
    cfg: SchedulerConfig,
    slots: Vec<Option<ReqState>>,
    free_slots: Vec<usize>,
    index: HashMap<Arc<str>, usize>,
    waiting: VecDeque<usize>,
    running: Vec<usize>,
}

impl Scheduler {
    pub(crate) fn new(cfg: SchedulerConfig) -> Self {
        Scheduler {
            cfg,
            slots: Vec::new(),
            free_slots: Vec::new(),
            index: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    pub(crate) fn contains(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }

    pub(crate) fn slot_of(&self, id: &str) -> Option<usize> {
        self.index.get(id).copied()
    }

    pub(crate) fn num_running(&self) -> usize {
        self.running.len()
    }

    pub(crate) fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn get(&self, slot: usize) -> Option<&ReqState> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    pub(crate) fn get_mut(&mut self, slot: usize) -> Option<&mut ReqState> {
        self.slots.get_mut(slot).and_then(Option::as_mut)
    }

    /// Every live request (for invariant checks).
    pub(crate) fn states(&self) -> impl Iterator<Item = &ReqState> {
        self.slots.iter().filter_map(Option::as_ref)
    }

    /// Queues a new request at the back of the waiting queue.
    pub(crate) fn insert(&mut self, st: ReqState) -> usize {
        let id = Arc::clone(&st.id);
        let slot = match self.free_slots.pop() {
            Some(s) => {
                if let Some(cell) = self.slots.get_mut(s) {
                    *cell = Some(st);
                }
                s
            }
            None => {
                self.slots.push(Some(st));
                self.slots.len() - 1
            }
        };
        self.index.insert(id, slot);
        self.waiting.push_back(slot);
        slot
    }

    /// Removes a request from whichever queue holds it and from the table.
    pub(crate) fn remove(&mut self, slot: usize) -> Option<ReqState> {
        if let Some(i) = self.running.iter().position(|s| *s == slot) {
            self.running.remove(i);
        } else if let Some(i) = self.waiting.iter().position(|s| *s == slot) {
            self.waiting.remove(i);
        }
        self.take(slot)
    }

    /// Removes finished running requests (one pass over the running list), with their slots.
    pub(crate) fn remove_finished(&mut self, slots: &[usize]) -> Vec<(usize, ReqState)> {
        if slots.is_empty() {
            return Vec::new();
        }
        let mut sorted = slots.to_vec();
        sorted.sort_unstable();
        self.running.retain(|s| sorted.binary_search(s).is_err());
        slots
            .iter()
            .filter_map(|&s| self.take(s).map(|st| (s, st)))
            .collect()
    }

    fn take(&mut self, slot: usize) -> Option<ReqState> {
        let st = self.slots.get_mut(slot)?.take()?;
        self.index.remove(&st.id);
        self.free_slots.push(slot);
        Some(st)
    }

    /// Decides one step; advances `num_computed` of every scheduled request.
    pub(crate) fn schedule(&mut self, ctx: &mut SchedCtx<'_>) -> ScheduleOutcome {
        let mut out = ScheduleOutcome::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        // A long prefill may only be capped when it would starve someone.
        let eligible = self.running.len() + self.waiting.len();
        let threshold = if eligible > 1 {
            self.cfg.long_prefill_token_threshold
        } else {
            0
        };
        self.schedule_running(ctx, &mut budget, threshold, &mut out);
        if out.num_preempted == 0 {
            self.schedule_waiting(ctx, &mut budget, threshold, &mut out);
        }
        for s in &out.scheduled {
            if let Some(r) = self.get_mut(s.slot) {
                r.num_computed += s.new_tokens;
            }
        }
        out
    }

    fn schedule_running(
        &mut self,
        ctx: &mut SchedCtx<'_>,
        budget: &mut usize,
        threshold: usize,
        out: &mut ScheduleOutcome,
    ) {
        let mut i = 0;
        while *budget > 0 {
            let Some(&slot) = self.running.get(i) else {
                break;
            };
            let Some(req) = self.get(slot) else {
                self.running.remove(i);
                continue;
            };
            let context = req.num_computed;
            let n = cap(req.num_tokens() - context, threshold, *budget);
            if n == 0 {
                i += 1;
                continue;
            }
            if !self.allocate_or_preempt(ctx, slot, n, out) {
                break;
            }
            out.scheduled.push(Scheduled {
                slot,
                new_tokens: n,
                context,
            });
            *budget -= n;
            i += 1;
        }
    }

    /// Allocates `n` tokens of room for running request `slot`, preempting from the back of
    /// the running list until it fits; false when `slot` had to preempt itself.
    fn allocate_or_preempt(
        &mut self,
        ctx: &mut SchedCtx<'_>,
        slot: usize,
        n: usize,
        out: &mut ScheduleOutcome,
    ) -> bool {
        loop {
            let Some(req) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
                return false;
            };
            if ctx.kv.allocate_slots(ctx.pool, req, n, &[], ctx.hasher) {
                return true;
            }
            let Some(victim) = self.running.pop() else {
                return false;
            };
            self.preempt(ctx, victim);
            out.num_preempted += 1;
            if victim == slot {
                return false;
            }
        }
    }

    fn preempt(&mut self, ctx: &mut SchedCtx<'_>, slot: usize) {
        if let Some(req) = self.slots.get_mut(slot).and_then(Option::as_mut) {
            ctx.kv.free(ctx.pool, req);
            req.num_computed = 0;
            req.status = Status::Preempted;
            req.num_preemptions += 1;
            ctx.metrics.num_preemptions += 1;
            self.waiting.push_front(slot);
        }
    }

    fn schedule_waiting(
        &mut self,
        ctx: &mut SchedCtx<'_>,
        budget: &mut usize,
        threshold: usize,
        out: &mut ScheduleOutcome,
    ) {
        while *budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&slot) = self.waiting.front() else {
                break;
            };
            let Some(req) = self.get(slot) else {
                self.waiting.pop_front();
                continue;
            };
            let lookup = req.num_computed == 0;
            let (hits, hit_tokens) = if lookup {
                ctx.kv.computed_blocks(ctx.pool, req)
            } else {
                (Vec::new(), 0)
            };
            let context = req.num_computed + hit_tokens;
            let wanted = req.num_tokens() - context;
            if !self.cfg.chunked_prefill && cap(wanted, threshold, usize::MAX) > *budget {
                break;
            }
            let n = cap(wanted, threshold, *budget);
            let Some(req) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
                break;
            };
            if n == 0 || !ctx.kv.allocate_slots(ctx.pool, req, n, &hits, ctx.hasher) {
                break;
            }
            if lookup {
                record_lookup(ctx.metrics, req, hit_tokens);
            }
            admit(req, context, hit_tokens, ctx.now);
            self.waiting.pop_front();
            self.running.push(slot);
            out.scheduled.push(Scheduled {
                slot,
                new_tokens: n,
                context,
            });
            *budget -= n;
        }
    }
}

fn cap(wanted: usize, threshold: usize, budget: usize) -> usize {
    let n = if threshold > 0 {
        wanted.min(threshold)
    } else {
        wanted
    };
    n.min(budget)
}

fn record_lookup(metrics: &mut EngineMetrics, req: &ReqState, hit_tokens: usize) {
    let queries = req.num_tokens() as u64;
    if req.num_preemptions > 0 {
        metrics.preempted_prefix_cache_queries += queries;
        metrics.preempted_prefix_cache_hits += hit_tokens as u64;
    } else {
        metrics.prefix_cache_queries += queries;
        metrics.prefix_cache_hits += hit_tokens as u64;
    }
}

fn admit(req: &mut ReqState, context: usize, hit_tokens: usize, now: SimTime) {
    req.status = Status::Running;
    req.num_computed = context;
    if req.num_cached_tokens.is_none() {
        req.num_cached_tokens = Some(hit_tokens);
    }
    if req.first_scheduled.is_none() {
        req.first_scheduled = Some(now);
    }
}
