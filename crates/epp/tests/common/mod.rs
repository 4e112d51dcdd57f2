//! Fixtures the picker's test files share: simulated replicas with KV events on port 0, the
//! router's `/metrics` page, and the wait for every in-flight claim to be released.

#![allow(clippy::unwrap_used, dead_code)]

use kinference_proxy::Proxy;
use kinference_sim_server::Server;
use kinference_testkit::{sim, WAIT};

pub const MODEL: &str = "tiny";

/// `n` replicas of `MODEL` (600 blocks of 32 tokens, 1000× speed) publishing KV events and
/// answering replays on ports they bound.
pub async fn sims(n: usize) -> Vec<Server> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut cfg = sim::config(MODEL, 600, 32, 1000.0);
        cfg.kv_events = Some(sim::events_on_port_zero());
        out.push(sim::start(cfg).await);
    }
    out
}

/// Waits until no worker of the first pool holds an in-flight claim.
pub async fn wait_no_in_flight(proxy: &Proxy) {
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0]
                .replicas
                .iter()
                .all(|r| r.workers.iter().all(|w| w.load.in_flight == 0))
        })
        .await
        .unwrap_or_else(|s| panic!("an in-flight claim leaked: {s:#?}"));
}

/// The router's `/metrics` page.
pub async fn admin_metrics(proxy: &Proxy) -> String {
    reqwest::get(format!("http://{}/metrics", proxy.admin_addr()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
