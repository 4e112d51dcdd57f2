//! kinference-proxy: the router's data plane (an OpenAI/vLLM-compatible HTTP proxy that sends
//! each request to the replica already caching its prompt's prefix) and its admin port.
//!
//! # Request flow
//!
//! ```text
//!  client ─HTTP/1.1|h2─▶ data port (TCP_NODELAY; conn.rs: ≤ max_connections, else accepting
//!                        pauses; a head within header_read_ms, idle ≤ keep_alive_ms)
//!    POST /v1/completions | /v1/chat/completions
//!      read body (≤ max_body_bytes, else 413; slower than body_read_ms + min rate: 408)
//!      parse `model` (400) ── pool lookup (404) ── the pool's gate: a place among
//!        max_in_flight, or a wait in its queue (full or timed out: 429, 503 if no replica up);
//!        then room on a replica (max_in_flight_per_replica), or a wait in the same queue
//!      tokenize once, as vLLM does ── block hashes (pool's block size, algorithm, seed,
//!                                     LoRA, cache_salt)
//!      decide::route: one index read lock (longest_prefix) + load atomics per worker
//!        (workers at max_in_flight_per_replica left out while another has room)
//!      policy lock: select + apply (speculative entries) ── Decision.ranked
//!      a `prefix_spread` with the pool's `warm` on: the hot prefix alone (max_tokens 1) to
//!        one worker, from its own task (warming.rs; nothing waits for it)
//!      forward the original bytes to ranked[0] (+ X-data-parallel-rank when D > 1);
//!        connect refused / 503 head → ranked[1], ... (max_attempts; then 503 + Retry-After)
//!      once the request is written, while the replica works: the decision is counted, the
//!        baselines' models see the request (decide::observe), and so does the chosen
//!        replica's count of the prefix only it holds
//!      stream the response back frame by frame: first byte releases predicted prefill
//!        tokens, cached_tokens is read from usage as it passes, the body owns the in-flight
//!        guard and the gate's place
//!      speculative entries kept if the first choice answered, moved to the fallback that
//!        answered, taken back if every replica refused or failed before a response head
//!    GET /v1/models: every pool's models, described by the replicas
//!    anything else: passed through to the least loaded replica of the request's pool
//!
//!  per replica: scraper task (GET /metrics every interval: running, waiting, KV usage,
//!               vllm:cache_config_info → scorable or not; health)
//!  discovered pools: PoolMembers handles (join / leave, and new tokenizer, hashing or
//!                    policy, while running; see members.rs)
//!  per pool:    EventPlane (ZMQ SUB per DP rank → index), policy expiry task
//!  admin port:  /metrics /livez /healthz /readyz /debug/explain /debug/replicas
//!               /debug/savings /debug/dashboard /dashboard (a bearer token for all but the
//!               probes and the dashboard's static page when admin_auth has one)
//! ```
//!
//! # Invariants
//!
//! * The body forwarded is byte for byte the body received; only hop-by-hop headers, `Host`
//!   and vLLM's DP-rank header are changed.
//! * A request moves to another replica only while nothing of it can have run: the connection
//!   failed, or the replica answered 503 before any body byte went to the client.
//! * Responses are never buffered: every upstream frame is handed to the client as it arrives,
//!   on sockets with `TCP_NODELAY` on both sides.
//! * The router's in-flight counts per worker are held by a guard that lives in the response
//!   body; success, upstream failure, timeout and client disconnect all release it. A client
//!   that goes away drops the upstream connection, which makes vLLM abort the request.
//! * Routing never waits on the index: a replica without events, with stale events, or whose
//!   hashes the router cannot reproduce (unscorable) is ranked by load.
//! * Every error the router answers itself is `{"error": {"message", "type", "param",
//!   "code"}}` with the matching status; no input makes a handler panic or hang (every
//!   upstream wait has a timeout).
//! * Prompts are never logged.
//! * Time for the policies is tokio's clock, so paused-time tests drive expiry.
//!
//! # Threads
//!
//! The data port is served by `threads` data-plane threads (one per CPU by default), each a
//! single-threaded tokio runtime accepting from the same listening socket and keeping its
//! own upstream connection pool: a request never crosses threads, which on a work-stealing
//! runtime cost a wake-up of another thread per hop (measured in BENCHMARKS.md, "Router
//! latency"). A connection does, once: the thread that accepts it hands it to another that
//! serves fewer connections (`conn::Spread`), since one thread may drain a whole burst of
//! connects from the shared listener. Event planes, scrapers, discovery and the admin port
//! run on the caller's runtime.

// Modules from the bottom up: each one uses only modules listed above it (no import cycles).
// Plain data and settings:
pub mod api;
pub mod config;
pub mod error;
mod limits;
mod metrics;
pub mod savings;
mod usage;
mod warm;
// Talking to replicas (and the headers both HTTP/1.1 paths carry as bytes):
mod heads;
mod link;
mod sock;
mod upstream;
// The live fleet and what keeps it current:
mod dashboard;
mod discovery;
mod fleet;
mod members;
mod scrape;
mod snapshot;
// One request, top down: body → decide → forward; the two ports:
mod admin;
mod body;
mod conn;
mod decide;
mod forward;
mod h1;
mod pick;
mod server;
mod warming;

/// For the fuzz target of the data port's HTTP/1.1 head parser (`fuzz/fuzz_targets/http1_head.rs`).
#[doc(hidden)]
pub mod fuzzing {
    pub use crate::h1::check_head as http1_head;
}

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use kinference_events::{EventsError, WorkerHealth};
use kinference_vllm::DpRank;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use api::{ReadyResponse, ReplicasResponse, ScrapeCounts};
pub use config::{
    parse_policy, AdminAuth, AdminToken, Config, ConfigError, ConfigErrors, EventSourceError,
    EventsSpec, InferencePoolRef, PolicyFlagError, PoolConfig, ReplicaFlagError, ReplicaSpec,
    ScaleIn, UpstreamProtocol, UrlError, WarmConfig, WarmMode,
};
pub use error::{RequestError, StartError};
pub use members::{JoinError, PoolMembers, ReconfigureError};
pub use pick::{Pick, PickRequest, Picker};
pub use savings::{Prices, Saved, SavingsModel};

use crate::admin::AdminState;
use crate::fleet::Fleet;
use crate::metrics::Metrics;
use crate::upstream::Upstream;

/// Connections the admin port keeps open at once (its own, apart from `max_connections`).
const ADMIN_CONNECTIONS: usize = 256;

/// With discovered pools: removes, every 10 s, the metric series a leaver's request that was
/// still running wrote after the leave (the leave itself removes the rest).
fn spawn_series_sweep(fleet: &Arc<Fleet>) -> Option<JoinHandle<()>> {
    if fleet.pools.iter().all(|p| p.source.is_none()) {
        return None;
    }
    let f = fleet.clone();
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        loop {
            tick.tick().await;
            f.forget_left_replicas();
        }
    }))
}

/// A front door served by the caller instead of the HTTP data port (the endpoint picker's gRPC
/// server): given the fleet's [`Picker`], the listener and the stop token, a future that serves
/// until the token is cancelled and the requests it carries have ended.
pub type Front = Box<
    dyn FnOnce(Picker, TcpListener, CancellationToken) -> Pin<Box<dyn Future<Output = ()> + Send>>
        + Send,
>;

/// What the data listener serves.
enum Door {
    /// The OpenAI/vLLM HTTP API, on the data-plane threads.
    Http(TcpListener),
    /// A caller's protocol, on the caller's runtime.
    Front(TcpListener, Front),
}

/// A running router: both ports served, background tasks running.
#[derive(Debug)]
pub struct Proxy {
    data_addr: SocketAddr,
    admin_addr: SocketAddr,
    fleet: Arc<Fleet>,
    stop: CancellationToken,
    /// Cancelled when the drain time is over: the data-plane threads drop what still runs.
    cut: CancellationToken,
    servers: Vec<JoinHandle<()>>,
    background: Vec<JoinHandle<()>>,
    /// How the data port's connections are spread over the data-plane threads (none with a
    /// front door of the caller's).
    spread: Option<Arc<conn::Spread>>,
}

impl Proxy {
    /// Validates `config`, binds its `listen` and `admin` addresses and starts.
    pub async fn start(config: Config) -> Result<Proxy, StartError> {
        let resolved = config.resolve()?;
        let bind = |addr: String| async move {
            TcpListener::bind(&addr)
                .await
                .map_err(|source| StartError::Bind { addr, source })
        };
        let data = bind(config.listen.clone()).await?;
        let admin = bind(config.admin.clone()).await?;
        Self::start_resolved(config, resolved, Door::Http(data), admin).await
    }

    /// Starts on listeners bound by the caller (`listen` and `admin` in `config` are unused).
    pub async fn start_with(
        config: Config,
        data: TcpListener,
        admin: TcpListener,
    ) -> Result<Proxy, StartError> {
        let resolved = config.resolve()?;
        Self::start_resolved(config, resolved, Door::Http(data), admin).await
    }

    /// Starts with the caller's front door on `front` instead of the HTTP data port (the
    /// fleet, its background tasks and the admin port as with [`Proxy::start_with`]).
    /// [`Proxy::data_addr`] is then `front`'s address.
    pub async fn start_front(
        config: Config,
        front: TcpListener,
        admin: TcpListener,
        serve: Front,
    ) -> Result<Proxy, StartError> {
        let resolved = config.resolve()?;
        Self::start_resolved(config, resolved, Door::Front(front, serve), admin).await
    }

    async fn start_resolved(
        config: Config,
        resolved: config::Resolved,
        door: Door,
        admin: TcpListener,
    ) -> Result<Proxy, StartError> {
        let metrics = Metrics::new();
        let resolved_admin_token = resolved.admin_token.clone();
        let upstream = Upstream::new(config.timeouts.connect(), config.timeouts.pool_idle());
        let (fleet, discoveries) =
            fleet::build(&config, resolved, metrics.clone(), upstream).await?;
        let fleet = Arc::new(fleet);
        let registry = {
            let fleet = fleet.clone();
            metrics.registry(
                Arc::new(move || snapshot::take(&fleet, snapshot::Costs::Skip)),
                config.savings,
            )
        };
        let mut background = Vec::new();
        for d in discoveries {
            background.push(tokio::spawn(discovery::run(
                fleet.clone(),
                d.pool,
                d.replica,
            )));
        }
        if let Some(every) = fleet.settings.scrape_interval {
            for pool in &fleet.pools {
                for r in pool.replicas().iter() {
                    background.push(tokio::spawn(scrape::run(
                        fleet.clone(),
                        pool.clone(),
                        r.clone(),
                        every,
                    )));
                }
            }
        }
        for pool in &fleet.pools {
            let (f, p) = (fleet.clone(), pool.clone());
            background.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    p.tick(f.now());
                }
            }));
        }
        background.extend(spawn_series_sweep(&fleet));
        let stop = CancellationToken::new();
        let cut = CancellationToken::new();
        let admin_addr = admin.local_addr()?;
        let (data_addr, mut servers, spread) = match door {
            Door::Http(data) => {
                let addr = data.local_addr()?;
                match Self::spawn_shards(&config, &fleet, data, &stop, &cut).await {
                    Ok((servers, spread)) => (addr, servers, Some(spread)),
                    Err(e) => {
                        for h in &background {
                            h.abort();
                        }
                        return Err(e.into());
                    }
                }
            }
            Door::Front(listener, serve) => {
                let addr = listener.local_addr()?;
                let front = serve(Picker::new(fleet.clone()), listener, stop.clone());
                (addr, vec![tokio::spawn(front)], None)
            }
        };
        let admin_state = Arc::new(AdminState {
            fleet: fleet.clone(),
            registry,
            totals: metrics.dashboard_registry(),
            token: resolved_admin_token,
            open_metrics: config.admin_auth.open_metrics,
            prices: config.savings,
            history: Default::default(),
        });
        background.push(tokio::spawn(admin::sample(admin_state.clone())));
        let admin_app = admin::router(admin_state);
        // The admin port has places of its own: a flood of the data port must not cut off
        // probes and scrapes.
        servers.push(tokio::spawn(conn::serve(
            admin,
            admin_app,
            stop.clone(),
            "admin",
            conn::Places::new(ADMIN_CONNECTIONS),
            conn::ConnRules::new(&config.timeouts, &config.limits),
            fleet.metrics.limits.clone(),
            None,
        )));
        tracing::info!(%data_addr, %admin_addr, pools = fleet.pools.len(), "router started");
        Ok(Proxy {
            data_addr,
            admin_addr,
            fleet,
            stop,
            cut,
            servers,
            background,
            spread,
        })
    }

    /// Serves the HTTP data port on `threads` data-plane threads (one per CPU by default);
    /// the handles complete when the threads have stopped.
    async fn spawn_shards(
        config: &Config,
        fleet: &Arc<Fleet>,
        data: TcpListener,
        stop: &CancellationToken,
        cut: &CancellationToken,
    ) -> std::io::Result<(Vec<JoinHandle<()>>, Arc<conn::Spread>)> {
        let threads = config.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let data = data.into_std()?;
        let places = conn::Places::new(config.limits.max_connections);
        let (spread, shares) = conn::Spread::new(threads);
        let mut servers = Vec::with_capacity(threads + 1);
        for (i, share) in shares.into_iter().enumerate() {
            let shard = Shard {
                index: i,
                listener: data.try_clone()?,
                fleet: fleet.clone(),
                places: places.clone(),
                share,
                stop: stop.clone(),
                cut: cut.clone(),
            };
            let done = match shard.spawn().await {
                Ok(done) => done,
                Err(e) => {
                    // The shards already running stop with their token.
                    stop.cancel();
                    return Err(e);
                }
            };
            servers.push(tokio::spawn(async move {
                let _ = done.await;
            }));
        }
        tracing::debug!(threads, "data-plane threads started");
        Ok((servers, spread))
    }

    /// Client connections each data-plane thread serves now (empty with a front door of the
    /// caller's).
    pub fn data_connections(&self) -> Vec<usize> {
        self.spread.as_ref().map_or_else(Vec::new, |s| s.open())
    }

    /// The data port (the OpenAI API), or the front door's address.
    pub fn data_addr(&self) -> SocketAddr {
        self.data_addr
    }

    /// Decisions for a gateway that forwards requests itself (see [`Picker`]).
    pub fn picker(&self) -> Picker {
        Picker::new(self.fleet.clone())
    }

    /// The admin port.
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// What `/debug/replicas` answers now.
    pub fn status(&self) -> ReplicasResponse {
        snapshot::take(&self.fleet, snapshot::Costs::Compute)
    }

    /// What `/readyz` answers now.
    pub fn readiness(&self) -> ReadyResponse {
        self.status().readiness()
    }

    /// The pools whose replicas are discovered (`inferencePool` in the configuration), each
    /// with the handle that changes its membership.
    pub fn discovered_pools(&self) -> Vec<PoolMembers> {
        self.fleet
            .pools
            .iter()
            .filter_map(|p| PoolMembers::new(self.fleet.clone(), p.clone()))
            .collect()
    }

    /// Requests in flight through the router, all pools.
    pub fn in_flight(&self) -> u64 {
        self.fleet.in_flight()
    }

    /// Waits until `pred` holds for the fleet's state (re-checked on every load, health or
    /// in-flight change), at most `timeout`; the last state checked comes back either way.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        pred: impl Fn(&ReplicasResponse) -> bool,
    ) -> Result<ReplicasResponse, ReplicasResponse> {
        let mut rx = self.fleet.changed.subscribe();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                let s = self.status();
                if pred(&s) {
                    return s;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await;
        waited.map_err(|_| self.status())
    }

    /// Waits until the KV-event stream of `replica_url`'s DP rank `rank` satisfies `pred`
    /// (for example, the index holds its blocks), at most `timeout`. Works for discovered
    /// streams too: it first waits for the subscription.
    pub async fn wait_for_events(
        &self,
        replica_url: &str,
        rank: u32,
        timeout: Duration,
        mut pred: impl FnMut(&WorkerHealth) -> bool,
    ) -> Result<WorkerHealth, EventsError> {
        let url = replica_url.trim_end_matches('/');
        let found = self.fleet.pools.iter().find_map(|p| {
            p.replicas().iter().find(|r| r.url() == url).map(|r| {
                (
                    p.clone(),
                    kinference_index::WorkerId::new(r.id, DpRank(rank)),
                )
            })
        });
        let Some((pool, worker)) = found else {
            return Err(EventsError::Config(format!("no replica {url}")));
        };
        let mut changed = self.fleet.changed.subscribe();
        let waited = tokio::time::timeout(timeout, async {
            loop {
                let plane = pool.plane().ok_or(EventsError::ShutDown)?;
                if let Some(mut rx) = plane.watch_health(worker) {
                    drop(plane);
                    let h = rx
                        .wait_for(&mut pred)
                        .await
                        .map_err(|_| EventsError::ShutDown)?;
                    return Ok(h.clone());
                }
                drop(plane);
                if changed.changed().await.is_err() {
                    return Err(EventsError::ShutDown);
                }
            }
        })
        .await;
        waited.unwrap_or(Err(EventsError::Timeout(timeout)))
    }

    /// Serves until `signal` completes, then shuts down.
    pub async fn run_until(self, signal: impl Future<Output = ()>) {
        signal.await;
        tracing::info!("shutting down");
        self.shutdown().await;
    }

    /// Stops accepting, lets running requests finish (up to `timeouts.drain_ms`), stops the
    /// background tasks and the event planes.
    pub async fn shutdown(self) {
        self.stop.cancel();
        for h in &self.background {
            h.abort();
        }
        for pool in &self.fleet.pools {
            PoolMembers::abort_all(pool);
        }
        let drain = self.fleet.settings.timeouts.drain();
        let deadline = tokio::time::Instant::now() + drain;
        for mut h in self.servers {
            if tokio::time::timeout_at(deadline, &mut h).await.is_err() {
                tracing::warn!("requests still running after the drain time; cutting them");
                self.cut.cancel();
                // A data-plane thread ends promptly once cut; the admin server is aborted.
                if tokio::time::timeout(Duration::from_secs(5), &mut h)
                    .await
                    .is_err()
                {
                    h.abort();
                }
            }
        }
        for h in self.background {
            let _ = h.await;
        }
        for pool in &self.fleet.pools {
            if let Some(plane) = pool.take_plane() {
                match Arc::try_unwrap(plane) {
                    Ok(plane) => plane.shutdown().await,
                    // Still referenced by a response in flight: dropping the last reference
                    // cancels its tasks.
                    Err(plane) => drop(plane),
                }
            }
        }
    }
}

/// One data-plane thread: a single-threaded event loop that accepts from the shared data
/// listener and serves the connections it accepted, start to end, with its own pool of
/// upstream connections. Everything one request does (client socket, routing, upstream socket,
/// streaming) stays on one thread, so no request pays for waking another thread; the shared
/// state (index, policy, load counters) is behind locks and atomics as before.
struct Shard {
    index: usize,
    listener: std::net::TcpListener,
    fleet: Arc<Fleet>,
    /// `limits.max_connections`, shared by every shard.
    places: Arc<conn::Places>,
    /// This shard's side of the spread of connections over the shards.
    share: conn::Share,
    stop: CancellationToken,
    cut: CancellationToken,
}

impl Shard {
    /// Starts the thread and waits until it accepts; the receiver it returns completes when
    /// the thread has stopped.
    async fn spawn(self) -> std::io::Result<tokio::sync::oneshot::Receiver<()>> {
        let (ready_tx, ready) = tokio::sync::oneshot::channel();
        let (done, finished) = tokio::sync::oneshot::channel();
        // Linux keeps 15 bytes of a thread's name: short enough to stay distinct.
        let name = format!("kinf-data-{}", self.index);
        std::thread::Builder::new().name(name).spawn(move || {
            self.run(ready_tx);
            let _ = done.send(());
        })?;
        match ready.await {
            Ok(Ok(())) => Ok(finished),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(std::io::Error::other(
                "a data-plane thread stopped at start",
            )),
        }
    }

    fn run(self, ready: tokio::sync::oneshot::Sender<std::io::Result<()>>) {
        let Shard {
            index: _,
            listener,
            fleet,
            places,
            share,
            stop,
            cut,
        } = self;
        let started = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .and_then(|rt| {
                let listener = {
                    let _in_rt = rt.enter();
                    TcpListener::from_std(listener)?
                };
                Ok((rt, listener))
            });
        let (rt, listener) = match started {
            Ok(x) => {
                let _ = ready.send(Ok(()));
                x
            }
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        rt.block_on(async move {
            let t = &fleet.settings.timeouts;
            let upstream = Upstream::new(t.connect(), t.pool_idle());
            let rules = conn::ConnRules {
                h1_fast_path: true,
                ..conn::ConnRules::new(t, &fleet.settings.limits)
            };
            let metrics = fleet.metrics.limits.clone();
            let app = server::Data::new(fleet, upstream);
            tokio::select! {
                () = conn::serve(listener, app, stop, "data", places, rules, metrics, Some(share)) => {}
                () = cut.cancelled() => {}
            }
        });
        // Dropping the runtime drops every connection still open on this thread.
        drop(rt);
    }
}
