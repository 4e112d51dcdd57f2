//! The SUB reader task and the replay DEALER, on [`crate::socket`] (libzmq).
//!
//! Invariants: the subscription and the connection monitor are set up before the socket binds
//! or connects, so no message or peer event is missed; connecting never waits for the peer
//! (libzmq dials in the background and redials after losses), and the reader task drains the
//! socket from the moment it exists.

use bytes::Bytes;
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, BackoffConfig};
use crate::error::EventsError;
use crate::socket::{Monitor, Pace, PeerEvent, SocketError, SocketType, ZmqSocket};

/// What the reader task reports to its subscriber, in arrival order.
#[derive(Debug)]
pub(crate) enum ReaderEvent {
    /// One multipart message, frames as received.
    Message(Vec<Bytes>),
    /// A publisher connected (or reconnected).
    PeerUp,
    /// A publisher connection closed.
    PeerDown,
    /// A dial found nobody listening; libzmq dials again by itself.
    DialFailed,
    /// A receive error; the reader backs off and continues.
    Error(String),
}

/// An open SUB socket with its connection monitor.
pub(crate) struct SubStream {
    /// Declared before `monitor`, so dropped first: it stops the monitor while the monitor's
    /// peer is still open ([`crate::socket`]'s invariants).
    pub socket: ZmqSocket,
    pub monitor: Monitor,
    /// The endpoint actually bound (bind mode).
    pub local_endpoint: Option<String>,
}

/// Opens a SUB socket subscribed to `topic`, bound to or connected to `endpoint`. Connecting
/// returns at once; the publisher may come up later.
pub(crate) async fn open_sub(
    endpoint: &str,
    bind: bool,
    topic: &str,
    redial: &BackoffConfig,
) -> Result<SubStream, EventsError> {
    let mut socket = ZmqSocket::sub(topic)?;
    socket.set_reconnect(redial.initial, redial.max)?;
    let monitor = socket.monitor()?;
    let local_endpoint = if bind {
        Some(socket.bind(endpoint).await?)
    } else {
        socket.connect(endpoint)?;
        None
    };
    Ok(SubStream {
        socket,
        monitor,
        local_endpoint,
    })
}

/// The monitor's events as a stream that keeps its pending receive between polls. A reader
/// that called [`Monitor::next`] afresh on every turn of its loop would ask libzmq each time,
/// and a receive that finds nothing costs a `poll` system call on the monitor's signal fd: one
/// per message with many quiet sockets. The kept receive only runs when that fd fires.
pub(crate) fn peer_events(
    monitor: &mut Monitor,
) -> impl Stream<Item = Result<PeerEvent, SocketError>> + '_ {
    futures::stream::unfold(monitor, |m| async move {
        let event = m.next().await;
        Some((event, m))
    })
}

/// Reads `stream` until cancelled, forwarding everything to `tx`. Ends when `tx` closes.
pub(crate) async fn run_reader(
    mut stream: SubStream,
    tx: mpsc::Sender<ReaderEvent>,
    backoff: BackoffConfig,
    pace: Pace,
    seed: u64,
    cancel: CancellationToken,
) {
    read_until_cancelled(&mut stream, &tx, backoff, pace, seed, &cancel).await;
}

async fn read_until_cancelled(
    stream: &mut SubStream,
    tx: &mpsc::Sender<ReaderEvent>,
    backoff: BackoffConfig,
    mut pace: Pace,
    seed: u64,
    cancel: &CancellationToken,
) {
    let mut backoff = Backoff::new(backoff, seed);
    let mut monitor_open = true;
    let peers = peer_events(&mut stream.monitor);
    tokio::pin!(peers);
    // One registration with the token for the task's life: a fresh `cancelled()` in each
    // select registers and unregisters under the token's lock, twice per message.
    let cancelled = cancel.cancelled();
    tokio::pin!(cancelled);
    loop {
        let event = tokio::select! {
            biased;
            _ = &mut cancelled => return,
            ev = peers.next(), if monitor_open => match ev {
                Some(Ok(PeerEvent::Up)) => ReaderEvent::PeerUp,
                Some(Ok(PeerEvent::Down)) => ReaderEvent::PeerDown,
                Some(Ok(PeerEvent::Retry)) => ReaderEvent::DialFailed,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "connection monitor failed");
                    monitor_open = false;
                    continue;
                }
                None => {
                    monitor_open = false;
                    continue;
                }
            },
            msg = stream.socket.recv_paced(&mut pace) => match msg {
                Ok(m) => {
                    backoff.reset();
                    ReaderEvent::Message(m.into_iter().map(Bytes::from).collect())
                }
                Err(e) => ReaderEvent::Error(e.to_string()),
            },
        };
        let failed = matches!(event, ReaderEvent::Error(_));
        tokio::select! {
            biased;
            _ = &mut cancelled => return,
            sent = tx.send(event) => if sent.is_err() { return },
        }
        if failed {
            tokio::select! {
                _ = &mut cancelled => return,
                _ = backoff.wait() => {}
            }
        }
    }
}

/// A replay client connection (one per replay attempt, so a late reply to an abandoned
/// request can never be mistaken for the next one's).
pub(crate) struct ReplayConn {
    socket: ZmqSocket,
}

impl ReplayConn {
    /// Dials the replay ROUTER (in the background; the request waits for the connection).
    pub fn connect(endpoint: &str) -> Result<Self, EventsError> {
        let socket = ZmqSocket::new(SocketType::DEALER)?;
        socket.connect(endpoint)?;
        Ok(ReplayConn { socket })
    }

    /// Sends vLLM's replay request: `[b"", start_seq as 8-byte big-endian]`.
    pub async fn request(&mut self, start_seq: u64) -> Result<(), EventsError> {
        let frames: [&[u8]; 2] = [b"", &start_seq.to_be_bytes()];
        Ok(self.socket.send(&frames).await?)
    }

    /// The next reply message, frames as received (empty delimiter included).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, EventsError> {
        let msg = self.socket.recv().await?;
        Ok(msg.into_iter().map(Bytes::from).collect())
    }
}
