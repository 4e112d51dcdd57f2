//! The data port: `/v1/completions` and `/v1/chat/completions` routed by the pool's policy,
//! `/v1/models` aggregated over the fleet, every other path passed through to a replica of the
//! pool its `model` names (the first pool without one), least loaded first.
//!
//! Invariant: a handler always ends in exactly one response: the replica's (streamed as it
//! comes), or the router's own error in OpenAI's shape.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::header;
use http::request::Parts;
use http::StatusCode;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::api::Health;
use crate::error::{json_response, RequestError};
use crate::fleet::{Fleet, Pool};
use crate::forward::{forward, reject, Forward, Target};
use crate::metrics::{DecisionLabels, PoolLabel, RequestLabels};
use crate::route::{self, Api};
use crate::upstream::Upstream;

/// What the data port's handlers share: the fleet, and the upstream client of the thread
/// they run on.
#[derive(Clone)]
pub(crate) struct Data {
    fleet: Arc<Fleet>,
    upstream: Upstream,
}

pub(crate) fn router(fleet: Arc<Fleet>, upstream: Upstream) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .fallback(passthrough)
        .with_state(Data { fleet, upstream })
}

/// Reads a whole request body, refusing more than `limit` bytes.
pub(crate) async fn read_body(limit: usize, req: Request) -> Result<(Parts, Bytes), RequestError> {
    let (parts, body) = req.into_parts();
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(RequestError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok((parts, c.to_bytes())),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(RequestError::TooLarge { limit })
        }
        Err(e) => Err(RequestError::ClientBody(e.to_string())),
    }
}

fn path_and_query(parts: &Parts) -> String {
    parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned())
}

async fn completions(State(data): State<Data>, req: Request) -> Response {
    routed(data, Api::Completions, req).await
}

async fn chat_completions(State(data): State<Data>, req: Request) -> Response {
    routed(data, Api::Chat, req).await
}

async fn routed(Data { fleet, upstream }: Data, api: Api, req: Request) -> Response {
    let start = Instant::now();
    let route = api.route();
    let (parts, body) = match read_body(fleet.settings.max_body_bytes, req).await {
        Ok(x) => x,
        Err(e) => return reject(&fleet, route, e),
    };
    let prepared = match route::prepare(&fleet, api, &body, &parts.headers, false) {
        Ok(p) => p,
        Err(e) => return reject(&fleet, route, e),
    };
    let (decision, _) = route::decide(&fleet, &prepared, true);
    let pool = prepared.pool.clone();
    let m = &fleet.metrics;
    m.decisions
        .get_or_create(&DecisionLabels {
            pool: pool.name.clone(),
            policy: decision.policy,
            reason: decision.reason.as_str(),
        })
        .inc();
    m.prompt_tokens
        .get_or_create(&PoolLabel {
            pool: pool.name.clone(),
        })
        .inc_by(u64::from(prepared.prompt_tokens));
    let targets: Vec<Target> = decision
        .ranked
        .iter()
        .zip(&decision.scores)
        .filter_map(|(w, s)| {
            let replica = pool.replica(w.replica)?.clone();
            let pin_rank = replica.dp_size() > 1;
            Some(Target {
                replica,
                rank: w.rank.0 as usize,
                pin_rank,
                predicted_cached: s.predicted_cached_tokens,
            })
        })
        .collect();
    tracing::debug!(
        pool = %pool.name,
        prompt_tokens = prepared.prompt_tokens,
        blocks = prepared.hashes.len(),
        reason = decision.reason.as_str(),
        chosen = ?decision.chosen(),
        "routing decision"
    );
    let fwd = Forward {
        route,
        pool: Some(pool.name.clone()),
        prompt_tokens: prepared.prompt_tokens,
        method: parts.method.clone(),
        path_and_query: path_and_query(&parts),
        headers: parts.headers,
        body,
        start,
    };
    let (resp, used) = forward(&fleet, &upstream, fwd, &targets).await;
    if let (Some(i), Some(first)) = (used, decision.chosen()) {
        if let Some(t) = targets.get(i).filter(|_| i > 0) {
            // The request landed on a fallback: that worker now holds the prefix.
            let mut landed = decision.clone();
            landed.ranked = vec![t.replica.worker(t.rank)];
            let now = fleet.now();
            pool.policy.lock().apply(&landed, &prepared.hashes, now);
            tracing::debug!(chosen = %first, landed = %landed.ranked[0], "request fell back");
        }
    }
    resp
}

/// Replicas of `pool` for a request the policy does not rank: the least loaded first (by
/// in-flight requests), ties rotated so that they spread.
fn load_order(pool: &Pool) -> Vec<Target> {
    let ticket = pool.ticket() as usize;
    let all_down = pool.replicas.iter().all(|r| r.health() == Health::Down);
    let mut rs: Vec<_> = pool
        .replicas
        .iter()
        .filter(|r| all_down || r.health() != Health::Down)
        .collect();
    if !rs.is_empty() {
        let n = rs.len();
        rs.rotate_left(ticket % n);
    }
    rs.sort_by_key(|r| r.workers.iter().map(|w| w.load().in_flight).sum::<u32>());
    rs.into_iter()
        .map(|r| Target {
            replica: r.clone(),
            rank: ticket % r.dp_size().max(1),
            pin_rank: false,
            predicted_cached: 0,
        })
        .collect()
}

/// The `route` label of a passed-through path (a fixed set: paths are not labels).
fn route_label(path: &str) -> &'static str {
    match path {
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        "/v1/embeddings" => "embeddings",
        "/v1/responses" => "responses",
        "/v1/messages" => "messages",
        "/health" => "health",
        "/ping" => "ping",
        "/metrics" => "replica_metrics",
        "/load" => "load",
        "/version" => "version",
        "/kv_event_sources" => "kv_event_sources",
        "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" => "lora_adapter",
        _ => "other",
    }
}

#[derive(Deserialize)]
struct ModelOnly {
    #[serde(default)]
    model: Option<String>,
}

async fn passthrough(State(Data { fleet, upstream }): State<Data>, req: Request) -> Response {
    let start = Instant::now();
    let route = route_label(req.uri().path());
    let (parts, body) = match read_body(fleet.settings.max_body_bytes, req).await {
        Ok(x) => x,
        Err(e) => return reject(&fleet, route, e),
    };
    let model = if body.first() == Some(&b'{') {
        serde_json::from_slice::<ModelOnly>(&body)
            .ok()
            .and_then(|m| m.model)
    } else {
        None
    };
    let pool = match fleet.lookup(model.as_deref()) {
        Ok((p, _)) => p.clone(),
        Err(e) => return reject(&fleet, route, e),
    };
    let targets = load_order(&pool);
    let fwd = Forward {
        route,
        pool: None,
        prompt_tokens: 0,
        method: parts.method.clone(),
        path_and_query: path_and_query(&parts),
        headers: parts.headers,
        body,
        start,
    };
    forward(&fleet, &upstream, fwd, &targets).await.0
}

/// `GET /v1/models`: the models every pool serves, with the replicas' own descriptions where
/// one answers, and a minimal entry otherwise.
async fn models(State(Data { fleet, upstream }): State<Data>) -> Response {
    let timeout = fleet
        .settings
        .timeouts
        .connect()
        .saturating_add(Duration::from_secs(3));
    let mut tasks = tokio::task::JoinSet::new();
    for pool in &fleet.pools {
        for r in pool.replicas.iter().filter(|r| r.health() != Health::Down) {
            let (u, r) = (upstream.clone(), r.clone());
            tasks.spawn(async move { u.get(&r, "/v1/models", timeout, 4 << 20).await });
        }
    }
    let mut described: BTreeMap<String, Value> = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        let Ok(Ok((status, body))) = done else {
            continue;
        };
        if !status.is_success() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(&body) else {
            continue;
        };
        for m in v
            .get("data")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(id) = m.get("id").and_then(Value::as_str) {
                described.entry(id.to_owned()).or_insert_with(|| m.clone());
            }
        }
    }
    let mut data = Vec::new();
    for pool in &fleet.pools {
        for model in &pool.models {
            data.push(described.remove(model).unwrap_or_else(|| {
                json!({"id": model, "object": "model", "created": 0, "owned_by": "kinference",
                       "root": model, "parent": null})
            }));
        }
    }
    fleet
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            route: "models",
            replica: String::new(),
            status: 200,
        })
        .inc();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}
