//! The router's decisions for a gateway that carries the bytes itself (an endpoint picker):
//! the same pipeline as the data port (pool lookup → the pool's gate → tokenize → hash →
//! [`decide::route`]), answering an ordered list of endpoints instead of forwarding. A
//! [`Pick`] holds the request's accounting until the gateway reports how it ended: the gate's
//! place, the in-flight claim (on the worker that really serves it, once the gateway says
//! which), the policy's speculative entries and the request metrics.
//!
//! Invariants: every [`Pick`] releases its claim and its place when dropped, however the
//! gateway's stream ends; speculative entries stay only where a response came from (moved to
//! the fallback that served, taken back when no replica answered or the stream broke before a
//! response); a replica the gateway names that the router did not pick is counted, never
//! trusted blindly (it must be one of the pool's replicas to take the claim).

use std::sync::Arc;

use http::{HeaderMap, StatusCode};
use tokio::time::Instant;

use crate::decide::{self, Api, Routed, Target};
use crate::error::RequestError;
use crate::fleet::{Fleet, InFlight};
use crate::limits::Admitted;
use crate::metrics::{PoolKind, RequestLabels, RouteReplica};
use crate::savings::BaselineGuess;
use crate::usage::UsageScanner;

/// Picks endpoints for requests a gateway forwards itself. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Picker {
    fleet: Arc<Fleet>,
}

/// One request as a gateway hands it to the picker.
#[derive(Debug)]
pub struct PickRequest<'a> {
    /// The request's path (`:path`), query included or not.
    pub path: &'a str,
    pub headers: &'a HeaderMap,
    /// The whole request body (empty for a request without one).
    pub body: &'a [u8],
    /// The gateway's subset hint: only these `host:port` endpoints may be picked.
    pub subset: Option<Vec<String>>,
}

impl Picker {
    pub(crate) fn new(fleet: Arc<Fleet>) -> Self {
        Picker { fleet }
    }

    /// Decides where a request goes. The error is what the gateway should answer at once
    /// (counted here): 400/404 for a request the router cannot place, 429/503 when shedding or
    /// when no endpoint is usable.
    pub async fn pick(&self, req: PickRequest<'_>) -> Result<Pick, RequestError> {
        let path = req.path.split('?').next().unwrap_or_default();
        let api = match path {
            "/v1/completions" => Some(Api::Completions),
            "/v1/chat/completions" => Some(Api::Chat),
            _ => None,
        };
        let route = api.map_or("picked_other", Api::route_label);
        let picked = match api {
            Some(api) => self.pick_routed(api, route, req).await,
            None => self.pick_by_load(route, &req).await,
        };
        picked.inspect_err(|e| decide::count_rejected(&self.fleet, route, e))
    }

    async fn pick_routed(
        &self,
        api: Api,
        route: &'static str,
        req: PickRequest<'_>,
    ) -> Result<Pick, RequestError> {
        let fleet = &self.fleet;
        let looked = decide::lookup(fleet, api, req.body)?;
        let admitted = decide::admit(fleet, looked.pool, req.subset.as_deref()).await?;
        let mut prepared = decide::prepare_looked(fleet, looked, req.headers, false)?;
        prepared.subset = req.subset;
        // A gateway may fall back down the whole list.
        let mut routed = decide::route(fleet, prepared, usize::MAX);
        // Nothing waits on the gateway's side: the baselines see the request now.
        let baselines = decide::observe(&routed);
        if routed.targets.is_empty() {
            decide::landed(fleet, &mut routed, None);
            let p = &routed.prepared;
            return Err(no_endpoint(fleet, &p.pool.name, p.subset.as_deref()));
        }
        decide::record_decision(fleet, &routed);
        let prompt_tokens = routed.prepared.prompt_tokens;
        Ok(Pick::new(
            fleet.clone(),
            route,
            Picked::Routed(Box::new(routed), baselines),
            admitted,
            prompt_tokens,
        ))
    }

    async fn pick_by_load(
        &self,
        route: &'static str,
        req: &PickRequest<'_>,
    ) -> Result<Pick, RequestError> {
        let fleet = &self.fleet;
        let model = (req.body.first() == Some(&b'{'))
            .then(|| serde_json::from_slice::<ModelOnly>(req.body).ok())
            .flatten()
            .and_then(|m| m.model);
        let (pool, _) = fleet.lookup(model.as_deref())?;
        let admitted = decide::admit(fleet, pool, req.subset.as_deref()).await?;
        let targets = decide::by_load(pool, req.subset.as_deref());
        if targets.is_empty() {
            return Err(no_endpoint(fleet, &pool.name, req.subset.as_deref()));
        }
        Ok(Pick::new(
            fleet.clone(),
            route,
            Picked::ByLoad {
                pool: pool.name.clone(),
                targets,
            },
            admitted,
            0,
        ))
    }

    /// The largest request body the router takes (`limits.max_body_bytes`).
    pub fn max_body_bytes(&self) -> usize {
        self.fleet.settings.max_body_bytes
    }

    /// What the admin port's `/readyz` says (the same snapshot and rule).
    pub fn ready(&self) -> bool {
        crate::snapshot::take(&self.fleet, crate::snapshot::Costs::Skip)
            .readiness()
            .ready
    }

    /// Counts a request the picker's caller answered with the router's own error without a
    /// pick (a stream that broke or carried garbage).
    pub fn count_rejected(&self, err: &RequestError) {
        decide::count_rejected(&self.fleet, "picked_other", err);
    }
}

#[derive(serde::Deserialize)]
struct ModelOnly {
    #[serde(default)]
    model: Option<String>,
}

fn no_endpoint(fleet: &Fleet, pool: &str, subset: Option<&[String]>) -> RequestError {
    let detail = match subset {
        Some(s) => format!(
            "no replica of the pool is in the gateway's subset [{}]",
            s.join(",")
        ),
        None => "the pool has no replica".to_owned(),
    };
    RequestError::NoReplica {
        pool: pool.to_owned(),
        detail,
        retry_after_s: fleet.settings.limits.retry_after_s,
    }
}

#[derive(Debug)]
enum Picked {
    /// The routed request, and what the pool's baselines guessed for it.
    Routed(Box<Routed>, Vec<BaselineGuess>),
    ByLoad {
        pool: String,
        targets: Vec<Target>,
    },
}

impl Picked {
    fn targets(&self) -> &[Target] {
        match self {
            Picked::Routed(r, _) => &r.targets,
            Picked::ByLoad { targets, .. } => targets,
        }
    }

    fn baselines(&self) -> &[BaselineGuess] {
        match self {
            Picked::Routed(_, baselines) => baselines,
            Picked::ByLoad { .. } => &[],
        }
    }

    fn pool(&self) -> &str {
        match self {
            Picked::Routed(r, _) => &r.prepared.pool.name,
            Picked::ByLoad { pool, .. } => pool,
        }
    }
}

/// How the gateway reported where a request was served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    /// `targets[i]` answered (the first: `0`).
    Target(usize),
    /// A replica of the pool the router did not pick, or none of the pool's.
    Elsewhere,
}

/// One picked request's endpoints and its accounting, until the gateway's stream ends.
#[derive(Debug)]
pub struct Pick {
    fleet: Arc<Fleet>,
    route: &'static str,
    picked: Picked,
    endpoints: Vec<String>,
    /// The in-flight claim, on the worker believed to serve the request.
    claim: Option<InFlight>,
    admitted: Option<Admitted>,
    prompt_tokens: u32,
    start: Instant,
    scanner: UsageScanner,
    /// Set once the gateway reported the response head.
    served: Option<(Served, String)>,
    first_seen: bool,
    done: bool,
}

impl Pick {
    fn new(
        fleet: Arc<Fleet>,
        route: &'static str,
        picked: Picked,
        admitted: Admitted,
        prompt_tokens: u32,
    ) -> Self {
        let targets = picked.targets();
        let endpoints = targets
            .iter()
            .map(|t| t.replica.endpoint.authority.as_str().to_owned())
            .collect();
        let claim = targets.first().map(|t| {
            InFlight::new(
                t.replica.clone(),
                t.rank,
                u64::from(prompt_tokens.saturating_sub(t.predicted_cached)),
                fleet.changed.clone(),
            )
        });
        Pick {
            fleet,
            route,
            picked,
            endpoints,
            claim,
            admitted: Some(admitted),
            prompt_tokens,
            start: Instant::now(),
            scanner: UsageScanner::default(),
            served: None,
            first_seen: false,
            done: false,
        }
    }

    /// The endpoints to try, best first, as `host:port` (never empty).
    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// The pool the request belongs to.
    pub fn pool(&self) -> &str {
        self.picked.pool()
    }

    /// The data-parallel rank to ask the first endpoint for (`X-data-parallel-rank`), when the
    /// policy chose one of several.
    pub fn dp_rank(&self) -> Option<usize> {
        self.picked
            .targets()
            .first()
            .filter(|t| t.pin_rank)
            .map(|t| t.rank)
    }

    /// The gateway's response head: which endpoint served (`host:port`; `None` when it did
    /// not say: the first picked) and its status. Moves the claim and the speculative entries
    /// to the worker that really serves the request. Only the first report counts.
    pub fn response_head(&mut self, served: Option<&str>, status: u16) {
        if self.served.is_some() {
            return;
        }
        let targets = self.picked.targets();
        let index = match served {
            None => Some(0),
            Some(ep) => targets
                .iter()
                .position(|t| t.replica.endpoint.authority.as_str() == ep),
        };
        let answered = status != StatusCode::SERVICE_UNAVAILABLE.as_u16();
        let (how, replica) = match index {
            Some(i) => {
                let t = &targets[i];
                if i != 0 {
                    self.claim = Some(InFlight::new(
                        t.replica.clone(),
                        t.rank,
                        u64::from(self.prompt_tokens.saturating_sub(t.predicted_cached)),
                        self.fleet.changed.clone(),
                    ));
                }
                if answered {
                    if let Picked::Routed(r, _) = &self.picked {
                        r.prepared
                            .pool
                            .count_routed(self.prompt_tokens, t.predicted_cached);
                    }
                }
                (Served::Target(i), t.replica.url().to_owned())
            }
            None => {
                // Not one the router picked: the gateway routed on its own (fail-open, or a
                // stale list). The claim follows it if it is a replica of the pool.
                let pool = match &self.picked {
                    Picked::Routed(r, _) => Some(r.prepared.pool.clone()),
                    Picked::ByLoad { .. } => None,
                };
                let other = pool.and_then(|p| {
                    p.replicas()
                        .iter()
                        .find(|r| Some(r.endpoint.authority.as_str()) == served)
                        .cloned()
                });
                self.claim = other
                    .as_ref()
                    .map(|r| InFlight::new(r.clone(), 0, 0, self.fleet.changed.clone()));
                let url = other.map_or_else(String::new, |r| r.url().to_owned());
                (Served::Elsewhere, url)
            }
        };
        if let Picked::Routed(r, _) = &mut self.picked {
            let used = match how {
                Served::Target(i) if answered => Some(i),
                _ => None,
            };
            decide::landed(&self.fleet, r, used);
        }
        let kind = match how {
            Served::Target(0) => "first",
            Served::Target(_) => "fallback",
            Served::Elsewhere => "elsewhere",
        };
        self.count_served(kind);
        self.fleet
            .metrics
            .requests
            .get_or_create(&RequestLabels {
                route: self.route,
                replica: replica.clone(),
                status,
            })
            .inc();
        self.served = Some((how, replica));
    }

    /// A chunk of the response body passed through the gateway: the first one means the
    /// prompt was prefilled; usage (cached tokens) is read as it passes.
    pub fn response_chunk(&mut self, chunk: &[u8]) {
        if chunk.is_empty() {
            return;
        }
        if !self.first_seen {
            self.first_seen = true;
            if let Some(c) = self.claim.as_mut() {
                c.release_prefill();
            }
            if let Some((_, replica)) = &self.served {
                self.fleet
                    .metrics
                    .first_byte
                    .get_or_create(&RouteReplica {
                        route: self.route,
                        replica: replica.clone(),
                    })
                    .observe(self.start.elapsed().as_secs_f64());
            }
        }
        self.scanner.feed(chunk);
    }

    /// The response ended (its last body chunk or trailers passed): the claim and the place
    /// are released and the request's duration and cached tokens recorded.
    pub fn finish(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let m = &self.fleet.metrics;
        if let Some((_, replica)) = self.served.as_ref().filter(|(_, r)| !r.is_empty()) {
            m.duration
                .get_or_create(&RouteReplica {
                    route: self.route,
                    replica: replica.clone(),
                })
                .observe(self.start.elapsed().as_secs_f64());
        }
        if let (Picked::Routed(..), Some(actual), Some((Served::Target(i), _))) = (
            &self.picked,
            self.scanner.cached_tokens(),
            self.served.as_ref(),
        ) {
            let predicted = self
                .picked
                .targets()
                .get(*i)
                .map_or(0, |t| t.predicted_cached);
            self.fleet.record_usage(
                self.picked.pool(),
                self.prompt_tokens,
                predicted,
                actual,
                self.picked.baselines(),
            );
        }
        self.claim = None;
        self.admitted = None;
    }

    /// The gateway's stream ended before a response head: `clean` when it closed the stream
    /// normally (a gateway that does not send the response path: the first endpoint is taken
    /// to have served), otherwise (an error, a reset) nothing is known to have run and the
    /// speculative entries are taken back.
    pub fn abandon(&mut self, clean: bool) {
        if self.done {
            return;
        }
        if self.served.is_none() {
            if !clean {
                if let Picked::Routed(r, _) = &mut self.picked {
                    decide::landed(&self.fleet, r, None);
                }
            }
            self.count_served("unreported");
        }
        self.finish();
    }

    fn count_served(&self, kind: &'static str) {
        self.fleet
            .metrics
            .served
            .get_or_create(&PoolKind {
                pool: self.picked.pool().to_owned(),
                kind,
            })
            .inc();
    }
}

impl Drop for Pick {
    fn drop(&mut self) {
        self.abandon(false);
    }
}
