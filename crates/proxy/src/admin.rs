//! The admin port: Prometheus `/metrics`, `/livez` (= `/healthz`), `/readyz`,
//! `POST /debug/explain`, `GET /debug/replicas`, `GET /debug/savings`, `GET /debug/dashboard`
//! and the `/dashboard` page that draws the last one. Nothing here forwards a request or
//! changes routing state.
//!
//! Invariants: `/debug/explain` runs the same parsing, tokenization and `select` as the data
//! plane, without `apply`, so explaining a request never changes where the next one goes.
//! With a token configured (`admin_auth`), every path but the probes needs
//! `Authorization: Bearer TOKEN` (`/metrics` too unless `open_metrics`), compared in constant
//! time; a refusal is a 401 in OpenAI's error shape, counted. The dashboard's page and
//! assets (`/dashboard`, compiled into the binary) hold no data and are served without the
//! token: the page asks for it and sends it as that header when it reads `/debug/dashboard`.

use std::sync::Arc;

use parking_lot::Mutex;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use prometheus_client::registry::Registry;
use serde::de::IgnoredAny;
use serde::Deserialize;
use subtle::ConstantTimeEq;

use crate::api::{DashboardResponse, ErrorBody, ErrorDetail};
use crate::body::read_body;
use crate::config::AdminToken;
use crate::dashboard::{self, History, Totals};
use crate::decide::{self, Api};
use crate::error::{json_response, RequestError};
use crate::fleet::Fleet;
use crate::savings::Prices;
use crate::snapshot::{self, Costs};

/// What the admin handlers share.
#[derive(Debug)]
pub(crate) struct AdminState {
    pub fleet: Arc<Fleet>,
    pub registry: Registry,
    /// The families the dashboard samples ([`crate::metrics::Metrics::dashboard_registry`]).
    pub totals: Registry,
    /// The bearer token every path but the probes needs (`None`: no authentication).
    pub token: Option<AdminToken>,
    /// `/metrics` without the token.
    pub open_metrics: bool,
    /// What the savings are valued at.
    pub prices: Prices,
    /// The dashboard's recent samples ([`sample`] adds them).
    pub history: Mutex<History>,
}

impl AdminState {
    /// `None` when the request may go on; else the 401 to answer.
    fn refuse(&self, headers: &HeaderMap) -> Option<Response> {
        let want = self.token.as_ref()?;
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
            .map(<[u8]>::trim_ascii);
        if given.is_some_and(|g| bool::from(g.ct_eq(want.as_bytes()))) {
            return None;
        }
        self.fleet.metrics.limits.admin_unauthorized.inc();
        let message = if given.is_some() {
            "the bearer token is wrong"
        } else {
            "this path needs `Authorization: Bearer TOKEN` (the router's admin token)"
        };
        let body = ErrorBody {
            error: ErrorDetail {
                message: message.to_owned(),
                kind: "AuthenticationError".to_owned(),
                param: None,
                code: 401,
            },
        };
        let mut resp = json_response(StatusCode::UNAUTHORIZED, &body);
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        Some(resp)
    }
}

pub(crate) fn router(state: Arc<AdminState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/livez", get(healthz))
        .route("/readyz", get(readyz))
        .route("/debug/explain", post(explain))
        .route("/debug/replicas", get(replicas))
        .route("/debug/savings", get(savings))
        .route("/debug/dashboard", get(dashboard_data))
        .route(
            "/dashboard",
            get(|| asset(DASHBOARD_HTML, "text/html; charset=utf-8")),
        )
        .route(
            "/dashboard/app.js",
            get(|| asset(DASHBOARD_JS, "text/javascript; charset=utf-8")),
        )
        .route(
            "/dashboard/app.css",
            get(|| asset(DASHBOARD_CSS, "text/css; charset=utf-8")),
        )
        .with_state(state)
}

async fn metrics(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if !s.open_metrics {
        if let Some(refused) = s.refuse(&headers) {
            return refused;
        }
    }
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
    let r = snapshot::take(&s.fleet, Costs::Skip).readiness();
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
    if let Some(refused) = s.refuse(req.headers()) {
        return refused;
    }
    let query = req.uri().query().unwrap_or("").to_owned();
    let (parts, body) = req.into_parts();
    let body = match read_body(&s.fleet, "admin", body).await {
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

async fn replicas(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Some(refused) = s.refuse(&headers) {
        return refused;
    }
    json_response(StatusCode::OK, &snapshot::take(&s.fleet, Costs::Compute))
}

async fn savings(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Some(refused) = s.refuse(&headers) {
        return refused;
    }
    json_response(StatusCode::OK, &dashboard::savings(&s.fleet, s.prices))
}

async fn dashboard_data(State(s): State<Arc<AdminState>>, headers: HeaderMap) -> Response {
    if let Some(refused) = s.refuse(&headers) {
        return refused;
    }
    let (history, reasons) = {
        let h = s.history.lock();
        (h.points(), h.reasons())
    };
    let body = DashboardResponse {
        savings: dashboard::savings(&s.fleet, s.prices),
        fleet: snapshot::take(&s.fleet, Costs::Skip),
        reasons,
        interval_secs: dashboard::INTERVAL.as_secs_f64(),
        history,
    };
    json_response(StatusCode::OK, &body)
}

const DASHBOARD_HTML: &str = include_str!("../assets/dashboard.html");
const DASHBOARD_JS: &str = include_str!("../assets/dashboard.js");
const DASHBOARD_CSS: &str = include_str!("../assets/dashboard.css");

async fn asset(body: &'static str, content_type: &'static str) -> Response {
    let mut resp = (StatusCode::OK, body).into_response();
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Everything the page needs comes from this port: nothing from elsewhere may load.
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'",
        ),
    );
    resp
}

/// Adds a point to the dashboard's history every [`dashboard::INTERVAL`], from the page
/// `/metrics` would answer and the fleet snapshot; runs until aborted.
pub(crate) async fn sample(s: Arc<AdminState>) {
    let mut tick = tokio::time::interval(dashboard::INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let totals = Totals::from_page(&crate::metrics::render(&s.totals));
        let loads = dashboard::fleet_loads(&s.fleet);
        let saved: f64 = s
            .fleet
            .pools
            .iter()
            .map(|p| s.fleet.metrics.saved(&p.name).gpu_seconds)
            .sum();
        let t = s.fleet.now().as_secs_f64();
        s.history.lock().push(t, totals, saved, loads);
    }
}
