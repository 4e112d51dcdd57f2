//! Small simulated vLLM replicas for tests: the reference tiny-Llama tokenizer, KV events on
//! ephemeral ports, each server on its own `127.0.0.1:0` listener.
//!
//! Invariant: every port is chosen by the server that binds it (port 0), never probed.

use kinference_sim::EngineConfig;
use kinference_sim_server::{KvEventsConfig, Server, ServerConfig};

/// KV events published on ephemeral ports: the PUB and the replay ROUTER bind `tcp://*:0`
/// (`*` makes the publisher bind, as in vLLM); the bound endpoints are in `Server::endpoints`.
pub fn events_on_port_zero() -> KvEventsConfig {
    let mut kv = KvEventsConfig::new("tcp://*:0");
    kv.replay_endpoint = Some("tcp://*:0".into());
    kv
}

/// A replica serving `model` with the reference tokenizer, `num_gpu_blocks` blocks of
/// `block_size` tokens, stepping `speedup` times faster than real time, without events.
pub fn config(model: &str, num_gpu_blocks: usize, block_size: usize, speedup: f64) -> ServerConfig {
    let engine = EngineConfig::small(num_gpu_blocks, block_size);
    ServerConfig::new(model, engine, crate::tokenizer_dir(), speedup)
}

/// Starts `cfg` on an ephemeral loopback port.
pub async fn start(cfg: ServerConfig) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("cannot bind a loopback port: {e}"));
    Server::start(cfg, listener)
        .await
        .unwrap_or_else(|e| panic!("the simulated replica did not start: {e}"))
}

/// A router's replica entry for `server`, subscribing to its KV events by their explicit
/// loopback endpoints (the server must publish them).
#[cfg(feature = "proxy")]
pub fn replica_with_events(server: &Server) -> kinference_proxy::ReplicaSpec {
    let eps = server
        .endpoints
        .clone()
        .unwrap_or_else(|| panic!("the replica at {} publishes no KV events", server.addr));
    let events = eps
        .events
        .as_deref()
        .unwrap_or_else(|| panic!("the replica at {} has no bound PUB endpoint", server.addr));
    let mut r = kinference_proxy::ReplicaSpec::new(&format!("http://{}", server.addr));
    r.events = Some(kinference_proxy::EventsSpec {
        connect: Some(crate::loopback(events)),
        replay: eps.replay.as_deref().map(crate::loopback),
        ..kinference_proxy::EventsSpec::default()
    });
    r
}
