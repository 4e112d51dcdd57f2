//! The driver in paused tokio time: steps pace at the simulated duration over `speedup`,
//! outputs arrive in order, and a dropped receiver aborts its request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_sim::{Engine, EngineConfig, EngineMetrics, Request, SimTime};
use kinference_sim_server::driver::{self, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

fn engine() -> Engine {
    // 10 ms per step in simulated time.
    Engine::new(EngineConfig::small(64, 16)).unwrap()
}

async fn submit(
    tx: &mpsc::Sender<Command>,
    id: &str,
    max_tokens: u32,
) -> mpsc::UnboundedReceiver<kinference_sim::RequestOutput> {
    let (out_tx, out_rx) = mpsc::unbounded_channel();
    let (reply, accepted) = oneshot::channel();
    let request = Request::new(id, (0..40).collect(), max_tokens);
    tx.send(Command::Submit {
        request,
        outputs: out_tx,
        reply,
    })
    .await
    .unwrap();
    accepted.await.unwrap().unwrap();
    out_rx
}

async fn metrics(tx: &mpsc::Sender<Command>) -> EngineMetrics {
    let (reply, rx) = oneshot::channel();
    tx.send(Command::Metrics(reply)).await.unwrap();
    rx.await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn steps_pace_at_simulated_time_over_speedup() {
    let (events_tx, mut events_rx) = mpsc::unbounded_channel();
    let (tx, _task) = driver::spawn(engine(), 10.0, SimTime::ZERO, events_tx);
    let t0 = Instant::now();
    let mut rx = submit(&tx, "a", 3).await;
    let mut got = Vec::new();
    while let Some(o) = rx.recv().await {
        got.push(o.index);
        if o.finished.is_some() {
            break;
        }
    }
    assert_eq!(got, vec![0, 1, 2]);
    // Three 10 ms steps at speedup 10; the last output is delivered before its step's sleep.
    assert_eq!(t0.elapsed(), Duration::from_millis(2));
    let batch = events_rx.recv().await.unwrap();
    assert!(
        !batch.events.is_empty(),
        "the prefill stores the prompt's full blocks"
    );
    let m = metrics(&tx).await;
    assert_eq!(m.generation_tokens, 3);
    assert_eq!(m.requests_finished_length, 1);
}

#[tokio::test(start_paused = true)]
async fn dropped_receiver_aborts_the_request() {
    let (events_tx, _events_rx) = mpsc::unbounded_channel();
    let (tx, _task) = driver::spawn(engine(), 1.0, SimTime::ZERO, events_tx);
    let mut rx = submit(&tx, "long", 500).await;
    let first = rx.recv().await.unwrap();
    assert_eq!(first.index, 0);
    assert_eq!(metrics(&tx).await.num_running, 1);
    drop(rx);
    let m = metrics(&tx).await;
    assert_eq!(m.num_running, 0);
    assert_eq!(m.requests_aborted, 1);
    assert!(m.generation_tokens < 500);
}

#[tokio::test(start_paused = true)]
async fn timer_granularity_does_not_stretch_simulated_steps() {
    let (events_tx, _events_rx) = mpsc::unbounded_channel();
    // 10 ms steps at speedup 1000 are 10 µs sleeps, below the timer's 1 ms resolution.
    let (tx, _task) = driver::spawn(engine(), 1000.0, SimTime::ZERO, events_tx);
    let mut rx = submit(&tx, "a", 5).await;
    while let Some(o) = rx.recv().await {
        if o.finished.is_some() {
            break;
        }
    }
    let m = metrics(&tx).await;
    assert_eq!(m.itl.count, 4);
    assert!(
        (m.itl.sum - 0.040).abs() < 1e-9,
        "inter-token latency is the model's 10 ms per step, got {}",
        m.itl.sum
    );
}
