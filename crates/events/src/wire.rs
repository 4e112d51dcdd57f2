//! Adapter from raw ZMQ frames to sequence-numbered payloads, over
//! `kinference_vllm::events::frames` (which knows every layout vLLM has used).
//!
//! Invariant: a message whose sequence frame is readable yields its number even when the rest
//! is wrong, so the stream's sequence still advances past it and no false gap is reported.

use bytes::Bytes;
use kinference_vllm::events::frames::{self, LiveMessage};

/// A live or replayed message that carries a sequence number and a payload to decode.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct SeqMsg {
    pub seq: u64,
    pub payload: Bytes,
}

/// A message that could not be taken apart; `seq` is known when its sequence frame was readable.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct WireError {
    pub seq: Option<u64>,
    pub reason: String,
}

/// One replay reply message, as a DEALER receives it.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ReplayFrame {
    Batch(SeqMsg),
    End,
}

/// A live message: exactly `[topic, seq (8 bytes BE), payload]`. A non-empty `topic` must match
/// frame 0 exactly (ZMQ subscriptions only match prefixes).
pub(crate) fn parse_live(frames: &[Bytes], topic: &str) -> Result<SeqMsg, WireError> {
    // Salvaged from a malformed message so the stream's sequence still advances past it.
    let salvaged = frames
        .get(1)
        .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
        .map(u64::from_be_bytes);
    let fail = |reason: String| WireError {
        seq: salvaged,
        reason,
    };
    let LiveMessage {
        topic: got, seq, ..
    } = frames::parse_live(frames).map_err(|e| fail(e.to_string()))?;
    if !topic.is_empty() && got != topic {
        return Err(fail(format!("topic {got:?} is not {topic:?}")));
    }
    let payload = frames.get(2).cloned().unwrap_or_default();
    Ok(SeqMsg { seq, payload })
}

/// A replay reply as a DEALER receives it (empty delimiter first), in the 0.34
/// `[topic, seq, payload]` or the 0.11–0.24 `[seq, payload]` layout, or the end marker.
pub(crate) fn parse_replay(frames: &[Bytes]) -> Result<ReplayFrame, WireError> {
    match frames::parse_replay(frames) {
        Ok(frames::ReplayFrame::End) => Ok(ReplayFrame::End),
        Ok(frames::ReplayFrame::Batch { seq, payload, .. }) => Ok(ReplayFrame::Batch(SeqMsg {
            seq,
            payload: Bytes::copy_from_slice(payload),
        })),
        Err(e) => Err(WireError {
            seq: None,
            reason: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(parts: &[&[u8]]) -> Vec<Bytes> {
        parts.iter().map(|p| Bytes::copy_from_slice(p)).collect()
    }

    #[test]
    fn live_frames() {
        let seq = 7u64.to_be_bytes();
        let ok = parse_live(&f(&[b"kv", &seq, b"p"]), "kv").unwrap();
        assert_eq!((ok.seq, ok.payload.as_ref()), (7, b"p".as_ref()));
        assert!(parse_live(&f(&[b"other", &seq, b"p"]), "").is_ok());
        let not_utf8 = parse_live(&f(&[&[0xff], &seq, b"p"]), "").unwrap_err();
        assert_eq!(not_utf8.seq, Some(7));
        let wrong_topic = parse_live(&f(&[b"kv-x", &seq, b"p"]), "kv").unwrap_err();
        assert_eq!(wrong_topic.seq, Some(7));
        let four = parse_live(&f(&[b"kv", &seq, b"p", b"q"]), "kv").unwrap_err();
        assert_eq!(four.seq, Some(7));
        let short = parse_live(&f(&[b"kv", b"12"]), "kv").unwrap_err();
        assert_eq!(short.seq, None);
    }

    #[test]
    fn replay_layouts() {
        let seq = 3u64.to_be_bytes();
        let end = u64::MAX.to_be_bytes();
        let new = parse_replay(&f(&[b"", b"kv", &seq, b"p"])).unwrap();
        let old = parse_replay(&f(&[b"", &seq, b"p"])).unwrap();
        assert_eq!(new, old);
        assert_eq!(
            parse_replay(&f(&[b"", b"", &end, b""])).unwrap(),
            ReplayFrame::End
        );
        assert_eq!(
            parse_replay(&f(&[b"", &end, b""])).unwrap(),
            ReplayFrame::End
        );
        assert!(parse_replay(&f(&[b"", b"x"])).is_err());
    }
}
