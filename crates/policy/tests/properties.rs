//! Seeded random checks: the tracker against a naive model, and decision invariants on
//! random fleets. A failure prints the seed and step.

use std::collections::HashMap;
use std::time::Duration;

use kinference_index::{ReplicaId, TierCounts, WorkerId};
use kinference_policy::{Candidate, Load, Policy, PolicyConfig, PrefixTracker, RequestCtx};
use kinference_vllm::{BlockHash, DpRank};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The tracker's contract, written the slow way: a map of deadlines, capacity enforced by
/// dropping the pair with the earliest deadline (oldest insertion among equals).
#[derive(Default)]
struct Naive {
    deadlines: HashMap<(BlockHash, WorkerId), (Duration, u64)>,
    stamp: u64,
}

impl Naive {
    fn insert(&mut self, w: WorkerId, hs: &[BlockHash], now: Duration, ttl: Duration, cap: usize) {
        self.deadlines.retain(|_, (d, _)| *d > now);
        for h in hs {
            self.stamp += 1;
            self.deadlines
                .insert((*h, w), (now.saturating_add(ttl), self.stamp));
        }
        while self.deadlines.len() > cap {
            let Some(oldest) = self
                .deadlines
                .iter()
                .min_by_key(|(_, v)| **v)
                .map(|(k, _)| *k)
            else {
                break;
            };
            self.deadlines.remove(&oldest);
        }
    }

    fn prefix_len(&self, w: WorkerId, hs: &[BlockHash], now: Duration) -> u32 {
        hs.iter()
            .take_while(|h| self.deadlines.get(&(**h, w)).is_some_and(|(d, _)| *d > now))
            .count() as u32
    }
}

#[test]
fn tracker_matches_the_naive_model() {
    // Seeds from 20 on never expire anything (a tracker without a TTL).
    for seed in 0..30u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let forever = seed >= 20;
        let ttl = if forever {
            Duration::MAX
        } else {
            Duration::from_millis(rng.gen_range(1..200))
        };
        let cap = rng.gen_range(1..60);
        let steps = if forever { 4_000 } else { 2_000 };
        let mut t = PrefixTracker::new(ttl, cap);
        let mut n = Naive::default();
        let mut now = Duration::ZERO;
        for step in 0..steps {
            now += Duration::from_millis(rng.gen_range(0..20));
            let w = WorkerId::new(ReplicaId(rng.gen_range(0..4)), DpRank(0));
            let root = rng.gen_range(0..6u64);
            let len = rng.gen_range(0..12u64);
            let hs: Vec<BlockHash> = (0..len).map(|i| BlockHash(root * 100 + i)).collect();
            match rng.gen_range(0..10) {
                0..=2 => {
                    t.insert(w, &hs, now);
                    n.insert(w, &hs, now, ttl, cap);
                }
                // Last block first, the receipt dropped.
                3..=4 => {
                    let reversed: Vec<BlockHash> = hs.iter().rev().copied().collect();
                    let _ = t.insert(w, &reversed, now);
                    n.insert(w, &reversed, now, ttl, cap);
                }
                5 => {
                    t.expire(now);
                }
                // Only what an index did not confirm: the blocks from some point on.
                6..=7 => {
                    let from = rng.gen_range(0..=hs.len());
                    t.insert(w, &hs[from..], now);
                    n.insert(w, &hs[from..], now, ttl, cap);
                }
                _ => {}
            }
            for r in 0..4 {
                let qw = WorkerId::new(ReplicaId(r), DpRank(0));
                let want = n.prefix_len(qw, &hs, now);
                assert_eq!(
                    t.prefix_len(qw, &hs, now),
                    want,
                    "seed {seed} step {step} worker {r}"
                );
                // What lengthens a known prefix: the run held from block `known` on.
                for known in 0..=hs.len() as u32 + 1 {
                    let run = hs
                        .get(known as usize..)
                        .map_or(0, |rest| n.prefix_len(qw, rest, now));
                    assert_eq!(
                        t.prefix_len_beyond(qw, &hs, known, now),
                        if run > 0 { known + run } else { 0 },
                        "seed {seed} step {step} worker {r} known {known}"
                    );
                }
            }
            assert!(t.len() <= cap, "seed {seed} step {step}");
        }
    }
}

#[test]
fn decisions_are_complete_ordered_and_deterministic() {
    let configs = [
        PolicyConfig::from_name("precise").unwrap(),
        PolicyConfig::from_name("approximate").unwrap(),
        PolicyConfig::RoundRobin,
        PolicyConfig::LeastLoad,
        PolicyConfig::SessionAffinity,
    ];
    for seed in 0..50u64 {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let n = rng.gen_range(1..12u32);
        let cands: Vec<Candidate> = (0..n)
            .map(|i| {
                let gpu = rng.gen_range(0..30);
                Candidate {
                    worker: WorkerId::new(ReplicaId(i / 2), DpRank(i % 2)),
                    load: Load {
                        running: rng.gen_range(0..20),
                        waiting: rng.gen_range(0..5),
                        kv_usage: rng.gen_range(0.0..1.0),
                        in_flight: rng.gen_range(0..20),
                        in_flight_prefill_tokens: rng.gen_range(0..5000),
                    },
                    cache: TierCounts {
                        gpu,
                        cpu: 0,
                        storage: 0,
                        any: gpu + rng.gen_range(0..5),
                    },
                    scorable: rng.gen_bool(0.9),
                }
            })
            .collect();
        let hs: Vec<BlockHash> = (0..30).map(BlockHash).collect();
        let session = format!("s{seed}");
        let req = RequestCtx {
            hashes: &hs,
            prompt_tokens: 30 * 16,
            block_size: 16,
            session: rng.gen_bool(0.5).then_some(session.as_str()),
            ticket: rng.gen(),
        };
        for cfg in &configs {
            let p = Policy::new(cfg.clone());
            let d = p.select(&req, &cands, Duration::ZERO);
            assert_eq!(d, p.select(&req, &cands, Duration::ZERO), "seed {seed}");
            // The winner alone, as a baseline asks for it: the same worker, ties included
            // (an idle fleet is all ties, broken by the ticket's rotation).
            assert_eq!(
                p.choose(&req, &cands, Duration::ZERO),
                d.chosen(),
                "seed {seed} {}",
                p.name()
            );
            let idle: Vec<Candidate> = cands
                .iter()
                .map(|c| Candidate {
                    load: Load::default(),
                    ..*c
                })
                .collect();
            assert_eq!(
                p.choose(&req, &idle, Duration::ZERO),
                p.select(&req, &idle, Duration::ZERO).chosen(),
                "seed {seed} {} idle",
                p.name()
            );
            assert_eq!(d.ranked.len(), cands.len(), "seed {seed} {}", p.name());
            let mut seen: Vec<_> = d.ranked.clone();
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), cands.len(), "seed {seed} {}", p.name());
            for (r, s) in d.ranked.iter().zip(&d.scores) {
                assert_eq!(*r, s.worker);
            }
            if matches!(cfg, PolicyConfig::Precise(_) | PolicyConfig::Approximate(_)) {
                // Within-cap candidates first, each group by non-increasing value.
                for pair in d.scores.windows(2) {
                    let (a, b) = (&pair[0], &pair[1]);
                    assert!(!a.over_cap || b.over_cap, "seed {seed}");
                    if a.over_cap == b.over_cap {
                        assert!(a.value >= b.value, "seed {seed}: {a:?} before {b:?}");
                    }
                }
            }
            if matches!(cfg, PolicyConfig::LeastLoad) {
                let min = cands
                    .iter()
                    .map(|c| c.load.outstanding())
                    .fold(f64::MAX, f64::min);
                assert_eq!(d.scores[0].load, min, "seed {seed}");
            }
        }
    }
}
