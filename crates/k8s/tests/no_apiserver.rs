//! The watcher's error path without a real API server (these run on every `cargo test`): a
//! closed port is `Unreachable`, and a stand-in that answers every request with a 403 Status
//! is `Forbidden`, naming the pool's list permission. The full behaviour is in `apiserver.rs`.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_k8s::{PoolError, PoolSnapshot, PoolState, PoolWatcher, WatchConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::watch;

fn client(port: u16) -> kube::Client {
    let url = format!("http://127.0.0.1:{port}").parse().unwrap();
    kube::Client::try_from(kube::Config::new(url)).unwrap()
}

async fn first_error(rx: &mut watch::Receiver<PoolSnapshot>) -> PoolError {
    let wait = rx.wait_for(|s| matches!(s.state, PoolState::Error(_)));
    let snap = tokio::time::timeout(Duration::from_secs(20), wait)
        .await
        .expect("no error state within 20 s")
        .unwrap()
        .clone();
    match snap.state {
        PoolState::Error(e) => e,
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn closed_port_is_unreachable() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap().port()
    };
    let w = PoolWatcher::start(client(port), WatchConfig::new("ns", "p"));
    let mut rx = w.subscribe();
    let e = first_error(&mut rx).await;
    assert_eq!(e.metric_label(), "unreachable", "{e}");
    assert!(rx.borrow().endpoints.is_empty());
}

/// Answers every request with a Kubernetes 403 Status, as RBAC would.
async fn forbid_everything(listener: TcpListener) {
    let body = r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"forbidden by the test","reason":"Forbidden","code":403}"#;
    loop {
        let Ok((mut sock, _)) = listener.accept().await else {
            return;
        };
        tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            let _ = sock.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.1 403 Forbidden\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(reply.as_bytes()).await;
        });
    }
}

#[tokio::test]
async fn forbidden_names_the_list_permission() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = tokio::spawn(forbid_everything(listener));
    let mut cfg = WatchConfig::new("models", "llama");
    cfg.routing = false;
    let w = PoolWatcher::start(client(port), cfg);
    let mut rx = w.subscribe();
    let e = first_error(&mut rx).await;
    assert_eq!(
        e.to_string(),
        "RBAC denied: missing permission to list inferencepools (API group \
         inference.networking.k8s.io) in namespace models; grant get, list and watch on it \
         (forbidden by the test)"
    );
    server.abort();
}
