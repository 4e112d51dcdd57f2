//! A bound SUB socket and the workers it feeds, told apart by topic: many replicas whose
//! publishers connect to one router endpoint (vLLM `endpoint: tcp://router:5557`, each with its
//! own `topic`, as llm-d's `kv@<pod-ip>@<model>`).
//!
//! Invariants:
//! - One socket per bound endpoint; each route is an exact topic (frame 0) and at most one
//!   worker owns a topic. The empty topic (take everything) is only allowed for a route that
//!   is alone on its endpoint.
//! - A message whose topic no route owns is counted and reported ([`BoundEndpoint`]), never
//!   handed to some other worker.
//! - Connection up/down events cannot be attributed to one publisher once several share the
//!   socket; they go to the route only while it is alone. Shared routes rely on sequence
//!   numbers (a restart shows as a number going back, a loss as a gap) as every route does.
//! - The socket closes when its last route is removed, so the port can be bound again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::backoff::BackoffConfig;
use crate::error::EventsError;
use crate::socket::{Pace, PeerEvent};
use crate::transport::{self, ReaderEvent, SubStream};

/// Distinct unknown topics remembered per endpoint (each with its count); more are only
/// counted in the total, so a misconfigured fleet cannot grow memory without bound.
const UNKNOWN_TOPICS_KEPT: usize = 64;

/// What a bound endpoint has seen, for metrics and the admin API.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BoundEndpoint {
    /// The endpoint as configured (after the DP-rank offset).
    pub endpoint: String,
    /// The endpoint actually bound (real port).
    pub local_endpoint: String,
    /// The topics routed to workers, sorted.
    pub topics: Vec<String>,
    /// Messages whose topic no worker owns (dropped).
    pub unknown_messages: u64,
    /// Up to 64 of those topics with their message counts.
    pub unknown_topics: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct Routes {
    by_topic: HashMap<Bytes, mpsc::Sender<ReaderEvent>>,
    unknown_messages: u64,
    unknown_topics: BTreeMap<String, u64>,
}

impl Routes {
    /// The route for a message with frame 0 `topic`, if any.
    fn route(&self, topic: &[u8]) -> Option<mpsc::Sender<ReaderEvent>> {
        if let Some(tx) = self.by_topic.get(topic) {
            return Some(tx.clone());
        }
        // The empty topic takes everything, and is only ever alone.
        self.by_topic.get(&b""[..]).cloned()
    }

    fn count_unknown(&mut self, topic: &[u8]) -> bool {
        self.unknown_messages += 1;
        let name = String::from_utf8_lossy(topic).into_owned();
        let kept = self.unknown_topics.len();
        match self.unknown_topics.get_mut(&name) {
            Some(n) => {
                *n += 1;
                false
            }
            None if kept < UNKNOWN_TOPICS_KEPT => {
                self.unknown_topics.insert(name, 1);
                true
            }
            None => false,
        }
    }
}

/// One bound SUB socket and its routes.
#[derive(Debug)]
pub(crate) struct SharedSub {
    endpoint: String,
    local_endpoint: String,
    routes: Arc<Mutex<Routes>>,
    cancel: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl SharedSub {
    /// Binds `endpoint` (subscribed to every topic) and starts its reader.
    pub async fn open(
        endpoint: &str,
        redial: &BackoffConfig,
        pace: Pace,
        cancel: CancellationToken,
    ) -> Result<SharedSub, EventsError> {
        let stream = transport::open_sub(endpoint, true, "", redial).await?;
        let local_endpoint = stream
            .local_endpoint
            .clone()
            .unwrap_or_else(|| endpoint.to_owned());
        let routes = Arc::new(Mutex::new(Routes::default()));
        let task = tokio::spawn(dispatch(
            stream,
            routes.clone(),
            local_endpoint.clone(),
            pace,
            cancel.clone(),
        ));
        Ok(SharedSub {
            endpoint: endpoint.to_owned(),
            local_endpoint,
            routes,
            cancel,
            task: Mutex::new(Some(task)),
        })
    }

    pub fn local_endpoint(&self) -> &str {
        &self.local_endpoint
    }

    /// Routes messages of `topic` to `tx`.
    pub fn add_route(&self, topic: &str, tx: mpsc::Sender<ReaderEvent>) -> Result<(), EventsError> {
        let mut routes = self.routes.lock();
        let conflict = if routes.by_topic.contains_key(topic.as_bytes()) {
            Some("is already routed to another worker")
        } else if !routes.by_topic.is_empty()
            && (topic.is_empty() || routes.by_topic.contains_key(&b""[..]))
        {
            Some("is ambiguous: replicas sharing a bound endpoint need distinct, non-empty topics")
        } else {
            None
        };
        if let Some(why) = conflict {
            return Err(EventsError::Config(format!(
                "topic {topic:?} at {} {why}",
                self.endpoint
            )));
        }
        routes
            .by_topic
            .insert(Bytes::copy_from_slice(topic.as_bytes()), tx);
        Ok(())
    }

    /// Removes the route of `topic`; returns how many routes are left.
    pub fn remove_route(&self, topic: &str) -> usize {
        let mut routes = self.routes.lock();
        routes.by_topic.remove(topic.as_bytes());
        routes.by_topic.len()
    }

    pub fn stats(&self) -> BoundEndpoint {
        let routes = self.routes.lock();
        let mut topics: Vec<String> = routes
            .by_topic
            .keys()
            .map(|t| String::from_utf8_lossy(t).into_owned())
            .collect();
        topics.sort();
        BoundEndpoint {
            endpoint: self.endpoint.clone(),
            local_endpoint: self.local_endpoint.clone(),
            topics,
            unknown_messages: routes.unknown_messages,
            unknown_topics: routes.unknown_topics.clone(),
        }
    }

    /// Stops the reader and closes the socket.
    pub async fn close(&self) {
        self.cancel.cancel();
        let task = self.task.lock().take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }
}

/// Reads the socket until cancelled, handing each message to the route of its topic.
async fn dispatch(
    mut stream: SubStream,
    routes: Arc<Mutex<Routes>>,
    endpoint: String,
    mut pace: Pace,
    cancel: CancellationToken,
) {
    let mut monitor_open = true;
    let peers = transport::peer_events(&mut stream.monitor);
    tokio::pin!(peers);
    loop {
        let (route, event) = tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            ev = peers.next(), if monitor_open => {
                let event = match ev {
                    Some(Ok(PeerEvent::Up)) => ReaderEvent::PeerUp,
                    Some(Ok(PeerEvent::Down)) => ReaderEvent::PeerDown,
                    Some(Ok(PeerEvent::Retry)) => continue,
                    Some(Err(e)) => {
                        tracing::warn!(%endpoint, error = %e, "connection monitor failed");
                        monitor_open = false;
                        continue;
                    }
                    None => {
                        monitor_open = false;
                        continue;
                    }
                };
                // Attributable only while one route listens here.
                let routes = routes.lock();
                let alone = (routes.by_topic.len() == 1)
                    .then(|| routes.by_topic.values().next().cloned())
                    .flatten();
                (alone, event)
            }
            msg = stream.socket.recv_paced(&mut pace) => match msg {
                Ok(frames) => {
                    let topic = frames.first().map(Vec::as_slice).unwrap_or_default();
                    let mut routes = routes.lock();
                    let route = routes.route(topic);
                    if route.is_none() && routes.count_unknown(topic) {
                        tracing::warn!(%endpoint, topic = %String::from_utf8_lossy(topic),
                            "KV events with a topic no replica is configured with; dropped");
                    }
                    (route, ReaderEvent::Message(frames.into_iter().map(Bytes::from).collect()))
                }
                Err(e) => {
                    tracing::warn!(%endpoint, error = %e, "bound event socket failed");
                    return;
                }
            },
        };
        if let Some(tx) = route {
            tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                // A closed route is a worker being removed: its messages are not wanted.
                _ = tx.send(event) => {}
            }
        }
    }
}
