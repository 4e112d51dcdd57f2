//! The admin port: Prometheus `/metrics`, `/healthz`, `/readyz`, `POST /debug/explain` and
//! `GET /debug/replicas`. Nothing here forwards a request or changes routing state.
//!
//! Invariant: `/debug/explain` runs the same parsing, tokenization and `select` as the data
//! plane, without `apply`, so explaining a request never changes where the next one goes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kinference_events::SyncState;
use prometheus_client::registry::Registry;
use serde::de::IgnoredAny;
use serde::Deserialize;

use crate::api::{
    EventStreamStatus, Health, PoolReady, PoolStatus, ReadyResponse, ReplicaStatus,
    ReplicasResponse, WorkerStatus,
};
use crate::error::{json_response, RequestError};
use crate::fleet::Fleet;
use crate::route::{self, Api};
use crate::server::read_body;

/// What the admin handlers share.
#[derive(Debug)]
pub(crate) struct AdminState {
    pub fleet: Arc<Fleet>,
    pub registry: Registry,
}

pub(crate) fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/explain", post(explain))
        .route("/debug/replicas", get(replicas))
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AdminState>>) -> Response {
    let text = crate::metrics::render(&s.registry);
    let mut resp = (StatusCode::OK, text).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when every pool has at least one replica that answered its last scrape or request.
pub(crate) fn readiness(fleet: &Fleet) -> ReadyResponse {
    let pools: Vec<PoolReady> = fleet
        .pools
        .iter()
        .map(|p| PoolReady {
            name: p.name.clone(),
            healthy_replicas: p
                .replicas
                .iter()
                .filter(|r| r.health() == Health::Up)
                .count(),
            replicas: p.replicas.len(),
        })
        .collect();
    ReadyResponse {
        ready: pools.iter().all(|p| p.healthy_replicas > 0),
        pools,
    }
}

async fn readyz(State(s): State<Arc<AdminState>>) -> Response {
    let r = readiness(&s.fleet);
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &r)
}

#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    messages: Option<IgnoredAny>,
}

/// `POST /debug/explain[?api=chat|completions]` with a request body: the decision, not
/// forwarded. Without `api`, a body with `messages` is a chat request.
async fn explain(State(s): State<Arc<AdminState>>, req: Request) -> Response {
    let query = req.uri().query().unwrap_or("").to_owned();
    let (parts, body) = match read_body(s.fleet.settings.max_body_bytes, req).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let api = if query.split('&').any(|kv| kv == "api=chat") {
        Api::Chat
    } else if query.split('&').any(|kv| kv == "api=completions") {
        Api::Completions
    } else {
        match serde_json::from_slice::<Probe>(&body) {
            Ok(Probe { messages: Some(_) }) => Api::Chat,
            Ok(_) => Api::Completions,
            Err(e) => {
                return RequestError::BadRequest(format!("the body is not a JSON request: {e}"))
                    .into_response()
            }
        }
    };
    match route::prepare(&s.fleet, api, &body, &parts.headers, true) {
        Ok(p) => json_response(StatusCode::OK, &route::explain(&s.fleet, api, &p)),
        Err(e) => e.into_response(),
    }
}

async fn replicas(State(s): State<Arc<AdminState>>) -> Response {
    json_response(StatusCode::OK, &snapshot(&s.fleet))
}

pub(crate) fn sync_name(s: SyncState) -> &'static str {
    match s {
        SyncState::Connecting => "connecting",
        SyncState::Synced => "synced",
        SyncState::Resynced => "resynced",
        SyncState::Stale => "stale",
    }
}

/// The state of every pool and replica now.
pub(crate) fn snapshot(fleet: &Fleet) -> ReplicasResponse {
    let now = tokio::time::Instant::now();
    let pools = fleet
        .pools
        .iter()
        .map(|pool| {
            let plane = pool.plane();
            let (index_entries, index_blocks) = pool.index_size();
            let replicas = pool
                .replicas
                .iter()
                .map(|r| {
                    let workers = (0..r.dp_size())
                        .map(|rank| {
                            let worker = r.worker(rank);
                            let h = plane.as_ref().and_then(|p| p.health(worker));
                            WorkerStatus {
                                rank: rank as u32,
                                worker: worker.to_string(),
                                load: r.workers[rank].snapshot(),
                                index_entries: pool.index.read().worker_entries(worker),
                                events: h.map(|h| EventStreamStatus {
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
                                    decode_errors: h.decode_errors,
                                    socket_errors: h.socket_errors,
                                    last_event_age_ms: h
                                        .last_event_age(now)
                                        .map(|d| d.as_millis() as u64),
                                    stored_block_size: h.stored_block_size,
                                    root_hashes_match: crate::scrape::roots_match(&pool.hasher, &h),
                                }),
                            }
                        })
                        .collect();
                    let info = r.info.lock();
                    ReplicaStatus {
                        url: r.url.clone(),
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
                        workers,
                    }
                })
                .collect();
            PoolStatus {
                name: pool.name.clone(),
                models: pool.models.clone(),
                block_size: pool.block_size,
                hash_algo: pool.hasher.algo().as_str().to_owned(),
                policy: pool.policy_name.to_owned(),
                index_entries,
                index_blocks,
                tracked_entries: pool.tracked_entries(),
                replicas,
            }
        })
        .collect();
    ReplicasResponse { pools }
}
