//! The index-writer task: the only code that takes the index's write lock.
//!
//! Invariants: updates of one worker arrive in the order its subscriber sent them (one FIFO
//! channel) and are applied in that order; health fields derived from the index (entries held,
//! applied sequence, sync state after a clear) are published only after the update is applied,
//! and a sync change is honoured only if its stale epoch is still the worker's current one.
//! The index lock is never held while a health channel is written: readers may take the index
//! lock while they hold a health borrow.

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
    pub health: Option<HealthTx>,
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

type HealthTx = Arc<watch::Sender<WorkerHealth>>;

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
        // Registered with the token once, not in each turn's selects.
        let cancel = self.cancel.clone();
        let cancelled = cancel.cancelled();
        tokio::pin!(cancelled);
        loop {
            let first = tokio::select! {
                biased;
                _ = &mut cancelled => break,
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
                _ = &mut cancelled => break,
                g = self.pause.read() => g,
            };
            self.apply_all(&mut buf);
        }
        tracing::debug!("index writer stopped");
    }

    fn apply_all(&self, buf: &mut Vec<Envelope>) {
        // Health is published after the index lock is released: a reader may hold a health
        // borrow (a `wait_for` predicate, say) while it takes the index's read lock, and
        // taking the health lock under the index's write lock would deadlock with it.
        let mut applied = Vec::with_capacity(buf.len());
        {
            let mut index = self.index.write();
            for env in buf.drain(..) {
                apply_one(&mut index, &env);
                let entries = env
                    .health
                    .is_some()
                    .then(|| index.worker_entries(env.worker));
                applied.push((env, entries));
            }
        }
        // One publication per worker however many of its batches were applied (each wakes
        // the channel's waiters), its changes made in the order they were applied.
        let mut groups: Vec<(&HealthTx, Vec<(usize, &Envelope)>)> = Vec::new();
        for (env, entries) in &applied {
            if let (Some(health), Some(entries)) = (&env.health, entries) {
                match groups.iter_mut().find(|(h, _)| Arc::ptr_eq(h, health)) {
                    Some((_, changes)) => changes.push((*entries, env)),
                    None => groups.push((health, vec![(*entries, env)])),
                }
            }
        }
        for (health, changes) in groups {
            health.send_modify(|h| {
                for (entries, env) in changes {
                    publish(h, entries, env);
                }
            });
        }
        for (env, _) in applied {
            if let Some(ack) = env.ack {
                let _ = ack.send(());
            }
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

/// What applying `env` changed in its worker's health (`entries`: what the index held then).
fn publish(h: &mut WorkerHealth, entries: usize, env: &Envelope) {
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
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::time::{Duration, Instant};

    use kinference_index::ReplicaId;
    use kinference_vllm::DpRank;

    use super::*;
    use crate::testing::stored;

    /// A writer over `index` whose channel is never used (the tests call `apply_all`).
    fn writer_of(index: &Arc<RwLock<Index>>) -> Writer {
        let (_tx, rx) = mpsc::channel(1);
        Writer {
            index: index.clone(),
            rx,
            batch_max: 8,
            pause: Arc::default(),
            cancel: CancellationToken::new(),
        }
    }

    /// Batches of two workers drained in one turn (published once per worker): each worker's
    /// health ends as if every batch had been published on its own, in order.
    #[test]
    fn one_turn_publishes_all_of_each_workers_changes_in_order() {
        let index = Arc::new(RwLock::new(Index::new()));
        let writer = writer_of(&index);
        let workers = [1, 2].map(|r| WorkerId::new(ReplicaId(r), DpRank(0)));
        let healths = workers.map(|w| {
            let (tx, rx) = watch::channel(WorkerHealth::new(w, "tcp://x:1".into()));
            (Arc::new(tx), rx)
        });
        let mut buf = Vec::new();
        for (i, (seq, hashes, parent)) in [
            (0, vec![11, 12], None),
            (1, vec![13], Some(12)),
            (2, vec![14, 15], Some(13)),
        ]
        .into_iter()
        .enumerate()
        {
            // Worker 1 gets batches 0 and 2 (the second replayed), worker 2 batch 1.
            let w = i % 2;
            let mut env = Envelope::new(
                workers[w],
                Some(Update::Batch {
                    seq,
                    batch: stored(&hashes, parent),
                }),
            );
            env.health = Some(healths[w].0.clone());
            env.replayed = i == 2;
            env.sync_after = Some((SyncState::Synced, 0));
            buf.push(env);
        }
        let (txs, mut rxs): (Vec<_>, Vec<_>) = healths.into_iter().unzip();
        for rx in &mut rxs {
            rx.mark_unchanged();
        }
        writer.apply_all(&mut buf);
        let h1 = rxs[0].borrow_and_update().clone();
        assert_eq!(h1.entries, 4);
        assert_eq!(h1.applied_seq, Some(2));
        assert_eq!((h1.batches_applied, h1.replayed_batches), (2, 1));
        assert_eq!(h1.sync, SyncState::Synced);
        let h2 = rxs[1].borrow_and_update().clone();
        assert_eq!(
            (h2.entries, h2.applied_seq, h2.batches_applied),
            (1, Some(1), 1)
        );
        assert_eq!(index.read().worker_entries(workers[0]), 4);
        drop(txs);
    }

    /// A reader holding a health borrow (as a `wait_for` predicate does) while it reads the
    /// index must not deadlock with the writer publishing that health: the writer has to let
    /// go of the index before it takes the health lock.
    #[test]
    fn an_index_read_under_a_health_borrow_does_not_wait_for_the_writer() {
        let worker = WorkerId::new(ReplicaId(1), DpRank(0));
        let index = Arc::new(RwLock::new(Index::new()));
        let (health, rx) = watch::channel(WorkerHealth::new(worker, "tcp://x:1".into()));
        let writer = writer_of(&index);
        let mut env = Envelope::new(
            worker,
            Some(Update::Batch {
                seq: 1,
                batch: stored(&[11, 12, 13], None),
            }),
        );
        env.health = Some(Arc::new(health));

        let held = rx.borrow();
        let applying = std::thread::spawn(move || writer.apply_all(&mut vec![env]));
        // Under the borrow: the batch must become readable. With the index lock held across
        // the health update it never does, and the deadline fails the test instead of hanging.
        let deadline = Instant::now() + Duration::from_secs(10);
        let entries = loop {
            if let Some(idx) = index.try_read_for(Duration::from_millis(100)) {
                if idx.worker_entries(worker) > 0 {
                    break idx.worker_entries(worker);
                }
            }
            assert!(
                Instant::now() < deadline,
                "the writer kept the index locked while waiting for the health borrow"
            );
            std::thread::yield_now();
        };
        drop(held);
        applying.join().unwrap();
        assert_eq!(entries, 3);
        assert_eq!(rx.borrow().entries, 3, "health published after the lock");
        assert_eq!(rx.borrow().applied_seq, Some(1));
    }
}
