//! The index-writer task: the only code that takes the index's write lock.
//!
//! Invariants: updates of one worker arrive in the order its subscriber sent them (one FIFO
//! channel) and are applied in that order; health fields derived from the index (entries held,
//! applied sequence, sync state after a clear) are published only after the update is applied,
//! and a sync change is honoured only if its stale epoch is still the worker's current one.

use std::sync::Arc;

use kinference_index::{Index, ReplicaId, WorkerId};
use kinference_vllm::KvEventBatch;
use parking_lot::RwLock;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::health::{SyncState, WorkerHealth};

/// A change to the index on behalf of one worker.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    /// Apply one engine step's events; `seq` is the publisher's sequence number.
    Batch { seq: u64, batch: KvEventBatch },
    /// Forget everything the index holds for the worker.
    ClearWorker,
    /// Forget every worker of the replica (it left the endpoint set).
    RemoveReplica(ReplicaId),
}

/// What travels on the channel: the update (`None`: only a sync change), where to publish
/// health, and the sync state the worker reaches once this is applied (`None`: unchanged).
#[derive(Debug)]
pub(crate) struct Envelope {
    pub worker: WorkerId,
    pub update: Option<Update>,
    pub health: Option<Arc<watch::Sender<WorkerHealth>>>,
    pub sync_after: Option<(SyncState, u64)>,
    pub replayed: bool,
    pub ack: Option<oneshot::Sender<()>>,
}

impl Envelope {
    pub fn new(worker: WorkerId, update: Option<Update>) -> Self {
        Envelope {
            worker,
            update,
            health: None,
            sync_after: None,
            replayed: false,
            ack: None,
        }
    }
}

pub(crate) struct Writer {
    pub index: Arc<RwLock<Index>>,
    pub rx: mpsc::Receiver<Envelope>,
    pub batch_max: usize,
    pub pause: Arc<tokio::sync::RwLock<()>>,
    pub cancel: CancellationToken,
}

impl Writer {
    pub async fn run(mut self) {
        let mut buf = Vec::with_capacity(self.batch_max);
        loop {
            let first = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                m = self.rx.recv() => match m {
                    Some(m) => m,
                    None => break,
                },
            };
            buf.push(first);
            while buf.len() < self.batch_max {
                match self.rx.try_recv() {
                    Ok(m) => buf.push(m),
                    Err(_) => break,
                }
            }
            let _gate = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => break,
                g = self.pause.read() => g,
            };
            self.apply_all(&mut buf);
        }
        tracing::debug!("index writer stopped");
    }

    fn apply_all(&self, buf: &mut Vec<Envelope>) {
        let mut acks = Vec::new();
        {
            let mut index = self.index.write();
            for env in buf.drain(..) {
                apply_one(&mut index, &env);
                if let Some(health) = &env.health {
                    publish(&index, &env, health);
                }
                acks.extend(env.ack);
            }
        }
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

fn apply_one(index: &mut Index, env: &Envelope) {
    match &env.update {
        Some(Update::Batch { seq, batch }) => {
            let stats = index.apply_batch(env.worker, batch);
            tracing::trace!(worker = ?env.worker, seq, ?stats, "applied batch");
        }
        Some(Update::ClearWorker) => {
            let dropped = index.clear_worker(env.worker);
            tracing::debug!(worker = ?env.worker, dropped, "cleared worker");
        }
        Some(Update::RemoveReplica(replica)) => {
            let dropped = index.remove_replica(*replica);
            tracing::debug!(%replica, dropped, "removed replica");
        }
        None => {}
    }
}

fn publish(index: &Index, env: &Envelope, health: &watch::Sender<WorkerHealth>) {
    let entries = index.worker_entries(env.worker);
    health.send_modify(|h| {
        h.entries = entries;
        if let Some(Update::Batch { seq, .. }) = &env.update {
            h.applied_seq = Some(*seq);
            h.batches_applied += 1;
            if env.replayed {
                h.replayed_batches += 1;
            }
        }
        if let Some((sync, epoch)) = env.sync_after {
            if h.stale_epoch == epoch {
                h.set_sync(sync);
            }
        }
    });
}
