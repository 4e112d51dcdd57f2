//! Errors: the ones a request can end with (answered in OpenAI's JSON shape) and the ones that
//! stop the router from starting.
//!
//! Every [`RequestError`] names its side (the client's request, a replica, or the router) and has
//! a stable metric label; none of them is a panic, and each becomes exactly one HTTP response.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use crate::api::{ErrorBody, ErrorDetail};
use crate::config::ConfigErrors;

/// Why a request was answered by the router itself instead of a replica.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is not JSON, or not the shape the endpoint needs.
    #[error("{0}")]
    BadRequest(String),
    /// The body is larger than `max_body_bytes`.
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: usize },
    /// No pool serves the requested model.
    #[error("The model `{0}` does not exist.")]
    UnknownModel(String),
    /// Every replica the request could go to refused it before anything was sent (503, with
    /// `Retry-After: retry_after_s`: a replica may be back soon).
    #[error("no usable replica for pool `{pool}`: {detail}")]
    NoReplica {
        pool: String,
        detail: String,
        retry_after_s: u32,
    },
    /// A replica failed after the request was sent to it (not retried: it may have run).
    #[error("replica {replica} failed: {detail}")]
    Upstream { replica: String, detail: String },
    /// A replica sent no response head within the first-byte timeout.
    #[error("replica {replica} did not answer within {timeout_ms} ms")]
    Timeout { replica: String, timeout_ms: u64 },
    /// The client's body could not be read.
    #[error("reading the request body failed: {0}")]
    ClientBody(String),
    /// The client's body arrived too slowly (`timeouts.body_read_ms`,
    /// `limits.min_body_rate_bytes_per_s`).
    #[error("the request body arrived too slowly (received {received} bytes in {elapsed_ms} ms)")]
    BodyTimeout { received: usize, elapsed_ms: u64 },
    /// The pool's admission gate and its queue were full, or the request waited too long in
    /// the queue; `no_replica` when the pool had no usable replica either (503, not 429).
    #[error("pool `{pool}` is overloaded ({reason}); retry after {retry_after_s} s")]
    Overloaded {
        pool: String,
        reason: &'static str,
        no_replica: bool,
        retry_after_s: u32,
    },
    /// A method the path does not take (405, with `Allow`).
    #[error("{method} is not allowed here; this path takes {allow}")]
    MethodNotAllowed {
        method: http::Method,
        allow: &'static str,
    },
}

impl RequestError {
    pub fn status(&self) -> StatusCode {
        match self {
            RequestError::BadRequest(_) | RequestError::ClientBody(_) => StatusCode::BAD_REQUEST,
            RequestError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            RequestError::UnknownModel(_) => StatusCode::NOT_FOUND,
            RequestError::NoReplica { .. } => StatusCode::SERVICE_UNAVAILABLE,
            RequestError::Upstream { .. } => StatusCode::BAD_GATEWAY,
            RequestError::Timeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            RequestError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            RequestError::Overloaded {
                no_replica: true, ..
            } => StatusCode::SERVICE_UNAVAILABLE,
            RequestError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            RequestError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
        }
    }

    /// vLLM's error class name for the `type` field.
    pub fn kind(&self) -> &'static str {
        match self {
            RequestError::BadRequest(_) | RequestError::ClientBody(_) => "BadRequestError",
            RequestError::TooLarge { .. } => "RequestTooLargeError",
            RequestError::UnknownModel(_) => "NotFoundError",
            RequestError::NoReplica { .. } => "ServiceUnavailableError",
            RequestError::Upstream { .. } => "BadGatewayError",
            RequestError::Timeout { .. } => "GatewayTimeoutError",
            RequestError::BodyTimeout { .. } => "RequestTimeoutError",
            RequestError::Overloaded {
                no_replica: true, ..
            } => "ServiceUnavailableError",
            RequestError::Overloaded { .. } => "RateLimitError",
            RequestError::MethodNotAllowed { .. } => "MethodNotAllowedError",
        }
    }

    /// A stable, low-cardinality label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            RequestError::BadRequest(_) => "bad_request",
            RequestError::ClientBody(_) => "client_body",
            RequestError::TooLarge { .. } => "too_large",
            RequestError::UnknownModel(_) => "unknown_model",
            RequestError::NoReplica { .. } => "no_replica",
            RequestError::Upstream { .. } => "upstream",
            RequestError::Timeout { .. } => "timeout",
            RequestError::BodyTimeout { .. } => "body_timeout",
            RequestError::Overloaded { .. } => "overloaded",
            RequestError::MethodNotAllowed { .. } => "method_not_allowed",
        }
    }

    /// Seconds the client should wait before retrying (`Retry-After`), when the router says.
    pub fn retry_after_s(&self) -> Option<u32> {
        match self {
            RequestError::Overloaded { retry_after_s, .. }
            | RequestError::NoReplica { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let param = match self {
            RequestError::UnknownModel(_) => Some("model".to_owned()),
            _ => None,
        };
        ErrorBody {
            error: ErrorDetail {
                message: self.to_string(),
                kind: self.kind().to_owned(),
                param,
                code: self.status().as_u16(),
            },
        }
    }
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        let mut resp = json_response(self.status(), &self.body());
        if let Some(s) = self.retry_after_s() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let RequestError::MethodNotAllowed { allow, .. } = &self {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        // The rest of the body was not read: the connection cannot carry another request.
        if let RequestError::BodyTimeout { .. } = &self {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}

/// A JSON response with the right content type; serialization of these plain types cannot
/// fail, but if it did the client still gets the status with an empty object.
pub(crate) fn json_response<T: serde::Serialize>(status: StatusCode, value: &T) -> Response {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut resp = (status, body).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("{0}")]
    Config(#[from] ConfigErrors),
    #[error("pool `{pool}`: loading the tokenizer from {dir}: {source}")]
    Tokenizer {
        pool: String,
        dir: String,
        source: kinference_tokenize::TokenizeError,
    },
    #[error("pool `{pool}`: {source}")]
    Events {
        pool: String,
        source: kinference_events::EventsError,
    },
    #[error("binding {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}
