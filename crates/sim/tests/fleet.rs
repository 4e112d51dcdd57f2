//! The simulated-time fleet: routing, determinism, ordering and error handling.

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;

use kinference_sim::{
    Arrival, Engine, EngineConfig, Fleet, FleetError, FleetView, Request, SimTime, StepOutput,
};

/// Engines of 79 usable blocks of 16 tokens: about three 400-token prefixes each.
fn fleet(n: usize) -> Fleet {
    Fleet::new(
        (0..n)
            .map(|_| Engine::new(EngineConfig::small(80, 16)).unwrap())
            .collect(),
    )
    .unwrap()
}

/// 300 requests from 10 conversations, each extending a shared per-conversation prefix.
fn trace() -> Vec<Arrival> {
    (0..300u32)
        .map(|i| {
            let conv = i % 10;
            let prefix: Vec<u32> = (0..400).map(|t| conv * 100_000 + t).collect();
            let own: Vec<u32> = (0..20 + i % 30).map(|t| 9_000_000 + i * 100 + t).collect();
            Arrival {
                at: SimTime::from_millis(u64::from(i) * 20),
                request: Request::new(format!("c{conv}-{i}"), [prefix, own].concat(), 8 + i % 7),
            }
        })
        .collect()
}

fn conversation(r: &Request) -> usize {
    r.id[1..].split('-').next().unwrap().parse().unwrap()
}

#[test]
fn round_robin_finishes_everything_deterministically() {
    let go = || {
        let mut f = fleet(4);
        let mut i = 0usize;
        let mut rr = |v: &FleetView<'_>, _: &Request| {
            i += 1;
            (i - 1) % v.len()
        };
        f.run(trace(), &mut rr).unwrap()
    };
    let a = go();
    assert_eq!(a.records.len(), 300);
    assert_eq!(a.routed, vec![75; 4]);
    assert!(a.ended_at > SimTime::from_millis(299 * 20));
    assert!(a.steps > 0 && a.kv_events > 0);
    assert!(a.ttft_quantile(0.5).unwrap() > 0.0);
    assert_eq!(a, go());
}

#[test]
fn prefix_affinity_beats_round_robin_on_hit_rate() {
    let mut f = fleet(4);
    let mut i = 0usize;
    let rr = f
        .run(trace(), &mut |v: &FleetView<'_>, _: &Request| {
            i += 1;
            (i - 1) % v.len()
        })
        .unwrap();
    let mut f = fleet(4);
    let sticky = f
        .run(trace(), &mut |v: &FleetView<'_>, r: &Request| {
            conversation(r) % v.len()
        })
        .unwrap();
    assert!(
        sticky.prefix_hit_rate() > rr.prefix_hit_rate() + 0.1,
        "sticky {} rr {}",
        sticky.prefix_hit_rate(),
        rr.prefix_hit_rate()
    );
    let cached: usize = sticky.records.iter().map(|r| r.cached_tokens).sum();
    assert!(cached > 0);
}

#[test]
fn the_router_sees_live_engine_state() {
    let mut f = fleet(2);
    let mut last = SimTime::ZERO;
    let mut saw_queue = false;
    let mut router = |v: &FleetView<'_>, r: &Request| {
        assert!(v.now() >= last);
        last = v.now();
        saw_queue |= v
            .engines()
            .iter()
            .any(|e| e.num_running() + e.num_waiting() > 0);
        // A cache-aware choice: the longest cached prefix, then the shortest queue.
        (0..v.len())
            .max_by_key(|&i| {
                let e = v.engine(i).unwrap();
                let load = e.num_running() + e.num_waiting();
                (
                    e.cached_prefix_tokens(&r.prompt, &r.extras),
                    std::cmp::Reverse(load),
                )
            })
            .unwrap()
    };
    let rep = f.run(trace(), &mut router).unwrap();
    assert!(saw_queue);
    assert_eq!(rep.records.len(), 300);
}

#[test]
fn the_sink_sees_every_step_at_its_end() {
    let mut f = fleet(3);
    let mut per_engine: HashMap<usize, SimTime> = HashMap::new();
    let mut events = 0u64;
    let mut sink = |e: usize, o: &StepOutput| {
        let prev = per_engine.insert(e, o.finished_at).unwrap_or(SimTime::ZERO);
        assert!(o.started_at >= prev, "steps of one engine do not overlap");
        events += o.events.as_ref().map_or(0, |b| b.events.len() as u64);
    };
    let rep = f
        .run_with(
            trace(),
            &mut |v: &FleetView<'_>, r: &Request| conversation(r) % v.len(),
            &mut sink,
        )
        .unwrap();
    assert_eq!(events, rep.kv_events);
}

#[test]
fn bad_routes_and_unordered_traces_are_errors() {
    assert!(matches!(Fleet::new(Vec::new()), Err(FleetError::NoEngines)));
    let mut f = fleet(2);
    let err = f
        .run(trace(), &mut |_: &FleetView<'_>, _: &Request| 5)
        .unwrap_err();
    assert_eq!(
        err,
        FleetError::BadRoute {
            chosen: 5,
            engines: 2
        }
    );
    let mut f = fleet(2);
    let mut t = trace();
    t.swap(3, 7);
    let err = f
        .run(t, &mut |_: &FleetView<'_>, _: &Request| 0)
        .unwrap_err();
    assert!(matches!(err, FleetError::OutOfOrder { .. }));
    let mut f = fleet(1);
    let bad = vec![Arrival {
        at: SimTime::ZERO,
        request: Request::new("x", vec![], 1),
    }];
    let err = f
        .run(bad, &mut |_: &FleetView<'_>, _: &Request| 0)
        .unwrap_err();
    assert!(matches!(err, FleetError::Rejected { .. }));
}
