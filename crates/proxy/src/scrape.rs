//! Load and cache-configuration scraping of each replica's `/metrics` (vLLM's names), and the
//! check that the router can reproduce the replica's block hashes.
//!
//! Invariants: one task per replica writes its load gauges and health; a replica whose
//! `vllm:cache_config_info` names another block size or hash algorithm than its pool's, or
//! prefix caching off, is marked unscorable (logged once per change, counted in metrics, shown
//! in `/debug/replicas`) and routed by load only. A replica that does not publish the info
//! metric is assumed to match the configuration. Its KV events are checked too, on every
//! scrape: a `BlockStored` with another block size, or recent root blocks (first blocks of a
//! sequence, hashed from the tokens the event carries) of which none hashes as the pool's
//! hasher computes it (another algorithm or `PYTHONHASHSEED`), make it unscorable as well.
//! One matching root clears the hash check: a root may legitimately differ (a request's
//! `cache_salt` on a vLLM that does not publish extra keys), a wrong seed makes every one
//! differ.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kinference_events::WorkerHealth;
use kinference_vllm::metrics::text;
use kinference_vllm::{BlockHasher, RequestExtras};

use crate::api::CacheConfigStatus;
use crate::fleet::{Fleet, Pool, Replica, Rules};
use crate::metrics::Tick;

/// What one scrape found, per vLLM engine (`engine` label = DP rank).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Scraped {
    pub engines: BTreeMap<u32, EngineLoad>,
    pub cache_config: Option<CacheConfigStatus>,
    pub prefix_cache_hits: Option<f64>,
    pub prefix_cache_queries: Option<f64>,
}

/// One engine's gauges (summed over models and other labels).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct EngineLoad {
    pub running: f64,
    pub waiting: f64,
    pub kv_usage: f64,
}

/// Reads a vLLM replica's Prometheus text page (the workspace's one parser). Unknown and
/// malformed lines are ignored; counters that are not finite do not count.
pub(crate) fn parse(text: &str) -> Scraped {
    let mut out = Scraped::default();
    for sample in text::parse(text).filter_map(Result::ok) {
        let value = sample.value;
        let engine = || {
            sample
                .label("engine")
                .and_then(|e| e.parse::<u32>().ok())
                .unwrap_or(0)
        };
        match sample.name {
            "vllm:num_requests_running" => {
                out.engines.entry(engine()).or_default().running += value
            }
            "vllm:num_requests_waiting" => {
                out.engines.entry(engine()).or_default().waiting += value
            }
            "vllm:kv_cache_usage_perc" => {
                // A fraction: a replica reporting +Inf, a negative value or more than 1 must
                // not weigh on its load beyond a full cache (NaN is ignored by `max`).
                let e = out.engines.entry(engine()).or_default();
                e.kv_usage = e.kv_usage.max(value.clamp(0.0, 1.0));
            }
            "vllm:prefix_cache_hits_total" => {
                *out.prefix_cache_hits.get_or_insert(0.0) += value;
            }
            "vllm:prefix_cache_queries_total" => {
                *out.prefix_cache_queries.get_or_insert(0.0) += value;
            }
            "vllm:cache_config_info" => {
                out.cache_config = Some(CacheConfigStatus {
                    block_size: sample.label("block_size").and_then(|v| v.parse().ok()),
                    num_gpu_blocks: sample.label("num_gpu_blocks").and_then(|v| v.parse().ok()),
                    hash_algo: sample
                        .label("prefix_caching_hash_algo")
                        .map(std::borrow::Cow::into_owned),
                    prefix_caching: sample
                        .label("enable_prefix_caching")
                        .map(|v| v.eq_ignore_ascii_case("true")),
                });
            }
            _ => {}
        }
    }
    out
}

/// Why the router cannot reproduce a replica's hashes, if it cannot.
pub(crate) fn unscorable_reason(rules: &Rules, cfg: &CacheConfigStatus) -> Option<String> {
    let mut reasons = Vec::new();
    if cfg.prefix_caching == Some(false) {
        reasons.push("prefix caching is off on the replica".to_owned());
    }
    if let Some(bs) = cfg.block_size {
        if bs != rules.block_size {
            reasons.push(format!(
                "the replica's block size is {bs}, the pool's {}",
                rules.block_size
            ));
        }
    }
    if let Some(algo) = &cfg.hash_algo {
        let ours = rules.hasher.algo().as_str();
        if algo != ours {
            reasons.push(format!(
                "the replica hashes with {algo}, the pool with {ours}"
            ));
        }
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// Why the router cannot reproduce the hashes in one worker's KV events, if it cannot.
pub(crate) fn event_unscorable_reason(
    block_size: u32,
    hasher: &BlockHasher,
    health: &WorkerHealth,
) -> Option<String> {
    if let Some(bs) = health.stored_block_size {
        if bs != block_size {
            return Some(format!(
                "the replica's KV events carry block size {bs}, the pool's is {block_size}"
            ));
        }
    }
    (roots_match(hasher, health) == Some(false)).then(|| {
        format!(
            "none of the replica's last {} first blocks hashes as the pool's {} (seed {:?}) \
             computes it: another hash algorithm or PYTHONHASHSEED",
            health.root_samples.len(),
            hasher.algo().as_str(),
            hasher.seed()
        )
    })
}

/// Whether any of the worker's recent root blocks hashes as `hasher` computes it; `None`
/// with fewer than two, so that one salted request alone does not condemn a replica.
pub(crate) fn roots_match(hasher: &BlockHasher, health: &WorkerHealth) -> Option<bool> {
    let samples = &health.root_samples;
    if samples.len() < 2 {
        return None;
    }
    Some(samples.iter().any(|root| {
        hasher
            .hash_block(None, &root.tokens, 0, &RequestExtras::default())
            .is_ok_and(|d| d.event_hash() == root.hash)
    }))
}

/// Scrapes one replica once and records what it found.
pub(crate) async fn scrape_once(fleet: &Fleet, pool: &Pool, replica: &Replica) {
    let got = fleet
        .upstream
        .get(
            &replica.endpoint,
            "/metrics",
            fleet.settings.scrape_timeout,
            16 << 20,
        )
        .await;
    let text = match got {
        Ok((status, body)) if status.is_success() => String::from_utf8_lossy(&body).into_owned(),
        Ok((status, _)) => {
            count(fleet, pool, replica, Tick::Failed);
            mark_down(fleet, replica, format!("/metrics answered {status}"));
            return;
        }
        Err(e) => {
            count(fleet, pool, replica, Tick::Failed);
            mark_down(fleet, replica, format!("/metrics: {e}"));
            return;
        }
    };
    count(fleet, pool, replica, Tick::Ok);
    let s = parse(&text);
    let dp = replica.dp_size();
    if dp == 1 {
        // A single-rank replica may still label its engine with its global rank.
        let mut total = crate::scrape::EngineLoad::default();
        for e in s.engines.values() {
            total.running += e.running;
            total.waiting += e.waiting;
            total.kv_usage = total.kv_usage.max(e.kv_usage);
        }
        if let Some(w) = replica.workers.first() {
            w.set_scraped(as_u32(total.running), as_u32(total.waiting), total.kv_usage);
        }
    } else {
        for (engine, e) in &s.engines {
            if let Some(w) = replica.workers.get(*engine as usize) {
                w.set_scraped(as_u32(e.running), as_u32(e.waiting), e.kv_usage);
            }
        }
    }
    // One set of rules for the whole verdict, even if they are replaced meanwhile.
    let rules = pool.rules();
    let mut reasons: Vec<String> = s
        .cache_config
        .as_ref()
        .and_then(|c| unscorable_reason(&rules, c))
        .into_iter()
        .collect();
    if let Some(plane) = pool.plane() {
        for rank in 0..replica.dp_size() {
            let why = plane
                .health(replica.worker(rank))
                .and_then(|h| event_unscorable_reason(rules.block_size, &rules.hasher, &h));
            if let Some(why) = why.filter(|w| !reasons.contains(w)) {
                reasons.push(why);
            }
        }
    }
    let reason = (!reasons.is_empty()).then(|| reasons.join("; "));
    let capacity_changed = {
        let mut info = replica.info.lock();
        info.last_error = None;
        let before = info.cache_config.as_ref().and_then(|c| c.num_gpu_blocks);
        info.cache_config = s.cache_config.clone();
        info.prefix_cache_hits = s.prefix_cache_hits;
        info.prefix_cache_queries = s.prefix_cache_queries;
        before != s.cache_config.as_ref().and_then(|c| c.num_gpu_blocks)
    };
    if capacity_changed {
        pool.fit_baselines();
    }
    if replica.set_unscorable(reason.clone()) {
        match &reason {
            Some(r) => tracing::warn!(replica = %replica.url(), pool = %pool.name, reason = %r,
                "replica's block hashes cannot be reproduced; routing it by load only"),
            None => tracing::info!(replica = %replica.url(), pool = %pool.name,
                "replica's block hashes match the pool again"),
        }
    }
    if replica.health() != crate::api::Health::Up {
        tracing::info!(replica = %replica.url(), "replica is up");
        replica.set_up();
    }
    fleet.bump();
}

fn as_u32(v: f64) -> u32 {
    if v.is_finite() && v > 0.0 {
        v.min(f64::from(u32::MAX)) as u32
    } else {
        0
    }
}

fn mark_down(fleet: &Fleet, replica: &Replica, error: String) {
    if replica.set_down(error.clone()) {
        tracing::warn!(replica = %replica.url(), error = %error, "replica is down");
    }
    fleet.bump();
}

/// How often a replica is scraped: every `every` while anything happens on it, every `idle`
/// at most while it is quiet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cadence {
    pub every: Duration,
    pub idle: Duration,
}

/// What the router can see of a replica without asking it, sampled at each tick.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Activity {
    /// Requests this router started on it, ever.
    pub started: u64,
    /// Requests from this router in flight on it now.
    pub in_flight: u64,
    /// KV-event messages received from it, ever.
    pub messages: u64,
    /// How many of its event streams are connected.
    pub connected: usize,
}

/// What the last scrape left behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LastScrape {
    /// Activity sampled just before it.
    pub activity: Activity,
    /// It failed, or found something running or waiting: load is moving, keep watching.
    pub busy: bool,
    pub elapsed: Duration,
}

/// Whether a replica is due for a scrape at this tick. A quiet replica (nothing running or
/// waiting at the last scrape, no request from this router since, no KV event since, event
/// streams as connected as before) waits up to `idle`: its load cannot have changed unless
/// another router sent it work, and that work would show as KV events. A dead replica's
/// event streams disconnect, which brings its scrape back within one `every`.
pub(crate) fn due(cadence: Cadence, last: &LastScrape, now: &Activity) -> bool {
    last.busy
        || last.elapsed >= cadence.idle
        || now.in_flight > 0
        || now.started != last.activity.started
        || now.messages != last.activity.messages
        || now.connected != last.activity.connected
}

/// The router-side activity of `replica`.
fn activity(pool: &Pool, replica: &Replica) -> Activity {
    let mut a = Activity::default();
    for w in &replica.workers {
        a.started += w.started.load(std::sync::atomic::Ordering::Relaxed);
        a.in_flight += u64::from(w.in_flight.load(std::sync::atomic::Ordering::Relaxed));
    }
    if let Some(plane) = pool.plane() {
        for rank in 0..replica.dp_size() {
            if let Some((messages, connected)) =
                plane.with_health(replica.worker(rank), |h| (h.messages, h.connected))
            {
                a.messages += messages;
                a.connected += usize::from(connected);
            }
        }
    }
    a
}

/// Where in the interval a replica's scrapes fall: spread by its URL, so that a thousand
/// replicas added at once are not scraped in one burst every interval.
fn phase(url: &str, every: Duration) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    url.hash(&mut h);
    let nanos = u64::try_from(every.as_nanos()).unwrap_or(u64::MAX).max(1);
    Duration::from_nanos(h.finish() % nanos)
}

/// Scrapes a replica at once, then on its phase of every `every` tick that [`due`] allows,
/// until aborted.
pub(crate) async fn run(
    fleet: Arc<Fleet>,
    pool: Arc<Pool>,
    replica: Arc<Replica>,
    every: Duration,
) {
    let cadence = Cadence {
        every,
        idle: fleet.settings.scrape_idle_interval.max(every),
    };
    let (mut last, mut at) = scrape_now(&fleet, &pool, &replica).await;
    tokio::time::sleep(phase(replica.url(), every)).await;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        last.elapsed = at.elapsed();
        if due(cadence, &last, &activity(&pool, &replica)) {
            (last, at) = scrape_now(&fleet, &pool, &replica).await;
        } else {
            count(&fleet, &pool, &replica, Tick::Idle);
            fleet.bump();
        }
    }
}

/// One scrape, and what [`due`] needs to remember of it.
async fn scrape_now(
    fleet: &Fleet,
    pool: &Pool,
    replica: &Replica,
) -> (LastScrape, tokio::time::Instant) {
    let at = tokio::time::Instant::now();
    // Sampled before the scrape: what happens during it counts as news at the next tick.
    let activity = activity(pool, replica);
    scrape_once(fleet, pool, replica).await;
    let busy = replica.health() != crate::api::Health::Up
        || replica.workers.iter().any(|w| {
            w.running.load(std::sync::atomic::Ordering::Relaxed) > 0
                || w.waiting.load(std::sync::atomic::Ordering::Relaxed) > 0
        });
    let last = LastScrape {
        activity,
        busy,
        elapsed: Duration::ZERO,
    };
    (last, at)
}

/// Counts one scrape tick of `replica`, in its status and in the pool's metric.
fn count(fleet: &Fleet, pool: &Pool, replica: &Replica, tick: Tick) {
    {
        let c = &mut replica.info.lock().scrapes;
        match tick {
            Tick::Ok => c.ok += 1,
            Tick::Failed => c.failed += 1,
            Tick::Idle => c.idle += 1,
        }
    }
    let labels = crate::metrics::PoolKind {
        pool: pool.name.clone(),
        kind: tick.label(),
    };
    fleet.metrics.scrapes.get_or_create(&labels).inc();
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",engine="0",num_gpu_blocks="200",prefix_caching_hash_algo="sha256_cbor"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 20
vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="+Inf"} 2
"#;

    #[test]
    fn parses_vllm_gauges_per_engine() {
        let s = parse(TEXT);
        assert_eq!(s.engines.len(), 2);
        assert_eq!(
            s.engines[&0],
            EngineLoad {
                running: 3.0,
                waiting: 2.0,
                kv_usage: 0.25
            }
        );
        assert_eq!(s.engines[&1].running, 1.0);
        assert_eq!(s.engines[&1].kv_usage, 0.5);
        let c = s.cache_config.unwrap();
        assert_eq!(c.block_size, Some(32));
        assert_eq!(c.num_gpu_blocks, Some(200));
        assert_eq!(c.hash_algo.as_deref(), Some("sha256_cbor"));
        assert_eq!(c.prefix_caching, Some(true));
        assert_eq!(s.prefix_cache_hits, Some(64.0));
        assert_eq!(s.prefix_cache_queries, Some(120.0));
    }

    #[test]
    fn kv_usage_out_of_range_is_clamped_to_a_fraction() {
        let page = "vllm:kv_cache_usage_perc{engine=\"0\"} +Inf\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} -3\n\
                    vllm:kv_cache_usage_perc{engine=\"2\"} NaN\n\
                    vllm:kv_cache_usage_perc{engine=\"3\"} 0.4\n";
        let s = parse(page);
        let usage: Vec<f64> = s.engines.values().map(|e| e.kv_usage).collect();
        assert_eq!(usage, vec![1.0, 0.0, 0.0, 0.4]);
    }

    fn health_with(block_size: Option<u32>, roots: &[(&BlockHasher, u32)]) -> WorkerHealth {
        let mut h = WorkerHealth::new(
            kinference_events::WorkerId::new(
                kinference_events::ReplicaId(0),
                kinference_events::DpRank(0),
            ),
            "tcp://127.0.0.1:1".into(),
        );
        h.stored_block_size = block_size;
        for (hasher, first) in roots {
            let tokens: Vec<u32> = (*first..*first + 16).collect();
            let hash = hasher
                .hash_block(None, &tokens, 0, &RequestExtras::default())
                .unwrap()
                .event_hash();
            h.root_samples
                .push_back(kinference_events::RootBlock { hash, tokens });
        }
        h
    }

    fn hasher(seed: Option<&str>) -> BlockHasher {
        BlockHasher::new(
            kinference_vllm::HashAlgo::Sha256Cbor,
            16,
            seed,
            kinference_vllm::ExtraKeysFormat::default(),
        )
        .unwrap()
    }

    #[test]
    fn event_hashes_made_with_another_seed_make_a_worker_unscorable() {
        let ours = hasher(None);
        let theirs = hasher(Some("42"));
        let same = health_with(Some(16), &[(&ours, 1), (&ours, 100)]);
        assert_eq!(event_unscorable_reason(16, &ours, &same), None);
        let other = health_with(Some(16), &[(&theirs, 1), (&theirs, 100)]);
        let why = event_unscorable_reason(16, &ours, &other).unwrap();
        assert!(why.contains("PYTHONHASHSEED"), "{why}");
        // One root is not enough to judge (a salted request differs legitimately) ...
        let one = health_with(Some(16), &[(&theirs, 1)]);
        assert_eq!(event_unscorable_reason(16, &ours, &one), None);
        // ... and one matching root among the recent ones clears the worker.
        let mixed = health_with(Some(16), &[(&theirs, 1), (&ours, 100)]);
        assert_eq!(event_unscorable_reason(16, &ours, &mixed), None);
    }

    const CADENCE: Cadence = Cadence {
        every: Duration::from_secs(1),
        idle: Duration::from_secs(5),
    };

    fn quiet(elapsed_s: u64) -> LastScrape {
        LastScrape {
            activity: Activity {
                started: 7,
                in_flight: 0,
                messages: 40,
                connected: 2,
            },
            busy: false,
            elapsed: Duration::from_secs(elapsed_s),
        }
    }

    #[test]
    fn a_quiet_replica_waits_for_the_idle_interval() {
        let last = quiet(1);
        assert!(!due(CADENCE, &last, &last.activity));
        assert!(!due(CADENCE, &quiet(4), &last.activity));
        assert!(due(CADENCE, &quiet(5), &last.activity));
    }

    #[test]
    fn any_news_makes_a_replica_due_at_the_next_tick() {
        let last = quiet(1);
        let news = [
            Activity {
                started: 8,
                ..last.activity
            },
            Activity {
                in_flight: 1,
                ..last.activity
            },
            Activity {
                messages: 41,
                ..last.activity
            },
            // A dead replica's event streams drop: its scrape must not wait.
            Activity {
                connected: 1,
                ..last.activity
            },
        ];
        for now in news {
            assert!(due(CADENCE, &last, &now), "{now:?}");
        }
        let busy = LastScrape {
            busy: true,
            ..quiet(1)
        };
        assert!(due(CADENCE, &busy, &busy.activity));
    }

    #[test]
    fn phases_spread_over_the_interval() {
        let every = Duration::from_secs(1);
        let mut tenths = [0u32; 10];
        for i in 0..1000 {
            let p = phase(&format!("http://10.0.{}.{}:8000", i / 250, i % 250), every);
            assert!(p < every);
            tenths[(p.as_millis() / 100) as usize] += 1;
        }
        // Uniform would be 100 per tenth; no burst holds a large share.
        assert!(
            tenths.iter().all(|&n| (50..=150).contains(&n)),
            "{tenths:?}"
        );
    }

    #[test]
    fn events_with_another_block_size_make_a_worker_unscorable() {
        let ours = hasher(None);
        let h = health_with(Some(32), &[]);
        let why = event_unscorable_reason(16, &ours, &h).unwrap();
        assert!(why.contains("block size 32"), "{why}");
        assert_eq!(
            event_unscorable_reason(16, &ours, &health_with(None, &[])),
            None
        );
    }
}
