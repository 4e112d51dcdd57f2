//! `kinfctl savings` and `kinfctl top`: what a running router's cache hits saved since it
//! started (`GET /debug/savings`), and a live terminal view of its fleet
//! (`GET /debug/dashboard`, the data of the admin port's `/dashboard` page).
//!
//! Invariants: both only read the admin port. `top` leaves the terminal as it found it: it
//! changes the terminal's mode (no line buffering, no echo, so `q` acts at once) only when
//! stdin is a terminal, and restores it on every way out (q, Ctrl-C, an error).

use std::fmt::Write as _;
use std::io::{IsTerminal, Read, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Result;
use kinference_proxy::api::{DashboardResponse, Health, SavingsFigures, SavingsResponse};

use crate::status::{Admin, AdminArgs};

#[derive(Debug, clap::Args)]
pub struct SavingsArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// The router's JSON (`SavingsResponse`) instead of the table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// Milliseconds between two refreshes.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Stop after this many screens (default: until q or Ctrl-C).
    #[arg(long)]
    iterations: Option<u64>,
    /// One screen, then exit (= --iterations 1).
    #[arg(long)]
    once: bool,
}

pub fn savings(args: &SavingsArgs) -> Result<String> {
    let admin = Admin::new(&args.admin)?;
    let s: SavingsResponse = admin.get("/debug/savings", &[200])?;
    if args.json {
        return Ok(format!("{}\n", serde_json::to_string(&s)?));
    }
    Ok(render_savings(admin.base(), &s))
}

/// The table: one row per pool and a total, then how the figures were valued.
pub fn render_savings(base: &str, s: &SavingsResponse) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "router {base}: savings over {} since start",
        duration(s.uptime_secs)
    );
    let _ = writeln!(
        out,
        "{:<16} {:>10} {:>16} {:>14} {:>12} {:>10}",
        "POOL", "REQUESTS", "TOKENS_SAVED", "GPU_SECONDS", "KWH", "USD"
    );
    let row = |out: &mut String, name: &str, f: &SavingsFigures| {
        let _ = writeln!(
            out,
            "{:<16} {:>10} {:>16} {:>14.3} {:>12.6} {:>10.4}",
            name,
            f.requests_observed,
            f.saved_prefill_tokens,
            f.saved_gpu_seconds,
            f.saved_kwh,
            f.saved_usd
        );
    };
    for p in &s.pools {
        row(&mut out, &p.name, &p.figures);
    }
    if s.pools.len() > 1 {
        row(&mut out, "total", &s.total);
    }
    for b in &s.baselines {
        let rate = |cached: u64| {
            pct((s.total.prompt_tokens > 0).then(|| cached as f64 / s.total.prompt_tokens as f64))
        };
        let _ = writeln!(
            out,
            "saved vs {} (estimated): {:.3} GPU-s, {:.6} kWh, ${:.4}; hit rate {} measured, {} \
             estimated for {} routing all the traffic",
            b.policy,
            b.saved_vs_gpu_seconds,
            b.saved_vs_kwh,
            b.saved_vs_usd,
            rate(s.total.saved_prefill_tokens),
            rate(b.cached_tokens),
            b.policy
        );
    }
    let profiles: Vec<String> = s
        .pools
        .iter()
        .map(|p| {
            format!(
                "{} {} ({} GPU/replica)",
                p.name, p.profile, p.gpus_per_replica
            )
        })
        .collect();
    let _ = writeln!(
        out,
        "valued at ${}/GPU-hour and {} W/GPU; GPU time from the timing profiles: {}; tokens \
         are the cached tokens the replicas reported (requests without usage count nothing)",
        s.usd_per_gpu_hour,
        s.gpu_watts,
        profiles.join(", ")
    );
    out
}

fn duration(secs: f64) -> String {
    if secs < 120.0 {
        format!("{secs:.0} s")
    } else if secs < 7200.0 {
        format!("{:.1} min", secs / 60.0)
    } else {
        format!("{:.2} h", secs / 3600.0)
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), |v| format!("{:.1}%", v * 100.0))
}

fn ms(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

/// One screen of `top`.
pub fn render_top(base: &str, d: &DashboardResponse) -> String {
    let mut out = String::new();
    let s = &d.savings;
    let _ = writeln!(
        out,
        "kinference {base}  up {}  (q or Ctrl-C quits)",
        duration(s.uptime_secs)
    );
    let t = &s.total;
    let _ = writeln!(
        out,
        "saved since start: {} prefill tokens, {:.3} GPU-s, {:.6} kWh, ${:.4} ({} requests with usage)",
        t.saved_prefill_tokens, t.saved_gpu_seconds, t.saved_kwh, t.saved_usd, t.requests_observed
    );
    for b in &s.baselines {
        let _ = writeln!(
            out,
            "saved vs {} (estimated): {:.3} GPU-s, ${:.4}",
            b.policy, b.saved_vs_gpu_seconds, b.saved_vs_usd
        );
    }
    let recent = &d.history[d.history.len().saturating_sub(5)..];
    let mean = |f: &dyn Fn(&kinference_proxy::api::HistoryPoint) -> Option<f64>| {
        let v: Vec<f64> = recent.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let last = d.history.last();
    let _ = writeln!(
        out,
        "requests/s {}  hit rate reported {} predicted {}  TTFT p50 {} p90 {} p99 {} ms",
        mean(&|p| Some(p.requests_per_s)).map_or_else(|| "-".to_owned(), |v| format!("{v:.1}")),
        pct(mean(&|p| p.reported_hit_rate)),
        pct(mean(&|p| p.predicted_hit_rate)),
        ms(last.and_then(|p| p.ttft_p50_ms)),
        ms(last.and_then(|p| p.ttft_p90_ms)),
        ms(last.and_then(|p| p.ttft_p99_ms)),
    );
    let total: u64 = d.reasons.values().sum();
    if total > 0 {
        let mut reasons: Vec<_> = d.reasons.iter().collect();
        reasons.sort_by(|a, b| b.1.cmp(a.1));
        let list: Vec<String> = reasons
            .iter()
            .map(|(r, n)| format!("{r} {:.0}%", **n as f64 * 100.0 / total as f64))
            .collect();
        let _ = writeln!(out, "decisions: {}", list.join("  "));
    }
    for pool in &d.fleet.pools {
        let _ = writeln!(
            out,
            "\npool {} ({}): index {} entries",
            pool.name, pool.policy, pool.index_entries
        );
        let _ = writeln!(
            out,
            "{:<28} {:<7} {:<8} {:>4} {:>4} {:>6} {:>5} {:>8} {:<9} {:>6} {:>5} {:>7} {:>7}",
            "REPLICA",
            "HEALTH",
            "SCORABLE",
            "RUN",
            "WAIT",
            "KV",
            "INFL",
            "ENTRIES",
            "EVENTS",
            "LAG_S",
            "GAPS",
            "REPLAYS",
            "RESYNCS"
        );
        for r in &pool.replicas {
            let w = &r.workers;
            let ev: Vec<_> = w.iter().filter_map(|x| x.events.as_ref()).collect();
            let health = match r.health {
                Health::Up => "up",
                Health::Down => "down",
                Health::Unknown => "unknown",
            };
            let sync = ev.first().map_or("-", |e| e.sync.as_str());
            let lag = ev
                .iter()
                .filter_map(|e| e.last_event_age_ms)
                .max()
                .map_or_else(|| "-".to_owned(), |v| format!("{:.1}", v as f64 / 1000.0));
            let _ = writeln!(
                out,
                "{:<28} {:<7} {:<8} {:>4} {:>4} {:>5.1}% {:>5} {:>8} {:<9} {:>6} {:>5} {:>7} {:>7}",
                r.url,
                health,
                if r.scorable { "yes" } else { "no" },
                w.iter().map(|x| x.load.running).sum::<u32>(),
                w.iter().map(|x| x.load.waiting).sum::<u32>(),
                w.iter().map(|x| x.load.kv_usage).fold(0.0, f64::max) * 100.0,
                w.iter().map(|x| x.load.in_flight).sum::<u32>(),
                w.iter().map(|x| x.index_entries).sum::<usize>(),
                sync,
                lag,
                ev.iter().map(|e| e.gaps).sum::<u64>(),
                ev.iter().map(|e| e.replays_succeeded).sum::<u64>(),
                ev.iter().map(|e| e.resets).sum::<u64>(),
            );
            if let Some(why) = r.unscorable_reason.as_ref().filter(|_| !r.scorable) {
                let _ = writeln!(out, "  unscorable: {why}");
            }
        }
    }
    out
}

/// The terminal's settings, restored when dropped (`stty -g` / `stty SETTINGS`).
struct TerminalMode {
    saved: Option<String>,
}

impl TerminalMode {
    /// Keys without Enter and without echo, when stdin is a terminal; nothing otherwise.
    fn keys_at_once() -> TerminalMode {
        if !std::io::stdin().is_terminal() {
            return TerminalMode { saved: None };
        }
        let stty = |args: &[&str]| {
            Command::new("stty")
                .args(args)
                .stdin(Stdio::inherit())
                .stderr(Stdio::null())
                .output()
                .ok()
                .filter(|o| o.status.success())
        };
        let saved = stty(&["-g"]).map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
        if saved.is_some() {
            stty(&["-icanon", "-echo", "min", "1"]);
        }
        TerminalMode { saved }
    }
}

impl Drop for TerminalMode {
    fn drop(&mut self) {
        if let Some(s) = &self.saved {
            let _ = Command::new("stty").arg(s).stdin(Stdio::inherit()).status();
        }
    }
}

/// Redraws until q, Ctrl-C or `--iterations`; on a terminal the screen is cleared first.
pub fn top(args: &TopArgs) -> Result<()> {
    let admin = Admin::new(&args.admin)?;
    let limit = if args.once { Some(1) } else { args.iterations };
    let tty = std::io::stdout().is_terminal();
    let _mode = TerminalMode::keys_at_once();
    let (quit_tx, mut quit_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    if std::io::stdin().is_terminal() {
        std::thread::spawn(move || {
            let mut byte = [0u8; 1];
            let mut stdin = std::io::stdin();
            while let Ok(1) = stdin.read(&mut byte) {
                if matches!(byte[0], b'q' | b'Q' | 3) {
                    let _ = quit_tx.send(());
                    return;
                }
            }
        });
    }
    let mut shown = 0u64;
    loop {
        let d: DashboardResponse = admin.get("/debug/dashboard", &[200])?;
        let screen = render_top(admin.base(), &d);
        let mut stdout = std::io::stdout().lock();
        if tty {
            // Home, clear: a full redraw each time, no cursor addressing.
            write!(stdout, "\x1b[H\x1b[2J")?;
        }
        write!(stdout, "{screen}")?;
        if !tty {
            writeln!(stdout)?;
        }
        stdout.flush()?;
        drop(stdout);
        shown += 1;
        if limit.is_some_and(|n| shown >= n) {
            return Ok(());
        }
        let wait = Duration::from_millis(args.interval_ms.max(50));
        let quit = admin.block_on(async {
            tokio::select! {
                _ = tokio::time::sleep(wait) => false,
                _ = tokio::signal::ctrl_c() => true,
                Some(()) = quit_rx.recv() => true,
            }
        });
        if quit {
            return Ok(());
        }
    }
}
