//! Hot-prefix warming (`warm` of a pool), what to warm and when: when the fair-share cap spills a hot prefix onto a
//! worker that lacks it (`Reason::PrefixSpread`), the prefix alone (`max_tokens: 1`) is sent to
//! one worker so that later spills find it cached: the chosen worker itself (`chosen`, next to
//! its request) or the next within-cap worker that lacks it (`next`, where the following spill
//! is likely to go).
//!
//! Pure pieces (no I/O): the plan from a decision, the warm's body, and the per-pool table of
//! cooldowns and warms in flight; `crate::warming` sends them.
//!
//! Invariants: a (prefix, worker) pair is warmed at most once per `cooldown_ms`, through a table
//! of at most [`SEEN_CAPACITY`] pairs; at most `max_in_flight` warms of a pool run at once (a
//! [`Place`] is held for each and given back when dropped).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kinference_index::WorkerId;
use kinference_policy::{Decision, Reason, Score};
use kinference_vllm::BlockHash;
use parking_lot::Mutex;
use serde_json::{json, Value};

use crate::config::{WarmConfig, WarmMode};

/// (prefix, worker) pairs remembered for the cooldown; beyond it, expired ones are dropped and
/// a warm that still finds the table full is skipped.
const SEEN_CAPACITY: usize = 4096;

/// A warm to send: the worker, and the blocks of the prompt that make the hot prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub worker: WorkerId,
    pub blocks: u32,
    /// Blocks of the prefix the worker is credited with already.
    pub cached_blocks: u32,
}

/// Whom to warm after `decision`, if anyone: only on a spread (a worker over the fair-share cap
/// holds more of the prefix than any within it), the hot prefix being that worker's cached
/// blocks, and only a within-cap, scorable worker lacking at least `min_blocks` of it.
pub(crate) fn plan(mode: WarmMode, decision: &Decision, min_blocks: u32) -> Option<Plan> {
    if decision.reason != Reason::PrefixSpread {
        return None;
    }
    let hot = decision
        .scores
        .iter()
        .filter(|s| s.over_cap && s.scorable)
        .map(|s| s.gpu_blocks)
        .max()?;
    let lacks = |s: &&Score| {
        !s.over_cap && s.scorable && hot.saturating_sub(s.gpu_blocks) >= min_blocks.max(1)
    };
    let target = match mode {
        WarmMode::Off => return None,
        WarmMode::Chosen => decision.scores.first().filter(lacks)?,
        // Scores are in rank order: the first within-cap worker after the chosen one is where
        // the next spill of the same prefix goes, all else equal.
        WarmMode::Next => decision.scores.iter().skip(1).find(lacks)?,
    };
    Some(Plan {
        worker: target.worker,
        blocks: hot,
        cached_blocks: target.gpu_blocks,
    })
}

/// Why a planned warm was not sent (the `reason` label of `kinference_warms_skipped_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Skip {
    /// The prefix was warmed on that worker less than `cooldown_ms` ago.
    Cooldown,
    /// `max_in_flight` warms of the pool are running.
    InFlight,
    /// The cooldown table is full of unexpired entries.
    Full,
    /// The worker is at `max_in_flight_per_replica`, or left the pool.
    NoRoom,
}

impl Skip {
    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Cooldown => "cooldown",
            Skip::InFlight => "in_flight",
            Skip::Full => "full",
            Skip::NoRoom => "no_room",
        }
    }
}

/// One pool's warming state: when each (prefix, worker) was last warmed, and warms running.
#[derive(Debug, Default)]
pub(crate) struct Warmer {
    /// Keyed by the prefix's last block hash (which covers every block before it).
    seen: Mutex<HashMap<(BlockHash, WorkerId), Duration>>,
    in_flight: Arc<AtomicU32>,
}

/// A place among a pool's warms in flight, given back when dropped.
#[derive(Debug)]
pub(crate) struct Place(Arc<AtomicU32>);

impl Drop for Place {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Warmer {
    /// Takes a place for a warm of `key` at `now`, or says why not.
    pub fn admit(
        &self,
        key: (BlockHash, WorkerId),
        now: Duration,
        cooldown: Duration,
        max_in_flight: u32,
    ) -> Result<Place, Skip> {
        let fresh = |at: &Duration| now < at.saturating_add(cooldown);
        let mut seen = self.seen.lock();
        if seen.get(&key).is_some_and(fresh) {
            return Err(Skip::Cooldown);
        }
        if self.in_flight.load(Ordering::Relaxed) >= max_in_flight {
            return Err(Skip::InFlight);
        }
        if seen.len() >= SEEN_CAPACITY && !seen.contains_key(&key) {
            seen.retain(|_, at| fresh(at));
            if seen.len() >= SEEN_CAPACITY {
                return Err(Skip::Full);
            }
        }
        seen.insert(key, now);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(Place(self.in_flight.clone()))
    }
}

/// The body of a warm: the prefix's token ids as a completion of one token, not streamed.
pub(crate) fn body(
    model: &str,
    prompt: &[u32],
    cache_salt: Option<&str>,
    cfg: &WarmConfig,
) -> Value {
    let mut b = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": 1,
        "stream": false,
    });
    if let Some(salt) = cache_salt {
        b["cache_salt"] = json!(salt);
    }
    if let Some(p) = cfg.priority {
        b["priority"] = json!(p);
    }
    b
}

#[cfg(test)]
mod tests {
    use kinference_index::{ReplicaId, WorkerId};
    use kinference_vllm::DpRank;

    use super::*;

    fn worker(r: u32) -> WorkerId {
        WorkerId {
            replica: ReplicaId(r),
            rank: DpRank(0),
        }
    }

    fn score(r: u32, gpu_blocks: u32, over_cap: bool) -> Score {
        Score {
            worker: worker(r),
            gpu_blocks,
            offloaded_blocks: 0,
            speculative_blocks: 0,
            predicted_cached_tokens: 0,
            load: 0.0,
            over_cap,
            scorable: true,
            value: 0.0,
        }
    }

    fn decision(reason: Reason, scores: Vec<Score>) -> Decision {
        Decision {
            ranked: scores.iter().map(|s| s.worker).collect(),
            reason,
            scores,
            policy: "precise",
        }
    }

    /// Worker 0 over the cap holds 128 blocks; 1 and 2 within it hold none; 3 holds 126.
    fn spread() -> Decision {
        decision(
            Reason::PrefixSpread,
            vec![
                score(1, 0, false),
                score(3, 126, false),
                score(2, 0, false),
                score(0, 128, true),
            ],
        )
    }

    #[test]
    fn only_a_spread_is_warmed() {
        let mut d = spread();
        d.reason = Reason::CachedPrefix;
        assert_eq!(plan(WarmMode::Next, &d, 4), None);
        d.reason = Reason::LoadOverCache;
        assert_eq!(plan(WarmMode::Chosen, &d, 4), None);
        assert_eq!(plan(WarmMode::Off, &spread(), 4), None);
    }

    #[test]
    fn chosen_warms_the_spill_target_with_the_hot_prefix() {
        let p = plan(WarmMode::Chosen, &spread(), 4).unwrap();
        assert_eq!(p.worker, worker(1));
        assert_eq!(p.blocks, 128);
        assert_eq!(p.cached_blocks, 0);
    }

    #[test]
    fn next_skips_the_chosen_and_workers_that_nearly_hold_it() {
        // Worker 3 lacks only 2 blocks (< min_blocks 4): worker 2 is next.
        let p = plan(WarmMode::Next, &spread(), 4).unwrap();
        assert_eq!(p.worker, worker(2));
        assert_eq!(p.blocks, 128);
        // With min_blocks 2, worker 3 lacks enough.
        assert_eq!(
            plan(WarmMode::Next, &spread(), 2).unwrap().worker,
            worker(3)
        );
    }

    #[test]
    fn no_within_cap_worker_lacking_it_means_no_warm() {
        let d = decision(
            Reason::PrefixSpread,
            vec![score(1, 0, false), score(0, 128, true), score(2, 128, true)],
        );
        assert_eq!(plan(WarmMode::Next, &d, 4), None);
        assert_eq!(plan(WarmMode::Chosen, &d, 4).unwrap().worker, worker(1));
        let mut unscorable = d.clone();
        unscorable.scores[0].scorable = false;
        assert_eq!(plan(WarmMode::Chosen, &unscorable, 4), None);
    }

    #[test]
    fn a_prefix_is_warmed_on_a_worker_once_per_cooldown() {
        let w = Warmer::default();
        let key = (BlockHash(7), worker(1));
        let cool = Duration::from_secs(10);
        let t = Duration::from_secs(100);
        let first = w.admit(key, t, cool, 4).unwrap();
        assert_eq!(
            w.admit(key, t + Duration::from_secs(9), cool, 4)
                .unwrap_err(),
            Skip::Cooldown
        );
        // Another worker, or another prefix, is its own pair.
        let other = w.admit((BlockHash(7), worker(2)), t, cool, 4).unwrap();
        drop((first, other));
        assert!(w.admit(key, t + cool, cool, 4).is_ok());
    }

    #[test]
    fn warms_in_flight_are_capped_and_places_come_back() {
        let w = Warmer::default();
        let cool = Duration::from_secs(10);
        let t = Duration::ZERO;
        let a = w.admit((BlockHash(1), worker(1)), t, cool, 2).unwrap();
        let _b = w.admit((BlockHash(2), worker(1)), t, cool, 2).unwrap();
        assert_eq!(
            w.admit((BlockHash(3), worker(1)), t, cool, 2).unwrap_err(),
            Skip::InFlight
        );
        drop(a);
        assert!(w.admit((BlockHash(3), worker(1)), t, cool, 2).is_ok());
    }

    #[test]
    fn a_full_table_drops_expired_pairs_first() {
        let w = Warmer::default();
        let cool = Duration::from_secs(10);
        for i in 0..SEEN_CAPACITY as u64 {
            drop(
                w.admit((BlockHash(i), worker(0)), Duration::ZERO, cool, 1)
                    .unwrap(),
            );
        }
        assert_eq!(
            w.admit(
                (BlockHash(u64::MAX), worker(0)),
                Duration::from_secs(1),
                cool,
                1
            )
            .unwrap_err(),
            Skip::Full
        );
        // Once they expire, there is room again.
        assert!(w
            .admit((BlockHash(u64::MAX), worker(0)), cool, cool, 1)
            .is_ok());
        assert_eq!(w.seen.lock().len(), 1);
    }

    #[test]
    fn the_warm_body_carries_salt_and_priority_only_when_given() {
        let mut cfg = WarmConfig::default();
        let b = body("m", &[1, 2, 3], None, &cfg);
        assert_eq!(
            b,
            json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1, "stream": false})
        );
        cfg.priority = Some(5);
        let b = body("m", &[1], Some("s"), &cfg);
        assert_eq!(b["cache_salt"], "s");
        assert_eq!(b["priority"], 5);
    }
}
