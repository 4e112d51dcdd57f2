//! How long a subscriber that starts late takes to catch up with a publisher's replay buffer,
//! over libzmq sockets: the fake publisher holds BATCHES batches (vLLM's default buffer is
//! 10,000) of HASHES stored blocks each, the plane subscribes, one live batch reveals the gap,
//! and the replay is fetched in rounds (the publisher's ROUTER drops what exceeds its send
//! limit of 1,000 queued messages).
//!
//! ```text
//! cargo run --release -p kinference-events --example catchup -- [BATCHES] [HASHES] [STALL_MS]
//! ```
//! STALL_MS sets `replay_stall_timeout` (default: the plane's); set it to the idle timeout
//! (2000) to wait out every round that lost its end marker, as the plane did before the stall
//! timeout existed. Prints the time from the live batch to the worker caught up, and the
//! replay rounds.

use std::time::{Duration, Instant};

use kinference_events::testing::{stored, FakePublisher};
use kinference_events::{DpRank, EventPlane, EventPlaneConfig, ReplicaId, WorkerConfig, WorkerId};

const TOPIC: &str = "kv-events";

fn arg(i: usize, default: u64) -> Result<u64, String> {
    std::env::args().nth(i).map_or(Ok(default), |s| {
        s.parse().map_err(|e| format!("argument {i}: {e}"))
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batches = arg(1, 10_000)?;
    let hashes = arg(2, 4)?;
    let mut config = EventPlaneConfig::default();
    if let Some(ms) = std::env::args().nth(3) {
        config.replay_stall_timeout = Duration::from_millis(ms.parse()?);
    }
    let mut publisher = FakePublisher::bind(TOPIC, batches as usize + 1).await?;
    for i in 0..batches {
        let chain: Vec<u64> = (0..hashes).map(|k| 1 + i * hashes + k).collect();
        let parent = (i > 0).then_some(i * hashes);
        publisher.publish_dropped(&stored(&chain, parent));
    }
    let plane = EventPlane::start(config)?;
    let worker = WorkerId::new(ReplicaId(0), DpRank(0));
    let endpoint = publisher
        .events_endpoint()
        .ok_or("no events endpoint")?
        .to_owned();
    let cfg = WorkerConfig::connect(worker.replica, worker.rank, &endpoint)
        .with_topic(TOPIC)
        .with_replay(publisher.replay_endpoint());
    plane.add_worker(cfg).await?;
    publisher.wait_subscribed(Duration::from_secs(10)).await?;
    let start = Instant::now();
    let last = publisher.publish(&stored(&[u64::MAX - 1], None)).await?;
    let h = plane
        .wait_for(worker, Duration::from_secs(600), |h| {
            h.applied_seq >= Some(last) && !h.stale
        })
        .await?;
    let rounds: Vec<u64> = publisher.replay_log().iter().map(|l| l.start).collect();
    println!(
        "{batches} batches of {hashes} blocks: caught up in {:.3} s, {} replay rounds from {:?}, \
         {} unrecoverable gaps, {} batches applied",
        start.elapsed().as_secs_f64(),
        rounds.len(),
        rounds,
        h.unrecoverable_gaps,
        h.batches_applied
    );
    plane.shutdown().await;
    Ok(())
}
