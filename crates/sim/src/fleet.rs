//! A fleet of engines advanced in simulated time, for benchmark sweeps without sockets.
//!
//! ```text
//!   trace (time-ordered arrivals) ──▶ router(&FleetView, &Request) -> engine index
//!                                            │ add_request(req, at)
//!   event queue: next step completion  ◀─────┴── engine.step(now) when idle and has work
//!   per busy engine (min-heap by time, then by start order)
//! ```
//!
//! At each instant the fleet first completes the steps ending then (their outputs go to the
//! sink), then admits the arrivals due, then starts a step on every idle engine with work.
//! A request arriving while its engine is mid-step waits for the next step, as in vLLM.
//! Everything is deterministic: ties break by the order in which steps were started.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use crate::engine::{Engine, StepOutput};
use crate::error::FleetError;
use crate::metrics::EngineMetrics;
use crate::request::Request;
use crate::time::SimTime;

/// A request and the simulated instant it reaches the router.
#[derive(Clone, Debug, PartialEq)]
pub struct Arrival {
    pub at: SimTime,
    pub request: Request,
}

/// What a routing policy may look at: the engines, read-only, and the current time.
#[derive(Debug, Clone, Copy)]
pub struct FleetView<'a> {
    engines: &'a [Engine],
    now: SimTime,
}

impl<'a> FleetView<'a> {
    pub fn now(&self) -> SimTime {
        self.now
    }

    pub fn len(&self) -> usize {
        self.engines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.engines.is_empty()
    }

    pub fn engine(&self, i: usize) -> Option<&'a Engine> {
        self.engines.get(i)
    }

    pub fn engines(&self) -> &'a [Engine] {
        self.engines
    }
}

/// One finished request, as the fleet saw it.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    pub engine: usize,
    pub request_id: Arc<str>,
    pub arrival: SimTime,
    pub first_token: Option<SimTime>,
    pub finished_at: SimTime,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub num_preemptions: u32,
}

impl RequestRecord {
    pub fn ttft_secs(&self) -> Option<f64> {
        self.first_token
            .map(|t| t.saturating_since(self.arrival).as_secs_f64())
    }
}

/// What a fleet run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetReport {
    /// The first arrival (or zero without arrivals).
    pub started_at: SimTime,
    /// The end of the last step.
    pub ended_at: SimTime,
    pub routed: Vec<u64>,
    pub records: Vec<RequestRecord>,
    pub engine_metrics: Vec<EngineMetrics>,
    pub steps: u64,
    pub kv_events: u64,
}

impl FleetReport {
    pub fn simulated_secs(&self) -> f64 {
        self.ended_at
            .saturating_since(self.started_at)
            .as_secs_f64()
    }

    /// Prefix-cache hits over queries, summed over engines (first admissions).
    pub fn prefix_hit_rate(&self) -> f64 {
        let q: u64 = self
            .engine_metrics
            .iter()
            .map(|m| m.prefix_cache_queries)
            .sum();
        let h: u64 = self
            .engine_metrics
            .iter()
            .map(|m| m.prefix_cache_hits)
            .sum();
        if q == 0 {
            0.0
        } else {
            h as f64 / q as f64
        }
    }

    /// The `q`-quantile (0..=1, nearest rank) of time to first token, seconds.
    pub fn ttft_quantile(&self, q: f64) -> Option<f64> {
        let mut v: Vec<f64> = self
            .records
            .iter()
            .filter_map(RequestRecord::ttft_secs)
            .collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let rank = (q.clamp(0.0, 1.0) * (v.len() - 1) as f64).round() as usize;
        v.get(rank).copied()
    }
}

/// N engines under one virtual clock.
#[derive(Debug)]
pub struct Fleet {
    engines: Vec<Engine>,
}

/// Per-run bookkeeping.
struct RunState {
    heap: BinaryHeap<Reverse<(SimTime, u64, usize)>>,
    in_flight: Vec<Option<StepOutput>>,
    seq: u64,
    dirty: Vec<usize>,
    report: FleetReport,
}

impl Fleet {
    pub fn new(engines: Vec<Engine>) -> Result<Fleet, FleetError> {
        if engines.is_empty() {
            return Err(FleetError::NoEngines);
        }
        Ok(Fleet { engines })
    }

    pub fn engines(&self) -> &[Engine] {
        &self.engines
    }

    pub fn into_engines(self) -> Vec<Engine> {
        self.engines
    }

    /// Replays `trace` (time-ordered) through `router` until every engine is idle.
    pub fn run<I, R>(&mut self, trace: I, router: &mut R) -> Result<FleetReport, FleetError>
    where
        I: IntoIterator<Item = Arrival>,
        R: FnMut(&FleetView<'_>, &Request) -> usize,
    {
        self.run_with(trace, router, &mut |_: usize, _: &StepOutput| {})
    }

    /// As [`Fleet::run`], handing every completed step to `sink(engine, output)` at its end.
    pub fn run_with<I, R, S>(
        &mut self,
        trace: I,
        router: &mut R,
        sink: &mut S,
    ) -> Result<FleetReport, FleetError>
    where
        I: IntoIterator<Item = Arrival>,
        R: FnMut(&FleetView<'_>, &Request) -> usize,
        S: FnMut(usize, &StepOutput),
    {
        let n = self.engines.len();
        let mut st = RunState {
            heap: BinaryHeap::new(),
            in_flight: (0..n).map(|_| None).collect(),
            seq: 0,
            dirty: Vec::new(),
            report: FleetReport {
                started_at: SimTime::ZERO,
                ended_at: SimTime::ZERO,
                routed: vec![0; n],
                records: Vec::new(),
                engine_metrics: Vec::new(),
                steps: 0,
                kv_events: 0,
            },
        };
        let mut arrivals = trace.into_iter().peekable();
        let mut previous: Option<SimTime> = None;
        loop {
            let next_done = st.heap.peek().map(|Reverse((t, _, _))| *t);
            let next_arrival = arrivals.peek().map(|a| a.at);
            let now = match (next_done, next_arrival) {
                (None, None) => break,
                (Some(d), None) => d,
                (None, Some(a)) => a,
                (Some(d), Some(a)) => d.min(a),
            };
            self.complete_steps(&mut st, now, sink);
            while let Some(a) = arrivals.next_if(|a| a.at <= now) {
                if previous.is_none() {
                    st.report.started_at = a.at;
                }
                if let Some(p) = previous.filter(|p| a.at < *p) {
                    return Err(FleetError::OutOfOrder {
                        at_ns: a.at.as_nanos(),
                        previous_ns: p.as_nanos(),
                    });
                }
                previous = Some(a.at);
                self.admit(&mut st, a, now, router)?;
            }
            self.start_steps(&mut st, now, sink);
        }
        st.report.engine_metrics = self.engines.iter().map(Engine::metrics).collect();
        Ok(st.report)
    }

    fn admit<R>(
        &mut self,
        st: &mut RunState,
        a: Arrival,
        now: SimTime,
        router: &mut R,
    ) -> Result<(), FleetError>
    where
        R: FnMut(&FleetView<'_>, &Request) -> usize,
    {
        let view = FleetView {
            engines: &self.engines,
            now,
        };
        let chosen = router(&view, &a.request);
        let engines = self.engines.len();
        let engine = self
            .engines
            .get_mut(chosen)
            .ok_or(FleetError::BadRoute { chosen, engines })?;
        let id = a.request.id.clone();
        engine
            .add_request(a.request, a.at)
            .map_err(|error| FleetError::Rejected {
                engine: chosen,
                request_id: id,
                error,
            })?;
        if let Some(r) = st.report.routed.get_mut(chosen) {
            *r += 1;
        }
        st.dirty.push(chosen);
        Ok(())
    }

    fn complete_steps<S: FnMut(usize, &StepOutput)>(
        &mut self,
        st: &mut RunState,
        now: SimTime,
        sink: &mut S,
    ) {
        while let Some(Reverse((t, _, e))) = st.heap.peek().copied() {
            if t > now {
                break;
            }
            st.heap.pop();
            if let Some(out) = st.in_flight.get_mut(e).and_then(Option::take) {
                deliver(&mut st.report, e, &out, sink);
            }
            st.dirty.push(e);
        }
    }

    fn start_steps<S: FnMut(usize, &StepOutput)>(
        &mut self,
        st: &mut RunState,
        now: SimTime,
        sink: &mut S,
    ) {
        st.dirty.sort_unstable();
        st.dirty.dedup();
        for e in std::mem::take(&mut st.dirty) {
            let idle = st.in_flight.get(e).is_some_and(Option::is_none);
            let Some(engine) = self.engines.get_mut(e) else {
                continue;
            };
            if !idle || !engine.has_work() {
                continue;
            }
            let out = engine.step(now);
            if out.scheduled_requests == 0 {
                // Nothing could run (or only events to flush): deliver now, stay idle until
                // something changes for this engine.
                deliver(&mut st.report, e, &out, sink);
                continue;
            }
            st.seq += 1;
            st.heap.push(Reverse((out.finished_at, st.seq, e)));
            if let Some(slot) = st.in_flight.get_mut(e) {
                *slot = Some(out);
            }
        }
    }
}

fn deliver<S: FnMut(usize, &StepOutput)>(
    report: &mut FleetReport,
    e: usize,
    out: &StepOutput,
    sink: &mut S,
) {
    if out.scheduled_requests > 0 {
        report.steps += 1;
    }
    report.ended_at = report.ended_at.max(out.finished_at);
    if let Some(b) = &out.events {
        report.kv_events += b.events.len() as u64;
    }
    for o in &out.outputs {
        if let Some(f) = &o.finished {
            report.records.push(RequestRecord {
                engine: e,
                request_id: Arc::clone(&o.request_id),
                arrival: f.arrival,
                first_token: f.first_token,
                finished_at: f.finished_at,
                prompt_tokens: f.usage.prompt_tokens,
                completion_tokens: f.usage.completion_tokens,
                cached_tokens: f.usage.cached_tokens,
                num_preemptions: f.num_preemptions,
            });
        }
    }
    sink(e, out);
}
