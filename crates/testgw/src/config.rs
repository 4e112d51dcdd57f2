//! Gateway configuration: where the picker is, how bodies travel over ext_proc, which endpoints
//! exist. Invariant: `endpoints` is the whole pool the gateway knows; a pick outside it is an error
//! (unless the list is empty, which turns validation off and leaves fail-open with nowhere to go).

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::time::Duration;

/// How the request body goes to the picker (Envoy's `processing_mode.request_body_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum RequestBodyMode {
    /// `FULL_DUPLEX_STREAMED`: chunks go out without waiting; the body that goes upstream is the
    /// one the picker streams back in `StreamedBodyResponse`s. What GIE gateways and llm-d use.
    #[default]
    FullDuplexStreamed,
    /// `BUFFERED`: the whole body in one message after the headers were answered; the picker's
    /// reply replaces the body only if it carries a body mutation.
    Buffered,
}

/// How the response body goes to the picker (Envoy's `processing_mode.response_body_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ResponseBodyMode {
    /// `NONE`: the response body goes straight to the client; the picker sees only headers.
    None,
    /// `STREAMED`: each chunk goes to the picker and waits for its answer; the original chunk
    /// passes unless the answer mutates it.
    Streamed,
    /// `FULL_DUPLEX_STREAMED`: chunks go out without waiting; the client gets what the picker
    /// streams back.
    #[default]
    FullDuplexStreamed,
}

/// A mode name that is not one of the accepted spellings.
#[derive(Debug, thiserror::Error)]
#[error("unknown body mode {0:?}")]
pub struct UnknownMode(pub String);

impl FromStr for RequestBodyMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "full-duplex" | "full-duplex-streamed" => Ok(Self::FullDuplexStreamed),
            "buffered" => Ok(Self::Buffered),
            _ => Err(UnknownMode(s.to_owned())),
        }
    }
}

impl FromStr for ResponseBodyMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "none" => Ok(Self::None),
            "streamed" => Ok(Self::Streamed),
            "full-duplex" | "full-duplex-streamed" => Ok(Self::FullDuplexStreamed),
            _ => Err(UnknownMode(s.to_owned())),
        }
    }
}

impl fmt::Display for RequestBodyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::FullDuplexStreamed => "full-duplex",
            Self::Buffered => "buffered",
        })
    }
}

impl fmt::Display for ResponseBodyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::None => "none",
            Self::Streamed => "streamed",
            Self::FullDuplexStreamed => "full-duplex",
        })
    }
}

/// Everything the gateway needs; `GatewayConfig::new` gives the defaults.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// The picker's gRPC address: `host:port` or a full `http://host:port` URI.
    pub picker: String,
    pub request_body_mode: RequestBodyMode,
    pub response_body_mode: ResponseBodyMode,
    /// Largest request-body chunk sent to the picker in full-duplex mode (at least 1).
    pub chunk_size: usize,
    /// Subset hint sent on every request unless the request carries `x-test-subset`.
    pub subset_hint: Option<Vec<String>>,
    /// Buffered mode: send the body right after the headers instead of waiting for the
    /// headers' answer (Envoy's `send_body_without_waiting_for_header_response`; pickers that
    /// answer the headers only once they have the body need it).
    pub send_body_without_waiting: bool,
    /// Route on our own (round robin over `endpoints`) when the picker is unreachable or fails
    /// before naming a destination; otherwise answer 503.
    pub fail_open: bool,
    /// The pool: picks are validated against it and fail-open routes over it.
    pub endpoints: Vec<SocketAddr>,
    /// Longest wait for any one picker message (Envoy's `message_timeout`).
    pub picker_timeout: Duration,
    pub upstream_connect_timeout: Duration,
    /// Longest wait for an endpoint's response head.
    pub upstream_response_timeout: Duration,
}

/// Default full-duplex chunk size, about what Envoy hands the filter per read.
pub const DEFAULT_CHUNK_SIZE: usize = 16 * 1024;

impl GatewayConfig {
    pub fn new(picker: impl Into<String>, endpoints: Vec<SocketAddr>) -> Self {
        Self {
            picker: picker.into(),
            request_body_mode: RequestBodyMode::default(),
            response_body_mode: ResponseBodyMode::default(),
            chunk_size: DEFAULT_CHUNK_SIZE,
            subset_hint: None,
            send_body_without_waiting: false,
            fail_open: false,
            endpoints,
            picker_timeout: Duration::from_secs(10),
            upstream_connect_timeout: Duration::from_secs(2),
            upstream_response_timeout: Duration::from_secs(300),
        }
    }

    pub(crate) fn picker_uri(&self) -> String {
        if self.picker.contains("://") {
            self.picker.clone()
        } else {
            format!("http://{}", self.picker)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_their_cli_spellings() {
        assert_eq!(
            "full-duplex".parse::<RequestBodyMode>().ok(),
            Some(RequestBodyMode::FullDuplexStreamed)
        );
        assert_eq!(
            "BUFFERED".parse::<RequestBodyMode>().ok(),
            Some(RequestBodyMode::Buffered)
        );
        assert_eq!(
            "FULL_DUPLEX_STREAMED".parse::<ResponseBodyMode>().ok(),
            Some(ResponseBodyMode::FullDuplexStreamed)
        );
        assert_eq!(
            "none".parse::<ResponseBodyMode>().ok(),
            Some(ResponseBodyMode::None)
        );
        assert!("streamed".parse::<RequestBodyMode>().is_err());
        assert_eq!(
            GatewayConfig::new("1.2.3.4:5", vec![]).picker_uri(),
            "http://1.2.3.4:5"
        );
    }
}
