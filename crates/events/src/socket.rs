//! libzmq sockets (the `zmq` crate, libzmq built from source) driven by tokio without a thread
//! per socket: the socket layer of the workspace (bound and non-TCP subscribers, replay
//! client, simulator publisher and replay server, interop tests). A subscriber that dials a
//! TCP publisher reads it without libzmq (`crate::dialer`), paced by this module's [`Pace`].
//!
//! Invariants:
//! - Every call into libzmq is non-blocking (`DONTWAIT`); waiting happens on the socket's
//!   `ZMQ_FD` registered with tokio. That fd is edge-triggered and only says "look again":
//!   after each wake the operation is retried until `EAGAIN`, and the readiness is cleared
//!   *before* the retry, so a signal arriving meanwhile is never lost.
//! - A socket is used by one task at a time (`&mut self`): libzmq sockets are not thread-safe,
//!   and a send processing commands could otherwise swallow the wake a receiver waits for.
//! - Sockets live in process-wide contexts that are never terminated, so dropping a socket
//!   never blocks; linger is 0 (vLLM closes with linger 0). libzmq caps a context at 1023
//!   sockets (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise), so a new context (one
//!   more libzmq I/O thread) is opened whenever the open ones are full: a router subscribed
//!   to a thousand replicas needs about three thousand sockets (SUB and its monitor pair).
//! - A monitored socket is dropped before its [`Monitor`], and stops its monitor when dropped.
//!   libzmq sends each monitor event from the context's I/O thread with a *blocking* send on
//!   its own PAIR socket; once our end of the pair is closed that send never returns, and every
//!   socket of the context (publishers and replay sockets of other replicas too) stops. A
//!   peer that disconnected while a dropped socket awaited libzmq's reaper did exactly that.
//! - Listeners get libzmq's `SO_REUSEADDR`, so a restarted process rebinds its ports at once
//!   even with earlier connections in `TIME_WAIT`.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

pub use zmq::SocketType;

/// A libzmq call failed, or the socket's fd could not be polled.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("zmq {op} {endpoint}: {source}")]
    Zmq {
        op: &'static str,
        endpoint: String,
        #[source]
        source: zmq::Error,
    },
    #[error("polling the zmq socket: {0}")]
    Poll(#[from] std::io::Error),
}

impl SocketError {
    fn new(op: &'static str, endpoint: &str, source: zmq::Error) -> Self {
        SocketError::Zmq {
            op,
            endpoint: endpoint.to_owned(),
            source,
        }
    }
}

impl From<SocketError> for crate::EventsError {
    fn from(e: SocketError) -> Self {
        crate::EventsError::Zmq(e.to_string())
    }
}

/// Sockets per context: below libzmq's default cap of 1023, with room for a socket, its
/// monitor and the monitor's peer to land in the same context (inproc needs that).
const SOCKETS_PER_CONTEXT: usize = 1000;
const LARGEST_GROUP: usize = 3;

/// A context and how many sockets are open in it.
#[derive(Clone)]
struct Slot {
    ctx: zmq::Context,
    live: Arc<AtomicUsize>,
}

/// A context with room for a group of up to [`LARGEST_GROUP`] sockets.
fn context_with_room() -> Slot {
    static SLOTS: OnceLock<Mutex<Vec<Slot>>> = OnceLock::new();
    let slots = SLOTS.get_or_init(|| Mutex::new(Vec::new()));
    // Plain data; a panic elsewhere cannot leave the list inconsistent.
    let mut slots = slots.lock().unwrap_or_else(|e| e.into_inner());
    let room = |s: &&Slot| s.live.load(Ordering::Relaxed) + LARGEST_GROUP <= SOCKETS_PER_CONTEXT;
    if let Some(s) = slots.iter().find(room) {
        return s.clone();
    }
    let slot = Slot {
        ctx: zmq::Context::new(),
        live: Arc::new(AtomicUsize::new(0)),
    };
    slots.push(slot.clone());
    slot
}

/// The signalling fd, borrowed from the socket that owns it.
struct SignalFd(RawFd);

impl AsRawFd for SignalFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Undoes a socket's count if its construction fails half way.
struct Counted(Option<Arc<AtomicUsize>>);

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some(live) = &self.0 {
            live.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// How long [`ZmqSocket::bind`] retries while a closed socket's listener is being torn down.
const BIND_RETRY: Duration = Duration::from_millis(20);
const BIND_ATTEMPTS: u32 = 100;

/// One libzmq socket under tokio.
pub struct ZmqSocket {
    // Declared before `socket`: the fd is deregistered from tokio before libzmq closes it.
    fd: AsyncFd<SignalFd>,
    socket: zmq::Socket,
    kind: SocketType,
    slot: Slot,
    /// Sockets this one holds in its context: itself, plus libzmq's monitor socket.
    weight: usize,
}

impl Drop for ZmqSocket {
    fn drop(&mut self) {
        // A weight above one is a monitor's.
        if self.weight > 1 {
            self.stop_monitor();
        }
        self.slot.live.fetch_sub(self.weight, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for ZmqSocket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZmqSocket")
            .field("kind", &self.kind)
            .field("fd", &self.fd.get_ref().0)
            .finish()
    }
}

impl ZmqSocket {
    /// A new socket of `kind` (in a tokio runtime: the fd is registered with its reactor).
    pub fn new(kind: SocketType) -> Result<Self, SocketError> {
        Self::new_in(context_with_room(), kind)
    }

    fn new_in(slot: Slot, kind: SocketType) -> Result<Self, SocketError> {
        let err = |op| move |e| SocketError::new(op, "", e);
        let socket = slot.ctx.socket(kind).map_err(err("socket"))?;
        // Counted from here: dropping `socket` on an error below closes it again.
        slot.live.fetch_add(1, Ordering::Relaxed);
        let mut guard = Counted(Some(slot.live.clone()));
        socket.set_linger(0).map_err(err("linger"))?;
        let raw = socket.get_fd().map_err(err("fd"))?;
        // The replacement, `register_with_interest`, is `unsafe` (forbidden in this workspace);
        // its safety condition holds here: the fd belongs to `socket`, which is declared after
        // `fd` and so outlives the registration, and `SignalFd` always returns the same fd.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(SignalFd(raw), Interest::READABLE)?;
        guard.0 = None;
        Ok(ZmqSocket {
            fd,
            socket,
            kind,
            slot,
            weight: 1,
        })
    }

    /// A SUB socket subscribed to `topic` (a prefix, as in ZMQ; `""` takes everything).
    pub fn sub(topic: &str) -> Result<Self, SocketError> {
        let s = Self::new(SocketType::SUB)?;
        s.socket
            .set_subscribe(topic.as_bytes())
            .map_err(|e| SocketError::new("subscribe", topic, e))?;
        Ok(s)
    }

    /// The high-water mark for both directions (vLLM's PUB uses 100,000).
    pub fn set_hwm(&self, hwm: i32) -> Result<(), SocketError> {
        let err = |e| SocketError::new("hwm", "", e);
        self.socket.set_sndhwm(hwm).map_err(err)?;
        self.socket.set_rcvhwm(hwm).map_err(err)
    }

    /// libzmq's redial pacing for connecting sockets: `initial` after a failure, doubling up
    /// to `max` (libzmq's default is a fixed 100 ms).
    pub fn set_reconnect(&self, initial: Duration, max: Duration) -> Result<(), SocketError> {
        let ms = |d: Duration| i32::try_from(d.as_millis()).unwrap_or(i32::MAX);
        let err = |e| SocketError::new("reconnect_ivl", "", e);
        self.socket.set_reconnect_ivl(ms(initial)).map_err(err)?;
        self.socket.set_reconnect_ivl_max(ms(max)).map_err(err)
    }

    /// The underlying libzmq socket, for options not wrapped here.
    pub fn raw(&self) -> &zmq::Socket {
        &self.socket
    }

    /// Binds `endpoint` (`tcp://*:PORT`, `tcp://HOST:0` for an ephemeral port) and returns the
    /// endpoint actually bound. While `EADDRINUSE` may come from a socket of this process that
    /// was just closed (libzmq tears listeners down in the background), it retries briefly.
    pub async fn bind(&mut self, endpoint: &str) -> Result<String, SocketError> {
        let mut attempt = 0;
        loop {
            match self.socket.bind(endpoint) {
                Ok(()) => break,
                Err(zmq::Error::EADDRINUSE) if attempt < BIND_ATTEMPTS => {
                    attempt += 1;
                    tokio::time::sleep(BIND_RETRY).await;
                }
                Err(e) => return Err(SocketError::new("bind", endpoint, e)),
            }
        }
        match self.socket.get_last_endpoint() {
            Ok(Ok(bound)) => Ok(bound),
            Ok(Err(_)) => Ok(endpoint.to_owned()),
            Err(e) => Err(SocketError::new("last_endpoint", endpoint, e)),
        }
    }

    /// Connects to `endpoint`. Returns at once: libzmq dials in the background and keeps
    /// redialing (every 100 ms by default) until the peer is there, and after every loss.
    pub fn connect(&self, endpoint: &str) -> Result<(), SocketError> {
        self.socket
            .connect(endpoint)
            .map_err(|e| SocketError::new("connect", endpoint, e))
    }

    /// The next multipart message, frames as received.
    pub async fn recv(&mut self) -> Result<Vec<Vec<u8>>, SocketError> {
        loop {
            match self.socket.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => return Ok(frames),
                Err(zmq::Error::EAGAIN) => wait(&self.fd).await?,
                Err(e) => return Err(SocketError::new("recv", "", e)),
            }
        }
    }

    /// [`ZmqSocket::recv`], with the wake-ups paced by `pace` while messages come fast.
    pub async fn recv_paced(&mut self, pace: &mut Pace) -> Result<Vec<Vec<u8>>, SocketError> {
        loop {
            match self.socket.recv_multipart(zmq::DONTWAIT) {
                Ok(frames) => {
                    pace.read_one();
                    return Ok(frames);
                }
                Err(zmq::Error::EAGAIN) => {
                    match pace.drained() {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => wait(&self.fd).await?,
                    }
                    pace.woke();
                }
                Err(e) => return Err(SocketError::new("recv", "", e)),
            }
        }
    }

    /// A message if one is queued, without waiting.
    pub fn try_recv(&mut self) -> Result<Option<Vec<Vec<u8>>>, SocketError> {
        match self.socket.recv_multipart(zmq::DONTWAIT) {
            Ok(frames) => Ok(Some(frames)),
            Err(zmq::Error::EAGAIN) => Ok(None),
            Err(e) => Err(SocketError::new("recv", "", e)),
        }
    }

    /// Sends one multipart message. Waits while the socket cannot take it (DEALER with no
    /// peer, ROUTER/DEALER at the high-water mark); a PUB never waits: libzmq drops what no
    /// subscriber can take, as for vLLM's PUB.
    pub async fn send<F: AsRef<[u8]>>(&mut self, frames: &[F]) -> Result<(), SocketError> {
        let last = frames.len().saturating_sub(1);
        for (i, frame) in frames.iter().enumerate() {
            let flags = zmq::DONTWAIT | if i < last { zmq::SNDMORE } else { 0 };
            loop {
                match self.socket.send(frame.as_ref(), flags) {
                    Ok(()) => break,
                    Err(zmq::Error::EAGAIN) => wait(&self.fd).await?,
                    Err(e) => return Err(SocketError::new("send", "", e)),
                }
            }
        }
        Ok(())
    }

    /// Lets libzmq process pending commands (new peers, subscriptions) while the socket is
    /// otherwise idle; resolves after each wake. For sockets that only send (PUB).
    pub async fn process_commands(&mut self) -> Result<(), SocketError> {
        wait(&self.fd).await?;
        self.socket
            .get_events()
            .map(|_| ())
            .map_err(|e| SocketError::new("events", "", e))
    }

    /// Starts reporting connection events of this socket.
    pub fn monitor(&mut self) -> Result<Monitor, SocketError> {
        let addr = monitor_address();
        let events = zmq::SocketEvent::CONNECTED.to_raw()
            | zmq::SocketEvent::ACCEPTED.to_raw()
            | zmq::SocketEvent::DISCONNECTED.to_raw()
            | zmq::SocketEvent::CONNECT_RETRIED.to_raw();
        self.socket
            .monitor(&addr, i32::from(events))
            .map_err(|e| SocketError::new("monitor", &addr, e))?;
        // libzmq's own monitor socket lives as long as this one.
        self.slot.live.fetch_add(1, Ordering::Relaxed);
        self.weight += 1;
        // inproc reaches only sockets of the same context.
        let pair = ZmqSocket::new_in(self.slot.clone(), SocketType::PAIR)?;
        // No limit on the events queued for us (an inproc pipe has none if either end sets
        // 0): libzmq's send of an event blocks its I/O thread at the limit, and replacing the
        // monitor ([`ZmqSocket::stop_monitor`]) would then wait for that thread.
        pair.socket
            .set_rcvhwm(0)
            .map_err(|e| SocketError::new("hwm", &addr, e))?;
        pair.connect(&addr)?;
        Ok(Monitor { pair })
    }

    /// Stops reporting connection events, so that no event waits on a closed [`Monitor`].
    /// The binding cannot pass libzmq the null endpoint that stops a monitor, so the monitor
    /// is replaced by one that reports nothing: libzmq closes the old one first and sends no
    /// event while the event mask is empty, whether or not the new one could be opened.
    fn stop_monitor(&mut self) {
        if let Err(e) = self.socket.monitor(&monitor_address(), 0) {
            tracing::debug!(error = %e, "replacing a socket monitor");
        }
    }
}

/// A fresh inproc endpoint for libzmq's end of a monitor (never reused: a closed monitor's
/// endpoint is released in the background).
fn monitor_address() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("inproc://kinference-monitor-{}-{n}", std::process::id())
}

/// When a receiving socket next looks for messages once it ran dry. Each wake-up by the socket's
/// signal costs system calls on both sides (libzmq's I/O thread signals its socket, tokio's
/// worker wakes, the receive asks libzmq's mailbox) and the subscriber's work per message is
/// small, so a stream of one small message per request (a fast engine publishes one batch per
/// step) cost more in wake-ups than in parsing. Once two wake-ups that read messages came less
/// than two intervals apart, the reader instead sleeps until the next point of a grid
/// (multiples of the interval from one origin, the same for every paced reader of the process,
/// so readers of many publishers wake together) and drains what came meanwhile: one wake-up per
/// interval, however many messages. It stays on the grid until `LINGER` (four) intervals passed
/// without a message, then waits for the signal again; slower streams wake on the signal with
/// no delay. Messages are delayed at most one interval (the router's own speculative entries
/// cover what it just routed); zero turns pacing off.
#[derive(Debug)]
pub struct Pace {
    interval: Duration,
    /// When the current wake-up began, and whether it has read a message since.
    woke_at: tokio::time::Instant,
    read_any: bool,
    /// When the previous wake-up that read a message began.
    last_productive: Option<tokio::time::Instant>,
    /// Looking on the grid rather than waiting for the signal.
    paced: bool,
}

/// Intervals a paced reader keeps looking on the grid after its last message before it waits
/// for the signal again. A fast stream has empty intervals too; waking on its signal in
/// those would cost a wake-up per message again, while looking on the grid costs a read that
/// finds nothing, in a wake-up shared with every other paced reader.
const LINGER: u32 = 4;

impl Pace {
    pub fn new(interval: Duration) -> Self {
        // Fixed before this reader's first wake-up, so every wake-up lies after it.
        grid_origin();
        Pace {
            interval,
            woke_at: tokio::time::Instant::now(),
            read_any: false,
            last_productive: None,
            paced: false,
        }
    }

    /// A message was read in the current wake-up.
    pub(crate) fn read_one(&mut self) {
        self.read_any = true;
    }

    /// The socket ran dry: when to look again (`None`: when it signals).
    pub(crate) fn drained(&mut self) -> Option<tokio::time::Instant> {
        if self.interval.is_zero() {
            return None;
        }
        let since = |p: tokio::time::Instant| self.woke_at.duration_since(p);
        if std::mem::take(&mut self.read_any) {
            let previous = self.last_productive.replace(self.woke_at);
            self.paced = previous.is_some_and(|p| since(p) <= 2 * self.interval);
        } else if self.paced {
            self.paced = self
                .last_productive
                .is_some_and(|p| since(p) < LINGER * self.interval);
        }
        self.paced
            .then(|| next_on_grid(self.woke_at, self.interval))
    }

    pub(crate) fn woke(&mut self) {
        self.woke_at = tokio::time::Instant::now();
        self.read_any = false;
    }
}

/// Where the paced readers' grid starts (the first time any reader asks).
fn grid_origin() -> tokio::time::Instant {
    static ORIGIN: OnceLock<tokio::time::Instant> = OnceLock::new();
    *ORIGIN.get_or_init(tokio::time::Instant::now)
}

/// The first point of the grid of `interval` strictly after `at`.
fn next_on_grid(at: tokio::time::Instant, interval: Duration) -> tokio::time::Instant {
    let origin = grid_origin();
    let step = interval.as_nanos().max(1);
    let nanos = |n: u128| Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX));
    if at >= origin {
        let k = at.duration_since(origin).as_nanos() / step + 1;
        origin + nanos(k * step)
    } else {
        // Before the origin (a clock of another runtime, in tests): the grid extends back.
        let k = origin.duration_since(at).as_nanos() / step;
        let point = origin - nanos(k * step);
        if point > at {
            point
        } else {
            point + interval
        }
    }
}

/// Waits until the signalling fd fires, then clears it; callers retry their operation. A free
/// function over the fd alone, so that waiting borrows nothing of the (non-`Sync`) socket.
async fn wait(fd: &AsyncFd<SignalFd>) -> Result<(), SocketError> {
    let mut guard = fd.readable().await?;
    guard.clear_ready();
    Ok(())
}

/// A connection event of a monitored socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerEvent {
    /// A connection was established (dialed or accepted).
    Up,
    /// A connection closed.
    Down,
    /// A dial failed (nobody listens yet); libzmq dials again after its reconnect interval.
    Retry,
}

/// Connection events of one socket (libzmq's socket monitor over an inproc PAIR).
#[derive(Debug)]
pub struct Monitor {
    pair: ZmqSocket,
}

impl Monitor {
    /// The next up/down event.
    pub async fn next(&mut self) -> Result<PeerEvent, SocketError> {
        loop {
            let frames = self.pair.recv().await?;
            // Frame 0: event id (u16) and value (u32), native byte order; frame 1: address.
            let Some(id) = frames.first().and_then(|f| f.get(..2)) else {
                continue;
            };
            let id = u16::from_ne_bytes([id[0], id[1]]);
            if id == zmq::SocketEvent::CONNECTED.to_raw()
                || id == zmq::SocketEvent::ACCEPTED.to_raw()
            {
                return Ok(PeerEvent::Up);
            }
            if id == zmq::SocketEvent::DISCONNECTED.to_raw() {
                return Ok(PeerEvent::Down);
            }
            if id == zmq::SocketEvent::CONNECT_RETRIED.to_raw() {
                return Ok(PeerEvent::Retry);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn more_sockets_than_one_libzmq_context_holds() {
        // libzmq refuses the 1024th socket of a context; a router with a thousand replicas
        // needs about three thousand (SUB, its monitor, the monitor's peer).
        let mut held = Vec::new();
        for i in 0..1100 {
            let mut s = ZmqSocket::sub("").unwrap_or_else(|e| panic!("socket {i}: {e}"));
            let m = s.monitor().unwrap_or_else(|e| panic!("monitor {i}: {e}"));
            held.push((s, m));
        }
        assert_eq!(held.len(), 1100);
    }

    /// Sends on `publisher` until `sub` receives, within five seconds.
    async fn exchange(publisher: &mut ZmqSocket, sub: &mut ZmqSocket) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while tokio::time::Instant::now() < deadline {
            publisher.send(&[&b"t"[..], b"x"]).await.unwrap();
            let got = tokio::time::timeout(Duration::from_millis(20), sub.recv());
            if got.await.is_ok() {
                return true;
            }
        }
        false
    }

    /// A monitored socket whose peers come and go after its monitor stopped and its
    /// `Monitor` closed leaves the context's I/O thread serving every other socket. Without
    /// the stop, libzmq's event for the first lost peer blocks that thread for good.
    #[tokio::test]
    async fn a_stopped_monitor_blocks_no_socket() {
        // A context of its own: a regression stalls this test only.
        let slot = Slot {
            ctx: zmq::Context::new(),
            live: Arc::new(AtomicUsize::new(0)),
        };
        let socket = |kind| ZmqSocket::new_in(slot.clone(), kind).unwrap();
        let mut sub = socket(SocketType::SUB);
        sub.socket.set_subscribe(b"").unwrap();
        let mut monitor = sub.monitor().unwrap();
        let endpoint = sub.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut publisher = socket(SocketType::PUB);
        publisher.connect(&endpoint).unwrap();
        assert!(exchange(&mut publisher, &mut sub).await);
        assert_eq!(monitor.next().await.unwrap(), PeerEvent::Up);
        sub.stop_monitor();
        drop(monitor);
        // Peers arrive and leave: each would be an event for the closed monitor.
        drop(publisher);
        let mut sub_receives = true;
        for _ in 0..3 {
            let mut publisher = socket(SocketType::PUB);
            publisher.connect(&endpoint).unwrap();
            sub_receives &= exchange(&mut publisher, &mut sub).await;
        }
        let mut a = socket(SocketType::PUB);
        let other = a.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut b = socket(SocketType::SUB);
        b.socket.set_subscribe(b"").unwrap();
        b.connect(&other).unwrap();
        let others_talk = exchange(&mut a, &mut b).await;
        if !(sub_receives && others_talk) {
            // Dropping it would stop its monitor, which waits for the stalled I/O thread.
            std::mem::forget(sub);
        }
        assert!(sub_receives, "the SUB still receives");
        assert!(others_talk, "another pair of the context still talks");
    }

    #[tokio::test(start_paused = true)]
    async fn pacing_sleeps_only_while_messages_come_fast() {
        let ms = Duration::from_millis;
        let mut p = Pace::new(ms(1));
        // A wake-up that read nothing waits for the signal.
        p.woke();
        assert_eq!(p.drained(), None);
        // The first productive wake-up has nothing to compare with: the signal.
        p.woke();
        p.read_any = true;
        assert_eq!(p.drained(), None);
        // The next one, 0.5 ms later: fast, so sleep until the grid's next point after it
        // began, at most 1 ms later.
        tokio::time::advance(ms(1) / 2).await;
        p.woke();
        let began = tokio::time::Instant::now();
        p.read_any = true;
        let at = p.drained().expect("paced");
        assert!(at > began && at <= began + ms(1), "{at:?} after {began:?}");
        // Woken by that timer, messages again: stays paced, on the grid's next point.
        tokio::time::advance(at - began).await;
        p.woke();
        p.read_any = true;
        assert_eq!(p.drained(), Some(at + ms(1)));
        // Another reader, woken a little later in the same interval, sleeps to the same point.
        let mut q = Pace::new(ms(1));
        q.woke();
        q.read_any = true;
        let _ = q.drained();
        tokio::time::advance(ms(1) / 4).await;
        q.woke();
        q.read_any = true;
        assert_eq!(q.drained(), Some(at + ms(1)));
        // The timer found nothing: it keeps looking on the grid until LINGER intervals
        // passed since its last message, then waits for the signal.
        let last = at; // p's last productive wake-up
        let mut point = at + ms(1);
        loop {
            tokio::time::advance(point - tokio::time::Instant::now()).await;
            p.woke();
            match p.drained() {
                Some(next) => {
                    assert!(point.duration_since(last) < LINGER * ms(1));
                    assert_eq!(next, point + ms(1));
                    point = next;
                }
                None => {
                    assert!(point.duration_since(last) >= LINGER * ms(1));
                    break;
                }
            }
        }
        // After a quiet 5 ms a message is read on its signal without delay.
        tokio::time::advance(ms(5)).await;
        p.woke();
        p.read_any = true;
        assert_eq!(p.drained(), None);
        // Zero turns it off.
        let mut off = Pace::new(Duration::ZERO);
        for _ in 0..3 {
            off.woke();
            off.read_any = true;
            assert_eq!(off.drained(), None);
        }
    }

    /// Through libzmq both ways: bursts, a steady fast stream and single messages after quiet
    /// spells all arrive, in order, none waiting for a signal that already came.
    #[tokio::test]
    async fn paced_receives_lose_nothing() {
        let mut publisher = ZmqSocket::new(SocketType::PUB).unwrap();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let mut sub = ZmqSocket::sub("t").unwrap();
        sub.connect(&endpoint).unwrap();
        // A PUB drops what no subscriber has joined for yet: send until one arrives.
        let mut pace = Pace::new(Duration::from_millis(1));
        loop {
            publisher.send(&[&b"t"[..], b"hello"]).await.unwrap();
            let got = tokio::time::timeout(Duration::from_millis(20), sub.recv_paced(&mut pace));
            if got.await.is_ok() {
                break;
            }
        }
        while sub.try_recv().unwrap().is_some() {}
        let mut sent = 0u32;
        let mut expect = 0u32;
        for round in 0..40 {
            // Bursts, then single messages, each after a pause longer than two intervals.
            let n = if round % 2 == 0 { 50 } else { 1 };
            for _ in 0..n {
                publisher
                    .send(&[&b"t"[..], &sent.to_be_bytes()[..]])
                    .await
                    .unwrap();
                sent += 1;
            }
            while expect < sent {
                let frames =
                    tokio::time::timeout(Duration::from_secs(5), sub.recv_paced(&mut pace))
                        .await
                        .expect("a sent message arrives")
                        .unwrap();
                assert_eq!(frames[1], expect.to_be_bytes());
                expect += 1;
            }
            if round % 4 == 3 {
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }
    }
}
