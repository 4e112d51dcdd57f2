//! Runs `kinfctl status` and `kinfctl explain` against a router started in process on port 0
//! in front of two simulated replicas with KV events: the fleet must show up as the router
//! sees it, the decision must rank the replica holding a prefix first, a router with an admin
//! token must be read with the token and refuse clearly without it, and an admin port that
//! does not answer, a router that is not ready, and an unknown model must be clear failures.
//! Nothing sleeps to wait: the router's state and event streams are awaited.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::SocketAddr;
use std::process::{Command, Stdio};

use kinference_proxy::api::{ExplainResponse, Health, ReplicasResponse};
use kinference_proxy::{AdminToken, Config, PoolConfig, Proxy, ReplicaSpec};
use kinference_sim_server::Server;
use kinference_testkit::sim::{self, replica_with_events};
use kinference_testkit::{tokenizer_dir, WAIT};
use serde_json::{json, Value};
use tokio::net::TcpListener;

const MODEL: &str = "tiny";
const BLOCK: u64 = 32;
/// A long shared prefix (about 1,000 tokens) and a question that differs per request.
fn prompt(question: &str) -> String {
    let mut s = String::from("Operator manual. ");
    for i in 0..120 {
        s.push_str(&format!(
            "Section {i} explains how a router reads its fleet. "
        ));
    }
    s.push_str(question);
    s
}

async fn sim() -> Server {
    let mut cfg = sim::config(MODEL, 600, BLOCK as usize, 1000.0);
    cfg.kv_events = Some(sim::events_on_port_zero());
    sim::start(cfg).await
}

fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A router on port 0 (data and admin) with one pool of `replicas`. Speculation is off, so a
/// cached prefix can only be known from the replicas' KV events.
async fn router(replicas: Vec<ReplicaSpec>) -> Proxy {
    router_with_token(replicas, None).await
}

/// [`router`], with `token` guarding its admin port.
async fn router_with_token(replicas: Vec<ReplicaSpec>, token: Option<&str>) -> Proxy {
    let mut pool = PoolConfig::new(MODEL, tokenizer_dir(), BLOCK as u32);
    pool.policy = kinference_proxy::parse_policy("{kind: precise, speculative_ttl_ms: 0}").unwrap();
    pool.replicas = replicas;
    let mut cfg = Config::new(vec![pool]);
    cfg.expose_endpoint_header = true;
    cfg.scrape.interval_ms = 50;
    cfg.admin_auth.token = token.and_then(AdminToken::new);
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    Proxy::start_with(cfg, data, admin).await.unwrap()
}

/// Two replicas with events and a router in front, every replica up, scorable, subscribed.
async fn fleet() -> (Vec<Server>, Proxy) {
    let sims = vec![sim().await, sim().await];
    let proxy = router(sims.iter().map(replica_with_events).collect()).await;
    proxy
        .wait_until(WAIT, |s| {
            s.pools.iter().flat_map(|p| &p.replicas).all(|r| {
                r.health == Health::Up
                    && r.scorable
                    && r.workers
                        .iter()
                        .all(|w| w.events.as_ref().is_some_and(|e| e.connected))
            })
        })
        .await
        .unwrap_or_else(|s| panic!("the fleet never came up: {s:#?}"));
    (sims, proxy)
}

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the binary off the runtime's threads (the router and replicas keep serving), without
/// an admin token from the environment.
async fn kinfctl(args: Vec<String>, stdin: Option<Vec<u8>>) -> Run {
    kinfctl_env(args, stdin, &[]).await
}

/// [`kinfctl`] with `env` set.
async fn kinfctl_env(args: Vec<String>, stdin: Option<Vec<u8>>, env: &[(&str, &str)]) -> Run {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let out = tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kinfctl"))
            .args(&args)
            .env_remove("KINFERENCE_ADMIN_TOKEN")
            .env_remove("KINFERENCE_ADMIN_TOKEN_FILE")
            .envs(env)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        if let Some(bytes) = stdin {
            let mut pipe = child.stdin.take().unwrap();
            pipe.write_all(&bytes).unwrap();
        }
        child.wait_with_output().unwrap()
    })
    .await
    .unwrap();
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// The cells of the first line whose cell `column` is `key` (table cells hold no spaces).
fn row<'a>(text: &'a str, column: usize, key: &str) -> Vec<&'a str> {
    text.lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|cells| cells.get(column) == Some(&key))
        .unwrap_or_else(|| panic!("no row with {key:?} in column {column}:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_every_replica_up_scorable_and_subscribed() {
    let (sims, proxy) = fleet().await;
    let admin = url(proxy.admin_addr());

    let run = kinfctl(args(&["status", "--admin", &admin]), None).await;
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    let text = &run.stdout;
    assert!(
        text.starts_with(&format!("router {admin}: ready (2 of 2 replicas up")),
        "{text}"
    );
    assert!(text.contains("pool tiny: models tiny; block size 32, sha256; policy precise"));
    assert!(
        text.contains("\n  tokenizer cache: no prompt looked up yet\n"),
        "{text}"
    );
    let header = row(text, 0, "REPLICA");
    for s in &sims {
        let cells = row(text, 1, &url(s.addr));
        let col = |name: &str| cells[header.iter().position(|h| *h == name).unwrap()];
        assert_eq!(col("HEALTH"), "up", "{text}");
        assert_eq!(col("SCORABLE"), "yes", "{text}");
        assert_eq!(col("RANK"), "dp0", "{text}");
        assert_eq!(col("EVENTS"), "connected", "{text}");
    }
    assert!(
        !text.contains("  ! "),
        "no notes on a healthy fleet:\n{text}"
    );

    // The JSON form reads back into the admin API's types.
    let run = kinfctl(
        args(&[
            "status",
            "--admin",
            proxy.admin_addr().to_string().as_str(),
            "--json",
        ]),
        None,
    )
    .await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let v: Value = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(v["ready"]["ready"], true, "{v}");
    let st: ReplicasResponse = serde_json::from_value(v["fleet"].clone()).unwrap();
    let mut urls: Vec<&str> = st.pools[0]
        .replicas
        .iter()
        .map(|r| r.url.as_str())
        .collect();
    let mut want: Vec<String> = sims.iter().map(|s| url(s.addr)).collect();
    urls.sort_unstable();
    want.sort_unstable();
    assert_eq!(urls, want);
    for r in &st.pools[0].replicas {
        assert_eq!((r.health, r.scorable), (Health::Up, true), "{r:#?}");
        assert!(r.workers[0].events.as_ref().unwrap().connected, "{r:#?}");
    }
    proxy.shutdown().await;
    for s in sims {
        s.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_ranks_the_replica_holding_the_prefix_first() {
    let (sims, proxy) = fleet().await;
    let admin = url(proxy.admin_addr());

    // Before any request nothing is cached anywhere.
    let second = json!({"prompt": prompt("And what does explain print?"), "max_tokens": 4});
    let second_bytes = serde_json::to_vec(&second).unwrap();
    let run = kinfctl(
        args(&["explain", "--admin", &admin, "--model", MODEL, "--json"]),
        Some(second_bytes.clone()),
    )
    .await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let cold: ExplainResponse = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(cold.reason, "no_cache", "{cold:#?}");
    assert!(cold.candidates.iter().all(|c| c.gpu_blocks == 0));

    let (served, blocks) = serve_first(&proxy).await;
    let gpu = explain_text(&admin, second_bytes, &served, blocks).await;
    explain_json(&admin, &second, &served, gpu).await;
    explain_unknown_model(&admin).await;
    proxy.shutdown().await;
    for s in sims {
        s.shutdown();
    }
}

/// One request through the router; returns the replica that served it and its prompt's
/// blocks, once their events are in the index and every replica is idle again.
async fn serve_first(proxy: &Proxy) -> (String, u64) {
    let first =
        json!({"model": MODEL, "prompt": prompt("What does status print?"), "max_tokens": 4});
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&first)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let served = format!(
        "http://{}",
        resp.headers()["x-kinference-endpoint"].to_str().unwrap()
    );
    let body: Value = resp.json().await.unwrap();
    let blocks = body["usage"]["prompt_tokens"].as_u64().unwrap() / BLOCK;
    proxy
        .wait_for_events(&served, 0, WAIT, |h| h.entries as u64 >= blocks && !h.stale)
        .await
        .unwrap_or_else(|e| panic!("events never reached the index: {e}"));
    proxy
        .wait_until(WAIT, |s| {
            s.pools[0]
                .replicas
                .iter()
                .flat_map(|r| &r.workers)
                .all(|w| w.load.in_flight == 0 && w.load.running == 0 && w.load.waiting == 0)
        })
        .await
        .unwrap_or_else(|s| panic!("replicas never looked idle: {s:#?}"));

    (served, blocks)
}

/// The human form, body on stdin without a model (set by --model); returns the GPU blocks
/// credited to the best replica.
async fn explain_text(admin: &str, second_bytes: Vec<u8>, served: &str, blocks: u64) -> u64 {
    let run = kinfctl(
        args(&["explain", "--admin", admin, "--model", MODEL]),
        Some(second_bytes),
    )
    .await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let text = &run.stdout;
    assert!(
        text.starts_with("pool tiny, model tiny, completions: "),
        "{text}"
    );
    let chosen = text.lines().find(|l| l.starts_with("chosen: ")).unwrap();
    assert!(
        chosen.contains(&format!("({served}), reason cached_prefix, policy precise")),
        "{text}"
    );
    let header = row(text, 0, "#");
    let best = row(text, 0, "1");
    let col = |name: &str| best[header.iter().position(|h| *h == name).unwrap()];
    assert_eq!(col("REPLICA"), served, "{text}");
    let gpu: u64 = col("GPU").parse().unwrap();
    assert!(
        gpu + 1 >= blocks,
        "{gpu} of {blocks} blocks credited:\n{text}"
    );
    assert!(col("CACHED-TOKENS").parse::<u64>().unwrap() > 0, "{text}");
    assert_eq!(col("SPECULATIVE"), "0", "{text}");
    assert_eq!(
        row(text, 0, "2")[3],
        "0",
        "the other replica caches nothing:\n{text}"
    );

    gpu
}

/// The JSON form, body from a file with its own model.
async fn explain_json(admin: &str, second: &Value, served: &str, gpu: u64) {
    let file = std::env::temp_dir().join(format!("kinfctl-explain-{}.json", std::process::id()));
    let mut with_model = second.clone();
    with_model["model"] = MODEL.into();
    std::fs::write(&file, serde_json::to_vec(&with_model).unwrap()).unwrap();
    let run = kinfctl(
        args(&[
            "explain",
            "--admin",
            admin,
            "--body",
            file.to_str().unwrap(),
            "--json",
        ]),
        None,
    )
    .await;
    std::fs::remove_file(&file).unwrap();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let e: ExplainResponse = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(e.reason, "cached_prefix", "{e:#?}");
    assert_eq!(e.candidates.len(), 2, "{e:#?}");
    assert_eq!(e.candidates[0].replica, served, "{e:#?}");
    assert_eq!(e.chosen.as_deref(), Some(e.candidates[0].worker.as_str()));
    assert_eq!(u64::from(e.candidates[0].gpu_blocks), gpu);
    assert_eq!(e.candidates[1].gpu_blocks, 0, "{e:#?}");
}

/// The router's own refusal comes back as the error, with a non-zero exit.
async fn explain_unknown_model(admin: &str) {
    let run = kinfctl(
        args(&["explain", "--admin", admin, "--model", "no-such-model"]),
        Some(br#"{"prompt": "x"}"#.to_vec()),
    )
    .await;
    assert_eq!(run.code, Some(1), "{}", run.stdout);
    assert!(run.stdout.is_empty(), "{}", run.stdout);
    assert!(
        run.stderr
            .contains("answered 404 NotFoundError: The model `no-such-model` does not exist."),
        "{}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_admin_port_is_a_clear_error() {
    // A port that was free a moment ago: nothing listens there now.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let admin = url(closed);
    for (cmd, stdin) in [
        (args(&["status", "--admin", &admin]), None),
        (
            args(&["explain", "--admin", &admin]),
            Some(br#"{"model": "tiny", "prompt": "x"}"#.to_vec()),
        ),
    ] {
        let run = kinfctl(cmd, stdin).await;
        assert_eq!(run.code, Some(1), "{}", run.stdout);
        assert!(run.stdout.is_empty(), "{}", run.stdout);
        assert!(
            run.stderr.starts_with(&format!(
                "error: cannot reach the router's admin port at {admin}"
            )),
            "{}",
            run.stderr
        );
    }

    // Input that is not a request body is refused before anything is sent.
    let run = kinfctl(
        args(&["explain", "--admin", &admin]),
        Some(b"[1, 2]".to_vec()),
    )
    .await;
    assert_eq!(run.code, Some(1));
    assert!(
        run.stderr.contains("must be a JSON object"),
        "{}",
        run.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_a_live_replica_is_reported_not_ready() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let proxy = router(vec![ReplicaSpec::new(&url(closed))]).await;
    proxy
        .wait_until(WAIT, |s| s.pools[0].replicas[0].health == Health::Down)
        .await
        .unwrap_or_else(|s| panic!("the dead replica never showed down: {s:#?}"));
    let run = kinfctl(args(&["status", "--admin", &url(proxy.admin_addr())]), None).await;
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    let text = &run.stdout;
    assert!(text.contains(": NOT READY (0 of 1 replicas up"), "{text}");
    let header = row(text, 0, "REPLICA");
    let cells = row(text, 1, &url(closed));
    assert_eq!(
        cells[header.iter().position(|h| *h == "HEALTH").unwrap()],
        "down"
    );
    assert!(
        text.lines().any(|l| l.starts_with("  ! replica-0 down: ")),
        "the scrape error is shown:\n{text}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_explain_read_a_token_guarded_router_with_the_token_only() {
    const TOKEN: &str = "kinfctl-test-token";
    let sims = vec![sim().await];
    let proxy =
        router_with_token(sims.iter().map(replica_with_events).collect(), Some(TOKEN)).await;
    proxy
        .wait_until(WAIT, |s| s.pools[0].replicas[0].health == Health::Up)
        .await
        .unwrap_or_else(|s| panic!("the replica never came up: {s:#?}"));
    let admin = url(proxy.admin_addr());
    let body = || Some(br#"{"model": "tiny", "prompt": "Which token?"}"#.to_vec());
    let status = || args(&["status", "--admin", &admin]);
    let explain = || args(&["explain", "--admin", &admin, "--json"]);

    // Without a token: refused, saying how to give one.
    for (cmd, stdin) in [(status(), None), (explain(), body())] {
        let run = kinfctl(cmd, stdin).await;
        assert_eq!(run.code, Some(1), "{}", run.stdout);
        assert!(run.stdout.is_empty(), "{}", run.stdout);
        assert!(
            run.stderr.contains("answered 401 AuthenticationError")
                && run
                    .stderr
                    .contains("--admin-token-file FILE or KINFERENCE_ADMIN_TOKEN"),
            "{}",
            run.stderr
        );
    }
    // A wrong token: refused as wrong.
    let wrong = [("KINFERENCE_ADMIN_TOKEN", "not-the-token")];
    let run = kinfctl_env(status(), None, &wrong).await;
    assert_eq!(run.code, Some(1), "{}", run.stdout);
    assert!(
        run.stderr.contains("the bearer token is wrong")
            && run.stderr.contains("is not the router's"),
        "{}",
        run.stderr
    );

    // The token from the environment.
    let env = [("KINFERENCE_ADMIN_TOKEN", TOKEN)];
    let run = kinfctl_env(status(), None, &env).await;
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    assert!(
        run.stdout
            .starts_with(&format!("router {admin}: ready (1 of 1 replicas up")),
        "{}",
        run.stdout
    );
    let run = kinfctl_env(explain(), body(), &env).await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let e: ExplainResponse = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(e.pool, MODEL, "{e:#?}");

    // The token from a file (whitespace around it ignored), by flag and by environment.
    let file = std::env::temp_dir().join(format!("kinfctl-token-{}", std::process::id()));
    std::fs::write(&file, format!("  {TOKEN}\n")).unwrap();
    let path = file.to_str().unwrap();
    let mut by_flag = status();
    by_flag.extend(args(&["--admin-token-file", path]));
    let run = kinfctl(by_flag, None).await;
    assert_eq!(run.code, Some(0), "{}{}", run.stdout, run.stderr);
    let run = kinfctl_env(explain(), body(), &[("KINFERENCE_ADMIN_TOKEN_FILE", path)]).await;
    std::fs::remove_file(&file).unwrap();
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let e: ExplainResponse = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(e.candidates.len(), 1, "{e:#?}");

    proxy.shutdown().await;
    for s in sims {
        s.shutdown();
    }
}

/// A second request on the first one's prefix is served from the replica's cache: `kinfctl
/// savings` reports the cached tokens the replica returned in `usage`, the GPU-seconds the
/// savings model charges for them (the function `kinference bench` uses), the same figures
/// as `/metrics`, and `kinfctl top --once` shows them with the fleet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savings_and_top_report_what_the_replicas_served_from_cache() {
    let (_sims, proxy) = fleet().await;
    let admin = url(proxy.admin_addr());
    serve_first(&proxy).await;
    let second =
        json!({"model": MODEL, "prompt": prompt("And what does savings print?"), "max_tokens": 4});
    let body: Value = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", proxy.data_addr()))
        .json(&second)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let prompt_tokens = body["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= BLOCK * 20, "the prefix was not cached: {body}");
    let want = kinference_proxy::SavingsModel::builtin("llama-3.1-8b-h100x1")
        .unwrap()
        .saved(prompt_tokens as u32, cached);

    // The first request found nothing cached: it adds a request but no tokens.
    let run = kinfctl(args(&["savings", "--admin", &admin, "--json"]), None).await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let s: kinference_proxy::api::SavingsResponse = serde_json::from_str(&run.stdout).unwrap();
    assert_eq!(s.total.requests_observed, 2, "{s:?}");
    assert_eq!(s.total.saved_prefill_tokens, cached);
    assert!(
        (s.total.saved_gpu_seconds - want.gpu_seconds).abs() < 1e-12,
        "{s:?} vs {want:?}"
    );
    assert!(want.gpu_seconds > 0.0);
    assert!((s.total.saved_usd - want.gpu_seconds / 3600.0 * 2.0).abs() < 1e-12);
    assert!((s.total.saved_kwh - want.gpu_seconds * 700.0 / 3.6e6).abs() < 1e-12);

    let page = reqwest::get(format!("{admin}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let pool = format!("{{pool=\"{MODEL}\"}}");
    assert_eq!(
        kinference_testkit::metric(
            &page,
            &format!("kinference_saved_prefill_tokens_total{pool}")
        ),
        cached as f64
    );
    let gpu_s = kinference_testkit::metric(
        &page,
        &format!("kinference_saved_prefill_gpu_seconds_total{pool}"),
    );
    assert!((gpu_s - want.gpu_seconds).abs() < 1e-12, "{gpu_s}");
    assert_eq!(
        kinference_testkit::metric(&page, "kinference_savings_usd_per_gpu_hour"),
        2.0
    );

    let run = kinfctl(args(&["savings", "--admin", &admin]), None).await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    let cells = row(&run.stdout, 0, MODEL);
    assert_eq!(cells[1], "2", "{}", run.stdout);
    assert_eq!(cells[2], cached.to_string(), "{}", run.stdout);
    assert!(run.stdout.contains("llama-3.1-8b-h100x1"), "{}", run.stdout);

    let run = kinfctl(args(&["top", "--admin", &admin, "--once"]), None).await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert!(
        run.stdout
            .contains(&format!("saved since start: {cached} prefill tokens")),
        "{}",
        run.stdout
    );
    for r in &proxy_replicas(&admin).await {
        assert!(
            run.stdout.contains(r.as_str()),
            "{r} missing:\n{}",
            run.stdout
        );
    }
    let run = kinfctl(
        args(&[
            "top",
            "--admin",
            &admin,
            "--iterations",
            "2",
            "--interval-ms",
            "50",
        ]),
        None,
    )
    .await;
    assert_eq!(run.code, Some(0), "{}", run.stderr);
    assert_eq!(run.stdout.matches("saved since start").count(), 2);
}

async fn proxy_replicas(admin: &str) -> Vec<String> {
    let fleet: ReplicasResponse = reqwest::get(format!("{admin}/debug/replicas"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    fleet.pools[0]
        .replicas
        .iter()
        .map(|r| r.url.clone())
        .collect()
}
