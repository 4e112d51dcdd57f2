//! Synthetic workload generators, all seeded and all in [`Prompt::Blocks`] form:
//!
//! * [`SharedPrefix`]: groups of requests sharing a long prefix (a system prompt, a document),
//!   group popularity Zipf-distributed, each request with a unique suffix;
//! * [`MultiTurn`]: chat conversations whose turn `t` carries the whole history;
//! * [`PrefixRatio`]: fixed-length prompts of which a given fraction is shared, for sweeps of
//!   the shared fraction.
//!
//! Lengths are whole blocks of [`SYNTH_BLOCK`] tokens: a block id stands for fixed content,
//! so a prefix that ended mid-block could not be shared exactly.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::BenchError;
use crate::workload::{exponential, Prompt, WorkRequest, Workload};

/// Tokens per block id in generated workloads.
pub const SYNTH_BLOCK: usize = 64;

/// Hands out fresh block ids; the top bits name the generator so workloads never collide.
struct Ids {
    next: u64,
}

impl Ids {
    fn new(tag: u64) -> Self {
        Ids { next: tag << 48 }
    }

    fn take(&mut self, n: usize) -> Vec<u64> {
        let out: Vec<u64> = (self.next..self.next + n as u64).collect();
        self.next += n as u64;
        out
    }
}

fn blocks_of(tokens: usize) -> usize {
    tokens.div_ceil(SYNTH_BLOCK)
}

/// Zipf(s) over `n` ranks, sampled by inverse CDF.
#[derive(Clone, Debug)]
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    pub fn new(n: usize, s: f64) -> Result<Self, BenchError> {
        if n == 0 || !s.is_finite() || s < 0.0 {
            return Err(BenchError::Config(format!(
                "Zipf needs n >= 1 and s >= 0, got n={n} s={s}"
            )));
        }
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (1..=n)
            .map(|k| {
                acc += 1.0 / (k as f64).powf(s);
                acc
            })
            .collect();
        for c in &mut cdf {
            *c /= acc;
        }
        Ok(Zipf { cdf })
    }

    /// A rank in `0..n`, 0 the most popular.
    pub fn sample(&self, rng: &mut impl Rng) -> usize {
        let u: f64 = rng.gen();
        self.cdf.partition_point(|c| *c < u).min(self.cdf.len() - 1)
    }
}

/// Groups of requests sharing a prefix, popularity Zipf(`zipf_s`).
#[derive(Clone, Debug, PartialEq)]
pub struct SharedPrefix {
    pub requests: usize,
    pub groups: usize,
    pub zipf_s: f64,
    pub prefix_tokens: usize,
    pub suffix_tokens: usize,
    pub output_tokens: u32,
    /// Requests per second (Poisson); re-timing later may replace these times.
    pub rate: f64,
    pub seed: u64,
}

impl Default for SharedPrefix {
    fn default() -> Self {
        SharedPrefix {
            requests: 2000,
            groups: 32,
            zipf_s: 1.1,
            prefix_tokens: 4096,
            suffix_tokens: 256,
            output_tokens: 64,
            rate: 20.0,
            seed: 1,
        }
    }
}

impl SharedPrefix {
    pub fn generate(&self) -> Result<Workload, BenchError> {
        positive_rate(self.rate)?;
        let zipf = Zipf::new(self.groups, self.zipf_s)?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut ids = Ids::new(1);
        let prefixes: Vec<Vec<u64>> = (0..self.groups)
            .map(|_| ids.take(blocks_of(self.prefix_tokens)))
            .collect();
        let suffix_blocks = blocks_of(self.suffix_tokens.max(1));
        let mut at = 0.0;
        let mut reqs = Vec::with_capacity(self.requests);
        for _ in 0..self.requests {
            let g = zipf.sample(&mut rng);
            let mut p = prefixes.get(g).cloned().unwrap_or_default();
            p.extend(ids.take(suffix_blocks));
            reqs.push(WorkRequest {
                at,
                session: Some(g as u64),
                prompt: Prompt::Blocks {
                    len: p.len() * SYNTH_BLOCK,
                    ids: p,
                    block_tokens: SYNTH_BLOCK,
                },
                max_tokens: self.output_tokens.max(1),
            });
            at += exponential(&mut rng, self.rate);
        }
        Ok(Workload::new(
            format!(
                "shared-prefix ({} groups, Zipf {}, {}+{} tokens)",
                self.groups, self.zipf_s, self.prefix_tokens, self.suffix_tokens
            ),
            reqs,
        ))
    }
}

/// Multi-turn chats: each conversation picks one of `system_prompts` shared system prompts;
/// turn `t` sends the system prompt, every earlier user turn and reply, and the new user turn.
#[derive(Clone, Debug, PartialEq)]
pub struct MultiTurn {
    pub conversations: usize,
    pub turns: usize,
    pub system_prompts: usize,
    pub system_tokens: usize,
    pub user_tokens: usize,
    pub reply_tokens: u32,
    /// Conversation starts per second (Poisson).
    pub start_rate: f64,
    /// Seconds between a turn's arrival and the next one's.
    pub think_secs: f64,
    pub seed: u64,
}

impl Default for MultiTurn {
    fn default() -> Self {
        MultiTurn {
            conversations: 400,
            turns: 6,
            system_prompts: 4,
            system_tokens: 1024,
            user_tokens: 256,
            reply_tokens: 192,
            start_rate: 2.0,
            think_secs: 10.0,
            seed: 2,
        }
    }
}

impl MultiTurn {
    pub fn generate(&self) -> Result<Workload, BenchError> {
        positive_rate(self.start_rate)?;
        if self.system_prompts == 0 || self.turns == 0 {
            return Err(BenchError::Config(
                "multi-turn needs at least one system prompt and one turn".into(),
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut ids = Ids::new(2);
        let systems: Vec<Vec<u64>> = (0..self.system_prompts)
            .map(|_| ids.take(blocks_of(self.system_tokens)))
            .collect();
        let mut reqs = Vec::new();
        let mut start = 0.0;
        for c in 0..self.conversations {
            let sys = rng.gen_range(0..self.system_prompts);
            let mut history = systems.get(sys).cloned().unwrap_or_default();
            let mut at = start;
            for _ in 0..self.turns {
                history.extend(ids.take(blocks_of(self.user_tokens.max(1))));
                reqs.push(WorkRequest {
                    at,
                    session: Some(c as u64),
                    prompt: Prompt::Blocks {
                        ids: history.clone(),
                        len: history.len() * SYNTH_BLOCK,
                        block_tokens: SYNTH_BLOCK,
                    },
                    max_tokens: self.reply_tokens.max(1),
                });
                // The reply comes back as the next turn's history.
                history.extend(ids.take(blocks_of(self.reply_tokens.max(1) as usize)));
                at += self.think_secs;
            }
            start += exponential(&mut rng, self.start_rate);
        }
        Ok(Workload::new(
            format!(
                "multi-turn ({} conversations x {} turns)",
                self.conversations, self.turns
            ),
            reqs,
        ))
    }
}

/// Fixed-length prompts whose first `prefix_ratio` is shared within one of `groups` groups.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefixRatio {
    pub requests: usize,
    pub prompt_tokens: usize,
    pub prefix_ratio: f64,
    pub groups: usize,
    pub output_tokens: u32,
    pub rate: f64,
    pub seed: u64,
}

impl Default for PrefixRatio {
    fn default() -> Self {
        PrefixRatio {
            requests: 2000,
            prompt_tokens: 2048,
            prefix_ratio: 0.5,
            groups: 16,
            output_tokens: 64,
            rate: 20.0,
            seed: 3,
        }
    }
}

impl PrefixRatio {
    pub fn generate(&self) -> Result<Workload, BenchError> {
        positive_rate(self.rate)?;
        if !(0.0..=1.0).contains(&self.prefix_ratio) || self.groups == 0 {
            return Err(BenchError::Config(format!(
                "prefix ratio must be in [0, 1] and groups >= 1, got {} and {}",
                self.prefix_ratio, self.groups
            )));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut ids = Ids::new(3);
        let total = blocks_of(self.prompt_tokens.max(1));
        let shared = ((total as f64 * self.prefix_ratio).round() as usize).min(total);
        let prefixes: Vec<Vec<u64>> = (0..self.groups).map(|_| ids.take(shared)).collect();
        let mut at = 0.0;
        let reqs = (0..self.requests)
            .map(|_| {
                let g = rng.gen_range(0..self.groups);
                let mut p = prefixes.get(g).cloned().unwrap_or_default();
                p.extend(ids.take(total - shared));
                let r = WorkRequest {
                    at,
                    session: Some(g as u64),
                    prompt: Prompt::Blocks {
                        len: p.len() * SYNTH_BLOCK,
                        ids: p,
                        block_tokens: SYNTH_BLOCK,
                    },
                    max_tokens: self.output_tokens.max(1),
                };
                at += exponential(&mut rng, self.rate);
                r
            })
            .collect();
        Ok(Workload::new(
            format!(
                "prefix-ratio {:.2} ({} tokens, {} groups)",
                self.prefix_ratio, self.prompt_tokens, self.groups
            ),
            reqs,
        ))
    }
}

fn positive_rate(r: f64) -> Result<(), BenchError> {
    if r.is_finite() && r > 0.0 {
        Ok(())
    } else {
        Err(BenchError::Config(format!(
            "rate must be positive, got {r}"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(r: &WorkRequest) -> &[u64] {
        match &r.prompt {
            Prompt::Blocks { ids, .. } => ids,
            _ => panic!("not blocks"),
        }
    }

    #[test]
    fn zipf_favours_low_ranks() {
        let z = Zipf::new(10, 1.2).unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut counts = [0usize; 10];
        for _ in 0..20_000 {
            counts[z.sample(&mut rng)] += 1;
        }
        assert!(
            counts[0] > 2 * counts[1] && counts[1] > counts[9],
            "{counts:?}"
        );
        assert!(Zipf::new(0, 1.0).is_err());
    }

    #[test]
    fn shared_prefix_groups_share_exactly_their_prefix() {
        let w = SharedPrefix {
            requests: 200,
            groups: 4,
            ..SharedPrefix::default()
        }
        .generate()
        .unwrap();
        assert_eq!(w.len(), 200);
        let pb = blocks_of(4096);
        let a = &w.requests[0];
        let same = w
            .requests
            .iter()
            .skip(1)
            .find(|r| r.session == a.session)
            .unwrap();
        let other = w.requests.iter().find(|r| r.session != a.session).unwrap();
        assert_eq!(ids(a)[..pb], ids(same)[..pb]);
        assert_ne!(ids(a)[pb], ids(same)[pb]);
        assert_ne!(ids(a)[0], ids(other)[0]);
    }

    #[test]
    fn multi_turn_carries_history() {
        let w = MultiTurn {
            conversations: 3,
            turns: 3,
            ..MultiTurn::default()
        }
        .generate()
        .unwrap();
        assert_eq!(w.len(), 9);
        let c: Vec<&WorkRequest> = w.requests.iter().filter(|r| r.session == Some(1)).collect();
        assert!(ids(c[1]).starts_with(ids(c[0])));
        assert!(ids(c[2]).len() > ids(c[1]).len());
        assert!(c[1].at > c[0].at);
    }

    #[test]
    fn prefix_ratio_sets_the_shared_fraction() {
        let w = PrefixRatio {
            requests: 50,
            groups: 1,
            prefix_ratio: 0.75,
            ..PrefixRatio::default()
        }
        .generate()
        .unwrap();
        let (a, b) = (ids(&w.requests[0]), ids(&w.requests[1]));
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        assert_eq!(common, 24);
        assert_eq!(a.len(), 32);
    }
}
