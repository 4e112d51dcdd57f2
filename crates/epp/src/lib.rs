//! kinference-epp: the endpoint picker (EPP) for gateways that speak the Gateway API Inference
//! Extension protocol over Envoy's ext_proc (`envoy.service.ext_proc.v3.ExternalProcessor/
//! Process`), in front of the same fleet, index, policies and admin API as `kinference serve`;
//! the gateway carries the bytes.
//!
//! ```text
//!  gateway ──gRPC (h2c)──▶ ExternalProcessor/Process, one stream per HTTP request
//!                           exchange.rs: headers → body → Picker::pick (kinference-proxy:
//!                           pool, gate, tokenize, hash, index, policy) → destination header
//!                           + envoy.lb metadata (ordered fallback list) → response path:
//!                           served endpoint → claim moved there → end of stream: released
//!          ──gRPC──────▶ grpc.health.v1.Health ("", and the ext_proc service)
//! ```
//!
//! Invariants: the picker never sees the response before the gateway does and never holds a
//! request: every message is answered as soon as the body mode allows; a stream that breaks
//! settles its pick (see `exchange.rs`); the health service says NOT_SERVING while the fleet
//! has no ready replica and once shutdown begins.

mod exchange;
pub mod wire;

use std::pin::Pin;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures_core::Stream;
use kinference_proxy::{Front, Picker};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;

pub use exchange::BodyMode;

/// The picker's own settings (the fleet's come from the router's configuration).
#[derive(Clone, Debug)]
pub struct Settings {
    /// How the gateway sends request bodies when its stream does not say
    /// (`protocol_config`); GIE gateways use full duplex.
    pub request_body_mode: BodyMode,
    /// How the gateway sends response bodies when its stream does not say.
    pub response_body_mode: BodyMode,
    /// HTTP/2 keep-alive pings to the gateway, and how long an unanswered one may wait.
    pub keepalive: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            request_body_mode: BodyMode::FullDuplex,
            response_body_mode: BodyMode::FullDuplex,
            keepalive: Duration::from_secs(30),
        }
    }
}

/// The ext_proc service: one stream state machine (`exchange.rs`) per stream.
#[derive(Debug, Clone)]
pub struct Epp {
    picker: Picker,
    settings: Settings,
}

impl Epp {
    pub fn new(picker: Picker, settings: Settings) -> Self {
        Epp { picker, settings }
    }
}

type ProcessStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Epp {
    type ProcessStream = ProcessStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let mut inbound = request.into_inner();
        // Answers of one message at a time wait here; a gateway that stops reading stops the
        // exchange (the send waits) rather than growing a queue.
        let (tx, rx) = mpsc::channel(16);
        let mut exchange = exchange::Exchange::new(self.picker.clone(), &self.settings);
        tokio::spawn(async move {
            let clean = loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break true,
                    Err(status) => {
                        tracing::debug!(%status, "the gateway's stream broke");
                        break false;
                    }
                };
                match exchange.on_message(msg).await {
                    Ok(answers) => {
                        for a in answers {
                            if tx.send(Ok(a)).await.is_err() {
                                // The gateway went away.
                                exchange.end(false);
                                return;
                            }
                        }
                    }
                    Err(status) => {
                        tracing::debug!(%status, "refusing the gateway's stream");
                        let _ = tx.send(Err(status)).await;
                        break false;
                    }
                }
            };
            exchange.end(clean);
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The picker's gRPC server for [`kinference_proxy::Proxy::start_front`]: ext_proc and the
/// gRPC health service on the front listener, until the proxy stops.
pub fn front(settings: Settings) -> Front {
    Box::new(move |picker, listener, stop| Box::pin(serve(picker, listener, stop, settings)))
}

/// Serves ext_proc and health on `listener` until `stop` is cancelled.
pub async fn serve(
    picker: Picker,
    listener: TcpListener,
    stop: CancellationToken,
    settings: Settings,
) {
    let (reporter, health) = tonic_health::server::health_reporter();
    let keepalive = settings.keepalive;
    let epp = Epp::new(picker.clone(), settings);
    let ready_watch = {
        let (reporter, stop) = (reporter.clone(), stop.clone());
        tokio::spawn(async move {
            let mut last = None;
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                let ready = picker.ready();
                if last != Some(ready) {
                    let status = if ready {
                        ServingStatus::Serving
                    } else {
                        ServingStatus::NotServing
                    };
                    reporter.set_service_status("", status).await;
                    reporter
                        .set_service_status(
                            <ExternalProcessorServer<Epp> as tonic::server::NamedService>::NAME,
                            status,
                        )
                        .await;
                    last = Some(ready);
                }
                tokio::select! {
                    _ = tick.tick() => {}
                    () = stop.cancelled() => break,
                }
            }
            reporter
                .set_service_status("", ServingStatus::NotServing)
                .await;
            reporter
                .set_not_serving::<ExternalProcessorServer<Epp>>()
                .await;
        })
    };
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(keepalive))
        .http2_keepalive_timeout(Some(keepalive))
        .add_service(health)
        .add_service(ExternalProcessorServer::new(epp))
        .serve_with_incoming_shutdown(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            stop.cancelled_owned(),
        )
        .await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the endpoint picker's gRPC server stopped");
    }
    ready_watch.abort();
}
