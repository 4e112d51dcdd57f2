//! A tiny simulated-time benchmark, end to end: a shared-prefix workload on four engines
//! under round-robin, precise and the oracle; cache-aware routing must serve more prompt
//! tokens from cache than round-robin, and `results.json` must carry every documented field.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kinference_bench::synth::SharedPrefix;
use kinference_bench::{
    bounds, compare_sim, summarize, Arrivals, Costs, PolicyResult, Report, RunReport, SimPolicy,
    SimSetup, Workload,
};

/// 300 requests over 16 prefixes of 2,048 tokens, at the workload's own times.
fn workload() -> (Workload, Arrivals) {
    let mut w = SharedPrefix {
        requests: 300,
        groups: 16,
        zipf_s: 1.0,
        prefix_tokens: 2048,
        suffix_tokens: 128,
        output_tokens: 16,
        rate: 15.0,
        seed: 11,
    }
    .generate()
    .unwrap();
    let arrivals = Arrivals::Trace { speedup: 1.0 };
    arrivals.apply(&mut w).unwrap();
    (w, arrivals)
}

#[test]
fn cache_aware_beats_round_robin_and_results_json_has_the_fields() {
    let (w, arrivals) = workload();
    // 4 engines of 8k tokens each: three prefixes fit per engine, not all sixteen.
    let setup = SimSetup::from_profile("llama-3.1-8b-h100x1", 4, Some(8_192)).unwrap();
    let policies: Vec<SimPolicy> = ["round-robin", "precise", "oracle"]
        .iter()
        .map(|p| SimPolicy::from_name(p).unwrap())
        .collect();
    let costs = Costs::default();
    let mut reports = 0usize;
    let runs = compare_sim(&setup, &w, &policies, &costs, &mut |_| reports += 1).unwrap();
    assert!(reports > 3, "progress was reported {reports} times");
    let hit = |name: &str| {
        runs.iter()
            .find(|r| r.result.policy == name)
            .unwrap()
            .result
            .clone()
    };
    let (rr, precise, oracle) = (hit("round-robin"), hit("precise"), hit("oracle"));
    for r in [&rr, &precise, &oracle] {
        check_result(r);
    }
    assert!(
        precise.hit_rate > rr.hit_rate + 0.15,
        "precise {} vs round-robin {}",
        precise.hit_rate,
        rr.hit_rate
    );
    assert!(oracle.hit_rate > rr.hit_rate + 0.15);
    assert!(precise.prefill_gpu_s.unwrap() < rr.prefill_gpu_s.unwrap());
    assert!(precise.prefill_gpu_s_saved_vs_rr.unwrap() > 0.0);

    let b = bounds::compute(
        &w,
        setup.replicas,
        setup.blocks_per_replica(),
        setup.engine.block_size,
        setup.engine.vocab_size,
        setup.engine.max_model_len,
    );
    assert!(b.infinite_hit_rate >= b.pooled_hit_rate);
    assert!(b.infinite_hit_rate + 1e-9 >= precise.hit_rate);

    let report = Report {
        mode: "sim".into(),
        fleet: serde_json::json!({"replicas": 4}),
        costs,
        runs: vec![RunReport {
            label: "smoke".into(),
            load: None,
            speedup: Some(1.0),
            workload: summarize(&w, &arrivals),
            bounds: Some(b),
            policies: runs,
        }],
    };
    check_files(&report);
}

/// Every request completed, with sane latencies and balance.
fn check_result(r: &PolicyResult) {
    eprintln!(
        "{} hit {:.3} ttft p50 {:?} imb {:?} util {:?}",
        r.policy, r.hit_rate, r.ttft_p50_s, r.imbalance, r.utilization
    );
    assert_eq!(r.completed, 300, "{}", r.policy);
    assert!(r.ttft_p50_s.unwrap() > 0.0);
    assert!(r.ttft_p99_s.unwrap() >= r.ttft_p50_s.unwrap());
    assert!(r.imbalance.unwrap() >= 1.0);
}

/// `results.json` carries every documented field, the markdown the table, and both plots
/// are PNGs.
fn check_files(report: &Report) {
    let dir = std::env::temp_dir().join(format!("kinference-bench-smoke-{}", std::process::id()));
    report.write_json(&dir).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("results.json")).unwrap()).unwrap();
    for policy in ["round-robin", "precise", "oracle"] {
        let p = &v["policies"][policy];
        for field in [
            "hit_rate",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "e2e_p50_s",
            "throughput_rps",
            "imbalance",
            "prefill_gpu_s",
        ] {
            assert!(p[field].is_number(), "{policy}.{field} = {}", p[field]);
        }
    }
    assert!(report.markdown("cmd").contains("| precise |"));
    let pngs = kinference_bench::plot::write_plots(report, &dir).unwrap();
    assert_eq!(pngs.len(), 2, "{pngs:?}");
    for p in &pngs {
        let bytes = std::fs::read(p).unwrap();
        assert!(
            bytes.starts_with(b"\x89PNG") && bytes.len() > 5_000,
            "{}",
            p.display()
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
