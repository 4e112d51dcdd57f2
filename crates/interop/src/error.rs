//! The one error type of the interop support code; every variant names what was being done.

use std::time::Duration;

use kinference_events::EventsError;
use kinference_vllm::HashError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum InteropError {
    #[error("environment: {0}")]
    Env(String),
    #[error("{what} {url}: {source}")]
    Http {
        what: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered HTTP {status}: {body}")]
    Status {
        url: String,
        status: u16,
        body: String,
    },
    #[error("unexpected response from {url}: {reason}")]
    Response { url: String, reason: String },
    #[error("replay from {endpoint}: {reason}")]
    Replay { endpoint: String, reason: String },
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout { after: Duration, what: String },
    #[error("event log: {0}")]
    Log(String),
    #[error("server configuration: {0}")]
    Server(String),
    #[error("event plane: {0}")]
    Events(#[from] EventsError),
    #[error("hasher: {0}")]
    Hash(#[from] HashError),
}
