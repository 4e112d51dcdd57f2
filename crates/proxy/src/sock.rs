//! Reading and writing a `TcpStream` shared by reference (between a connection and the request
//! or response body using it at the moment) by readiness, from whichever task polls: the
//! HTTP/1.1 paths towards clients (`h1`) and replicas (`link`), and the one header value both
//! parse the same way (`Content-Length`).
//!
//! Invariant: a read never blocks and never reads past the buffer's spare capacity or the
//! bytes asked for; `Pending` is returned only with the caller's waker registered for the
//! socket's next readiness; a read that drained the socket leaves its readiness cleared (see
//! `read_draining`).

use std::io;
use std::task::{ready, Context, Poll};

use bytes::{BufMut, BytesMut};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// How much a read buffer grows by when less than 4 KiB of it is free.
pub(crate) const READ_CHUNK: usize = 16 * 1024;

/// Reads what the socket has into `buf`: the bytes read, 0 at the end of the stream.
pub(crate) fn poll_read_buf(
    tcp: &TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    poll_read_at_most(tcp, buf, usize::MAX, cx)
}

/// Reads into `buf` what the socket has, at most `max` bytes (never past them: what follows
/// may be the next request's, which the connection reads): the bytes read, 0 at the end of the
/// stream. Room is made only once the socket is ready, so a wait allocates nothing: a buffer
/// with less than 4 KiB (or `max`) free grows by `READ_CHUNK` (or `max`, when less), and the
/// bytes land in its uninitialized capacity.
pub(crate) fn poll_read_at_most(
    tcp: &TcpStream,
    buf: &mut BytesMut,
    max: usize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    let grow = max.min(READ_CHUNK);
    loop {
        ready!(tcp.poll_read_ready(cx))?;
        if buf.capacity() - buf.len() < grow.min(4096) {
            buf.reserve(grow);
        }
        let asked = (buf.capacity() - buf.len()).min(max);
        let mut room = (&mut *buf).limit(max);
        match read_draining(tcp, asked, || tcp.try_read_buf(&mut room)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return Poll::Ready(r),
        }
    }
}

/// One `read` of at most `asked` bytes; when it returns fewer (and more than none), the
/// socket's receive queue was empty at its end, so the socket's read readiness is cleared
/// with it. Without that, the next wait for bytes (the next request's head, the next
/// response) found the readiness of the bytes just read still set and paid a `recv` that
/// returned `EWOULDBLOCK` before waiting: one wasted system call per read on each side.
/// Safe against bytes that arrive meanwhile: tokio clears only the readiness it had seen
/// before the read began, and bytes arriving after it are a new edge of the socket's
/// edge-triggered registration.
fn read_draining(
    tcp: &TcpStream,
    asked: usize,
    read: impl FnOnce() -> io::Result<usize>,
) -> io::Result<usize> {
    let mut short = None;
    let r = tcp.try_io(Interest::READABLE, || {
        let n = read()?;
        if n > 0 && n < asked {
            short = Some(n);
            // Makes `try_io` clear the readiness it saw; the bytes are returned below.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(n)
    });
    match (r, short) {
        (Err(e), Some(n)) if e.kind() == io::ErrorKind::WouldBlock => Ok(n),
        (r, _) => r,
    }
}

/// A `Content-Length` value: digits only (after the whitespace around it), `None` otherwise.
pub(crate) fn content_length(value: &[u8]) -> Option<u64> {
    std::str::from_utf8(value)
        .ok()
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
}

/// Writes all of `bytes`, waiting for the socket's room as needed.
pub(crate) async fn write_all(tcp: &TcpStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match tcp.try_write(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = bytes.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tcp.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `parts` in order, in vectored writes: a request's head and body leave in one
/// system call and one segment without being copied into one buffer first.
pub(crate) async fn write_all_vectored<const N: usize>(
    tcp: &TcpStream,
    parts: [&[u8]; N],
) -> io::Result<()> {
    let mut slices = parts.map(io::IoSlice::new);
    let mut rest = &mut slices[..];
    while rest.iter().any(|s| !s.is_empty()) {
        match tcp.try_write_vectored(rest) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut rest, n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => tcp.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    async fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let near = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (far, _) = l.accept().await.unwrap();
        (near, far)
    }

    /// Whether the socket's readiness is set now, without a system call.
    fn ready_now(tcp: &TcpStream) -> bool {
        let waker = std::task::Waker::noop();
        tcp.poll_read_ready(&mut Context::from_waker(waker))
            .is_ready()
    }

    #[tokio::test]
    async fn a_short_read_clears_readiness_and_later_bytes_still_wake() {
        let (near, mut far) = pair().await;
        let mut buf = BytesMut::new();
        for round in 0..3u8 {
            let sent = vec![b'a' + round; 100];
            far.write_all(&sent).await.unwrap();
            let mut got = 0;
            while got < sent.len() {
                got += poll_fn(|cx| poll_read_buf(&near, &mut buf, cx))
                    .await
                    .unwrap();
            }
            assert_eq!(&buf[buf.len() - 100..], &sent[..]);
            // Drained: waiting for the next bytes costs no read that finds none.
            assert!(!ready_now(&near), "round {round}");
        }
        let mut dst = BytesMut::with_capacity(64);
        far.write_all(b"0123456789").await.unwrap();
        // A full read leaves readiness set: more may be queued, as here. The buffer has room
        // for all ten bytes; only eight are asked for, and only eight are taken.
        let n = poll_fn(|cx| poll_read_at_most(&near, &mut dst, 8, cx))
            .await
            .unwrap();
        assert_eq!((n, &dst[..]), (8, &b"01234567"[..]));
        assert!(ready_now(&near));
        let n = poll_fn(|cx| poll_read_at_most(&near, &mut dst, 8, cx))
            .await
            .unwrap();
        assert_eq!((n, &dst[..]), (2, &b"0123456789"[..]));
        assert!(!ready_now(&near));
        drop(far);
        let n = poll_fn(|cx| poll_read_at_most(&near, &mut dst, 8, cx))
            .await
            .unwrap();
        assert_eq!(n, 0, "the end of the stream");
    }

    /// Parts larger than the socket takes at once (so writes stop part-way through a part and
    /// wait for room), an empty part among them, and a tiny one after: every byte arrives, in
    /// order.
    #[tokio::test]
    async fn vectored_writes_deliver_every_part_in_order_across_partial_writes() {
        use tokio::io::AsyncReadExt;
        let (near, mut far) = pair().await;
        let part = |len: usize, seed: u8| -> Vec<u8> {
            (0..len)
                .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
                .collect()
        };
        let (a, b, c) = (part(3 << 20, 1), part(5 << 20, 2), part(7, 3));
        let expected = [&a[..], &b[..], &c[..]].concat();
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            far.read_to_end(&mut got).await.unwrap();
            got
        });
        write_all_vectored(&near, [&a[..], &[], &b[..], &c[..]])
            .await
            .unwrap();
        drop(near);
        let got = reader.await.unwrap();
        assert_eq!(got.len(), expected.len());
        assert!(got == expected, "the bytes arrived out of order");
    }
}
