//! One ext_proc stream (one per client request): the send side is a channel feeding the gRPC
//! request stream, the receive side tonic's response stream. Invariants: the stream half-closes
//! only when every sender clone is gone, so a task still streaming body chunks keeps it open;
//! every receive is bounded by the picker timeout; a graceful close half-closes and then drains
//! the picker's side so the picker sees a clean end of stream, never a reset.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

/// Messages queued toward the picker before the sender waits; small, so full-duplex body
/// streaming follows the gRPC stream's own flow control.
const SEND_QUEUE: usize = 16;

/// Why a picker stream failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PickerError {
    #[error("picker call failed: {0}")]
    Status(#[from] tonic::Status),
    #[error("picker ended the stream before the exchange was complete")]
    Closed,
    #[error("picker did not answer within {0:?}")]
    Timeout(Duration),
    #[error("picker broke the protocol: {0}")]
    Protocol(String),
}

/// When the last message went into the stream; shared with sender tasks.
#[derive(Clone, Debug)]
pub(crate) struct LastSent(Arc<Mutex<Instant>>);

impl LastSent {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Instant::now())))
    }

    pub(crate) fn mark(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    pub(crate) fn get(&self) -> Instant {
        *self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The send half before the call is made: messages may be queued (or a task may start
/// streaming) before the picker's response headers arrive, as a picker that answers only after
/// the whole body would otherwise never answer.
#[derive(Debug)]
pub(crate) struct Outbox {
    pub(crate) tx: mpsc::Sender<ProcessingRequest>,
    pub(crate) last_sent: LastSent,
    rx: mpsc::Receiver<ProcessingRequest>,
}

impl Outbox {
    pub(crate) fn new() -> Self {
        let (tx, rx) = mpsc::channel(SEND_QUEUE);
        Self {
            tx,
            rx,
            last_sent: LastSent::new(),
        }
    }

    /// Starts the call; the queued messages and any running sender feed it.
    pub(crate) async fn open(
        self,
        client: &ExternalProcessorClient<Channel>,
        timeout: Duration,
    ) -> Result<Exchange, PickerError> {
        let mut client = client.clone();
        let call = client.process(ReceiverStream::new(self.rx));
        let rx = match tokio::time::timeout(timeout, call).await {
            Err(_) => return Err(PickerError::Timeout(timeout)),
            Ok(r) => r?.into_inner(),
        };
        Ok(Exchange {
            tx: self.tx,
            rx,
            timeout,
            last_sent: self.last_sent,
        })
    }
}

/// An open ext_proc stream.
#[derive(Debug)]
pub(crate) struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
    timeout: Duration,
    pub(crate) last_sent: LastSent,
}

impl Exchange {
    pub(crate) async fn send(&self, msg: ProcessingRequest) -> Result<(), PickerError> {
        send(&self.tx, &self.last_sent, msg).await
    }

    /// A sender for a task that streams body chunks while this side reads answers.
    pub(crate) fn sender(&self) -> (mpsc::Sender<ProcessingRequest>, LastSent) {
        (self.tx.clone(), self.last_sent.clone())
    }

    pub(crate) async fn recv(&mut self) -> Result<ProcessingResponse, PickerError> {
        match tokio::time::timeout(self.timeout, self.rx.message()).await {
            Err(_) => Err(PickerError::Timeout(self.timeout)),
            Ok(Err(status)) => Err(PickerError::Status(status)),
            Ok(Ok(None)) => Err(PickerError::Closed),
            Ok(Ok(Some(m))) => Ok(m),
        }
    }

    /// Half-closes our side and waits (bounded) for the picker to end its side. Sender clones
    /// handed out must be gone first or the half-close waits for them.
    pub(crate) async fn close(self) {
        let Exchange {
            tx,
            mut rx,
            timeout,
            ..
        } = self;
        drop(tx);
        let drain = async { while let Ok(Some(_)) = rx.message().await {} };
        if tokio::time::timeout(timeout, drain).await.is_err() {
            tracing::debug!("picker kept its side of a finished stream open; dropping it");
        }
    }
}

pub(crate) async fn send(
    tx: &mpsc::Sender<ProcessingRequest>,
    last_sent: &LastSent,
    msg: ProcessingRequest,
) -> Result<(), PickerError> {
    tx.send(msg).await.map_err(|_| PickerError::Closed)?;
    last_sent.mark();
    Ok(())
}
