//! Cached prefix against load: the scoring shared by the precise and approximate policies,
//! and the load-only orderings.
//!
//! For candidate `i` with outstanding requests `l_i` (fleet mean `m`, fair share
//! `f = (Σl + 1) / n`):
//!
//! ```text
//!   cached_i = gpu_i + offload_credit · (any_i − gpu_i)            (blocks; 0 if unscorable)
//!   value_i  = cached_i · block_size
//!            − load_weight_tokens · l_i / max(m, 1)
//!            − pending_prefill_weight · in_flight_prefill_tokens_i
//!            − kv_pressure_tokens · max(0, kv_usage_i − threshold) / (1 − threshold)
//!   over_cap_i = l_i + 1 > max(fair_share_cap · f, f + fair_share_slack, ⌈f⌉)
//! ```
//!
//! The cap is a ratio under load and an absolute slack at low concurrency: with a handful of
//! requests in flight a ratio alone would move a conversation off the replica holding it over
//! one or two extra requests, which cost far less than recomputing its prefix.
//!
//! Ranking: within-cap before over-cap, then higher value, then lower load, then rotation by
//! the request's ticket, so equal candidates take turns instead of the first one always winning.

use std::cmp::Ordering;

use kinference_index::WorkerId;

use crate::config::PreciseConfig;
use crate::types::{Candidate, Decision, Reason, Score};

/// Cache credit of one candidate, in blocks, before weighting.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Credit {
    pub gpu: u32,
    pub offloaded: u32,
    pub speculative: u32,
}

pub(crate) fn rank_by_cache(
    cfg: &PreciseConfig,
    policy: &'static str,
    candidates: &[Candidate],
    credits: &[Credit],
    prompt_tokens: u32,
    block_size: u32,
    ticket: u64,
) -> Decision {
    let n = candidates.len();
    if n == 0 {
        return Decision::empty(policy);
    }
    let scale = Scale::new(cfg, candidates, prompt_tokens, block_size);
    // Each score with its candidate's position, for the rotation among ties, sorted in place:
    // the order [`sorted_order`] would give, without its list of indices.
    let mut tagged: Vec<(usize, Score)> = candidates
        .iter()
        .zip(credits)
        .map(|(c, cr)| scale.score(cfg, c, cr))
        .enumerate()
        .collect();
    // If every candidate is over the cap (possible only with a cap near 1), nobody is.
    if tagged.iter().all(|(_, s)| s.over_cap) {
        for (_, s) in &mut tagged {
            s.over_cap = false;
        }
    }
    let rot = rotation(n, ticket);
    tagged.sort_by(|(a, sa), (b, sb)| {
        sa.over_cap
            .cmp(&sb.over_cap)
            .then(sb.value.total_cmp(&sa.value))
            .then(sa.load.total_cmp(&sb.load))
            .then(rot(*a).cmp(&rot(*b)))
    });
    // Collected from a borrowing iterator, so into a new list of exactly `n`: `into_iter()`
    // would reuse the pairs' allocation and shrink it with a realloc (a score is smaller).
    let scores: Vec<Score> = tagged.iter().map(|&(_, s)| s).collect();
    let reason = cache_reason(&scores);
    Decision {
        ranked: scores.iter().map(|s| s.worker).collect(),
        reason,
        scores,
        policy,
    }
}

/// The terms of one ranking that depend on the whole candidate set.
#[derive(Clone, Copy, Debug)]
struct Scale {
    /// Mean outstanding requests, at least 1.
    mean: f64,
    /// The load above which a candidate is over the fair-share cap.
    cap: f64,
    pressure_span: f64,
    prompt_tokens: u32,
    block_size: u32,
}

impl Scale {
    fn new(
        cfg: &PreciseConfig,
        candidates: &[Candidate],
        prompt_tokens: u32,
        block_size: u32,
    ) -> Self {
        let n = candidates.len() as f64;
        let total: f64 = candidates.iter().map(|c| c.load.outstanding()).sum();
        let fair = (total + 1.0) / n;
        // With few requests in flight the cap must still admit the next whole request on some
        // worker, or every worker would be "over" it; the slack keeps the ratio from biting
        // when the fair share is only a request or two.
        let cap = (cfg.fair_share_cap * fair)
            .max(fair + cfg.fair_share_slack)
            .max(fair.ceil());
        Scale {
            mean: (total / n).max(1.0),
            cap,
            pressure_span: (1.0 - cfg.kv_pressure_threshold).max(1e-9),
            prompt_tokens,
            block_size,
        }
    }

    /// One candidate's score (the module doc's `value_i` and `over_cap_i`).
    #[inline]
    fn score(&self, cfg: &PreciseConfig, c: &Candidate, cr: &Credit) -> Score {
        let load = c.load.outstanding();
        let (gpu, offloaded, speculative) = if c.scorable {
            (cr.gpu, cr.offloaded, cr.speculative)
        } else {
            (0, 0, 0)
        };
        let cached_blocks = f64::from(gpu) + cfg.offload_credit * f64::from(offloaded);
        let pressure = (c.load.kv_usage - cfg.kv_pressure_threshold).max(0.0) / self.pressure_span;
        let value = cached_blocks * f64::from(self.block_size)
            - cfg.load_weight_tokens * load / self.mean
            - cfg.pending_prefill_weight * c.load.in_flight_prefill_tokens as f64
            - cfg.kv_pressure_tokens * pressure.min(1.0);
        let predicted = (u64::from(gpu.saturating_add(offloaded)) * u64::from(self.block_size))
            .min(u64::from(self.prompt_tokens));
        Score {
            worker: c.worker,
            gpu_blocks: gpu,
            offloaded_blocks: offloaded,
            speculative_blocks: speculative,
            predicted_cached_tokens: u32::try_from(predicted).unwrap_or(u32::MAX),
            load,
            over_cap: load + 1.0 > self.cap,
            scorable: c.scorable,
            value,
        }
    }
}

fn cache_reason(scores: &[Score]) -> Reason {
    let Some(first) = scores.first() else {
        return Reason::NoCandidates;
    };
    let credit = |s: &Score| (s.gpu_blocks, s.offloaded_blocks);
    let best_within = scores
        .iter()
        .filter(|s| !s.over_cap)
        .map(credit)
        .max()
        .unwrap_or_default();
    let best_over = scores
        .iter()
        .filter(|s| s.over_cap)
        .map(credit)
        .max()
        .unwrap_or_default();
    if best_over > credit(first) && best_over > best_within {
        Reason::PrefixSpread
    } else if best_within > credit(first) {
        Reason::LoadOverCache
    } else if credit(first) > (0, 0) {
        Reason::CachedPrefix
    } else if best_over > (0, 0) {
        Reason::PrefixSpread
    } else {
        Reason::NoCache
    }
}

/// Load-only scores (round-robin, least-load, session affinity): no cache credit.
pub(crate) fn load_scores(candidates: &[Candidate]) -> Vec<Score> {
    candidates
        .iter()
        .map(|c| Score {
            worker: c.worker,
            gpu_blocks: 0,
            offloaded_blocks: 0,
            speculative_blocks: 0,
            predicted_cached_tokens: 0,
            load: c.load.outstanding(),
            over_cap: false,
            scorable: c.scorable,
            value: -c.load.outstanding(),
        })
        .collect()
}

/// Indices `0..n` sorted by `cmp`, ties broken by rotation: a start position drawn from the
/// ticket comes first among equals, then the ones after it, wrapping around.
pub(crate) fn sorted_order(
    n: usize,
    ticket: u64,
    mut cmp: impl FnMut(usize, usize) -> Ordering,
) -> Vec<usize> {
    let rot = rotation(n, ticket);
    let mut idx: Vec<usize> = (0..n).collect();
    idx.sort_by(|&a, &b| cmp(a, b).then(rot(a).cmp(&rot(b))));
    idx
}

/// The first index of [`sorted_order`] with the same arguments, in one pass and without
/// allocating (for callers that need only the winner).
pub(crate) fn first_in_order(
    n: usize,
    ticket: u64,
    mut cmp: impl FnMut(usize, usize) -> Ordering,
) -> Option<usize> {
    let rot = rotation(n, ticket);
    (0..n).min_by(|&a, &b| cmp(a, b).then(rot(a).cmp(&rot(b))))
}

/// Each index's place in the rotation of ties that `ticket` starts.
fn rotation(n: usize, ticket: u64) -> impl Fn(usize) -> usize {
    // The ticket is mixed first: callers that step their counter by a fixed stride (two
    // tickets per request, say) would otherwise start every rotation on the same few workers.
    let start = if n == 0 {
        0
    } else {
        (splitmix(ticket) % n as u64) as usize
    };
    move |i: usize| (i + n - start) % n
}

/// Reorders `scores` (given in candidate order) by `order` into a decision.
pub(crate) fn decision_from(
    policy: &'static str,
    reason: Reason,
    scores: Vec<Score>,
    order: &[usize],
) -> Decision {
    let scores: Vec<Score> = order
        .iter()
        .filter_map(|&i| scores.get(i).copied())
        .collect();
    Decision {
        ranked: scores.iter().map(|s| s.worker).collect(),
        reason,
        scores,
        policy,
    }
}

/// Rendezvous (highest random weight) hashing: a session keeps its worker as long as that
/// worker stays, and only the sessions of a leaving worker move.
pub(crate) fn rendezvous_weight(session: &str, worker: WorkerId) -> u64 {
    // FNV-1a over the key, then splitmix64 finalisation with the worker mixed in: stable across
    // builds and platforms, unlike std's randomly keyed hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in session.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let w = (u64::from(worker.replica.0) << 32) | u64::from(worker.rank.0);
    splitmix(h ^ splitmix(w))
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
