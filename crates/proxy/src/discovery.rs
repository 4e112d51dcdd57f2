//! KV-event endpoint discovery through a replica's `GET /kv_event_sources`
//! (`{dp_rank: KVEventsConfig}` with resolved endpoints), retried until it succeeds.
//!
//! Invariants: endpoints are resolved by the workspace's one resolver
//! ([`kinference_events::resolve_endpoint`]: a wildcard host is dialled at the replica's own
//! host, an endpoint the publisher connected to is bound). The event plane offsets a base
//! endpoint by the DP rank, so the per-rank endpoints the replica reports are turned back into
//! base endpoints (port − rank) before subscribing.

use std::sync::Arc;
use std::time::Duration;

use kinference_events::{
    resolve_endpoint, resolve_replay, EndpointError, EventPlane, WorkerConfig,
};
use kinference_vllm::DpRank;
use serde::Deserialize;

use crate::fleet::{Fleet, Replica};
use crate::upstream::GetError;

/// One rank's entry of `/kv_event_sources`.
#[derive(Clone, Debug, Deserialize)]
struct Source {
    endpoint: String,
    #[serde(default)]
    replay_endpoint: Option<String>,
    #[serde(default)]
    topic: Option<String>,
    #[serde(default = "yes")]
    enable_kv_cache_events: bool,
}

fn yes() -> bool {
    true
}

/// Fetches the sources and subscribes to each rank; returns the number of ranks subscribed.
async fn discover_once(
    fleet: &Fleet,
    plane: &EventPlane,
    replica: &Replica,
) -> Result<usize, DiscoveryError> {
    let (status, body) = fleet
        .upstream
        .get(
            &replica.endpoint,
            "/kv_event_sources",
            fleet.settings.scrape_timeout,
            1 << 20,
        )
        .await?;
    if !status.is_success() {
        return Err(DiscoveryError::Status(status));
    }
    let sources: std::collections::BTreeMap<String, Source> =
        serde_json::from_slice(&body).map_err(|e| DiscoveryError::Json(e.to_string()))?;
    let host = replica.endpoint.authority.host();
    let mut added = 0;
    let single = replica.dp_size() == 1 && sources.len() == 1;
    for (key, src) in &sources {
        if !src.enable_kv_cache_events {
            continue;
        }
        let reported: u32 = key.parse().map_err(|_| DiscoveryError::Rank(key.clone()))?;
        // A single-rank replica serving global rank r (external DP load balancing) is worker 0
        // here, and its endpoints are its own (no offset to undo).
        let (rank, offset) = if single { (0, 0) } else { (reported, reported) };
        if rank as usize >= replica.dp_size() {
            tracing::warn!(replica = %replica.url(), rank, "event source for a rank beyond dp_ranks; ignored");
            continue;
        }
        let ep = resolve_endpoint(&src.endpoint, offset, host)?;
        let mut wc = if ep.we_bind {
            WorkerConfig::bind(replica.id, DpRank(rank), &ep.base)
        } else {
            WorkerConfig::connect(replica.id, DpRank(rank), &ep.base)
        };
        let topic = src.topic.clone().unwrap_or_else(|| replica.topic.clone());
        wc = wc.with_topic(&topic);
        if let Some(rep) = &src.replay_endpoint {
            wc = wc.with_replay(&resolve_replay(rep, offset, host)?);
        }
        match plane.add_worker(wc).await {
            Ok(_) | Err(kinference_events::EventsError::DuplicateWorker(_)) => added += 1,
            Err(e) => return Err(DiscoveryError::Subscribe(e)),
        }
    }
    Ok(added)
}

/// Why one discovery attempt failed (it is retried).
#[derive(Debug, thiserror::Error)]
enum DiscoveryError {
    #[error(transparent)]
    Get(#[from] GetError),
    #[error("/kv_event_sources answered {0}")]
    Status(http::StatusCode),
    #[error("/kv_event_sources: {0}")]
    Json(String),
    #[error("/kv_event_sources: rank {0:?} is not a number")]
    Rank(String),
    #[error(transparent)]
    Endpoint(#[from] EndpointError),
    #[error(transparent)]
    Subscribe(kinference_events::EventsError),
}

/// Retries discovery with capped backoff until the replica answers; aborted at shutdown.
pub(crate) async fn run(fleet: Arc<Fleet>, pool: usize, replica: Arc<Replica>) {
    let mut wait = Duration::from_millis(200);
    loop {
        let plane = fleet.pools.get(pool).and_then(|p| p.plane());
        let Some(plane) = plane else { return };
        match discover_once(&fleet, &plane, &replica).await {
            Ok(n) => {
                tracing::info!(replica = %replica.url(), ranks = n, "KV-event sources discovered");
                replica.info.lock().events_error = None;
                fleet.bump();
                return;
            }
            Err(e) => {
                tracing::debug!(replica = %replica.url(), error = %e, "KV-event discovery failed; retrying");
                replica.info.lock().events_error = Some(e.to_string());
                fleet.bump();
            }
        }
        drop(plane);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}
