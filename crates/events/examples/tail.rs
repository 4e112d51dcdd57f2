//! Follows one vLLM KV-event stream and prints the worker's health as it changes.
//!
//! ```text
//! cargo run -p kinference-events --example tail -- MODE ADDRESS [--replay ADDR] [--topic T]
//!     [--rank N] [--seconds S] [--until-applied SEQ]
//! ```
//! MODE is `bind` (vLLM's PUB connects to ADDRESS) or `connect` (vLLM's PUB binds). Exits 0
//! once `--until-applied` is reached, 1 on timeout; prints the final health and entry count.

use std::time::Duration;

use kinference_events::{
    DpRank, EventPlane, EventPlaneConfig, ReplicaId, WorkerConfig, WorkerHealth,
};

struct Args {
    config: WorkerConfig,
    seconds: u64,
    until_applied: Option<u64>,
}

fn parse_args() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mode = it.next().ok_or("missing MODE (bind|connect)")?;
    let address = it.next().ok_or("missing ADDRESS")?;
    let (mut replay, mut topic, mut rank, mut seconds, mut until) =
        (None, String::new(), 0, 30, None);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        let num = || value.parse::<u64>().map_err(|e| format!("{flag}: {e}"));
        match flag.as_str() {
            "--replay" => replay = Some(value.clone()),
            "--topic" => topic = value.clone(),
            "--rank" => rank = num()? as u32,
            "--seconds" => seconds = num()?,
            "--until-applied" => until = Some(num()?),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let (replica, rank) = (ReplicaId(0), DpRank(rank));
    let mut config = match mode.as_str() {
        "bind" => WorkerConfig::bind(replica, rank, &address),
        "connect" => WorkerConfig::connect(replica, rank, &address),
        _ => return Err(format!("unknown MODE {mode}")),
    };
    if let Some(r) = &replay {
        config = config.with_replay(r);
    }
    config = config.with_topic(&topic);
    Ok(Args {
        config,
        seconds,
        until_applied: until,
    })
}

fn show(h: &WorkerHealth) {
    println!(
        "connected={} local={:?} last_seq={:?} applied_seq={:?} msgs={} applied={} gaps={} \
         replays={}/{} replayed={} unrecoverable={} resets={} decode_errors={} entries={} sync={:?}",
        h.connected, h.local_endpoint, h.last_seq, h.applied_seq, h.messages, h.batches_applied,
        h.gaps, h.replays_succeeded, h.replays_attempted, h.replayed_batches,
        h.unrecoverable_gaps, h.resets, h.decode_errors, h.entries, h.sync
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = parse_args()?;
    let plane = EventPlane::start(EventPlaneConfig::default())?;
    let worker = plane.add_worker(args.config).await?;
    let mut rx = plane.watch_health(worker).ok_or("worker vanished")?;
    show(&rx.borrow_and_update());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.seconds);
    let mut reached = false;
    loop {
        match tokio::time::timeout_at(deadline, rx.changed()).await {
            Ok(Ok(())) => {}
            _ => break,
        }
        let h = rx.borrow_and_update().clone();
        show(&h);
        if args.until_applied.is_some() && h.applied_seq >= args.until_applied {
            reached = true;
            break;
        }
    }
    let entries = plane.index().read().worker_entries(worker);
    println!("final entries={entries}");
    plane.shutdown().await;
    if args.until_applied.is_some() && !reached {
        std::process::exit(1);
    }
    Ok(())
}
