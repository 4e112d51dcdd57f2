//! `kinference serve`: the cache-aware router. Settings come from a YAML file (`--config`,
//! see `docs/config.md`) or, for a one-pool fleet, from flags alone; every flag also reads a
//! `KINFERENCE_*` environment variable. Flags override the file's top-level settings; the pool
//! flags (`--model`, `--tokenizer`, `--block-size`, `--replica`, ...) describe the one pool of a
//! file-less fleet and cannot be combined with `--config`. On Kubernetes, `--inference-pool`
//! replaces `--replica`: the pool's replicas are the ready pods of that `InferencePool`
//! (several pools: `inferencePool:` in the file), read with `--kubeconfig` or, in a pod, its
//! service account.

use std::path::PathBuf;

use anyhow::Context as _;

use kinference_proxy::{
    parse_policy, Config, InferencePoolRef, PoolConfig, Proxy, ReplicaSpec, ScaleIn,
};

/// Where a pod's service account says which namespace it runs in.
const POD_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// YAML configuration file (format in docs/config.md).
    #[arg(long, short = 'c', env = "KINFERENCE_CONFIG")]
    config: Option<PathBuf>,
    /// Data-plane address (the OpenAI API) [default: 127.0.0.1:8080].
    #[arg(long, env = "KINFERENCE_LISTEN")]
    listen: Option<String>,
    /// Admin address (metrics, health, debug) [default: 127.0.0.1:9090].
    #[arg(long, env = "KINFERENCE_ADMIN")]
    admin: Option<String>,

    /// One-pool fleet: a model name the replicas serve (repeat or comma-separate for several).
    #[arg(long = "model", env = "KINFERENCE_MODEL", value_delimiter = ',')]
    models: Vec<String>,
    /// One-pool fleet: directory with the model's tokenizer.json.
    #[arg(long, env = "KINFERENCE_TOKENIZER")]
    tokenizer: Option<PathBuf>,
    /// One-pool fleet: the replicas' --block-size.
    #[arg(long, env = "KINFERENCE_BLOCK_SIZE")]
    block_size: Option<u32>,
    /// One-pool fleet: the replicas' --prefix-caching-hash-algo [default: sha256].
    #[arg(long, env = "KINFERENCE_HASH_ALGO")]
    hash_algo: Option<String>,
    /// One-pool fleet: the replicas' PYTHONHASHSEED, if set.
    #[arg(long, env = "KINFERENCE_HASH_SEED")]
    hash_seed: Option<String>,
    /// One-pool fleet: the policy, by name or as YAML ('{kind: precise, load_weight_tokens: 512}').
    #[arg(long, env = "KINFERENCE_POLICY")]
    policy: Option<String>,
    /// One-pool fleet: bytes of the tokenizer's prefix cache (0: off).
    #[arg(long, env = "KINFERENCE_TOKENIZER_CACHE_BYTES")]
    tokenizer_cache_bytes: Option<usize>,
    /// One-pool fleet: header carrying the session key for session-affinity.
    #[arg(long, env = "KINFERENCE_SESSION_HEADER")]
    session_header: Option<String>,
    /// One-pool fleet: the GPU timing profile savings are charged with [default:
    /// llama-3.1-8b-h100x1].
    #[arg(long, env = "KINFERENCE_SAVINGS_PROFILE")]
    savings_profile: Option<String>,
    /// One-pool fleet: policies the savings are compared with, each deciding every request
    /// without sending it (round-robin, least-load, approximate; comma-separated; `none` for no
    /// comparison) [default: round-robin].
    #[arg(long, env = "KINFERENCE_BASELINES", value_delimiter = ',')]
    baselines: Option<Vec<String>>,
    /// One-pool fleet: cache-aware scale-in, the YAML of the `scale_in` setting
    /// ('{pod_deletion_cost: true}' keeps the pods' controller.kubernetes.io/pod-deletion-cost
    /// current; needs --inference-pool and patch on pods).
    #[arg(long, env = "KINFERENCE_SCALE_IN")]
    scale_in: Option<String>,
    /// One-pool fleet: hot-prefix warming, `off`, `chosen` or `next` (see docs/config.md,
    /// "Hot-prefix warming") [default: off].
    #[arg(long, env = "KINFERENCE_WARM")]
    warm: Option<kinference_proxy::WarmMode>,
    // The help is an attribute, not a doc comment: its `[...]` are option syntax, not links.
    #[arg(
        long = "replica",
        env = "KINFERENCE_REPLICAS",
        value_delimiter = ';',
        help = "One-pool fleet: a replica, URL[,events=tcp://H:P|discover][,bind=tcp://H:P][,replay=tcp://H:P][,topic=T][,dp=N][,protocol=http|h2c]. Repeat for each replica (';' separates them in KINFERENCE_REPLICAS)"
    )]
    replicas: Vec<String>,
    /// One-pool fleet on Kubernetes: the InferencePool whose ready pods are the replicas
    /// (instead of --replica).
    #[arg(long, env = "KINFERENCE_INFERENCE_POOL")]
    inference_pool: Option<String>,
    /// Kubernetes: kubeconfig file [default: in a pod its service account, else $KUBECONFIG
    /// or ~/.kube/config].
    #[arg(long, env = "KINFERENCE_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Kubernetes: namespace of InferencePools that do not name one [default: the pod's own,
    /// else "default"].
    #[arg(long, env = "KINFERENCE_NAMESPACE")]
    namespace: Option<String>,

    /// Upstream connect timeout, ms.
    #[arg(long, env = "KINFERENCE_CONNECT_TIMEOUT_MS")]
    connect_timeout_ms: Option<u64>,
    /// Time to a replica's response head, ms.
    #[arg(long, env = "KINFERENCE_FIRST_BYTE_TIMEOUT_MS")]
    first_byte_timeout_ms: Option<u64>,
    /// Longest silence inside a response body, ms.
    #[arg(long, env = "KINFERENCE_IDLE_TIMEOUT_MS")]
    idle_timeout_ms: Option<u64>,
    /// Cap on a whole response, ms (0: none).
    #[arg(long, env = "KINFERENCE_TOTAL_TIMEOUT_MS")]
    total_timeout_ms: Option<u64>,
    /// Time running requests get on shutdown, ms.
    #[arg(long, env = "KINFERENCE_DRAIN_MS")]
    drain_ms: Option<u64>,
    /// Largest request body, bytes.
    #[arg(long, env = "KINFERENCE_MAX_BODY_BYTES")]
    max_body_bytes: Option<usize>,
    /// Replicas tried per request while nothing was sent.
    #[arg(long, env = "KINFERENCE_MAX_ATTEMPTS")]
    max_attempts: Option<u32>,
    /// Interval between /metrics scrapes of each replica, ms (0: off).
    #[arg(long, env = "KINFERENCE_SCRAPE_INTERVAL_MS")]
    scrape_interval_ms: Option<u64>,
    /// Timeout of one scrape, ms.
    #[arg(long, env = "KINFERENCE_SCRAPE_TIMEOUT_MS")]
    scrape_timeout_ms: Option<u64>,
    /// Longest interval between scrapes of a quiet replica, ms (0: scrape every replica at
    /// --scrape-interval-ms).
    #[arg(long, env = "KINFERENCE_SCRAPE_IDLE_INTERVAL_MS")]
    scrape_idle_interval_ms: Option<u64>,
    /// Data-plane threads [default: one per CPU].
    #[arg(long, env = "KINFERENCE_THREADS")]
    threads: Option<usize>,
    /// Name the serving replica in x-kinference-endpoint response headers.
    #[arg(long, env = "KINFERENCE_EXPOSE_ENDPOINT_HEADER")]
    expose_endpoint_header: bool,

    /// Client connections open at once (the accept loop pauses at the cap).
    #[arg(long, env = "KINFERENCE_MAX_CONNECTIONS")]
    max_connections: Option<usize>,
    /// Requests of one pool forwarded at once (0: no limit).
    #[arg(long, env = "KINFERENCE_MAX_IN_FLIGHT")]
    max_in_flight: Option<usize>,
    /// Requests forwarded at once to one replica (per DP rank; 0: no limit), e.g. the
    /// replicas' --max-num-seqs divided among the routers.
    #[arg(long, env = "KINFERENCE_MAX_IN_FLIGHT_PER_REPLICA")]
    max_in_flight_per_replica: Option<u32>,
    /// Requests of one pool waiting for a place; beyond it, 429.
    #[arg(long, env = "KINFERENCE_MAX_QUEUE")]
    max_queue: Option<usize>,
    /// Longest wait in a pool's queue, ms; then 429.
    #[arg(long, env = "KINFERENCE_QUEUE_TIMEOUT_MS")]
    queue_timeout_ms: Option<u64>,
    /// Time for a client's request head, ms.
    #[arg(long, env = "KINFERENCE_HEADER_READ_TIMEOUT_MS")]
    header_read_timeout_ms: Option<u64>,
    /// Time for a client's request body before the minimum rate applies, ms.
    #[arg(long, env = "KINFERENCE_BODY_READ_TIMEOUT_MS")]
    body_read_timeout_ms: Option<u64>,
    /// Slowest request body accepted after the body read timeout, bytes/s (0: none).
    #[arg(long, env = "KINFERENCE_MIN_BODY_RATE_BYTES_PER_S")]
    min_body_rate_bytes_per_s: Option<u64>,
    /// Idle client connections are closed after this, ms.
    #[arg(long, env = "KINFERENCE_KEEP_ALIVE_TIMEOUT_MS")]
    keep_alive_timeout_ms: Option<u64>,
    /// HTTP/2 streams one client connection may have open at once.
    #[arg(long, env = "KINFERENCE_H2_MAX_CONCURRENT_STREAMS")]
    h2_max_concurrent_streams: Option<u32>,
    /// Retry-After of a shed request, seconds.
    #[arg(long, env = "KINFERENCE_RETRY_AFTER_S")]
    retry_after_s: Option<u32>,
    /// A file holding the admin port's bearer token (the token itself: KINFERENCE_ADMIN_TOKEN,
    /// never a flag).
    #[arg(long, env = "KINFERENCE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Serve the admin port's /metrics without the token.
    #[arg(long, env = "KINFERENCE_ADMIN_OPEN_METRICS")]
    admin_open_metrics: bool,
    /// Price of one GPU-hour in US dollars, for the savings the admin port reports [default: 2.0].
    #[arg(long, env = "KINFERENCE_USD_PER_GPU_HOUR")]
    usd_per_gpu_hour: Option<f64>,
    /// Power of one GPU in watts, for the energy saved [default: 700].
    #[arg(long, env = "KINFERENCE_GPU_WATTS")]
    gpu_watts: Option<f64>,
}

/// The environment variable holding the admin token itself.
const ADMIN_TOKEN_ENV: &str = "KINFERENCE_ADMIN_TOKEN";

impl ServeArgs {
    fn has_pool_flags(&self) -> bool {
        !self.models.is_empty()
            || self.tokenizer.is_some()
            || self.block_size.is_some()
            || self.hash_algo.is_some()
            || self.hash_seed.is_some()
            || self.policy.is_some()
            || self.session_header.is_some()
            || self.tokenizer_cache_bytes.is_some()
            || self.savings_profile.is_some()
            || self.baselines.is_some()
            || self.scale_in.is_some()
            || self.warm.is_some()
            || !self.replicas.is_empty()
            || self.inference_pool.is_some()
    }

    /// The namespace of pools that name none: the flag, the pod's own, or `default`.
    fn namespace(&self) -> String {
        self.namespace
            .clone()
            .or_else(|| {
                std::fs::read_to_string(POD_NAMESPACE_FILE)
                    .ok()
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
            })
            .unwrap_or_else(|| "default".to_owned())
    }

    /// Whether the replicas come from exactly one of --replica and --inference-pool.
    fn source_problem(&self) -> Option<String> {
        match (self.replicas.is_empty(), &self.inference_pool) {
            (true, None) => Some(
                "at least one --replica URL[,events=...] (or --inference-pool NAME) is required"
                    .to_owned(),
            ),
            (false, Some(_)) => {
                Some("--replica and --inference-pool exclude each other: pick one".to_owned())
            }
            _ => None,
        }
    }

    /// The one pool described by flags; every missing or bad flag is reported at once.
    fn pool(&self) -> anyhow::Result<PoolConfig> {
        let mut problems = Vec::new();
        if self.models.is_empty() {
            problems.push("--model is required (or --config FILE)".to_owned());
        }
        // A discovered pool may take them from its KinferencePool (checked once it is read).
        let discovered = self.inference_pool.is_some();
        if self.tokenizer.is_none() && !discovered {
            problems.push("--tokenizer DIR is required".to_owned());
        }
        if self.block_size.is_none() && !discovered {
            problems.push("--block-size N is required (the replicas' --block-size)".to_owned());
        }
        problems.extend(self.source_problem());
        let mut replicas = Vec::new();
        for r in &self.replicas {
            match ReplicaSpec::from_flag(r) {
                Ok(spec) => replicas.push(spec),
                Err(e) => problems.push(e.to_string()),
            }
        }
        let policy = match self.policy.as_deref().map(parse_policy).transpose() {
            Ok(p) => p,
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        };
        let scale_in = match self.scale_in.as_deref().map(ScaleIn::from_flag).transpose() {
            Ok(s) => s,
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        };
        if !problems.is_empty() {
            anyhow::bail!("{}", problems.join("\n"));
        }
        let model = self.models.first().cloned().unwrap_or_default();
        let mut pool = PoolConfig::new(
            &model,
            self.tokenizer.clone().unwrap_or_default(),
            self.block_size.unwrap_or_default(),
        );
        pool.models = self.models.clone();
        if let Some(a) = &self.hash_algo {
            pool.hash_algo = a.clone();
        }
        pool.hash_seed = self.hash_seed.clone();
        if let Some(p) = policy {
            pool.policy = p;
        }
        pool.session_header = self.session_header.clone();
        if let Some(b) = self.tokenizer_cache_bytes {
            pool.tokenizer_cache_bytes = b;
        }
        if let Some(p) = &self.savings_profile {
            pool.savings_profile = p.clone();
        }
        if let Some(b) = &self.baselines {
            pool.baselines = b.iter().filter(|b| *b != "none").cloned().collect();
        }
        if let Some(s) = scale_in {
            pool.scale_in = s;
        }
        if let Some(w) = self.warm {
            pool.warm.mode = w;
        }
        pool.replicas = replicas;
        pool.inference_pool = self.inference_pool.as_ref().map(|name| InferencePoolRef {
            namespace: None,
            name: name.clone(),
        });
        Ok(pool)
    }

    fn config(&self) -> anyhow::Result<Config> {
        let mut cfg = match &self.config {
            Some(path) => {
                if self.has_pool_flags() {
                    anyhow::bail!(
                        "--model, --tokenizer, --block-size, --hash-algo, --hash-seed, --policy, \
                         --session-header, --tokenizer-cache-bytes, --savings-profile, \
                         --baselines, --scale-in, --warm, --replica and --inference-pool \
                         describe a file-less fleet; with --config put pools in the file"
                    );
                }
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                Config::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
            }
            None => Config::new(vec![self.pool()?]),
        };
        if let Some(v) = &self.listen {
            cfg.listen = v.clone();
        }
        if let Some(v) = &self.admin {
            cfg.admin = v.clone();
        }
        let t = &mut cfg.timeouts;
        for (flag, field) in [
            (self.connect_timeout_ms, &mut t.connect_ms),
            (self.first_byte_timeout_ms, &mut t.first_byte_ms),
            (self.idle_timeout_ms, &mut t.idle_ms),
            (self.total_timeout_ms, &mut t.total_ms),
            (self.drain_ms, &mut t.drain_ms),
            (self.scrape_interval_ms, &mut cfg.scrape.interval_ms),
            (self.scrape_timeout_ms, &mut cfg.scrape.timeout_ms),
            (
                self.scrape_idle_interval_ms,
                &mut cfg.scrape.idle_interval_ms,
            ),
            (self.queue_timeout_ms, &mut t.queue_ms),
            (self.header_read_timeout_ms, &mut t.header_read_ms),
            (self.body_read_timeout_ms, &mut t.body_read_ms),
            (self.keep_alive_timeout_ms, &mut t.keep_alive_ms),
            (
                self.min_body_rate_bytes_per_s,
                &mut cfg.limits.min_body_rate_bytes_per_s,
            ),
        ] {
            if let Some(v) = flag {
                *field = v;
            }
        }
        let l = &mut cfg.limits;
        for (flag, field) in [
            (self.max_connections, &mut l.max_connections),
            (self.max_in_flight, &mut l.max_in_flight),
            (self.max_queue, &mut l.max_queue),
        ] {
            if let Some(v) = flag {
                *field = v;
            }
        }
        if let Some(v) = self.max_in_flight_per_replica {
            l.max_in_flight_per_replica = v;
        }
        if let Some(v) = self.h2_max_concurrent_streams {
            l.h2_max_concurrent_streams = v;
        }
        if let Some(v) = self.retry_after_s {
            l.retry_after_s = v;
        }
        if let Some(f) = &self.admin_token_file {
            cfg.admin_auth.token_file = Some(f.clone());
        }
        if let Ok(token) = std::env::var(ADMIN_TOKEN_ENV) {
            cfg.admin_auth.token = Some(
                kinference_proxy::AdminToken::new(&token)
                    .with_context(|| format!("{ADMIN_TOKEN_ENV} is set but empty"))?,
            );
        }
        if self.admin_open_metrics {
            cfg.admin_auth.open_metrics = true;
        }
        if let Some(v) = self.usd_per_gpu_hour {
            cfg.savings.usd_per_gpu_hour = v;
        }
        if let Some(v) = self.gpu_watts {
            cfg.savings.gpu_watts = v;
        }
        if let Some(v) = self.max_body_bytes {
            cfg.limits.max_body_bytes = v;
        }
        if let Some(v) = self.max_attempts {
            cfg.limits.max_attempts = v;
        }
        if let Some(v) = self.threads {
            cfg.threads = Some(v);
        }
        if self.expose_endpoint_header {
            cfg.expose_endpoint_header = true;
        }
        let namespace = self.namespace();
        for p in &mut cfg.pools {
            if let Some(r) = &mut p.inference_pool {
                r.namespace.get_or_insert_with(|| namespace.clone());
            }
        }
        // Discovered pools are checked once their KinferencePool is applied (`run`).
        if cfg.pools.iter().all(|p| p.inference_pool.is_none()) {
            cfg.check()?;
        }
        Ok(cfg)
    }
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    run_with(args, None)
}

/// Runs the router with the HTTP data port, or with `front` (the endpoint picker's gRPC
/// server) on the `listen` address instead.
pub fn run_with(args: ServeArgs, front: Option<kinference_proxy::Front>) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let namespace = args.namespace();
    let kubeconfig = args.kubeconfig.clone();
    // Requests are served on the proxy's own data-plane threads (`threads`); this runtime only
    // carries the background work (event streams into the index, scrapes, discovery, the admin
    // port). One worker keeps that work from waking a second thread per KV-event batch, which
    // took CPU from the data plane (BENCHMARKS.md, "Router latency"); the index ingests
    // millions of block events per second on one core. A front door of the caller's (the
    // endpoint picker's gRPC server) runs on this runtime instead, so it gets `threads` workers:
    // its tokenizing would otherwise queue behind itself and the background work on one thread.
    let workers = match (&front, cfg.threads) {
        (None, _) => 1,
        (Some(_), Some(n)) => n.max(1),
        (Some(_), None) => {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .thread_name("kinference")
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        let mut cfg = cfg;
        let client = kube_client(&cfg, kubeconfig.as_deref()).await?;
        if let Some(client) = &client {
            // A KinferencePool naming a pool's InferencePool wins over the flags and the file.
            kinference_k8s::settings::apply_to_pools(client, &mut cfg.pools, &namespace).await;
            cfg.check().context(
                "a discovered pool's tokenizer and hashing come from its KinferencePool, \
                 else from --tokenizer/--block-size or the config file",
            )?;
        }
        let proxy = match front {
            None => Proxy::start(cfg).await?,
            Some(front) => {
                let bind = |addr: String| async move {
                    tokio::net::TcpListener::bind(&addr)
                        .await
                        .with_context(|| format!("binding {addr}"))
                };
                let listener = bind(cfg.listen.clone()).await?;
                let admin = bind(cfg.admin.clone()).await?;
                Proxy::start_front(cfg, listener, admin, front).await?
            }
        };
        let discovery = discover(&proxy, client, &namespace);
        // Discovery stops first, so that no replica joins a router that is shutting down.
        let stop_discovery = async move {
            shutdown_signal().await;
            for task in discovery {
                task.abort();
            }
        };
        proxy.run_until(stop_discovery).await;
        Ok(())
    })
}

/// A Kubernetes client when some pool is discovered from an InferencePool.
async fn kube_client(
    cfg: &Config,
    kubeconfig: Option<&std::path::Path>,
) -> anyhow::Result<Option<kinference_k8s::Client>> {
    if cfg.pools.iter().all(|p| p.inference_pool.is_none()) {
        return Ok(None);
    }
    let client = kinference_k8s::client(kubeconfig)
        .await
        .context("connecting to Kubernetes for the InferencePools")?;
    Ok(Some(client))
}

/// Starts following the InferencePool of every discovered pool (none: nothing to do).
fn discover(
    proxy: &Proxy,
    client: Option<kinference_k8s::Client>,
    namespace: &str,
) -> Vec<tokio::task::JoinHandle<()>> {
    let Some(client) = client else {
        return Vec::new();
    };
    proxy
        .discovered_pools()
        .into_iter()
        .map(|members| {
            tracing::info!(pool = %members.name(), inference_pool = %members.source().name, "following InferencePool");
            kinference_k8s::router::spawn_pool(client.clone(), members, namespace)
        })
        .collect()
}

/// Ctrl-C, or SIGTERM on Unix (what Kubernetes sends).
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; Ctrl-C only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn tok() -> String {
        kinference_testkit::tokenizer_dir().display().to_string()
    }

    #[test]
    fn flags_build_a_one_pool_fleet() {
        let cli = Cli::try_parse_from([
            "serve",
            "--listen",
            "127.0.0.1:18080",
            "--admin",
            "127.0.0.1:19090",
            "--model",
            "M",
            "--tokenizer",
            &tok(),
            "--block-size",
            "32",
            "--replica",
            "http://127.0.0.1:8001,events=tcp://127.0.0.1:5557",
            "--replica",
            "http://127.0.0.1:8002",
            "--policy",
            "least-load",
            "--first-byte-timeout-ms",
            "5000",
            "--max-in-flight-per-replica",
            "64",
        ])
        .unwrap();
        let cfg = cli.serve.config().unwrap();
        assert_eq!(cfg.listen, "127.0.0.1:18080");
        assert_eq!(cfg.timeouts.first_byte_ms, 5000);
        assert_eq!(cfg.limits.max_in_flight_per_replica, 64);
        let pool = &cfg.pools[0];
        assert_eq!(pool.models, ["M"]);
        assert_eq!(pool.block_size, 32);
        assert_eq!(pool.policy.name(), "least-load");
        assert_eq!(pool.replicas.len(), 2);
        assert!(pool.replicas[0].events.is_some());
    }

    #[test]
    fn an_inference_pool_replaces_the_replica_list() {
        let cli = Cli::try_parse_from([
            "serve",
            "--model",
            "M",
            "--tokenizer",
            &tok(),
            "--block-size",
            "16",
            "--inference-pool",
            "llama",
            "--namespace",
            "models",
        ])
        .unwrap();
        let cfg = cli.serve.config().unwrap();
        let pool = &cfg.pools[0];
        assert!(pool.replicas.is_empty());
        let r = pool.inference_pool.as_ref().unwrap();
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_str()),
            (Some("models"), "llama")
        );
        let both = Cli::try_parse_from([
            "serve",
            "--model",
            "M",
            "--tokenizer",
            &tok(),
            "--block-size",
            "16",
            "--inference-pool",
            "llama",
            "--replica",
            "http://h:1",
        ])
        .unwrap();
        let err = both.serve.config().unwrap_err().to_string();
        assert!(err.contains("exclude each other"), "{err}");
    }

    #[test]
    fn a_discovered_pool_may_leave_tokenizer_and_block_size_to_its_kinference_pool() {
        let cli =
            Cli::try_parse_from(["serve", "--model", "M", "--inference-pool", "llama"]).unwrap();
        let cfg = cli.serve.config().unwrap();
        assert_eq!(
            cfg.pools[0].block_size, 0,
            "filled in from the KinferencePool"
        );
        // Still refused once known that nothing fills them in.
        let err = cfg.check().unwrap_err().to_string();
        assert!(err.contains("block_size"), "{err}");
    }

    #[test]
    fn scale_in_comes_from_its_flag_and_is_checked() {
        let flags = |scale_in: &str| {
            Cli::try_parse_from([
                "serve",
                "--model",
                "M",
                "--inference-pool",
                "llama",
                "--scale-in",
                scale_in,
            ])
            .unwrap()
            .serve
            .config()
        };
        let cfg = flags("{pod_deletion_cost: true, half_life_s: 120}").unwrap();
        let s = &cfg.pools[0].scale_in;
        assert!(s.pod_deletion_cost);
        assert_eq!((s.half_life_s, s.interval_s), (120.0, 30.0));
        let err = flags("{half_life_s: 0}").unwrap_err().to_string();
        assert!(err.contains("--scale-in.half_life_s"), "{err}");
        let err = flags("{pod_deletion_cost: yes please}")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--scale-in"), "{err}");
    }

    #[test]
    fn missing_flags_are_all_reported() {
        let cli = Cli::try_parse_from(["serve", "--replica", "http://h:1,colour=red"]).unwrap();
        let err = cli.serve.config().unwrap_err().to_string();
        for want in ["--model", "--tokenizer", "--block-size", "colour"] {
            assert!(err.contains(want), "{want} missing in: {err}");
        }
    }
}
