//! The driver in paused tokio time: steps pace at the simulated duration over `speedup`,
//! outputs arrive in order, and a dropped receiver aborts its request.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_sim::{Engine, EngineConfig, EngineMetrics, Request, SimTime};
use kinference_sim_server::driver::{self, Command};
use kinference_sim_server::text::{word, StopStrings};
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
        request: Box::new(request),
        stop: StopStrings::default(),
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
    let (events_tx, mut events_rx) = mpsc::channel(16);
    let tx = driver::spawn(engine(), 10.0, SimTime::ZERO, Some(events_tx)).commands;
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
    let tx = driver::spawn(engine(), 1.0, SimTime::ZERO, None).commands;
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
    // 10 ms steps at speedup 1000 are 10 µs sleeps, below the timer's 1 ms resolution.
    let tx = driver::spawn(engine(), 1000.0, SimTime::ZERO, None).commands;
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

fn drain(rx: &mut mpsc::UnboundedReceiver<kinference_sim::RequestOutput>) -> usize {
    let mut n = 0;
    while rx.try_recv().is_ok() {
        n += 1;
    }
    n
}

/// A full publisher queue stalls the engine (vLLM's engine core blocks in `queue.put`): no
/// batch is dropped, and stepping resumes as soon as the queue has room.
#[tokio::test(start_paused = true)]
async fn a_full_event_queue_stalls_the_engine_until_it_drains() {
    let (events_tx, mut events_rx) = mpsc::channel(1);
    let tx = driver::spawn(engine(), 1.0, SimTime::ZERO, Some(events_tx)).commands;
    // 40 prompt tokens: the prefill stores 2 blocks of 16; decode fills one more every 16
    // tokens, so 100 tokens make 6 more batches.
    let mut rx = submit(&tx, "a", 100).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stalled = drain(&mut rx);
    assert!(
        stalled > 0 && stalled < 100,
        "the second batch blocks after {stalled} tokens"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        drain(&mut rx),
        0,
        "still stalled: nothing was dropped to make room"
    );

    let mut batches = vec![events_rx.recv().await.unwrap()];
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut total = stalled + drain(&mut rx);
    assert!(
        total > stalled,
        "room in the queue lets the engine step again"
    );
    while total < 100 {
        batches.push(events_rx.recv().await.unwrap());
        tokio::time::sleep(Duration::from_secs(5)).await;
        total += drain(&mut rx);
    }
    while let Ok(b) = events_rx.try_recv() {
        batches.push(b);
    }
    let stored: usize = batches
        .iter()
        .flat_map(|b| &b.events)
        .map(|e| match e {
            kinference_vllm::KvEvent::BlockStored(s) => s.block_hashes.len(),
            _ => 0,
        })
        .sum();
    // 40 prompt + 99 computed output tokens = 139 tokens = 8 full blocks, each stored once.
    assert_eq!(stored, 8);
    assert_eq!(metrics(&tx).await.generation_tokens, 100);
}

#[tokio::test(start_paused = true)]
async fn a_stop_string_finishes_the_request_at_its_token() {
    let tx = driver::spawn(engine(), 1.0, SimTime::ZERO, None).commands;
    // The same id gives the same pseudo-tokens: learn them, then stop at the fifth word.
    let mut probe = submit(&tx, "s", 20).await;
    let mut tokens = Vec::new();
    while let Some(o) = probe.recv().await {
        tokens.push(o.token);
        if o.finished.is_some() {
            break;
        }
    }
    let text: String = tokens.iter().map(|t| word(*t)).collect();
    let stop = word(tokens[4]);
    let at = text.find(&stop).unwrap() + stop.len();
    let expected = tokens
        .iter()
        .scan(0, |len, t| {
            *len += word(*t).len();
            Some(*len)
        })
        .position(|len| len >= at)
        .unwrap()
        + 1;

    let (out_tx, mut rx) = mpsc::unbounded_channel();
    let (reply, accepted) = oneshot::channel();
    let stop = StopStrings {
        strings: vec![stop],
        include: false,
    };
    let request = Request::new("s", (0..40).collect(), 20);
    tx.send(Command::Submit {
        request: Box::new(request),
        stop,
        outputs: out_tx,
        reply,
    })
    .await
    .unwrap();
    accepted.await.unwrap().unwrap();
    let mut got = Vec::new();
    while let Some(o) = rx.recv().await {
        let fin = o.finished.clone();
        got.push(o);
        if let Some(f) = fin {
            assert_eq!(f.reason, kinference_sim::FinishReason::Stop);
            assert_eq!(f.usage.completion_tokens, expected);
            break;
        }
    }
    assert_eq!(got.len(), expected);
    assert!(
        rx.recv().await.is_none(),
        "nothing after the finishing output"
    );
    let m = metrics(&tx).await;
    assert_eq!(
        (m.num_running, m.requests_finished_stop, m.requests_aborted),
        (0, 1, 0)
    );
}
