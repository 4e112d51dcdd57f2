//! Injected faults on the live KV-event stream (`--events-drop-pct`, `--events-dup-pct`,
//! `--events-reorder-pct`): a test harness's way to exercise a subscriber's gap, duplicate and
//! restart handling without a lossy network.
//!
//! Only live sends are affected: every batch still enters the replay buffer with its own
//! sequence number, so a dropped batch is one a PUB socket lost at its high-water mark (a
//! replay recovers it), a duplicate is the same frames sent twice, and a reordered batch is
//! held back and sent right after the next one (or alone once [`HOLD_MAX`] passes, so a quiet
//! stream does not keep it forever). Decisions come from a seeded generator: one seed, one
//! sequence of faults. All percentages 0 (the default) sends every batch once, in order.

use std::time::Duration;

/// Longest time a held-back (reordered) batch waits for a successor before it is sent alone.
pub const HOLD_MAX: Duration = Duration::from_millis(200);

/// How often each fault happens, per live batch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EventFaults {
    /// Percent of batches not sent live (0..=100).
    pub drop_pct: f64,
    /// Percent of sent batches sent twice.
    pub dup_pct: f64,
    /// Percent of sent batches held back and sent after the next one.
    pub reorder_pct: f64,
    /// Seed of the decisions.
    pub seed: u64,
}

/// A fault percentage outside 0..=100 (or not a number).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("events-{name}-pct must be within 0..=100, not {value}")]
pub struct FaultRangeError {
    /// `drop`, `dup` or `reorder`.
    pub name: &'static str,
    pub value: f64,
}

impl EventFaults {
    /// Whether any fault can happen.
    pub fn any(&self) -> bool {
        self.drop_pct > 0.0 || self.dup_pct > 0.0 || self.reorder_pct > 0.0
    }

    /// Checks that every percentage is within 0..=100; the error names the bad one.
    pub fn validate(&self) -> Result<(), FaultRangeError> {
        for (name, value) in [
            ("drop", self.drop_pct),
            ("dup", self.dup_pct),
            ("reorder", self.reorder_pct),
        ] {
            if !(0.0..=100.0).contains(&value) {
                return Err(FaultRangeError { name, value });
            }
        }
        Ok(())
    }
}

/// Counts of what was done, for logs and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultCounts {
    pub dropped: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

/// The fault state of one stream: the generator and the batch held back, if any.
#[derive(Debug)]
pub struct Faulty<M> {
    faults: EventFaults,
    rng: u64,
    held: Option<M>,
    pub counts: FaultCounts,
}

impl<M: Clone> Faulty<M> {
    pub fn new(faults: EventFaults) -> Self {
        Faulty {
            faults,
            rng: faults.seed,
            held: None,
            counts: FaultCounts::default(),
        }
    }

    /// splitmix64: small, seedable, good enough to spread faults evenly.
    fn roll(&mut self, pct: f64) -> bool {
        if pct <= 0.0 {
            return false;
        }
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 53 random bits as a fraction in [0, 1).
        ((z >> 11) as f64 / (1u64 << 53) as f64) * 100.0 < pct
    }

    /// The messages to send now, in order, for the next batch `m`.
    pub fn on_batch(&mut self, m: M) -> Vec<M> {
        if self.roll(self.faults.drop_pct) {
            self.counts.dropped += 1;
            return Vec::new();
        }
        let mut out = Vec::with_capacity(3);
        if let Some(h) = self.held.take() {
            // The held batch goes right after its successor: the pair arrives swapped.
            out.push(m.clone());
            if self.roll(self.faults.dup_pct) {
                self.counts.duplicated += 1;
                out.push(m);
            }
            out.push(h);
            return out;
        }
        if self.roll(self.faults.reorder_pct) {
            self.counts.reordered += 1;
            self.held = Some(m);
            return out;
        }
        out.push(m.clone());
        if self.roll(self.faults.dup_pct) {
            self.counts.duplicated += 1;
            out.push(m);
        }
        out
    }

    /// Whether a batch is held back (then call [`Faulty::release`] after [`HOLD_MAX`]).
    pub fn holding(&self) -> bool {
        self.held.is_some()
    }

    /// The held-back batch, if any, to send alone.
    pub fn release(&mut self) -> Option<M> {
        self.held.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(f: EventFaults, n: u32) -> (Vec<u32>, FaultCounts) {
        let mut s = Faulty::new(f);
        let mut out = Vec::new();
        for m in 0..n {
            out.extend(s.on_batch(m));
        }
        out.extend(s.release());
        (out, s.counts)
    }

    #[test]
    fn no_faults_sends_everything_once_in_order() {
        let f = EventFaults::default();
        assert!(!f.any());
        let (out, counts) = run(f, 100);
        assert_eq!(out, (0..100).collect::<Vec<_>>());
        assert_eq!(counts, FaultCounts::default());
    }

    #[test]
    fn certain_faults_do_exactly_that() {
        let all = |drop_pct, dup_pct, reorder_pct| EventFaults {
            drop_pct,
            dup_pct,
            reorder_pct,
            seed: 1,
        };
        assert_eq!(run(all(100.0, 0.0, 0.0), 5).0, Vec::<u32>::new());
        assert_eq!(run(all(0.0, 100.0, 0.0), 3).0, vec![0, 0, 1, 1, 2, 2]);
        // Every other batch is held and follows its successor; the last one is released.
        assert_eq!(run(all(0.0, 0.0, 100.0), 5).0, vec![1, 0, 3, 2, 4]);
    }

    #[test]
    fn rates_follow_the_percentages_and_the_seed_decides() {
        let f = EventFaults {
            drop_pct: 5.0,
            dup_pct: 3.0,
            reorder_pct: 2.0,
            seed: 42,
        };
        let (out, c) = run(f, 20_000);
        assert_eq!(run(f, 20_000), (out.clone(), c), "same seed, same faults");
        let other = run(EventFaults { seed: 43, ..f }, 20_000);
        assert_ne!(other.0, out, "another seed, other faults");
        // Binomial bounds far outside chance (several standard deviations) for this seed.
        assert!((800..1200).contains(&c.dropped), "{c:?}");
        assert!((400..750).contains(&c.duplicated), "{c:?}");
        assert!((250..550).contains(&c.reordered), "{c:?}");
        // Nothing is lost but the drops, nothing appears but the duplicates.
        assert_eq!(out.len() as u64, 20_000 - c.dropped + c.duplicated, "{c:?}");
        let mut sorted = out.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len() as u64, 20_000 - c.dropped);
    }

    #[test]
    fn out_of_range_percentages_are_refused() {
        let bad = EventFaults {
            dup_pct: 101.0,
            ..EventFaults::default()
        };
        assert_eq!(bad.validate().unwrap_err().name, "dup");
        assert!(EventFaults {
            drop_pct: f64::NAN,
            ..EventFaults::default()
        }
        .validate()
        .is_err());
        assert!(EventFaults::default().validate().is_ok());
    }
}
