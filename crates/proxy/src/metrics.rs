//! The router's Prometheus metrics (admin `/metrics`), through a registry built at start.
//!
//! Two kinds: event counters and histograms updated on the request path ([`Metrics`], cheap
//! clones of shared families), and state read when scraped ([`FleetCollector`]: replica
//! health and load, scorability, index size, KV-event stream health). Label values are bounded
//! sets: route names from a fixed list, replica URLs and pool names from the configuration,
//! status codes, and fixed reason/kind labels — never anything from a request body.

use std::fmt::Write as _;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::api::Health;
use crate::fleet::Fleet;

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

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~260 s.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 21))
}

/// Families updated on the request path. Clones share the same series.
#[derive(Clone, Debug)]
pub(crate) struct Metrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<RouteReplica, Histogram, fn() -> Histogram>,
    pub first_byte: Family<RouteReplica, Histogram, fn() -> Histogram>,
    pub decisions: Family<DecisionLabels, Counter>,
    /// `kind` = predicted | actual, over requests whose response reported cached tokens.
    pub cached_tokens: Family<PoolKind, Counter>,
    pub usage_observed: Family<PoolLabel, Counter>,
    pub prompt_tokens: Family<PoolLabel, Counter>,
    /// `kind` = connect | unavailable.
    pub retries: Family<PoolKind, Counter>,
    pub router_errors: Family<KindLabel, Counter>,
    pub upstream_failures: Family<ReplicaKind, Counter>,
    pub client_disconnects: Family<RouteLabel, Counter>,
    pub tokenize_fallbacks: Family<PoolKind, Counter>,
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            first_byte: Family::new_with_constructor(latency_histogram),
            decisions: Family::default(),
            cached_tokens: Family::default(),
            usage_observed: Family::default(),
            prompt_tokens: Family::default(),
            retries: Family::default(),
            router_errors: Family::default(),
            upstream_failures: Family::default(),
            client_disconnects: Family::default(),
            tokenize_fallbacks: Family::default(),
        }
    }

    /// Registers every family and the fleet's state collector.
    pub fn registry(&self, fleet: Arc<Fleet>) -> Registry {
        let mut r = Registry::default();
        r.register(
            "kinference_requests",
            "Requests answered, by route, replica (empty when the router answered) and status",
            self.requests.clone(),
        );
        r.register(
            "kinference_request_duration_seconds",
            "Time from the request to the end of the response body, by route and replica",
            self.duration.clone(),
        );
        r.register(
            "kinference_first_byte_seconds",
            "Time from the request to the first response body byte, by route and replica",
            self.first_byte.clone(),
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
            "kinference_usage_observed",
            "Routed requests whose response reported cached tokens",
            self.usage_observed.clone(),
        );
        r.register(
            "kinference_routed_prompt_tokens",
            "Prompt tokens of routed requests, as the router tokenized them",
            self.prompt_tokens.clone(),
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
            self.upstream_failures.clone(),
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
        r.register_collector(Box::new(FleetCollector { fleet }));
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

/// State read at scrape time.
#[derive(Debug)]
struct FleetCollector {
    fleet: Arc<Fleet>,
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

impl Collector for FleetCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut up = Series::gauge(
            "kinference_replica_up",
            "1 when the replica's last scrape or request reached it",
        );
        let mut scorable = Series::gauge(
            "kinference_replica_scorable",
            "1 when the router can reproduce the replica's block hashes (0: routed by load only)",
        );
        let mut unscorable = Series::gauge(
            "kinference_unscorable_replicas",
            "Replicas whose block hashes the router cannot reproduce, per pool",
        );
        let mut in_flight = Series::gauge(
            "kinference_worker_in_flight",
            "Requests this router sent to the worker that have not finished",
        );
        let mut prefill = Series::gauge(
            "kinference_worker_in_flight_prefill_tokens",
            "Predicted uncached prompt tokens of this router's requests still waiting for a first byte",
        );
        let mut running = Series::gauge(
            "kinference_worker_running",
            "Scraped vllm:num_requests_running",
        );
        let mut waiting = Series::gauge(
            "kinference_worker_waiting",
            "Scraped vllm:num_requests_waiting",
        );
        let mut kv = Series::gauge(
            "kinference_worker_kv_usage",
            "Scraped vllm:kv_cache_usage_perc (0..1)",
        );
        let mut entries = Series::gauge(
            "kinference_index_entries",
            "Entries in the pool's block index",
        );
        let mut blocks = Series::gauge(
            "kinference_index_blocks",
            "Distinct block hashes in the pool's index",
        );
        let mut tracked = Series::gauge(
            "kinference_tracked_entries",
            "Router-side (block, worker) entries: speculative, or the approximate policy's record",
        );
        let mut ev_connected = Series::gauge(
            "kinference_event_stream_connected",
            "1 when the worker's KV-event stream is connected",
        );
        let mut ev_state = Series::gauge(
            "kinference_event_stream_state",
            "1 for the worker's current sync state (connecting, synced, resynced, stale)",
        );
        let mut ev_lag = Series::gauge(
            "kinference_event_stream_lag_seconds",
            "Seconds since the worker's last live KV event",
        );
        let mut ev_entries = Series::gauge(
            "kinference_event_stream_index_entries",
            "Index entries held for the worker",
        );
        let mut ev_messages = Series::counter(
            "kinference_event_stream_messages",
            "Live KV-event messages received",
        );
        let mut ev_gaps = Series::counter("kinference_event_stream_gaps", "Sequence gaps detected");
        let mut ev_replays = Series::counter(
            "kinference_event_stream_replays",
            "Replays attempted to fill gaps",
        );
        let mut ev_replays_ok = Series::counter(
            "kinference_event_stream_replays_succeeded",
            "Replays that filled their gap",
        );
        let mut ev_unrec = Series::counter(
            "kinference_event_stream_unrecoverable_gaps",
            "Gaps replay could not fill (the worker was cleared)",
        );
        let mut ev_resets = Series::counter(
            "kinference_event_stream_resets",
            "Publisher restarts detected",
        );
        let mut ev_decode = Series::counter(
            "kinference_event_stream_decode_errors",
            "Event messages that could not be decoded",
        );

        let now = tokio::time::Instant::now();
        for pool in &self.fleet.pools {
            let pl = || vec![("pool", pool.name.clone())];
            let (n_entries, n_blocks) = pool.index_size();
            entries.samples.push((pl(), n_entries as f64));
            blocks.samples.push((pl(), n_blocks as f64));
            tracked.samples.push((pl(), pool.tracked_entries() as f64));
            let mut n_unscorable = 0usize;
            let plane = pool.plane();
            for replica in &pool.replicas {
                let rl = || {
                    vec![
                        ("pool", pool.name.clone()),
                        ("replica", replica.url.clone()),
                    ]
                };
                up.samples
                    .push((rl(), f64::from(u8::from(replica.health() == Health::Up))));
                let ok = replica.is_scorable();
                n_unscorable += usize::from(!ok);
                scorable.samples.push((rl(), f64::from(u8::from(ok))));
                for (rank, w) in replica.workers.iter().enumerate() {
                    let wl = || {
                        let mut l = rl();
                        l.push(("rank", rank.to_string()));
                        l
                    };
                    let load = w.snapshot();
                    in_flight.samples.push((wl(), f64::from(load.in_flight)));
                    prefill
                        .samples
                        .push((wl(), load.in_flight_prefill_tokens as f64));
                    running.samples.push((wl(), f64::from(load.running)));
                    waiting.samples.push((wl(), f64::from(load.waiting)));
                    kv.samples.push((wl(), load.kv_usage));
                    let Some(h) = plane.as_ref().and_then(|p| p.health(replica.worker(rank)))
                    else {
                        continue;
                    };
                    ev_connected
                        .samples
                        .push((wl(), f64::from(u8::from(h.connected))));
                    let mut sl = wl();
                    sl.push(("state", crate::admin::sync_name(h.sync).to_owned()));
                    ev_state.samples.push((sl, 1.0));
                    if let Some(age) = h.last_event_age(now) {
                        ev_lag.samples.push((wl(), age.as_secs_f64()));
                    }
                    ev_entries.samples.push((wl(), h.entries as f64));
                    ev_messages.samples.push((wl(), h.messages as f64));
                    ev_gaps.samples.push((wl(), h.gaps as f64));
                    ev_replays.samples.push((wl(), h.replays_attempted as f64));
                    ev_replays_ok
                        .samples
                        .push((wl(), h.replays_succeeded as f64));
                    ev_unrec.samples.push((wl(), h.unrecoverable_gaps as f64));
                    ev_resets.samples.push((wl(), h.resets as f64));
                    ev_decode.samples.push((wl(), h.decode_errors as f64));
                }
            }
            unscorable.samples.push((pl(), n_unscorable as f64));
        }
        for s in [
            &up,
            &scorable,
            &unscorable,
            &in_flight,
            &prefill,
            &running,
            &waiting,
            &kv,
            &entries,
            &blocks,
            &tracked,
            &ev_connected,
            &ev_state,
            &ev_lag,
            &ev_entries,
            &ev_messages,
            &ev_gaps,
            &ev_replays,
            &ev_replays_ok,
            &ev_unrec,
            &ev_resets,
            &ev_decode,
        ] {
            s.encode(&mut encoder)?;
        }
        Ok(())
    }
}
