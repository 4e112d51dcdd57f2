//! The engine driver: one task owns the [`Engine`] and advances it in (scaled) tokio time.
//!
//! Simulated time maps to tokio time as `sim = epoch + elapsed × speedup`. A step that starts
//! from idle runs at the mapped "now"; back-to-back steps run at the engine's `busy_until`, and
//! after each the task sleeps until the instant its simulated end maps to. Timer granularity
//! therefore never stretches simulated step times, and oversleeping does not accumulate;
//! paused tokio time drives it exactly in tests. Outputs go to the waiting
//! handler's channel; a handler that went away (dropped receiver) gets its request aborted
//! so its blocks are freed as vLLM frees them on client disconnect. A request with stop
//! strings is matched token by token as its outputs are delivered; the token that completes
//! one finishes the request there ([`Engine::stop`]), as vLLM's frontend finishes it after
//! detokenizing, and that output carries the `Stop` finish. Every step's
//! `KvEventBatch` goes to the publisher channel in step order; that channel is bounded, and a
//! full channel stalls the engine until the publisher catches up, as vLLM's engine core blocks
//! on its publisher's `queue.put` (`max_queue_size`). A `watch` counter ticks after every step
//! and every command that changes the engine, so observers wait for a state instead of polling.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kinference_sim::{
    AddRequestError, Engine, EngineMetrics, Request, RequestOutput, ResetError, SimTime,
};
use kinference_vllm::KvEventBatch;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::text::{StopMatcher, StopStrings};

/// A handler waiting for a request's outputs.
struct Waiter {
    outputs: mpsc::UnboundedSender<RequestOutput>,
    stop: Option<StopMatcher>,
}

/// A read-only look at the engine, run on the driver task between steps.
pub type Inspect = Box<dyn FnOnce(&Engine) + Send>;

/// What handlers ask of the driver.
pub enum Command {
    /// Queue a request; its outputs arrive on `outputs` in order, the last one finished.
    Submit {
        /// Boxed: a request is large next to the other commands.
        request: Box<Request>,
        /// Stop strings to match on the rendered output (empty: none).
        stop: StopStrings,
        outputs: mpsc::UnboundedSender<RequestOutput>,
        reply: oneshot::Sender<Result<(), AddRequestError>>,
    },
    Metrics(oneshot::Sender<EngineMetrics>),
    ResetPrefixCache(oneshot::Sender<Result<(), ResetError>>),
    Inspect(Inspect),
    /// How many event batches the driver has handed to the publisher so far.
    BatchesSent(oneshot::Sender<u64>),
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            Command::Submit { .. } => "Submit",
            Command::Metrics(_) => "Metrics",
            Command::ResetPrefixCache(_) => "ResetPrefixCache",
            Command::Inspect(_) => "Inspect",
            Command::BatchesSent(_) => "BatchesSent",
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
    waiting: HashMap<Arc<str>, Waiter>,
    /// `None` when events are off.
    events: Option<mpsc::Sender<KvEventBatch>>,
    batches_sent: u64,
    progress: watch::Sender<u64>,
}

/// A spawned driver: its command queue, its progress counter and its task.
#[derive(Debug)]
pub struct DriverHandle {
    pub commands: mpsc::Sender<Command>,
    /// Ticks after every engine step and every command that changed the engine.
    pub progress: watch::Receiver<u64>,
    pub task: JoinHandle<()>,
}

/// Spawns the driver; it runs until every command sender is dropped and the engine is idle.
/// `speedup` below or at zero (or not finite) is read as 1. `events` receives every step's
/// batch (`None`: events off); when it is full the engine waits.
pub fn spawn(
    engine: Engine,
    speedup: f64,
    epoch: SimTime,
    events: Option<mpsc::Sender<KvEventBatch>>,
) -> DriverHandle {
    let (tx, rx) = mpsc::channel(1024);
    let (progress, progress_rx) = watch::channel(0);
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
        batches_sent: 0,
        progress,
    };
    DriverHandle {
        commands: tx,
        progress: progress_rx,
        task: tokio::spawn(driver.run(rx)),
    }
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
            if self.abort_abandoned() {
                self.tick();
            }
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
            if let (Some(batch), Some(events)) = (out.events, &self.events) {
                // Blocks while the publisher's queue is full. A publisher that is gone (the
                // replica shutting down) drops the batch; the engine goes on regardless.
                if events.send(batch).await.is_ok() {
                    self.batches_sent += 1;
                }
            }
            self.tick();
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

    fn tick(&self) {
        self.progress.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn handle(&mut self, cmd: Command) {
        let changes = !matches!(
            cmd,
            Command::Metrics(_) | Command::Inspect(_) | Command::BatchesSent(_)
        );
        self.apply(cmd);
        if changes {
            self.tick();
        }
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                request,
                stop,
                outputs,
                reply,
            } => {
                let id: Arc<str> = Arc::from(request.id.as_str());
                let res = self.engine.add_request(*request, self.arrival_time());
                if res.is_ok() {
                    let stop = (!stop.strings.is_empty()).then(|| StopMatcher::new(stop));
                    self.waiting.insert(id, Waiter { outputs, stop });
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
            Command::BatchesSent(reply) => {
                let _ = reply.send(self.batches_sent);
            }
        }
    }

    fn deliver(&mut self, mut o: RequestOutput) {
        let id = Arc::clone(&o.request_id);
        let Some(w) = self.waiting.get_mut(&id) else {
            return;
        };
        let matched = w.stop.as_mut().and_then(|m| m.push(o.token)).is_some();
        if matched && o.finished.is_none() {
            // The step that produced this token has ended; the request ends with it.
            o.finished = self.engine.stop(&id, self.engine.busy_until());
        }
        let finished = o.finished.is_some();
        let gone = match self.waiting.get(&id) {
            Some(w) => w.outputs.send(o).is_err(),
            None => false,
        };
        if gone && !finished {
            self.engine.abort(&id);
        }
        if gone || finished {
            self.waiting.remove(&id);
        }
    }

    /// Aborts every request whose receiver is gone; true if there was any.
    fn abort_abandoned(&mut self) -> bool {
        let gone: Vec<Arc<str>> = self
            .waiting
            .iter()
            .filter(|(_, w)| w.outputs.is_closed())
            .map(|(id, _)| Arc::clone(id))
            .collect();
        for id in &gone {
            self.engine.abort(id);
            self.waiting.remove(id);
        }
        !gone.is_empty()
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
