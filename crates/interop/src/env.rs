//! Which real vLLM server the interop tests talk to, read from the environment.
//!
//! Invariant: the tests run only when [`URL_VAR`] is set; then every other variable is required,
//! so a half-configured environment fails loudly instead of skipping.

use std::path::PathBuf;

use crate::error::InteropError;

/// Base URL of the OpenAI-compatible server, e.g. `http://127.0.0.1:18000`.
pub const URL_VAR: &str = "KINFERENCE_REAL_VLLM_URL";
/// The endpoint vLLM's PUB socket connects to; the test's subscriber binds it.
pub const EVENTS_VAR: &str = "KINFERENCE_REAL_VLLM_EVENTS";
/// vLLM's replay ROUTER endpoint.
pub const REPLAY_VAR: &str = "KINFERENCE_REAL_VLLM_REPLAY";
/// The server's `--prefix-caching-hash-algo` (`sha256`, `sha256_cbor`, ...).
pub const HASH_ALGO_VAR: &str = "KINFERENCE_REAL_VLLM_HASH_ALGO";

/// The real server's model directory (its `tokenizer.json`), when not in the default place.
pub const MODEL_DIR_VAR: &str = "KINFERENCE_REAL_VLLM_MODEL_DIR";
/// Where `scripts/real-vllm.sh` installs vLLM and the tiny model (default
/// `~/.cache/kinference/real-vllm`).
pub const CACHE_VAR: &str = "KINFERENCE_VLLM_CACHE";

/// What a test prints when it does not run.
pub const SKIP_MESSAGE: &str =
    "skipped: set KINFERENCE_REAL_VLLM_URL (scripts/interop.sh does) to run against a real vLLM";

/// The served model name `scripts/real-vllm.sh` gives the tiny model.
pub const MODEL: &str = "tiny";
/// The topic `scripts/real-vllm.sh` configures for KV events.
pub const TOPIC: &str = "kv-events";

/// The directory of the model the real servers serve (tokenizer files included):
/// [`MODEL_DIR_VAR`], else `models/tiny-llama` under [`CACHE_VAR`]'s directory.
pub fn model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os(MODEL_DIR_VAR) {
        return PathBuf::from(d);
    }
    let cache = std::env::var_os(CACHE_VAR).map_or_else(
        || {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/kinference/real-vllm")
        },
        PathBuf::from,
    );
    cache.join("models/tiny-llama")
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RealVllmEnv {
    pub url: String,
    pub events: String,
    pub replay: String,
    pub hash_algo: String,
}

impl RealVllmEnv {
    /// `Ok(None)` when [`URL_VAR`] is unset or empty (the tests skip); an error when it is set
    /// but a companion variable is missing.
    pub fn from_env() -> Result<Option<Self>, InteropError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Like [`RealVllmEnv::from_env`], reading variables through `get`.
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<Self>, InteropError> {
        let Some(url) = get(URL_VAR).filter(|v| !v.trim().is_empty()) else {
            return Ok(None);
        };
        let mut missing = Vec::new();
        let mut need = |name: &'static str| {
            let value = get(name).filter(|v| !v.trim().is_empty());
            if value.is_none() {
                missing.push(name);
            }
            value.unwrap_or_default()
        };
        let events = need(EVENTS_VAR);
        let replay = need(REPLAY_VAR);
        let hash_algo = need(HASH_ALGO_VAR);
        if !missing.is_empty() {
            return Err(InteropError::Env(format!(
                "{URL_VAR} is set but {} {} not",
                missing.join(", "),
                if missing.len() == 1 { "is" } else { "are" }
            )));
        }
        Ok(Some(RealVllmEnv {
            url: url.trim_end_matches('/').to_owned(),
            events,
            replay,
            hash_algo,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn unset_url_skips() {
        assert_eq!(RealVllmEnv::from_lookup(lookup(&[])).unwrap(), None);
        assert_eq!(
            RealVllmEnv::from_lookup(lookup(&[(URL_VAR, " ")])).unwrap(),
            None
        );
    }

    #[test]
    fn partial_configuration_is_an_error() {
        let err = RealVllmEnv::from_lookup(lookup(&[(URL_VAR, "http://h:1"), (EVENTS_VAR, "x")]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(REPLAY_VAR) && err.contains(HASH_ALGO_VAR),
            "{err}"
        );
        assert!(!err.contains(EVENTS_VAR), "{err}");
    }

    #[test]
    fn full_configuration_parses() {
        let env = RealVllmEnv::from_lookup(lookup(&[
            (URL_VAR, "http://h:1/"),
            (EVENTS_VAR, "tcp://127.0.0.1:2"),
            (REPLAY_VAR, "tcp://127.0.0.1:3"),
            (HASH_ALGO_VAR, "sha256_cbor"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(env.url, "http://h:1");
        assert_eq!(env.hash_algo, "sha256_cbor");
    }
}
