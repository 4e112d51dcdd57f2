//! The subscriber task of one (replica, DP rank): sequence tracking, replay, resync.
//!
//! Invariants:
//! - Updates for the worker leave this task in stream order; a message is applied at most once
//!   (the [`Sequencer`] decides, replayed and buffered live copies of it are skipped).
//! - While a gap is being filled the worker is `Stale`; live messages arriving meanwhile are
//!   buffered (at most `replay_buffer_max`) and handled after the replay, in arrival order.
//! - A gap replay cannot fill, or a publisher restart, clears the worker in the index before
//!   anything newer is applied, so the index never mixes two incompatible histories.
//! - The sync state the index reaches is published by the writer when it applies the update
//!   carrying it, tagged with the stale epoch current when it was sent.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use kinference_index::WorkerId;
use kinference_vllm::events::codec::decode_batch;
use kinference_vllm::{BlockStored, KvEvent};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::backoff::Backoff;
use crate::config::EventPlaneConfig;
use crate::dialer;
use crate::error::EventsError;
use crate::health::{RootBlock, SyncState, WorkerHealth, ROOT_SAMPLES};
use crate::sequencer::{Live, Replayed, Sequencer};
use crate::socket::Pace;
use crate::transport::{self, ReaderEvent, ReplayConn, SubStream};
use crate::wire::{self, ReplayFrame, SeqMsg, WireError};
use crate::writer::{Envelope, Update};

/// The task was cancelled or the index writer is gone: unwind quietly.
#[derive(Debug)]
pub(crate) struct Stop;

type Flow<T = ()> = Result<T, Stop>;

/// A sequence-numbered message; `payload` is `None` when its frames were unreadable.
#[derive(Debug)]
struct Incoming {
    seq: u64,
    payload: Option<Bytes>,
}

/// Why a replay is needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Resolve {
    /// Messages are missing before the trigger.
    Gap,
    /// Nothing is missing, but the publisher reconnected and may be a new instance.
    Verify,
}

/// What applying one replay's messages found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replay {
    /// Applied in order (or skipped as already held) to the end.
    Applied,
    /// The overlap shows the publisher restarted.
    Restarted,
    /// Stopped at a hole after applying some: the rest is to be asked for again.
    Holed,
}

/// How a replay fetch ended.
#[derive(Debug)]
enum FetchEnd {
    /// The end marker arrived: the publisher sent all it still had.
    Complete,
    /// Connection, send, receive or timeout failure.
    Failed(EventsError),
    /// Too many live messages piled up while waiting.
    Overflow,
}

/// What the messages read since the health last changed add to it. Each message would
/// otherwise be a publication of its own (a lock and a wake of every watcher's channel slot):
/// they are published together once the reader has nothing more queued (before the last one
/// goes to the writer), and before any other change the subscriber makes to the health. So
/// the subscriber's own changes never show without the messages before them, and the writer's
/// (`applied_seq`) lead the message count by at most the rest of a burst.
#[derive(Debug, Default)]
struct Seen {
    messages: u64,
    decode_errors: u64,
    last_seq: Option<u64>,
}

impl Seen {
    fn apply_to(&mut self, h: &mut WorkerHealth) {
        if self.messages == 0 {
            return;
        }
        // A message proves a connection (on a shared bound endpoint, connection events
        // cannot be told apart per publisher, so this is the only sign of one).
        h.connected = true;
        h.messages += self.messages;
        h.decode_errors += self.decode_errors;
        // Read together just now (one burst), so one clock reading serves them all.
        h.last_event_at = Some(Instant::now());
        h.last_seq = self.last_seq.or(h.last_seq);
        *self = Seen::default();
    }
}

/// Everything a subscriber needs, fixed at spawn time.
#[derive(Debug)]
pub(crate) struct SubscriberSpec {
    pub worker: WorkerId,
    pub topic: String,
    pub endpoint: String,
    pub replay: Option<String>,
    pub plane: Arc<EventPlaneConfig>,
    pub health: Arc<watch::Sender<WorkerHealth>>,
    pub writer: mpsc::Sender<Envelope>,
    pub cancel: CancellationToken,
    pub seed: u64,
}

pub(crate) struct Subscriber {
    spec: SubscriberSpec,
    /// `spec.cancel` fired: one registration with the token for the task's life, polled by
    /// the per-message waits (a fresh `cancelled()` there would register and unregister
    /// under the token's lock for every message).
    stop: Pin<Box<WaitForCancellationFutureOwned>>,
    rx: mpsc::Receiver<ReaderEvent>,
    seq: Sequencer,
    /// The sync state the index reaches once everything sent so far is applied.
    target: SyncState,
    /// The stale epoch of the last stale mark (mirrors the health's).
    epoch: u64,
    /// A gap is being filled: updates carry no sync change until it is closed.
    resolving: bool,
    pending: VecDeque<Incoming>,
    peers: u32,
    /// A publisher connection closed since the last message.
    lost_peer: bool,
    /// The next in-order message follows a reconnection: prove through the replay overlap
    /// that the publisher is the same instance before trusting it.
    verify_next: bool,
    seen: Seen,
}

/// Runs one worker's subscription until cancelled. `routed` carries the worker's messages
/// from a bound endpoint's dispatcher (bind mode: the socket is bound before, so that bind
/// errors reach the caller); without it the task dials the publisher itself.
pub(crate) async fn run(spec: SubscriberSpec, routed: Option<mpsc::Receiver<ReaderEvent>>) {
    let reader_cancel = spec.cancel.child_token();
    let (rx, reader) = match routed {
        Some(rx) => (rx, None),
        None => {
            let (tx, rx) = mpsc::channel(spec.plane.reader_capacity);
            let (backoff, seed, cancel) =
                (spec.plane.backoff.clone(), spec.seed, reader_cancel.clone());
            let pace = Pace::new(spec.plane.read_pacing);
            let reader = if dialer::dials(&spec.endpoint) {
                let (endpoint, topic) = (spec.endpoint.clone(), spec.topic.clone());
                tokio::spawn(dialer::run(
                    endpoint, topic, tx, backoff, pace, seed, cancel,
                ))
            } else {
                let stream = match connect(&spec).await {
                    Ok(s) => s,
                    Err(Stop) => return,
                };
                tokio::spawn(transport::run_reader(
                    stream, tx, backoff, pace, seed, cancel,
                ))
            };
            (rx, Some(reader))
        }
    };
    let mut sub = Subscriber {
        stop: Box::pin(spec.cancel.clone().cancelled_owned()),
        spec,
        rx,
        seq: Sequencer::default(),
        target: SyncState::Connecting,
        epoch: 0,
        resolving: false,
        pending: VecDeque::new(),
        peers: 0,
        lost_peer: false,
        verify_next: false,
        seen: Seen::default(),
    };
    let _ = sub.main_loop().await;
    reader_cancel.cancel();
    if let Some(reader) = reader {
        let _ = reader.await;
    }
    sub.health(|h| h.connected = false);
    tracing::debug!(worker = ?sub.spec.worker, "subscriber stopped");
}

/// Dials the publisher with capped, jittered backoff until it answers or the task is cancelled.
async fn connect(spec: &SubscriberSpec) -> Flow<SubStream> {
    let mut backoff = Backoff::new(spec.plane.backoff.clone(), spec.seed);
    loop {
        let attempt = transport::open_sub(&spec.endpoint, false, &spec.topic, &spec.plane.backoff);
        let result = tokio::select! {
            biased;
            _ = spec.cancel.cancelled() => return Err(Stop),
            r = attempt => r,
        };
        match result {
            Ok(stream) => return Ok(stream),
            Err(e) => {
                spec.health.send_modify(|h| h.socket_errors += 1);
                tracing::warn!(worker = ?spec.worker, endpoint = %spec.endpoint, error = %e,
                    "event stream connect failed; retrying");
            }
        }
        tokio::select! {
            biased;
            _ = spec.cancel.cancelled() => return Err(Stop),
            _ = backoff.wait() => {}
        }
    }
}

impl Subscriber {
    async fn main_loop(&mut self) -> Flow {
        loop {
            let msg = match self.pending.pop_front() {
                Some(m) => m,
                None => self.next_live().await?,
            };
            self.on_live(msg).await?;
        }
    }

    async fn next_live(&mut self) -> Flow<Incoming> {
        loop {
            if self.rx.is_empty() {
                self.flush_seen();
            }
            let event = tokio::select! {
                biased;
                _ = &mut self.stop => return Err(Stop),
                ev = self.rx.recv() => ev.ok_or(Stop)?,
            };
            if let Some(msg) = self.on_reader_event(event) {
                return Ok(msg);
            }
        }
    }

    /// Books what the reader saw; returns a message that carries a sequence number.
    fn on_reader_event(&mut self, event: ReaderEvent) -> Option<Incoming> {
        match event {
            ReaderEvent::Message(frames) => self.on_frames(&frames),
            ReaderEvent::PeerUp => {
                self.peers = self.peers.saturating_add(1);
                if std::mem::take(&mut self.lost_peer) {
                    self.verify_next = true;
                }
                self.health(|h| h.connected = true);
                None
            }
            ReaderEvent::PeerDown => {
                self.peers = self.peers.saturating_sub(1);
                self.lost_peer = true;
                let connected = self.peers > 0;
                self.health(|h| h.connected = connected);
                None
            }
            ReaderEvent::DialFailed => {
                // Counted, not logged: libzmq redials on its own, with the plane's backoff.
                self.health(|h| h.socket_errors += 1);
                None
            }
            ReaderEvent::Error(e) => {
                tracing::warn!(worker = ?self.spec.worker, error = %e, "event socket error");
                self.health(|h| h.socket_errors += 1);
                None
            }
        }
    }

    fn on_frames(&mut self, frames: &[Bytes]) -> Option<Incoming> {
        let parsed = wire::parse_live(frames, &self.spec.topic);
        let seq = match &parsed {
            Ok(m) => Some(m.seq),
            Err(e) => e.seq,
        };
        let seen = &mut self.seen;
        seen.messages += 1;
        if seq.is_some() {
            seen.last_seq = seq;
        }
        if parsed.is_err() {
            seen.decode_errors += 1;
        }
        match parsed {
            Ok(SeqMsg { seq, payload }) => Some(Incoming {
                seq,
                payload: Some(payload),
            }),
            Err(WireError { seq, reason }) => {
                tracing::warn!(worker = ?self.spec.worker, ?seq, %reason,
                    "skipping unreadable event message");
                seq.map(|seq| Incoming { seq, payload: None })
            }
        }
    }

    async fn on_live(&mut self, msg: Incoming) -> Flow {
        let verify = std::mem::take(&mut self.verify_next);
        match self.seq.classify_live(msg.seq) {
            // After a reconnection a restarted engine may continue exactly where the old one
            // stopped; only the content of the last accepted message can tell.
            Live::Apply if verify && !self.seq.is_fresh() && self.spec.replay.is_some() => {
                self.resolve(msg, Resolve::Verify).await
            }
            Live::Apply => self.apply(msg, false).await,
            Live::Duplicate => Ok(()),
            Live::Gap { .. } => self.resolve(msg, Resolve::Gap).await,
            Live::Behind if self.same_instance().await? => {
                self.health(|h| h.repeats += 1);
                Ok(())
            }
            Live::Behind | Live::Reset => {
                self.reset(msg.seq).await?;
                match self.seq.classify_live(msg.seq) {
                    Live::Apply => self.apply(msg, false).await,
                    _ => self.resolve(msg, Resolve::Gap).await,
                }
            }
        }
    }

    /// Whether the publisher still holds the last accepted message with the same content: then
    /// a live number that went back was a copy or a late arrival, not a restart. A replay that
    /// fails or lacks that message proves nothing, and the caller treats it as a restart (as
    /// without a replay endpoint). Live messages arriving meanwhile are buffered as usual.
    async fn same_instance(&mut self) -> Flow<bool> {
        let (Some(endpoint), Some((seq, payload))) = (self.spec.replay.clone(), self.seq.overlap())
        else {
            return Ok(false);
        };
        self.health(|h| h.replays_attempted += 1);
        let (items, _) = self.fetch(&endpoint, seq).await?;
        Ok(items
            .iter()
            .any(|m| matches!(m, Ok(m) if m.seq == seq && m.payload == payload)))
    }

    /// Accepts `msg` as the next of the stream and sends its batch to the index.
    async fn apply(&mut self, msg: Incoming, replayed: bool) -> Flow {
        if self.seq.is_fresh() && msg.seq == 0 {
            // The first message of a publisher instance: its cache started empty.
            self.target = SyncState::Synced;
        }
        self.seq.accept(msg.seq, msg.payload.clone());
        let Some(payload) = msg.payload else {
            return Ok(());
        };
        let batch = match decode_batch(&payload) {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(worker = ?self.spec.worker, seq = msg.seq, error = %e,
                    label = e.metric_label(), "skipping undecodable event batch");
                self.health(|h| h.decode_errors += 1);
                return Ok(());
            }
        };
        let cleared = batch
            .events
            .iter()
            .any(|e| matches!(e, KvEvent::AllBlocksCleared));
        if cleared && self.target == SyncState::Resynced {
            self.target = SyncState::Synced;
        }
        if let Some((block_size, root)) = stored_facts(&batch.events) {
            // Most batches repeat the block size and store no root block: nothing to tell.
            self.spec.health.send_if_modified(|h| {
                let changed = h.stored_block_size != Some(block_size) || root.is_some();
                h.stored_block_size = Some(block_size);
                if let Some(root) = root {
                    if h.root_samples.len() >= ROOT_SAMPLES {
                        h.root_samples.pop_front();
                    }
                    h.root_samples.push_back(root);
                }
                changed
            });
        }
        let update = Update::Batch {
            seq: msg.seq,
            batch,
        };
        self.send(update, replayed).await
    }

    async fn send(&mut self, update: Update, replayed: bool) -> Flow {
        // The last message of a burst is counted before it can show as applied.
        if self.rx.is_empty() {
            self.flush_seen();
        }
        let mut env = Envelope::new(self.spec.worker, Some(update));
        env.health = Some(self.spec.health.clone());
        env.replayed = replayed;
        if !self.resolving {
            env.sync_after = Some((self.target, self.epoch));
        }
        tokio::select! {
            biased;
            _ = &mut self.stop => Err(Stop),
            r = self.spec.writer.send(env) => r.map_err(|_| Stop),
        }
    }

    fn mark_stale(&mut self) {
        let mut epoch = 0;
        self.health(|h| epoch = h.mark_stale());
        self.epoch = epoch;
    }

    /// The publisher restarted: clear the worker and treat what follows as a new stream.
    async fn reset(&mut self, seq: u64) -> Flow {
        tracing::warn!(worker = ?self.spec.worker, seq, next = ?self.seq.next(),
            "event stream restarted; clearing worker");
        self.health(|h| h.resets += 1);
        self.mark_stale();
        self.seq.reset();
        self.target = SyncState::Connecting;
        self.send(Update::ClearWorker, false).await
    }

    /// Gives up on the messages before `resume_at`: clear the worker and continue from there.
    async fn unrecoverable(&mut self, resume_at: u64) -> Flow {
        tracing::warn!(worker = ?self.spec.worker, missing_from = ?self.seq.next(), resume_at,
            "event gap cannot be replayed; clearing worker");
        self.health(|h| h.unrecoverable_gaps += 1);
        self.mark_stale();
        self.seq.resync_at(resume_at);
        self.target = SyncState::Resynced;
        self.send(Update::ClearWorker, false).await
    }

    /// `trigger` arrived ahead of the expected sequence number (or needs verifying): replay
    /// what is missing, then apply `trigger` unless the replay already delivered it.
    async fn resolve(&mut self, trigger: Incoming, why: Resolve) -> Flow {
        tracing::info!(worker = ?self.spec.worker, seq = trigger.seq, next = ?self.seq.next(),
            ?why, "replaying");
        if why == Resolve::Gap {
            self.health(|h| h.gaps += 1);
        }
        self.mark_stale();
        self.resolving = true;
        let filled = self.fill(trigger.seq).await?;
        if filled {
            self.health(|h| h.replays_succeeded += 1);
        }
        if !self.reached(trigger.seq) {
            self.unrecoverable(trigger.seq).await?;
        }
        self.resolving = false;
        if self.seq.next() == Some(trigger.seq) {
            self.apply(trigger, false).await
        } else {
            // The replay delivered it already; close the gap with a sync-only update.
            self.send_sync().await
        }
    }

    fn reached(&self, seq: u64) -> bool {
        self.seq.next().is_some_and(|next| next >= seq)
    }

    async fn send_sync(&mut self) -> Flow {
        let mut env = Envelope::new(self.spec.worker, None);
        env.health = Some(self.spec.health.clone());
        env.sync_after = Some((self.target, self.epoch));
        tokio::select! {
            biased;
            _ = self.spec.cancel.cancelled() => Err(Stop),
            r = self.spec.writer.send(env) => r.map_err(|_| Stop),
        }
    }

    /// Replays until everything before `until` is accepted; returns whether that happened
    /// without losing anything. Holes and restarts found on the way are handled here.
    async fn fill(&mut self, until: u64) -> Flow<bool> {
        let Some(endpoint) = self.spec.replay.clone() else {
            return Ok(false);
        };
        let mut backoff = Backoff::new(self.spec.plane.backoff.clone(), self.spec.seed ^ until);
        let epoch_before = self.epoch;
        // Attempts that got nothing new; a truncated replay that moved forward is asked again
        // from where it stopped without counting. vLLM's replay ROUTER keeps libzmq's default
        // send limit of 1,000 queued messages and drops replies while its queue to the peer is
        // full: a reply can lose its middle (a hole), its tail with the end marker (a timeout),
        // or only its tail, when the queue drained before the end marker was sent.
        let mut attempt = 0;
        while attempt < self.spec.plane.replay_attempts {
            let from = self.seq.replay_start();
            let next_before = self.seq.next();
            self.health(|h| h.replays_attempted += 1);
            let (items, end) = self.fetch(&endpoint, from).await?;
            let replayed = self.apply_replayed(items).await?;
            if replayed == Replay::Restarted {
                self.reset(until).await?;
                // `until` is the live message that started this gap: keep judging against it.
                self.seq.note_live(until);
                attempt += 1;
                continue;
            }
            if self.reached(until) {
                // Only a fill that needed no clear on the way counts as a success.
                return Ok(self.epoch == epoch_before);
            }
            if replayed == Replay::Holed {
                tracing::debug!(worker = ?self.spec.worker, %endpoint, from,
                    to = self.seq.replay_start(), "replay has a hole after progress; asking again");
                continue;
            }
            let progressed = self.seq.next() > next_before;
            match end {
                FetchEnd::Overflow => {
                    tracing::warn!(worker = ?self.spec.worker, "live buffer full during replay");
                    return Ok(false);
                }
                // Its tail was dropped, with the end marker (a timeout) or without.
                FetchEnd::Complete | FetchEnd::Failed(_) if progressed => {
                    tracing::debug!(worker = ?self.spec.worker, %endpoint, from,
                        to = self.seq.replay_start(), ?end,
                        "replay cut short after progress; asking for the rest");
                    continue;
                }
                FetchEnd::Complete => return Ok(false),
                FetchEnd::Failed(e) => {
                    tracing::warn!(worker = ?self.spec.worker, %endpoint, from, attempt,
                        error = %e, "replay failed");
                }
            }
            attempt += 1;
            self.wait_buffering(&mut backoff).await?;
        }
        Ok(false)
    }

    /// Applies replayed messages in order; says whether the overlap showed a restart or a hole
    /// stopped it after progress.
    async fn apply_replayed(&mut self, items: Vec<Result<SeqMsg, WireError>>) -> Flow<Replay> {
        let mut applied = false;
        for item in items {
            let msg = match item {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(worker = ?self.spec.worker, reason = %e.reason,
                        "skipping unreadable replay message");
                    self.health(|h| h.decode_errors += 1);
                    continue;
                }
            };
            let incoming = Incoming {
                seq: msg.seq,
                payload: Some(msg.payload.clone()),
            };
            match self.seq.classify_replayed(msg.seq, &msg.payload) {
                Replayed::Skip => {}
                Replayed::Apply => {
                    self.apply(incoming, true).await?;
                    applied = true;
                }
                Replayed::Mismatch => return Ok(Replay::Restarted),
                // A hole after progress: the publisher dropped replies past its send limit
                // (libzmq's ROUTER drops while a peer's queue is full); ask again from it.
                Replayed::Hole { .. } if applied => return Ok(Replay::Holed),
                // At the start: the publisher no longer holds what is missing.
                Replayed::Hole { .. } => {
                    self.unrecoverable(msg.seq).await?;
                    self.apply(incoming, true).await?;
                    applied = true;
                }
            }
        }
        Ok(Replay::Applied)
    }

    /// Fetches a replay from `from` while buffering live messages.
    async fn fetch(
        &mut self,
        endpoint: &str,
        from: u64,
    ) -> Flow<(Vec<Result<SeqMsg, WireError>>, FetchEnd)> {
        let plane = self.spec.plane.clone();
        let mut items = Vec::new();
        let end = {
            let fetch = fetch_replay(endpoint, from, &plane, &mut items);
            let fetch = tokio::time::timeout(plane.replay_total_timeout, fetch);
            tokio::pin!(fetch);
            loop {
                tokio::select! {
                    biased;
                    _ = self.spec.cancel.cancelled() => return Err(Stop),
                    r = &mut fetch => break match r {
                        Ok(Ok(())) => FetchEnd::Complete,
                        Ok(Err(e)) => FetchEnd::Failed(e),
                        Err(_) => FetchEnd::Failed(EventsError::Timeout(plane.replay_total_timeout)),
                    },
                    ev = self.rx.recv() => {
                        if self.buffer(ev.ok_or(Stop)?) {
                            break FetchEnd::Overflow;
                        }
                    }
                }
            }
        };
        Ok((items, end))
    }

    /// Sleeps one backoff step while buffering live messages.
    async fn wait_buffering(&mut self, backoff: &mut Backoff) -> Flow {
        let sleep = tokio::time::sleep(backoff.next_delay());
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                biased;
                _ = self.spec.cancel.cancelled() => return Err(Stop),
                _ = &mut sleep => return Ok(()),
                ev = self.rx.recv() => {
                    if self.buffer(ev.ok_or(Stop)?) {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Buffers a live message during a replay; returns true when the buffer is full.
    fn buffer(&mut self, event: ReaderEvent) -> bool {
        if let Some(msg) = self.on_reader_event(event) {
            self.pending.push_back(msg);
        }
        if self.rx.is_empty() {
            self.flush_seen();
        }
        self.pending.len() >= self.spec.plane.replay_buffer_max
    }

    /// Changes the worker's health, after the messages read so far ([`Seen`]).
    fn health(&mut self, f: impl FnOnce(&mut WorkerHealth)) {
        let seen = &mut self.seen;
        self.spec.health.send_modify(|h| {
            seen.apply_to(h);
            f(h);
        });
    }

    /// Publishes the messages read so far, if any.
    fn flush_seen(&mut self) {
        if self.seen.messages > 0 {
            self.health(|_| {});
        }
    }
}

/// One replay exchange: connect, ask from `from`, collect replies until the end marker (or
/// until the reply stalls: see [`EventPlaneConfig::replay_stall_timeout`]).
async fn fetch_replay(
    endpoint: &str,
    from: u64,
    plane: &EventPlaneConfig,
    items: &mut Vec<Result<SeqMsg, WireError>>,
) -> Result<(), EventsError> {
    let mut conn = ReplayConn::connect(endpoint)?;
    tokio::time::timeout(plane.replay_connect_timeout, conn.request(from))
        .await
        .map_err(|_| EventsError::Timeout(plane.replay_connect_timeout))??;
    let mut wait = plane.replay_idle_timeout;
    loop {
        let frames = tokio::time::timeout(wait, conn.recv())
            .await
            .map_err(|_| EventsError::Timeout(wait))??;
        // Once the reply has begun the rest comes back to back, or not at all.
        wait = plane.replay_stall_timeout;
        match wire::parse_replay(&frames) {
            Ok(ReplayFrame::End) => return Ok(()),
            Ok(ReplayFrame::Batch(m)) => items.push(Ok(m)),
            Err(e) => items.push(Err(e)),
        }
    }
}

/// The block size of a batch's last `BlockStored`, and its last root block that can be
/// rehashed without request context (no parent, LoRA or extra keys; KV cache group 0).
/// `None` when the batch stored nothing. Cheap: no hashing here, the reader hashes samples.
fn stored_facts(events: &[KvEvent]) -> Option<(u32, Option<RootBlock>)> {
    let mut block_size = None;
    let mut root = None;
    for e in events {
        if let KvEvent::BlockStored(s) = e {
            block_size = Some(s.block_size);
            root = root_block(s).or(root);
        }
    }
    block_size.map(|bs| (bs, root))
}

fn root_block(s: &BlockStored) -> Option<RootBlock> {
    let bs = usize::try_from(s.block_size).ok()?;
    let plain_keys = s
        .extra_keys
        .as_ref()
        .is_none_or(|k| k.first().is_none_or(Option::is_none));
    if s.parent_block_hash.is_some()
        || s.lora_id.is_some()
        || s.lora_name.is_some()
        || !plain_keys
        || s.group_idx.is_some_and(|g| g != 0)
        || bs == 0
    {
        return None;
    }
    Some(RootBlock {
        hash: s.block_hashes.first()?.block_hash(),
        tokens: s.token_ids.get(..bs)?.to_vec(),
    })
}

#[cfg(test)]
mod tests {
    use kinference_vllm::{BlockHash, ExtraKeyItem, HashValue};

    use super::*;
    use crate::testing::{removed, stored};

    fn events(b: kinference_vllm::KvEventBatch) -> Vec<KvEvent> {
        b.events
    }

    #[test]
    fn a_root_block_is_sampled_with_its_first_block_of_tokens() {
        let mut evs = events(stored(&[7, 8], None));
        if let KvEvent::BlockStored(s) = &mut evs[0] {
            s.token_ids = (0..32).collect();
        }
        let (bs, root) = stored_facts(&evs).unwrap();
        assert_eq!(bs, 16);
        let root = root.unwrap();
        assert_eq!(root.hash, HashValue::Int(7).block_hash());
        assert_eq!(root.tokens, (0..16).collect::<Vec<u32>>());
    }

    #[test]
    fn blocks_that_need_request_context_are_not_sampled() {
        // A child block, a LoRA block and a block with extra keys (cache salt, multimodal)
        // hash with context the event alone does not fully give back.
        let child = events(stored(&[9], Some(7)));
        let mut lora = events(stored(&[10], None));
        let mut salted = events(stored(&[11], None));
        if let KvEvent::BlockStored(s) = &mut lora[0] {
            s.lora_id = Some(1);
        }
        if let KvEvent::BlockStored(s) = &mut salted[0] {
            s.extra_keys = Some(vec![Some(vec![ExtraKeyItem::Str("salt".into())])]);
        }
        for evs in [child, lora, salted] {
            assert_eq!(stored_facts(&evs), Some((16, None)), "{evs:?}");
        }
        assert_eq!(stored_facts(&events(removed(&[7]))), None);
    }

    #[test]
    fn the_last_block_size_and_last_root_of_a_batch_win() {
        let mut evs = events(stored(&[1], None));
        let mut later = events(stored(&[2], None));
        let mut child = events(stored(&[3], Some(2)));
        if let KvEvent::BlockStored(s) = &mut child[0] {
            s.block_size = 32;
            s.token_ids = vec![1; 32];
        }
        evs.append(&mut later);
        evs.append(&mut child);
        let (bs, root) = stored_facts(&evs).unwrap();
        assert_eq!(bs, 32);
        assert_eq!(root.unwrap().hash, BlockHash(2));
    }
}
