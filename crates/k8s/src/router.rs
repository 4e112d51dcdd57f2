//! The router's side of discovery: one task per discovered pool follows the pool's
//! [`PoolWatcher`], applies the [`diff`](crate::diff) of each new snapshot to the router's
//! [`PoolMembers`], applies each new generation of the `KinferencePool` naming it (policy,
//! tokenizer, hashing: [`PoolMembers::reconfigure`]), reports whether the pool can be read,
//! and writes the `KinferencePool`'s status.
//!
//! A spec generation is applied, or refused, once: a spec that is invalid or whose tokenizer
//! cannot be loaded leaves the pool on the last settings applied, logged as an error, shown in
//! `/debug/replicas` and `kinference_pool_settings_error`, and reported as the `Accepted`
//! condition `False`; `status.observedGeneration` is the generation applied. The status is
//! written only once the generation it describes has been judged, so it never reports a spec
//! the router has not acted on yet. A `KinferencePool` that goes away leaves the settings as
//! they are (the router's own were replaced at start or by a later generation).
//!
//! Invariants: leavers are removed before joiners are added, so a pod that changed its IP is
//! never routed at both addresses; a member that cannot join is logged and left out until the
//! next snapshot that still lists it; a pool that cannot be read keeps its last known members
//! (the watcher keeps them) and is reported through [`PoolMembers::set_source_state`], once
//! per change in the log. Nothing here panics, and each pool has its own task, so one pool's
//! failure never stops another's.

use std::collections::BTreeMap;
use std::time::Duration;

use kinference_proxy::api::{Health, PoolStatus};
use kinference_proxy::{EventsSpec, PoolMembers, ReconfigureError, ReplicaSpec, UpstreamProtocol};
use kube::Client;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::crd::Hashing;
use crate::snapshot::{
    diff_endpoints, AppProtocol, Endpoint, EventSource, PoolSnapshot, PoolState, Routing,
};
use crate::status::{StatusReport, StatusWriter, Verdict};
use crate::watch::{PoolWatcher, WatchConfig};

/// How often the `KinferencePool` status is re-applied without a change in membership (an
/// apply that changes nothing is not a write on the API server).
pub const STATUS_INTERVAL: Duration = Duration::from_secs(5);

/// Starts following `members`' `InferencePool` (in `namespace` unless the configuration names
/// one) on the current runtime; the task ends when the handle is aborted.
pub fn spawn_pool(client: Client, members: PoolMembers, namespace: &str) -> JoinHandle<()> {
    let ns = members
        .source()
        .namespace
        .clone()
        .unwrap_or_else(|| namespace.to_owned());
    let cfg = WatchConfig::new(&ns, &members.source().name);
    tokio::spawn(run_pool(client, members, cfg))
}

/// Follows one pool until the watcher's channel closes.
pub async fn run_pool(client: Client, members: PoolMembers, cfg: WatchConfig) {
    let writer = StatusWriter::new(client.clone(), &cfg.namespace);
    let watcher = PoolWatcher::start(client.clone(), cfg.clone());
    let mut rx = watcher.subscribe();
    let (spec_tx, spec_rx) = watch::channel(SpecState::default());
    // Its own task: a slow or unreachable API server must not hold back membership changes.
    let status = tokio::spawn(write_status(writer, members.clone(), rx.clone(), spec_rx));
    let costs = tokio::spawn(crate::deletion_cost::run(
        client.clone(),
        members.clone(),
        cfg.namespace.clone(),
    ));
    let mut held: BTreeMap<String, Endpoint> = BTreeMap::new();
    let mut reported: Option<String> = None;
    loop {
        let snap = rx.borrow_and_update().clone();
        apply(&members, &mut held, &snap).await;
        report_state(&members, &snap, &mut reported);
        apply_spec(&members, snap.routing.as_ref(), &spec_tx).await;
        if rx.changed().await.is_err() {
            break;
        }
    }
    status.abort();
    costs.abort();
}

/// Makes the members match the snapshot's endpoints.
async fn apply(members: &PoolMembers, held: &mut BTreeMap<String, Endpoint>, snap: &PoolSnapshot) {
    let d = diff_endpoints(held, &snap.endpoints);
    for name in &d.left {
        members.leave(name).await;
        held.remove(name);
    }
    let joins = d
        .changed
        .into_iter()
        .map(|(n, _, e)| (n, e))
        .chain(d.joined);
    for (name, e) in joins {
        match members.join(&name, &replica_specs(&e)).await {
            Ok(()) => {
                held.insert(name, e);
            }
            Err(err) => {
                // Left out of `held`, so the next snapshot listing it tries again.
                members.leave(&name).await;
                held.remove(&name);
                tracing::warn!(pool = %members.name(), pod = %name, error = %err, "pod cannot join the pool");
            }
        }
    }
}

/// The router's replicas for one pod: one per target port, spoken to in the pool's
/// `appProtocol`; the pod's event source goes with the first, the others ask their own server.
pub fn replica_specs(e: &Endpoint) -> Vec<ReplicaSpec> {
    let protocol = match e.protocol {
        AppProtocol::Http => UpstreamProtocol::Http,
        AppProtocol::H2c => UpstreamProtocol::H2c,
    };
    e.urls
        .iter()
        .enumerate()
        .map(|(i, url)| {
            let mut r = ReplicaSpec::new(url);
            r.protocol = protocol;
            let source = if i == 0 {
                &e.events
            } else {
                &EventSource::Discover
            };
            r.events = Some(events_spec(source));
            r
        })
        .collect()
}

fn events_spec(source: &EventSource) -> EventsSpec {
    match source {
        EventSource::Discover => EventsSpec {
            discover: true,
            ..EventsSpec::default()
        },
        EventSource::Connect {
            endpoint,
            replay,
            topic,
        } => EventsSpec {
            connect: Some(endpoint.clone()),
            replay: replay.clone(),
            topic: topic.clone(),
            ..EventsSpec::default()
        },
        EventSource::Bind {
            endpoint,
            replay,
            topic,
        } => EventsSpec {
            bind: Some(endpoint.clone()),
            replay: replay.clone(),
            topic: topic.clone(),
            ..EventsSpec::default()
        },
    }
}

/// Where the pool's `KinferencePool` spec stands, for the status.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SpecState {
    /// The `KinferencePool` (name, generation) last applied or refused.
    pub judged: Option<(String, Option<i64>)>,
    /// The one whose spec the pool routes with.
    pub applied: Option<(String, Option<i64>)>,
    /// The `Accepted` condition for `judged`.
    pub accepted: Option<Verdict>,
}

/// Applies a `KinferencePool` generation not judged yet: its policy, tokenizer and hashing
/// replace the pool's settings, or, when they cannot, the pool keeps its settings and the
/// refusal is logged and reported.
async fn apply_spec(
    members: &PoolMembers,
    routing: Option<&Routing>,
    state: &watch::Sender<SpecState>,
) {
    let Some(r) = routing else {
        if state.borrow().judged.is_some() {
            tracing::info!(pool = %members.name(),
                "no KinferencePool names the InferencePool any more; the pool keeps the settings it routes with");
            members.set_settings_error(None);
            state.send_replace(SpecState::default());
        }
        return;
    };
    let key = (r.name.clone(), r.generation);
    if state.borrow().judged.as_ref() == Some(&key) {
        return;
    }
    let generation = r.generation.unwrap_or_default();
    let mut settings = members.settings();
    let outcome = match crate::settings::overlay(&mut settings, &r.spec) {
        Err(errors) => Err(("InvalidSpec", errors.join("; "))),
        Ok(_) => members.reconfigure(&settings).await.map_err(|e| {
            let reason = match e {
                ReconfigureError::Config(_) => "InvalidSpec",
                ReconfigureError::Tokenizer { .. } | ReconfigureError::Task { .. } => {
                    "TokenizerNotLoaded"
                }
            };
            (reason, e.to_string())
        }),
    };
    let previous = state.borrow().applied.clone();
    let next = match outcome {
        Ok(changed) => {
            if !changed.is_empty() {
                tracing::info!(pool = %members.name(), kinference_pool = %r.name, generation,
                    ?changed, "routing with the KinferencePool's new policy, tokenizer and hashing");
            }
            members.set_settings_error(None);
            SpecState {
                judged: Some(key.clone()),
                applied: Some(key),
                accepted: Some(Verdict::True {
                    reason: "Applied".into(),
                    message: format!("the router routes with generation {generation}"),
                }),
            }
        }
        Err((reason, message)) => {
            let kept = match &previous {
                Some((name, Some(g))) if *name == r.name => format!("generation {g}"),
                Some((name, g)) => format!(
                    "KinferencePool {name}'s generation {}",
                    g.unwrap_or_default()
                ),
                None => "the router's own settings".to_owned(),
            };
            // status.observedGeneration is this object's: another's generation says nothing.
            let applied = previous.filter(|(name, _)| *name == r.name);
            tracing::error!(pool = %members.name(), kinference_pool = %r.name, generation,
                reason, error = %message,
                "the KinferencePool's spec cannot be applied; the pool keeps routing with its last settings");
            members.set_settings_error(Some(format!(
                "KinferencePool {} generation {generation}: {message}",
                r.name
            )));
            SpecState {
                judged: Some(key),
                applied,
                accepted: Some(Verdict::False {
                    reason: reason.into(),
                    message: format!("{message}; routing with {kept}"),
                }),
            }
        }
    };
    state.send_replace(next);
}

/// Tells the router whether the pool can be read, logging each change once.
fn report_state(members: &PoolMembers, snap: &PoolSnapshot, reported: &mut Option<String>) {
    match &snap.state {
        PoolState::Syncing => {}
        PoolState::Ready => {
            if reported.take().is_some() {
                tracing::info!(pool = %members.name(), namespace = %snap.namespace,
                    inference_pool = %snap.pool, "InferencePool readable again");
            }
            members.set_source_state(None);
        }
        PoolState::Error(e) => {
            let message = e.to_string();
            if reported.as_deref() != Some(&message) {
                tracing::error!(pool = %members.name(), namespace = %snap.namespace,
                    inference_pool = %snap.pool, error = %message, kept = snap.endpoints.len(),
                    "InferencePool cannot be read; routing goes on over the `kept` replicas last read");
                *reported = Some(message.clone());
            }
            members.set_source_state(Some((e.metric_label(), message)));
        }
    }
}

/// Applies the `KinferencePool` status, when one names the pool, on every new snapshot and
/// every [`STATUS_INTERVAL`].
async fn write_status(
    writer: StatusWriter,
    members: PoolMembers,
    mut rx: watch::Receiver<PoolSnapshot>,
    mut spec: watch::Receiver<SpecState>,
) {
    let mut tick = tokio::time::interval(STATUS_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut window = HitWindow::default();
    loop {
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            changed = spec.changed() => if changed.is_err() { return },
            _ = tick.tick() => {}
        }
        let snap = rx.borrow_and_update().clone();
        let judged = spec.borrow_and_update().clone();
        let Some(routing) = &snap.routing else {
            continue;
        };
        let key = (routing.name.clone(), routing.generation);
        let Some(accepted) = judged.accepted.filter(|_| judged.judged == Some(key)) else {
            // The pool task has not acted on this generation yet; it says when it has.
            continue;
        };
        let pool = members.status();
        let predicted = window.update(&pool);
        let mut report = report_for(&pool, &snap.state, Some(&routing.spec.hashing));
        report.predicted_hit_rate = predicted;
        report.accepted = accepted;
        report.generation = routing.generation;
        report.applied_generation = judged.applied.and_then(|(_, g)| g);
        let now = k8s_openapi::jiff::Timestamp::now();
        if let Err(e) = writer.apply(&routing.name, &report, now).await {
            tracing::warn!(pool = %members.name(), kinference_pool = %routing.name, error = %e,
                reason = e.metric_label(), "writing the KinferencePool status failed");
        }
    }
}

/// The predicted hit rate over the status window: tokens the policy expected cached / prompt
/// tokens routed, between two status writes. A window without routed tokens keeps the last
/// rate, so an idle pool does not flap to "unknown".
#[derive(Clone, Debug, Default)]
pub struct HitWindow {
    /// (routed prompt tokens, predicted cached tokens) at the previous write; since start
    /// before the first.
    last: (u64, u64),
    rate: Option<f64>,
}

impl HitWindow {
    /// Moves the window to `pool`'s counters and returns the rate over it.
    pub fn update(&mut self, pool: &PoolStatus) -> Option<f64> {
        let now = (pool.routed_prompt_tokens, pool.predicted_cached_tokens);
        let routed = now.0.saturating_sub(self.last.0);
        let predicted = now.1.saturating_sub(self.last.1);
        self.last = now;
        if routed > 0 {
            // Token counts per window are far below 2^52: exact as f64.
            self.rate = Some(predicted as f64 / routed as f64);
        }
        self.rate
    }
}

/// Why the `KinferencePool`'s hashing is not the one the router hashes with, if it is not.
fn hashing_differs(pool: &PoolStatus, declared: &Hashing) -> Option<String> {
    let mut why = Vec::new();
    if declared.block_size != pool.block_size {
        why.push(format!(
            "spec.hashing.blockSize is {}, the router's pool uses {}",
            declared.block_size, pool.block_size
        ));
    }
    if declared.algorithm != pool.hash_algo {
        why.push(format!(
            "spec.hashing.algorithm is {}, the router's pool uses {}",
            declared.algorithm, pool.hash_algo
        ));
    }
    (!why.is_empty()).then(|| {
        format!(
            "{}; the spec is not applied (see the Accepted condition)",
            why.join("; ")
        )
    })
}

/// The status report for a pool as the router sees it (pure); `declared` is the hashing the
/// `KinferencePool` says the pods run with.
pub fn report_for(
    pool: &PoolStatus,
    state: &PoolState,
    declared: Option<&Hashing>,
) -> StatusReport {
    let total = pool.replicas.len();
    let up = pool.replicas.iter().filter(|r| r.health != Health::Down);
    let scorable = up.clone().filter(|r| r.scorable).count();
    let healthy = up.count();
    let ready = match state {
        PoolState::Error(e) => Verdict::False {
            reason: "SourceUnreadable".into(),
            message: e.to_string(),
        },
        PoolState::Syncing => Verdict::Unknown {
            reason: "Syncing".into(),
            message: "the InferencePool has not been read yet".into(),
        },
        PoolState::Ready if healthy == 0 => Verdict::False {
            reason: "NoReplicas".into(),
            message: format!("{total} replicas, none reachable"),
        },
        PoolState::Ready => Verdict::True {
            reason: "Routing".into(),
            message: format!("{healthy} of {total} replicas reachable"),
        },
    };
    let unscorable: Vec<String> = pool
        .replicas
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.url, r.unscorable_reason.as_ref()?)))
        .collect();
    let config_differs = declared.and_then(|d| hashing_differs(pool, d));
    let hashing_verified = if let Some(why) = config_differs {
        Verdict::False {
            reason: "RouterConfigDiffers".into(),
            message: why,
        }
    } else if !unscorable.is_empty() {
        Verdict::False {
            reason: "HashMismatch".into(),
            message: unscorable.join("; "),
        }
    } else if pool.replicas.iter().any(|r| r.cache_config.is_some()) {
        Verdict::True {
            reason: "CacheConfigMatches".into(),
            message: "every replica's cache configuration and events match the pool's".into(),
        }
    } else {
        Verdict::Unknown {
            reason: "NotChecked".into(),
            message: "no replica has reported its cache configuration yet".into(),
        }
    };
    let (hits, queries) = pool.replicas.iter().fold((0.0, 0.0), |(h, q), r| {
        (
            h + r.prefix_cache_hits.unwrap_or(0.0),
            q + r.prefix_cache_queries.unwrap_or(0.0),
        )
    });
    StatusReport {
        ready,
        hashing_verified,
        accepted: Verdict::Unknown {
            reason: "NotJudged".into(),
            message: "the router has not acted on this spec yet".into(),
        },
        generation: None,
        applied_generation: None,
        replicas: i32::try_from(total).unwrap_or(i32::MAX),
        scorable_replicas: i32::try_from(scorable).unwrap_or(i32::MAX),
        predicted_hit_rate: None,
        reported_hit_rate: (queries > 0.0).then(|| hits / queries),
    }
}

#[cfg(test)]
mod tests {
    use kinference_proxy::api::{CacheConfigStatus, ReplicaStatus};

    use super::*;
    use crate::error::PoolError;

    fn replica(url: &str, health: Health, unscorable: Option<&str>) -> ReplicaStatus {
        ReplicaStatus {
            url: url.into(),
            id: "r".into(),
            dp_ranks: 1,
            health,
            last_error: None,
            scorable: unscorable.is_none(),
            unscorable_reason: unscorable.map(String::from),
            cache_config: Some(CacheConfigStatus {
                block_size: Some(16),
                num_gpu_blocks: Some(4096),
                hash_algo: Some("sha256".into()),
                prefix_caching: Some(true),
            }),
            events_mode: "discover".into(),
            events_error: None,
            prefix_cache_hits: Some(30.0),
            prefix_cache_queries: Some(100.0),
            scrapes: Default::default(),
            scale_in_cost: None,
            workers: Vec::new(),
        }
    }

    fn pool(replicas: Vec<ReplicaStatus>) -> PoolStatus {
        PoolStatus {
            name: "p".into(),
            models: vec!["m".into()],
            block_size: 16,
            hash_algo: "sha256".into(),
            policy: "precise".into(),
            index_entries: 0,
            index_blocks: 0,
            tracked_entries: 0,
            replicas,
            routed_prompt_tokens: 0,
            predicted_cached_tokens: 0,
            discovery: None,
            event_endpoints: Vec::new(),
            tokenizer_cache: Default::default(),
        }
    }

    #[test]
    fn the_predicted_hit_rate_is_over_the_window_and_kept_while_idle() {
        let mut p = pool(Vec::new());
        let mut w = HitWindow::default();
        assert_eq!(w.update(&p), None);
        (p.routed_prompt_tokens, p.predicted_cached_tokens) = (1000, 250);
        assert_eq!(w.update(&p), Some(0.25));
        (p.routed_prompt_tokens, p.predicted_cached_tokens) = (2000, 1150);
        assert_eq!(w.update(&p), Some(0.9));
        assert_eq!(w.update(&p), Some(0.9));
    }

    #[test]
    fn the_report_counts_reachable_and_scorable_replicas() {
        let p = pool(vec![
            replica("http://a:1", Health::Up, None),
            replica("http://b:1", Health::Up, Some("block size 32")),
            replica("http://c:1", Health::Down, None),
        ]);
        let r = report_for(&p, &PoolState::Ready, None);
        assert_eq!((r.replicas, r.scorable_replicas), (3, 1));
        assert!(matches!(r.ready, Verdict::True { .. }), "{r:?}");
        assert!(
            matches!(&r.hashing_verified, Verdict::False { message, .. } if message.contains("http://b:1: block size 32")),
            "{r:?}"
        );
        assert_eq!(r.reported_hit_rate, Some(0.3));
    }

    #[test]
    fn an_unreadable_or_empty_pool_is_not_ready() {
        let denied = PoolState::Error(PoolError::Unreachable("refused".into()));
        let r = report_for(&pool(Vec::new()), &denied, None);
        assert!(
            matches!(&r.ready, Verdict::False { reason, .. } if reason == "SourceUnreadable"),
            "{r:?}"
        );
        let r = report_for(&pool(Vec::new()), &PoolState::Ready, None);
        assert!(
            matches!(&r.ready, Verdict::False { reason, .. } if reason == "NoReplicas"),
            "{r:?}"
        );
        assert!(matches!(r.hashing_verified, Verdict::Unknown { .. }));
        assert_eq!(r.reported_hit_rate, None);
    }

    #[test]
    fn a_declared_hashing_other_than_the_routers_is_reported() {
        let p = pool(vec![replica("http://a:1", Health::Up, None)]);
        let same = Hashing {
            block_size: 16,
            algorithm: "sha256".into(),
            seed: None,
        };
        let r = report_for(&p, &PoolState::Ready, Some(&same));
        assert!(matches!(r.hashing_verified, Verdict::True { .. }), "{r:?}");
        let other = Hashing {
            block_size: 32,
            ..same
        };
        let r = report_for(&p, &PoolState::Ready, Some(&other));
        assert!(
            matches!(&r.hashing_verified, Verdict::False { reason, message }
                if reason == "RouterConfigDiffers" && message.contains("blockSize is 32")),
            "{r:?}"
        );
    }

    #[test]
    fn each_target_port_is_a_replica_and_the_pod_source_goes_with_the_first() {
        let e = Endpoint {
            ip: std::net::IpAddr::from([10, 0, 0, 5]),
            urls: vec!["http://10.0.0.5:8000".into(), "http://10.0.0.5:8001".into()],
            protocol: Default::default(),
            labels: Default::default(),
            annotations: Default::default(),
            events: EventSource::Connect {
                endpoint: "tcp://10.0.0.5:5557".into(),
                replay: None,
                topic: "kv".into(),
            },
        };
        let specs = replica_specs(&e);
        assert_eq!(specs.len(), 2);
        let first = specs[0].events.clone().unwrap_or_default();
        assert_eq!(first.connect.as_deref(), Some("tcp://10.0.0.5:5557"));
        assert_eq!(first.topic, "kv");
        assert!(specs[1].events.as_ref().is_some_and(|e| e.discover));
        assert!(specs.iter().all(|s| s.protocol == UpstreamProtocol::Http));
        let h2c = Endpoint {
            protocol: AppProtocol::H2c,
            ..e
        };
        assert!(replica_specs(&h2c)
            .iter()
            .all(|s| s.protocol == UpstreamProtocol::H2c));
    }
}
