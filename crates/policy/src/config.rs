//! Policy configuration as it appears in the router's config file (`policy:` per pool).
//!
//! Every field has a default, so `{kind: precise}` is a complete configuration; `validate`
//! reports every bad value at once.

use std::time::Duration;

use serde::Deserialize;

/// Which policy a pool uses, with its knobs.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PolicyConfig {
    /// Cached prefix from the replicas' own KV events (the default).
    Precise(PreciseConfig),
    /// Cached prefix guessed from what this router sent where (replicas without events).
    Approximate(ApproximateConfig),
    RoundRobin,
    LeastLoad,
    /// Requests with the same session key go to the same worker (rendezvous hashing).
    SessionAffinity,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::Precise(PreciseConfig::default())
    }
}

/// The knobs of cache-vs-load scoring, shared by the precise and approximate policies.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreciseConfig {
    /// Cached tokens worth one fleet-mean of outstanding requests: a worker twice as busy as
    /// the mean must hold this many more cached tokens to win.
    pub load_weight_tokens: f64,
    /// Workers whose outstanding requests (this one included) exceed this multiple of the fair
    /// share, and the fair share plus `fair_share_slack`, are ranked after all others, however
    /// much they hold: hot prefixes spread under load.
    pub fair_share_cap: f64,
    /// Outstanding requests a worker may hold above the fair share before the cap applies,
    /// whatever the ratio says: at low concurrency a replica one or two requests busier keeps
    /// the conversations it holds.
    pub fair_share_slack: f64,
    /// How much one cached token in a lower tier (CPU, storage) is worth against one on GPU.
    pub offload_credit: f64,
    /// Cost of one uncached prompt token this router already sent to the worker and that is
    /// still being prefilled, in cached tokens: queued prefill delays this request's first token.
    pub pending_prefill_weight: f64,
    /// KV usage above which a worker is penalised (it is close to preempting).
    pub kv_pressure_threshold: f64,
    /// Penalty, in cached tokens, at 100 % KV usage (linear from the threshold); 0 (the
    /// default) turns the term off.
    pub kv_pressure_tokens: f64,
    /// After routing, assume the chosen worker holds the request's blocks for this long,
    /// until its events confirm them. Zero disables speculation.
    #[serde(rename = "speculative_ttl_ms", with = "millis")]
    pub speculative_ttl: Duration,
    /// Upper bound on speculative entries kept.
    pub speculative_capacity: usize,
}

impl Default for PreciseConfig {
    fn default() -> Self {
        // Chosen with `kinference bench` on the Mooncake conversation trace (8 replicas), the
        // hot-prefix workload, the demo's multi-turn chats and the peer-router comparison
        // (BENCHMARKS.md, "Policy defaults"). A ratio alone bit at low concurrency: with about
        // six requests on four replicas a cap of 1.5 moved conversations off the replica holding
        // them (peers script 55 % hit against the peers' 61 %), and on Mooncake at 50 % load
        // cap 1.5 reached 20.6 % hit. A slack of 4 requests keeps them together (61.5 %; Mooncake
        // 50 %: 24.9 %; hot prefixes at 80 %: 77.9 % → 90.6 % with TTFT p90 223 → 24 ms). Under
        // load the ratio binds: on Mooncake at 80 % cap 2.0 with slack 4 reached 24.6 %, cap 1.5
        // 23.8 %, caps of 2.5 and 3 no more, with the same TTFT tail. A cap of 2.0 once let the
        // demo's popular system prompt queue (TTFT p90 11 s, load weight 1024); at these settings
        // four demo runs kept TTFT p90 at 139–392 ms. The load weight hardly moved Mooncake; a
        // small one keeps a replica that looks one request busier (a scrape lags) from losing a
        // short cached prefix. The KV-pressure term is off: it pushed requests away from a
        // replica that holds their prefix just when KV memory is short, where a miss costs the
        // most (the prefix must be stored again elsewhere). Off, ShareGPT at 80 % load went from
        // 54.0 to 62.2 % hit (8 replicas; TTFT p90 317 → 27 ms) and from 49.4 to 58.6 % (4), a
        // KV-bound hot-prefix run from 59.5 to 73.3 % (TTFT p90 20.4 → 11.7 s), and Mooncake
        // and the hot prefixes did not change (BENCHMARKS.md, "Policy defaults"). The
        // pending-prefill weight went from 0.25 to 0.075 after the KV term was off: a
        // replica's queued prefill had weighed more than the prefix it holds, so a
        // conversation left its replica while the replica was busy with someone else's
        // prompt. Mooncake at 80 % went 24.6 → 26.2 % (8 replicas) and 16.5 → 17.6 % (4),
        // ShareGPT at 80 % on 4 replicas 58.6 → 60.6 %, the demo 58–69 → 67–69 % over four
        // runs; the cost is a longer tail under load (Mooncake TTFT p99 5.4 → 5.8 s, hot
        // prefixes at 80 % p90 24 → 36 ms). 0.05 gained 0.2 points more on Mooncake and lost
        // 1.7 points and 2 s of TTFT p90 on the KV-bound run.
        PreciseConfig {
            load_weight_tokens: 256.0,
            fair_share_cap: 2.0,
            fair_share_slack: 4.0,
            offload_credit: 0.5,
            pending_prefill_weight: 0.075,
            kv_pressure_threshold: 0.9,
            kv_pressure_tokens: 0.0,
            speculative_ttl: Duration::from_secs(2),
            speculative_capacity: 1 << 20,
        }
    }
}

/// The approximate policy: the same scoring over a router-side record of routed prefixes.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproximateConfig {
    /// The cache-vs-load knobs (`scoring:` in the file).
    pub scoring: PreciseConfig,
    /// How long a routed prefix is assumed to stay cached.
    #[serde(rename = "ttl_ms", with = "millis")]
    pub ttl: Duration,
    /// Upper bound on (block, worker) entries; the oldest go first.
    pub capacity: usize,
}

impl Default for ApproximateConfig {
    fn default() -> Self {
        ApproximateConfig {
            scoring: PreciseConfig {
                speculative_ttl: Duration::ZERO,
                ..PreciseConfig::default()
            },
            ttl: Duration::from_secs(120),
            capacity: 1 << 22,
        }
    }
}

/// A bad policy setting; `field` is the setting's name as in the config file.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("policy setting `{field}`: {problem}")]
pub struct ConfigError {
    pub field: &'static str,
    pub problem: String,
}

/// Every problem [`PolicyConfig::validate`] found (never empty), shown joined with `; `.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{}", joined(.0))]
pub struct ConfigErrors(pub Vec<ConfigError>);

fn joined(errs: &[ConfigError]) -> String {
    errs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

impl PolicyConfig {
    /// The policy's name as in the config file and in metrics.
    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::Precise(_) => "precise",
            PolicyConfig::Approximate(_) => "approximate",
            PolicyConfig::RoundRobin => "round-robin",
            PolicyConfig::LeastLoad => "least-load",
            PolicyConfig::SessionAffinity => "session-affinity",
        }
    }

    /// Parses a bare policy name (command-line flags), with default knobs.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "precise" => PolicyConfig::Precise(PreciseConfig::default()),
            "approximate" => PolicyConfig::Approximate(ApproximateConfig::default()),
            "round-robin" => PolicyConfig::RoundRobin,
            "least-load" => PolicyConfig::LeastLoad,
            "session-affinity" => PolicyConfig::SessionAffinity,
            _ => return None,
        })
    }

    /// `self` if it validates, else every problem.
    pub fn checked(self) -> Result<Self, ConfigErrors> {
        let errs = self.validate();
        if errs.is_empty() {
            Ok(self)
        } else {
            Err(ConfigErrors(errs))
        }
    }

    /// Every problem with the settings, not just the first.
    pub fn validate(&self) -> Vec<ConfigError> {
        let mut errs = Vec::new();
        match self {
            PolicyConfig::Precise(p) => p.validate(&mut errs),
            PolicyConfig::Approximate(a) => {
                a.scoring.validate(&mut errs);
                if a.ttl.is_zero() {
                    errs.push(err("ttl_ms", "must be positive"));
                }
                if a.capacity == 0 {
                    errs.push(err("capacity", "must be positive"));
                }
            }
            PolicyConfig::RoundRobin | PolicyConfig::LeastLoad | PolicyConfig::SessionAffinity => {}
        }
        errs
    }
}

impl PreciseConfig {
    fn validate(&self, errs: &mut Vec<ConfigError>) {
        let non_neg = [
            ("load_weight_tokens", self.load_weight_tokens),
            ("fair_share_slack", self.fair_share_slack),
            ("offload_credit", self.offload_credit),
            ("pending_prefill_weight", self.pending_prefill_weight),
            ("kv_pressure_tokens", self.kv_pressure_tokens),
        ];
        for (field, v) in non_neg {
            if !v.is_finite() || v < 0.0 {
                errs.push(err(field, format!("must be a finite number >= 0, got {v}")));
            }
        }
        if !self.fair_share_cap.is_finite() || self.fair_share_cap < 1.0 {
            errs.push(err(
                "fair_share_cap",
                format!(
                    "must be >= 1 (1 = perfectly even), got {}",
                    self.fair_share_cap
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.kv_pressure_threshold) {
            errs.push(err(
                "kv_pressure_threshold",
                format!("must be within 0..=1, got {}", self.kv_pressure_threshold),
            ));
        }
        if self.offload_credit > 1.0 {
            errs.push(err(
                "offload_credit",
                "must be <= 1 (a GPU block is worth 1)",
            ));
        }
    }
}

fn err(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError {
        field,
        problem: problem.into(),
    }
}

/// Durations in the config file are integer milliseconds (`speculative_ttl_ms: 2000`).
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer};

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        u64::deserialize(d).map(Duration::from_millis)
    }
}
