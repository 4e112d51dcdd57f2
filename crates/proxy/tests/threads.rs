//! The data plane's threads: every thread serves the one data port, shutdown closes the port on
//! all of them, and a request still running when the drain time is over is cut. A test binary
//! of its own, so that the thread names it reads from /proc belong to its one router.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::Arc;

use kinference_proxy::{Config, PoolConfig, Proxy, ReplicaSpec};
use kinference_testkit::{tokenizer_dir, WAIT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The tests run one at a time: each reads the thread names of its own router.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A "replica" that answers every request on a connection with `ok` and keeps the connection
/// (so the router's pooled connections are reused), or never answers when `silent`.
async fn replica(silent: bool) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) if silent => {}
                        Ok(_) => {
                            let r = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                            if sock.write_all(r).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

fn config(replica: SocketAddr, threads: usize) -> Config {
    let mut pool = PoolConfig::new("tiny", tokenizer_dir(), 32);
    pool.replicas = vec![ReplicaSpec::new(&format!("http://{replica}"))];
    let mut c = Config::new(vec![pool]);
    c.listen = "127.0.0.1:0".into();
    c.admin = "127.0.0.1:0".into();
    c.scrape.interval_ms = 0;
    c.threads = Some(threads);
    c
}

/// One HTTP/1.1 request on its own connection; the status, or the I/O error.
async fn get_once(addr: SocketAddr, path: &str) -> std::io::Result<u16> {
    let mut s = TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).await?;
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status line in {text:?}")))
}

/// The names of this process's data-plane threads, sorted.
fn data_threads() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_owned())
        .filter(|n| n.starts_with("kinf-data-"))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_data_thread_serves_the_port_and_shutdown_closes_it() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let up = replica(false).await;
    let proxy = Proxy::start(config(up, 3)).await.unwrap();
    let addr = proxy.data_addr();
    if cfg!(target_os = "linux") {
        assert_eq!(
            data_threads(),
            ["kinf-data-0", "kinf-data-1", "kinf-data-2"]
        );
    }
    // Many connections at once: whichever thread accepts one serves it to the end.
    let mut set = tokio::task::JoinSet::new();
    for i in 0..48 {
        set.spawn(async move { get_once(addr, &format!("/v1/anything/{i}")).await });
    }
    let mut ok = 0;
    while let Some(r) = set.join_next().await {
        assert_eq!(r.unwrap().unwrap(), 200);
        ok += 1;
    }
    assert_eq!(ok, 48);
    assert_eq!(proxy.in_flight(), 0);

    tokio::time::timeout(WAIT, proxy.shutdown())
        .await
        .expect("shutdown hung");
    // No thread still holds the listening socket.
    assert!(
        TcpStream::connect(addr).await.is_err(),
        "the data port still accepts after shutdown"
    );
}

/// A burst of keep-alive connections (a client opening its pool) is spread over the threads
/// however many one thread happens to accept, each connection is served to the end by the
/// thread it landed on (every request on it answered), and the counts go back to zero as the
/// connections close.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_connections_is_spread_over_the_threads() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let up = replica(false).await;
    let proxy = Proxy::start(config(up, 4)).await.unwrap();
    let addr = proxy.data_addr();
    let mut conns = Vec::new();
    for _ in 0..32 {
        conns.push(TcpStream::connect(addr).await.unwrap());
    }
    // Three requests on each: all connections accepted, and served after any hand-over.
    for round in 0..3 {
        for (i, s) in conns.iter_mut().enumerate() {
            let req = format!("GET /v1/anything/{round}/{i} HTTP/1.1\r\nhost: x\r\n\r\n");
            s.write_all(req.as_bytes()).await.unwrap();
            let mut head = Vec::new();
            while !head.ends_with(b"\r\n\r\nok") {
                let mut byte = [0u8; 1];
                assert_eq!(s.read(&mut byte).await.unwrap(), 1, "connection {i} closed");
                head.push(byte[0]);
            }
            assert!(
                head.starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&head)
            );
        }
    }
    let open = proxy.data_connections();
    assert_eq!(open.iter().sum::<usize>(), 32, "{open:?}");
    let (lo, hi) = (open.iter().min().unwrap(), open.iter().max().unwrap());
    assert!(hi - lo <= 2, "connections per thread {open:?}");
    drop(conns);
    tokio::time::timeout(WAIT, async {
        while proxy.data_connections().iter().sum::<usize>() > 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("counts stayed at {:?}", proxy.data_connections()));
    tokio::time::timeout(WAIT, proxy.shutdown())
        .await
        .expect("shutdown hung");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_running_past_the_drain_time_is_cut() {
    let _serial = ONE_AT_A_TIME.lock().await;
    let silent = replica(true).await;
    let mut cfg = config(silent, 2);
    cfg.timeouts.drain_ms = 200;
    let proxy = Arc::new(Proxy::start(cfg).await.unwrap());
    let addr = proxy.data_addr();
    let stuck = tokio::spawn(get_once(addr, "/v1/never"));
    proxy
        .wait_until(WAIT, |s| {
            s.pools
                .iter()
                .flat_map(|p| &p.replicas)
                .flat_map(|r| &r.workers)
                .any(|w| w.load.in_flight == 1)
        })
        .await
        .unwrap_or_else(|s| panic!("the request never reached the replica: {s:#?}"));
    let proxy = Arc::try_unwrap(proxy).expect("one owner");
    tokio::time::timeout(WAIT, proxy.shutdown())
        .await
        .expect("shutdown waited for a request that never ends");
    // The client's connection was dropped with its thread: an error or an empty answer,
    // never a hang.
    let r = tokio::time::timeout(WAIT, stuck)
        .await
        .expect("the cut request hung")
        .unwrap();
    assert!(
        r.is_err(),
        "a request that never got an answer ended with {r:?}"
    );
}
