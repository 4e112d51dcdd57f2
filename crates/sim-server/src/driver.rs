//! The engine driver: one task owns the [`Engine`] and advances it in (scaled) tokio time.
//!
//! Simulated time maps to tokio time as `sim = epoch + elapsed × speedup`. A step that starts
//! from idle runs at the mapped "now"; back-to-back steps run at the engine's `busy_until`, and
//! after each the task sleeps until the instant its simulated end maps to. Timer granularity
//! therefore never stretches simulated step times, and oversleeping does not accumulate;
//! paused tokio time drives it exactly in tests. Outputs go to the waiting
//! handler's channel; a handler that went away (dropped receiver) gets its request aborted
//! so its blocks are freed as vLLM frees them on client disconnect. Every step's
//! `KvEventBatch` goes to the publisher channel in step order.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kinference_sim::{
    AddRequestError, Engine, EngineMetrics, Request, RequestOutput, ResetError, SimTime,
};
use kinference_vllm::KvEventBatch;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

/// A read-only look at the engine, run on the driver task between steps.
pub type Inspect = Box<dyn FnOnce(&Engine) + Send>;

/// What handlers ask of the driver.
pub enum Command {
    /// Queue a request; its outputs arrive on `outputs` in order, the last one finished.
    Submit {
        request: Request,
        outputs: mpsc::UnboundedSender<RequestOutput>,
        reply: oneshot::Sender<Result<(), AddRequestError>>,
    },
    Metrics(oneshot::Sender<EngineMetrics>),
    ResetPrefixCache(oneshot::Sender<Result<(), ResetError>>),
    Inspect(Inspect),
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Command::Submit { .. } => "Submit",
            Command::Metrics(_) => "Metrics",
            Command::ResetPrefixCache(_) => "ResetPrefixCache",
            Command::Inspect(_) => "Inspect",
        };
        f.write_str(name)
    }
}

/// The driver task's state.
struct Driver {
    engine: Engine,
    speedup: f64,
    epoch: SimTime,
    started: Instant,
    /// The last step ran something, so the next one starts at the engine's `busy_until`.
    continuous: bool,
    waiting: HashMap<Arc<str>, mpsc::UnboundedSender<RequestOutput>>,
    events: mpsc::UnboundedSender<KvEventBatch>,
}

/// Spawns the driver; it runs until every command sender is dropped and the engine is idle.
/// `speedup` below or at zero (or not finite) is read as 1.
pub fn spawn(
    engine: Engine,
    speedup: f64,
    epoch: SimTime,
    events: mpsc::UnboundedSender<KvEventBatch>,
) -> (mpsc::Sender<Command>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(1024);
    let speedup = if speedup.is_finite() && speedup > 0.0 {
        speedup
    } else {
        1.0
    };
    let driver = Driver {
        engine,
        speedup,
        epoch,
        started: Instant::now(),
        continuous: false,
        waiting: HashMap::new(),
        events,
    };
    (tx, tokio::spawn(driver.run(rx)))
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            if !self.engine.has_work() {
                match rx.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
            // Abandoned requests go first, so a command queued after a disconnect already
            // sees the request aborted.
            self.abort_abandoned();
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            if !self.engine.has_work() {
                self.continuous = false;
                continue;
            }
            let at = if self.continuous {
                self.engine.busy_until()
            } else {
                self.now()
            };
            let out = self.engine.step(at);
            for o in out.outputs {
                self.deliver(o);
            }
            if let Some(batch) = out.events {
                // The publisher may be gone (events disabled); the engine goes on regardless.
                let _ = self.events.send(batch);
            }
            self.continuous = out.scheduled_requests > 0;
            if self.continuous {
                tokio::time::sleep_until(self.instant_of(out.finished_at)).await;
            } else if self.engine.num_waiting() > 0 {
                // Nothing fits now and nothing runs: wait for a command (an abort or a reset)
                // rather than spinning.
                match rx.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
        }
    }

    fn now(&self) -> SimTime {
        let elapsed = self.started.elapsed().mul_f64(self.speedup);
        self.epoch.saturating_add(elapsed)
    }

    /// An arrival during a run of steps happened within the running step at the latest.
    fn arrival_time(&self) -> SimTime {
        let now = self.now();
        if self.continuous {
            now.min(self.engine.busy_until())
        } else {
            now
        }
    }

    /// The tokio instant a simulated time maps to.
    fn instant_of(&self, t: SimTime) -> Instant {
        self.started + t.saturating_since(self.epoch).div_f64(self.speedup)
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                request,
                outputs,
                reply,
            } => {
                let id: Arc<str> = Arc::from(request.id.as_str());
                let res = self.engine.add_request(request, self.arrival_time());
                if res.is_ok() {
                    self.waiting.insert(id, outputs);
                }
                let _ = reply.send(res);
            }
            Command::Metrics(reply) => {
                let _ = reply.send(self.engine.metrics());
            }
            Command::ResetPrefixCache(reply) => {
                let _ = reply.send(self.engine.reset_prefix_cache());
            }
            Command::Inspect(f) => f(&self.engine),
        }
    }

    fn deliver(&mut self, o: RequestOutput) {
        let id = Arc::clone(&o.request_id);
        let finished = o.finished.is_some();
        let gone = match self.waiting.get(&id) {
            Some(tx) => tx.send(o).is_err(),
            None => false,
        };
        if gone && !finished {
            self.engine.abort(&id);
        }
        if gone || finished {
            self.waiting.remove(&id);
        }
    }

    fn abort_abandoned(&mut self) {
        let gone: Vec<Arc<str>> = self
            .waiting
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(id, _)| Arc::clone(id))
            .collect();
        for id in gone {
            self.engine.abort(&id);
            self.waiting.remove(&id);
        }
    }
}

/// Wall-clock "now" as a [`SimTime`] since the Unix epoch, so batch timestamps look like
/// vLLM's `time.time()`.
pub fn unix_now() -> SimTime {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    SimTime::from_nanos(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
