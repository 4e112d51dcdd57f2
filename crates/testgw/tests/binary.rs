//! The `kinference-testgw` binary as scripts run it: prints its bound address first, then
//! routes through the picker.

// Helpers and tests may panic: a panic is a test failure with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

#[tokio::test]
async fn binary_prints_its_address_and_routes_through_the_picker() {
    let up = Upstream::hello("a").await;
    let picker = ToyPicker::start(route_to(&up.addr.to_string())).await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kinference-testgw"))
        .args([
            "--listen",
            "127.0.0.1:0",
            "--picker",
            &picker.addr.to_string(),
            "--endpoints",
            &up.addr.to_string(),
            "--body-mode",
            "buffered",
            "--response-body-mode",
            "streamed",
        ])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let stdout = child.stdout.take().expect("stdout");
    let mut line = String::new();
    tokio::time::timeout(WAIT, BufReader::new(stdout).read_line(&mut line))
        .await
        .expect("first line in time")
        .expect("first line");
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/completions"))
        .body("hello")
        .send()
        .await
        .expect("answer");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.text().await.expect("body"), "hello from a");
    let seen = picker.finished_stream(0).await;
    assert!(matches!(
        seen[0],
        Seen::RequestHeaders {
            request_body_mode: Some(2),
            response_body_mode: Some(1),
            ..
        }
    ));
    assert_eq!(up.received()[0].body, "hello");
    child.kill().await.expect("stop the binary");
}
