//! The KV-event publisher, as vLLM's `ZmqEventPublisher` runs it.
//!
//! A PUB socket sends `[topic, seq (8 bytes BE), msgpack batch]` with `seq` counting from 0;
//! it binds when the endpoint names `*` or `::` (vLLM's rule) and connects otherwise. A
//! ROUTER socket answers `[b"", start_seq]` with every buffered batch from `start_seq` on as
//! `[b"", topic, seq, payload]`, then the end marker `[b"", b"", ff×8, b""]`. The buffer keeps
//! the last `buffer_steps` batches; sequence numbers never repeat.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use kinference_vllm::events::{codec, frames};
use kinference_vllm::KvEventBatch;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::ServerError;

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
}

impl KvEventsConfig {
    pub fn new(endpoint: &str) -> Self {
        KvEventsConfig {
            endpoint: endpoint.to_owned(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
        }
    }
}

/// vLLM's rule: the PUB binds if the endpoint contains `*` or `::`, or is ipc/inproc.
pub fn publisher_binds(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The wildcard host as the socket library spells it (`*` → `0.0.0.0`).
fn bindable(endpoint: &str) -> String {
    endpoint.replacen("://*:", "://0.0.0.0:", 1)
}

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

fn zmq_err(e: zeromq::ZmqError) -> ServerError {
    ServerError::Zmq(e.to_string())
}

fn message(frames: Vec<Bytes>) -> Option<ZmqMessage> {
    ZmqMessage::try_from(frames).ok()
}

/// Opens the sockets and spawns the publishing and replay tasks; batches sent on the returned
/// channel go out in order.
pub async fn start(
    cfg: &KvEventsConfig,
) -> Result<
    (
        mpsc::UnboundedSender<KvEventBatch>,
        PublisherEndpoints,
        Vec<JoinHandle<()>>,
    ),
    ServerError,
> {
    let mut socket = PubSocket::new();
    let events = if publisher_binds(&cfg.endpoint) {
        let ep = socket
            .bind(&bindable(&cfg.endpoint))
            .await
            .map_err(zmq_err)?;
        Some(ep.to_string())
    } else {
        socket.connect(&cfg.endpoint).await.map_err(zmq_err)?;
        None
    };
    let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
    let mut tasks = Vec::new();
    let mut replay = None;
    if let Some(rep) = &cfg.replay_endpoint {
        let mut router = RouterSocket::new();
        let ep = router.bind(&bindable(rep)).await.map_err(zmq_err)?;
        replay = Some(ep.to_string());
        tasks.push(tokio::spawn(serve_replay(
            router,
            Arc::clone(&buffer),
            cfg.topic.clone(),
        )));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    tasks.push(tokio::spawn(publish(
        socket,
        rx,
        buffer,
        cfg.topic.clone(),
        cfg.buffer_steps.max(1),
    )));
    Ok((tx, PublisherEndpoints { events, replay }, tasks))
}

async fn publish(
    mut socket: PubSocket,
    mut rx: mpsc::UnboundedReceiver<KvEventBatch>,
    buffer: Buffer,
    topic: String,
    capacity: usize,
) {
    let mut seq: u64 = 0;
    while let Some(batch) = rx.recv().await {
        let payload = Bytes::from(codec::encode_batch(&batch));
        {
            let mut buf = lock(&buffer);
            while buf.len() >= capacity {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        let [t, s, _] = frames::live_frames(&topic, seq, &[]);
        if let Some(msg) = message(vec![Bytes::from(t), Bytes::from(s), payload]) {
            if let Err(e) = socket.send(msg).await {
                tracing::warn!(error = %e, seq, "kv event publish failed");
            }
        }
        seq += 1;
    }
    let _ = socket.close().await;
}

async fn serve_replay(mut router: RouterSocket, buffer: Buffer, topic: String) {
    loop {
        // A receive error means the socket is closed: nothing more will arrive.
        let Ok(request) = router.recv().await else {
            return;
        };
        let frames_in = request.into_vec();
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
        let mut replies: Vec<Vec<Bytes>> = items
            .into_iter()
            .map(|(s, payload)| {
                let [d, t, sq, _] = frames::replay_batch_frames(&topic, s, &[]);
                vec![Bytes::from(d), Bytes::from(t), Bytes::from(sq), payload]
            })
            .collect();
        replies.push(
            frames::replay_end_frames()
                .into_iter()
                .map(Bytes::from)
                .collect(),
        );
        for mut reply in replies {
            reply.insert(0, identity.clone());
            let Some(msg) = message(reply) else { continue };
            if router.send(msg).await.is_err() {
                break;
            }
        }
    }
}
