//! A workload: requests with arrival times, prompts described abstractly, and output lengths;
//! and the arrival processes that re-time them.
//!
//! A prompt is kept as a description ([`Prompt`]), not as tokens: a Mooncake hour is 145 M
//! prompt tokens, so each runner turns the description into token ids (simulated time) or text
//! (live HTTP) only when the request is issued. Two invariants make that safe:
//! * the same description always yields the same tokens or text (everything is seeded), and
//! * two prompts whose block ids agree on a prefix yield token sequences (and texts) that agree
//!   on the corresponding prefix, so a prefix cache sees exactly the sharing the trace encodes.
//!
//! Requests are kept in arrival order; re-timing keeps that order.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::BenchError;

/// One chat message of a text workload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    pub content: String,
}

/// What a request's prompt is made of.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Trace style: `block_tokens` pseudo tokens (or words) per id, the whole cut to `len`
    /// tokens. Ids are prefix-chained as in the Mooncake release: equal ids at the same
    /// position mean equal content.
    Blocks {
        ids: Vec<u64>,
        len: usize,
        block_tokens: usize,
    },
    /// A chat conversation in real text (ShareGPT): each turn carries the history.
    Chat(Vec<Message>),
    /// Token ids given directly (a tokenized chat, for simulated runs).
    Tokens(Vec<u32>),
}

impl Prompt {
    /// Prompt length in tokens where it is known without a tokenizer.
    pub fn known_len(&self) -> Option<usize> {
        match self {
            Prompt::Blocks { len, .. } => Some(*len),
            Prompt::Tokens(t) => Some(t.len()),
            Prompt::Chat(_) => None,
        }
    }
}

/// One request of a workload.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkRequest {
    /// Seconds from the workload's start.
    pub at: f64,
    /// The conversation it belongs to, when the workload has conversations.
    pub session: Option<u64>,
    pub prompt: Prompt,
    /// Tokens to generate (at least 1).
    pub max_tokens: u32,
}

/// A named list of requests in arrival order.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    pub name: String,
    pub requests: Vec<WorkRequest>,
}

impl Workload {
    pub fn new(name: impl Into<String>, mut requests: Vec<WorkRequest>) -> Self {
        // Stable: requests at the same instant keep their generation order.
        requests.sort_by(|a, b| a.at.total_cmp(&b.at));
        Workload {
            name: name.into(),
            requests,
        }
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Seconds from the first arrival to the last.
    pub fn span_secs(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => (b.at - a.at).max(0.0),
            _ => 0.0,
        }
    }

    /// Keeps at most `max_requests` requests arriving within `max_secs` of the first one.
    pub fn truncate(&mut self, max_requests: Option<usize>, max_secs: Option<f64>) {
        if let Some(n) = max_requests {
            self.requests.truncate(n);
        }
        if let (Some(limit), Some(first)) = (max_secs, self.requests.first().map(|r| r.at)) {
            self.requests.retain(|r| r.at - first <= limit);
        }
    }

    /// Sum of the known prompt lengths, tokens.
    pub fn known_prompt_tokens(&self) -> usize {
        self.requests
            .iter()
            .filter_map(|r| r.prompt.known_len())
            .sum()
    }

    pub fn output_tokens(&self) -> u64 {
        self.requests.iter().map(|r| u64::from(r.max_tokens)).sum()
    }
}

/// How requests are timed when a run issues them.
#[derive(Clone, Debug, PartialEq)]
pub enum Arrivals {
    /// The workload's own times divided by `speedup` (2 = twice as fast).
    Trace { speedup: f64 },
    /// Exponential gaps at `rate` requests per second.
    Poisson { rate: f64, seed: u64 },
    /// One request every `1 / rate` seconds.
    Constant { rate: f64 },
    /// Arrival times taken from another trace (e.g. Azure's), request k at time k, divided
    /// by `speedup`.
    Times { times: Vec<f64>, speedup: f64 },
    /// A closed loop: `n` requests outstanding at all times (live mode only).
    Concurrency(usize),
}

impl Arrivals {
    pub fn label(&self) -> String {
        match self {
            Arrivals::Trace { speedup } => format!("trace times / {speedup}"),
            Arrivals::Poisson { rate, .. } => format!("Poisson {rate} req/s"),
            Arrivals::Constant { rate } => format!("constant {rate} req/s"),
            Arrivals::Times { speedup, .. } => format!("external trace times / {speedup}"),
            Arrivals::Concurrency(n) => format!("closed loop, {n} outstanding"),
        }
    }

    /// Re-times `w` in place (no-op for a closed loop, where times are not used).
    pub fn apply(&self, w: &mut Workload) -> Result<(), BenchError> {
        let positive = |x: f64, what: &str| {
            if x.is_finite() && x > 0.0 {
                Ok(())
            } else {
                Err(BenchError::Config(format!(
                    "{what} must be positive, got {x}"
                )))
            }
        };
        let first = w.requests.first().map_or(0.0, |r| r.at);
        match self {
            Arrivals::Trace { speedup } => {
                positive(*speedup, "speedup")?;
                for r in &mut w.requests {
                    r.at = (r.at - first) / speedup;
                }
            }
            Arrivals::Poisson { rate, seed } => {
                positive(*rate, "rate")?;
                let mut rng = ChaCha8Rng::seed_from_u64(*seed);
                let mut t = 0.0;
                for r in &mut w.requests {
                    r.at = t;
                    t += exponential(&mut rng, *rate);
                }
            }
            Arrivals::Constant { rate } => {
                positive(*rate, "rate")?;
                for (i, r) in w.requests.iter_mut().enumerate() {
                    r.at = i as f64 / rate;
                }
            }
            Arrivals::Times { times, speedup } => {
                positive(*speedup, "speedup")?;
                if times.len() < w.requests.len() {
                    return Err(BenchError::Config(format!(
                        "the arrival trace has {} times for {} requests",
                        times.len(),
                        w.requests.len()
                    )));
                }
                let t0 = times.first().copied().unwrap_or(0.0);
                for (r, t) in w.requests.iter_mut().zip(times) {
                    r.at = (t - t0).max(0.0) / speedup;
                }
            }
            Arrivals::Concurrency(n) => {
                if *n == 0 {
                    return Err(BenchError::Config("concurrency must be at least 1".into()));
                }
            }
        }
        Ok(())
    }
}

/// An exponential variate with the given rate (inverse transform).
pub(crate) fn exponential(rng: &mut ChaCha8Rng, rate: f64) -> f64 {
    let u: f64 = rng.gen_range(f64::EPSILON..1.0);
    -u.ln() / rate
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(times: &[f64]) -> Workload {
        Workload::new(
            "t",
            times
                .iter()
                .map(|&at| WorkRequest {
                    at,
                    session: None,
                    prompt: Prompt::Tokens(vec![1, 2, 3]),
                    max_tokens: 1,
                })
                .collect(),
        )
    }

    #[test]
    fn retiming_keeps_order_and_scales() {
        let mut a = w(&[10.0, 12.0, 20.0]);
        Arrivals::Trace { speedup: 2.0 }.apply(&mut a).unwrap();
        let t: Vec<f64> = a.requests.iter().map(|r| r.at).collect();
        assert_eq!(t, vec![0.0, 1.0, 5.0]);
        let mut c = w(&[0.0, 0.0, 0.0, 0.0]);
        Arrivals::Constant { rate: 4.0 }.apply(&mut c).unwrap();
        assert_eq!(c.requests[3].at, 0.75);
        let mut p = w(&vec![0.0; 2000]);
        Arrivals::Poisson {
            rate: 10.0,
            seed: 1,
        }
        .apply(&mut p)
        .unwrap();
        assert!(p.requests.windows(2).all(|x| x[0].at <= x[1].at));
        let rate = 1999.0 / p.span_secs();
        assert!((rate - 10.0).abs() < 1.0, "{rate}");
        assert!(Arrivals::Constant { rate: 0.0 }.apply(&mut c).is_err());
    }

    #[test]
    fn truncation_bounds_count_and_time() {
        let mut a = w(&[5.0, 6.0, 7.0, 100.0]);
        a.truncate(Some(3), Some(1.5));
        assert_eq!(a.len(), 2);
    }
}
