//! kinference-testgw binary: runs the test gateway for scripts. Prints `listening on ADDR` as
//! the first line of stdout once the listener is bound, then serves until interrupted.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use kinference_testgw::{Gateway, GatewayConfig, RequestBodyMode, ResponseBodyMode};

#[derive(Debug, Parser)]
#[command(
    name = "kinference-testgw",
    about = "Envoy-like test gateway for an ext_proc endpoint picker"
)]
struct Args {
    /// Address to serve clients on (port 0 picks one; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// The picker's gRPC address (host:port or http://host:port).
    #[arg(long)]
    picker: String,
    /// The pool, comma-separated ip:port: picks are checked against it, fail-open routes over it.
    #[arg(long, value_delimiter = ',')]
    endpoints: Vec<SocketAddr>,
    /// full-duplex | buffered
    #[arg(long, default_value = "full-duplex")]
    body_mode: RequestBodyMode,
    /// none | streamed | full-duplex
    #[arg(long, default_value = "full-duplex")]
    response_body_mode: ResponseBodyMode,
    /// Request body chunk size (bytes) in full-duplex mode.
    #[arg(long, default_value_t = kinference_testgw::DEFAULT_CHUNK_SIZE)]
    chunk_size: usize,
    /// Subset hint sent with every request, comma-separated ip:port.
    #[arg(long, value_delimiter = ',')]
    subset: Option<Vec<String>>,
    /// Buffered mode: send the body without waiting for the headers' answer (Envoy's
    /// send_body_without_waiting_for_header_response).
    #[arg(long)]
    body_without_waiting: bool,
    /// Route round robin over --endpoints when the picker fails, instead of answering 503.
    #[arg(long)]
    fail_open: bool,
    /// Longest wait for one picker message, milliseconds.
    #[arg(long, default_value_t = 10_000)]
    picker_timeout_ms: u64,
    /// Upstream connect timeout, milliseconds.
    #[arg(long, default_value_t = 2_000)]
    connect_timeout_ms: u64,
    /// Longest wait for an endpoint's response head, milliseconds.
    #[arg(long, default_value_t = 300_000)]
    response_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut config = GatewayConfig::new(args.picker, args.endpoints);
    config.request_body_mode = args.body_mode;
    config.response_body_mode = args.response_body_mode;
    config.chunk_size = args.chunk_size.max(1);
    config.subset_hint = args.subset;
    config.fail_open = args.fail_open;
    config.send_body_without_waiting = args.body_without_waiting;
    config.picker_timeout = Duration::from_millis(args.picker_timeout_ms);
    config.upstream_connect_timeout = Duration::from_millis(args.connect_timeout_ms);
    config.upstream_response_timeout = Duration::from_millis(args.response_timeout_ms);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let gateway = Gateway::start(config, listener)
        .await
        .context("starting the gateway")?;
    println!("listening on {}", gateway.local_addr());
    tokio::signal::ctrl_c()
        .await
        .context("waiting for ctrl-c")?;
    gateway.shutdown().await;
    Ok(())
}
