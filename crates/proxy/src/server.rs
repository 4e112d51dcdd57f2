//! The data port, read top to bottom as a request travels: accept → read the body →
//! decide where it goes ([`crate::decide`]) → forward and stream the answer back
//! ([`crate::forward`]) → or answer the router's own error ([`reject`]).
//!
//! `POST /v1/completions` and `POST /v1/chat/completions` are routed by the pool's policy,
//! `GET /v1/models` is aggregated over the fleet, those paths' other methods are answered 405,
//! and every other path is passed through to a replica of the pool its `model` names (the
//! first pool without one), least loaded first.
//!
//! Invariant: a handler always ends in exactly one response: the replica's (streamed as it
//! comes), or the router's own error in OpenAI's shape, counted once.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::api::Health;
use crate::body::{path_and_query, read_body};
use crate::conn::App;
use crate::decide::{self, Api};
use crate::error::{json_response, RequestError};
use crate::fleet::Fleet;
use crate::forward::{forward, Accounting, Forward};
use crate::h1::{Answer, Req};
use crate::metrics::RequestLabels;
use crate::upstream::Upstream;
use crate::warming;

/// What the data port's handlers share: the fleet, and the upstream client of the thread
/// they run on.
#[derive(Clone)]
pub(crate) struct Data {
    fleet: Arc<Fleet>,
    upstream: Upstream,
}

impl Data {
    pub(crate) fn new(fleet: Arc<Fleet>, upstream: Upstream) -> Self {
        Data { fleet, upstream }
    }
}

/// The data port's paths, matched here rather than by a router (see [`App`]): exact paths
/// only, a path's other methods answered 405 with `Allow`, anything else passed through.
impl App for Data {
    fn call(&self, req: Req) -> impl Future<Output = Answer> + Send + use<> {
        let data = self.clone();
        async move {
            let m = &req.method;
            match req.uri.path() {
                "/v1/completions" if m == Method::POST => routed(data, Api::Completions, req).await,
                "/v1/chat/completions" if m == Method::POST => routed(data, Api::Chat, req).await,
                "/v1/models" if m == Method::GET || m == Method::HEAD => models(data).await.into(),
                "/v1/completions" => {
                    not_allowed(&data, &req, Api::Completions.route_label(), "POST")
                }
                "/v1/chat/completions" => not_allowed(&data, &req, Api::Chat.route_label(), "POST"),
                "/v1/models" => not_allowed(&data, &req, "models", "GET,HEAD"),
                _ => passthrough(data, req).await,
            }
        }
    }
}

fn not_allowed(data: &Data, req: &Req, route: &'static str, allow: &'static str) -> Answer {
    let err = RequestError::MethodNotAllowed {
        method: req.method.clone(),
        allow,
    };
    reject(&data.fleet, route, err)
}

/// A request the pool's policy places.
async fn routed(Data { fleet, upstream }: Data, api: Api, req: Req) -> Answer {
    let start = Instant::now();
    let label = api.route_label();
    let Req {
        method,
        uri,
        headers,
        body,
    } = req;
    let body = match read_body(&fleet, "data", body).await {
        Ok(x) => x,
        Err(e) => return reject(&fleet, label, e),
    };
    let looked = match decide::lookup(&fleet, api, &body) {
        Ok(l) => l,
        Err(e) => return reject(&fleet, label, e),
    };
    let admitted = match decide::admit(&fleet, looked.pool, None).await {
        Ok(a) => a,
        Err(e) => return reject(&fleet, label, e),
    };
    let prepared = match decide::prepare_looked(&fleet, looked, &headers, false) {
        Ok(p) => p,
        Err(e) => return reject(&fleet, label, e),
    };
    let mut routed = decide::route(
        &fleet,
        prepared,
        fleet.settings.max_attempts.max(1) as usize,
    );
    warming::spawn(&fleet, &upstream, &mut routed, &headers);
    let (pool, prompt_tokens) = (routed.prepared.pool.clone(), routed.prepared.prompt_tokens);
    let fwd = Forward {
        route: label,
        pool: pool.clone(),
        accounting: Accounting::Routed { prompt_tokens },
        method,
        path_and_query: path_and_query(&uri),
        headers,
        body,
        start,
        admitted,
    };
    // What the response does not need waits until the request is on its way.
    let observe = || {
        decide::record_decision(&fleet, &routed);
        decide::observe(&routed)
    };
    match forward(&fleet, &upstream, fwd, &routed.targets, observe).await {
        Ok((resp, used)) => {
            let answered = resp.status != StatusCode::SERVICE_UNAVAILABLE;
            if let Some(t) = routed.targets.get(used).filter(|_| answered) {
                pool.count_routed(prompt_tokens, t.predicted_cached);
            }
            decide::landed(&fleet, &mut routed, answered.then_some(used));
            resp
        }
        Err(e) => {
            decide::landed(&fleet, &mut routed, None);
            reject(&fleet, label, e)
        }
    }
}

/// Answers a request with the router's own error, and counts it.
fn reject(fleet: &Fleet, route: &'static str, err: RequestError) -> Answer {
    decide::count_rejected(fleet, route, &err);
    err.into_response().into()
}

/// The `route` label of a passed-through path (a fixed set: paths are not labels).
fn route_label(path: &str) -> &'static str {
    match path {
        "/tokenize" => "tokenize",
        "/detokenize" => "detokenize",
        "/v1/embeddings" => "embeddings",
        "/v1/responses" => "responses",
        "/v1/messages" => "messages",
        "/health" => "health",
        "/ping" => "ping",
        "/metrics" => "replica_metrics",
        "/load" => "load",
        "/version" => "version",
        "/kv_event_sources" => "kv_event_sources",
        "/v1/load_lora_adapter" | "/v1/unload_lora_adapter" => "lora_adapter",
        _ => "other",
    }
}

#[derive(Deserialize)]
struct ModelOnly {
    #[serde(default)]
    model: Option<String>,
}

/// Any other path: to the least loaded replica of the request's pool.
async fn passthrough(Data { fleet, upstream }: Data, req: Req) -> Answer {
    let start = Instant::now();
    let route = route_label(req.uri.path());
    let Req {
        method,
        uri,
        headers,
        body,
    } = req;
    let body = match read_body(&fleet, "data", body).await {
        Ok(x) => x,
        Err(e) => return reject(&fleet, route, e),
    };
    let model = if body.first() == Some(&b'{') {
        serde_json::from_slice::<ModelOnly>(&body)
            .ok()
            .and_then(|m| m.model)
    } else {
        None
    };
    let pool = match fleet.lookup(model.as_deref()) {
        Ok((p, _)) => p.clone(),
        Err(e) => return reject(&fleet, route, e),
    };
    let admitted = match decide::admit(&fleet, &pool, None).await {
        Ok(a) => a,
        Err(e) => return reject(&fleet, route, e),
    };
    let targets = decide::by_load(&pool, None);
    let fwd = Forward {
        route,
        pool,
        accounting: Accounting::Passthrough,
        method,
        path_and_query: path_and_query(&uri),
        headers,
        body,
        start,
        admitted,
    };
    match forward(&fleet, &upstream, fwd, &targets, Vec::new).await {
        Ok((resp, _)) => resp,
        Err(e) => reject(&fleet, route, e),
    }
}

/// `GET /v1/models`: the models every pool serves, with the replicas' own descriptions where
/// one answers, and a minimal entry otherwise.
async fn models(Data { fleet, upstream }: Data) -> Response {
    let timeout = fleet
        .settings
        .timeouts
        .connect()
        .saturating_add(Duration::from_secs(3));
    let mut tasks = tokio::task::JoinSet::new();
    for pool in &fleet.pools {
        for r in pool
            .replicas()
            .iter()
            .filter(|r| r.health() != Health::Down)
        {
            let (u, r) = (upstream.clone(), r.clone());
            tasks.spawn(async move { u.get(&r.endpoint, "/v1/models", timeout, 4 << 20).await });
        }
    }
    let mut described: BTreeMap<String, Value> = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        let Ok(Ok((status, body))) = done else {
            continue;
        };
        if !status.is_success() {
            continue;
        }
        let Ok(v) = serde_json::from_slice::<Value>(&body) else {
            continue;
        };
        for m in v
            .get("data")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(id) = m.get("id").and_then(Value::as_str) {
                described.entry(id.to_owned()).or_insert_with(|| m.clone());
            }
        }
    }
    let mut data = Vec::new();
    for pool in &fleet.pools {
        for model in &pool.models {
            data.push(described.remove(model).unwrap_or_else(|| {
                json!({"id": model, "object": "model", "created": 0, "owned_by": "kinference",
                       "root": model, "parent": null})
            }));
        }
    }
    fleet
        .metrics
        .requests
        .get_or_create(&RequestLabels {
            route: "models",
            replica: String::new(),
            status: 200,
        })
        .inc();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}
