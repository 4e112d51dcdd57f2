//! The OpenAI-compatible HTTP surface of a vLLM replica, answered by the simulated engine.
//!
//! Prompts are tokenized exactly as vLLM tokenizes them (so block hashes match a real
//! replica); generated tokens are the engine's pseudo-tokens rendered as words from a fixed
//! list (the text carries no meaning, only the right token count). Handlers hold the output
//! receiver for as long as the client waits: dropping it (disconnect) aborts the request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kinference_sim::{EngineMetrics, Request, RequestOutput, Usage};
use kinference_tokenize::{ChatRequest, CompletionRequest, Tokenizer};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::driver::Command;
use crate::error::ApiError;
use crate::prom::{self, CacheInfo};
use crate::publisher::PublisherEndpoints;

/// Shared state of the handlers.
#[derive(Debug)]
pub struct AppState {
    pub model: String,
    pub tokenizer: Tokenizer,
    pub driver: mpsc::Sender<Command>,
    pub max_model_len: usize,
    pub data_parallel_rank: i64,
    pub cache: CacheInfo,
    /// The `--kv-events-config` as published by `/kv_event_sources`, if events are on.
    pub kv_events: Option<(crate::publisher::KvEventsConfig, PublisherEndpoints)>,
    pub next_id: AtomicU64,
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
        .with_state(state)
}

/// Filler vocabulary for generated text: token `t` renders as `WORDS[t % len]`.
const WORDS: &[&str] = &[
    "the", "cache", "block", "token", "hash", "router", "prefix", "server", "request", "model",
    "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "by", "this",
    "key", "value", "parent", "batch", "event", "step", "queue", "time",
];

fn word(token: u32) -> String {
    let w = WORDS
        .get(token as usize % WORDS.len())
        .copied()
        .unwrap_or("the");
    format!(" {w}")
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn unix_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The parts of an OpenAI request body the simulator acts on.
#[derive(Debug)]
struct Common {
    max_tokens: Option<u64>,
    stream: bool,
    include_usage: bool,
}

fn parse_body(state: &AppState, body: &[u8]) -> Result<(Value, Common), ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid JSON body: {e}")))?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::BadRequest(
            "request body must be a JSON object".into(),
        ));
    };
    if let Some(m) = obj.get("model") {
        match m.as_str() {
            Some(m) if m == state.model => {}
            Some(m) => return Err(ApiError::ModelNotFound(m.to_owned())),
            None if m.is_null() => {}
            None => return Err(ApiError::BadRequest("`model` must be a string".into())),
        }
    }
    let max_tokens =
        match obj
            .get("max_tokens")
            .or_else(|| obj.get("max_completion_tokens"))
        {
            None | Some(Value::Null) => None,
            Some(x) => Some(x.as_u64().filter(|n| *n > 0).ok_or_else(|| {
                ApiError::BadRequest("max_tokens must be a positive integer".into())
            })?),
        };
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = obj
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok((
        v,
        Common {
            max_tokens,
            stream,
            include_usage,
        },
    ))
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
enum Api {
    Completion,
    Chat,
}

/// A submitted request: its id, prompt length, and the stream of its outputs.
struct Running {
    id: String,
    created: u64,
    prompt_len: usize,
    outputs: mpsc::UnboundedReceiver<RequestOutput>,
}

async fn submit(
    state: &AppState,
    api: Api,
    prompt: Vec<u32>,
    max_tokens: Option<u64>,
) -> Result<Running, ApiError> {
    let n = state.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match api {
        Api::Completion => format!("cmpl-{n:016x}"),
        Api::Chat => format!("chatcmpl-{n:016x}"),
    };
    let prompt_len = prompt.len();
    if prompt_len >= state.max_model_len {
        return Err(ApiError::BadRequest(format!(
            "This model's maximum context length is {} tokens. However, your request has {} input tokens.",
            state.max_model_len, prompt_len
        )));
    }
    let room = (state.max_model_len - prompt_len) as u64;
    let max_tokens = max_tokens.unwrap_or(room);
    if max_tokens > room {
        return Err(ApiError::BadRequest(format!(
            "max_tokens ({max_tokens}) is too large: the prompt has {prompt_len} tokens and the maximum context length is {}",
            state.max_model_len
        )));
    }
    let request = Request::new(
        id.clone(),
        prompt,
        u32::try_from(max_tokens).unwrap_or(u32::MAX),
    );
    let (out_tx, outputs) = mpsc::unbounded_channel();
    let (reply, accepted) = oneshot::channel();
    let cmd = Command::Submit {
        request,
        outputs: out_tx,
        reply,
    };
    let gone = || ApiError::Internal("engine is not running".into());
    state.driver.send(cmd).await.map_err(|_| gone())?;
    accepted
        .await
        .map_err(|_| gone())?
        .map_err(|e| ApiError::BadRequest(e.to_string()))?;
    Ok(Running {
        id,
        created: unix_secs(),
        prompt_len,
        outputs,
    })
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "completion_tokens": u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

async fn completions(State(state): State<Shared>, body: Bytes) -> Response {
    generate(state, Api::Completion, body).await
}

async fn chat_completions(State(state): State<Shared>, body: Bytes) -> Response {
    generate(state, Api::Chat, body).await
}

async fn generate(state: Shared, api: Api, body: Bytes) -> Response {
    let prepared = parse_body(&state, &body).and_then(|(_, common)| {
        let prompt = match api {
            Api::Completion => completion_prompt(&state, &body)?,
            Api::Chat => chat_prompt(&state, &body)?,
        };
        Ok((prompt, common))
    });
    let (prompt, common) = match prepared {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let run = match submit(&state, api, prompt, common.max_tokens).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    if common.stream {
        stream_response(state, api, run, common.include_usage)
    } else {
        match collect(&state, api, run).await {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(e) => e.into_response(),
        }
    }
}

async fn collect(state: &AppState, api: Api, mut run: Running) -> Result<Value, ApiError> {
    let mut text = String::new();
    while let Some(o) = run.outputs.recv().await {
        text.push_str(&word(o.token));
        let Some(fin) = o.finished else { continue };
        let choice = match api {
            Api::Completion => json!({
                "index": 0, "text": text, "logprobs": null,
                "finish_reason": fin.reason.as_str(), "stop_reason": null,
                "prompt_logprobs": null,
            }),
            Api::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text, "refusal": null,
                            "tool_calls": [], "reasoning": null},
                "logprobs": null, "finish_reason": fin.reason.as_str(), "stop_reason": null,
            }),
        };
        let object = match api {
            Api::Completion => "text_completion",
            Api::Chat => "chat.completion",
        };
        return Ok(json!({
            "id": run.id, "object": object, "created": run.created, "model": state.model,
            "choices": [choice], "service_tier": null, "system_fingerprint": null,
            "usage": usage_json(&fin.usage), "kv_transfer_params": null,
        }));
    }
    Err(ApiError::Internal(format!(
        "request {} ended without finishing ({} prompt tokens)",
        run.id, run.prompt_len
    )))
}

/// One SSE event: `data: {json}\n\n`.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn chunk(state: &AppState, api: Api, run: &Running, delta: Value, finish: Option<&str>) -> Value {
    match api {
        Api::Completion => json!({
            "id": run.id, "object": "text_completion", "created": run.created,
            "model": state.model,
            "choices": [{"index": 0, "text": delta, "logprobs": null,
                         "finish_reason": finish, "stop_reason": null}],
        }),
        Api::Chat => json!({
            "id": run.id, "object": "chat.completion.chunk", "created": run.created,
            "model": state.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null,
                         "finish_reason": finish, "stop_reason": null}],
        }),
    }
}

/// The SSE body: a chunk per token (chat opens with the assistant role), an optional usage
/// chunk, then `data: [DONE]`. Dropping the body drops the receiver, which aborts the request.
fn stream_response(state: Shared, api: Api, run: Running, include_usage: bool) -> Response {
    let first: Vec<Bytes> = match api {
        Api::Chat => vec![sse(&chunk(
            &state,
            api,
            &run,
            json!({"role": "assistant", "content": ""}),
            None,
        ))],
        Api::Completion => Vec::new(),
    };
    let init = (state, run, false);
    let tokens = futures::stream::unfold(init, move |(state, mut run, done)| async move {
        if done {
            return None;
        }
        let Some(o) = run.outputs.recv().await else {
            return Some((
                vec![Bytes::from_static(b"data: [DONE]\n\n")],
                (state, run, true),
            ));
        };
        let text = word(o.token);
        let delta = match api {
            Api::Completion => json!(text),
            Api::Chat => json!({"content": text}),
        };
        let finish = o.finished.as_ref().map(|f| f.reason.as_str());
        let mut out = vec![sse(&chunk(&state, api, &run, delta, finish))];
        let Some(fin) = o.finished else {
            return Some((out, (state, run, false)));
        };
        if include_usage {
            let mut u = chunk(&state, api, &run, Value::Null, None);
            u["choices"] = json!([]);
            u["usage"] = usage_json(&fin.usage);
            out.push(sse(&u));
        }
        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
        Some((out, (state, run, true)))
    });
    use futures::StreamExt;
    let body = futures::stream::iter([first])
        .chain(tokens)
        .flat_map(|v| futures::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        Body::from_stream(body),
    )
        .into_response()
}

async fn models(State(state): State<Shared>) -> Response {
    json_response(
        StatusCode::OK,
        &json!({
            "object": "list",
            "data": [{
                "id": state.model, "object": "model", "created": unix_secs(),
                "owned_by": "vllm", "root": state.model, "parent": null,
                "max_model_len": state.max_model_len, "permission": [],
            }],
        }),
    )
}

async fn tokenize(State(state): State<Shared>, body: Bytes) -> Response {
    let tokens = parse_body(&state, &body).and_then(|(v, _)| {
        if v.get("messages").is_some() {
            chat_prompt(&state, &body)
        } else if v.get("prompt").is_some() {
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

/// A snapshot of the engine's metrics from the driver task.
pub async fn engine_metrics(state: &AppState) -> Option<EngineMetrics> {
    let (tx, rx) = oneshot::channel();
    state.driver.send(Command::Metrics(tx)).await.ok()?;
    rx.await.ok()
}

async fn metrics(State(state): State<Shared>) -> Response {
    let Some(m) = engine_metrics(&state).await else {
        return ApiError::Internal("engine is not running".into()).into_response();
    };
    let text = prom::render(&state.model, state.data_parallel_rank, &state.cache, &m);
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

async fn reset_prefix_cache(State(state): State<Shared>) -> Response {
    let (tx, rx) = oneshot::channel();
    if state
        .driver
        .send(Command::ResetPrefixCache(tx))
        .await
        .is_err()
    {
        return ApiError::Internal("engine is not running".into()).into_response();
    }
    match rx.await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => ApiError::BadRequest(e.to_string()).into_response(),
        Err(_) => ApiError::Internal("engine is not running".into()).into_response(),
    }
}

async fn kv_event_sources(State(state): State<Shared>) -> Response {
    let mut map = serde_json::Map::new();
    if let Some((cfg, eps)) = &state.kv_events {
        let endpoint = eps.events.clone().unwrap_or_else(|| cfg.endpoint.clone());
        map.insert(
            state.data_parallel_rank.to_string(),
            json!({
                "enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": endpoint, "replay_endpoint": eps.replay,
                "buffer_steps": cfg.buffer_steps, "hwm": 100_000,
                "max_queue_size": 100_000, "topic": cfg.topic,
            }),
        );
    }
    json_response(StatusCode::OK, &Value::Object(map))
}
