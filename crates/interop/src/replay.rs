//! Reads vLLM's KV-event log back through its replay ROUTER, independently of the event plane.
//!
//! vLLM keeps its last `buffer_steps` batches; a DEALER sends `[b"", start_seq]` and receives
//! every buffered batch with `seq >= start_seq`, then an end marker. The tests use this as the
//! ground truth of what the engine published, so it shares no code with the subscriber under
//! test beyond the frame parser and msgpack decoder of `kinference-vllm` (which the golden
//! vectors test on their own).

use std::time::Duration;

use kinference_events::socket::{SocketType, ZmqSocket};
use kinference_vllm::{decode_batch, parse_replay, KvEventBatch, ReplayFrame};

use crate::error::InteropError;

/// One batch as the replay socket returned it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayedBatch {
    pub seq: u64,
    pub topic: Option<String>,
    pub batch: KvEventBatch,
}

/// Every buffered batch with `seq >= start_seq`, in the order vLLM sent them. `timeout` bounds
/// the connection and each wait for the next reply message.
pub async fn fetch_replay(
    endpoint: &str,
    start_seq: u64,
    timeout: Duration,
) -> Result<Vec<ReplayedBatch>, InteropError> {
    let fail = |reason: String| InteropError::Replay {
        endpoint: endpoint.to_owned(),
        reason,
    };
    let mut socket = ZmqSocket::new(SocketType::DEALER).map_err(|e| fail(e.to_string()))?;
    socket.connect(endpoint).map_err(|e| fail(e.to_string()))?;
    // The DEALER dials in the background; the request waits for the connection.
    let request: [&[u8]; 2] = [b"", &start_seq.to_be_bytes()];
    tokio::time::timeout(timeout, socket.send(&request))
        .await
        .map_err(|_| fail(format!("not connected within {timeout:?}")))?
        .map_err(|e| fail(format!("send: {e}")))?;
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(timeout, socket.recv())
            .await
            .map_err(|_| {
                fail(format!(
                    "no reply within {timeout:?} after {} batches",
                    out.len()
                ))
            })?
            .map_err(|e| fail(format!("recv: {e}")))?;
        let frames = msg;
        match parse_replay(&frames).map_err(|e| fail(format!("frames: {e}")))? {
            ReplayFrame::End => break,
            ReplayFrame::Batch {
                topic,
                seq,
                payload,
            } => {
                let batch =
                    decode_batch(payload).map_err(|e| fail(format!("batch seq {seq}: {e}")))?;
                out.push(ReplayedBatch {
                    seq,
                    topic: topic.map(str::to_owned),
                    batch,
                });
            }
        }
    }
    Ok(out)
}
