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

/// Waits until `proxy` has applied a KV-event message from the replica at `url` (its first
/// DP rank), sending it short completions of `model` straight (not through the router) until
/// then; returns how many it sent.
///
/// A PUB drops what it publishes before it has read a subscriber's subscription (libzmq's
/// "slow joiner"; vLLM's publisher is one), and the router counts a stream as connected once
/// it has written its subscription: under load, the first batch after connecting can be lost,
/// and a lost batch shows (as a gap, then replayed) only when a later one arrives. A test that
/// needs the index to hold a request's blocks primes the stream first. Each completion's
/// events get a few seconds, and it gives up after ten.
#[cfg(feature = "proxy")]
pub async fn prime_events(proxy: &kinference_proxy::Proxy, url: &str, model: &str) -> u32 {
    let client = reqwest::Client::new();
    let mut attempt = 0;
    loop {
        attempt += 1;
        // Unlike any test's prompts from the first token, so no test's prefix is cached by it.
        let prompt = format!("Priming {attempt} of {url}: ")
            + &"the router listens for this replica's KV events. ".repeat(6);
        let body = serde_json::json!({
            "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
        });
        let resp = client
            .post(format!("{url}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap_or_else(|e| panic!("priming request to {url}: {e}"));
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert!(
            status.is_success(),
            "priming request to {url}: {status} {text}"
        );
        let applied = proxy
            .wait_for_events(url, 0, std::time::Duration::from_secs(5), |h| {
                h.messages > 0 && !h.stale && h.applied_seq.is_some() && h.applied_seq == h.last_seq
            })
            .await;
        if applied.is_ok() {
            return attempt;
        }
        assert!(
            attempt < 10,
            "{url}'s KV events never reached the router after {attempt} requests: {applied:?}"
        );
    }
}
