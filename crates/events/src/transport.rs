//! ZMQ sockets (the pure-Rust `zeromq` crate): the SUB reader task and the replay DEALER.
//!
//! Invariants: the subscription is registered before the socket binds or connects (the crate
//! sends remembered subscriptions to every new peer), and a reader task polls the SUB socket
//! from the moment it exists: the crate only reads TCP while the socket is polled, so an idle
//! SUB would stall its publishers and lose messages at their high-water mark.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{DealerSocket, Socket, SocketEvent, SocketOptions, SocketRecv, SocketSend, SubSocket};

use crate::backoff::{Backoff, BackoffConfig};
use crate::error::EventsError;

/// What the reader task reports to its subscriber, in arrival order.
#[derive(Debug)]
pub(crate) enum ReaderEvent {
    /// One multipart message, frames as received.
    Message(Vec<Bytes>),
    /// A publisher connected (or reconnected).
    PeerUp,
    /// A publisher connection closed.
    PeerDown,
    /// A receive error; the reader backs off and continues.
    Error(String),
}

/// An open SUB socket with its connection monitor.
pub(crate) struct SubStream {
    socket: SubSocket,
    monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    /// The endpoint actually bound (bind mode).
    pub local_endpoint: Option<String>,
}

fn zmq_err(e: zeromq::ZmqError) -> EventsError {
    EventsError::Zmq(e.to_string())
}

/// Opens a SUB socket subscribed to `topic`, bound to or connected to `endpoint`.
pub(crate) async fn open_sub(
    endpoint: &str,
    bind: bool,
    topic: &str,
    connect_timeout: Duration,
) -> Result<SubStream, EventsError> {
    let mut options = SocketOptions::default();
    options.connect_timeout(connect_timeout);
    let mut socket = SubSocket::with_options(options);
    let monitor = socket.monitor();
    socket.subscribe(topic).await.map_err(zmq_err)?;
    let local_endpoint = if bind {
        let bound = socket.bind(endpoint).await.map_err(zmq_err)?;
        Some(bound.to_string())
    } else {
        // The crate retries refused connections until its own timeout; ours bounds it too.
        tokio::time::timeout(connect_timeout, socket.connect(endpoint))
            .await
            .map_err(|_| EventsError::Timeout(connect_timeout))?
            .map_err(zmq_err)?;
        None
    };
    Ok(SubStream {
        socket,
        monitor,
        local_endpoint,
    })
}

/// Reads `stream` until cancelled, forwarding everything to `tx`. Ends when `tx` closes.
pub(crate) async fn run_reader(
    mut stream: SubStream,
    tx: mpsc::Sender<ReaderEvent>,
    backoff: BackoffConfig,
    seed: u64,
    cancel: CancellationToken,
) {
    read_until_cancelled(&mut stream, &tx, backoff, seed, &cancel).await;
    // Unbind before returning, so a removed worker's port is free once its task has ended.
    let close = stream.socket.close();
    if tokio::time::timeout(CLOSE_GRACE, close).await.is_err() {
        tracing::warn!("SUB socket did not close in time");
    }
}

/// How long closing a socket may take before it is just dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

async fn read_until_cancelled(
    stream: &mut SubStream,
    tx: &mpsc::Sender<ReaderEvent>,
    backoff: BackoffConfig,
    seed: u64,
    cancel: &CancellationToken,
) {
    let mut backoff = Backoff::new(backoff, seed);
    let mut monitor_open = true;
    loop {
        let event = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            ev = stream.monitor.next(), if monitor_open => match ev {
                Some(SocketEvent::Connected(..) | SocketEvent::Accepted(..)) => ReaderEvent::PeerUp,
                Some(SocketEvent::Disconnected(..)) => ReaderEvent::PeerDown,
                Some(_) => continue,
                None => {
                    monitor_open = false;
                    continue;
                }
            },
            msg = stream.socket.recv() => match msg {
                Ok(m) => {
                    backoff.reset();
                    ReaderEvent::Message(m.into_vec())
                }
                Err(e) => ReaderEvent::Error(e.to_string()),
            },
        };
        let failed = matches!(event, ReaderEvent::Error(_));
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            sent = tx.send(event) => if sent.is_err() { return },
        }
        if failed {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = backoff.wait() => {}
            }
        }
    }
}

/// A replay client connection (one per replay attempt, so a late reply to an abandoned
/// request can never be mistaken for the next one's).
pub(crate) struct ReplayConn {
    socket: DealerSocket,
}

impl ReplayConn {
    pub async fn connect(endpoint: &str, timeout: Duration) -> Result<Self, EventsError> {
        let mut options = SocketOptions::default();
        options.connect_timeout(timeout);
        let mut socket = DealerSocket::with_options(options);
        tokio::time::timeout(timeout, socket.connect(endpoint))
            .await
            .map_err(|_| EventsError::Timeout(timeout))?
            .map_err(zmq_err)?;
        Ok(ReplayConn { socket })
    }

    /// Sends vLLM's replay request: `[b"", start_seq as 8-byte big-endian]`.
    pub async fn request(&mut self, start_seq: u64) -> Result<(), EventsError> {
        let frames = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&start_seq.to_be_bytes()),
        ];
        let msg =
            zeromq::ZmqMessage::try_from(frames).map_err(|e| EventsError::Zmq(format!("{e:?}")))?;
        self.socket.send(msg).await.map_err(zmq_err)
    }

    /// The next reply message, frames as received (empty delimiter included).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, EventsError> {
        let msg = self.socket.recv().await.map_err(zmq_err)?;
        Ok(msg.into_vec())
    }
}
