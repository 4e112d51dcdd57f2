//! Errors of the server shell: startup failures, and request errors in vLLM's OpenAI shape
//! (`{"error": {"message", "type", "param", "code"}}`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use thiserror::Error;

/// Why the server could not start or stopped.
#[derive(Debug, Error)]
pub enum ServerError {
    #[error("engine config: {0}")]
    Engine(#[from] kinference_sim::ConfigError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] kinference_tokenize::TokenizeError),
    #[error("zmq: {0}")]
    Zmq(String),
    #[error("endpoint {endpoint}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("{0}")]
    Config(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

/// A request error, answered as vLLM answers it.
#[derive(Debug, Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "BadRequestError",
            ApiError::ModelNotFound(_) => "NotFoundError",
            ApiError::Internal(_) => "InternalServerError",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let param = match self {
            ApiError::ModelNotFound(_) => serde_json::Value::from("model"),
            _ => serde_json::Value::Null,
        };
        let body = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": param,
                "code": status.as_u16(),
            }
        });
        (
            status,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}
