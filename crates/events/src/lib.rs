//! Live KV-event subscription per replica (edge crate: sockets and tokio live here).
//!
//! Keeps a [`kinference_index::Index`] in step with every vLLM replica's ZMQ KV-event stream:
//! one subscriber per (replica, DP rank), sequence tracking, replay on gaps, resync on engine
//! restarts, and a health snapshot per worker that readers get without taking a lock.
//!
//! # Architecture
//!
//! ```text
//!  vLLM PUB (rank r) ──ZMQ──▶ reader task ──mpsc──▶ subscriber task ──┐
//!  vLLM ROUTER (replay) ◀─DEALER─(on a gap)────────┘  (sequencer)     │ bounded mpsc
//!                                                                     │ (WorkerId, Update)
//!  vLLM PUB (rank r') ──ZMQ──▶ reader task ──mpsc──▶ subscriber task ──┤
//!                                                                     ▼
//!                                                    index-writer task (the single writer)
//!                                                       │ write lock, a batch of updates
//!                                                       ▼
//!  router ── read lock, longest_prefix ──────▶ Arc<RwLock<Index>>
//!  router ── borrow, no lock ────────────────▶ watch<WorkerHealth> per worker
//! ```
//!
//! - The **reader task** owns the SUB socket (libzmq, see [`socket`]; for a publisher dialled
//!   over TCP, a ZMTP connection of its own, see `dialer`) and drains it from the moment it is
//!   bound or connected, forwarding raw messages and connection events. While
//!   messages come faster than [`EventPlaneConfig::read_pacing`] it wakes once per that
//!   interval and reads all that came ([`socket::Pace`]), not once per message.
//! - The **subscriber task** parses frames, tracks the sequence number, fetches replays over a
//!   DEALER socket while buffering live messages, and sends [`Update`]s to the writer. What it
//!   sends for one worker is in stream order and the channel is FIFO, so the index applies each
//!   worker's events in order, each at most once.
//! - The **index-writer task** is the only code that takes the index's write lock. It drains up
//!   to [`EventPlaneConfig::writer_batch_max`] updates per lock hold and then publishes the
//!   index-derived health fields (entries held, applied sequence, sync state). A full channel
//!   makes subscribers wait (backpressure) instead of growing memory; if that makes the
//!   publisher drop messages at its high-water mark, the loss shows as a gap and is replayed.
//!
//! # Sequence handling, per (replica, DP rank)
//!
//! - **In order** (`seq == next`): applied. A first message with seq 0 starts a `Synced` stream.
//! - **Gap** (`seq > next`, or a first message above 0): the worker turns `Stale`; a replay is
//!   requested from the *last applied* number (one early: its content must match what was
//!   applied, which proves the same publisher instance answered) or from 0 when nothing was
//!   applied. Replayed batches already applied are skipped, the rest applied in order; live
//!   messages arriving meanwhile are buffered and handled afterwards. Both reply layouts (0.34
//!   `[topic, seq, payload]`, 0.11–0.24 `[seq, payload]`) and their end markers are accepted.
//!   vLLM's ROUTER drops replies past its send limit, so a reply can come back with a hole, a
//!   lost tail or a lost end marker (a reply that pauses for
//!   [`EventPlaneConfig::replay_stall_timeout`] after it began is taken as cut short): a round
//!   that moved the stream forward without reaching the batch that revealed the gap is asked
//!   again from where it stopped, and only rounds that bring nothing new count against
//!   [`EventPlaneConfig::replay_attempts`].
//! - **Unrecoverable gap** (no replay endpoint, timeouts after
//!   [`EventPlaneConfig::replay_attempts`], or the publisher's buffer no longer holds the start
//!   of the gap): counted, the worker is cleared, and the stream continues from the oldest
//!   message still available; the worker is then `Resynced`.
//! - **Repeat** (a live number at or below the previous live number and below `next`): a copy
//!   or a late arrival, or a restarted engine; only the publisher can tell. A replay from the
//!   last applied number is fetched: when it holds that message with the same content, the
//!   publisher is the same instance and the message is skipped (counted in `repeats`, nothing
//!   cleared); when the replay fails or does not hold it, or there is no replay endpoint, it is
//!   a reset.
//! - **Reset** (a live number at or below the previous live number that is not a proven
//!   repeat, or replay content that differs from what was applied: the engine restarted):
//!   counted, the worker is cleared, and the new stream is rebuilt from 0 (by replay when its
//!   first messages were missed). After a reconnection the first in-order message is verified
//!   through the replay overlap too, since a restarted engine can happen to continue at exactly
//!   the expected number.
//! - **Unreadable messages** (wrong frame count, bad sequence frame, other topic, payload that
//!   does not decode): counted in `decode_errors`, logged and skipped; when the sequence frame
//!   is readable the sequence still advances, so no false gap follows.
//! - Socket connect failures and failed replays are retried with capped, jittered exponential
//!   backoff; every network wait has a timeout, and every task ends on the plane's
//!   cancellation token.
//!
//! # Sync states (what "stale" means)
//!
//! See [`SyncState`]. `Stale`: the index may hold wrong entries for the worker (a gap is being
//! filled, or a clear is not applied yet). `Resynced`: the worker was cleared and everything
//! since has been applied in order, so every entry held is true but blocks cached before the
//! clear are missing (false negatives only); this is consistent, not stale. `Synced`: every
//! event since a point where the engine's cache was known empty (seq 0 of a publisher, or an
//! `AllBlocksCleared`) has been applied, so the view is exact. Sync changes are published by the
//! writer when the update that causes them is applied.
//!
//! # Public API
//!
//! ```text
//! EventPlane::start(EventPlaneConfig) -> Result<EventPlane, EventsError>  (in a tokio runtime)
//! EventPlane::add_worker(&self, WorkerConfig).await -> Result<WorkerId, EventsError>
//! EventPlane::add_replica(&self, ReplicaConfig).await -> Result<Vec<WorkerId>, EventsError>
//! EventPlane::remove_worker(&self, WorkerId).await -> Result<bool, EventsError>
//! EventPlane::remove_replica(&self, ReplicaId).await -> Result<usize, EventsError>
//! EventPlane::submit(&self, WorkerId, Update).await -> Result<(), EventsError>
//! EventPlane::index(&self) -> IndexHandle            // Arc<parking_lot::RwLock<Index>>
//! EventPlane::health(&self, WorkerId) -> Option<WorkerHealth>
//! EventPlane::watch_health(&self, WorkerId) -> Option<watch::Receiver<WorkerHealth>>
//! EventPlane::workers(&self) -> Vec<WorkerId>
//! EventPlane::wait_for(&self, WorkerId, Duration, pred).await -> Result<WorkerHealth, EventsError>
//! EventPlane::pause_writer(&self).await -> WriterPause   // writer applies nothing while held
//! EventPlane::shutdown(self).await
//!
//! WorkerConfig::bind(replica, rank, "tcp://127.0.0.1:5557")      // vLLM's PUB connects to us
//! WorkerConfig::connect(replica, rank, "tcp://10.0.0.5:5557")    // vLLM's PUB binds; we dial
//! WorkerConfig::auto(replica, rank, address, "tcp://*:5557")     // vLLM's rule decides
//!     .with_replay("tcp://10.0.0.5:5558")                        // replay ROUTER to dial
//!     .with_topic("kv-events")                                   // default ""
//! ```
//!
//! Example (vLLM started with `"endpoint": "tcp://127.0.0.1:5557"`, so its PUB connects):
//!
//! ```no_run
//! # async fn demo() -> Result<(), kinference_events::EventsError> {
//! use std::time::Duration;
//! use kinference_events::{DpRank, EventPlane, EventPlaneConfig, ReplicaId, WorkerConfig};
//!
//! let plane = EventPlane::start(EventPlaneConfig::default())?;
//! let worker = plane
//!     .add_worker(
//!         WorkerConfig::bind(ReplicaId(0), DpRank(0), "tcp://127.0.0.1:5557")
//!             .with_replay("tcp://127.0.0.1:5558")
//!             .with_topic("kv-events"),
//!     )
//!     .await?;
//! let health = plane
//!     .wait_for(worker, Duration::from_secs(20), |h| h.applied_seq.is_some() && !h.stale)
//!     .await?;
//! let held = plane.index().read().worker_entries(worker);
//! assert_eq!(held, health.entries);
//! plane.shutdown().await;
//! # Ok(())
//! # }
//! ```
//!
//! Endpoints in a [`WorkerConfig`] are the *base* endpoints configured for the whole replica
//! (`--kv-events-config`); the worker's DP rank offsets them exactly as vLLM does (tcp: port
//! base + rank). Only `tcp://` endpoints are accepted. Binding port 0 is allowed for rank 0;
//! the real endpoint is then in [`WorkerHealth::local_endpoint`].
//!
//! The [`socket`] module is the workspace's one ZMQ layer (libzmq under tokio); the simulator's
//! publisher and the interop tests use it too.
//!
//! Feature `test-util` adds the `testing` module: a vLLM-like publisher (PUB + replay ROUTER) and batch
//! builders.

mod backoff;
mod config;
mod dialer;
mod error;
mod health;
mod plane;
mod sequencer;
mod shared;
pub mod socket;
mod subscriber;
#[cfg(feature = "test-util")]
pub mod testing;
mod transport;
mod wire;
mod writer;

pub use backoff::{Backoff, BackoffConfig};
pub use config::{
    is_wildcard_host, offset_endpoint, publisher_binds, resolve_endpoint, resolve_replay,
    EndpointError, EventPlaneConfig, ReplicaConfig, ResolvedEndpoint, SocketMode, WorkerConfig,
};
pub use error::EventsError;
pub use health::{RootBlock, SyncState, WorkerHealth, ROOT_SAMPLES};
pub use plane::{EventPlane, IndexHandle, WriterPause};
pub use shared::BoundEndpoint;
pub use writer::Update;

pub use kinference_index::{Index, ReplicaId, WorkerId};
pub use kinference_vllm::DpRank;
pub use tokio::sync::watch;
