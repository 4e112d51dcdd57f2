//! Reads vLLM's KV-event log back through its replay ROUTER, independently of the event plane.
//!
//! vLLM keeps its last `buffer_steps` batches; a DEALER sends `[b"", start_seq]` and receives
//! every buffered batch with `seq >= start_seq`, then an end marker. The tests use this as the
//! ground truth of what the engine published, so it shares no code with the subscriber under
//! test beyond the frame parser and msgpack decoder of `kinference-vllm` (which the golden
//! vectors test on their own).

use std::time::Duration;

use bytes::Bytes;
use kinference_vllm::{decode_batch, parse_replay, KvEventBatch, ReplayFrame};
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

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
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut socket = DealerSocket::with_options(options);
    tokio::time::timeout(timeout, socket.connect(endpoint))
        .await
        .map_err(|_| fail(format!("connect timed out after {timeout:?}")))?
        .map_err(|e| fail(format!("connect: {e}")))?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ])
    .map_err(|e| fail(format!("building the request: {e:?}")))?;
    socket
        .send(request)
        .await
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
        let frames = msg.into_vec();
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
    drop(socket.close().await);
    Ok(out)
}
