//! Runs `kinference demo` on a small workload: both policies complete every request through
//! their router, and the table, results.json and report land where they should; by default
//! the demo's own lines and one progress bar per policy are all stderr shows (no info lines
//! from the router or the replicas).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use serde_json::Value;

#[test]
fn demo_compares_round_robin_and_precise_end_to_end() {
    let out_dir = std::env::temp_dir().join(format!("kinference-demo-test-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kinference"))
        .args([
            "demo",
            "--replicas",
            "2",
            "--conversations",
            "8",
            "--turns",
            "3",
            "--speedup",
            "20",
            "--out",
        ])
        .arg(&out_dir)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    assert!(
        !stderr.contains(" INFO ") && !stderr.contains(" DEBUG "),
        "the demo is quiet by default:\n{stderr}"
    );
    for policy in ["round-robin", "precise"] {
        assert!(
            stderr.lines().any(|l| l.trim_start().starts_with(policy)
                && l.contains(&format!("[{}] 24/24 requests", "#".repeat(32)))),
            "no finished progress bar for {policy}:\n{stderr}"
        );
    }
    assert!(stdout.contains("| round-robin |"), "{stdout}");
    assert!(stdout.contains("| precise |"), "{stdout}");
    assert!(
        stdout.contains("precise vs round-robin: hit rate"),
        "{stdout}"
    );

    let results: Value =
        serde_json::from_str(&std::fs::read_to_string(out_dir.join("results.json")).unwrap())
            .unwrap();
    let policies = &results["policies"];
    for name in ["round-robin", "precise"] {
        let p = &policies[name];
        let hit = p["hit_rate"].as_f64().unwrap_or(-1.0);
        assert!((0.0..=1.0).contains(&hit), "{name}: {p}");
        assert!(p["ttft_p50_s"].as_f64().unwrap_or(0.0) > 0.0, "{name}: {p}");
        assert!(
            p["prefill_gpu_s"].as_f64().unwrap_or(0.0) > 0.0,
            "{name}: {p}"
        );
    }
    // The table's last column counts failed requests: none, for either policy.
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| round-robin |") || l.starts_with("| precise |"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    assert!(rows.iter().all(|l| l.ends_with("| 0 |")), "{stdout}");
    assert!(out_dir.join("report.md").exists());
    let _ = std::fs::remove_dir_all(&out_dir);
}
