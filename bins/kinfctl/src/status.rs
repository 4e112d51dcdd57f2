//! `kinfctl status`: the fleet as a running router sees it, read from its admin port
//! (`GET /readyz` and `GET /debug/replicas`), per pool, replica and DP rank.
//!
//! Also home of what `explain` shares with it: the admin-port client and the column layout.
//! Nothing here changes the router's state: both endpoints are read-only snapshots.

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use kinference_proxy::api::{
    DiscoveryStatus, ErrorBody, EventStreamStatus, Health, PoolStatus, ReadyResponse,
    ReplicaStatus, ReplicasResponse, TokenizerCacheStatus, WorkerStatus,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Where the router's admin port is, and how long to wait for it.
#[derive(Debug, clap::Args)]
pub struct AdminArgs {
    /// The router's admin address (`--admin` of `kinference serve`), e.g. http://127.0.0.1:9090.
    #[arg(long, default_value = "http://127.0.0.1:9090")]
    admin: String,
    /// Seconds to wait for each answer of the admin port.
    #[arg(long, default_value_t = 10)]
    timeout_secs: u64,
    /// A file holding the router's admin token (`admin_auth` of `kinference serve`); the
    /// token itself may come from KINFERENCE_ADMIN_TOKEN instead (never from a flag).
    #[arg(long, env = "KINFERENCE_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<std::path::PathBuf>,
}

/// The environment variable holding the admin token itself.
const ADMIN_TOKEN_ENV: &str = "KINFERENCE_ADMIN_TOKEN";

impl AdminArgs {
    /// The bearer token to send: from `--admin-token-file`, else `KINFERENCE_ADMIN_TOKEN`.
    fn token(&self) -> Result<Option<String>> {
        let text = match &self.admin_token_file {
            Some(path) => std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token from {}", path.display()))?,
            None => match std::env::var(ADMIN_TOKEN_ENV) {
                Ok(t) => t,
                Err(_) => return Ok(None),
            },
        };
        let t = text.trim();
        if t.is_empty() {
            bail!("the admin token is empty");
        }
        Ok(Some(t.to_owned()))
    }
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// One JSON object: `{"ready": <ReadyResponse>, "fleet": <ReplicasResponse>}`.
    #[arg(long)]
    json: bool,
}

/// A client of one router's admin port.
pub struct Admin {
    base: String,
    /// Sent as `Authorization: Bearer` when set.
    token: Option<String>,
    http: reqwest::Client,
    rt: tokio::runtime::Runtime,
}

impl Admin {
    pub fn new(args: &AdminArgs) -> Result<Admin> {
        let trimmed = args.admin.trim().trim_end_matches('/');
        if trimmed.is_empty() {
            bail!("--admin is empty");
        }
        // `host:port` as `kinference serve --admin` takes it is accepted as is.
        let base = if trimmed.contains("://") {
            trimmed.to_owned()
        } else {
            format!("http://{trimmed}")
        };
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(args.timeout_secs.max(1)))
            .build()
            .context("building the HTTP client")?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        let token = args.token()?;
        Ok(Admin {
            base,
            token,
            http,
            rt,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    /// Runs `f` on the client's runtime (timers and signals included).
    pub fn block_on<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// `GET path`, decoding a `T` from any status in `ok` and naming the router's error
    /// otherwise.
    pub fn get<T: DeserializeOwned>(&self, path: &str, ok: &[u16]) -> Result<T> {
        let req = self.http.get(format!("{}{path}", self.base));
        self.call(req, path, ok)
    }

    /// `POST path` with a JSON body.
    pub fn post<T: DeserializeOwned>(&self, path: &str, body: Vec<u8>) -> Result<T> {
        let req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        self.call(req, path.split('?').next().unwrap_or(path), &[200])
    }

    fn call<T: DeserializeOwned>(
        &self,
        req: reqwest::RequestBuilder,
        what: &str,
        ok: &[u16],
    ) -> Result<T> {
        let base = &self.base;
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let (status, bytes) = self.rt.block_on(async {
            let resp = req.send().await.with_context(|| {
                format!("cannot reach the router's admin port at {base} (is `kinference serve --admin` listening there?)")
            })?;
            let status = resp.status().as_u16();
            let bytes = resp
                .bytes()
                .await
                .with_context(|| format!("reading the answer of {base}{what}"))?;
            anyhow::Ok((status, bytes))
        })?;
        if !ok.contains(&status) {
            let hint = match (status, &self.token) {
                (401, None) => " (give kinfctl the token: --admin-token-file FILE or KINFERENCE_ADMIN_TOKEN)",
                (401, Some(_)) => " (the token given, from --admin-token-file or KINFERENCE_ADMIN_TOKEN, is not the router's)",
                _ => "",
            };
            if let Ok(e) = serde_json::from_slice::<ErrorBody>(&bytes) {
                bail!(
                    "{base}{what} answered {status} {}: {}{hint}",
                    e.error.kind,
                    e.error.message
                );
            }
            let text = String::from_utf8_lossy(&bytes);
            bail!(
                "{base}{what} answered {status}: {} (is {base} the router's admin port?)",
                text.trim().chars().take(200).collect::<String>()
            );
        }
        serde_json::from_slice(&bytes).with_context(|| {
            format!("{base}{what} did not answer the router's JSON (is {base} the admin port of a `kinference serve` of the same version?)")
        })
    }
}

/// What `status --json` prints.
#[derive(Debug, Serialize)]
struct StatusReport<'a> {
    ready: &'a ReadyResponse,
    fleet: &'a ReplicasResponse,
}

/// The report, and whether the router is ready (every pool has a replica up).
pub fn run(args: &StatusArgs) -> Result<(bool, String)> {
    let admin = Admin::new(&args.admin)?;
    // /readyz answers 503 with the same JSON while a pool has no replica up.
    let ready: ReadyResponse = admin.get("/readyz", &[200, 503])?;
    let fleet: ReplicasResponse = admin.get("/debug/replicas", &[200])?;
    let text = if args.json {
        let report = StatusReport {
            ready: &ready,
            fleet: &fleet,
        };
        format!("{}\n", serde_json::to_string(&report)?)
    } else {
        render(admin.base(), &ready, &fleet)
    };
    Ok((ready.ready, text))
}

/// The human report: a header per pool, a row per DP rank, then notes on anything wrong.
/// Table cells hold no spaces, so `awk` can pick columns.
pub fn render(base: &str, ready: &ReadyResponse, fleet: &ReplicasResponse) -> String {
    let mut out = String::new();
    let up: usize = ready.pools.iter().map(|p| p.healthy_replicas).sum();
    let all: usize = ready.pools.iter().map(|p| p.replicas).sum();
    let _ = writeln!(
        out,
        "router {base}: {} ({up} of {all} replicas up, {} pools)",
        if ready.ready { "ready" } else { "NOT READY" },
        ready.pools.len()
    );
    for pool in &fleet.pools {
        out.push('\n');
        render_pool(&mut out, pool);
    }
    out
}

fn render_pool(out: &mut String, pool: &PoolStatus) {
    let _ = writeln!(
        out,
        "pool {}: models {}; block size {}, {}; policy {}; index {} entries, {} blocks, {} tracked",
        pool.name,
        pool.models.join(", "),
        pool.block_size,
        pool.hash_algo,
        pool.policy,
        pool.index_entries,
        pool.index_blocks,
        pool.tracked_entries
    );
    let _ = writeln!(out, "  {}", tokenizer_cache_line(&pool.tokenizer_cache));
    if let Some(d) = &pool.discovery {
        let _ = writeln!(out, "  {}", discovery_line(d));
        if let Some(e) = &d.settings_error {
            let _ = writeln!(
                out,
                "  settings NOT APPLIED: {e}; routing with the last settings applied"
            );
        }
    }
    let mut rows = vec![[
        "REPLICA",
        "URL",
        "HEALTH",
        "SCORABLE",
        "RANK",
        "RUNNING",
        "WAITING",
        "KV",
        "IN-FLIGHT",
        "EVENTS",
        "SYNC",
        "SEQ",
        "GAPS",
        "REPLAYS",
        "ENTRIES",
        "SCALE-IN",
    ]
    .map(String::from)
    .to_vec()];
    let mut notes = Vec::new();
    for r in &pool.replicas {
        for w in &r.workers {
            rows.push(worker_row(r, w));
        }
        notes.extend(replica_notes(r));
    }
    out.push_str(&table(&rows, "  "));
    for n in notes {
        let _ = writeln!(out, "  ! {n}");
    }
}

/// Where a discovered pool's replicas come from and whether that source can be read now.
fn discovery_line(d: &DiscoveryStatus) -> String {
    let state = match (&d.error, d.synced) {
        (Some(e), synced) => format!(
            "ERROR ({}): {e}; {}",
            d.error_kind.as_deref().unwrap_or("unknown"),
            if synced {
                "routing goes on over the replicas last read"
            } else {
                "never read: no replicas"
            }
        ),
        (None, true) => "synced".to_owned(),
        (None, false) => "syncing (not read yet)".to_owned(),
    };
    format!("discovery {}: {state}", d.source)
}

fn health_name(h: Health) -> &'static str {
    match h {
        Health::Up => "up",
        Health::Down => "down",
        Health::Unknown => "unknown",
    }
}

fn worker_row(r: &ReplicaStatus, w: &WorkerStatus) -> Vec<String> {
    let load = &w.load;
    let in_flight = if load.in_flight_prefill_tokens > 0 {
        format!("{}(+{}tok)", load.in_flight, load.in_flight_prefill_tokens)
    } else {
        load.in_flight.to_string()
    };
    let (events, sync, seq, gaps, replays) = match &w.events {
        Some(e) => events_cells(e),
        None => (
            r.events_mode.clone(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ),
    };
    vec![
        r.id.clone(),
        r.url.clone(),
        health_name(r.health).into(),
        if r.scorable { "yes" } else { "NO" }.into(),
        format!("dp{}", w.rank),
        load.running.to_string(),
        load.waiting.to_string(),
        format!("{:.1}%", load.kv_usage * 100.0),
        in_flight,
        events,
        sync,
        seq,
        gaps,
        replays,
        w.index_entries.to_string(),
        // The replica's, on each of its ranks: what losing it would cost (cached tokens).
        r.scale_in_cost
            .map_or_else(|| "-".to_owned(), |c| format!("{c:.0}")),
    ]
}

/// EVENTS, SYNC, SEQ, GAPS, REPLAYS cells of a subscribed stream. SEQ is the last sequence
/// number seen (and the last applied, when behind); GAPS counts the unrecoverable ones too.
fn events_cells(e: &EventStreamStatus) -> (String, String, String, String, String) {
    let events = if e.connected {
        "connected"
    } else {
        "disconnected"
    };
    let seq = match (e.last_seq, e.applied_seq) {
        (Some(l), Some(a)) if l == a => l.to_string(),
        (Some(l), Some(a)) => format!("{l}(applied={a})"),
        (Some(l), None) => format!("{l}(applied=-)"),
        (None, _) => "-".into(),
    };
    let mut gaps = e.gaps.to_string();
    if e.unrecoverable_gaps > 0 {
        let _ = write!(gaps, "({}lost)", e.unrecoverable_gaps);
    }
    let replays = format!("{}/{}", e.replays_succeeded, e.replays_attempted);
    (events.into(), e.sync.clone(), seq, gaps, replays)
}

/// One line for everything about a replica an operator should act on.
fn replica_notes(r: &ReplicaStatus) -> Vec<String> {
    let mut notes = Vec::new();
    if !r.scorable {
        notes.push(format!(
            "{} not scorable (routed by load only): {}",
            r.id,
            r.unscorable_reason.as_deref().unwrap_or("no reason given")
        ));
    }
    if let Some(e) = &r.last_error {
        notes.push(format!("{} {}: {e}", r.id, health_name(r.health)));
    }
    if let Some(e) = &r.events_error {
        notes.push(format!("{} events ({}): {e}", r.id, r.events_mode));
    }
    for w in &r.workers {
        let Some(e) = &w.events else { continue };
        if e.decode_errors + e.socket_errors + e.resets > 0 {
            notes.push(format!(
                "{} {}: {} decode errors, {} socket errors, {} resets",
                w.worker, e.endpoint, e.decode_errors, e.socket_errors, e.resets
            ));
        }
    }
    notes
}

/// Left-aligned columns two spaces apart, every line prefixed with `indent`, trailing
/// spaces trimmed. The first row is the header.
pub fn table(rows: &[Vec<String>], indent: &str) -> String {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|cell| cell.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::from(indent);
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// How much prompt text the tokenizer's prefix cache spared the router from encoding.
fn tokenizer_cache_line(c: &TokenizerCacheStatus) -> String {
    let looked_up = c.bytes_reused + c.bytes_encoded_on_hits + c.bytes_encoded_on_misses;
    if c.hits + c.misses == 0 || looked_up == 0 {
        return "tokenizer cache: no prompt looked up yet".to_owned();
    }
    format!(
        "tokenizer cache: {} hits, {} misses; {:.1} % of the looked-up prompt text reused; {} entries, {:.1} MiB, {} evicted",
        c.hits,
        c.misses,
        100.0 * c.bytes_reused as f64 / looked_up as f64,
        c.entries,
        c.bytes as f64 / (1024.0 * 1024.0),
        c.evictions
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_on_the_widest_cell() {
        let rows = vec![
            vec!["A".to_string(), "BB".to_string()],
            vec!["long".to_string(), "x".to_string()],
        ];
        assert_eq!(table(&rows, "  "), "  A     BB\n  long  x\n");
    }

    #[test]
    fn a_pools_discovery_state_and_error_are_shown() {
        let d: DiscoveryStatus = serde_json::from_value(serde_json::json!({
            "source": "inferencepool/models/llama",
            "synced": true,
            "error": "RBAC denied: missing permission to list pods",
            "error_kind": "forbidden",
        }))
        .unwrap();
        assert_eq!(
            discovery_line(&d),
            "discovery inferencepool/models/llama: ERROR (forbidden): RBAC denied: missing \
             permission to list pods; routing goes on over the replicas last read"
        );
        let ok = DiscoveryStatus {
            error: None,
            error_kind: None,
            ..d.clone()
        };
        assert_eq!(
            discovery_line(&ok),
            "discovery inferencepool/models/llama: synced"
        );
        let never = DiscoveryStatus { synced: false, ..d };
        assert!(discovery_line(&never).ends_with("never read: no replicas"));
    }

    #[test]
    fn the_tokenizer_caches_share_of_reused_text_is_shown() {
        let mut c = TokenizerCacheStatus::default();
        assert_eq!(
            tokenizer_cache_line(&c),
            "tokenizer cache: no prompt looked up yet"
        );
        c.hits = 3;
        c.misses = 1;
        c.bytes_reused = 9_000;
        c.bytes_encoded_on_hits = 500;
        c.bytes_encoded_on_misses = 500;
        c.entries = 2;
        c.bytes = 3 << 20;
        assert_eq!(
            tokenizer_cache_line(&c),
            "tokenizer cache: 3 hits, 1 misses; 90.0 % of the looked-up prompt text reused; 2 entries, 3.0 MiB, 0 evicted"
        );
    }

    #[test]
    fn a_bare_address_gets_a_scheme() {
        let args = AdminArgs {
            admin: "127.0.0.1:9090/".into(),
            timeout_secs: 1,
            admin_token_file: None,
        };
        assert_eq!(Admin::new(&args).unwrap().base(), "http://127.0.0.1:9090");
    }
}
