//! The one snapshot of the fleet's state: `/debug/replicas`, `/readyz`, the state series of
//! `/metrics` and the operator CLI's `kinfctl status` all render from [`take`].
//!
//! Invariant: taking a snapshot reads atomics, takes the replica info, the index read locks and
//! the tokenizers' prefix-cache locks briefly, one at a time, and never holds a lock across another or changes routing state.

use kinference_events::{EventPlane, SyncState, WorkerHealth};
use std::time::Duration;

use tokio::time::Instant;

use crate::api::{
    DiscoveryStatus, EventEndpointStatus, EventStreamStatus, PoolStatus, ReplicaStatus,
    ReplicasResponse, WorkerStatus,
};
use crate::fleet::{Fleet, Pool, Replica};
use crate::scrape::roots_match;

/// Whether a snapshot computes the replicas' scale-in costs: one index lookup per prefix each
/// replica remembers, so only where they are shown (`/debug/replicas`, the embedding API),
/// not for probes, `/metrics` or the dashboard's samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Costs {
    Skip,
    Compute,
}

/// The state of every pool and replica now.
pub(crate) fn take(fleet: &Fleet, costs: Costs) -> ReplicasResponse {
    let now = Instant::now();
    ReplicasResponse {
        pools: fleet
            .pools
            .iter()
            .map(|p| pool(p, now, fleet.now(), costs))
            .collect(),
    }
}

/// `since_start` is the fleet's clock ([`crate::fleet::Fleet::now`]), which the replicas'
/// scale-in costs are kept on.
pub(crate) fn pool(pool: &Pool, now: Instant, since_start: Duration, costs: Costs) -> PoolStatus {
    // (now on the fleet's clock, half-life) when the costs are computed.
    let scale_in =
        (costs == Costs::Compute).then(|| (since_start, pool.rules().config.scale_in.half_life()));
    let (index_entries, index_blocks) = pool.index_size();
    let plane = pool.plane();
    let (routed_prompt_tokens, predicted_cached_tokens) = pool.routed_tokens();
    let rules = pool.rules();
    PoolStatus {
        name: pool.name.clone(),
        models: pool.models.clone(),
        block_size: rules.block_size,
        hash_algo: rules.hasher.algo().as_str().to_owned(),
        policy: rules.policy_name.to_owned(),
        index_entries,
        index_blocks,
        tracked_entries: pool.tracked_entries(),
        replicas: pool
            .replicas()
            .iter()
            .map(|r| replica(pool, plane.as_deref(), r, now, scale_in))
            .collect(),
        routed_prompt_tokens,
        predicted_cached_tokens,
        discovery: discovery(pool),
        event_endpoints: plane.as_deref().map(event_endpoints).unwrap_or_default(),
        tokenizer_cache: rules.tokenizer.cache_stats().into(),
    }
}

fn discovery(pool: &Pool) -> Option<DiscoveryStatus> {
    let source = pool.source.as_ref()?;
    let d = pool.discovery.lock().clone();
    let (error_kind, error) = d.error.map_or((None, None), |(k, m)| (Some(k), Some(m)));
    Some(DiscoveryStatus {
        source: format!(
            "inferencepool/{}/{}",
            source.namespace.as_deref().unwrap_or("-"),
            source.name
        ),
        synced: d.synced,
        error,
        error_kind,
        settings_error: d.settings_error,
    })
}

fn event_endpoints(plane: &EventPlane) -> Vec<EventEndpointStatus> {
    plane
        .bound_endpoints()
        .into_iter()
        .map(|b| EventEndpointStatus {
            endpoint: b.endpoint,
            local_endpoint: b.local_endpoint,
            topics: b.topics,
            unknown_topic_messages: b.unknown_messages,
            unknown_topics: b.unknown_topics,
        })
        .collect()
}

fn replica(
    pool: &Pool,
    plane: Option<&EventPlane>,
    r: &Replica,
    now: Instant,
    scale_in: Option<(Duration, Duration)>,
) -> ReplicaStatus {
    let workers = (0..r.dp_size())
        .map(|rank| {
            let worker = r.worker(rank);
            let health = plane.and_then(|p| p.health(worker));
            WorkerStatus {
                rank: rank as u32,
                worker: worker.to_string(),
                load: r.workers[rank].snapshot(),
                index_entries: pool.index.read().worker_entries(worker),
                events: health.map(|h| events(pool, &h, now)),
            }
        })
        .collect();
    let info = r.info.lock();
    ReplicaStatus {
        url: r.url().to_owned(),
        id: r.id.to_string(),
        dp_ranks: r.dp_size() as u32,
        health: r.health(),
        last_error: info.last_error.clone(),
        scorable: r.is_scorable(),
        unscorable_reason: info.unscorable_reason.clone(),
        cache_config: info.cache_config.clone(),
        events_mode: r.events_mode.to_owned(),
        events_error: info.events_error.clone(),
        prefix_cache_hits: info.prefix_cache_hits,
        prefix_cache_queries: info.prefix_cache_queries,
        scrapes: info.scrapes,
        scale_in_cost: scale_in.map(|(since_start, half_life)| {
            r.scale_in_cost(&pool.index.read(), since_start, half_life)
        }),
        workers,
    }
}

fn events(pool: &Pool, h: &WorkerHealth, now: Instant) -> EventStreamStatus {
    EventStreamStatus {
        endpoint: h.endpoint.clone(),
        local_endpoint: h.local_endpoint.clone(),
        connected: h.connected,
        sync: sync_name(h.sync).to_owned(),
        last_seq: h.last_seq,
        applied_seq: h.applied_seq,
        messages: h.messages,
        batches_applied: h.batches_applied,
        gaps: h.gaps,
        replays_attempted: h.replays_attempted,
        replays_succeeded: h.replays_succeeded,
        replayed_batches: h.replayed_batches,
        unrecoverable_gaps: h.unrecoverable_gaps,
        resets: h.resets,
        repeats: h.repeats,
        decode_errors: h.decode_errors,
        socket_errors: h.socket_errors,
        last_event_age_ms: h.last_event_age(now).map(|d| d.as_millis() as u64),
        stored_block_size: h.stored_block_size,
        root_hashes_match: roots_match(&pool.rules().hasher, h),
    }
}

fn sync_name(s: SyncState) -> &'static str {
    match s {
        SyncState::Connecting => "connecting",
        SyncState::Synced => "synced",
        SyncState::Resynced => "resynced",
        SyncState::Stale => "stale",
    }
}
