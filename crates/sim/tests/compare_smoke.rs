//! The routing comparison of `examples/compare.rs` on a small slice of the Mooncake trace:
//! cache-aware routing must hit the prefix cache more often than round-robin, and the index,
//! fed only by the engines' KV events, must end up holding exactly what the engines cache.

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

// Shared with the examples; this test uses only part of it.
#[allow(dead_code)]
#[path = "../examples/common/mod.rs"]
mod common;

use kinference_sim::{
    Arrival, Engine, EngineConfig, Fleet, FleetView, Profile, Request, SimTime, StepOutput,
};
use std::cell::RefCell;

use common::compare::{index_matches_engines, run, CacheAware, CacheAwareOptions, Policy};
use common::trace::{arrival, default_trace_path, read_trace, Slice, TraceLine};

#[test]
fn cache_aware_beats_round_robin_and_the_index_tracks_the_engines() {
    let lines = read_trace(
        &default_trace_path().unwrap(),
        Slice {
            limit: 180,
            until_ms: u64::MAX,
        },
    )
    .unwrap();
    assert_eq!(lines.len(), 180);
    let cfg = EngineConfig::from_profile(&Profile::builtin("llama-3.1-8b-h100x1").unwrap());
    let opts = CacheAwareOptions::default();
    // The three replays are independent: run them side by side.
    let (rr, ca, blind) = std::thread::scope(|s| {
        let rr =
            s.spawn(|| run(Policy::RoundRobin, &cfg, 4, &lines, opts).map_err(|e| e.to_string()));
        let blind = s.spawn(|| blind_hit_rate(&cfg, &lines, opts));
        let ca = run(Policy::CacheAware, &cfg, 4, &lines, opts).unwrap();
        (rr.join().unwrap().unwrap(), ca, blind.join().unwrap())
    });
    assert_eq!(rr.report.records.len(), 180);
    assert_eq!(ca.report.records.len(), 180);
    let (a, b) = (rr.report.prefix_hit_rate(), ca.report.prefix_hit_rate());
    assert!(
        b > a,
        "cache-aware hit rate {b} not above round-robin's {a}"
    );
    // The control: the same policy with an index that never hears an event only balances
    // load; the gain must come from the events.
    assert!(
        b > blind,
        "cache-aware hit rate {b} not above the blind policy's {blind}"
    );

    let router = ca.router.as_ref().unwrap();
    // The slice overflows the engines' caches, so the index saw evictions too.
    assert!(router.applied.stored > 0 && router.applied.removed > 0);
    assert_eq!(router.applied.ignored, 0);
    assert!(!router.index.is_empty());
    index_matches_engines(&router.index, &ca.engines).unwrap();
}

/// The cache-aware policy on a fleet whose events are dropped: its index stays empty.
fn blind_hit_rate(cfg: &EngineConfig, lines: &[TraceLine], opts: CacheAwareOptions) -> f64 {
    let engines = (0..4).map(|_| Engine::new(cfg.clone()).unwrap()).collect();
    let mut fleet = Fleet::new(engines).unwrap();
    let mut router = CacheAware::new(cfg, opts).unwrap();
    let arrivals = lines
        .iter()
        .enumerate()
        .map(|(i, l)| arrival(i, l, cfg.vocab_size));
    let mut route = |v: &FleetView<'_>, r: &Request| router.route(v, r);
    let report = fleet.run(arrivals, &mut route).unwrap();
    assert!(router.index.is_empty());
    report.prefix_hit_rate()
}

#[test]
fn cold_requests_spread_over_idle_engines() {
    let cfg = EngineConfig::small(200, 16);
    let mut fleet =
        Fleet::new((0..4).map(|_| Engine::new(cfg.clone()).unwrap()).collect()).unwrap();
    // Eight unrelated prompts at the same instant: nothing is cached anywhere.
    let trace: Vec<Arrival> = (0..8u32)
        .map(|i| Arrival {
            at: SimTime::ZERO,
            request: Request::new(format!("r{i}"), (0..64).map(|t| i * 1000 + t).collect(), 4),
        })
        .collect();
    let state = RefCell::new(CacheAware::new(&cfg, CacheAwareOptions::default()).unwrap());
    let mut route = |v: &FleetView<'_>, r: &Request| state.borrow_mut().route(v, r);
    let mut sink = |e: usize, out: &StepOutput| state.borrow_mut().observe(e, out);
    let report = fleet.run_with(trace, &mut route, &mut sink).unwrap();
    assert_eq!(report.routed, vec![2; 4]);
}

#[test]
fn a_cached_prefix_draws_its_follow_up() {
    let cfg = EngineConfig::small(200, 16);
    let mut fleet =
        Fleet::new((0..4).map(|_| Engine::new(cfg.clone()).unwrap()).collect()).unwrap();
    let shared: Vec<u32> = (0..320).collect();
    let req = |id: &str, tail: u32| {
        let mut p = shared.clone();
        p.extend(tail..tail + 20);
        Request::new(id, p, 2)
    };
    // Three cold requests first, so that engine 0 is not the default pick by index alone;
    // the follow-up of `warm` arrives once its prefix has been published.
    let mut trace: Vec<Arrival> = (0..3u32)
        .map(|i| Arrival {
            at: SimTime::ZERO,
            request: Request::new(
                format!("cold{i}"),
                (0..64).map(|t| 90_000 + i * 1000 + t).collect(),
                2,
            ),
        })
        .collect();
    trace.push(Arrival {
        at: SimTime::ZERO,
        request: req("warm", 50_000),
    });
    trace.push(Arrival {
        at: SimTime::from_millis(1000),
        request: req("follow-up", 60_000),
    });
    let state = RefCell::new(CacheAware::new(&cfg, CacheAwareOptions::default()).unwrap());
    let mut route = |v: &FleetView<'_>, r: &Request| state.borrow_mut().route(v, r);
    let mut sink = |e: usize, out: &StepOutput| state.borrow_mut().observe(e, out);
    let report = fleet.run_with(trace, &mut route, &mut sink).unwrap();
    let engine_of = |id: &str| {
        report
            .records
            .iter()
            .find(|r| &*r.request_id == id)
            .unwrap()
            .engine
    };
    assert_eq!(engine_of("warm"), 3);
    assert_eq!(engine_of("follow-up"), 3);
    let cached = report
        .records
        .iter()
        .find(|r| &*r.request_id == "follow-up")
        .unwrap()
        .cached_tokens;
    assert_eq!(cached, 320);
}
