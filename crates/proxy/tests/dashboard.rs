//! The admin port's dashboard behind a token: the page and its assets (no data) are served
//! to anyone, with a policy that lets them load nothing from elsewhere; the data
//! (`/debug/dashboard`, `/debug/savings`) only with the token, and a router that has served
//! nothing reports zero savings at the configured prices.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kinference_proxy::api::{DashboardResponse, SavingsResponse};
use kinference_proxy::{AdminToken, Config, PoolConfig, Proxy, ReplicaSpec};
use kinference_testkit::{tokenizer_dir, unused_port};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_open_and_its_data_needs_the_token() {
    // A replica nobody listens on: the admin port answers all the same.
    let mut pool = PoolConfig::new("tiny", tokenizer_dir(), 16);
    pool.replicas = vec![ReplicaSpec::new(&format!(
        "http://127.0.0.1:{}",
        unused_port()
    ))];
    let mut cfg = Config::new(vec![pool]);
    cfg.listen = "127.0.0.1:0".into();
    cfg.admin = "127.0.0.1:0".into();
    cfg.admin_auth.token = AdminToken::new("t0ken");
    cfg.savings.usd_per_gpu_hour = 3.5;
    cfg.savings.gpu_watts = 400.0;
    let proxy = Proxy::start(cfg).await.unwrap();
    let base = format!("http://{}", proxy.admin_addr());
    let http = reqwest::Client::new();

    for (path, kind, needle) in [
        ("/dashboard", "text/html", "/dashboard/app.js"),
        ("/dashboard/app.js", "text/javascript", "/debug/dashboard"),
        ("/dashboard/app.css", "text/css", "--panel"),
    ] {
        let resp = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 200, "{path}");
        let h = resp.headers();
        assert!(
            h["content-type"].to_str().unwrap().starts_with(kind),
            "{path}"
        );
        let csp = h["content-security-policy"].to_str().unwrap();
        assert!(csp.contains("default-src 'self'"), "{csp}");
        let body = resp.text().await.unwrap();
        assert!(body.contains(needle), "{path}: {body}");
        // Nothing from the network: no absolute URL to fetch anything from.
        for line in body.lines() {
            let l = line.to_ascii_lowercase();
            assert!(
                !(l.contains("src=\"http") || l.contains("href=\"http") || l.contains("@import")),
                "{path} loads from elsewhere: {line}"
            );
        }
    }

    for path in ["/debug/dashboard", "/debug/savings"] {
        let resp = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{path}");
        let resp = http
            .get(format!("{base}{path}"))
            .bearer_auth("wrong")
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 401, "{path}");
    }

    let d: DashboardResponse = http
        .get(format!("{base}/debug/dashboard"))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(d.fleet.pools.len(), 1);
    assert_eq!(d.interval_secs, 1.0);
    assert_eq!(d.savings.usd_per_gpu_hour, 3.5);
    assert_eq!(d.savings.gpu_watts, 400.0);
    assert_eq!(d.savings.pools[0].profile, "llama-3.1-8b-h100x1");
    assert_eq!(d.savings.pools[0].gpus_per_replica, 1);
    assert_eq!(d.savings.total.saved_prefill_tokens, 0);
    assert_eq!(d.savings.total.saved_gpu_seconds, 0.0);

    let s: SavingsResponse = http
        .get(format!("{base}/debug/savings"))
        .bearer_auth("t0ken")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(s.pools.len(), 1);
    assert_eq!(s.total.requests_observed, 0);
    proxy.shutdown().await;
}

#[test]
fn a_pool_names_a_profile_that_exists_and_prices_are_numbers() {
    let mut pool = PoolConfig::new("tiny", tokenizer_dir(), 16);
    pool.replicas = vec![ReplicaSpec::new("http://127.0.0.1:8000")];
    pool.savings_profile = "h100-of-my-dreams".into();
    let mut cfg = Config::new(vec![pool]);
    cfg.savings.gpu_watts = -5.0;
    let errs = cfg.validate();
    let text: Vec<String> = errs.iter().map(ToString::to_string).collect();
    assert!(
        text.iter()
            .any(|e| e.starts_with("pools[0].savings_profile") && e.contains("h100-of-my-dreams")),
        "{text:?}"
    );
    assert!(
        text.iter()
            .any(|e| e.starts_with("savings") && e.contains("gpu_watts")),
        "{text:?}"
    );
}
