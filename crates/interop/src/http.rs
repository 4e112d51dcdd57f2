//! A small client for the vLLM endpoints the interop tests use: completions, chat, `/tokenize`,
//! `/reset_prefix_cache`, `/health` and the cache settings in `/metrics`.
//!
//! Every request is bounded by a timeout; a non-2xx answer is an error carrying the body, so a
//! failing test shows vLLM's own message.

use std::time::Duration;

use kinference_vllm::metrics::ReplicaMetrics;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::InteropError;

/// One chat turn, as the OpenAI API and vLLM's `/tokenize` take it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
        }
    }
}

/// A completions prompt: text (vLLM tokenizes it with BOS) or token ids (used as given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

/// The token accounting vLLM reports for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache (`--enable-prompt-tokens-details`).
    pub cached_tokens: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The generated text (completion text or the assistant message's content).
    pub text: String,
    pub usage: Usage,
}

/// The server's KV-cache settings from the `vllm:cache_config_info` metric.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerCacheConfig {
    pub block_size: u32,
    pub num_gpu_blocks: u32,
    pub hash_algo: String,
    pub prefix_caching: bool,
}

#[derive(Clone, Debug)]
pub struct VllmHttp {
    base: String,
    model: String,
    client: reqwest::Client,
}

/// Long enough for a prefill on two shared CPU cores, short enough to fail a hung test.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

impl VllmHttp {
    pub fn new(base: &str, model: &str) -> Result<Self, InteropError> {
        let client = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|source| InteropError::Http {
                what: "building a client for",
                url: base.to_owned(),
                source,
            })?;
        Ok(VllmHttp {
            base: base.trim_end_matches('/').to_owned(),
            model: model.to_owned(),
            client,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET /health` answered 200.
    pub async fn healthy(&self) -> Result<bool, InteropError> {
        let url = format!("{}/health", self.base);
        let resp = self
            .client
            .get(&url)
            .send()
            .await
            .map_err(|source| InteropError::Http {
                what: "GET",
                url: url.clone(),
                source,
            })?;
        Ok(resp.status().is_success())
    }

    /// Token ids vLLM computes for a completions prompt (BOS included).
    pub async fn tokenize_text(&self, prompt: &str) -> Result<Vec<u32>, InteropError> {
        let body = json!({"model": self.model, "prompt": prompt});
        self.tokenize(body).await
    }

    /// Token ids vLLM computes for a chat request (template applied, generation prompt added).
    pub async fn tokenize_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, InteropError> {
        let body =
            json!({"model": self.model, "messages": messages, "add_generation_prompt": true});
        self.tokenize(body).await
    }

    async fn tokenize(&self, body: Value) -> Result<Vec<u32>, InteropError> {
        let (url, v) = self.post("/tokenize", &body).await?;
        let tokens = v
            .get("tokens")
            .and_then(Value::as_array)
            .ok_or_else(|| bad(&url, "no tokens array"))?;
        let ids: Option<Vec<u32>> = tokens
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect();
        let ids = ids.ok_or_else(|| bad(&url, "a token id is not a u32"))?;
        let count = v.get("count").and_then(Value::as_u64);
        if count != Some(ids.len() as u64) {
            return Err(bad(
                &url,
                &format!("count {count:?} != {} tokens", ids.len()),
            ));
        }
        Ok(ids)
    }

    /// A greedy completion of `max_tokens` tokens.
    pub async fn complete(
        &self,
        prompt: &Prompt,
        max_tokens: u32,
    ) -> Result<Completion, InteropError> {
        let prompt = match prompt {
            Prompt::Text(t) => json!(t),
            Prompt::Ids(ids) => json!(ids),
        };
        let body = json!({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                          "temperature": 0.0});
        let (url, v) = self.post("/v1/completions", &body).await?;
        let text = v
            .pointer("/choices/0/text")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&url, "no choices[0].text"))?;
        Ok(Completion {
            text: text.to_owned(),
            usage: usage(&url, &v)?,
        })
    }

    /// A greedy chat completion of `max_tokens` tokens.
    pub async fn chat(
        &self,
        messages: &[ChatMessage],
        max_tokens: u32,
    ) -> Result<Completion, InteropError> {
        let body = json!({"model": self.model, "messages": messages, "max_tokens": max_tokens,
                          "temperature": 0.0});
        let (url, v) = self.post("/v1/chat/completions", &body).await?;
        let text = v
            .pointer("/choices/0/message/content")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&url, "no choices[0].message.content"))?;
        Ok(Completion {
            text: text.to_owned(),
            usage: usage(&url, &v)?,
        })
    }

    /// `POST /reset_prefix_cache` (needs `VLLM_SERVER_DEV_MODE=1` on the server).
    pub async fn reset_prefix_cache(&self) -> Result<(), InteropError> {
        let url = format!("{}/reset_prefix_cache", self.base);
        let resp = self
            .client
            .post(&url)
            .send()
            .await
            .map_err(|source| InteropError::Http {
                what: "POST",
                url: url.clone(),
                source,
            })?;
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(InteropError::Status {
                url,
                status: status.as_u16(),
                body,
            });
        }
        // vLLM answers 200 with {"success": false} when requests are still running.
        if body.contains("false") {
            return Err(bad(&url, &format!("reset refused: {body}")));
        }
        Ok(())
    }

    /// The cache settings vLLM reports in `/metrics`.
    pub async fn cache_config(&self) -> Result<ServerCacheConfig, InteropError> {
        let url = format!("{}/metrics", self.base);
        let text = self.get_text(&url).await?;
        parse_cache_config(&text).ok_or_else(|| bad(&url, "no usable vllm:cache_config_info line"))
    }

    async fn get_text(&self, url: &str) -> Result<String, InteropError> {
        body_text("GET", url, self.client.get(url)).await
    }

    async fn post(&self, path: &str, body: &Value) -> Result<(String, Value), InteropError> {
        let url = format!("{}{path}", self.base);
        let text = body_text("POST", &url, self.client.post(&url).json(body)).await?;
        let value =
            serde_json::from_str(&text).map_err(|e| bad(&url, &format!("not JSON: {e}")))?;
        Ok((url, value))
    }
}

/// Sends `request` and returns its body, or the error a caller can act on: a transport
/// failure, or a non-2xx status with the body vLLM sent.
async fn body_text(
    what: &'static str,
    url: &str,
    request: reqwest::RequestBuilder,
) -> Result<String, InteropError> {
    let resp = request.send().await.map_err(|source| InteropError::Http {
        what,
        url: url.to_owned(),
        source,
    })?;
    let status = resp.status();
    let body = resp.text().await.map_err(|source| InteropError::Http {
        what: "reading",
        url: url.to_owned(),
        source,
    })?;
    if !status.is_success() {
        return Err(InteropError::Status {
            url: url.to_owned(),
            status: status.as_u16(),
            body,
        });
    }
    Ok(body)
}

fn bad(url: &str, reason: &str) -> InteropError {
    InteropError::Response {
        url: url.to_owned(),
        reason: reason.to_owned(),
    }
}

fn usage(url: &str, v: &Value) -> Result<Usage, InteropError> {
    let prompt_tokens = v
        .pointer("/usage/prompt_tokens")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| bad(url, "no usage.prompt_tokens"))?;
    let cached_tokens = v
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            bad(
                url,
                "no usage.prompt_tokens_details.cached_tokens (server needs --enable-prompt-tokens-details)",
            )
        })?;
    Ok(Usage {
        prompt_tokens,
        cached_tokens,
    })
}

/// Reads `vllm:cache_config_info{...}` from a Prometheus text page (the first such sample;
/// `None` unless it names all four settings).
pub fn parse_cache_config(metrics: &str) -> Option<ServerCacheConfig> {
    let info = ReplicaMetrics::from_exposition(metrics).cache_config?;
    Some(ServerCacheConfig {
        block_size: info.block_size?.try_into().ok()?,
        num_gpu_blocks: info.num_gpu_blocks?.try_into().ok()?,
        hash_algo: info.prefix_caching_hash_algo?,
        prefix_caching: info.enable_prefix_caching?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_cache_config_info() {
        let page = "# HELP x\nvllm:cache_config_info{_block_size_resolved=\"True\",block_size=\"32\",\
cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",kv_cache_dtype_skip_layers=\"[]\",\
num_gpu_blocks=\"80\",num_gpu_blocks_override=\"80\",prefix_caching_hash_algo=\"sha256_cbor\"} 1.0\n";
        let cfg = parse_cache_config(page).unwrap();
        assert_eq!(
            cfg,
            ServerCacheConfig {
                block_size: 32,
                num_gpu_blocks: 80,
                hash_algo: "sha256_cbor".into(),
                prefix_caching: true,
            }
        );
        assert_eq!(parse_cache_config("vllm:other{block_size=\"32\"} 1"), None);
    }
}
