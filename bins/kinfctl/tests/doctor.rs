//! Runs `kinfctl doctor` against an in-process simulated replica with KV events on: it must
//! pass when the router's settings match, and name the setting when they do not.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

use kinference_sim_server::Server;
use kinference_testkit::{sim, tokenizer_dir};

async fn replica() -> Server {
    let mut cfg = sim::config("tiny", 400, 32, 1000.0);
    cfg.engine.max_model_len = 4096;
    cfg.kv_events = Some(sim::events_on_port_zero());
    sim::start(cfg).await
}

/// Runs the binary off the runtime's threads (the replica keeps serving meanwhile).
async fn doctor(server: &Server, extra: &[&str]) -> (bool, String) {
    let mut args = vec![
        "doctor".to_owned(),
        "--replica".to_owned(),
        format!("http://{}", server.addr),
        "--timeout-secs".to_owned(),
        "10".to_owned(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_kinfctl"))
            .args(&args)
            .env("RUST_LOG", "kinference_events=debug")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains("verdict:") || stdout.contains("\"hashes_match\""),
        "no report; stderr: {stderr}\nstdout: {stdout}"
    );
    if !out.status.success() {
        eprintln!("kinfctl stderr:\n{stderr}");
    }
    (out.status.success(), stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn matching_settings_pass_every_check() {
    let server = replica().await;
    let dir = tokenizer_dir();
    let (ok, report) = doctor(&server, &["--tokenizer", dir.to_str().unwrap()]).await;
    assert!(ok, "{report}");
    for check in [
        "replica", "config", "tokenize", "events", "hashes", "cached",
    ] {
        assert!(
            report
                .lines()
                .any(|l| l.starts_with("ok") && l.contains(check)),
            "check {check} did not pass:\n{report}"
        );
    }
    assert!(report.contains("block size 32, hash sha256"), "{report}");
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_algorithm_is_named() {
    let server = replica().await;
    let (ok, report) = doctor(&server, &["--algo", "sha256_cbor", "--json"]).await;
    assert!(!ok, "{report}");
    let json_start = report.find('{').unwrap();
    let json_end = report.rfind('}').unwrap();
    let v: serde_json::Value = serde_json::from_str(&report[json_start..=json_end]).unwrap();
    assert_eq!(v["hashes_match"], false);
    let checks = v["checks"].as_array().unwrap();
    let detail = |name: &str| {
        checks
            .iter()
            .filter(|c| c["name"] == name && c["status"] == "fail")
            .map(|c| c["detail"].as_str().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(" | ")
    };
    assert!(
        detail("config").contains("router sha256_cbor, replica sha256"),
        "{report}"
    );
    assert!(
        detail("hashes")
            .contains("replica hashes with hash algorithm sha256 (router: sha256_cbor)"),
        "{report}"
    );
    server.shutdown();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_block_size_and_a_wrong_seed_are_named() {
    let server = replica().await;
    let (ok, report) = doctor(&server, &["--block-size", "16"]).await;
    assert!(!ok, "{report}");
    assert!(
        report.contains("block size: router 16, replica 32"),
        "{report}"
    );
    assert!(report.contains("block size 32 (router: 16)"), "{report}");

    let (ok, report) = doctor(&server, &["--seed", "7"]).await;
    assert!(!ok, "{report}");
    assert!(report.contains("seed unset (router: 7)"), "{report}");
    server.shutdown();
}
