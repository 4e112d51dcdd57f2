//! The router's Prometheus metrics (admin `/metrics`), through a registry built at start.
//!
//! Two kinds: event counters and histograms updated on the request path ([`Metrics`], cheap
//! clones of shared families), and state read when scraped ([`StateCollector`]: replica
//! health and load, scorability, index size, KV-event stream health), rendered from the same
//! fleet snapshot `/debug/replicas` answers, so the two never disagree. Label values are bounded
//! sets: route names from a fixed list, replica URLs and pool names from the configuration,
//! status codes, and fixed reason/kind labels — never anything from a request body. Series
//! labelled with a replica that left the fleet are removed ([`Metrics::forget_replicas`]), so
//! discovery churn never makes `/metrics` grow without bound.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::hash::Hash;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use parking_lot::{MappedRwLockReadGuard, Mutex, RwLock};
use prometheus_client::metrics::family::MetricConstructor;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::api::{Health, ReplicasResponse};
use crate::limits::LimitMetrics;
use crate::savings::{Prices, Saved};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RequestLabels {
    pub route: &'static str,
    pub replica: String,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteReplica {
    pub route: &'static str,
    pub replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DecisionLabels {
    pub pool: String,
    pub policy: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PoolKind {
    pub pool: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PoolPolicy {
    pub pool: String,
    pub policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PoolLabel {
    pub pool: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReplicaKind {
    pub replica: String,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct KindLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct RouteLabel {
    pub route: &'static str,
}

/// Label sets that name a replica (empty: the router answered itself).
pub(crate) trait ReplicaLabel {
    fn replica(&self) -> &str;
}

impl ReplicaLabel for RequestLabels {
    fn replica(&self) -> &str {
        &self.replica
    }
}

impl ReplicaLabel for RouteReplica {
    fn replica(&self) -> &str {
        &self.replica
    }
}

impl ReplicaLabel for ReplicaKind {
    fn replica(&self) -> &str {
        &self.replica
    }
}

/// A [`Family`] labelled by replica that remembers its label sets, so that a replica's series
/// can be removed once it left the fleet (the family itself cannot be walked). The request path
/// pays one read lock, as before, once a series exists.
#[derive(Debug)]
pub(crate) struct ReplicaFamily<S, M, C = fn() -> M> {
    family: Family<S, M, C>,
    keys: Arc<Mutex<HashSet<S>>>,
}

impl<S: Clone, M, C: Clone> Clone for ReplicaFamily<S, M, C> {
    fn clone(&self) -> Self {
        ReplicaFamily {
            family: self.family.clone(),
            keys: self.keys.clone(),
        }
    }
}

impl<S, M, C> ReplicaFamily<S, M, C>
where
    S: Clone + Hash + Eq + ReplicaLabel,
    C: MetricConstructor<M>,
{
    fn new(family: Family<S, M, C>) -> Self {
        ReplicaFamily {
            family,
            keys: Arc::default(),
        }
    }

    /// The family, to register.
    fn family(&self) -> Family<S, M, C>
    where
        C: Clone,
    {
        self.family.clone()
    }

    pub fn get_or_create(&self, labels: &S) -> MappedRwLockReadGuard<'_, M> {
        if let Some(m) = self.family.get(labels) {
            return m;
        }
        self.keys.lock().insert(labels.clone());
        self.family.get_or_create(labels)
    }

    /// Removes the series of every replica `keep` rejects; returns how many.
    fn forget(&self, keep: &dyn Fn(&str) -> bool) -> usize {
        let mut keys = self.keys.lock();
        let gone: Vec<S> = keys
            .iter()
            .filter(|k| !k.replica().is_empty() && !keep(k.replica()))
            .cloned()
            .collect();
        for k in &gone {
            keys.remove(k);
            self.family.remove(k);
        }
        gone.len()
    }
}

fn latency_histogram() -> Histogram {
    // 31.25 µs .. ~260 s: a request the router answers from a fast replica takes well under
    // 0.25 ms, and a lowest bucket of 0.25 ms put all of them in it.
    Histogram::new(exponential_buckets(0.000_031_25, 2.0, 24))
}

/// One replica's series of the families every response updates, found once per route (and
/// status) and kept with the replica, so a response does not hash the replica's URL into
/// three families. A replica that left keeps its handles only while its last requests finish;
/// its series are then removed from the families ([`Metrics::forget_replicas`]).
#[derive(Debug, Default)]
pub(crate) struct ReplicaSeries {
    /// Per (route, status).
    requests: RwLock<Vec<((&'static str, u16), Counter)>>,
    /// Per route: time to first byte, duration.
    timing: RwLock<Vec<(&'static str, (Histogram, Histogram))>>,
}

/// The handles kept under `key` in `list`, or `make`'s, kept from now on. Two requests that
/// miss at once may both keep theirs: the same series, found first either way.
fn kept<K: PartialEq, V: Clone>(list: &RwLock<Vec<(K, V)>>, key: K, make: impl FnOnce() -> V) -> V {
    if let Some((_, v)) = list.read().iter().find(|(k, _)| *k == key) {
        return v.clone();
    }
    let v = make();
    list.write().push((key, v.clone()));
    v
}

/// Families updated on the request path. Clones share the same series.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub requests: ReplicaFamily<RequestLabels, Counter>,
    pub duration: ReplicaFamily<RouteReplica, Histogram, fn() -> Histogram>,
    pub first_byte: ReplicaFamily<RouteReplica, Histogram, fn() -> Histogram>,
    pub decisions: Family<DecisionLabels, Counter>,
    /// `kind` = predicted | actual, over requests whose response reported cached tokens.
    pub cached_tokens: Family<PoolKind, Counter>,
    pub usage_observed: Family<PoolLabel, Counter>,
    pub prompt_tokens: Family<PoolLabel, Counter>,
    /// Prompt tokens the replicas reported served from cache (`crate::savings`).
    pub saved_tokens: Family<PoolLabel, Counter>,
    /// The prefill GPU-seconds those tokens would have cost (`crate::savings`).
    pub saved_gpu_seconds: Family<PoolLabel, Counter<f64, AtomicU64>>,
    /// Prompt tokens of the requests whose response reported cached tokens.
    pub usage_prompt_tokens: Family<PoolLabel, Counter>,
    /// Over the same requests: what each baseline would have found cached, and saved.
    pub baseline_tokens: Family<PoolPolicy, Counter>,
    pub baseline_gpu_seconds: Family<PoolPolicy, Counter<f64, AtomicU64>>,
    /// Hot-prefix warming (`crate::warm`): warms sent, failed, skipped (`kind` = why), their
    /// prompt tokens, of those the ones the replica had cached, and their prefill GPU-seconds.
    pub warms_sent: Family<PoolLabel, Counter>,
    pub warms_failed: Family<PoolLabel, Counter>,
    pub warms_skipped: Family<PoolKind, Counter>,
    pub warm_prompt_tokens: Family<PoolLabel, Counter>,
    pub warm_cached_tokens: Family<PoolLabel, Counter>,
    pub warm_prefill_gpu_seconds: Family<PoolLabel, Counter<f64, AtomicU64>>,
    /// `kind` = connect | unavailable.
    pub retries: Family<PoolKind, Counter>,
    pub router_errors: Family<KindLabel, Counter>,
    pub upstream_failures: ReplicaFamily<ReplicaKind, Counter>,
    pub client_disconnects: Family<RouteLabel, Counter>,
    pub tokenize_fallbacks: Family<PoolKind, Counter>,
    /// `kind` = ok | failed | idle (a tick that skipped a quiet replica).
    pub scrapes: Family<PoolKind, Counter>,
    /// Endpoint picker: how a picked request's gateway reported the endpoint that served it
    /// (`kind` = first | fallback | elsewhere | unreported).
    pub served: Family<PoolKind, Counter>,
    /// Shedding, client-side timeouts, connections (`crate::limits`).
    pub limits: LimitMetrics,
    /// Each pool's series of [`Metrics::record_usage`] and [`Metrics::record_decision`], looked
    /// up once: every routed request updates two of them and every routed response eight, and a
    /// family lookup builds a label set (a string) and hashes it.
    /// Pool series are never removed, so a handle stays the series' own.
    usage: Arc<Handles<Box<str>, Arc<PoolUsage>>>,
}

/// Series handles by key, for families updated on every request: found by a scan under the
/// read lock (a few keys each), else made and kept. A family lookup builds a label set, with
/// strings, and hashes it; a handle is the series' own as long as the series is never removed.
#[derive(Debug)]
struct Handles<K, H>(RwLock<Vec<(K, H)>>);

impl<K, H> Default for Handles<K, H> {
    fn default() -> Self {
        Handles(RwLock::new(Vec::new()))
    }
}

impl<K, H: Clone> Handles<K, H> {
    /// The handle of `key`, made by `make` (key and handle) at its first use. `make` runs
    /// outside this lock: it takes the family's, which another thread holding this one while
    /// waiting for the family's would deadlock against.
    fn get<Q>(&self, key: &Q, make: impl FnOnce() -> (K, H)) -> H
    where
        K: std::borrow::Borrow<Q>,
        Q: PartialEq + ?Sized,
    {
        if let Some((_, h)) = self.0.read().iter().find(|(k, _)| k.borrow() == key) {
            return h.clone();
        }
        let (k, h) = make();
        let mut all = self.0.write();
        if let Some((_, known)) = all.iter().find(|(k, _)| k.borrow() == key) {
            return known.clone();
        }
        all.push((k, h.clone()));
        h
    }
}

/// One pool's usage series (handles share the families' values).
#[derive(Debug)]
struct PoolUsage {
    pool: Box<str>,
    predicted: Counter,
    actual: Counter,
    observed: Counter,
    saved_tokens: Counter,
    saved_gpu_seconds: Counter<f64, AtomicU64>,
    prompt_tokens: Counter,
    /// Per baseline policy: tokens, GPU-seconds.
    baselines: Handles<&'static str, (Counter, GpuSeconds)>,
    /// `kinference_prompt_tokens` of the pool's routed requests.
    routed_prompt_tokens: Counter,
    /// `kinference_decisions` by policy and reason.
    decisions: Handles<(&'static str, &'static str), Counter>,
}

type GpuSeconds = Counter<f64, AtomicU64>;

/// A scrape tick's outcome: the `kind` of `kinference_replica_scrapes_total`.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Tick {
    Ok,
    Failed,
    /// Skipped: the replica was quiet.
    Idle,
}

impl Tick {
    const ALL: [Tick; 3] = [Tick::Ok, Tick::Failed, Tick::Idle];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Tick::Ok => "ok",
            Tick::Failed => "failed",
            Tick::Idle => "idle",
        }
    }
}

impl Metrics {
    /// Creates `pool`'s series whose label values are all known ahead, at zero, so that the
    /// pool's page has its shape from the start: a counter that first appears at its first
    /// increment reads as absent, not as a rise from 0, to `rate()` and to alerts.
    pub(crate) fn open_pool(&self, pool: &str) {
        for tick in Tick::ALL {
            let _ = self.scrapes.get_or_create(&PoolKind {
                pool: pool.to_owned(),
                kind: tick.label(),
            });
        }
    }

    pub fn new() -> Self {
        Metrics {
            requests: ReplicaFamily::new(Family::default()),
            duration: ReplicaFamily::new(Family::new_with_constructor(latency_histogram)),
            first_byte: ReplicaFamily::new(Family::new_with_constructor(latency_histogram)),
            decisions: Family::default(),
            cached_tokens: Family::default(),
            usage_observed: Family::default(),
            prompt_tokens: Family::default(),
            saved_tokens: Family::default(),
            saved_gpu_seconds: Family::default(),
            usage_prompt_tokens: Family::default(),
            baseline_tokens: Family::default(),
            baseline_gpu_seconds: Family::default(),
            warms_sent: Family::default(),
            warms_failed: Family::default(),
            warms_skipped: Family::default(),
            warm_prompt_tokens: Family::default(),
            warm_cached_tokens: Family::default(),
            warm_prefill_gpu_seconds: Family::default(),
            retries: Family::default(),
            router_errors: Family::default(),
            upstream_failures: ReplicaFamily::new(Family::default()),
            client_disconnects: Family::default(),
            tokenize_fallbacks: Family::default(),
            scrapes: Family::default(),
            served: Family::default(),
            limits: LimitMetrics::default(),
            usage: Arc::default(),
        }
    }

    fn pool_usage(&self, pool: &str) -> Arc<PoolUsage> {
        self.usage.get(pool, || {
            let pk = |kind| PoolKind {
                pool: pool.to_owned(),
                kind,
            };
            let pl = PoolLabel {
                pool: pool.to_owned(),
            };
            // One statement per handle: a family's guard lives to the end of its statement,
            // and the next lookup in the same family may need that family's write lock.
            let predicted = self.cached_tokens.get_or_create(&pk("predicted")).clone();
            let actual = self.cached_tokens.get_or_create(&pk("actual")).clone();
            let observed = self.usage_observed.get_or_create(&pl).clone();
            let saved_tokens = self.saved_tokens.get_or_create(&pl).clone();
            let saved_gpu_seconds = self.saved_gpu_seconds.get_or_create(&pl).clone();
            let prompt_tokens = self.usage_prompt_tokens.get_or_create(&pl).clone();
            let routed_prompt_tokens = self.prompt_tokens.get_or_create(&pl).clone();
            let u = PoolUsage {
                pool: pool.into(),
                predicted,
                actual,
                observed,
                saved_tokens,
                saved_gpu_seconds,
                prompt_tokens,
                baselines: Handles::default(),
                routed_prompt_tokens,
                decisions: Handles::default(),
            };
            (pool.into(), Arc::new(u))
        })
    }

    fn baseline_usage(&self, u: &PoolUsage, policy: &'static str) -> (Counter, GpuSeconds) {
        u.baselines.get(&policy, || {
            let pp = PoolPolicy {
                pool: u.pool.to_string(),
                policy,
            };
            let t = self.baseline_tokens.get_or_create(&pp).clone();
            let g = self.baseline_gpu_seconds.get_or_create(&pp).clone();
            (policy, (t, g))
        })
    }

    /// A routing decision in `pool` by `policy` for `reason`, of a request of `prompt` tokens.
    pub fn record_decision(
        &self,
        pool: &str,
        policy: &'static str,
        reason: &'static str,
        prompt: u32,
    ) {
        let u = self.pool_usage(pool);
        u.routed_prompt_tokens.inc_by(u64::from(prompt));
        let counter = u.decisions.get(&(policy, reason), || {
            let labels = DecisionLabels {
                pool: pool.to_owned(),
                policy,
                reason,
            };
            (
                (policy, reason),
                self.decisions.get_or_create(&labels).clone(),
            )
        });
        counter.inc();
    }

    /// A routed response of `prompt` tokens that reported its cached tokens: the prediction
    /// it was routed on against what the replica says it served from cache, what that hit
    /// `saved`, and what each baseline would have saved on it.
    pub fn record_usage(
        &self,
        pool: &str,
        prompt: u32,
        predicted: u32,
        actual: u64,
        saved: Saved,
        baselines: &[(&'static str, Saved)],
    ) {
        let u = self.pool_usage(pool);
        u.predicted.inc_by(u64::from(predicted));
        u.actual.inc_by(actual);
        u.observed.inc();
        u.saved_tokens.inc_by(saved.tokens);
        u.saved_gpu_seconds.inc_by(saved.gpu_seconds);
        u.prompt_tokens.inc_by(u64::from(prompt));
        for &(policy, b) in baselines {
            let (tokens, gpu_seconds) = self.baseline_usage(&u, policy);
            tokens.inc_by(b.tokens);
            gpu_seconds.inc_by(b.gpu_seconds);
        }
    }

    /// `replica`'s answered-requests counter for `route` and `status` (`url` is the replica's
    /// label), from its cache in `series`.
    pub fn replica_requests(
        &self,
        series: &ReplicaSeries,
        url: &str,
        route: &'static str,
        status: u16,
    ) -> Counter {
        kept(&series.requests, (route, status), || {
            self.requests
                .get_or_create(&RequestLabels {
                    route,
                    replica: url.to_owned(),
                    status,
                })
                .clone()
        })
    }

    /// `replica`'s time-to-first-byte and duration histograms for `route`.
    pub fn replica_timing(
        &self,
        series: &ReplicaSeries,
        url: &str,
        route: &'static str,
    ) -> (Histogram, Histogram) {
        kept(&series.timing, route, || {
            let labels = RouteReplica {
                route,
                replica: url.to_owned(),
            };
            // One statement per handle: a family's guard lives to the end of its statement.
            let first = self.first_byte.get_or_create(&labels).clone();
            let duration = self.duration.get_or_create(&labels).clone();
            (first, duration)
        })
    }

    /// A pool's prompt tokens over the requests whose response reported cached tokens.
    pub fn usage_prompt_tokens(&self, pool: &str) -> u64 {
        let pl = PoolLabel {
            pool: pool.to_owned(),
        };
        self.usage_prompt_tokens.get(&pl).map_or(0, |c| c.get())
    }

    /// What `policy` would have saved on the same requests as [`Metrics::saved`] (estimated).
    pub fn baseline_saved(&self, pool: &str, policy: &'static str) -> Saved {
        let pp = PoolPolicy {
            pool: pool.to_owned(),
            policy,
        };
        Saved {
            tokens: self.baseline_tokens.get(&pp).map_or(0, |c| c.get()),
            gpu_seconds: self.baseline_gpu_seconds.get(&pp).map_or(0.0, |c| c.get()),
        }
    }

    /// A pool's routed requests whose response reported cached tokens, since start.
    pub fn usage_count(&self, pool: &str) -> u64 {
        let pl = PoolLabel {
            pool: pool.to_owned(),
        };
        self.usage_observed.get(&pl).map_or(0, |c| c.get())
    }

    /// A pool's savings since start: (tokens, GPU-seconds).
    pub fn saved(&self, pool: &str) -> Saved {
        let pl = PoolLabel {
            pool: pool.to_owned(),
        };
        Saved {
            tokens: self.saved_tokens.get(&pl).map_or(0, |c| c.get()),
            gpu_seconds: self.saved_gpu_seconds.get(&pl).map_or(0.0, |c| c.get()),
        }
    }

    /// Removes the series of replicas `keep` rejects (ones no longer in the fleet); returns
    /// how many series went.
    pub fn forget_replicas(&self, keep: &dyn Fn(&str) -> bool) -> usize {
        self.requests.forget(keep)
            + self.duration.forget(keep)
            + self.first_byte.forget(keep)
            + self.upstream_failures.forget(keep)
    }

    /// The families the dashboard's totals are read from (`dashboard::Totals`), alone: what it
    /// samples every second, without the per-replica state series and the other families of
    /// the full page (at a thousand replicas, rendering those every second was ~6 % of a core).
    pub fn dashboard_registry(&self) -> Registry {
        let mut r = Registry::default();
        self.register_totals(&mut r);
        r
    }

    /// Registers the families of [`Metrics::dashboard_registry`] in `r`.
    fn register_totals(&self, r: &mut Registry) {
        r.register(
            "kinference_requests",
            "Requests answered, by route, replica (empty when the router answered) and status",
            self.requests.family(),
        );
        r.register(
            "kinference_first_byte_seconds",
            "Time from the request to the first response body byte, by route and replica",
            self.first_byte.family(),
        );
        r.register(
            "kinference_decisions",
            "Routing decisions by pool, policy and the reason the chosen worker won",
            self.decisions.clone(),
        );
        r.register(
            "kinference_cached_tokens",
            "Prompt tokens served from cache, predicted by the policy and reported by the \
             replica (usage.prompt_tokens_details.cached_tokens), over requests whose response \
             reported them",
            self.cached_tokens.clone(),
        );
        r.register(
            "kinference_routed_prompt_tokens",
            "Prompt tokens of routed requests, as the router tokenized them",
            self.prompt_tokens.clone(),
        );
    }

    /// Registers every family, and a collector rendering the fleet's state from `snapshot`
    /// at each scrape; `prices` are exposed as gauges so a dashboard can turn saved
    /// GPU-seconds into kWh and money.
    pub fn registry(&self, snapshot: Snapshotter, prices: Prices) -> Registry {
        let mut r = Registry::default();
        self.register_totals(&mut r);
        r.register(
            "kinference_request_duration_seconds",
            "Time from the request to the end of the response body, by route and replica",
            self.duration.family(),
        );
        r.register(
            "kinference_usage_observed",
            "Routed requests whose response reported cached tokens",
            self.usage_observed.clone(),
        );
        r.register(
            "kinference_saved_prefill_tokens",
            "Prompt tokens the replicas reported served from cache \
             (usage.prompt_tokens_details.cached_tokens) instead of prefilled, by pool",
            self.saved_tokens.clone(),
        );
        r.register(
            "kinference_saved_prefill_gpu_seconds",
            "GPU-seconds of prefill those cached tokens would have cost, from the pool's timing \
             profile (savings_profile), counting every GPU of a replica",
            self.saved_gpu_seconds.clone(),
        );
        r.register(
            "kinference_usage_prompt_tokens",
            "Prompt tokens of the routed requests whose response reported cached tokens: the \
             requests the saved and baseline series count",
            self.usage_prompt_tokens.clone(),
        );
        r.register(
            "kinference_baseline_cached_tokens",
            "Estimated: prompt tokens a baseline policy (baselines) would have found cached on \
             the same requests as kinference_saved_prefill_tokens, had it routed all the \
             traffic itself",
            self.baseline_tokens.clone(),
        );
        r.register(
            "kinference_baseline_saved_prefill_gpu_seconds",
            "Estimated: the prefill GPU-seconds those baseline hits would have saved; saved vs \
             a baseline = kinference_saved_prefill_gpu_seconds minus this",
            self.baseline_gpu_seconds.clone(),
        );
        r.register(
            "kinference_warms_sent",
            "Hot-prefix warms sent (the prefix alone, max_tokens 1; see warm), by pool",
            self.warms_sent.clone(),
        );
        r.register(
            "kinference_warms_failed",
            "Hot-prefix warms that failed (connect, error status, timeout), by pool",
            self.warms_failed.clone(),
        );
        r.register(
            "kinference_warms_skipped",
            "Hot-prefix warms planned but not sent, by pool and reason: cooldown (warmed there \
             within warm.cooldown_ms), in_flight (warm.max_in_flight running), full (the \
             cooldown table is full), no_room (the worker is at max_in_flight_per_replica)",
            self.warms_skipped.clone(),
        );
        r.register(
            "kinference_warm_prompt_tokens",
            "Prompt tokens of the hot-prefix warms sent: their cost in tokens",
            self.warm_prompt_tokens.clone(),
        );
        r.register(
            "kinference_warm_cached_tokens",
            "Of the warms' prompt tokens, those the replica reported already cached",
            self.warm_cached_tokens.clone(),
        );
        r.register(
            "kinference_warm_prefill_gpu_seconds",
            "GPU-seconds the warms' prefill cost, from the pool's timing profile \
             (savings_profile), as kinference bench charges a request",
            self.warm_prefill_gpu_seconds.clone(),
        );
        let usd: Gauge<f64, AtomicU64> = Gauge::default();
        usd.set(prices.usd_per_gpu_hour);
        r.register(
            "kinference_savings_usd_per_gpu_hour",
            "The price of a GPU-hour the savings are valued at (savings.usd_per_gpu_hour)",
            usd,
        );
        let watts: Gauge<f64, AtomicU64> = Gauge::default();
        watts.set(prices.gpu_watts);
        r.register(
            "kinference_savings_gpu_watts",
            "The power of one GPU the saved energy is computed with (savings.gpu_watts)",
            watts,
        );
        r.register(
            "kinference_retries",
            "Requests moved to the next replica before anything was sent (connect failure) \
             or after a 503 response head",
            self.retries.clone(),
        );
        r.register(
            "kinference_router_errors",
            "Requests the router answered with an error, by kind",
            self.router_errors.clone(),
        );
        r.register(
            "kinference_upstream_failures",
            "Failures talking to a replica, by kind",
            self.upstream_failures.family(),
        );
        r.register(
            "kinference_client_disconnects",
            "Responses abandoned by the client before their end",
            self.client_disconnects.clone(),
        );
        r.register(
            "kinference_tokenize_fallbacks",
            "Requests routed by load only because their prompt could not be tokenized",
            self.tokenize_fallbacks.clone(),
        );
        r.register(
            "kinference_replica_scrapes",
            "Scrape ticks of the replicas' /metrics by pool and outcome: ok, failed, or idle \
             (skipped: the replica was quiet since its last scrape, see scrape.idle_interval_ms)",
            self.scrapes.clone(),
        );
        r.register(
            "kinference_picker_served",
            "Endpoint picker: requests by pool and where the gateway says they were served: \
             first (the first endpoint picked), fallback (a later one of the list), elsewhere \
             (an endpoint not picked) or unreported (the stream ended without a response)",
            self.served.clone(),
        );
        self.limits.register(&mut r);
        r.register_collector(Box::new(StateCollector { snapshot }));
        r
    }
}

/// Renders a registry in the text exposition format.
pub(crate) fn render(registry: &Registry) -> String {
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, registry).is_err() {
        out.clear();
        let _ = writeln!(out, "# encoding failed");
    }
    out
}

/// Takes the fleet snapshot a scrape renders.
pub(crate) type Snapshotter = Arc<dyn Fn() -> ReplicasResponse + Send + Sync>;

/// State read at scrape time, from one snapshot.
struct StateCollector {
    snapshot: Snapshotter,
}

impl std::fmt::Debug for StateCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StateCollector")
    }
}

type Labels = Vec<(&'static str, String)>;

/// One metric with its samples, encoded in one descriptor.
struct Series {
    name: &'static str,
    help: &'static str,
    counter: bool,
    samples: Vec<(Labels, f64)>,
}

impl Series {
    fn gauge(name: &'static str, help: &'static str) -> Self {
        Series {
            name,
            help,
            counter: false,
            samples: Vec::new(),
        }
    }

    fn counter(name: &'static str, help: &'static str) -> Self {
        Series {
            counter: true,
            ..Series::gauge(name, help)
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        if self.samples.is_empty() {
            return Ok(());
        }
        let kind = if self.counter {
            MetricType::Counter
        } else {
            MetricType::Gauge
        };
        let mut family = encoder.encode_descriptor(self.name, self.help, None, kind)?;
        for (labels, v) in &self.samples {
            let enc = family.encode_family(labels)?;
            if self.counter {
                // Counters here are u64 counts read from state.
                ConstCounter::new(*v as u64).encode(enc)?;
            } else {
                ConstGauge::new(*v).encode(enc)?;
            }
        }
        Ok(())
    }
}

/// Every state series, in the order they are exposed.
struct StateSeries {
    up: Series,
    scorable: Series,
    unscorable: Series,
    in_flight: Series,
    prefill: Series,
    running: Series,
    waiting: Series,
    kv: Series,
    entries: Series,
    blocks: Series,
    tracked: Series,
    ev_connected: Series,
    ev_state: Series,
    ev_lag: Series,
    ev_entries: Series,
    ev_messages: Series,
    ev_gaps: Series,
    ev_replays: Series,
    ev_replays_ok: Series,
    ev_unrec: Series,
    ev_resets: Series,
    ev_repeats: Series,
    ev_decode: Series,
    discovery_ok: Series,
    discovery_error: Series,
    settings_error: Series,
    ev_unknown: Series,
    tok_lookups: Series,
    tok_bytes: Series,
    tok_entries: Series,
    tok_size: Series,
    tok_evictions: Series,
}

impl StateSeries {
    fn new() -> Self {
        StateSeries {
            up: Series::gauge(
                "kinference_replica_up",
                "1 when the replica's last scrape or request reached it",
            ),
            scorable: Series::gauge(
                "kinference_replica_scorable",
                "1 when the router can reproduce the replica's block hashes (0: routed by load only)",
            ),
            unscorable: Series::gauge(
                "kinference_unscorable_replicas",
                "Replicas whose block hashes the router cannot reproduce, per pool",
            ),
            in_flight: Series::gauge(
                "kinference_worker_in_flight",
                "Requests this router sent to the worker that have not finished",
            ),
            prefill: Series::gauge(
                "kinference_worker_in_flight_prefill_tokens",
                "Predicted uncached prompt tokens of this router's requests still waiting for a first byte",
            ),
            running: Series::gauge(
                "kinference_worker_running",
                "Scraped vllm:num_requests_running",
            ),
            waiting: Series::gauge(
                "kinference_worker_waiting",
                "Scraped vllm:num_requests_waiting",
            ),
            kv: Series::gauge(
                "kinference_worker_kv_usage",
                "Scraped vllm:kv_cache_usage_perc (0..1)",
            ),
            entries: Series::gauge(
                "kinference_index_entries",
                "Entries in the pool's block index",
            ),
            blocks: Series::gauge(
                "kinference_index_blocks",
                "Distinct block hashes in the pool's index",
            ),
            tracked: Series::gauge(
                "kinference_tracked_entries",
                "Router-side (block, worker) entries: speculative, or the approximate policy's record",
            ),
            ev_connected: Series::gauge(
                "kinference_event_stream_connected",
                "1 when the worker's KV-event stream is connected",
            ),
            ev_state: Series::gauge(
                "kinference_event_stream_state",
                "1 for the worker's current sync state (connecting, synced, resynced, stale)",
            ),
            ev_lag: Series::gauge(
                "kinference_event_stream_lag_seconds",
                "Seconds since the worker's last live KV event",
            ),
            ev_entries: Series::gauge(
                "kinference_event_stream_index_entries",
                "Index entries held for the worker",
            ),
            ev_messages: Series::counter(
                "kinference_event_stream_messages",
                "Live KV-event messages received",
            ),
            ev_gaps: Series::counter("kinference_event_stream_gaps", "Sequence gaps detected"),
            ev_replays: Series::counter(
                "kinference_event_stream_replays",
                "Replays attempted to fill gaps",
            ),
            ev_replays_ok: Series::counter(
                "kinference_event_stream_replays_succeeded",
                "Replays that filled their gap",
            ),
            ev_unrec: Series::counter(
                "kinference_event_stream_unrecoverable_gaps",
                "Gaps replay could not fill (the worker was cleared)",
            ),
            ev_resets: Series::counter(
                "kinference_event_stream_resets",
                "Publisher restarts detected",
            ),
            ev_repeats: Series::counter(
                "kinference_event_stream_repeats",
                "Live event messages behind the stream that the publisher's replay proved to be copies (skipped, nothing cleared)",
            ),
            ev_decode: Series::counter(
                "kinference_event_stream_decode_errors",
                "Event messages that could not be decoded",
            ),
            discovery_ok: Series::gauge(
                "kinference_pool_discovery_ok",
                "1 while a discovered pool's source (InferencePool, pods) can be read",
            ),
            discovery_error: Series::gauge(
                "kinference_pool_discovery_error",
                "1 while a discovered pool's source cannot be read, labelled with why",
            ),
            settings_error: Series::gauge(
                "kinference_pool_settings_error",
                "1 while a discovered pool's declared settings (its KinferencePool) cannot be applied; it routes with the last ones that could",
            ),
            ev_unknown: Series::counter(
                "kinference_event_endpoint_unknown_topic_messages",
                "KV-event messages at a bound endpoint under a topic no replica is configured with (dropped)",
            ),
            tok_lookups: Series::counter(
                "kinference_tokenizer_cache_lookups",
                "Prompt texts of 256 bytes or more looked up in the pool tokenizer's prefix cache, by outcome: hit (token ids of an earlier prompt reused) or miss",
            ),
            tok_bytes: Series::counter(
                "kinference_tokenizer_cache_text_bytes",
                "Bytes of the looked-up prompt texts, each counted once: reused (ids from the cache), encoded_on_hit or encoded_on_miss",
            ),
            tok_entries: Series::gauge(
                "kinference_tokenizer_cache_entries",
                "Prompt texts held in the pool tokenizer's prefix cache",
            ),
            tok_size: Series::gauge(
                "kinference_tokenizer_cache_bytes",
                "Bytes the pool tokenizer's prefix cache holds (texts, token ids, split points, block digests)",
            ),
            tok_evictions: Series::counter(
                "kinference_tokenizer_cache_evictions",
                "Entries the pool tokenizer's prefix cache evicted to stay under its capacity",
            ),
        }
    }

    fn add(&mut self, snapshot: &ReplicasResponse) {
        for pool in &snapshot.pools {
            let pl = || vec![("pool", pool.name.clone())];
            self.entries.samples.push((pl(), pool.index_entries as f64));
            self.blocks.samples.push((pl(), pool.index_blocks as f64));
            self.tracked
                .samples
                .push((pl(), pool.tracked_entries as f64));
            self.add_tokenizer_cache(pool);
            if let Some(d) = &pool.discovery {
                let ok = d.synced && d.error.is_none();
                self.discovery_ok
                    .samples
                    .push((pl(), f64::from(u8::from(ok))));
                if let Some(kind) = &d.error_kind {
                    let mut el = pl();
                    el.push(("reason", kind.clone()));
                    self.discovery_error.samples.push((el, 1.0));
                }
                self.settings_error
                    .samples
                    .push((pl(), f64::from(u8::from(d.settings_error.is_some()))));
            }
            let mut n_unscorable = 0usize;
            for replica in &pool.replicas {
                let rl = || {
                    vec![
                        ("pool", pool.name.clone()),
                        ("replica", replica.url.clone()),
                    ]
                };
                let up = replica.health == Health::Up;
                self.up.samples.push((rl(), f64::from(u8::from(up))));
                n_unscorable += usize::from(!replica.scorable);
                self.scorable
                    .samples
                    .push((rl(), f64::from(u8::from(replica.scorable))));
                for w in &replica.workers {
                    let mut wl = rl();
                    wl.push(("rank", w.rank.to_string()));
                    self.add_worker(wl, w);
                }
            }
            self.unscorable.samples.push((pl(), n_unscorable as f64));
            for ep in &pool.event_endpoints {
                let mut el = pl();
                el.push(("endpoint", ep.endpoint.clone()));
                self.ev_unknown
                    .samples
                    .push((el, ep.unknown_topic_messages as f64));
            }
        }
    }

    fn add_tokenizer_cache(&mut self, pool: &crate::api::PoolStatus) {
        let tc = &pool.tokenizer_cache;
        let with = |name: &'static str, value: &str| {
            vec![("pool", pool.name.clone()), (name, value.to_owned())]
        };
        for (outcome, n) in [("hit", tc.hits), ("miss", tc.misses)] {
            self.tok_lookups
                .samples
                .push((with("outcome", outcome), n as f64));
        }
        for (kind, n) in [
            ("reused", tc.bytes_reused),
            ("encoded_on_hit", tc.bytes_encoded_on_hits),
            ("encoded_on_miss", tc.bytes_encoded_on_misses),
        ] {
            self.tok_bytes.samples.push((with("kind", kind), n as f64));
        }
        let pl = || vec![("pool", pool.name.clone())];
        self.tok_entries.samples.push((pl(), tc.entries as f64));
        self.tok_size.samples.push((pl(), tc.bytes as f64));
        self.tok_evictions.samples.push((pl(), tc.evictions as f64));
    }

    fn add_worker(&mut self, wl: Labels, w: &crate::api::WorkerStatus) {
        let load = &w.load;
        self.in_flight
            .samples
            .push((wl.clone(), f64::from(load.in_flight)));
        self.prefill
            .samples
            .push((wl.clone(), load.in_flight_prefill_tokens as f64));
        self.running
            .samples
            .push((wl.clone(), f64::from(load.running)));
        self.waiting
            .samples
            .push((wl.clone(), f64::from(load.waiting)));
        self.kv.samples.push((wl.clone(), load.kv_usage));
        let Some(h) = &w.events else { return };
        self.ev_connected
            .samples
            .push((wl.clone(), f64::from(u8::from(h.connected))));
        let mut sl = wl.clone();
        sl.push(("state", h.sync.clone()));
        self.ev_state.samples.push((sl, 1.0));
        if let Some(ms) = h.last_event_age_ms {
            self.ev_lag.samples.push((wl.clone(), ms as f64 / 1000.0));
        }
        let counts = [
            (&mut self.ev_entries, w.index_entries as u64),
            (&mut self.ev_messages, h.messages),
            (&mut self.ev_gaps, h.gaps),
            (&mut self.ev_replays, h.replays_attempted),
            (&mut self.ev_replays_ok, h.replays_succeeded),
            (&mut self.ev_unrec, h.unrecoverable_gaps),
            (&mut self.ev_resets, h.resets),
            (&mut self.ev_repeats, h.repeats),
            (&mut self.ev_decode, h.decode_errors),
        ];
        for (series, v) in counts {
            series.samples.push((wl.clone(), v as f64));
        }
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for s in [
            &self.up,
            &self.scorable,
            &self.unscorable,
            &self.in_flight,
            &self.prefill,
            &self.running,
            &self.waiting,
            &self.kv,
            &self.entries,
            &self.blocks,
            &self.tracked,
            &self.ev_connected,
            &self.ev_state,
            &self.ev_lag,
            &self.ev_entries,
            &self.ev_messages,
            &self.ev_gaps,
            &self.ev_replays,
            &self.ev_replays_ok,
            &self.ev_unrec,
            &self.ev_resets,
            &self.ev_repeats,
            &self.ev_unknown,
            &self.ev_decode,
            &self.discovery_ok,
            &self.discovery_error,
            &self.settings_error,
            &self.tok_lookups,
            &self.tok_bytes,
            &self.tok_entries,
            &self.tok_size,
            &self.tok_evictions,
        ] {
            s.encode(encoder)?;
        }
        Ok(())
    }
}

impl Collector for StateCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut series = StateSeries::new();
        series.add(&(self.snapshot)());
        series.encode(&mut encoder)
    }
}

#[cfg(test)]
mod tests {
    // Test code: a failed unwrap is a failed test with its message.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    /// What the router adds to a request is tens of microseconds: 40 µs and 120 µs land in
    /// different buckets, a bucket ends below 40 µs, and a stream of minutes still lands below
    /// `+Inf`.
    #[test]
    fn latency_buckets_tell_tens_of_microseconds_apart() {
        let h = latency_histogram();
        for v in [0.000_040, 0.000_120, 200.0] {
            h.observe(v);
        }
        let mut r = Registry::default();
        r.register("t", "t", h);
        let text = render(&r);
        let buckets: Vec<(f64, f64)> = kinference_vllm::metrics::text::parse(&text)
            .map(Result::unwrap)
            .filter(|s| s.name == "t_bucket")
            .map(|s| (s.label("le").unwrap().parse().unwrap(), s.value))
            .collect();
        let below = |v: f64| {
            buckets
                .iter()
                .filter(|(le, _)| *le < v)
                .map(|(_, n)| *n)
                .fold(0.0, f64::max)
        };
        assert!(buckets.iter().any(|(le, _)| *le < 0.000_040), "{text}");
        assert_eq!(below(0.000_120), 1.0, "{text}");
        assert_eq!(below(f64::INFINITY), 3.0, "{text}");
    }
}
