//! The KV-event publisher, as vLLM's `ZmqEventPublisher` runs it.
//!
//! A PUB socket sends `[topic, seq (8 bytes BE), msgpack batch]` with `seq` counting from 0;
//! it binds when the endpoint names `*` or `::` (vLLM's rule) and connects otherwise. A
//! ROUTER socket answers `[b"", start_seq]` with every buffered batch from `start_seq` on as
//! `[b"", topic, seq, payload]`, then the end marker `[b"", b"", ff×8, b""]`. The buffer keeps
//! the last `buffer_steps` batches; sequence numbers never repeat.
//!
//! Both sockets are libzmq's (`kinference_events::socket`), as vLLM's are (pyzmq): connecting
//! returns at once and libzmq dials in the background (and again after every loss), so the
//! simulator serves before its router is up; batches published while no subscriber has its
//! subscription in place are dropped, as vLLM's are (replay recovers them).
//!
//! [`faults`] can drop, duplicate and reorder live sends for tests of subscribers
//! (`KvEventsConfig::faults`, off by default); the replay buffer is never affected.

pub mod faults;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kinference_events::socket::{SocketError, SocketType, ZmqSocket};
use kinference_vllm::events::{codec, frames};
use kinference_vllm::KvEventBatch;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::error::ServerError;
pub use faults::EventFaults;
use faults::{Faulty, HOLD_MAX};

/// Where and how events go out (vLLM's `--kv-events-config`).
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventsConfig {
    /// The PUB endpoint, e.g. `tcp://*:5557` (bind) or `tcp://router:5557` (connect).
    pub endpoint: String,
    /// The ROUTER endpoint for replay (always bound), e.g. `tcp://*:5558`.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`, 10,000 by default).
    pub buffer_steps: usize,
    /// Batches queued between the engine and the socket (vLLM's `max_queue_size`, 100,000 by
    /// default); the engine waits while the queue is full.
    pub max_queue_size: usize,
    /// Injected live-send faults (none by default).
    pub faults: EventFaults,
}

impl KvEventsConfig {
    pub fn new(endpoint: &str) -> Self {
        KvEventsConfig {
            endpoint: endpoint.to_owned(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            max_queue_size: 100_000,
            faults: EventFaults::default(),
        }
    }

    /// This config for DP rank offset `by` (vLLM's `offset_endpoint_port`), both endpoints.
    pub fn offset(&self, by: u16) -> Result<KvEventsConfig, ServerError> {
        let mut c = self.clone();
        c.endpoint = offset_endpoint(&self.endpoint, by)?;
        c.replay_endpoint = self
            .replay_endpoint
            .as_deref()
            .map(|r| offset_endpoint(r, by))
            .transpose()?;
        Ok(c)
    }
}

/// vLLM's `offset_endpoint_port` for tcp endpoints: the port plus `by` (rank r of a replica
/// whose base port is P uses P + r). Offset 0 keeps the endpoint as given. Port 0 stays 0, so
/// every rank binds its own ephemeral port (a simulator extension: vLLM has no base to add to
/// and refuses it). Other transports cannot be offset (and only tcp is built in here).
pub fn offset_endpoint(endpoint: &str, by: u16) -> Result<String, ServerError> {
    if by == 0 {
        return Ok(endpoint.to_owned());
    }
    let bad = |reason: &str| ServerError::Endpoint {
        endpoint: endpoint.to_owned(),
        reason: reason.to_owned(),
    };
    if !endpoint.starts_with("tcp://") {
        return Err(bad("only tcp endpoints can be offset per rank or replica"));
    }
    let (base, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| bad("no port to offset"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    if port == 0 {
        return Ok(endpoint.to_owned());
    }
    let port = port
        .checked_add(by)
        .ok_or_else(|| bad("the offset port is past 65535"))?;
    Ok(format!("{base}:{port}"))
}

/// The TCP port of an endpoint, if it names one.
pub fn endpoint_port(endpoint: &str) -> Option<u16> {
    endpoint.rsplit_once(':')?.1.parse().ok()
}

/// vLLM's rule: the PUB binds if the endpoint contains `*` or `::`, or is ipc/inproc.
pub fn publisher_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// vLLM's PUB high-water mark (`hwm`, 100,000 by default).
const HWM: i32 = 100_000;

/// The endpoints actually in use (bound ports resolved).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PublisherEndpoints {
    /// The bound PUB endpoint; `None` when the PUB connects.
    pub events: Option<String>,
    pub replay: Option<String>,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

fn lock(buf: &Buffer) -> MutexGuard<'_, VecDeque<(u64, Bytes)>> {
    // The buffer holds plain data; a panic elsewhere cannot leave it inconsistent.
    buf.lock().unwrap_or_else(|e| e.into_inner())
}

fn zmq_err(e: SocketError) -> ServerError {
    ServerError::Zmq(e.to_string())
}

/// A started publisher.
#[derive(Debug)]
pub struct Publisher {
    /// Batches sent here go out in order.
    pub batches: mpsc::Sender<KvEventBatch>,
    pub endpoints: PublisherEndpoints,
    /// Batches published so far (buffered for replay and sent on the PUB socket).
    pub published: watch::Receiver<u64>,
    pub tasks: Vec<JoinHandle<()>>,
}

/// Opens the sockets and spawns the publishing and replay tasks.
pub async fn start(cfg: &KvEventsConfig) -> Result<Publisher, ServerError> {
    let mut socket = ZmqSocket::new(SocketType::PUB).map_err(zmq_err)?;
    socket.set_hwm(HWM).map_err(zmq_err)?;
    let events = if publisher_binds(&cfg.endpoint) {
        Some(socket.bind(&cfg.endpoint).await.map_err(zmq_err)?)
    } else {
        socket.connect(&cfg.endpoint).map_err(zmq_err)?;
        None
    };
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let mut tasks = Vec::new();
    let mut replay = None;
    if let Some(rep) = &cfg.replay_endpoint {
        let mut router = ZmqSocket::new(SocketType::ROUTER).map_err(zmq_err)?;
        replay = Some(router.bind(rep).await.map_err(zmq_err)?);
        tasks.push(tokio::spawn(serve_replay(
            router,
            Arc::clone(&buffer),
            cfg.topic.clone(),
        )));
    }
    let (tx, rx) = mpsc::channel(cfg.max_queue_size.max(1));
    let (published_tx, published) = watch::channel(0);
    tasks.push(tokio::spawn(publish(
        socket,
        rx,
        buffer,
        (cfg.topic.clone(), cfg.buffer_steps.max(1)),
        Faulty::new(cfg.faults),
        published_tx,
    )));
    Ok(Publisher {
        batches: tx,
        endpoints: PublisherEndpoints { events, replay },
        published,
        tasks,
    })
}

async fn publish(
    mut socket: ZmqSocket,
    mut rx: mpsc::Receiver<KvEventBatch>,
    buffer: Buffer,
    (topic, capacity): (String, usize),
    mut faults: Faulty<(u64, Bytes)>,
    published: watch::Sender<u64>,
) {
    let mut seq: u64 = 0;
    loop {
        let holding = faults.holding();
        let batch = tokio::select! {
            b = rx.recv() => match b {
                Some(b) => b,
                None => return,
            },
            // Between batches, let libzmq take in new subscribers and their subscriptions,
            // so the next batch reaches them.
            r = socket.process_commands() => {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "kv event socket poll failed");
                }
                continue;
            }
            // A reordered batch whose successor does not come goes out alone.
            () = tokio::time::sleep(HOLD_MAX), if holding => {
                if let Some((s, payload)) = faults.release() {
                    send_live(&mut socket, &topic, s, &payload).await;
                }
                continue;
            }
        };
        let payload = Bytes::from(codec::encode_batch(&batch));
        {
            let mut buf = lock(&buffer);
            while buf.len() >= capacity {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        for (s, p) in faults.on_batch((seq, payload)) {
            send_live(&mut socket, &topic, s, &p).await;
        }
        seq += 1;
        published.send_replace(seq);
    }
}

async fn send_live(socket: &mut ZmqSocket, topic: &str, seq: u64, payload: &[u8]) {
    let [t, s, _] = frames::live_frames(topic, seq, &[]);
    let msg: [&[u8]; 3] = [&t, &s, payload];
    if let Err(e) = socket.send(&msg).await {
        tracing::warn!(error = %e, seq, "kv event publish failed");
    }
}

async fn serve_replay(mut router: ZmqSocket, buffer: Buffer, topic: String) {
    loop {
        let frames_in = match router.recv().await {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(error = %e, "replay socket failed");
                return;
            }
        };
        let Some((identity, rest)) = frames_in.split_first() else {
            continue;
        };
        let Ok(start) = frames::parse_replay_request(rest) else {
            continue;
        };
        let items: Vec<(u64, Bytes)> = lock(&buffer)
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        for (s, payload) in items {
            let [d, t, sq, _] = frames::replay_batch_frames(&topic, s, &[]);
            let msg: [&[u8]; 5] = [identity, &d, &t, &sq, &payload];
            if router.send(&msg).await.is_err() {
                break;
            }
        }
        let end = frames::replay_end_frames();
        let msg: [&[u8]; 5] = [identity, &end[0], &end[1], &end[2], &end[3]];
        if let Err(e) = router.send(&msg).await {
            tracing::debug!(error = %e, "replay reply not sent");
        }
    }
}
