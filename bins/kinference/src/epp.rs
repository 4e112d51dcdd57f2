//! `kinference epp`: the endpoint picker for gateways that speak the Gateway API Inference
//! Extension protocol (Envoy ext_proc). The same fleet sources, policies and admin API as
//! `kinference serve` (every serve flag applies); `--listen` is the gRPC address the gateway
//! calls, and no HTTP data port is served.

use std::time::Duration;

use kinference_epp::{BodyMode, Settings};

use crate::serve::{self, ServeArgs};

#[derive(Debug, clap::Args)]
pub struct EppArgs {
    #[command(flatten)]
    router: ServeArgs,
    /// Request body mode of gateways that do not say (Envoy sends `protocol_config`):
    /// full-duplex (FULL_DUPLEX_STREAMED, what GIE gateways use) or buffered (BUFFERED and
    /// STREAMED: every message answered).
    #[arg(long, env = "KINFERENCE_EPP_REQUEST_BODY_MODE", default_value = "full-duplex", value_parser = parse_mode)]
    request_body_mode: BodyMode,
    /// Response body mode of gateways that do not say.
    #[arg(long, env = "KINFERENCE_EPP_RESPONSE_BODY_MODE", default_value = "full-duplex", value_parser = parse_mode)]
    response_body_mode: BodyMode,
    /// Interval of HTTP/2 keep-alive pings to the gateway, and how long one may go unanswered, s.
    #[arg(long, env = "KINFERENCE_EPP_KEEPALIVE_S", default_value_t = 30)]
    keepalive_s: u64,
}

fn parse_mode(s: &str) -> Result<BodyMode, String> {
    match s {
        "full-duplex" | "full_duplex" | "FULL_DUPLEX_STREAMED" => Ok(BodyMode::FullDuplex),
        "buffered" | "streamed" | "BUFFERED" | "STREAMED" => Ok(BodyMode::Acked),
        _ => Err(format!(
            "`{s}`: expected full-duplex or buffered (streamed is answered as buffered)"
        )),
    }
}

pub fn run(args: EppArgs) -> anyhow::Result<()> {
    let settings = Settings {
        request_body_mode: args.request_body_mode,
        response_body_mode: args.response_body_mode,
        keepalive: Duration::from_secs(args.keepalive_s.max(1)),
    };
    serve::run_with(args.router, Some(kinference_epp::front(settings)))
}
