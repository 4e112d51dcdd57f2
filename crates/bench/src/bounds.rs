//! Hit-rate references without a timing model: what a prefix cache could serve if routing
//! and capacity were the only limits.
//!
//! * `infinite`: one cache that never evicts — no policy on any fleet can beat it;
//! * `pooled`: one LRU cache as large as the whole fleet's (N × blocks per replica) — what
//!   perfect cache sharing across replicas would give;
//! * `round_robin` and `capped_greedy`: N LRU caches, requests dealt round-robin, or to the
//!   longest cached prefix among replicas within 1.1 × the fair request count (the reference
//!   the shared trace statistics quote).
//!
//! Prompts are processed in arrival order at the engines' block granularity: a request looks
//! up its leading full blocks (at most `len - 1` tokens, as vLLM does) and then inserts all of
//! its full blocks, most recently used last. Running requests do not pin blocks here and
//! generated tokens are not cached, so with timing the engines do somewhat worse.

use std::collections::{HashMap, HashSet, VecDeque};

use kinference_sim::request::splitmix64;
use serde::Serialize;

use crate::text::sim_tokens;
use crate::workload::Workload;

/// The references for one workload and fleet shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Bounds {
    pub replicas: usize,
    pub blocks_per_replica: usize,
    pub block_size: usize,
    pub prompt_tokens: u64,
    pub infinite_hit_rate: f64,
    pub pooled_hit_rate: f64,
    pub round_robin_hit_rate: f64,
    pub capped_greedy_hit_rate: f64,
    /// Max ÷ mean requests per replica under the capped greedy rule.
    pub capped_greedy_imbalance: f64,
}

/// A block-key LRU of fixed capacity. Keys chain (each commits to its prefix), so a hit is
/// the leading run of present keys.
#[derive(Debug)]
struct Lru {
    cap: usize,
    stamp_of: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
    tick: u64,
}

impl Lru {
    fn new(cap: usize) -> Self {
        Lru {
            cap: cap.max(1),
            stamp_of: HashMap::new(),
            order: VecDeque::new(),
            tick: 0,
        }
    }

    fn matched(&self, keys: &[u64]) -> usize {
        keys.iter()
            .take_while(|k| self.stamp_of.contains_key(k))
            .count()
    }

    fn insert(&mut self, keys: &[u64]) {
        for &k in keys {
            self.tick += 1;
            self.stamp_of.insert(k, self.tick);
            self.order.push_back((k, self.tick));
        }
        while self.stamp_of.len() > self.cap {
            let Some((k, t)) = self.order.pop_front() else {
                break;
            };
            if self.stamp_of.get(&k) == Some(&t) {
                self.stamp_of.remove(&k);
            }
        }
        // Re-touched keys leave stale queue entries; keep the queue proportional to the set.
        if self.order.len() > 2 * self.stamp_of.len() + 4096 {
            let live = &self.stamp_of;
            self.order.retain(|(k, t)| live.get(k) == Some(t));
        }
    }
}

/// Chained keys of the full `block_size` blocks of `tokens`.
fn block_keys(tokens: &[u32], block_size: usize) -> Vec<u64> {
    let mut prev = 0x243f_6a88_85a3_08d3u64;
    tokens
        .chunks_exact(block_size.max(1))
        .map(|c| {
            let mut h = prev;
            for &t in c {
                h = splitmix64(h ^ u64::from(t));
            }
            prev = h;
            h
        })
        .collect()
}

/// Computes the references for `w` (chat prompts tokenized) on `replicas` engines of
/// `blocks_per_replica` blocks of `block_size` tokens, prompts from `vocab`.
pub fn compute(
    w: &Workload,
    replicas: usize,
    blocks_per_replica: usize,
    block_size: usize,
    vocab: u32,
    max_model_len: usize,
) -> Bounds {
    let n = replicas.max(1);
    let bs = block_size.max(1);
    let mut infinite: HashSet<u64> = HashSet::new();
    let mut pooled = Lru::new(blocks_per_replica.saturating_mul(n));
    let mut rr: Vec<Lru> = (0..n).map(|_| Lru::new(blocks_per_replica)).collect();
    let mut greedy = CappedGreedy::new(n, blocks_per_replica);
    let (mut total, mut h_inf, mut h_pool, mut h_rr) = (0u64, 0, 0, 0);
    let mut i = 0usize;
    for r in &w.requests {
        let tokens = sim_tokens(&r.prompt, vocab);
        if tokens.is_empty() || tokens.len() >= max_model_len {
            continue;
        }
        let keys = block_keys(&tokens, bs);
        let lookup = keys.get(..(tokens.len() - 1) / bs).unwrap_or(&keys);
        total += tokens.len() as u64;
        let inf = lookup.iter().take_while(|k| infinite.contains(k)).count();
        h_inf += inf;
        infinite.extend(keys.iter().copied());
        h_pool += pooled.matched(lookup);
        pooled.insert(&keys);
        if let Some(c) = rr.get_mut(i % n) {
            h_rr += c.matched(lookup);
            c.insert(&keys);
        }
        greedy.place(i, lookup, &keys);
        i += 1;
    }
    let frac = |blocks: usize| {
        if total == 0 {
            0.0
        } else {
            (blocks * bs) as f64 / total as f64
        }
    };
    Bounds {
        replicas: n,
        blocks_per_replica,
        block_size: bs,
        prompt_tokens: total,
        infinite_hit_rate: frac(h_inf),
        pooled_hit_rate: frac(h_pool),
        round_robin_hit_rate: frac(h_rr),
        capped_greedy_hit_rate: frac(greedy.hits),
        capped_greedy_imbalance: crate::stats::imbalance(&greedy.load),
    }
}

/// Greedy placement on the longest cached prefix, capped at 1.1 × the fair share of the
/// requests placed so far (ties to the least loaded).
struct CappedGreedy {
    caches: Vec<Lru>,
    load: Vec<u64>,
    /// Blocks found cached, summed over every placement.
    hits: usize,
}

impl CappedGreedy {
    fn new(n: usize, blocks_per_replica: usize) -> Self {
        CappedGreedy {
            caches: (0..n).map(|_| Lru::new(blocks_per_replica)).collect(),
            load: vec![0u64; n],
            hits: 0,
        }
    }

    /// Places request `i` (0-based) with `lookup` blocks to match and `keys` to cache.
    fn place(&mut self, i: usize, lookup: &[u64], keys: &[u64]) {
        let n = self.load.len();
        let cap = 1.1 * (i + 1) as f64 / n as f64;
        let eligible: Vec<usize> = (0..n)
            .filter(|&j| (self.load[j] + 1) as f64 <= cap)
            .collect();
        let cands: Vec<usize> = if eligible.is_empty() {
            (0..n).collect()
        } else {
            eligible
        };
        let mut best: Option<(usize, u64, usize)> = None;
        for j in cands {
            let m = self.caches.get(j).map_or(0, |c| c.matched(lookup));
            let better = match best {
                None => true,
                Some((bm, bl, _)) => m > bm || (m == bm && self.load[j] < bl),
            };
            if better {
                best = Some((m, self.load[j], j));
            }
        }
        if let Some((m, _, j)) = best {
            self.hits += m;
            self.load[j] += 1;
            if let Some(c) = self.caches.get_mut(j) {
                c.insert(keys);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Prompt, WorkRequest};

    fn req(ids: Vec<u64>) -> WorkRequest {
        WorkRequest {
            at: 0.0,
            session: None,
            prompt: Prompt::Blocks {
                len: ids.len() * 64,
                ids,
                block_tokens: 64,
            },
            max_tokens: 1,
        }
    }

    #[test]
    fn lru_evicts_least_recently_used() {
        let mut l = Lru::new(3);
        l.insert(&[1, 2, 3]);
        l.insert(&[1]);
        l.insert(&[4]);
        assert_eq!(l.matched(&[1]), 1);
        assert_eq!(l.matched(&[2]), 0);
        assert_eq!(l.matched(&[3, 4]), 2);
    }

    #[test]
    fn bounds_are_ordered_on_a_shared_prefix_workload() {
        // Three prefixes of 8 ids, each followed by a unique id, arriving cyclically on 4
        // replicas that each hold one request's blocks: round-robin never finds the group it
        // served last, a prefix-aware rule mostly does.
        let mut reqs = Vec::new();
        for i in 0..200u64 {
            let g = i % 3;
            let mut ids: Vec<u64> = (0..8).map(|b| g * 100 + b).collect();
            ids.push(10_000 + i);
            reqs.push(req(ids));
        }
        let w = Workload::new("t", reqs);
        let b = compute(&w, 4, 40, 16, 32_000, 100_000);
        assert!(b.infinite_hit_rate >= b.pooled_hit_rate);
        assert!(b.pooled_hit_rate >= b.capped_greedy_hit_rate - 1e-9);
        assert!(b.capped_greedy_hit_rate > b.round_robin_hit_rate);
        // 8 of 9 blocks shared; the first request of each group misses.
        assert_eq!(b.round_robin_hit_rate, 0.0);
        assert!(b.capped_greedy_hit_rate > 0.5, "{b:?}");
        assert!((b.infinite_hit_rate - (197.0 * 8.0 / 9.0) / 200.0).abs() < 1e-9);
        // Tiny caches: nothing survives between two requests of a group.
        let tiny = compute(&w, 4, 4, 64, 32_000, 100_000);
        assert_eq!(tiny.round_robin_hit_rate, 0.0);
    }
}
