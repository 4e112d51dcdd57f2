//! Seeded randomized tests: the block pool against a naive reference of vLLM's rules, and
//! whole engines under random load against a reference of the event stream.
//!
//! A failure names its seed; rerun one with `SIM_SEED=<seed> cargo test -p kinference-sim
//! --test invariants_random`.

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use kinference_sim::{BlockId, BlockPool, Engine, EngineConfig, EventOptions, Request, SimTime};
use kinference_vllm::{BlockDigest, EventHashForm, KvEvent, RequestExtras};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn seeds(default: std::ops::Range<u64>) -> Vec<u64> {
    match std::env::var("SIM_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(s) => vec![s],
        None => default.collect(),
    }
}

fn digest(k: u8) -> BlockDigest {
    BlockDigest::from_bytes(&[k; 32]).unwrap()
}

/// vLLM's block-pool rules written the slow, obvious way.
struct RefPool {
    refcnt: Vec<u32>,
    key: Vec<Option<u8>>,
    free: Vec<u32>,
    cache: Vec<(u8, u32)>,
    removed: Vec<u8>,
}

impl RefPool {
    fn new(n: usize) -> Self {
        RefPool {
            refcnt: vec![0; n],
            key: vec![None; n],
            free: (1..n as u32).collect(),
            cache: Vec::new(),
            removed: Vec::new(),
        }
    }

    fn allocate(&mut self, k: usize) -> Option<Vec<u32>> {
        if k > self.free.len() {
            return None;
        }
        let got: Vec<u32> = self.free.drain(..k).collect();
        for &b in &got {
            if let Some(key) = self.key[b as usize].take() {
                if let Some(i) = self.cache.iter().position(|&(k2, b2)| k2 == key && b2 == b) {
                    self.cache.remove(i);
                    self.removed.push(key);
                }
            }
            self.refcnt[b as usize] = 1;
        }
        Some(got)
    }

    fn free(&mut self, ordered: &[u32]) {
        let (mut first, mut last) = (Vec::new(), Vec::new());
        for &b in ordered {
            if self.refcnt[b as usize] == 0 {
                continue;
            }
            self.refcnt[b as usize] -= 1;
            if self.refcnt[b as usize] == 0 {
                if self.key[b as usize].is_none() {
                    first.push(b)
                } else {
                    last.push(b)
                }
            }
        }
        first.append(&mut self.free);
        first.extend(last);
        self.free = first;
    }

    fn touch(&mut self, b: u32) {
        if self.refcnt[b as usize] == 0 {
            self.free.retain(|&x| x != b);
        }
        self.refcnt[b as usize] += 1;
    }

    fn cache(&mut self, b: u32, key: u8) {
        if self.key[b as usize].is_none() {
            self.key[b as usize] = Some(key);
            self.cache.push((key, b));
        }
    }

    fn get_cached(&self, key: u8) -> Option<u32> {
        self.cache.iter().find(|&&(k, _)| k == key).map(|&(_, b)| b)
    }
}

fn removed_keys(p: &mut BlockPool) -> Vec<u8> {
    p.take_events()
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) => {
                let h = r.block_hashes[0].block_hash().0;
                Some((h & 0xff) as u8)
            }
            _ => None,
        })
        .collect()
}

#[test]
fn block_pool_matches_the_reference_under_random_operations() {
    for seed in seeds(0..40) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = rng.gen_range(4..40);
        let mut pool = BlockPool::new(n, true, EventOptions::default()).unwrap();
        let mut reference = RefPool::new(n);
        let mut held: Vec<u32> = Vec::new();
        for op in 0..400 {
            let ctx = format!("seed {seed} op {op}");
            match rng.gen_range(0..4) {
                0 => {
                    let k = rng.gen_range(0..4);
                    let got = pool
                        .allocate(k)
                        .map(|v| v.iter().map(|b| b.0).collect::<Vec<_>>());
                    assert_eq!(got, reference.allocate(k), "{ctx}");
                    held.extend(got.unwrap_or_default());
                }
                1 if !held.is_empty() => {
                    held.shuffle(&mut rng);
                    let k = rng.gen_range(1..=held.len());
                    let gone: Vec<u32> = held.drain(..k).collect();
                    pool.free(gone.iter().map(|&b| BlockId(b)));
                    reference.free(&gone);
                }
                2 if !held.is_empty() => {
                    let b = held[rng.gen_range(0..held.len())];
                    let key = rng.gen_range(1..12u8);
                    pool.cache_full_blocks(&[BlockId(b)], &[digest(key)], None);
                    reference.cache(b, key);
                }
                _ => {
                    let key = rng.gen_range(1..12u8);
                    let got = pool.get_cached(&digest(key)).map(|b| b.0);
                    assert_eq!(got, reference.get_cached(key), "{ctx}");
                    if let Some(b) = got.filter(|_| rng.gen_bool(0.5)) {
                        pool.touch(&[BlockId(b)]);
                        reference.touch(b);
                        held.push(b);
                    }
                }
            }
            let order: Vec<u32> = pool.free_order().iter().map(|b| b.0).collect();
            assert_eq!(order, reference.free, "{ctx}: free-queue (eviction) order");
            assert_eq!(
                removed_keys(&mut pool),
                std::mem::take(&mut reference.removed),
                "{ctx}"
            );
            for b in 1..n as u32 {
                assert_eq!(
                    pool.ref_count(BlockId(b)),
                    Some(reference.refcnt[b as usize]),
                    "{ctx}"
                );
            }
            pool.check_invariants()
                .map_err(|e| format!("{ctx}: {e}"))
                .unwrap();
        }
    }
}

/// The event stream as a subscriber sees it: stored minus removed minus cleared.
#[derive(Default)]
struct EventModel {
    live: HashMap<u64, u32>,
}

impl EventModel {
    fn apply(&mut self, ev: &KvEvent, ctx: &str) {
        match ev {
            KvEvent::BlockStored(s) => {
                assert_eq!(
                    s.block_hashes.len() * s.block_size as usize,
                    s.token_ids.len(),
                    "{ctx}"
                );
                assert_eq!(
                    s.extra_keys.as_ref().map(Vec::len),
                    Some(s.block_hashes.len()),
                    "{ctx}"
                );
                for h in &s.block_hashes {
                    *self.live.entry(h.block_hash().0).or_default() += 1;
                }
            }
            KvEvent::BlockRemoved(r) => {
                assert_eq!(
                    r.block_hashes.len(),
                    1,
                    "{ctx}: one BlockRemoved per evicted hash"
                );
                let h = r.block_hashes[0].block_hash().0;
                let c = self
                    .live
                    .get_mut(&h)
                    .unwrap_or_else(|| panic!("{ctx}: removed {h} never stored"));
                *c -= 1;
                if *c == 0 {
                    self.live.remove(&h);
                }
            }
            KvEvent::AllBlocksCleared => self.live.clear(),
        }
    }
}

fn cached_multiset(e: &Engine) -> HashMap<u64, u32> {
    let mut m = HashMap::new();
    for (d, _) in e.block_pool().cached_blocks() {
        *m.entry(d.event_hash().0).or_default() += 1;
    }
    m
}

fn random_request(rng: &mut ChaCha8Rng, i: usize, families: &[Vec<u32>]) -> Request {
    let fam = &families[rng.gen_range(0..families.len())];
    let shared = rng.gen_range(0..=fam.len());
    let own = rng.gen_range(1..40);
    let prompt: Vec<u32> = fam[..shared]
        .iter()
        .copied()
        .chain((0..own).map(|_| rng.gen_range(0..500)))
        .collect();
    Request::new(format!("r{i}"), prompt, rng.gen_range(1..24))
}

fn check_step(e: &Engine, model: &EventModel, cfg: &EngineConfig, scheduled: usize, ctx: &str) {
    e.check_invariants()
        .map_err(|err| format!("{ctx}: {err}"))
        .unwrap();
    assert!(scheduled <= cfg.max_num_batched_tokens, "{ctx}");
    assert!(e.num_running() <= cfg.max_num_seqs, "{ctx}");
    let u = e.kv_cache_usage();
    assert!((0.0..=1.0).contains(&u), "{ctx}: usage {u}");
    assert_eq!(
        cached_multiset(e),
        model.live,
        "{ctx}: cached hashes != stored - removed"
    );
}

#[test]
fn engines_keep_their_invariants_under_random_load() {
    let (mut preemptions, mut evictions) = (0u64, 0u64);
    for seed in seeds(0..12) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut cfg = EngineConfig::small(rng.gen_range(42..90), [4, 8][rng.gen_range(0..2)]);
        cfg.max_num_seqs = rng.gen_range(2..12);
        cfg.max_num_batched_tokens = rng.gen_range(16..128);
        cfg.max_model_len = 160;
        cfg.events.hash_form = EventHashForm::Int;
        let mut e = Engine::new(cfg.clone()).unwrap();
        let families: Vec<Vec<u32>> = (0..4)
            .map(|f| (0..120).map(|t| f * 1000 + t).collect())
            .collect();
        let mut model = EventModel::default();
        let (mut now, mut next_id, mut finished, mut aborted) =
            (SimTime::ZERO, 0usize, 0usize, 0usize);
        let total = 250;
        for step in 0..20_000 {
            let ctx = format!("seed {seed} step {step}");
            while next_id < total && rng.gen_bool(0.3) {
                e.add_request(random_request(&mut rng, next_id, &families), now)
                    .unwrap();
                next_id += 1;
            }
            if rng.gen_bool(0.02) && next_id > 0 {
                aborted += usize::from(e.abort(&format!("r{}", rng.gen_range(0..next_id))));
            }
            if rng.gen_bool(0.01) {
                let _ = e.reset_prefix_cache();
            }
            let o = e.step(now);
            now = o
                .finished_at
                .max(now.saturating_add(std::time::Duration::from_millis(1)));
            for ev in o.events.iter().flat_map(|b| &b.events) {
                model.apply(ev, &ctx);
                evictions += u64::from(matches!(ev, KvEvent::BlockRemoved(_)));
            }
            finished += o.outputs.iter().filter(|x| x.finished.is_some()).count();
            check_step(&e, &model, &cfg, o.scheduled_tokens, &ctx);
            if next_id == total && !e.has_work() {
                break;
            }
        }
        assert_eq!(
            finished + aborted,
            total,
            "seed {seed}: every request finishes or is aborted"
        );
        let m = e.metrics();
        assert_eq!(m.requests_finished_length as usize, finished, "seed {seed}");
        assert!(m.prefix_cache_hits <= m.prefix_cache_queries, "seed {seed}");
        assert!(
            m.prefix_cache_hits > 0,
            "seed {seed}: shared prefixes must hit"
        );
        assert_eq!(
            e.block_pool().num_free(),
            e.block_pool().num_blocks() - 1,
            "seed {seed}"
        );
        preemptions += m.num_preemptions;
    }
    if std::env::var("SIM_SEED").is_err() {
        // The workload must exercise the paths under test, not just pass by being gentle.
        assert!(preemptions > 0, "no preemption in any seed");
        assert!(evictions > 0, "no eviction in any seed");
    }
}

#[test]
fn event_stream_rebuilds_the_cache_of_a_fresh_engine_replay() {
    // Two engines fed the same requests publish the same events: the simulator is a pure
    // function of its inputs and clock.
    let build = || {
        let mut e = Engine::new(EngineConfig::small(40, 4)).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        let families: Vec<Vec<u32>> = (0..3)
            .map(|f| (0..60).map(|t| f * 1000 + t).collect())
            .collect();
        let mut now = SimTime::ZERO;
        let mut all = Vec::new();
        for i in 0..60 {
            e.add_request(random_request(&mut rng, i, &families), now)
                .unwrap();
            let o = e.step(now);
            now = o.finished_at;
            all.extend(o.events.map(|b| b.events).unwrap_or_default());
        }
        while e.has_work() {
            let o = e.step(now);
            now = o.finished_at;
            all.extend(o.events.map(|b| b.events).unwrap_or_default());
        }
        (all, e.block_pool().cached_blocks().len())
    };
    let (a, na) = build();
    let (b, nb) = build();
    assert_eq!(a, b);
    assert_eq!(na, nb);
    assert!(
        a.iter().any(|e| matches!(e, KvEvent::BlockRemoved(_))),
        "the pool was under pressure"
    );
    let _ = RequestExtras::default();
}
