//! Behaviour of the policies on hand-built fleets: cache wins at equal load, cold requests
//! rotate, hot prefixes spread, speculation holds bursts together, and the load-only policies.

use std::time::Duration;

use kinference_index::{ReplicaId, TierCounts, WorkerId};
use kinference_policy::{
    ApproximateConfig, Candidate, Decision, Load, Policy, PolicyConfig, PreciseConfig, Reason,
    RequestCtx,
};
use kinference_vllm::{BlockHash, DpRank};

fn w(i: u32) -> WorkerId {
    WorkerId::new(ReplicaId(i), DpRank(0))
}

fn fleet(n: u32) -> Vec<Candidate> {
    (0..n).map(|i| Candidate::new(w(i))).collect()
}

fn hashes(prefix: u64, n: u64) -> Vec<BlockHash> {
    (0..n).map(|i| BlockHash(prefix * 1_000_000 + i)).collect()
}

fn ctx(h: &[BlockHash], ticket: u64) -> RequestCtx<'_> {
    RequestCtx {
        hashes: h,
        prompt_tokens: (h.len() as u32) * 16 + 5,
        block_size: 16,
        session: None,
        ticket,
    }
}

fn gpu(n: u32) -> TierCounts {
    TierCounts {
        gpu: n,
        any: n,
        ..TierCounts::default()
    }
}

fn precise() -> Policy {
    Policy::new(PolicyConfig::Precise(PreciseConfig::default()))
}

fn assert_complete(d: &Decision, cands: &[Candidate]) {
    assert_eq!(d.ranked.len(), cands.len());
    assert_eq!(d.scores.len(), cands.len());
    for (r, s) in d.ranked.iter().zip(&d.scores) {
        assert_eq!(*r, s.worker);
    }
    for c in cands {
        assert_eq!(d.ranked.iter().filter(|&&r| r == c.worker).count(), 1);
    }
}

#[test]
fn cached_prefix_wins_at_equal_load() {
    let h = hashes(1, 40);
    let mut c = fleet(4);
    c[2].cache = gpu(30);
    c[1].cache = gpu(10);
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_complete(&d, &c);
    assert_eq!(d.chosen(), Some(w(2)));
    assert_eq!(d.ranked[1], w(1));
    assert_eq!(d.reason, Reason::CachedPrefix);
    assert_eq!(d.scores[0].predicted_cached_tokens, 30 * 16);
    assert_eq!(d.policy, "precise");
}

#[test]
fn predicted_tokens_never_exceed_the_prompt() {
    let h = hashes(1, 4);
    let mut c = fleet(1);
    c[0].cache = gpu(4);
    let r = RequestCtx {
        prompt_tokens: 64,
        ..ctx(&h, 0)
    };
    let d = precise().select(&r, &c, Duration::ZERO);
    assert_eq!(d.scores[0].predicted_cached_tokens, 64);
}

#[test]
fn cold_requests_spread_instead_of_piling_on_one_worker() {
    let mut c = fleet(5);
    let p = precise();
    let mut chosen = Vec::new();
    for t in 0..5u64 {
        let h = hashes(100 + t, 8);
        let d = p.select(&ctx(&h, t), &c, Duration::ZERO);
        assert_eq!(d.reason, Reason::NoCache);
        let w = d.chosen().unwrap();
        c.iter_mut().find(|x| x.worker == w).unwrap().load.in_flight += 1;
        chosen.push(w);
    }
    chosen.sort();
    chosen.dedup();
    assert_eq!(
        chosen.len(),
        5,
        "five cold requests in a row go to five workers"
    );
}

#[test]
fn equal_workers_share_traffic_whatever_the_ticket_stride() {
    // Load does not change between these decisions (a burst before any counter moves): only
    // the tie-break spreads them, and a caller stepping tickets by 2 or 4 must not collapse it
    // onto a subset of the workers.
    let c = fleet(4);
    let p = precise();
    for stride in [1u64, 2, 4] {
        let mut counts = [0usize; 4];
        for k in 0..400u64 {
            let h = hashes(1000 + k, 4);
            let w = p
                .select(&ctx(&h, k * stride), &c, Duration::ZERO)
                .chosen()
                .unwrap();
            counts[w.replica.0 as usize] += 1;
        }
        assert!(
            counts.iter().all(|&n| n >= 60),
            "stride {stride}: {counts:?}"
        );
    }
}

#[test]
fn a_much_busier_worker_loses_a_short_prefix() {
    let h = hashes(1, 4);
    let mut c = fleet(3);
    c[0].cache = gpu(2); // 32 tokens: not worth a queue
    c[0].load.running = 6;
    c[1].load.running = 3;
    c[2].load.running = 3;
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_ne!(d.chosen(), Some(w(0)));
    assert!(matches!(
        d.reason,
        Reason::LoadOverCache | Reason::PrefixSpread
    ));
}

#[test]
fn a_hot_prefix_spreads_across_the_fleet() {
    // Every request shares a 64-block system prompt that only worker 0 holds; requests never
    // finish, so load only grows. The cap keeps every worker near the fair share.
    let cfg = PreciseConfig {
        speculative_ttl: Duration::ZERO,
        ..PreciseConfig::default()
    };
    let (cap, slack) = (cfg.fair_share_cap, cfg.fair_share_slack);
    let p = Policy::new(PolicyConfig::Precise(cfg));
    let mut c = fleet(8);
    let mut spread = 0;
    for t in 0..400u64 {
        let h = hashes(7, 64);
        for cand in c.iter_mut() {
            cand.cache = if cand.worker == w(0) { gpu(64) } else { gpu(0) };
        }
        let d = p.select(&ctx(&h, t), &c, Duration::ZERO);
        assert_complete(&d, &c);
        if d.reason == Reason::PrefixSpread {
            spread += 1;
        }
        let chosen = d.chosen().unwrap();
        let cand = c.iter_mut().find(|x| x.worker == chosen).unwrap();
        cand.load.in_flight += 1;
        let total: f64 = c.iter().map(|x| x.load.outstanding()).sum();
        let max = c.iter().map(|x| x.load.outstanding()).fold(0.0, f64::max);
        // The slack lets the holder run a few requests past the ratio while the fleet is
        // nearly idle, so it belongs in the bound too.
        let fair = total / 8.0;
        assert!(
            max <= (cap * fair).max(fair + slack).max(fair.ceil()) + 1.0,
            "request {t}: busiest worker has {max} of {total}"
        );
    }
    assert!(spread > 100, "the hot prefix was spread {spread} times");
    // Worker 0 holds the prefix: it takes more than its fair share of 50, up to the cap.
    let on_zero = c[0].load.in_flight;
    let most = (cap * 50.0) as u32 + 1;
    assert!(
        (51..=most).contains(&on_zero),
        "worker 0 took {on_zero} of 400"
    );
}

#[test]
fn at_low_concurrency_a_slightly_busier_worker_keeps_its_long_prefix() {
    // Six requests on four workers: the one holding this conversation's 64 blocks has two more
    // than each of the others. The default ratio alone (2 × 7/4 = 3.5 requests, this one
    // included) would rank it last and recompute 1,024 tokens elsewhere to save two queued
    // requests.
    let h = hashes(1, 64);
    let mut c = fleet(4);
    c[0].cache = gpu(64);
    c[0].load.in_flight = 3;
    for cand in &mut c[1..] {
        cand.load.in_flight = 1;
    }
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_complete(&d, &c);
    assert_eq!(d.chosen(), Some(w(0)));
    assert_eq!(d.reason, Reason::CachedPrefix);
    assert!(d.scores.iter().all(|s| !s.over_cap), "{:?}", d.scores);
}

#[test]
fn under_fleet_load_a_prefix_all_traffic_shares_still_spreads() {
    // Every request shares a 64-block prefix only worker 0 holds, and none finish. While the
    // fleet is nearly idle the holder keeps the first few (the slack); once the fair share is
    // many requests the ratio binds and the holder goes over the cap.
    let cfg = PreciseConfig {
        speculative_ttl: Duration::ZERO,
        ..PreciseConfig::default()
    };
    let cap = cfg.fair_share_cap;
    let p = Policy::new(PolicyConfig::Precise(cfg));
    let h = hashes(9, 64);
    let mut c = fleet(8);
    c[0].cache = gpu(64);
    let mut first_to_holder = 0;
    let mut holder_over_cap = 0;
    for t in 0..320u64 {
        let d = p.select(&ctx(&h, t), &c, Duration::ZERO);
        let chosen = d.chosen().unwrap();
        if t < 3 && chosen == w(0) {
            first_to_holder += 1;
        }
        let holder = d.scores.iter().find(|s| s.worker == w(0)).unwrap();
        if t >= 160 && holder.over_cap {
            holder_over_cap += 1;
            assert_ne!(chosen, w(0), "request {t}");
            assert_eq!(d.reason, Reason::PrefixSpread, "request {t}");
        }
        c.iter_mut()
            .find(|x| x.worker == chosen)
            .unwrap()
            .load
            .in_flight += 1;
    }
    assert_eq!(
        first_to_holder, 3,
        "a nearly idle fleet keeps the prefix together"
    );
    assert!(holder_over_cap > 80, "over cap {holder_over_cap} of 160");
    // 320 requests: a fair share of 40, and the holder ends at the ratio, not above it.
    let on_zero = f64::from(c[0].load.in_flight);
    assert!(
        (41.0..=cap * 40.0 + 1.0).contains(&on_zero),
        "worker 0 took {on_zero} of 320"
    );
}

#[test]
fn unscorable_workers_are_routed_by_load_only() {
    let h = hashes(1, 40);
    let mut c = fleet(2);
    c[0].cache = gpu(40);
    c[0].scorable = false;
    c[1].load.running = 1;
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_eq!(d.chosen(), Some(w(0)));
    assert_eq!(d.reason, Reason::NoCache);
    assert_eq!(d.scores[0].gpu_blocks, 0);
    assert!(!d.scores[0].scorable);
}

#[test]
fn a_worker_short_of_kv_memory_keeps_the_prefix_it_holds_unless_pressure_is_priced() {
    // Worker 0 holds 40 of the prompt's blocks and is at 98 % KV usage; the others hold
    // nothing and have room. Sending the request elsewhere would store the whole prefix again
    // where memory is just as needed, so by default the cache wins.
    let h = hashes(1, 44);
    let mut c = fleet(3);
    c[0].cache = gpu(40);
    c[0].load.kv_usage = 0.98;
    c[1].load.kv_usage = 0.5;
    c[2].load.kv_usage = 0.5;
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_eq!(d.chosen(), Some(w(0)));
    // Priced above the prefix's worth (640 tokens), the pressure term moves it.
    let priced = Policy::new(PolicyConfig::Precise(PreciseConfig {
        kv_pressure_tokens: 2048.0,
        ..PreciseConfig::default()
    }));
    let d = priced.select(&ctx(&h, 0), &c, Duration::ZERO);
    assert_ne!(d.chosen(), Some(w(0)));
}

#[test]
fn queued_prefill_moves_a_request_only_when_it_outweighs_the_cached_prefix() {
    // Each worker has one request of this router in flight; worker 0's is still prefilling
    // uncached tokens. Worker 0 holds 40 blocks (640 tokens) of this prompt.
    let h = hashes(1, 44);
    let mut c = fleet(3);
    for x in &mut c {
        x.load.in_flight = 1;
    }
    c[0].cache = gpu(40);
    let pick = |p: &Policy, queued: u64| {
        let mut c = c.clone();
        c[0].load.in_flight_prefill_tokens = queued;
        p.select(&ctx(&h, 0), &c, Duration::ZERO).chosen()
    };
    // At the default weight 6,000 queued tokens cost 450 cached tokens' worth: the prefix stays.
    assert_eq!(pick(&precise(), 6_000), Some(w(0)));
    // 12,000 cost 900, more than the 640 it would save: the request goes to an idle worker.
    assert_ne!(pick(&precise(), 12_000), Some(w(0)));
    // A heavier weight moves the first one too.
    let heavy = Policy::new(PolicyConfig::Precise(PreciseConfig {
        pending_prefill_weight: 0.25,
        ..PreciseConfig::default()
    }));
    assert_ne!(pick(&heavy, 6_000), Some(w(0)));
}

#[test]
fn offloaded_blocks_count_at_a_discount() {
    let h = hashes(1, 40);
    let mut c = fleet(3);
    c[0].cache = gpu(20);
    c[1].cache = TierCounts {
        gpu: 0,
        cpu: 30,
        storage: 0,
        any: 30,
    };
    c[2].cache = TierCounts {
        gpu: 0,
        cpu: 45,
        storage: 0,
        any: 45,
    };
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    // 20 GPU blocks beat 30 CPU blocks at half credit (15), lose to 45 at half credit (22.5).
    assert_eq!(d.ranked, vec![w(2), w(0), w(1)]);
    assert_eq!(d.scores[0].offloaded_blocks, 45);
}

#[test]
fn speculation_keeps_a_burst_together_until_it_expires() {
    let mut p = precise();
    let c = fleet(4);
    let h = hashes(3, 32);
    let t0 = Duration::from_secs(10);
    let first = p.select(&ctx(&h, 1), &c, t0);
    assert_eq!(first.reason, Reason::NoCache);
    p.apply(&first, &h, t0);
    let target = first.chosen().unwrap();

    // The same conversation again, before any event arrived, from a different ticket.
    let second = p.select(&ctx(&h, 2), &c, t0 + Duration::from_millis(500));
    assert_eq!(second.chosen(), Some(target));
    assert_eq!(second.reason, Reason::CachedPrefix);
    assert_eq!(second.scores[0].speculative_blocks, 32);

    // Once the TTL has passed the entry is gone and rotation takes over again.
    let late = t0 + PreciseConfig::default().speculative_ttl + Duration::from_millis(1);
    let third = p.select(&ctx(&h, 2), &c, late);
    assert_eq!(third.reason, Reason::NoCache);
    assert_eq!(third.scores[0].speculative_blocks, 0);
    p.expire(late);
    assert_eq!(p.tracked_entries(), 0);
}

#[test]
fn an_undone_speculation_leaves_nothing_and_spares_what_others_recorded() {
    let mut p = precise();
    let c = fleet(4);
    let h = hashes(5, 16);
    let t0 = Duration::from_secs(1);
    let d = p.select(&ctx(&h, 1), &c, t0);
    let refused = p.apply(&d, &h, t0);
    assert_eq!(p.tracked_entries(), 16);
    p.undo(refused, &h, t0);
    assert_eq!(
        p.tracked_entries(),
        0,
        "the refused request's entries are gone"
    );
    let again = p.select(&ctx(&h, 1), &c, t0);
    assert_eq!(again.reason, Reason::NoCache);

    // A request the worker answered, then one it refused for the same prefix: undoing the
    // second brings back the first's entries with their own deadline.
    let answered = p.apply(&d, &h, t0);
    drop(answered);
    let t1 = t0 + Duration::from_millis(500);
    let refused = p.apply(&d, &h, t1);
    p.undo(refused, &h, t1);
    assert_eq!(p.tracked_entries(), 16);
    let ttl = PreciseConfig::default().speculative_ttl;
    let s = p.select(&ctx(&h, 2), &c, t0 + ttl - Duration::from_millis(1));
    assert_eq!(
        s.scores[0].speculative_blocks, 16,
        "still the answered one's"
    );
    let s = p.select(&ctx(&h, 2), &c, t0 + ttl + Duration::from_millis(1));
    assert_eq!(
        s.scores[0].speculative_blocks, 0,
        "its deadline, not the refused one's"
    );

    // A refusal undone after a later request refreshed the entries leaves them to that one.
    let t2 = t0 + ttl * 3;
    let refused = p.apply(&d, &h, t2);
    let later = t2 + Duration::from_millis(100);
    let _kept = p.apply(&d, &h, later);
    p.undo(refused, &h, later);
    let s = p.select(&ctx(&h, 3), &c, later);
    assert_eq!(s.scores[0].speculative_blocks, 16);
    p.expire(later + ttl);
    assert_eq!(
        p.tracked_entries(),
        0,
        "restored and refreshed entries still expire"
    );
}

#[test]
fn speculation_does_not_double_count_confirmed_blocks() {
    let mut p = precise();
    let mut c = fleet(2);
    let h = hashes(4, 10);
    let d = p.select(&ctx(&h, 0), &c, Duration::ZERO);
    p.apply(&d, &h, Duration::ZERO);
    let chosen = d.chosen().unwrap();
    for cand in c.iter_mut() {
        if cand.worker == chosen {
            cand.cache = gpu(6);
        }
    }
    let d2 = p.select(&ctx(&h, 1), &c, Duration::from_millis(1));
    assert_eq!(d2.scores[0].gpu_blocks, 10);
    assert_eq!(d2.scores[0].speculative_blocks, 4);
}

/// The record keeps only what the index had not confirmed for the chosen worker: the
/// confirmed blocks are the events' to keep (and to take away when the worker evicts one).
#[test]
fn speculation_records_only_the_blocks_the_index_had_not_confirmed() {
    let mut p = precise();
    let mut c = fleet(2);
    c[0].cache = gpu(6);
    let h = hashes(7, 10);
    let t0 = Duration::from_secs(1);
    let d = p.select(&ctx(&h, 0), &c, t0);
    assert_eq!(d.chosen(), Some(w(0)));
    let applied = p.apply(&d, &h, t0);
    assert_eq!(p.tracked_entries(), 4, "blocks 6..10 only");

    // Before the events come: the index's 6, lengthened to all 10.
    let t1 = t0 + Duration::from_millis(10);
    let s = p.select(&ctx(&h, 1), &c, t1);
    assert_eq!(
        (s.scores[0].gpu_blocks, s.scores[0].speculative_blocks),
        (10, 4)
    );

    // The worker evicted block 3 meanwhile: the credit stops there, as the index does.
    c[0].cache = gpu(3);
    let s = p.select(&ctx(&h, 2), &c, t1);
    assert_eq!(
        s.scores
            .iter()
            .find(|s| s.worker == w(0))
            .unwrap()
            .gpu_blocks,
        3
    );

    // A refusal takes back exactly what was recorded.
    p.undo(applied, &h, t1);
    assert_eq!(p.tracked_entries(), 0);

    // A fallback that answered records from its own confirmed prefix (none here).
    c[0].cache = gpu(6);
    let mut landed = p.select(&ctx(&h, 3), &c, t1);
    landed.ranked = vec![w(1)];
    let _kept = p.apply(&landed, &h, t1);
    assert_eq!(p.tracked_entries(), 10);
}

#[test]
fn approximate_learns_from_what_it_routed() {
    let mut p = Policy::new(PolicyConfig::Approximate(ApproximateConfig::default()));
    let mut c = fleet(4);
    for x in c.iter_mut() {
        x.cache = gpu(99); // ignored: the approximate policy does not read the index
    }
    let h = hashes(5, 20);
    let d = p.select(&ctx(&h, 3), &c, Duration::ZERO);
    assert_eq!(d.reason, Reason::NoCache);
    p.apply(&d, &h, Duration::ZERO);
    let longer: Vec<BlockHash> = h.iter().copied().chain(hashes(6, 5)).collect();
    let d2 = p.select(&ctx(&longer, 0), &c, Duration::from_secs(60));
    assert_eq!(d2.chosen(), d.chosen());
    assert_eq!(d2.scores[0].gpu_blocks, 20);
    assert_eq!(d2.policy, "approximate");
    let after = ApproximateConfig::default().ttl + Duration::from_secs(1);
    let d3 = p.select(&ctx(&longer, 0), &c, after);
    assert_eq!(d3.reason, Reason::NoCache);
}

#[test]
fn round_robin_cycles_by_ticket() {
    let p = Policy::new(PolicyConfig::RoundRobin);
    let mut c = fleet(3);
    c[0].load.running = 50;
    let picks: Vec<_> = (0..6)
        .map(|t| p.select(&ctx(&[], t), &c, Duration::ZERO).chosen().unwrap())
        .collect();
    assert_eq!(picks, vec![w(0), w(1), w(2), w(0), w(1), w(2)]);
}

#[test]
fn least_load_picks_the_idlest_and_rotates_ties() {
    let p = Policy::new(PolicyConfig::LeastLoad);
    let mut c = fleet(3);
    c[0].load.running = 2;
    c[1].load = Load {
        waiting: 1,
        ..Load::default()
    };
    c[2].load.in_flight = 1;
    let d = p.select(&ctx(&[], 0), &c, Duration::ZERO);
    assert_eq!(d.reason, Reason::LeastLoad);
    assert_eq!(*d.ranked.last().unwrap(), w(0));
    let firsts: Vec<_> = (0..3)
        .map(|t| p.select(&ctx(&[], t), &c, Duration::ZERO).chosen().unwrap())
        .collect();
    assert!(firsts.contains(&w(1)) && firsts.contains(&w(2)));
}

#[test]
fn session_affinity_is_stable_and_moves_only_sessions_of_a_leaving_worker() {
    let p = Policy::new(PolicyConfig::SessionAffinity);
    let c = fleet(5);
    let keys: Vec<String> = (0..200).map(|i| format!("user-{i}")).collect();
    let pick = |cands: &[Candidate], key: &str, t: u64| {
        let r = RequestCtx {
            session: Some(key),
            ..ctx(&[], t)
        };
        p.select(&r, cands, Duration::ZERO).chosen().unwrap()
    };
    let before: Vec<_> = keys.iter().map(|k| pick(&c, k, 0)).collect();
    for (k, b) in keys.iter().zip(&before) {
        assert_eq!(pick(&c, k, 17), *b, "same session, other ticket");
    }
    let mut counts = [0usize; 5];
    for b in &before {
        counts[b.replica.0 as usize] += 1;
    }
    assert!(
        counts.iter().all(|&n| n >= 15),
        "sessions spread: {counts:?}"
    );
    let fewer: Vec<Candidate> = c.iter().copied().filter(|x| x.worker != w(3)).collect();
    for (k, b) in keys.iter().zip(&before) {
        let now = pick(&fewer, k, 0);
        if *b != w(3) {
            assert_eq!(now, *b, "{k} moved although its worker stayed");
        }
    }
    let none = p.select(&ctx(&[], 0), &c, Duration::ZERO);
    assert_eq!(none.reason, Reason::NoSession);
}

#[test]
fn no_candidates_gives_an_empty_decision() {
    let d = precise().select(&ctx(&hashes(1, 3), 0), &[], Duration::ZERO);
    assert!(d.chosen().is_none());
    assert_eq!(d.reason, Reason::NoCandidates);
}

#[test]
fn decision_serializes_for_explanation() {
    let h = hashes(1, 3);
    let mut c = fleet(2);
    c[1].cache = gpu(3);
    let d = precise().select(&ctx(&h, 0), &c, Duration::ZERO);
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["reason"], "cached_prefix");
    assert_eq!(v["ranked"][0], w(1).to_string());
    assert_eq!(v["scores"][0]["gpu_blocks"], 3);
    assert_eq!(v["policy"], "precise");
}

#[test]
fn config_defaults_unknown_fields_and_all_errors_at_once() {
    let p: PolicyConfig = serde_json::from_str(r#"{"kind":"precise"}"#).unwrap();
    assert_eq!(p, PolicyConfig::default());
    let p: PolicyConfig = serde_json::from_str(
        r#"{"kind":"precise","speculative_ttl_ms":500,"fair_share_cap":1.75}"#,
    )
    .unwrap();
    match &p {
        PolicyConfig::Precise(c) => {
            assert_eq!(c.speculative_ttl, Duration::from_millis(500));
            assert_eq!(c.fair_share_cap, 1.75);
        }
        other => panic!("{other:?}"),
    }
    let a: PolicyConfig = serde_json::from_str(
        r#"{"kind":"approximate","ttl_ms":1000,"scoring":{"load_weight_tokens":10}}"#,
    )
    .unwrap();
    match &a {
        PolicyConfig::Approximate(c) => {
            assert_eq!(c.ttl, Duration::from_secs(1));
            assert_eq!(c.scoring.load_weight_tokens, 10.0);
        }
        other => panic!("{other:?}"),
    }
    let rr: PolicyConfig = serde_json::from_str(r#"{"kind":"round-robin"}"#).unwrap();
    assert_eq!(rr.name(), "round-robin");
    assert!(serde_json::from_str::<PolicyConfig>(r#"{"kind":"precise","bogus":1}"#).is_err());
    assert!(serde_json::from_str::<PolicyConfig>(r#"{"kind":"fastest"}"#).is_err());

    let bad = PolicyConfig::Precise(PreciseConfig {
        fair_share_cap: 0.5,
        load_weight_tokens: -1.0,
        kv_pressure_threshold: 2.0,
        ..PreciseConfig::default()
    });
    let errs = bad.validate();
    let fields: Vec<_> = errs.iter().map(|e| e.field).collect();
    assert_eq!(
        fields,
        vec![
            "load_weight_tokens",
            "fair_share_cap",
            "kv_pressure_threshold"
        ]
    );
    assert!(PolicyConfig::default().validate().is_empty());
    for slack in [-1.0, f64::NAN, f64::INFINITY] {
        let bad = PolicyConfig::Precise(PreciseConfig {
            fair_share_slack: slack,
            ..PreciseConfig::default()
        });
        let errs = bad.validate();
        assert_eq!(errs.len(), 1, "{slack}: {errs:?}");
        assert_eq!(errs[0].field, "fair_share_slack");
        assert!(errs[0].to_string().contains(">= 0"), "{}", errs[0]);
    }
    let p: PolicyConfig =
        serde_json::from_str(r#"{"kind":"precise","fair_share_slack":0}"#).unwrap();
    assert!(matches!(p, PolicyConfig::Precise(c) if c.fair_share_slack == 0.0));
    for name in [
        "precise",
        "approximate",
        "round-robin",
        "least-load",
        "session-affinity",
    ] {
        assert_eq!(PolicyConfig::from_name(name).unwrap().name(), name);
    }
    assert!(PolicyConfig::from_name("random").is_none());
}
