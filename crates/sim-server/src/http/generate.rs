//! One generation request from submission to its last chunk: `n` engine requests sharing the
//! prompt, their outputs merged per choice, stop strings applied, logprobs attached, and the
//! OpenAI response (JSON or SSE) built from them.
//!
//! vLLM fans `n > 1` out the same way (`ParentRequest`: child `i` is request `{i}_{id}`, all
//! added at once), so the first child to be scheduled caches the prompt's blocks and the
//! others hit them. Stop strings are matched on the rendered text by the driver (which
//! finishes the engine request at that token) and again here to truncate the text, with the
//! same function, as vLLM's frontend matches them after detokenizing. Dropping a
//! [`Generation`] drops its output receivers, which aborts whatever still runs.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::stream::{SelectAll, Stream, StreamExt};
use kinference_sim::{Request, RequestOutput, SimTime};
use kinference_vllm::{Lora, RequestExtras};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use super::params::Params;
use super::{json_response, unix_secs, Api, Shared};
use crate::driver::Command;
use crate::error::ApiError;
use crate::text::{self, StopStrings, TokenLogprob};

type Outputs = Pin<Box<dyn Stream<Item = (usize, RequestOutput)> + Send>>;

/// Counts a request's engine requests as outstanding on its rank until dropped.
struct Load {
    state: Shared,
    rank: usize,
    n: usize,
}

impl Drop for Load {
    fn drop(&mut self) {
        if let Some(r) = self.state.ranks.get(self.rank) {
            r.outstanding.fetch_sub(self.n, Ordering::Relaxed);
        }
    }
}

/// How a choice ended: vLLM's `finish_reason` and, for stop strings, `stop_reason`.
#[derive(Clone, Debug, PartialEq)]
struct Finish {
    reason: &'static str,
    stop_reason: Option<String>,
}

/// One choice's progress.
#[derive(Debug)]
struct Choice {
    engine_id: Arc<str>,
    text: String,
    /// Bytes of `text` already streamed.
    sent: usize,
    tokens: usize,
    logprobs: Vec<TokenLogprob>,
    /// Entries of `logprobs` already streamed.
    sent_logprobs: usize,
    finish: Option<Finish>,
    cached_tokens: Option<usize>,
    /// When the engine finished it (its last step's end).
    finished_at: Option<SimTime>,
}

/// A submitted request: its choices and the merged stream of their outputs.
pub(super) struct Generation {
    api: Api,
    id: String,
    created: u64,
    params: Params,
    prompt_len: usize,
    choices: Vec<Choice>,
    outputs: SelectAll<Outputs>,
    /// Bytes a stream holds back so a stop string split across tokens never leaks out.
    holdback: usize,
    _load: Load,
}

fn output_stream(index: usize, rx: mpsc::UnboundedReceiver<RequestOutput>) -> Outputs {
    Box::pin(futures::stream::unfold(rx, move |mut rx| async move {
        rx.recv().await.map(|o| ((index, o), rx))
    }))
}

fn too_long(state: &super::AppState, prompt_len: usize) -> ApiError {
    ApiError::BadRequest(format!(
        "This model's maximum context length is {} tokens. However, your request has \
         {prompt_len} input tokens. Please reduce the length of the input messages.",
        state.max_model_len
    ))
}

/// Validates lengths, then queues `params.n` engine requests for `prompt` on `rank`.
pub(super) async fn submit(
    state: Shared,
    api: Api,
    prompt: Vec<u32>,
    params: Params,
    rank: usize,
    request_id: Option<&str>,
) -> Result<Generation, ApiError> {
    let prompt_len = prompt.len();
    if prompt_len >= state.max_model_len {
        return Err(too_long(&state, prompt_len));
    }
    let room = (state.max_model_len - prompt_len) as u64;
    let max_tokens = params.max_tokens.unwrap_or(room);
    if max_tokens > room {
        return Err(ApiError::BadRequest(format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's \
             maximum context length is {} tokens and your request has {prompt_len} input \
             tokens ({max_tokens} > {} - {prompt_len}).",
            state.max_model_len, state.max_model_len
        )));
    }
    // vLLM: the X-Request-Id header, else `random_uuid()` (16 random hex digits).
    let base = match request_id {
        Some(r) => r.to_owned(),
        None => {
            let n = state.next_id.fetch_add(1, Ordering::Relaxed);
            format!(
                "{:016x}",
                std::hash::BuildHasher::hash_one(&state.id_key, n)
            )
        }
    };
    let id = match api {
        Api::Completion => format!("cmpl-{base}"),
        Api::Chat => format!("chatcmpl-{base}"),
    };
    let extras = RequestExtras {
        lora: params.lora.as_ref().map(|l| Lora {
            name: l.name.clone(),
            path: l.path.clone(),
        }),
        cache_salt: params.cache_salt.clone(),
        ..RequestExtras::default()
    };
    let rank_state = state
        .ranks
        .get(rank)
        .ok_or_else(|| ApiError::Internal(format!("no DP rank at {rank}")))?;
    rank_state
        .outstanding
        .fetch_add(params.n, Ordering::Relaxed);
    let load = Load {
        state: Arc::clone(&state),
        rank,
        n: params.n,
    };
    let mut choices = Vec::with_capacity(params.n);
    let mut outputs = SelectAll::new();
    for i in 0..params.n {
        let engine_id = if params.n == 1 {
            id.clone()
        } else {
            format!("{i}_{id}")
        };
        let mut request = Request::new(
            engine_id.clone(),
            prompt.clone(),
            u32::try_from(max_tokens).unwrap_or(u32::MAX),
        )
        .with_extras(extras.clone());
        if let Some(l) = &params.lora {
            request = request.with_lora_id(l.id);
        }
        let (out_tx, out_rx) = mpsc::unbounded_channel();
        let (reply, accepted) = oneshot::channel();
        let cmd = Command::Submit {
            request: Box::new(request),
            stop: StopStrings {
                strings: params.stop.clone(),
                include: params.include_stop_str_in_output,
            },
            outputs: out_tx,
            reply,
        };
        let gone = || ApiError::Internal("engine is not running".into());
        rank_state.driver.send(cmd).await.map_err(|_| gone())?;
        accepted
            .await
            .map_err(|_| gone())?
            .map_err(|e| ApiError::BadRequest(e.to_string()))?;
        outputs.push(output_stream(i, out_rx));
        choices.push(Choice {
            engine_id: Arc::from(engine_id),
            text: String::new(),
            sent: 0,
            tokens: 0,
            logprobs: Vec::new(),
            sent_logprobs: 0,
            finish: None,
            cached_tokens: None,
            finished_at: None,
        });
    }
    let holdback = if params.include_stop_str_in_output {
        0
    } else {
        params
            .stop
            .iter()
            .map(|s| s.len().saturating_sub(1))
            .max()
            .unwrap_or(0)
    };
    Ok(Generation {
        api,
        id,
        created: unix_secs(),
        params,
        prompt_len,
        choices,
        outputs,
        holdback,
        _load: load,
    })
}

impl Generation {
    fn done(&self) -> bool {
        self.choices
            .iter()
            .all(|c| c.finish.is_some() && c.cached_tokens.is_some())
    }

    /// Applies the next engine output; returns the choice it changed, or `None` once every
    /// choice has finished.
    async fn next(&mut self) -> Result<Option<usize>, ApiError> {
        loop {
            if self.done() {
                return Ok(None);
            }
            let Some((i, o)) = self.outputs.next().await else {
                if self.choices.iter().all(|c| c.finish.is_some()) {
                    return Ok(None);
                }
                return Err(ApiError::Internal(format!(
                    "request {} ended without finishing ({} prompt tokens)",
                    self.id, self.prompt_len
                )));
            };
            let Some(c) = self.choices.get_mut(i) else {
                continue;
            };
            if c.finish.is_some() {
                if let (Some(f), None) = (&o.finished, c.cached_tokens) {
                    c.cached_tokens = Some(f.usage.cached_tokens);
                    c.finished_at = Some(f.finished_at);
                }
                continue;
            }
            self.apply(i, o);
            return Ok(Some(i));
        }
    }

    fn apply(&mut self, i: usize, o: RequestOutput) {
        let Some(c) = self.choices.get_mut(i) else {
            return;
        };
        let w = text::word(o.token);
        c.text.push_str(&w);
        c.tokens += 1;
        if let Some(k) = self.params.logprobs {
            // Completions list the sampled token among its top entries even for `logprobs: 0`.
            let k = if self.api == Api::Completion {
                k.max(1)
            } else {
                k
            };
            c.logprobs
                .push(text::logprob(&c.engine_id, o.index, o.token, k));
        }
        if let Some(f) = &o.finished {
            c.finish = Some(Finish {
                reason: f.reason.as_str(),
                stop_reason: None,
            });
            c.cached_tokens = Some(f.usage.cached_tokens);
            c.finished_at = Some(f.finished_at);
        }
        // The driver saw the same token and finished the request if this matches.
        let stop = text::check_stop(
            &c.text,
            w.len(),
            &self.params.stop,
            self.params.include_stop_str_in_output,
        );
        if let Some((s, keep)) = stop {
            c.text.truncate(keep);
            c.finish = Some(Finish {
                reason: "stop",
                stop_reason: Some(s),
            });
        }
    }

    fn usage(&self) -> Value {
        let completion: usize = self.choices.iter().map(|c| c.tokens).sum();
        // vLLM reports the child whose finish completed the request: the last to finish, the
        // later in scheduling (= index) order within one step.
        let cached = self
            .choices
            .iter()
            .enumerate()
            .max_by_key(|(i, c)| (c.finished_at, *i))
            .and_then(|(_, c)| c.cached_tokens)
            .unwrap_or(0);
        json!({
            "prompt_tokens": self.prompt_len,
            "total_tokens": self.prompt_len + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Completion, _) => "text_completion",
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
        }
    }

    /// Waits for every choice to finish and builds the JSON response.
    pub(super) async fn collect(mut self) -> Result<Value, ApiError> {
        while self.next().await?.is_some() {}
        let choices: Vec<Value> = (0..self.choices.len())
            .map(|i| self.full_choice(i))
            .collect();
        Ok(json!({
            "id": self.id, "object": self.object(false), "created": self.created,
            "model": self.params.model, "choices": choices, "service_tier": null,
            "system_fingerprint": null, "usage": self.usage(), "kv_transfer_params": null,
        }))
    }

    fn full_choice(&self, i: usize) -> Value {
        let Some(c) = self.choices.get(i) else {
            return Value::Null;
        };
        let (reason, stop_reason) = finish_json(c.finish.as_ref());
        let logprobs = self.logprobs_json(&c.logprobs, 0);
        match self.api {
            Api::Completion => json!({
                "index": i, "text": c.text, "logprobs": logprobs,
                "finish_reason": reason, "stop_reason": stop_reason, "prompt_logprobs": null,
            }),
            Api::Chat => json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text, "refusal": null,
                            "tool_calls": [], "reasoning": null},
                "logprobs": logprobs, "finish_reason": reason, "stop_reason": stop_reason,
            }),
        }
    }

    /// OpenAI's logprobs object for `entries`; `offset` is the text offset of the first one.
    fn logprobs_json(&self, entries: &[TokenLogprob], offset: usize) -> Value {
        if self.params.logprobs.is_none() {
            return Value::Null;
        }
        match self.api {
            Api::Completion => {
                let mut at = offset;
                let mut text_offset = Vec::with_capacity(entries.len());
                for e in entries {
                    text_offset.push(at);
                    at += e.token.len();
                }
                let top: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let m: serde_json::Map<String, Value> =
                            e.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "text_offset": text_offset,
                    "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                    "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
                    "top_logprobs": top,
                })
            }
            Api::Chat => {
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let top: Vec<Value> = e
                            .top
                            .iter()
                            .map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()}))
                            .collect();
                        json!({"token": e.token, "logprob": e.logprob,
                               "bytes": e.token.as_bytes(), "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content})
            }
        }
    }

    fn chunk(&self, i: usize, delta: Value, logprobs: Value, finish: Option<&Finish>) -> Value {
        let (reason, stop_reason) = finish_json(finish);
        let choice = match self.api {
            Api::Completion => json!({"index": i, "text": delta, "logprobs": logprobs,
                                      "finish_reason": reason, "stop_reason": stop_reason}),
            Api::Chat => json!({"index": i, "delta": delta, "logprobs": logprobs,
                                "finish_reason": reason, "stop_reason": stop_reason}),
        };
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.params.model, "choices": [choice],
        })
    }

    /// The chunk for what choice `i` gained since the last one; `None` when there is nothing
    /// to send yet (text held back for a possible stop string).
    fn delta_chunk(&mut self, i: usize) -> Option<Value> {
        let holdback = self.holdback;
        let c = self.choices.get(i)?;
        let upto = if c.finish.is_some() {
            c.text.len()
        } else {
            text::floor_boundary(&c.text, c.text.len().saturating_sub(holdback))
        };
        let from = c.sent.min(upto);
        let delta = c.text.get(from..upto).unwrap_or("").to_owned();
        if delta.is_empty() && c.finish.is_none() {
            return None;
        }
        let offset: usize = c
            .logprobs
            .iter()
            .take(c.sent_logprobs)
            .map(|e| e.token.len())
            .sum();
        let logprobs = self.logprobs_json(c.logprobs.get(c.sent_logprobs..).unwrap_or(&[]), offset);
        let delta = match self.api {
            Api::Completion => json!(delta),
            Api::Chat => json!({"content": delta}),
        };
        let chunk = self.chunk(i, delta, logprobs, c.finish.as_ref());
        let c = self.choices.get_mut(i)?;
        c.sent = upto;
        c.sent_logprobs = c.logprobs.len();
        Some(chunk)
    }

    fn usage_chunk(&self) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created,
            "model": self.params.model, "choices": [], "usage": self.usage(),
        })
    }
}

fn finish_json(f: Option<&Finish>) -> (Value, Value) {
    match f {
        Some(f) => (json!(f.reason), json!(f.stop_reason)),
        None => (Value::Null, Value::Null),
    }
}

/// One SSE event: `data: {json}\n\n`.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

/// The SSE body: chat opens each choice with the assistant role, then a chunk per token per
/// choice, an optional usage chunk, and `data: [DONE]`. Dropping the body drops the
/// [`Generation`], which aborts the request.
pub(super) fn stream_response(g: Generation) -> Response {
    let first: Vec<Bytes> = match g.api {
        Api::Chat => (0..g.choices.len())
            .map(|i| {
                let delta = json!({"role": "assistant", "content": ""});
                sse(&g.chunk(i, delta, Value::Null, None))
            })
            .collect(),
        Api::Completion => Vec::new(),
    };
    let body = futures::stream::unfold(Some(g), |g| async move {
        let mut g = g?;
        loop {
            match g.next().await {
                Ok(Some(i)) => {
                    if let Some(c) = g.delta_chunk(i) {
                        return Some((vec![sse(&c)], Some(g)));
                    }
                }
                Ok(None) => {
                    let mut out = Vec::new();
                    if g.params.include_usage {
                        out.push(sse(&g.usage_chunk()));
                    }
                    out.push(Bytes::from_static(DONE));
                    return Some((out, None));
                }
                Err(e) => {
                    // vLLM reports a failure inside an open stream as an error event.
                    let err = json!({"error": {"message": e.to_string(),
                                               "type": "InternalServerError", "code": 500}});
                    return Some((vec![sse(&err), Bytes::from_static(DONE)], None));
                }
            }
        }
    });
    let body = futures::stream::iter([first])
        .chain(body)
        .flat_map(|v| futures::stream::iter(v.into_iter().map(Ok::<_, std::convert::Infallible>)));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")],
        Body::from_stream(body),
    )
        .into_response()
}

/// The JSON response of a non-streaming request.
pub(super) async fn json_body(g: Generation) -> Response {
    match g.collect().await {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => e.into_response(),
    }
}
