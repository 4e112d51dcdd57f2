//! The request fields the simulator acts on, parsed and validated as vLLM validates them
//! (`vllm/entrypoints/openai/protocol.py`, `vllm/sampling_params.py`): the model or LoRA
//! adapter, `max_tokens`, `n`, `stream`, `stop`, `logprobs` and `cache_salt`.
//!
//! Invariant: a [`Params`] is internally consistent (n ≥ 1, top-k logprobs ≤ the server's
//! maximum, a present `cache_salt` is non-empty); every rejection is a 400 with vLLM's
//! message, an unknown model a 404.

use serde_json::{Map, Value};

use super::{Api, AppState, LoraAdapter};
use crate::error::ApiError;

/// vLLM's default `--max-logprobs`.
pub const MAX_LOGPROBS: usize = 20;

/// What one generation request asks for, beyond its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct Params {
    /// The model name responses echo (the base model or the adapter).
    pub model: String,
    pub lora: Option<LoraAdapter>,
    pub max_tokens: Option<u64>,
    /// Choices to generate (each its own engine request sharing the prompt's blocks).
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    /// Top alternatives per token when logprobs are on (`Some(0)`: the token's own only).
    pub logprobs: Option<usize>,
    pub cache_salt: Option<String>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::BadRequest(msg.into())
}

/// Parses the body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| bad(format!("invalid JSON body: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(bad("request body must be a JSON object")),
    }
}

/// The served name a request addresses: the base model, a LoRA adapter, or absent (the base
/// model, as vLLM accepts).
pub fn resolve_model(
    state: &AppState,
    obj: &Map<String, Value>,
) -> Result<(String, Option<LoraAdapter>), ApiError> {
    match obj.get("model") {
        None | Some(Value::Null) => Ok((state.model.clone(), None)),
        Some(Value::String(m)) if *m == state.model => Ok((m.clone(), None)),
        Some(Value::String(m)) => match state.loras.iter().find(|l| l.name == *m) {
            Some(l) => Ok((m.clone(), Some(l.clone()))),
            None => Err(ApiError::ModelNotFound(m.clone())),
        },
        Some(_) => Err(bad("`model` must be a string")),
    }
}

fn opt_u64(obj: &Map<String, Value>, key: &str) -> Result<Option<u64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(format!("`{key}` must be a non-negative integer"))),
    }
}

fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{key}` must be a boolean"))),
    }
}

fn stop_strings(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    match obj.get("stop") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|s| s.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("`stop` must be a string or a list of strings")),
        Some(_) => Err(bad("`stop` must be a string or a list of strings")),
    }
}

fn logprobs(api: Api, obj: &Map<String, Value>) -> Result<Option<usize>, ApiError> {
    let k = match api {
        Api::Completion => opt_u64(obj, "logprobs")?,
        Api::Chat => {
            let on = opt_bool(obj, "logprobs")?;
            let top = opt_u64(obj, "top_logprobs")?;
            match (on, top) {
                (false, Some(t)) if t > 0 => {
                    return Err(bad(
                        "when using `top_logprobs`, `logprobs` must be set to true.",
                    ))
                }
                (false, _) => None,
                (true, t) => Some(t.unwrap_or(0)),
            }
        }
    };
    match k {
        Some(k) if k > MAX_LOGPROBS as u64 => Err(bad(format!(
            "Requested sample logprobs of {k}, which is greater than max allowed: {MAX_LOGPROBS}"
        ))),
        Some(k) => Ok(Some(k as usize)),
        None => Ok(None),
    }
}

/// Parses and validates everything but the prompt.
pub fn parse(state: &AppState, api: Api, obj: &Map<String, Value>) -> Result<Params, ApiError> {
    let (model, lora) = resolve_model(state, obj)?;
    let max_tokens = match api {
        Api::Chat => match opt_u64(obj, "max_completion_tokens")? {
            Some(m) => Some(m),
            None => opt_u64(obj, "max_tokens")?,
        },
        Api::Completion => opt_u64(obj, "max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(bad("max_tokens must be at least 1, got 0."));
    }
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(v) => match v.as_i64() {
            Some(n) if n >= 1 => usize::try_from(n).map_err(|_| bad("`n` is too large"))?,
            Some(n) => return Err(bad(format!("n must be at least 1, got {n}."))),
            None => return Err(bad("`n` must be an integer")),
        },
    };
    let stream = opt_bool(obj, "stream")?;
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(_) if !stream => {
            return Err(bad(
                "Stream options can only be defined when `stream=True`.",
            ))
        }
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?,
        Some(_) => return Err(bad("`stream_options` must be an object")),
    };
    let cache_salt = match obj.get("cache_salt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(bad(
                "Parameter 'cache_salt' must be a non-empty string if provided.",
            ))
        }
    };
    Ok(Params {
        model,
        lora,
        max_tokens,
        n,
        stream,
        include_usage,
        stop: stop_strings(obj)?,
        include_stop_str_in_output: opt_bool(obj, "include_stop_str_in_output")?,
        logprobs: logprobs(api, obj)?,
        cache_salt,
    })
}
