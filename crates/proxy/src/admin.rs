//! The admin port: Prometheus `/metrics`, `/healthz`, `/readyz`, `POST /debug/explain` and
//! `GET /debug/replicas`. Nothing here forwards a request or changes routing state.
//!
//! Invariant: `/debug/explain` runs the same parsing, tokenization and `select` as the data
//! plane, without `apply`, so explaining a request never changes where the next one goes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prometheus_client::registry::Registry;
use serde::de::IgnoredAny;
use serde::Deserialize;

use crate::body::read_body;
use crate::decide::{self, Api};
use crate::error::{json_response, RequestError};
use crate::fleet::Fleet;
use crate::snapshot;

/// What the admin handlers share.
#[derive(Debug)]
pub(crate) struct AdminState {
    pub fleet: Arc<Fleet>,
    pub registry: Registry,
}

pub(crate) fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/explain", post(explain))
        .route("/debug/replicas", get(replicas))
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AdminState>>) -> Response {
    let text = crate::metrics::render(&s.registry);
    let mut resp = (StatusCode::OK, text).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<Arc<AdminState>>) -> Response {
    let r = snapshot::take(&s.fleet).readiness();
    let status = if r.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    json_response(status, &r)
}

#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    messages: Option<IgnoredAny>,
}

/// `POST /debug/explain[?api=chat|completions]` with a request body: the decision, not
/// forwarded. Without `api`, a body with `messages` is a chat request.
async fn explain(State(s): State<Arc<AdminState>>, req: Request) -> Response {
    let query = req.uri().query().unwrap_or("").to_owned();
    let (parts, body) = match read_body(s.fleet.settings.max_body_bytes, req).await {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let api = if query.split('&').any(|kv| kv == "api=chat") {
        Api::Chat
    } else if query.split('&').any(|kv| kv == "api=completions") {
        Api::Completions
    } else {
        match serde_json::from_slice::<Probe>(&body) {
            Ok(Probe { messages: Some(_) }) => Api::Chat,
            Ok(_) => Api::Completions,
            Err(e) => {
                return RequestError::BadRequest(format!("the body is not a JSON request: {e}"))
                    .into_response()
            }
        }
    };
    match decide::prepare(&s.fleet, api, &body, &parts.headers, true) {
        Ok(p) => json_response(StatusCode::OK, &decide::explain(&s.fleet, api, &p)),
        Err(e) => e.into_response(),
    }
}

async fn replicas(State(s): State<Arc<AdminState>>) -> Response {
    json_response(StatusCode::OK, &snapshot::take(&s.fleet))
}
