//! The reader task for a publisher we dial over TCP: ZMTP spoken by the task itself
//! ([`kinference_vllm::events::zmtp`]) on a tokio socket, instead of a libzmq SUB socket.
//!
//! Why not libzmq here: libzmq reads every connection on its own I/O thread, which wakes for
//! each message the publisher sends and then signals the reader, so a replica publishing one
//! batch per engine step cost the router two thread wake-ups per batch whatever the reader's
//! pacing (BENCHMARKS.md, "KV events read without libzmq's I/O thread"). Read here, a paced
//! reader wakes once per interval and takes everything that came in one `read`. libzmq still
//! serves everything else: bound endpoints (a publisher dials us, possibly many on one port),
//! non-TCP endpoints, replay DEALERs, the simulator's publisher; it is also the publisher the
//! tests of this reader talk to, besides a fake peer for the protocol's edges.
//!
//! Invariants: the task reports what a monitored libzmq SUB would (a connection up after the
//! handshake, down when it ends, a failed dial, an error) and every message in the order it
//! was sent; it redials after every loss with the plane's backoff, like libzmq's reconnect;
//! nothing it reads is trusted: frames over [`zmtp::MAX_FRAME`], reserved flags, a peer that is
//! not a publisher or does not finish the handshake in [`HANDSHAKE_TIMEOUT`] end the
//! connection with an error, never a panic or an unbounded allocation.

use std::io::{Read, Write};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use kinference_vllm::events::zmtp::{self, Command, ZmtpError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, BackoffConfig};
use crate::socket::Pace;
use crate::transport::ReaderEvent;

/// Longest a connected publisher may take to greet and send READY (libzmq's default
/// handshake interval).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Bytes asked of the kernel per read (more when a frame needs it).
const READ_CHUNK: usize = 64 * 1024;

/// Whether the reader can serve `endpoint` (`tcp://HOST:PORT`); others go to libzmq.
pub(crate) fn dials(endpoint: &str) -> bool {
    endpoint.starts_with("tcp://")
}

/// How a connection ended.
#[derive(Debug, thiserror::Error)]
enum End {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(#[from] ZmtpError),
    #[error("the publisher closed the connection")]
    Closed,
    #[error("handshake timed out")]
    Timeout,
    /// The subscriber is gone: stop.
    #[error("subscriber gone")]
    Gone,
}

/// Dials `endpoint`, subscribes to `topic` and forwards everything to `tx` until cancelled or
/// `tx` closes; redials after every failure and loss.
pub(crate) async fn run(
    endpoint: String,
    topic: String,
    tx: mpsc::Sender<ReaderEvent>,
    redial: BackoffConfig,
    mut pace: Pace,
    seed: u64,
    cancel: CancellationToken,
) {
    let addr = endpoint
        .strip_prefix("tcp://")
        .unwrap_or(&endpoint)
        .to_owned();
    let mut backoff = Backoff::new(redial, seed);
    // Everything the task awaits runs under the cancellation: its subscriber waits for it to
    // end before dropping the channel, so a send to a full channel must not outlive a cancel.
    let _ = cancel
        .run_until_cancelled(async {
            loop {
                let report = match open(&addr, topic.as_bytes()).await {
                    Ok((stream, mut buf)) => {
                        backoff.reset();
                        if tx.send(ReaderEvent::PeerUp).await.is_err() {
                            return;
                        }
                        let end = read(stream, &mut buf, &tx, &mut pace).await;
                        tracing::debug!(%endpoint, reason = %end, "event stream connection ended");
                        match end {
                            End::Gone => return,
                            End::Closed | End::Io(_) => ReaderEvent::PeerDown,
                            // A peer that broke the protocol was connected: report both.
                            e => {
                                if tx.send(ReaderEvent::PeerDown).await.is_err() {
                                    return;
                                }
                                ReaderEvent::Error(format!("{endpoint}: {e}"))
                            }
                        }
                    }
                    // Nobody listens yet, or a publisher closing as we greet it.
                    Err(End::Io(e)) if is_dial_failure(&e) => ReaderEvent::DialFailed,
                    Err(End::Closed) => ReaderEvent::DialFailed,
                    Err(e) => ReaderEvent::Error(format!("{endpoint}: {e}")),
                };
                if tx.send(report).await.is_err() {
                    return;
                }
                backoff.wait().await;
            }
        })
        .await;
}

/// Nobody listens (yet): counted like libzmq's retried dials, not logged.
fn is_dial_failure(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | TimedOut
            | NotFound
            | HostUnreachable
            | NetworkUnreachable
    )
}

/// Connects and completes the handshake: greetings, READY both ways, the subscription.
/// Returns the stream and any bytes read past the handshake.
async fn open(addr: &str, topic: &[u8]) -> Result<(TcpStream, BytesMut), End> {
    let mut stream = TcpStream::connect(addr).await?;
    // Small writes (a PONG) go out at once rather than wait for an acknowledgement.
    stream.set_nodelay(true)?;
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&mut stream, topic)).await {
        Ok(Ok(buf)) => Ok((stream, buf)),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(End::Timeout),
    }
}

async fn handshake(stream: &mut TcpStream, topic: &[u8]) -> Result<BytesMut, End> {
    stream.write_all(&zmtp::greeting()).await?;
    let mut buf = BytesMut::with_capacity(READ_CHUNK);
    while buf.len() < zmtp::GREETING_LEN {
        read_more(stream, &mut buf).await?;
    }
    zmtp::check_greeting(&buf.split_to(zmtp::GREETING_LEN))?;
    // READY and the subscription in one segment, as libzmq's SUB sends them: a subscription
    // that trails the handshake lets the publisher attach the connection without it, and
    // drop what it publishes meanwhile.
    let mut hello = zmtp::ready_sub();
    hello.extend_from_slice(&zmtp::subscribe(topic));
    stream.write_all(&hello).await?;
    let head = loop {
        if let Some(head) = zmtp::parse_frame(&buf)? {
            break head;
        }
        read_more(stream, &mut buf).await?;
    };
    if !head.command {
        return Err(ZmtpError::NoReady.into());
    }
    zmtp::check_ready(&buf[head.header..head.size()])?;
    buf.advance(head.size());
    Ok(buf)
}

async fn read_more(stream: &mut TcpStream, buf: &mut BytesMut) -> Result<(), End> {
    buf.reserve(READ_CHUNK);
    if stream.read_buf(buf).await? == 0 {
        return Err(End::Closed);
    }
    Ok(())
}

/// The connection while messages are read: in tokio's reactor only while waiting for its
/// signal. A socket registered with the reactor wakes the runtime's thread on every arrival
/// (edge-triggered epoll), whether or not a task waits for it; a paced reader must not be
/// registered, or its pacing saves nothing.
enum Conn {
    Paced(std::net::TcpStream),
    Signalled(TcpStream),
}

impl Conn {
    /// A non-blocking read (`WouldBlock` when empty).
    fn try_read(&self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Conn::Paced(s) => (&*s).read(buf),
            Conn::Signalled(s) => s.try_read(buf),
        }
    }

    /// A non-blocking write.
    fn try_write(&self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Conn::Paced(s) => (&*s).write(buf),
            Conn::Signalled(s) => s.try_write(buf),
        }
    }

    /// Waits until `at` on the grid, out of the reactor.
    async fn sleep_until(self, at: tokio::time::Instant) -> std::io::Result<Conn> {
        let socket = match self {
            Conn::Paced(s) => s,
            Conn::Signalled(s) => s.into_std()?,
        };
        tokio::time::sleep_until(at).await;
        Ok(Conn::Paced(socket))
    }

    /// Waits for the socket's signal, in the reactor (registering reports data that came
    /// while it was out, so nothing is missed).
    async fn readable(self) -> std::io::Result<Conn> {
        let socket = match self {
            Conn::Paced(s) => TcpStream::from_std(s)?,
            Conn::Signalled(s) => s,
        };
        socket.readable().await?;
        Ok(Conn::Signalled(socket))
    }
}

/// Reads messages until the connection ends. Each turn reads all the kernel holds, forwards
/// every complete message (its frames share the read buffer), and once the socket is empty
/// waits as `pace` says: until the grid's next point while messages come fast, else for the
/// socket's signal.
async fn read(
    stream: TcpStream,
    buf: &mut BytesMut,
    tx: &mpsc::Sender<ReaderEvent>,
    pace: &mut Pace,
) -> End {
    let mut conn = match stream.into_std() {
        Ok(s) => Conn::Paced(s),
        Err(e) => return End::Io(e),
    };
    let mut scratch = vec![0u8; READ_CHUNK];
    let mut frames: Vec<Bytes> = Vec::new();
    loop {
        loop {
            match conn.try_read(&mut scratch) {
                Ok(0) => return End::Closed,
                Ok(n) => buf.extend_from_slice(&scratch[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return End::Io(e),
            }
            if let Err(end) = forward(&conn, buf, &mut frames, tx, pace).await {
                return end;
            }
        }
        let waited = match pace.drained() {
            Some(at) => conn.sleep_until(at).await,
            None => conn.readable().await,
        };
        conn = match waited {
            Ok(c) => c,
            Err(e) => return End::Io(e),
        };
        pace.woke();
    }
}

/// Forwards every complete message in `buf`, answering pings on the way.
async fn forward(
    conn: &Conn,
    buf: &mut BytesMut,
    frames: &mut Vec<Bytes>,
    tx: &mpsc::Sender<ReaderEvent>,
    pace: &mut Pace,
) -> Result<(), End> {
    while let Some(head) = zmtp::parse_frame(buf)? {
        let frame = buf.split_to(head.size()).freeze().slice(head.header..);
        if head.command {
            match zmtp::parse_command(&frame)? {
                Command::Ping { context } => write_all(conn, &zmtp::pong(context)).await?,
                Command::Error { reason } => {
                    let reason = String::from_utf8_lossy(reason).into_owned();
                    return Err(ZmtpError::Refused(reason).into());
                }
                _ => {}
            }
            continue;
        }
        frames.push(frame);
        if !head.more {
            pace.read_one();
            let message = ReaderEvent::Message(std::mem::take(frames));
            if tx.send(message).await.is_err() {
                return Err(End::Gone);
            }
        }
    }
    Ok(())
}

/// Writes a small command (a PONG) on the non-blocking socket. Its send buffer is all but
/// empty (a subscriber sends nothing else), so this finishes at once; should it not, it
/// retries each millisecond rather than leave half a frame behind.
async fn write_all(conn: &Conn, mut bytes: &[u8]) -> Result<(), End> {
    while !bytes.is_empty() {
        match conn.try_write(bytes) {
            Ok(0) => return Err(End::Closed),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::socket::{SocketType, ZmqSocket};
    use tokio::net::TcpListener;

    fn fast_redial() -> BackoffConfig {
        BackoffConfig {
            initial: Duration::from_millis(5),
            max: Duration::from_millis(20),
            jitter: 0.0,
        }
    }

    fn spawn(endpoint: String, topic: &str) -> (mpsc::Receiver<ReaderEvent>, CancellationToken) {
        let (tx, rx) = mpsc::channel(1024);
        let cancel = CancellationToken::new();
        tokio::spawn(run(
            endpoint,
            topic.to_owned(),
            tx,
            fast_redial(),
            Pace::new(Duration::from_millis(1)),
            7,
            cancel.clone(),
        ));
        (rx, cancel)
    }

    async fn next(rx: &mut mpsc::Receiver<ReaderEvent>) -> ReaderEvent {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .expect("an event within 10 s")
            .expect("the reader runs")
    }

    /// Skips connection events (a dial may fail before the publisher listens) and returns the
    /// next message's frames.
    async fn next_message(rx: &mut mpsc::Receiver<ReaderEvent>) -> Vec<Bytes> {
        loop {
            if let ReaderEvent::Message(m) = next(rx).await {
                return m;
            }
        }
    }

    /// Against libzmq's PUB: the subscription is honoured (other topics filtered by the
    /// publisher), multipart messages of every size arrive whole and in order, and a
    /// restarted publisher on the same port is found again.
    #[tokio::test]
    async fn reads_a_libzmq_publisher_and_follows_its_restart() {
        let mut publisher = ZmqSocket::new(SocketType::PUB).unwrap();
        let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let (mut rx, cancel) = spawn(endpoint.clone(), "kv");
        // A PUB drops what no subscriber has joined for yet: send until one arrives.
        loop {
            publisher.send(&[&b"kv"[..], b"hello"]).await.unwrap();
            let got = tokio::time::timeout(Duration::from_millis(20), next_message(&mut rx));
            if got.await.is_ok() {
                break;
            }
        }
        let sizes = [0usize, 1, 255, 256, 70_000, 300_000];
        for round in 0..60u32 {
            publisher.send(&[&b"other"[..], b"x"]).await.unwrap();
            let body: Vec<u8> = (0..sizes[round as usize % sizes.len()])
                .map(|i| (i as u32 ^ round) as u8)
                .collect();
            publisher
                .send(&[&b"kv"[..], &round.to_be_bytes()[..], &body])
                .await
                .unwrap();
            // Skipping the greetings still in flight.
            let m = loop {
                let m = next_message(&mut rx).await;
                if m.get(1).is_none_or(|f| f[..] != b"hello"[..]) {
                    break m;
                }
            };
            assert_eq!(m.len(), 3, "round {round}");
            assert_eq!(m[0], b"kv"[..]);
            assert_eq!(m[1], round.to_be_bytes()[..]);
            assert_eq!(m[2], body);
        }
        // The publisher goes away and comes back on the same port.
        drop(publisher);
        loop {
            if matches!(next(&mut rx).await, ReaderEvent::PeerDown) {
                break;
            }
        }
        let mut publisher = ZmqSocket::new(SocketType::PUB).unwrap();
        publisher.bind(&endpoint).await.unwrap();
        let mut up = false;
        loop {
            publisher.send(&[&b"kv"[..], b"again"]).await.unwrap();
            match tokio::time::timeout(Duration::from_millis(20), next(&mut rx)).await {
                Ok(ReaderEvent::PeerUp) => up = true,
                Ok(ReaderEvent::Message(m)) => {
                    assert!(up, "a message before the connection was reported");
                    assert_eq!(m[1], b"again"[..]);
                    break;
                }
                _ => {}
            }
        }
        cancel.cancel();
    }

    #[tokio::test]
    async fn nobody_listening_is_a_failed_dial_retried() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let (mut rx, cancel) = spawn(format!("tcp://{addr}"), "");
        for _ in 0..3 {
            assert!(matches!(next(&mut rx).await, ReaderEvent::DialFailed));
        }
        cancel.cancel();
    }

    /// A peer that is not a publisher, or sends garbage, or a frame longer than the limit, is
    /// an error and the connection is dropped; pings are answered.
    #[tokio::test]
    async fn hostile_peers_are_errors_and_pings_are_answered() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mut rx, cancel) = spawn(format!("tcp://{addr}"), "t");

        async fn greet(listener: &TcpListener, socket_type: &[u8]) -> TcpStream {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut theirs = [0u8; zmtp::GREETING_LEN];
            s.read_exact(&mut theirs).await.unwrap();
            assert_eq!(theirs, zmtp::greeting());
            let mut g = zmtp::greeting();
            g[11] = 1;
            s.write_all(&g).await.unwrap();
            // READY and the subscription come before ours: a publisher attaching the
            // connection has its subscription at once (sent after our READY, it trailed by a
            // delayed acknowledgement, and what was published meanwhile was lost).
            let mut hello = zmtp::ready_sub();
            hello.extend_from_slice(&zmtp::subscribe(b"t"));
            let mut got = vec![0u8; hello.len()];
            s.read_exact(&mut got).await.unwrap();
            assert_eq!(got, hello);
            let mut body = vec![5];
            body.extend_from_slice(b"READY\x0bSocket-Type");
            body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
            body.extend_from_slice(socket_type);
            let mut out = Vec::new();
            zmtp::write_frame(&mut out, 0x04, &body);
            s.write_all(&out).await.unwrap();
            s
        }

        // Not a publisher.
        let _s = greet(&listener, b"ROUTER").await;
        match next(&mut rx).await {
            ReaderEvent::Error(e) => assert!(e.contains("ROUTER"), "{e}"),
            other => panic!("{other:?}"),
        }
        // A publisher that pings, sends a message, then a frame over the limit.
        let mut s = greet(&listener, b"PUB").await;
        assert!(matches!(next(&mut rx).await, ReaderEvent::PeerUp));
        let mut out = Vec::new();
        zmtp::write_frame(&mut out, 0x04, b"\x04PING\x00\x0aab");
        zmtp::write_message(&mut out, &[&b"t"[..], b"payload"]);
        s.write_all(&out).await.unwrap();
        let pong = zmtp::pong(b"ab");
        let mut got = vec![0u8; pong.len()];
        s.read_exact(&mut got).await.unwrap();
        assert_eq!(got, pong);
        match next(&mut rx).await {
            ReaderEvent::Message(m) => assert_eq!(m, vec![Bytes::from("t"), "payload".into()]),
            other => panic!("{other:?}"),
        }
        let mut huge = vec![0x02];
        huge.extend_from_slice(&(zmtp::MAX_FRAME + 1).to_be_bytes());
        s.write_all(&huge).await.unwrap();
        assert!(matches!(next(&mut rx).await, ReaderEvent::PeerDown));
        match next(&mut rx).await {
            ReaderEvent::Error(e) => assert!(e.contains("exceeds"), "{e}"),
            other => panic!("{other:?}"),
        }
        cancel.cancel();
    }
}
