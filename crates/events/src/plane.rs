//! [`EventPlane`]: owns the index, its single writer task and one subscriber task per worker.
//!
//! Invariants: the index is written only by the writer task; a worker's subscriber is stopped
//! (awaited) before its removal is sent to the writer, so nothing of it can be applied after
//! the removal; every task stops when the plane's cancellation token fires. Workers that bind
//! the same endpoint (a fixed port) share one socket and are told apart by topic
//! ([`crate::shared`]); the socket closes with its last worker.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use kinference_index::{Index, ReplicaId, WorkerId};
use parking_lot::{Mutex, RwLock};
use tokio::sync::{mpsc, oneshot, watch, OwnedRwLockWriteGuard};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{EventPlaneConfig, ReplicaConfig, WorkerConfig};
use crate::error::EventsError;
use crate::health::WorkerHealth;
use crate::shared::{BoundEndpoint, SharedSub};
use crate::socket::Pace;
use crate::subscriber::{self, SubscriberSpec};
use crate::transport::ReaderEvent;
use crate::writer::{Envelope, Update, Writer};

/// Shared handle to the index. Readers take the read lock briefly (`longest_prefix`); only the
/// plane's writer task takes the write lock.
pub type IndexHandle = Arc<RwLock<Index>>;

/// How long shutdown waits for a task before aborting it.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// While held, the index writer applies nothing (updates queue in the bounded channel, then
/// subscribers wait). For consistent multi-read snapshots and for backpressure tests.
#[derive(Debug)]
pub struct WriterPause {
    _guard: OwnedRwLockWriteGuard<()>,
}

#[derive(Debug)]
struct WorkerTask {
    cancel: CancellationToken,
    task: JoinHandle<()>,
    health: watch::Receiver<WorkerHealth>,
    /// Bind mode: the bound endpoint feeding this worker, and the worker's topic there.
    route: Option<(Arc<SharedSub>, String)>,
}

/// Bound endpoints by configured address; port-0 endpoints are never shared (each asks for a
/// port of its own) and are not listed.
type BoundMap = tokio::sync::Mutex<HashMap<String, Arc<SharedSub>>>;

/// The live KV-event plane. Create inside a tokio runtime with [`EventPlane::start`].
#[derive(Debug)]
pub struct EventPlane {
    config: Arc<EventPlaneConfig>,
    index: IndexHandle,
    tx: mpsc::Sender<Envelope>,
    cancel: CancellationToken,
    pause: Arc<tokio::sync::RwLock<()>>,
    workers: Mutex<HashMap<WorkerId, WorkerTask>>,
    bound: BoundMap,
    writer: Mutex<Option<JoinHandle<()>>>,
    seeds: AtomicU64,
}

impl EventPlane {
    /// Starts the index writer. Must be called from within a tokio runtime.
    pub fn start(config: EventPlaneConfig) -> Result<EventPlane, EventsError> {
        config.validate()?;
        let index: IndexHandle = Arc::new(RwLock::new(Index::new()));
        let (tx, rx) = mpsc::channel(config.channel_capacity);
        let cancel = CancellationToken::new();
        let pause = Arc::new(tokio::sync::RwLock::new(()));
        let writer = Writer {
            index: index.clone(),
            rx,
            batch_max: config.writer_batch_max,
            pause: pause.clone(),
            cancel: cancel.child_token(),
        };
        let writer = tokio::spawn(writer.run());
        Ok(EventPlane {
            config: Arc::new(config),
            index,
            tx,
            cancel,
            pause,
            workers: Mutex::new(HashMap::new()),
            bound: BoundMap::default(),
            writer: Mutex::new(Some(writer)),
            seeds: AtomicU64::new(0),
        })
    }

    pub fn config(&self) -> &EventPlaneConfig {
        &self.config
    }

    /// Subscribes to one (replica, DP rank) stream. In bind mode the socket is bound before
    /// this returns (bind errors are returned; the bound endpoint is in the worker's health);
    /// in connect mode the subscriber dials in the background, retrying with backoff.
    pub async fn add_worker(&self, config: WorkerConfig) -> Result<WorkerId, EventsError> {
        if self.cancel.is_cancelled() {
            return Err(EventsError::ShutDown);
        }
        config.validate()?;
        let worker = config.worker_id();
        if self.workers.lock().contains_key(&worker) {
            return Err(EventsError::DuplicateWorker(worker));
        }
        let endpoint = config.events_endpoint()?;
        let mut health = WorkerHealth::new(worker, endpoint.clone());
        let (routed, route) = if config.mode.binds() {
            let (tx, rx) = mpsc::channel(self.config.reader_capacity);
            let shared = self.route(&endpoint, &config.topic, tx).await?;
            health.local_endpoint = Some(shared.local_endpoint().to_owned());
            (Some(rx), Some((shared, config.topic.clone())))
        } else {
            (None, None)
        };
        let (health_tx, health_rx) = watch::channel(health);
        let cancel = self.cancel.child_token();
        let spec = SubscriberSpec {
            worker,
            topic: config.topic.clone(),
            endpoint,
            replay: config.replay_endpoint()?,
            plane: self.config.clone(),
            health: Arc::new(health_tx),
            writer: self.tx.clone(),
            cancel: cancel.clone(),
            seed: self.seed_for(worker),
        };
        let duplicate = self.workers.lock().contains_key(&worker);
        if duplicate {
            self.release(route).await;
            return Err(EventsError::DuplicateWorker(worker));
        }
        let task = tokio::spawn(subscriber::run(spec, routed));
        let entry = WorkerTask {
            cancel,
            task,
            health: health_rx,
            route,
        };
        self.workers.lock().insert(worker, entry);
        tracing::info!(?worker, "event subscriber started");
        Ok(worker)
    }

    /// Subscribes to every DP rank of a replica (ports base + rank).
    pub async fn add_replica(&self, config: ReplicaConfig) -> Result<Vec<WorkerId>, EventsError> {
        let mut added = Vec::new();
        for worker in config.workers() {
            match self.add_worker(worker).await {
                Ok(id) => added.push(id),
                Err(e) => {
                    // All ranks or none: a half-subscribed replica would look healthy.
                    for id in added {
                        let _ = self.remove_worker(id).await;
                    }
                    return Err(e);
                }
            }
        }
        Ok(added)
    }

    /// Stops one worker's subscriber and clears its entries; returns once the index no longer
    /// holds them. `Ok(false)` if it was not subscribed.
    pub async fn remove_worker(&self, worker: WorkerId) -> Result<bool, EventsError> {
        let Some(task) = self.workers.lock().remove(&worker) else {
            return Ok(false);
        };
        self.stop_worker(task).await;
        self.send_and_wait(Envelope::new(worker, Some(Update::ClearWorker)))
            .await?;
        Ok(true)
    }

    /// Stops every subscriber of `replica` and removes all its entries from the index; returns
    /// once they are gone, with the number of workers stopped.
    pub async fn remove_replica(&self, replica: ReplicaId) -> Result<usize, EventsError> {
        let tasks: Vec<WorkerTask> = {
            let mut workers = self.workers.lock();
            let ids: Vec<WorkerId> = workers
                .keys()
                .filter(|w| w.replica == replica)
                .copied()
                .collect();
            ids.iter().filter_map(|id| workers.remove(id)).collect()
        };
        let stopped = tasks.len();
        for task in tasks {
            self.stop_worker(task).await;
        }
        let any = WorkerId {
            replica,
            rank: kinference_vllm::DpRank(0),
        };
        self.send_and_wait(Envelope::new(any, Some(Update::RemoveReplica(replica))))
            .await?;
        Ok(stopped)
    }

    async fn send_and_wait(&self, mut env: Envelope) -> Result<(), EventsError> {
        let (ack_tx, ack_rx) = oneshot::channel();
        env.ack = Some(ack_tx);
        tokio::select! {
            _ = self.cancel.cancelled() => return Err(EventsError::ShutDown),
            r = self.tx.send(env) => r.map_err(|_| EventsError::ShutDown)?,
        }
        tokio::select! {
            _ = self.cancel.cancelled() => Err(EventsError::ShutDown),
            r = ack_rx => r.map_err(|_| EventsError::ShutDown),
        }
    }

    /// Queues an update for the index writer, in order with the streams' updates (for example
    /// entries written speculatively by a router). Waits while the writer's queue is full.
    pub async fn submit(&self, worker: WorkerId, update: Update) -> Result<(), EventsError> {
        tokio::select! {
            _ = self.cancel.cancelled() => Err(EventsError::ShutDown),
            r = self.tx.send(Envelope::new(worker, Some(update))) => {
                r.map_err(|_| EventsError::ShutDown)
            }
        }
    }

    /// The shared index (read it with `index().read()`).
    pub fn index(&self) -> IndexHandle {
        self.index.clone()
    }

    /// The workers currently subscribed.
    pub fn workers(&self) -> Vec<WorkerId> {
        let mut ids: Vec<WorkerId> = self.workers.lock().keys().copied().collect();
        ids.sort();
        ids
    }

    /// A snapshot of one worker's health.
    pub fn health(&self, worker: WorkerId) -> Option<WorkerHealth> {
        self.workers
            .lock()
            .get(&worker)
            .map(|t| t.health.borrow().clone())
    }

    /// `read` applied to one worker's health in place, without copying it (its root samples
    /// hold token ids): for callers that need a few fields of many workers often.
    pub fn with_health<R>(
        &self,
        worker: WorkerId,
        read: impl FnOnce(&WorkerHealth) -> R,
    ) -> Option<R> {
        self.workers
            .lock()
            .get(&worker)
            .map(|t| read(&t.health.borrow()))
    }

    /// A receiver that sees every health change of `worker` (hold it to read without locks).
    pub fn watch_health(&self, worker: WorkerId) -> Option<watch::Receiver<WorkerHealth>> {
        self.workers.lock().get(&worker).map(|t| t.health.clone())
    }

    /// Waits until `worker`'s health satisfies `pred`, at most `timeout`.
    pub async fn wait_for(
        &self,
        worker: WorkerId,
        timeout: Duration,
        pred: impl FnMut(&WorkerHealth) -> bool,
    ) -> Result<WorkerHealth, EventsError> {
        let mut rx = self
            .watch_health(worker)
            .ok_or(EventsError::UnknownWorker(worker))?;
        let waited = tokio::time::timeout(timeout, rx.wait_for(pred)).await;
        match waited {
            Ok(Ok(h)) => Ok(h.clone()),
            Ok(Err(_)) => Err(EventsError::ShutDown),
            Err(_) => Err(EventsError::Timeout(timeout)),
        }
    }

    /// Stops the index writer from applying updates until the returned guard is dropped.
    pub fn pause_writer(&self) -> impl Future<Output = WriterPause> + Send + 'static {
        let pause = self.pause.clone();
        async move {
            WriterPause {
                _guard: pause.write_owned().await,
            }
        }
    }

    /// Stops every task and waits for them (each at most a few seconds, then aborted).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let tasks: Vec<WorkerTask> = self.workers.lock().drain().map(|(_, t)| t).collect();
        for task in tasks {
            self.stop_worker(task).await;
        }
        let writer = self.writer.lock().take();
        if let Some(writer) = writer {
            stop_join(writer).await;
        }
    }

    /// Every bound endpoint with its topics and the messages no worker owned (unknown
    /// topics), sorted by bound endpoint. Cheap and lock-light: for metrics and admin pages.
    pub fn bound_endpoints(&self) -> Vec<BoundEndpoint> {
        let mut seen: Vec<Arc<SharedSub>> = Vec::new();
        for t in self.workers.lock().values() {
            if let Some((s, _)) = &t.route {
                if !seen.iter().any(|x| Arc::ptr_eq(x, s)) {
                    seen.push(s.clone());
                }
            }
        }
        let mut out: Vec<BoundEndpoint> = seen.iter().map(|s| s.stats()).collect();
        out.sort_by(|a, b| a.local_endpoint.cmp(&b.local_endpoint));
        out
    }

    /// The bound endpoint for `endpoint` (opened on first use), with `tx` routed for `topic`.
    async fn route(
        &self,
        endpoint: &str,
        topic: &str,
        tx: mpsc::Sender<ReaderEvent>,
    ) -> Result<Arc<SharedSub>, EventsError> {
        let shareable = !endpoint.ends_with(":0");
        // Held until the route is in place, so a concurrent release cannot close it first.
        let mut bound = self.bound.lock().await;
        let existing = bound.get(endpoint).filter(|_| shareable).cloned();
        let fresh = existing.is_none();
        let shared = match existing {
            Some(s) => s,
            None => {
                let cancel = self.cancel.child_token();
                let pace = Pace::new(self.config.read_pacing);
                Arc::new(SharedSub::open(endpoint, &self.config.backoff, pace, cancel).await?)
            }
        };
        match shared.add_route(topic, tx) {
            Ok(()) => {
                if fresh && shareable {
                    bound.insert(endpoint.to_owned(), shared.clone());
                }
                Ok(shared)
            }
            Err(e) => {
                drop(bound);
                if fresh {
                    shared.close().await;
                }
                Err(e)
            }
        }
    }

    /// Drops a worker's route; closes the bound endpoint when it was the last.
    async fn release(&self, route: Option<(Arc<SharedSub>, String)>) {
        let Some((shared, topic)) = route else { return };
        let mut bound = self.bound.lock().await;
        if shared.remove_route(&topic) > 0 {
            return;
        }
        bound.retain(|_, s| !Arc::ptr_eq(s, &shared));
        drop(bound);
        shared.close().await;
    }

    async fn stop_worker(&self, mut task: WorkerTask) {
        let route = task.route.take();
        stop_task(task).await;
        self.release(route).await;
    }

    fn seed_for(&self, worker: WorkerId) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        worker.hash(&mut h);
        h.finish() ^ self.seeds.fetch_add(1, Ordering::Relaxed)
    }
}

impl Drop for EventPlane {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn stop_task(task: WorkerTask) {
    task.cancel.cancel();
    stop_join(task.task).await;
}

async fn stop_join(mut handle: JoinHandle<()>) {
    if tokio::time::timeout(STOP_GRACE, &mut handle).await.is_err() {
        tracing::warn!("task did not stop in time; aborting");
        handle.abort();
    }
}
