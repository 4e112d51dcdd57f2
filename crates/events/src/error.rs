//! Errors of the event plane; each variant has a stable label for metrics and logs.

use std::time::Duration;

use kinference_index::WorkerId;

#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid endpoint {endpoint:?}: {reason}")]
    Endpoint { endpoint: String, reason: String },
    #[error("worker {0:?} is already subscribed")]
    DuplicateWorker(WorkerId),
    #[error("worker {0:?} is not subscribed")]
    UnknownWorker(WorkerId),
    #[error("the event plane is shut down")]
    ShutDown,
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    #[error("zmq: {0}")]
    Zmq(String),
}

impl EventsError {
    /// A stable, low-cardinality label.
    pub fn label(&self) -> &'static str {
        match self {
            EventsError::Config(_) => "config",
            EventsError::Endpoint { .. } => "endpoint",
            EventsError::DuplicateWorker(_) => "duplicate_worker",
            EventsError::UnknownWorker(_) => "unknown_worker",
            EventsError::ShutDown => "shut_down",
            EventsError::Timeout(_) => "timeout",
            EventsError::Zmq(_) => "zmq",
        }
    }
}
