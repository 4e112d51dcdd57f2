//! Test support (feature `test-util`): a publisher that behaves like vLLM's
//! `ZmqEventPublisher`, plus batch builders.
//!
//! [`FakePublisher`] sends `[topic, seq (8 bytes BE), payload]` on a publishing socket that
//! binds or connects, keeps the last `buffer_steps` batches, and answers DEALER replay requests
//! `[b"", start_seq]` on a ROUTER with every buffered `seq >= start` and then the end marker, in
//! the 0.34 layout or the 0.11–0.24 one. It uses an XPUB socket (wire-identical to a PUB for the
//! subscriber) so a test can wait until the subscription has arrived instead of sleeping.
//! Both sockets are libzmq's ([`crate::socket`]), as in vLLM (pyzmq).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::error::EventsError;
use crate::socket::{SocketType, ZmqSocket};
use kinference_vllm::events::codec::encode_batch;
use kinference_vllm::events::frames;
use kinference_vllm::{BlockRemoved, BlockStored, HashValue, KvEvent, KvEventBatch};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Which replay reply layout the fake answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayLayout {
    /// `[b"", topic, seq, payload]`, end `[b"", b"", ff×8, b""]` (vLLM 0.34).
    V034,
    /// `[b"", seq, payload]`, end `[b"", ff×8, b""]` (vLLM 0.11–0.24).
    Legacy,
}

/// How the replay server behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayMode {
    Answer(ReplayLayout),
    /// Reads requests and never answers (a hung or overloaded publisher).
    Silent,
    /// Answers with only the first `keep` buffered batches: libzmq's ROUTER dropped the rest
    /// of the reply while its queue to the peer was full. The end marker follows when `end`
    /// (the queue had drained by the time it was sent), else it is lost too.
    TailDropped {
        layout: ReplayLayout,
        keep: usize,
        end: bool,
    },
}

/// One answered replay request: the start asked for and the sequence numbers sent back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayLog {
    pub start: u64,
    pub sent: Vec<u64>,
}

#[derive(Debug)]
struct ReplayState {
    topic: String,
    buffer: VecDeque<(u64, Vec<u8>)>,
    capacity: usize,
    mode: ReplayMode,
    log: Vec<ReplayLog>,
}

/// A vLLM-like KV-event publisher for tests.
pub struct FakePublisher {
    socket: ZmqSocket,
    topic: String,
    next_seq: u64,
    state: Arc<Mutex<ReplayState>>,
    events_endpoint: Option<String>,
    replay_endpoint: String,
    cancel: CancellationToken,
    replay_task: JoinHandle<()>,
}

impl std::fmt::Debug for FakePublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakePublisher")
            .field("topic", &self.topic)
            .field("next_seq", &self.next_seq)
            .field("events_endpoint", &self.events_endpoint)
            .field("replay_endpoint", &self.replay_endpoint)
            .finish()
    }
}

impl FakePublisher {
    /// The publisher binds ephemeral ports on 127.0.0.1 (vLLM endpoint `tcp://*:PORT`).
    pub async fn bind(topic: &str, buffer_steps: usize) -> Result<Self, EventsError> {
        let any = "tcp://127.0.0.1:0";
        Self::bind_at(any, any, topic, buffer_steps).await
    }

    /// The publisher binds the given event and replay endpoints (a restarted engine binds the
    /// same ports again).
    pub async fn bind_at(
        events: &str,
        replay: &str,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<Self, EventsError> {
        let mut socket = ZmqSocket::new(SocketType::XPUB)?;
        let bound = socket.bind(events).await?;
        Self::finish(socket, Some(bound), replay, topic, buffer_steps).await
    }

    /// The publisher connects to a bound subscriber (vLLM endpoint `tcp://HOST:PORT`).
    pub async fn connect(
        endpoint: &str,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<Self, EventsError> {
        let socket = ZmqSocket::new(SocketType::XPUB)?;
        socket.connect(endpoint)?;
        Self::finish(socket, None, "tcp://127.0.0.1:0", topic, buffer_steps).await
    }

    async fn finish(
        socket: ZmqSocket,
        events_endpoint: Option<String>,
        replay_endpoint: &str,
        topic: &str,
        buffer_steps: usize,
    ) -> Result<Self, EventsError> {
        let mut router = ZmqSocket::new(SocketType::ROUTER)?;
        let replay = router.bind(replay_endpoint).await?;
        let state = Arc::new(Mutex::new(ReplayState {
            topic: topic.to_owned(),
            buffer: VecDeque::new(),
            capacity: buffer_steps.max(1),
            mode: ReplayMode::Answer(ReplayLayout::V034),
            log: Vec::new(),
        }));
        let cancel = CancellationToken::new();
        let replay_task = tokio::spawn(serve_replay(router, state.clone(), cancel.clone()));
        Ok(FakePublisher {
            socket,
            topic: topic.to_owned(),
            next_seq: 0,
            state,
            events_endpoint,
            replay_endpoint: replay,
            cancel,
            replay_task,
        })
    }

    /// The bound event endpoint (bind mode), with its real port.
    pub fn events_endpoint(&self) -> Option<&str> {
        self.events_endpoint.as_deref()
    }

    pub fn replay_endpoint(&self) -> &str {
        &self.replay_endpoint
    }

    /// The sequence number the next publish will use.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    pub fn set_replay_mode(&self, mode: ReplayMode) {
        self.state.lock().mode = mode;
    }

    /// Every replay request answered so far.
    pub fn replay_log(&self) -> Vec<ReplayLog> {
        self.state.lock().log.clone()
    }

    /// Waits until a subscriber's subscription message has arrived; after that, published
    /// messages reach it (no slow-joiner loss).
    pub async fn wait_subscribed(&mut self, timeout: Duration) -> Result<(), EventsError> {
        let wait = async {
            loop {
                let msg = self.socket.recv().await?;
                if msg.first().and_then(|f| f.first()) == Some(&1) {
                    return Ok(());
                }
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| EventsError::Timeout(timeout))?
    }

    fn buffer(&mut self, payload: &[u8]) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        let mut state = self.state.lock();
        state.buffer.push_back((seq, payload.to_vec()));
        while state.buffer.len() > state.capacity {
            state.buffer.pop_front();
        }
        seq
    }

    /// Publishes one batch (buffered for replay, then sent live); returns its sequence number.
    pub async fn publish(&mut self, batch: &KvEventBatch) -> Result<u64, EventsError> {
        self.publish_payload(&encode_batch(batch)).await
    }

    /// Publishes an arbitrary payload under the next sequence number.
    pub async fn publish_payload(&mut self, payload: &[u8]) -> Result<u64, EventsError> {
        let seq = self.buffer(payload);
        let frames = frames::live_frames(&self.topic, seq, payload);
        self.socket.send(&frames).await?;
        Ok(seq)
    }

    /// Buffers a batch for replay without sending it live: the live message is lost.
    pub fn publish_dropped(&mut self, batch: &KvEventBatch) -> u64 {
        self.buffer(&encode_batch(batch))
    }

    /// Sends the buffered message `seq` live again, as a copy or a late arrival would come;
    /// returns whether the buffer still held it.
    pub async fn resend(&mut self, seq: u64) -> Result<bool, EventsError> {
        let payload = {
            let state = self.state.lock();
            state
                .buffer
                .iter()
                .find(|(s, _)| *s == seq)
                .map(|(_, p)| p.clone())
        };
        let Some(payload) = payload else {
            return Ok(false);
        };
        let frames = frames::live_frames(&self.topic, seq, &payload);
        self.socket.send(&frames).await?;
        Ok(true)
    }

    /// Sends raw frames; sequence numbers and the replay buffer are untouched.
    pub async fn send_frames(&mut self, frames: Vec<Vec<u8>>) -> Result<(), EventsError> {
        Ok(self.socket.send(&frames).await?)
    }

    /// Takes the next sequence number without publishing (for hand-made frames).
    pub fn take_seq(&mut self) -> u64 {
        self.buffer(b"")
    }

    /// Simulates an engine restart on the same sockets: the sequence starts at 0 again and the
    /// replay buffer is empty.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.state.lock().buffer.clear();
    }

    /// Stops the replay server and closes both sockets; binding their ports again works at
    /// once ([`ZmqSocket::bind`] waits out libzmq's background teardown).
    pub async fn close(self) {
        self.cancel.cancel();
        let _ = self.replay_task.await;
        drop(self.socket);
    }
}

async fn serve_replay(
    mut router: ZmqSocket,
    state: Arc<Mutex<ReplayState>>,
    cancel: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            _ = cancel.cancelled() => return,
            r = router.recv() => r,
        };
        let Ok(frames) = request else { continue };
        let Some((identity, rest)) = frames.split_first() else {
            continue;
        };
        let Ok(start) = frames::parse_replay_request(rest) else {
            continue;
        };
        let replies = {
            let mut state = state.lock();
            let (layout, keep, end) = match state.mode {
                ReplayMode::Answer(layout) => (layout, usize::MAX, true),
                ReplayMode::TailDropped { layout, keep, end } => (layout, keep, end),
                ReplayMode::Silent => continue,
            };
            let items: Vec<(u64, Vec<u8>)> = state
                .buffer
                .iter()
                .filter(|(seq, _)| *seq >= start)
                .take(keep)
                .cloned()
                .collect();
            let sent = items.iter().map(|(s, _)| *s).collect();
            state.log.push(ReplayLog { start, sent });
            let mut replies = reply_frames(&state.topic, layout, items);
            if !end {
                replies.pop();
            }
            replies
        };
        for mut reply in replies {
            reply.insert(0, identity.to_vec());
            if router.send(&reply).await.is_err() {
                break;
            }
        }
    }
}

fn reply_frames(
    topic: &str,
    layout: ReplayLayout,
    items: Vec<(u64, Vec<u8>)>,
) -> Vec<Vec<Vec<u8>>> {
    let end = frames::END_SEQ.to_be_bytes().to_vec();
    let mut out: Vec<Vec<Vec<u8>>> = items
        .into_iter()
        .map(|(seq, payload)| match layout {
            ReplayLayout::V034 => frames::replay_batch_frames(topic, seq, &payload).to_vec(),
            ReplayLayout::Legacy => vec![Vec::new(), seq.to_be_bytes().to_vec(), payload],
        })
        .collect();
    out.push(match layout {
        ReplayLayout::V034 => frames::replay_end_frames().to_vec(),
        ReplayLayout::Legacy => vec![Vec::new(), end, Vec::new()],
    });
    out
}

/// A batch storing `hashes` as one chain under `parent` (GPU, block size 16).
pub fn stored(hashes: &[u64], parent: Option<u64>) -> KvEventBatch {
    let stored = BlockStored {
        block_hashes: hashes.iter().map(|h| HashValue::Int(*h)).collect(),
        parent_block_hash: parent.map(HashValue::Int),
        token_ids: vec![1; hashes.len() * 16],
        block_size: 16,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..BlockStored::default()
    };
    batch(vec![KvEvent::BlockStored(stored)])
}

/// A batch removing `hashes` from GPU, one event per hash as vLLM sends them.
pub fn removed(hashes: &[u64]) -> KvEventBatch {
    let events = hashes
        .iter()
        .map(|h| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![HashValue::Int(*h)],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..BlockRemoved::default()
            })
        })
        .collect();
    batch(events)
}

/// A batch with one `AllBlocksCleared`.
pub fn all_cleared() -> KvEventBatch {
    batch(vec![KvEvent::AllBlocksCleared])
}

fn batch(events: Vec<KvEvent>) -> KvEventBatch {
    KvEventBatch {
        ts: 1_700_000_000.0,
        events,
        data_parallel_rank: Some(0),
    }
}

/// The reference model of one worker's cache: the set of GPU block hashes its events leave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Model {
    pub blocks: std::collections::BTreeSet<u64>,
}

impl Model {
    /// Applies a batch built by [`stored`], [`removed`] or [`all_cleared`].
    pub fn apply(&mut self, batch: &KvEventBatch) {
        for event in &batch.events {
            match event {
                KvEvent::BlockStored(s) => self
                    .blocks
                    .extend(s.block_hashes.iter().map(|h| h.block_hash().0)),
                KvEvent::BlockRemoved(r) => {
                    for h in &r.block_hashes {
                        self.blocks.remove(&h.block_hash().0);
                    }
                }
                KvEvent::AllBlocksCleared => self.blocks.clear(),
            }
        }
    }

    /// Whether `index` holds exactly this model's blocks (GPU tier) for `worker`.
    pub fn matches(
        &self,
        index: &kinference_index::Index,
        worker: kinference_index::WorkerId,
    ) -> bool {
        let gpu = kinference_vllm::Tier::Gpu;
        index.worker_entries(worker) == self.blocks.len()
            && self
                .blocks
                .iter()
                .all(|h| index.holds(worker, kinference_vllm::BlockHash(*h), gpu))
    }
}

/// Plane settings for tests: short timeouts and backoff so failure paths finish quickly.
pub fn fast_config() -> crate::EventPlaneConfig {
    crate::EventPlaneConfig {
        replay_connect_timeout: Duration::from_secs(2),
        replay_idle_timeout: Duration::from_millis(500),
        replay_total_timeout: Duration::from_secs(5),
        backoff: crate::BackoffConfig {
            initial: Duration::from_millis(10),
            max: Duration::from_millis(200),
            jitter: 0.5,
        },
        ..crate::EventPlaneConfig::default()
    }
}
