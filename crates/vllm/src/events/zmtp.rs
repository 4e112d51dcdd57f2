//! ZMTP 3 (ZeroMQ's wire protocol, RFC 23/ZMTP) as a subscriber speaks it to a PUB over TCP
//! with the NULL mechanism: the greeting, the READY handshake, the subscription, and the frame
//! layout of everything that follows. Pure: callers own the socket and the buffers.
//!
//! Invariants: [`parse_frame`] reads only what its input holds and never allocates; a frame
//! larger than [`MAX_FRAME`] is an error, not an allocation. We announce ZMTP 3.0, so a 3.1
//! peer (libzmq 4.2 and later) takes subscriptions in the 3.0 form, a message whose first byte
//! is 1, which every ZMTP 3 publisher accepts.

use thiserror::Error;

/// The greeting both sides send first: signature, version, mechanism, as-server, filler.
pub const GREETING_LEN: usize = 64;

/// The largest frame body accepted (vLLM's batches are kilobytes; a bigger length is garbage
/// or hostile, and would otherwise be allocated for).
pub const MAX_FRAME: u64 = 256 << 20;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Why bytes from a peer are not the ZMTP this subscriber speaks.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum ZmtpError {
    #[error("not a ZMTP 3 greeting (signature or version {0}.x)")]
    Greeting(u8),
    #[error("peer asks for security mechanism {0:?}, only NULL is spoken")]
    Mechanism(String),
    #[error("reserved frame flags {0:#04x}")]
    Flags(u8),
    #[error("frame of {0} bytes exceeds the limit")]
    TooLarge(u64),
    #[error("malformed {0} command")]
    Command(&'static str),
    #[error("peer is a {0:?} socket, not a publisher")]
    SocketType(String),
    #[error("peer refused the handshake: {0}")]
    Refused(String),
    #[error("expected a READY command first")]
    NoReady,
}

/// Our greeting: ZMTP 3.0, NULL mechanism, client side.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Checks a peer's greeting (its first [`GREETING_LEN`] bytes): ZMTP 3.x with the NULL
/// mechanism.
pub fn check_greeting(g: &[u8]) -> Result<(), ZmtpError> {
    let Some(g) = g.first_chunk::<GREETING_LEN>() else {
        return Err(ZmtpError::Greeting(0));
    };
    if g[0] != 0xFF || g[9] & 0x01 == 0 || g[10] < 3 {
        return Err(ZmtpError::Greeting(g[10]));
    }
    let mechanism = &g[12..32];
    if mechanism != b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0" {
        let name = mechanism.split(|&b| b == 0).next().unwrap_or_default();
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(name).into_owned(),
        ));
    }
    Ok(())
}

/// Appends one frame (header and body).
pub fn write_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    let len = body.len() as u64;
    if len > 255 {
        out.push(flags | LONG);
        out.extend_from_slice(&len.to_be_bytes());
    } else {
        out.push(flags);
        out.push(len as u8);
    }
    out.extend_from_slice(body);
}

/// Our READY command, saying we are a SUB socket.
pub fn ready_sub() -> Vec<u8> {
    let mut body = Vec::with_capacity(32);
    body.push(5);
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"SUB");
    let mut out = Vec::with_capacity(body.len() + 2);
    write_frame(&mut out, COMMAND, &body);
    out
}

/// A subscription to `topic` (a prefix; empty takes everything), as a 3.0 message.
pub fn subscribe(topic: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(topic.len() + 1);
    body.push(1);
    body.extend_from_slice(topic);
    let mut out = Vec::with_capacity(body.len() + 9);
    write_frame(&mut out, 0, &body);
    out
}

/// Where one complete frame lies in a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHead {
    /// More frames of the same message follow.
    pub more: bool,
    /// A command (handshake, heartbeat), not message data.
    pub command: bool,
    /// Bytes of header before the body.
    pub header: usize,
    /// Bytes of body.
    pub body: usize,
}

impl FrameHead {
    /// Bytes of the whole frame: header and body.
    pub fn size(&self) -> usize {
        self.header + self.body
    }
}

/// The first frame of `buf`, if it is complete (`Ok(None)`: more bytes are needed).
pub fn parse_frame(buf: &[u8]) -> Result<Option<FrameHead>, ZmtpError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(MORE | LONG | COMMAND) != 0 {
        return Err(ZmtpError::Flags(flags));
    }
    let (header, size) = if flags & LONG != 0 {
        let Some(size) = buf.get(1..9) else {
            return Ok(None);
        };
        let mut be = [0u8; 8];
        be.copy_from_slice(size);
        (9, u64::from_be_bytes(be))
    } else {
        let Some(&size) = buf.get(1) else {
            return Ok(None);
        };
        (2, u64::from(size))
    };
    if size > MAX_FRAME {
        return Err(ZmtpError::TooLarge(size));
    }
    // At most MAX_FRAME, so it fits a usize on every target this builds for.
    let body = size as usize;
    if buf.len() < header + body {
        return Ok(None);
    }
    Ok(Some(FrameHead {
        more: flags & MORE != 0,
        command: flags & COMMAND != 0,
        header,
        body,
    }))
}

/// A command a publisher may send after the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command<'a> {
    /// The peer's READY, with its socket type.
    Ready { socket_type: &'a [u8] },
    /// A heartbeat to answer with [`pong`] and this context.
    Ping { context: &'a [u8] },
    /// The peer gives up on the connection.
    Error { reason: &'a [u8] },
    /// Anything else (PONG, SUBSCRIBE, ...): ignored.
    Other,
}

/// Reads a command frame's body.
pub fn parse_command(body: &[u8]) -> Result<Command<'_>, ZmtpError> {
    let (&n, rest) = body.split_first().ok_or(ZmtpError::Command("empty"))?;
    let name = rest.get(..n as usize).ok_or(ZmtpError::Command("name"))?;
    let data = &rest[n as usize..];
    match name {
        b"READY" => {
            let mut props = data;
            let mut socket_type = None;
            while let Some((&len, rest)) = props.split_first() {
                let key = rest
                    .get(..len as usize)
                    .ok_or(ZmtpError::Command("READY"))?;
                let rest = &rest[len as usize..];
                let vlen = rest.get(..4).ok_or(ZmtpError::Command("READY"))?;
                let vlen = u32::from_be_bytes([vlen[0], vlen[1], vlen[2], vlen[3]]) as usize;
                let value = rest.get(4..4 + vlen).ok_or(ZmtpError::Command("READY"))?;
                if key.eq_ignore_ascii_case(b"Socket-Type") {
                    socket_type = Some(value);
                }
                props = &rest[4 + vlen..];
            }
            Ok(Command::Ready {
                socket_type: socket_type.ok_or(ZmtpError::Command("READY"))?,
            })
        }
        b"PING" => {
            // Two bytes of TTL, then up to 16 bytes of context.
            let context = data.get(2..).ok_or(ZmtpError::Command("PING"))?;
            Ok(Command::Ping {
                context: &context[..context.len().min(16)],
            })
        }
        b"ERROR" => {
            let reason = match data.split_first() {
                Some((&len, rest)) => &rest[..rest.len().min(len as usize)],
                None => &[],
            };
            Ok(Command::Error { reason })
        }
        _ => Ok(Command::Other),
    }
}

/// Checks the peer's first command: a READY from a PUB or XPUB socket.
pub fn check_ready(body: &[u8]) -> Result<(), ZmtpError> {
    match parse_command(body)? {
        Command::Ready { socket_type } => {
            if socket_type == b"PUB" || socket_type == b"XPUB" {
                Ok(())
            } else {
                Err(ZmtpError::SocketType(
                    String::from_utf8_lossy(socket_type).into_owned(),
                ))
            }
        }
        Command::Error { reason } => Err(ZmtpError::Refused(
            String::from_utf8_lossy(reason).into_owned(),
        )),
        _ => Err(ZmtpError::NoReady),
    }
}

/// The PONG answering a PING with `context`.
pub fn pong(context: &[u8]) -> Vec<u8> {
    let mut body = Vec::with_capacity(5 + context.len());
    body.push(4);
    body.extend_from_slice(b"PONG");
    body.extend_from_slice(context);
    let mut out = Vec::with_capacity(body.len() + 2);
    write_frame(&mut out, COMMAND, &body);
    out
}

/// Appends one message (its frames, `MORE` on all but the last), as a publisher sends it: for
/// tests of readers and for fuzzing.
pub fn write_message<F: AsRef<[u8]>>(out: &mut Vec<u8>, frames: &[F]) {
    let last = frames.len().saturating_sub(1);
    for (i, f) in frames.iter().enumerate() {
        write_frame(out, if i < last { MORE } else { 0 }, f.as_ref());
    }
}

/// One message as borrowed frames.
pub type Frames<'a> = Vec<&'a [u8]>;

/// Splits `buf` into messages (frames of each), stopping at the first incomplete frame:
/// returns the messages and how many bytes they used. Commands are skipped. A reference
/// reader for tests and fuzzing; the subscriber slices its own buffer with [`parse_frame`].
pub fn split_messages(buf: &[u8]) -> Result<(Vec<Frames<'_>>, usize), ZmtpError> {
    let mut messages = Vec::new();
    let mut current = Vec::new();
    let mut at = 0;
    let mut done = 0;
    while let Some(head) = parse_frame(&buf[at..])? {
        let body = &buf[at + head.header..at + head.size()];
        at += head.size();
        if head.command {
            parse_command(body)?;
        } else {
            current.push(body);
            if !head.more {
                messages.push(std::mem::take(&mut current));
            }
        }
        if current.is_empty() {
            done = at;
        }
    }
    Ok((messages, done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn our_greeting_is_a_zmtp_3_0_null_client() {
        let g = greeting();
        assert_eq!(&g[..12], b"\xff\0\0\0\0\0\0\0\x01\x7f\x03\x00");
        assert_eq!(&g[12..17], b"NULL\0");
        assert!(g[32..].iter().all(|&b| b == 0));
        assert_eq!(check_greeting(&g), Ok(()));
        let mut curve = g;
        curve[12..17].copy_from_slice(b"CURVE");
        assert_eq!(
            check_greeting(&curve),
            Err(ZmtpError::Mechanism("CURVE".into()))
        );
        let mut v2 = g;
        v2[10] = 1;
        assert_eq!(check_greeting(&v2), Err(ZmtpError::Greeting(1)));
        assert_eq!(check_greeting(&g[..63]), Err(ZmtpError::Greeting(0)));
    }

    #[test]
    fn ready_round_trips_and_names_the_socket_type() {
        let ours = ready_sub();
        let head = parse_frame(&ours).unwrap().unwrap();
        assert!(head.command && !head.more && head.size() == ours.len());
        let body = &ours[head.header..];
        assert_eq!(
            parse_command(body),
            Ok(Command::Ready {
                socket_type: b"SUB"
            })
        );
        assert_eq!(check_ready(body), Err(ZmtpError::SocketType("SUB".into())));
        // libzmq's PUB READY (with an empty Identity property too).
        let mut pubr = vec![5];
        pubr.extend_from_slice(b"READY");
        pubr.push(11);
        pubr.extend_from_slice(b"Socket-Type");
        pubr.extend_from_slice(&3u32.to_be_bytes());
        pubr.extend_from_slice(b"PUB");
        pubr.push(8);
        pubr.extend_from_slice(b"Identity");
        pubr.extend_from_slice(&0u32.to_be_bytes());
        assert_eq!(check_ready(&pubr), Ok(()));
        assert_eq!(
            check_ready(&pubr[..pubr.len() - 3]),
            Err(ZmtpError::Command("READY"))
        );
        let mut err = vec![5];
        err.extend_from_slice(b"ERROR");
        err.push(3);
        err.extend_from_slice(b"bad");
        assert_eq!(check_ready(&err), Err(ZmtpError::Refused("bad".into())));
    }

    #[test]
    fn ping_gets_its_context_back() {
        let mut ping = vec![4];
        ping.extend_from_slice(b"PING");
        ping.extend_from_slice(&[0, 10]);
        ping.extend_from_slice(b"ctx");
        assert_eq!(parse_command(&ping), Ok(Command::Ping { context: b"ctx" }));
        let p = pong(b"ctx");
        assert_eq!(p, b"\x04\x08\x04PONGctx");
    }

    #[test]
    fn short_and_long_frames_and_the_limits() {
        let mut out = Vec::new();
        write_frame(&mut out, MORE, &[7u8; 255]);
        write_frame(&mut out, 0, &[8u8; 256]);
        let first = parse_frame(&out).unwrap().unwrap();
        assert_eq!((first.header, first.body, first.more), (2, 255, true));
        let second = parse_frame(&out[first.size()..]).unwrap().unwrap();
        assert_eq!((second.header, second.body, second.more), (9, 256, false));
        // Every proper prefix is incomplete, never an error.
        for cut in 0..out.len() - second.size() {
            assert_eq!(parse_frame(&out[..cut]), Ok(None), "cut {cut}");
        }
        assert_eq!(parse_frame(&[0x08, 0]), Err(ZmtpError::Flags(0x08)));
        let mut huge = vec![LONG];
        huge.extend_from_slice(&(MAX_FRAME + 1).to_be_bytes());
        assert_eq!(parse_frame(&huge), Err(ZmtpError::TooLarge(MAX_FRAME + 1)));
    }

    /// Seeded random messages, commands between them, cut at every byte: the reference splitter
    /// returns exactly the complete messages before the cut.
    #[test]
    fn split_messages_matches_what_was_written() {
        let mut rng = ChaCha8Rng::seed_from_u64(23);
        for _ in 0..200 {
            let mut out = Vec::new();
            let mut ends = Vec::new();
            let mut written: Vec<Vec<Vec<u8>>> = Vec::new();
            for _ in 0..rng.gen_range(1..6) {
                if rng.gen_bool(0.3) {
                    let mut ping = vec![4];
                    ping.extend_from_slice(b"PING\0\x01");
                    write_frame(&mut out, COMMAND, &ping);
                }
                let frames: Vec<Vec<u8>> = (0..rng.gen_range(1..4))
                    .map(|_| {
                        let len = if rng.gen_bool(0.2) {
                            rng.gen_range(256..700)
                        } else {
                            rng.gen_range(0..40)
                        };
                        (0..len).map(|_| rng.gen()).collect()
                    })
                    .collect();
                write_message(&mut out, &frames);
                ends.push(out.len());
                written.push(frames);
            }
            for cut in 0..=out.len() {
                let (got, used) = split_messages(&out[..cut]).unwrap();
                let complete = ends.iter().filter(|&&e| e <= cut).count();
                assert_eq!(got.len(), complete, "cut {cut}");
                for (g, w) in got.iter().zip(&written) {
                    assert_eq!(g.len(), w.len());
                    assert!(g.iter().zip(w).all(|(a, b)| a == &b.as_slice()));
                }
                // What is left after `used` holds no complete message.
                let floor = if complete == 0 { 0 } else { ends[complete - 1] };
                assert!(used >= floor && used <= cut, "cut {cut}: used {used}");
                assert!(split_messages(&out[used..cut]).unwrap().0.is_empty());
            }
        }
    }
}
