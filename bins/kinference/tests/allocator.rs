//! `kinference serve` runs with mimalloc's purge delay it sets for itself (by starting again,
//! same pid, with the variable set) unless the environment already names one, which is kept.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

/// Starts a router in front of a replica that is not there, waits for its "router started"
/// line, and returns its environment's value of `MIMALLOC_PURGE_DELAY` (every one, in order).
fn purge_delay_of_router(env: Option<&str>) -> Vec<String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kinference"));
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--admin",
        "127.0.0.1:0",
        "--model",
        "m",
        "--replica",
        "http://127.0.0.1:9",
        "--block-size",
        "16",
        "--tokenizer",
    ])
    .arg(kinference_testkit::tokenizer_dir())
    .env("NO_COLOR", "1")
    .env("RUST_LOG", "info")
    .env_remove("MIMALLOC_PURGE_DELAY")
    .stdout(Stdio::null())
    .stderr(Stdio::piped());
    if let Some(v) = env {
        cmd.env("MIMALLOC_PURGE_DELAY", v);
    }
    let mut child = cmd.spawn().unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut line = String::new();
        if stderr.read_line(&mut line).unwrap() == 0 {
            let _ = child.kill();
            panic!("the router ended before it started:\n{seen}");
        }
        seen.push_str(&line);
        if line.contains("router started") {
            break;
        }
    }
    // The pid the test started is the router's: exec kept it.
    let environ = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    environ
        .split(|&b| b == 0)
        .filter_map(|kv| {
            std::str::from_utf8(kv)
                .ok()?
                .strip_prefix("MIMALLOC_PURGE_DELAY=")
                .map(str::to_owned)
        })
        .collect()
}

#[test]
fn the_router_sets_the_purge_delay_and_keeps_an_operators() {
    assert_eq!(purge_delay_of_router(None), ["10000"]);
    assert_eq!(purge_delay_of_router(Some("-1")), ["-1"]);
}
