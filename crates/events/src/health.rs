//! Per-worker health, published through a `watch` channel so readers never take a lock.
//!
//! Two tasks write a worker's health: its subscriber (stream facts: connection, sequence,
//! counters) and the index writer (facts that are only true once the index has applied an
//! update: entries held, applied sequence, sync state after a clear). Stale marks carry an
//! epoch so that a clear applied late by the writer never hides a newer gap.

use std::collections::VecDeque;
use std::time::Duration;

use kinference_index::WorkerId;
use kinference_vllm::BlockHash;
use tokio::time::Instant;

/// How far the index can be trusted for one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SyncState {
    /// No event applied yet; the index holds nothing for this worker.
    Connecting,
    /// Every event since a point where the engine's cache was known empty (sequence 0 of this
    /// publisher instance, or an `AllBlocksCleared`) has been applied in order: the index
    /// mirrors the worker's cache exactly, up to `applied_seq`.
    Synced,
    /// The worker was cleared after an unrecoverable gap (or a late start) and every event
    /// since has been applied in order: each entry held is true, but blocks cached before the
    /// clear are missing (false negatives only). Becomes `Synced` on `AllBlocksCleared` or
    /// after a publisher restart replayed from 0.
    Resynced,
    /// A gap is open (replay running) or a reset/unrecoverable gap was detected and the clear
    /// has not been applied yet: entries may be wrong (blocks already evicted, missed stores).
    Stale,
}

/// Root blocks kept per worker for the hash check (the most recent ones).
pub const ROOT_SAMPLES: usize = 4;

/// The first block of a sequence as a worker announced it (no parent, no LoRA, no extra keys):
/// everything needed to recompute its hash, so a reader holding the pool's hasher can tell
/// whether the router reproduces this worker's hashes (algorithm, seed) from real traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RootBlock {
    /// The hash as announced (index key form).
    pub hash: BlockHash,
    /// The block's token ids (`block_size` of them, as announced).
    pub tokens: Vec<u32>,
}

/// A snapshot of one worker's stream and index state.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerHealth {
    pub worker: WorkerId,
    /// The endpoint dialled or bound (after the DP-rank offset).
    pub endpoint: String,
    /// The endpoint actually bound, with the real port when 0 was asked (bind mode only).
    pub local_endpoint: Option<String>,
    /// At least one publisher connection is established.
    pub connected: bool,
    /// Arrival of the last live message (tokio clock).
    pub last_event_at: Option<Instant>,
    /// Sequence number of the last live message received.
    pub last_seq: Option<u64>,
    /// Sequence number of the last batch the index writer applied for this worker.
    pub applied_seq: Option<u64>,
    /// Live messages received (any content).
    pub messages: u64,
    /// Batches applied to the index (live and replayed).
    pub batches_applied: u64,
    /// Gaps detected (seq ahead of the expected one, or a first message above 0).
    pub gaps: u64,
    pub replays_attempted: u64,
    pub replays_succeeded: u64,
    /// Batches received through replay and applied.
    pub replayed_batches: u64,
    /// Gaps replay could not fill; each one cleared the worker.
    pub unrecoverable_gaps: u64,
    /// Publisher restarts detected (sequence went back, or replay showed different content).
    pub resets: u64,
    /// Live messages at or below the stream's position that the replay overlap proved to be
    /// copies or late arrivals from the same publisher instance (skipped, nothing cleared).
    pub repeats: u64,
    /// Messages that could not be parsed or decoded (skipped).
    pub decode_errors: u64,
    /// Socket setup or receive errors, and failed dials (nobody listening yet; libzmq redials
    /// with the plane's backoff).
    pub socket_errors: u64,
    /// Entries the index holds for this worker, after the last applied update.
    pub entries: usize,
    pub sync: SyncState,
    /// `sync == Stale`, kept as a field for cheap checks.
    pub stale: bool,
    /// Bumped on every stale mark; a clear only lifts staleness if no newer mark exists.
    pub stale_epoch: u64,
    /// `block_size` of the last `BlockStored` received.
    pub stored_block_size: Option<u32>,
    /// The last [`ROOT_SAMPLES`] root blocks received, oldest first.
    pub root_samples: VecDeque<RootBlock>,
}

impl WorkerHealth {
    pub fn new(worker: WorkerId, endpoint: String) -> Self {
        WorkerHealth {
            worker,
            endpoint,
            local_endpoint: None,
            connected: false,
            last_event_at: None,
            last_seq: None,
            applied_seq: None,
            messages: 0,
            batches_applied: 0,
            gaps: 0,
            replays_attempted: 0,
            replays_succeeded: 0,
            replayed_batches: 0,
            unrecoverable_gaps: 0,
            resets: 0,
            repeats: 0,
            decode_errors: 0,
            socket_errors: 0,
            entries: 0,
            sync: SyncState::Connecting,
            stale: false,
            stale_epoch: 0,
            stored_block_size: None,
            root_samples: VecDeque::new(),
        }
    }

    /// Time since the last live message, on tokio's clock.
    pub fn last_event_age(&self, now: Instant) -> Option<Duration> {
        self.last_event_at.map(|t| now.saturating_duration_since(t))
    }

    pub(crate) fn set_sync(&mut self, sync: SyncState) {
        self.sync = sync;
        self.stale = sync == SyncState::Stale;
    }

    /// Marks the worker stale and returns the epoch a later clear must match.
    pub(crate) fn mark_stale(&mut self) -> u64 {
        self.stale_epoch += 1;
        self.set_sync(SyncState::Stale);
        self.stale_epoch
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kinference_index::ReplicaId;
    use kinference_vllm::DpRank;

    #[tokio::test(start_paused = true)]
    async fn age_follows_tokio_clock() {
        let worker = WorkerId {
            replica: ReplicaId(1),
            rank: DpRank(0),
        };
        let mut h = WorkerHealth::new(worker, "tcp://x:1".into());
        assert_eq!(h.last_event_age(Instant::now()), None);
        h.last_event_at = Some(Instant::now());
        tokio::time::advance(Duration::from_secs(7)).await;
        assert_eq!(
            h.last_event_age(Instant::now()),
            Some(Duration::from_secs(7))
        );
    }

    #[test]
    fn stale_marks_bump_epoch() {
        let worker = WorkerId {
            replica: ReplicaId(1),
            rank: DpRank(0),
        };
        let mut h = WorkerHealth::new(worker, String::new());
        assert_eq!(h.mark_stale(), 1);
        assert!(h.stale);
        assert_eq!(h.mark_stale(), 2);
        h.set_sync(SyncState::Resynced);
        assert!(!h.stale);
    }
}
