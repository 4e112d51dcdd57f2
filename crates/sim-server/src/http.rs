//! The OpenAI-compatible HTTP surface of a vLLM replica, answered by the simulated engines.
//!
//! Prompts are tokenized exactly as vLLM tokenizes them (so block hashes match a real
//! replica); generated tokens are the engine's pseudo-tokens rendered as words from a fixed
//! list (the text carries no meaning, only the right token count). Handlers hold the output
//! receivers for as long as the client waits: dropping them (disconnect) aborts the request.
//! With several DP ranks a request goes to the rank named by `X-data-parallel-rank` (vLLM's
//! header; a value that is not an integer is ignored, as vLLM ignores it), else to the rank
//! with the fewest outstanding engine requests (lowest rank on ties), which is what vLLM's
//! internal load balancer converges to for one API server.

mod generate;
pub mod params;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kinference_sim::EngineMetrics;
use kinference_tokenize::{ChatRequest, CompletionRequest, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::driver::Command;
use crate::error::ApiError;
use crate::prom::{self, CacheInfo, EngineSnapshot};
use crate::publisher::{KvEventsConfig, PublisherEndpoints};

/// vLLM's header for pinning a request to a DP rank.
pub const DP_RANK_HEADER: &str = "x-data-parallel-rank";

/// A served LoRA adapter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraAdapter {
    pub name: String,
    pub path: String,
    /// `parent` in `/v1/models`.
    pub parent: String,
    /// vLLM's `lora_int_id` (1, 2, ... in `--lora-modules` order), published as
    /// `BlockStored.lora_id`.
    pub id: i64,
}

/// One DP rank as the handlers see it.
#[derive(Debug)]
pub struct RankState {
    pub rank: i64,
    pub driver: mpsc::Sender<Command>,
    /// Engine requests submitted and not yet answered (the load balancer's measure).
    pub outstanding: AtomicUsize,
    /// The rank's `--kv-events-config` (ports offset) and bound endpoints, if events are on.
    pub kv_events: Option<(KvEventsConfig, PublisherEndpoints)>,
    /// Batches its publisher has published (numbered 0 .. this), if events are on.
    pub published: Option<watch::Receiver<u64>>,
}

/// Shared state of the handlers.
#[derive(Debug)]
pub struct AppState {
    pub model: String,
    pub loras: Vec<LoraAdapter>,
    /// Shared by every replica of the process that uses the same tokenizer directory.
    pub tokenizer: Arc<Tokenizer>,
    pub max_model_len: usize,
    pub cache: CacheInfo,
    /// At least one.
    pub ranks: Vec<RankState>,
    /// Counts requests; hashed under `id_key` into vLLM-like random request ids.
    pub next_id: AtomicU64,
    /// A random key per server, so ids differ across servers and restarts as vLLM's do.
    pub id_key: std::collections::hash_map::RandomState,
}

type Shared = Arc<AppState>;

/// The router with every endpoint.
pub fn router(state: Shared) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/kv_event_sources", get(kv_event_sources))
        .route("/debug/cache", get(debug_cache))
        .with_state(state)
}

pub(crate) fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

pub(crate) fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn completion_prompt(state: &AppState, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let req =
        CompletionRequest::from_json(body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let mut prompts = state
        .tokenizer
        .encode_completion_request(&req)
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    if prompts.len() != 1 {
        return Err(ApiError::BadRequest(
            "exactly one prompt per request is supported".into(),
        ));
    }
    Ok(prompts.pop().unwrap_or_default())
}

fn chat_prompt(state: &AppState, body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let req = ChatRequest::from_json(body).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    state
        .tokenizer
        .encode_chat(&req)
        .map_err(|e| ApiError::BadRequest(e.to_string()))
}

/// Which OpenAI API a request came through: it decides the response shapes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    Completion,
    Chat,
}

/// The rank position a request goes to: the header's rank, or the least loaded one.
fn pick_rank(state: &AppState, headers: &HeaderMap) -> Result<usize, ApiError> {
    let asked = headers
        .get(DP_RANK_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok());
    if let Some(r) = asked {
        return state.ranks.iter().position(|s| s.rank == r).ok_or_else(|| {
            let first = state.ranks.first().map_or(0, |s| s.rank);
            ApiError::BadRequest(format!(
                "Requested DP rank {r} is out of range [{first}, {})",
                first + state.ranks.len() as i64
            ))
        });
    }
    Ok(state
        .ranks
        .iter()
        .enumerate()
        .min_by_key(|(i, s)| (s.outstanding.load(Ordering::Relaxed), *i))
        .map_or(0, |(i, _)| i))
}

async fn completions(State(state): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    generate_response(state, Api::Completion, headers, body).await
}

async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate_response(state, Api::Chat, headers, body).await
}

async fn generate_response(state: Shared, api: Api, headers: HeaderMap, body: Bytes) -> Response {
    let prepared = params::parse_object(&body).and_then(|obj| {
        let p = params::parse(&state, api, &obj)?;
        let prompt = match api {
            Api::Completion => completion_prompt(&state, &body)?,
            Api::Chat => chat_prompt(&state, &body)?,
        };
        let rank = pick_rank(&state, &headers)?;
        Ok((p, prompt, rank))
    });
    let (p, prompt, rank) = match prepared {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok());
    let stream = p.stream;
    match generate::submit(Arc::clone(&state), api, prompt, p, rank, request_id).await {
        Ok(g) if stream => generate::stream_response(g),
        Ok(g) => generate::json_body(g).await,
        Err(e) => e.into_response(),
    }
}

async fn models(State(state): State<Shared>) -> Response {
    let created = unix_secs();
    let mut data = vec![json!({
        "id": state.model, "object": "model", "created": created,
        "owned_by": "vllm", "root": state.model, "parent": null,
        "max_model_len": state.max_model_len, "permission": [],
    })];
    // vLLM lists each adapter with its path as `root` and the base model as `parent`.
    data.extend(state.loras.iter().map(|l| {
        json!({
            "id": l.name, "object": "model", "created": created,
            "owned_by": "vllm", "root": l.path, "parent": l.parent,
            "max_model_len": null, "permission": [],
        })
    }));
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn tokenize(State(state): State<Shared>, body: Bytes) -> Response {
    let tokens = params::parse_object(&body).and_then(|obj| {
        params::resolve_model(&state, &obj)?;
        if obj.contains_key("messages") {
            chat_prompt(&state, &body)
        } else if obj.contains_key("prompt") {
            completion_prompt(&state, &body)
        } else {
            Err(ApiError::BadRequest(
                "either `prompt` or `messages` is required".into(),
            ))
        }
    });
    match tokens {
        Ok(t) => json_response(
            StatusCode::OK,
            &json!({"count": t.len(), "max_model_len": state.max_model_len,
                    "tokens": t, "token_strs": null}),
        ),
        Err(e) => e.into_response(),
    }
}

async fn health() -> StatusCode {
    StatusCode::OK
}

/// A snapshot of one rank's engine metrics from its driver task.
pub async fn engine_metrics(rank: &RankState) -> Option<EngineMetrics> {
    let (tx, rx) = oneshot::channel();
    rank.driver.send(Command::Metrics(tx)).await.ok()?;
    rx.await.ok()
}

async fn metrics(State(state): State<Shared>) -> Response {
    let mut engines = Vec::with_capacity(state.ranks.len());
    for r in &state.ranks {
        let Some(m) = engine_metrics(r).await else {
            return ApiError::Internal("engine is not running".into()).into_response();
        };
        engines.push(EngineSnapshot {
            rank: r.rank,
            metrics: m,
        });
    }
    let text = prom::render(&state.model, &state.cache, &engines);
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Resets every rank's prefix cache, as vLLM's endpoint resets every engine.
async fn reset_prefix_cache(State(state): State<Shared>) -> Response {
    for r in &state.ranks {
        let (tx, rx) = oneshot::channel();
        if r.driver.send(Command::ResetPrefixCache(tx)).await.is_err() {
            return ApiError::Internal("engine is not running".into()).into_response();
        }
        match rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return ApiError::BadRequest(e.to_string()).into_response(),
            Err(_) => return ApiError::Internal("engine is not running".into()).into_response(),
        }
    }
    StatusCode::OK.into_response()
}

async fn kv_event_sources(State(state): State<Shared>) -> Response {
    let mut map = serde_json::Map::new();
    for r in &state.ranks {
        let Some((cfg, eps)) = &r.kv_events else {
            continue;
        };
        let endpoint = eps.events.clone().unwrap_or_else(|| cfg.endpoint.clone());
        map.insert(
            r.rank.to_string(),
            json!({
                "enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": endpoint, "replay_endpoint": eps.replay,
                "buffer_steps": cfg.buffer_steps, "hwm": 100_000,
                "max_queue_size": cfg.max_queue_size, "topic": cfg.topic,
            }),
        );
    }
    json_response(StatusCode::OK, &Value::Object(map))
}

/// The simulator's own view of each rank's cache (no vLLM counterpart): `cached_blocks`, the
/// distinct block hashes its prefix cache holds (what a subscriber that applied every event
/// holds for the rank), and `published_batches`, the event batches published so far (the last
/// sequence number + 1; null without events). Harnesses compare a router's index with it.
async fn debug_cache(State(state): State<Shared>) -> Response {
    let mut ranks = Vec::with_capacity(state.ranks.len());
    for r in &state.ranks {
        let (tx, rx) = oneshot::channel();
        let look = Command::Inspect(Box::new(move |e: &kinference_sim::Engine| {
            let _ = tx.send(e.block_pool().num_cached_digests());
        }));
        if r.driver.send(look).await.is_err() {
            return ApiError::Internal("engine is not running".into()).into_response();
        }
        let Ok(cached) = rx.await else {
            return ApiError::Internal("engine is not running".into()).into_response();
        };
        let published = r.published.as_ref().map(|p| *p.borrow());
        ranks
            .push(json!({"rank": r.rank, "cached_blocks": cached, "published_batches": published}));
    }
    json_response(StatusCode::OK, &json!({ "ranks": ranks }))
}
