//! Reading a client's request: the whole body within the configured limit, and the target
//! path as forwarded. Shared by both ports.
//!
//! Invariant: a body over the limit is refused (413) before or while it is read, never
//! buffered beyond the limit.

use axum::extract::Request;
use bytes::Bytes;
use http::header;
use http::request::Parts;
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::error::RequestError;

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

/// The request target as forwarded: path and query.
pub(crate) fn path_and_query(parts: &Parts) -> String {
    parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |p| p.as_str().to_owned())
}
