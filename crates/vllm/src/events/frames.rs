//! ZMQ multipart framing of vLLM's KV-event stream: live messages, replay requests and replies,
//! and the length-prefixed capture format used by the golden files.
//!
//! Parsers borrow from the frames they are given (no copies) and accept any frame container
//! (`Vec<Vec<u8>>`, `[&[u8]]`, ZMQ message types implementing `AsRef<[u8]>`).
//!
//! The empty delimiter frame: a ROUTER socket addresses replies as `[identity, b"", ...]`. A
//! DEALER client receives the `b""` as a frame of its own; a REQ client has it stripped. The
//! replay parser accepts both, and does not need to know which socket was used:
//!
//! | frames | 0.34 via DEALER | 0.34 via REQ / 0.11–0.24 via DEALER | 0.11–0.24 via REQ |
//! |---|---|---|---|
//! | batch | `["", topic, seq, payload]` | `[topic, seq, payload]` / `["", seq, payload]` | `[seq, payload]` |
//! | end | `["", "", ff×8, ""]` | `["", ff×8, ""]` | `[ff×8, ""]` |
//!
//! The middle column is one shape: an old reply read with its delimiter is exactly a 0.34 reply
//! with the default empty topic read without it, so both parse the same way.

use thiserror::Error;

/// The sequence number vLLM's replay socket sends to mark the end of a reply
/// (`(-1).to_bytes(8, "big", signed=True)`).
pub const END_SEQ: u64 = u64::MAX;

/// Why a multipart message is not a KV-event message.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("expected {expected} frames, got {got}")]
    FrameCount { expected: &'static str, got: usize },
    #[error("sequence frame has {len} bytes, expected 8")]
    SeqLength { len: usize },
    #[error("topic frame is not UTF-8")]
    TopicNotUtf8,
    #[error("expected an empty delimiter frame, got {len} bytes")]
    Delimiter { len: usize },
    #[error("length-prefixed capture truncated at byte {offset}")]
    Truncated { offset: usize },
}

impl FrameError {
    /// A stable, low-cardinality label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            FrameError::FrameCount { .. } => "frame_count",
            FrameError::SeqLength { .. } => "seq_length",
            FrameError::TopicNotUtf8 => "topic_not_utf8",
            FrameError::Delimiter { .. } => "delimiter",
            FrameError::Truncated { .. } => "truncated",
        }
    }
}

/// One message from the PUB socket: `[topic, seq (8 bytes BE), payload]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveMessage<'a> {
    pub topic: &'a str,
    pub seq: u64,
    /// The msgpack batch; decode with [`crate::events::codec::decode_batch`].
    pub payload: &'a [u8],
}

/// One message from the replay socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayFrame<'a> {
    /// A buffered batch. `topic` is `None` in the two-frame `[seq, payload]` form, and `""` for
    /// the pre-0.34 three-frame form (indistinguishable from 0.34's default topic).
    Batch {
        topic: Option<&'a str>,
        seq: u64,
        payload: &'a [u8],
    },
    /// The end marker: nothing more follows for this request.
    End,
}

/// Parses a live message. Exactly three frames are expected, as a SUB socket receives them.
pub fn parse_live<F: AsRef<[u8]>>(frames: &[F]) -> Result<LiveMessage<'_>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(LiveMessage {
            topic: topic_str(topic.as_ref())?,
            seq: seq_of(seq.as_ref())?,
            payload: payload.as_ref(),
        }),
        _ => Err(FrameError::FrameCount {
            expected: "3",
            got: frames.len(),
        }),
    }
}

/// Parses one replay reply message, in any of the layouts in the module table. A sequence of
/// [`END_SEQ`] is the end marker whatever the payload frame holds.
pub fn parse_replay<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayFrame<'_>, FrameError> {
    let (topic, seq, payload) = match frames {
        [delim, topic, seq, payload] => {
            expect_delimiter(delim.as_ref())?;
            (Some(topic.as_ref()), seq.as_ref(), payload.as_ref())
        }
        [topic, seq, payload] => (Some(topic.as_ref()), seq.as_ref(), payload.as_ref()),
        [seq, payload] => (None, seq.as_ref(), payload.as_ref()),
        _ => {
            return Err(FrameError::FrameCount {
                expected: "2 to 4",
                got: frames.len(),
            })
        }
    };
    let seq = seq_of(seq)?;
    if seq == END_SEQ {
        return Ok(ReplayFrame::End);
    }
    Ok(ReplayFrame::Batch {
        topic: topic.map(topic_str).transpose()?,
        seq,
        payload,
    })
}

/// The frames a DEALER sends to ask for every buffered batch with `seq >= start_seq`:
/// `[b"", start_seq (8 bytes BE)]`. A REQ socket adds the delimiter itself: send only the
/// second frame there.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// Parses a replay request as a ROUTER sees it after the identity frame: `[b"", seq]`, or
/// `[seq]` when the delimiter has already been taken off.
pub fn parse_replay_request<F: AsRef<[u8]>>(frames: &[F]) -> Result<u64, FrameError> {
    match frames {
        [delim, seq] => {
            expect_delimiter(delim.as_ref())?;
            seq_of(seq.as_ref())
        }
        [seq] => seq_of(seq.as_ref()),
        _ => Err(FrameError::FrameCount {
            expected: "1 or 2",
            got: frames.len(),
        }),
    }
}

/// The frames of a live message, as vLLM's PUB socket sends them.
pub fn live_frames(topic: &str, seq: u64, payload: &[u8]) -> [Vec<u8>; 3] {
    [
        topic.as_bytes().to_vec(),
        seq.to_be_bytes().to_vec(),
        payload.to_vec(),
    ]
}

/// One 0.34 replay reply after the ROUTER's identity frame: `[b"", topic, seq, payload]`.
pub fn replay_batch_frames(topic: &str, seq: u64, payload: &[u8]) -> [Vec<u8>; 4] {
    [
        Vec::new(),
        topic.as_bytes().to_vec(),
        seq.to_be_bytes().to_vec(),
        payload.to_vec(),
    ]
}

/// The 0.34 end marker after the ROUTER's identity frame: `[b"", b"", ff×8, b""]`.
pub fn replay_end_frames() -> [Vec<u8>; 4] {
    [
        Vec::new(),
        Vec::new(),
        END_SEQ.to_be_bytes().to_vec(),
        Vec::new(),
    ]
}

/// Splits a capture of one multipart message stored as frames of `u32 BE length + bytes`
/// (`msg_NNNN.bin`, `replay_NNNN.bin`). A capture ending inside a frame is an error; an empty
/// capture is zero frames.
pub fn parse_length_prefixed(bytes: &[u8]) -> Result<Vec<&[u8]>, FrameError> {
    // Every frame costs at least its 4-byte header, which bounds the preallocation.
    let mut frames = Vec::with_capacity(bytes.len() / 4);
    let mut rest = bytes;
    while !rest.is_empty() {
        let offset = bytes.len() - rest.len();
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            return Err(FrameError::Truncated { offset });
        };
        let len = u32::from_be_bytes(*len) as usize;
        let Some(frame) = tail.get(..len) else {
            return Err(FrameError::Truncated { offset });
        };
        frames.push(frame);
        rest = tail.get(len..).unwrap_or_default();
    }
    Ok(frames)
}

/// The inverse of [`parse_length_prefixed`]. Frames over `u32::MAX` bytes are cut to fit.
pub fn encode_length_prefixed<F: AsRef<[u8]>>(frames: &[F]) -> Vec<u8> {
    let total = frames.iter().map(|f| 4 + f.as_ref().len()).sum();
    let mut out = Vec::with_capacity(total);
    for frame in frames {
        let frame = frame.as_ref();
        let len = frame.len().min(u32::MAX as usize);
        out.extend_from_slice(&(len as u32).to_be_bytes());
        out.extend_from_slice(frame.get(..len).unwrap_or_default());
    }
    out
}

fn seq_of(frame: &[u8]) -> Result<u64, FrameError> {
    frame
        .first_chunk::<8>()
        .filter(|_| frame.len() == 8)
        .map(|b| u64::from_be_bytes(*b))
        .ok_or(FrameError::SeqLength { len: frame.len() })
}

fn topic_str(frame: &[u8]) -> Result<&str, FrameError> {
    std::str::from_utf8(frame).map_err(|_| FrameError::TopicNotUtf8)
}

fn expect_delimiter(frame: &[u8]) -> Result<(), FrameError> {
    if frame.is_empty() {
        Ok(())
    } else {
        Err(FrameError::Delimiter { len: frame.len() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEQ7: [u8; 8] = [0, 0, 0, 0, 0, 0, 0, 7];
    const END: [u8; 8] = [0xff; 8];

    #[test]
    fn live_messages_need_three_frames_and_an_eight_byte_seq() {
        let frames = live_frames("kv-events", 7, b"payload");
        let msg = parse_live(&frames).unwrap();
        assert_eq!(
            msg,
            LiveMessage {
                topic: "kv-events",
                seq: 7,
                payload: b"payload"
            }
        );
        let short: [&[u8]; 2] = [b"t", &SEQ7];
        assert_eq!(
            parse_live(&short),
            Err(FrameError::FrameCount {
                expected: "3",
                got: 2
            })
        );
        let bad_seq: [&[u8]; 3] = [b"t", &SEQ7[1..], b"p"];
        assert_eq!(parse_live(&bad_seq), Err(FrameError::SeqLength { len: 7 }));
        let bad_topic: [&[u8]; 3] = [&[0xff], &SEQ7, b"p"];
        assert_eq!(parse_live(&bad_topic), Err(FrameError::TopicNotUtf8));
    }

    #[test]
    fn replay_replies_parse_in_every_layout_with_or_without_delimiter() {
        let batch = |topic| ReplayFrame::Batch {
            topic,
            seq: 7,
            payload: b"p",
        };
        let v034_dealer: [&[u8]; 4] = [b"", b"kv", &SEQ7, b"p"];
        let v034_req: [&[u8]; 3] = [b"kv", &SEQ7, b"p"];
        let old_dealer: [&[u8]; 3] = [b"", &SEQ7, b"p"];
        let old_req: [&[u8]; 2] = [&SEQ7, b"p"];
        assert_eq!(parse_replay(&v034_dealer), Ok(batch(Some("kv"))));
        assert_eq!(parse_replay(&v034_req), Ok(batch(Some("kv"))));
        assert_eq!(parse_replay(&old_dealer), Ok(batch(Some(""))));
        assert_eq!(parse_replay(&old_req), Ok(batch(None)));
        let built = replay_batch_frames("kv", 7, b"p");
        assert_eq!(parse_replay(&built), Ok(batch(Some("kv"))));

        let end_034_dealer: [&[u8]; 4] = [b"", b"", &END, b""];
        let end_old_dealer: [&[u8]; 3] = [b"", &END, b""];
        let end_old_req: [&[u8]; 2] = [&END, b""];
        for end in [
            &end_034_dealer[..],
            &end_034_dealer[1..],
            &end_old_dealer[..],
            &end_old_req[..],
        ] {
            assert_eq!(parse_replay(end), Ok(ReplayFrame::End));
        }
        assert_eq!(parse_replay(&replay_end_frames()), Ok(ReplayFrame::End));

        let no_delim: [&[u8]; 4] = [b"x", b"kv", &SEQ7, b"p"];
        assert_eq!(
            parse_replay(&no_delim),
            Err(FrameError::Delimiter { len: 1 })
        );
        let five: [&[u8]; 5] = [b""; 5];
        assert!(matches!(
            parse_replay(&five),
            Err(FrameError::FrameCount { got: 5, .. })
        ));
        let one: [&[u8]; 1] = [&SEQ7];
        assert!(parse_replay(&one).is_err());
    }

    #[test]
    fn replay_requests_round_trip() {
        let req = replay_request(42);
        assert_eq!(req[0], b"");
        assert_eq!(req[1], 42u64.to_be_bytes());
        assert_eq!(parse_replay_request(&req), Ok(42));
        assert_eq!(parse_replay_request(&req[1..]), Ok(42));
        let bad: [&[u8]; 2] = [b"x", &SEQ7];
        assert_eq!(
            parse_replay_request(&bad),
            Err(FrameError::Delimiter { len: 1 })
        );
        assert!(parse_replay_request::<&[u8]>(&[]).is_err());
    }

    #[test]
    fn length_prefixed_captures_round_trip_and_reject_truncation() {
        let frames: [&[u8]; 3] = [b"", b"kv-events", &SEQ7];
        let bytes = encode_length_prefixed(&frames);
        assert_eq!(&bytes[..8], &[0, 0, 0, 0, 0, 0, 0, 9]);
        assert_eq!(parse_length_prefixed(&bytes).unwrap(), frames);
        assert_eq!(parse_length_prefixed(&[]).unwrap(), Vec::<&[u8]>::new());
        assert_eq!(
            parse_length_prefixed(&bytes[..6]),
            Err(FrameError::Truncated { offset: 4 })
        );
        assert_eq!(
            parse_length_prefixed(&[0, 0, 0xff, 0xff, 1]),
            Err(FrameError::Truncated { offset: 0 })
        );
    }
}
