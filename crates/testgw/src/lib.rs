//! kinference-testgw: a test gateway that behaves like Envoy toward an endpoint picker (the
//! Gateway API Inference Extension protocol over ext_proc) and forwards each HTTP request to the
//! endpoint the picker chose. Invariant: it depends on nothing of kinference's own picker, so it
//! checks any picker against the protocol, not against our implementation of it.
//!
//! ```no_run
//! # async fn run() -> Result<(), kinference_testgw::GatewayError> {
//! use kinference_testgw::{Gateway, GatewayConfig};
//! let endpoints = vec!["10.0.0.1:8000".parse().unwrap()];
//! let config = GatewayConfig::new("127.0.0.1:9002", endpoints);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! let gateway = Gateway::start(config, listener).await?;
//! println!("{} {:?}", gateway.local_addr(), gateway.stats());
//! # Ok(()) }
//! ```

mod config;
mod exchange;
pub mod extproc;
mod gateway;
mod stats;

pub use config::{
    GatewayConfig, RequestBodyMode, ResponseBodyMode, UnknownMode, DEFAULT_CHUNK_SIZE,
};
pub use gateway::{Gateway, GatewayError};
pub use stats::{LatencySummary, Stats, StatsSnapshot};
