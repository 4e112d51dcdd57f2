//! Overload protection: each pool's admission gate (at most `max_in_flight` requests
//! forwarded, a bounded queue with a timeout behind them; the same queue holds requests
//! waiting for room on a replica, `max_in_flight_per_replica`) and the counters of everything
//! the router sheds or times out on the client side.
//!
//! Invariants: an admitted request holds its place ([`Admitted`]) until its response ends,
//! however it ends (the place lives in the response body, next to the in-flight guard); a
//! request that finds the gate and its queue full is refused at once, without waiting, so
//! shedding costs an admitted request nothing but one atomic operation on the fast path. A
//! queued request that goes away (client disconnect) leaves the queue. Both kinds of waiter
//! share one queue: `max_queue` bounds all of a pool's waiting requests, `queue_ms` each wait.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why a request was shed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shed {
    /// Every place and every queue slot was taken.
    QueueFull,
    /// It waited `timeouts.queue_ms` in the queue without a place coming free.
    QueueTimeout,
    /// Every replica it could go to had `max_in_flight_per_replica` requests, and the queue
    /// was full.
    ReplicasFull,
    /// It waited `timeouts.queue_ms` in the queue without room coming free on a replica.
    ReplicasFullTimeout,
}

impl Shed {
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::QueueTimeout => "queue_timeout",
            Shed::ReplicasFull => "replicas_full",
            Shed::ReplicasFullTimeout => "replicas_full_timeout",
        }
    }
}

/// One pool's admission: `max_in_flight` places and a queue of `max_queue` waiters.
#[derive(Debug)]
pub(crate) struct Gate {
    /// `None`: no limit.
    places: Option<Arc<Semaphore>>,
    max_queue: usize,
    waiting: AtomicUsize,
    queue_timeout: Duration,
    queued: Gauge,
}

/// A place taken at a pool's gate; dropping it frees the place for the next waiter.
#[derive(Debug)]
pub(crate) struct Admitted {
    _place: Option<OwnedSemaphorePermit>,
}

impl Gate {
    /// `max_in_flight` 0: no limit. `queued` is the pool's queue-length gauge.
    pub fn new(
        max_in_flight: usize,
        max_queue: usize,
        queue_timeout: Duration,
        queued: Gauge,
    ) -> Self {
        let places = (max_in_flight > 0)
            .then(|| Arc::new(Semaphore::new(max_in_flight.min(Semaphore::MAX_PERMITS))));
        Gate {
            places,
            max_queue,
            waiting: AtomicUsize::new(0),
            queue_timeout,
            queued,
        }
    }

    /// A place for one request: at once when one is free, after a wait in the queue when the
    /// queue has room, else the reason it was shed.
    pub async fn admit(&self) -> Result<Admitted, Shed> {
        let Some(places) = &self.places else {
            return Ok(Admitted { _place: None });
        };
        if let Ok(p) = places.clone().try_acquire_owned() {
            return Ok(Admitted { _place: Some(p) });
        }
        let _queued = self.enqueue().ok_or(Shed::QueueFull)?;
        match tokio::time::timeout(self.queue_timeout, places.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(Admitted { _place: Some(p) }),
            // The semaphore is never closed; a closed one could only mean shutting down.
            Ok(Err(_)) | Err(_) => Err(Shed::QueueTimeout),
        }
    }

    /// Waits in the queue until `room` resolves: for an admitted request whose replicas are
    /// all full. Shed at once when the queue is full, or after `queue_timeout`.
    pub async fn wait_for_room(&self, room: impl Future<Output = ()>) -> Result<(), Shed> {
        let _queued = self.enqueue().ok_or(Shed::ReplicasFull)?;
        tokio::time::timeout(self.queue_timeout, room)
            .await
            .map_err(|_| Shed::ReplicasFullTimeout)
    }

    /// A queue slot, or `None` when `max_queue` requests wait already.
    fn enqueue(&self) -> Option<Queued<'_>> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        self.queued.inc();
        Some(Queued(self))
    }

    /// Requests waiting in the queue now.
    #[cfg(test)]
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }
}

/// A queue slot, given back however the wait ends (admitted, timed out, client gone).
struct Queued<'g>(&'g Gate);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.queued.dec();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ShedLabels {
    pub pool: String,
    pub reason: &'static str,
    pub status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TimeoutLabels {
    pub port: &'static str,
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PortLabel {
    pub port: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct QueueLabel {
    pub pool: String,
}

/// The counters and gauges of the router's own protection. Clones share the same series.
#[derive(Clone, Debug, Default)]
pub(crate) struct LimitMetrics {
    /// Requests refused by a pool's gate, by reason and status (429, or 503 when the pool
    /// had no usable replica).
    pub shed: Family<ShedLabels, Counter>,
    /// Requests waiting at a pool's gate.
    pub queued: Family<QueueLabel, Gauge>,
    /// Client connections closed or requests cut for being too slow, by port and kind:
    /// header_read, body_read, keep_alive, h2_keep_alive.
    pub client_timeouts: Family<TimeoutLabels, Counter>,
    /// Client connections open, by port.
    pub connections: Family<PortLabel, Gauge>,
    /// Times an accept loop stopped accepting because `max_connections` were open.
    pub accept_pauses: Family<PortLabel, Counter>,
    /// Accept errors (out of file descriptors, ...), after each of which accepting pauses.
    pub accept_errors: Family<PortLabel, Counter>,
    /// Admin requests refused for a missing or wrong token.
    pub admin_unauthorized: Counter,
}

impl LimitMetrics {
    pub fn timeout(&self, port: &'static str, kind: &'static str) {
        self.client_timeouts
            .get_or_create(&TimeoutLabels { port, kind })
            .inc();
    }

    pub fn register(&self, r: &mut Registry) {
        r.register(
            "kinference_shed_requests",
            "Requests refused by a pool's admission gate (max_in_flight, \
             max_in_flight_per_replica and their queue), by reason (queue_full, queue_timeout, \
             replicas_full, replicas_full_timeout) and status (429; 503 when the pool had no \
             usable replica)",
            self.shed.clone(),
        );
        r.register(
            "kinference_queued_requests",
            "Requests waiting at a pool's admission gate for a place, or for room on a replica",
            self.queued.clone(),
        );
        r.register(
            "kinference_client_timeouts",
            "Client connections closed, or requests answered 408, for being too slow, by port \
             and kind (header_read, body_read, keep_alive, h2_keep_alive)",
            self.client_timeouts.clone(),
        );
        r.register(
            "kinference_client_connections",
            "Client connections open, by port",
            self.connections.clone(),
        );
        r.register(
            "kinference_accept_pauses",
            "Times accepting stopped because limits.max_connections connections were open",
            self.accept_pauses.clone(),
        );
        r.register(
            "kinference_accept_errors",
            "Failed accepts (for example, out of file descriptors); accepting pauses after each",
            self.accept_errors.clone(),
        );
        r.register(
            "kinference_admin_unauthorized",
            "Admin-port requests refused for a missing or wrong bearer token",
            self.admin_unauthorized.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_gate_queues_then_sheds_and_a_freed_place_goes_to_the_first_waiter() {
        let gate = Arc::new(Gate::new(1, 1, Duration::from_secs(5), Gauge::default()));
        let first = gate.admit().await.unwrap();
        let g = gate.clone();
        let waiter = tokio::spawn(async move { g.admit().await.map(drop) });
        while gate.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        assert_eq!(gate.admit().await.unwrap_err(), Shed::QueueFull);
        drop(first);
        waiter.await.unwrap().unwrap();
        assert_eq!(gate.waiting(), 0);

        let held = gate.admit().await.unwrap();
        let start = tokio::time::Instant::now();
        assert_eq!(gate.admit().await.unwrap_err(), Shed::QueueTimeout);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(gate.waiting(), 0, "a timed-out waiter leaves the queue");
        drop(held);
        assert!(gate.admit().await.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_for_room_shares_the_queue_and_its_timeout() {
        let gate = Arc::new(Gate::new(0, 1, Duration::from_secs(5), Gauge::default()));
        let (room, mut has_room) = tokio::sync::watch::channel(false);
        let g = gate.clone();
        let waiter = tokio::spawn(async move {
            g.wait_for_room(async move {
                let _ = has_room.wait_for(|r| *r).await;
            })
            .await
        });
        while gate.waiting() == 0 {
            tokio::task::yield_now().await;
        }
        // The one queue slot is taken: a second waiter is refused at once.
        assert_eq!(
            gate.wait_for_room(std::future::pending()).await,
            Err(Shed::ReplicasFull)
        );
        room.send(true).unwrap();
        assert_eq!(waiter.await.unwrap(), Ok(()));
        assert_eq!(gate.waiting(), 0);

        let start = tokio::time::Instant::now();
        assert_eq!(
            gate.wait_for_room(std::future::pending()).await,
            Err(Shed::ReplicasFullTimeout)
        );
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert_eq!(gate.waiting(), 0, "a timed-out waiter leaves the queue");
    }

    #[tokio::test]
    async fn no_limit_admits_everything() {
        let gate = Gate::new(0, 0, Duration::from_secs(1), Gauge::default());
        let held: Vec<_> = futures_join(&gate, 100).await;
        assert_eq!(held.len(), 100);
    }

    async fn futures_join(gate: &Gate, n: usize) -> Vec<Admitted> {
        let mut out = Vec::new();
        for _ in 0..n {
            out.push(gate.admit().await.unwrap());
        }
        out
    }
}
