//! [`PoolWatcher`]: one task per pool that watches the `InferencePool`, the pods its selector
//! matches and (optionally) the `KinferencePool` naming it, and publishes a
//! [`PoolSnapshot`] on a `watch` channel whenever the routable view changes.
//!
//! ```text
//!  watcher(InferencePool, name=P) ─┐
//!  watcher(Pod, selector of P) ────┼─▶ reflector stores ─▶ endpoints() ─▶ watch::Sender<PoolSnapshot>
//!  watcher(KinferencePool) ────────┘   (one task, the channel's one writer)        │
//!                                                                     router: diff(old, new)
//! ```
//!
//! Invariants: kube's `watcher` re-lists on 410 Gone (routine, not reported) and resumes after
//! API-server restarts, with its default backoff; a failing watch sets an error state but keeps
//! the last known endpoints (routing goes on with the last fleet), except when the pool itself
//! is gone. The pod watch follows selector changes: a new one starts and the old endpoints stay
//! published until it has listed. Errors are cleared by the next successful event. Since the
//! backoff grows to tens of seconds during an outage, and a resumed watch says nothing until
//! something changes, a watch that failed to reach the API server is also probed every
//! `probe_interval` with a one-item list, and restarted (re-listing, old endpoints still
//! published until then) as soon as that answers.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::core::Selector;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::crd::KinferencePool;
use crate::error::{is_routine, PoolError, Watched};
use crate::gie::InferencePool;
use crate::snapshot::{endpoints, PoolSnapshot, PoolState, Routing};

/// Which pool to watch, and how.
#[derive(Clone, Debug)]
pub struct WatchConfig {
    pub namespace: String,
    /// The `InferencePool`'s name.
    pub pool: String,
    /// Also watch `KinferencePool` objects (our CRD) for the pool's settings; when on,
    /// a missing `kinference.io` CRD is reported as an error.
    pub routing: bool,
    /// While a watch is in error, how often to probe whether the API answers again.
    pub probe_interval: Duration,
}

impl WatchConfig {
    pub fn new(namespace: &str, pool: &str) -> Self {
        WatchConfig {
            namespace: namespace.to_owned(),
            pool: pool.to_owned(),
            routing: true,
            probe_interval: Duration::from_secs(2),
        }
    }
}

/// A running pool watch; dropping it stops the watch.
#[derive(Debug)]
pub struct PoolWatcher {
    rx: watch::Receiver<PoolSnapshot>,
    task: JoinHandle<()>,
}

impl PoolWatcher {
    /// Starts watching on the current tokio runtime. The first snapshot is `Syncing`.
    pub fn start(client: Client, cfg: WatchConfig) -> PoolWatcher {
        let (tx, rx) = watch::channel(PoolSnapshot::syncing(&cfg.namespace, &cfg.pool));
        let task = tokio::spawn(run(client, cfg, tx));
        PoolWatcher { rx, task }
    }

    /// A receiver of the pool's snapshots.
    pub fn subscribe(&self) -> watch::Receiver<PoolSnapshot> {
        self.rx.clone()
    }

    /// The latest snapshot.
    pub fn current(&self) -> PoolSnapshot {
        self.rx.borrow().clone()
    }
}

impl Drop for PoolWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Events<K> = BoxStream<'static, Result<watcher::Event<K>, watcher::Error>>;

/// One reflected watch and what it last said.
struct Source<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash,
{
    store: Store<K>,
    stream: Events<K>,
    synced: bool,
    error: Option<PoolError>,
    watched: Watched,
    api: Api<K>,
    wc: watcher::Config,
    probe: ListParams,
}

impl<K> Source<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    fn new(api: Api<K>, wc: watcher::Config, probe: ListParams, watched: Watched) -> Self {
        let (store, stream) = reflected(&api, &wc);
        Source {
            store,
            stream,
            synced: false,
            error: None,
            watched,
            api,
            wc,
            probe,
        }
    }

    /// A fresh watch (and store, published once it has listed), with a fresh backoff.
    fn restart(&mut self) {
        (self.store, self.stream) = reflected(&self.api, &self.wc);
        self.synced = false;
        self.error = None;
    }

    fn on(&mut self, item: Option<Result<watcher::Event<K>, watcher::Error>>) {
        match item {
            Some(Ok(ev)) => {
                if self.error.take().is_some() {
                    tracing::info!(resource = self.watched.resource, "watch recovered");
                }
                if matches!(ev, watcher::Event::InitDone) {
                    self.synced = true;
                }
            }
            Some(Err(e)) if is_routine(&e) => {
                tracing::debug!(resource = self.watched.resource, error = %e, "re-listing");
            }
            Some(Err(e)) => {
                let err = self.watched.classify(&e);
                if self.error.as_ref() != Some(&err) {
                    tracing::warn!(resource = self.watched.resource, error = %err, "watch failed");
                }
                self.error = Some(err);
            }
            None => {}
        }
    }

    /// After the API server was unreachable, the watcher's backoff may have grown to tens of
    /// seconds (and a resumed watch says nothing until something changes): once a cheap list
    /// answers again, restart the watch so it re-lists now. Denials and missing CRDs are left to
    /// the watcher's own backoff, whose re-list clears them: probing those would re-list every
    /// interval while they last.
    async fn probe(&mut self, limit: Duration) {
        if !matches!(
            self.error,
            Some(PoolError::Unreachable(_) | PoolError::Api { .. })
        ) {
            return;
        }
        let answered = tokio::time::timeout(limit, self.api.list_metadata(&self.probe)).await;
        if matches!(answered, Ok(Ok(_))) {
            tracing::info!(
                resource = self.watched.resource,
                "API answers again: re-listing"
            );
            self.restart();
        }
    }

    fn objects(&self) -> Vec<Arc<K>> {
        self.store.state()
    }
}

fn reflected<K>(api: &Api<K>, wc: &watcher::Config) -> (Store<K>, Events<K>)
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store();
    let stream = watcher(api.clone(), wc.clone())
        .default_backoff()
        .reflect(writer)
        .boxed();
    (store, stream)
}

async fn next<K>(s: &mut Option<Source<K>>) -> Option<Result<watcher::Event<K>, watcher::Error>>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash,
{
    match s {
        Some(s) => s.stream.next().await,
        None => std::future::pending().await,
    }
}

fn watched(
    cfg: &WatchConfig,
    group: &'static str,
    version: &'static str,
    resource: &'static str,
) -> Watched {
    Watched {
        group,
        version,
        resource,
        namespace: cfg.namespace.clone(),
    }
}

fn pod_source(
    client: &Client,
    cfg: &WatchConfig,
    labels: &BTreeMap<String, String>,
) -> Source<Pod> {
    let selector: Selector = labels.clone().into_iter().collect();
    let api = Api::namespaced(client.clone(), &cfg.namespace);
    let probe = ListParams::default().labels_from(&selector).limit(1);
    let wc = watcher::Config::default().labels_from(&selector);
    Source::new(api, wc, probe, watched(cfg, "", "v1", "pods"))
}

/// All of one pool's watches.
struct Sources {
    pools: Source<InferencePool>,
    pods: Option<Source<Pod>>,
    routing: Option<Source<KinferencePool>>,
    selector: Option<BTreeMap<String, String>>,
}

impl Sources {
    fn new(client: &Client, cfg: &WatchConfig) -> Self {
        let by_name = format!("metadata.name={}", cfg.pool);
        let pools = Source::new(
            Api::namespaced(client.clone(), &cfg.namespace),
            watcher::Config::default().fields(&by_name),
            ListParams::default().fields(&by_name).limit(1),
            watched(cfg, "inference.networking.k8s.io", "v1", "inferencepools"),
        );
        let routing = cfg.routing.then(|| {
            Source::new(
                Api::namespaced(client.clone(), &cfg.namespace),
                watcher::Config::default(),
                ListParams::default().limit(1),
                watched(cfg, "kinference.io", "v1alpha1", "kinferencepools"),
            )
        });
        Sources {
            pools,
            pods: None,
            routing,
            selector: None,
        }
    }

    fn pool(&self) -> Option<Arc<InferencePool>> {
        self.pools.objects().into_iter().next()
    }

    /// Restarts the pod watch when the pool's selector changed (or the pool came or went).
    fn follow_selector(&mut self, client: &Client, cfg: &WatchConfig) {
        if !self.pools.synced {
            // A (re)starting pool watch has an empty store: that is not the pool going away.
            return;
        }
        let want = self.pool().map(|p| p.spec.selector.match_labels.clone());
        if want == self.selector {
            return;
        }
        self.pods = want
            .as_ref()
            .filter(|l| !l.is_empty())
            .map(|l| pod_source(client, cfg, l));
        self.selector = want;
    }

    fn errored(&self) -> bool {
        self.pools.error.is_some()
            || self.pods.as_ref().is_some_and(|p| p.error.is_some())
            || self.routing.as_ref().is_some_and(|r| r.error.is_some())
    }

    async fn probe(&mut self, limit: Duration) {
        self.pools.probe(limit).await;
        if let Some(p) = &mut self.pods {
            p.probe(limit).await;
        }
        if let Some(r) = &mut self.routing {
            r.probe(limit).await;
        }
    }
}

async fn run(client: Client, cfg: WatchConfig, tx: watch::Sender<PoolSnapshot>) {
    let mut src = Sources::new(&client, &cfg);
    let mut snap = PoolSnapshot::syncing(&cfg.namespace, &cfg.pool);
    // An interval, not a sleep per loop turn: events of the healthy watches must not keep
    // postponing the probe of a failed one.
    let mut probe = tokio::time::interval(cfg.probe_interval);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let errored = src.errored();
        tokio::select! {
            _ = tx.closed() => return,
            ev = src.pools.stream.next() => src.pools.on(ev),
            ev = next(&mut src.pods) => if let Some(p) = &mut src.pods { p.on(ev) },
            ev = next(&mut src.routing) => if let Some(r) = &mut src.routing { r.on(ev) },
            _ = probe.tick(), if errored => src.probe(cfg.probe_interval).await,
        }
        src.follow_selector(&client, &cfg);
        let mut next = compose(&src, &cfg, &snap);
        if !next.same_content(&snap) {
            next.revision = snap.revision + 1;
            tracing::debug!(pool = %cfg.pool, revision = next.revision, endpoints = next.endpoints.len(), "pool snapshot");
            tx.send_replace(next.clone());
            snap = next;
        }
    }
}

/// Whether the routing watch has listed (or failed), and the pool's `KinferencePool` (the
/// first by name when several name the pool); the previous one until the watch has listed.
fn routing_of(src: &Sources, cfg: &WatchConfig, prev: &PoolSnapshot) -> (bool, Option<Routing>) {
    let Some(r) = &src.routing else {
        return (true, None);
    };
    if !(r.synced || r.error.is_some()) {
        return (false, prev.routing.clone());
    }
    let ours = r
        .objects()
        .into_iter()
        .filter(|o| o.spec.pool_ref.name == cfg.pool)
        .min_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    let routing = ours.map(|o| Routing {
        name: o.metadata.name.clone().unwrap_or_default(),
        generation: o.metadata.generation,
        spec: o.spec.clone(),
    });
    (true, routing)
}

/// The snapshot the sources describe now; `prev` supplies the endpoints while a watch has not
/// listed yet.
fn compose(src: &Sources, cfg: &WatchConfig, prev: &PoolSnapshot) -> PoolSnapshot {
    let mut snap = PoolSnapshot {
        revision: prev.revision,
        pool_generation: prev.pool_generation,
        endpoints: prev.endpoints.clone(),
        ..PoolSnapshot::syncing(&cfg.namespace, &cfg.pool)
    };
    let (routing_settled, routing) = routing_of(src, cfg, prev);
    snap.routing = routing;
    let errors = [
        src.pools.error.clone(),
        src.pods.as_ref().and_then(|p| p.error.clone()),
        src.routing.as_ref().and_then(|r| r.error.clone()),
    ];
    let first_error = errors.into_iter().flatten().next();
    let Some(pool) = src.pool() else {
        if src.pools.synced {
            snap.endpoints.clear();
            snap.pool_generation = None;
            snap.state = PoolState::Error(first_error.unwrap_or(PoolError::PoolNotFound {
                namespace: cfg.namespace.clone(),
                name: cfg.pool.clone(),
            }));
        } else if let Some(e) = first_error {
            snap.state = PoolState::Error(e);
        }
        return snap;
    };
    snap.pool_generation = pool.metadata.generation;
    let pods_synced = src.pods.as_ref().is_some_and(|p| p.synced);
    let mut computed = Ok(());
    if (pods_synced || src.pods.is_none()) && routing_settled {
        let pods = src.pods.as_ref().map(|p| p.objects()).unwrap_or_default();
        let events = snap.routing.as_ref().map(|r| r.spec.pod_events());
        match endpoints(&pool, pods.iter().map(|p| p.as_ref()), events.as_ref()) {
            Ok(eps) => snap.endpoints = eps,
            Err(e) => {
                snap.endpoints.clear();
                computed = Err(e);
            }
        }
    }
    snap.state = match (first_error, computed) {
        (Some(e), _) | (None, Err(e)) => PoolState::Error(e),
        (None, Ok(())) if (pods_synced || src.pods.is_none()) && routing_settled => {
            PoolState::Ready
        }
        (None, Ok(())) => PoolState::Syncing,
    };
    snap
}
