//! Reading and writing a `TcpStream` shared by reference (between a connection and the request
//! or response body using it at the moment) by readiness, from whichever task polls: the
//! HTTP/1.1 paths towards clients (`h1`) and replicas (`link`).
//!
//! Invariant: a read never blocks and never reads past the buffer's spare capacity; `Pending`
//! is returned only with the caller's waker registered for the socket's next readiness.

use std::io;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::net::TcpStream;

/// How much a read buffer grows by when less than 4 KiB of it is free.
pub(crate) const READ_CHUNK: usize = 16 * 1024;

/// Reads what the socket has into `buf`: the bytes read, 0 at the end of the stream.
pub(crate) fn poll_read_buf(
    tcp: &TcpStream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    loop {
        ready!(tcp.poll_read_ready(cx))?;
        if buf.capacity() - buf.len() < 4096 {
            buf.reserve(READ_CHUNK);
        }
        match tcp.try_read_buf(buf) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return Poll::Ready(r),
        }
    }
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
