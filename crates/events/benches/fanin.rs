//! KV-event fan-in: one [`EventPlane`] subscribed to N vLLM-like publishers over loopback TCP,
//! measured end to end (socket -> frames -> decode -> index writer -> index).
//!
//! The publishers run in a child process (this binary again, `KINFERENCE_BENCH_FANIN_CHILD`),
//! so the router's CPU (this process's runtime and libzmq threads, from `/proc/self/task`) is
//! separate from the publishers'. The child binds one XPUB per worker on 127.0.0.1:0 (a
//! publisher that binds, as vLLM's `tcp://*:PORT`), the plane dials each, and the child waits
//! for every subscription notice before anything is published. Every batch is one
//! `BlockStored` of 16 chained hashes with their 256 token ids plus 16 single-hash
//! `BlockRemoved`s evicting the blocks stored `depth` steps earlier, so each worker holds
//! `depth * 16` blocks at steady state; the payload is encoded once and its hashes and `ts`
//! are patched in place per message. Sequence numbers are in order per publisher.
//!
//! Flow control: a PUB drops what a slow subscriber cannot take, which would turn "flat out"
//! into gaps. The child's sockets have no high-water mark and it keeps at most
//! `KINFERENCE_BENCH_FANIN_WINDOW` messages in flight: this process tells it, every
//! millisecond, how many batches the index has applied (health counters), so "flat out" runs
//! at what the router sustains and nothing is dropped.
//!
//! Applied block events are counted from the plane's health (`batches_applied` x 32 hashes);
//! the publish-to-applied delay pairs the child's send times of sampled messages with the
//! moment a health watcher saw the batch applied (a watcher wake included).
//!
//! `KINFERENCE_BENCH_FANIN_SHARED=1` turns it around, as a pool's shared `events.bind` does:
//! the plane binds one endpoint for every worker, each told apart by its topic (`kv-0000`,
//! ...; fixed width, so no topic is a prefix of another), and the child's XPUBs connect to it.
//!
//! `cargo bench -p kinference-events --bench fanin` runs 1,000 workers for 10 s flat out;
//! `KINFERENCE_BENCH_FANIN_WORKERS`, `_SECS`, `_RATE` (messages/s offered, 0 = flat out),
//! `_DEPTH` and `_WINDOW` change that. Without `--bench` it runs 8 workers for 0.2 s.

// Bench code: a failed unwrap is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kinference_events::{
    watch, DpRank, EventPlane, EventPlaneConfig, Index, ReplicaId, WorkerConfig, WorkerHealth,
    WorkerId,
};
use kinference_vllm::events::codec::{decode_batch, encode_batch};
use kinference_vllm::{BlockRemoved, BlockStored, HashValue, KvEvent, KvEventBatch};
use tokio_util::sync::CancellationToken;

// The kinference binary's allocator: decode and the index writer allocate and free per batch,
// across threads.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CHILD_ENV: &str = "KINFERENCE_BENCH_FANIN_CHILD";
const TOPIC: &str = "kv-events";
/// Set (to the plane's bound endpoint) in the child of a shared-endpoint run.
const SHARED_ENV: &str = "KINFERENCE_BENCH_FANIN_SHARED_ENDPOINT";

/// Worker `i`'s topic on a shared endpoint.
fn shared_topic(i: usize) -> String {
    format!("kv-{i:04}")
}
/// Blocks per `BlockStored` and evictions per batch.
const PER_STEP: usize = 16;
const BLOCK_SIZE: usize = 16;
/// Block events (stored + removed hashes) per batch.
const EVENTS_PER_BATCH: u64 = 2 * PER_STEP as u64;
/// Linux's USER_HZ: the unit of utime/stime in /proc.
const TICKS_PER_SEC: f64 = 100.0;
/// How often the harness tells the child what has been applied.
const FEEDBACK_EVERY: Duration = Duration::from_millis(1);
/// Every 16th worker's delays are sampled: watching a worker costs a harness wake-up per batch.
const WATCH_STRIDE: usize = 16;
/// Bound on every wait for the other side (setup, drain).
const WAIT: Duration = Duration::from_secs(300);

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Block `j` of step `step` of worker `worker`. The top bit is set so every hash takes the
/// same 9-byte msgpack form and can be patched in place; a negative step (the evictions of
/// the first `depth` steps) names blocks never stored.
fn block_hash(worker: u32, step: u64, j: usize) -> u64 {
    mix(mix(u64::from(worker)) ^ step.wrapping_mul(64).wrapping_add(j as u64)) | (1 << 63)
}

/// One encoded batch with the byte offsets of everything that changes per message.
struct Template {
    payload: Vec<u8>,
    stored: Vec<usize>,
    parent: usize,
    removed: Vec<usize>,
    ts: usize,
}

impl Template {
    fn new() -> Self {
        let placeholder = |i: u64| 0xC0FF_EE00_0000_0000 | i;
        let tokens: Vec<u32> = (0..(PER_STEP * BLOCK_SIZE) as u64)
            .map(|i| (mix(i) % 128_000) as u32)
            .collect();
        let mut events = vec![KvEvent::BlockStored(BlockStored {
            block_hashes: (0..PER_STEP as u64)
                .map(|j| HashValue::Int(placeholder(j)))
                .collect(),
            parent_block_hash: Some(HashValue::Int(placeholder(100))),
            token_ids: tokens,
            block_size: BLOCK_SIZE as u32,
            medium: Some("GPU".into()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..BlockStored::default()
        })];
        events.extend((0..PER_STEP as u64).map(|j| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![HashValue::Int(placeholder(200 + j))],
                medium: Some("GPU".into()),
                group_idx: Some(0),
                ..BlockRemoved::default()
            })
        }));
        let batch = KvEventBatch {
            ts: 1_700_000_000.0,
            events,
            data_parallel_rank: Some(0),
        };
        let payload = encode_batch(&batch);
        let find = |v: u64| {
            let mut needle = vec![0xcf];
            needle.extend_from_slice(&v.to_be_bytes());
            let hits: Vec<usize> = payload
                .windows(needle.len())
                .enumerate()
                .filter(|(_, w)| *w == needle.as_slice())
                .map(|(i, _)| i + 1)
                .collect();
            assert_eq!(hits.len(), 1, "placeholder {v:#x} must occur once");
            hits[0]
        };
        // [ts, events, rank]: fixarray header, then the float64 marker.
        assert_eq!(
            payload[1], 0xcb,
            "ts is a float64 right after the array header"
        );
        Template {
            stored: (0..PER_STEP as u64).map(|j| find(placeholder(j))).collect(),
            parent: find(placeholder(100)),
            removed: (0..PER_STEP as u64)
                .map(|j| find(placeholder(200 + j)))
                .collect(),
            ts: 2,
            payload,
        }
    }

    /// Rewrites the payload as step `step` of `worker`, sent at `ts` (unix seconds).
    fn fill(&mut self, worker: u32, step: u64, depth: u64, ts: f64) {
        let put = |buf: &mut Vec<u8>, at: usize, v: u64| {
            buf[at..at + 8].copy_from_slice(&v.to_be_bytes());
        };
        for (j, &at) in self.stored.iter().enumerate() {
            put(&mut self.payload, at, block_hash(worker, step, j));
        }
        let parent = block_hash(worker, step.wrapping_sub(1), PER_STEP - 1);
        put(&mut self.payload, self.parent, parent);
        let evicted = step.wrapping_sub(depth);
        for (j, &at) in self.removed.iter().enumerate() {
            put(&mut self.payload, at, block_hash(worker, evicted, j));
        }
        put(&mut self.payload, self.ts, ts.to_bits());
    }
}

/// This thread's id, from the /proc/thread-self link (`PID/task/TID`).
fn tid() -> u64 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// utime + stime (ticks) of every live thread of this process, by thread id, with its name.
fn thread_ticks() -> HashMap<u64, (String, u64)> {
    let mut out = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for task in tasks.flatten() {
        let Some(id) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // After the name: state is field 3, utime 14, stime 15.
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        out.insert(id, (name, ticks(11) + ticks(12)));
    }
    out
}

/// utime + stime (ticks) of the whole process, exited threads included.
fn process_ticks() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    let Some(close) = stat.rfind(')') else {
        return 0;
    };
    let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    ticks(11) + ticks(12)
}

/// Ticks spent between two snapshots, summed by `class(tid, name)`, largest first. libzmq's
/// threads are not named in this build (they inherit their creator's name), so callers tell
/// them apart by thread id.
fn ticks_by(
    after: &HashMap<u64, (String, u64)>,
    before: &HashMap<u64, (String, u64)>,
    class: impl Fn(u64, &str) -> &'static str,
) -> Vec<(&'static str, u64)> {
    let mut sums: HashMap<&'static str, u64> = HashMap::new();
    for (id, (name, t)) in after {
        let spent = t.saturating_sub(before.get(id).map_or(0, |b| b.1));
        *sums.entry(class(*id, name)).or_default() += spent;
    }
    let mut out: Vec<(&'static str, u64)> = sums.into_iter().collect();
    out.sort_by_key(|b| std::cmp::Reverse(b.1));
    out
}

/// The soft open-file limit, from /proc/self/limits.
fn open_file_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

// ---------------------------------------------------------------------------------------
// The publisher process.

/// Runs the publishers; talks to the harness over stdin/stdout, one command per line.
fn publisher_main() {
    let workers: usize = env_or("KINFERENCE_BENCH_FANIN_WORKERS", 8);
    let depth: u64 = env_or("KINFERENCE_BENCH_FANIN_DEPTH", 64);
    let secs: f64 = env_or("KINFERENCE_BENCH_FANIN_SECS", 0.2);
    let rate: f64 = env_or("KINFERENCE_BENCH_FANIN_RATE", 0.0);
    let window: u64 = env_or("KINFERENCE_BENCH_FANIN_WINDOW", 8192);
    let sampled_every: u64 = env_or("KINFERENCE_BENCH_FANIN_SAMPLE_EVERY", 4);

    let shared = std::env::var(SHARED_ENV).ok();
    let topics: Vec<Vec<u8>> = (0..workers)
        .map(|i| match shared {
            Some(_) => shared_topic(i).into_bytes(),
            None => TOPIC.as_bytes().to_vec(),
        })
        .collect();
    let mut out = std::io::stdout().lock();
    // libzmq refuses the 1024th socket of a context.
    let mut contexts: Vec<zmq::Context> = Vec::new();
    let mut sockets = Vec::with_capacity(workers);
    for i in 0..workers {
        if i % 1000 == 0 {
            contexts.push(zmq::Context::new());
        }
        let ctx = contexts.last().unwrap();
        let s = ctx.socket(zmq::XPUB).unwrap();
        s.set_linger(0).unwrap();
        // No high-water mark: a PUB at its mark drops; the window below bounds memory.
        s.set_sndhwm(0).unwrap();
        match &shared {
            Some(ep) => s.connect(ep).unwrap(),
            None => {
                s.bind("tcp://127.0.0.1:0").unwrap();
                let ep = s.get_last_endpoint().unwrap().unwrap();
                writeln!(out, "endpoint {ep}").unwrap();
            }
        }
        sockets.push(s);
    }
    writeln!(out, "bound").unwrap();
    out.flush().unwrap();

    // The XPUB delivers each subscription as a message starting with 1: wait for one that
    // covers this worker's topic (a shared endpoint's SUB subscribes to everything, "").
    for (s, topic) in sockets.iter().zip(&topics) {
        s.set_rcvtimeo(WAIT.as_millis() as i32).unwrap();
        loop {
            let msg = s.recv_bytes(0).expect("subscription notice");
            if msg.first() == Some(&1) && topic.starts_with(&msg[1..]) {
                break;
            }
        }
    }
    writeln!(out, "subscribed").unwrap();
    out.flush().unwrap();

    let applied = Arc::new(AtomicU64::new(0));
    let go = Arc::new(AtomicBool::new(false));
    let exit = Arc::new(AtomicBool::new(false));
    {
        let (applied, go, exit) = (applied.clone(), go.clone(), exit.clone());
        std::thread::Builder::new()
            .name("pub-stdin".into())
            .spawn(move || {
                for line in std::io::stdin().lock().lines() {
                    let Ok(line) = line else { break };
                    if let Some(n) = line.strip_prefix("a ") {
                        applied.store(n.parse().unwrap_or(0), Ordering::Release);
                    } else if line == "go" {
                        go.store(true, Ordering::Release);
                    } else if line == "exit" {
                        break;
                    }
                }
                exit.store(true, Ordering::Release);
            })
            .unwrap();
    }

    let mut template = Template::new();
    let mut seqs = vec![0u64; workers];
    let mut sent: u64 = 0;
    let send = |template: &mut Template, seqs: &mut [u64], sent: &mut u64, w: usize| {
        let seq = seqs[w];
        let ts = unix_nanos();
        template.fill(w as u32, seq, depth, ts as f64 / 1e9);
        let s = &sockets[w];
        s.send(&topics[w][..], zmq::SNDMORE).unwrap();
        s.send(&seq.to_be_bytes()[..], zmq::SNDMORE).unwrap();
        s.send(&template.payload[..], 0).unwrap();
        seqs[w] += 1;
        *sent += 1;
        ts
    };
    // Waits until fewer than `window` messages are in flight.
    let wait_window = |sent: u64| {
        while sent >= applied.load(Ordering::Acquire) + window {
            if exit.load(Ordering::Acquire) {
                std::process::exit(1);
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    };

    // Prefill: `depth` steps per worker, so the timed part evicts real blocks.
    for _ in 0..depth {
        for w in 0..workers {
            wait_window(sent);
            send(&mut template, &mut seqs, &mut sent, w);
        }
    }
    writeln!(out, "prefilled {sent}").unwrap();
    out.flush().unwrap();
    while !go.load(Ordering::Acquire) {
        if exit.load(Ordering::Acquire) {
            return;
        }
        std::thread::sleep(Duration::from_micros(100));
    }

    let ticks0 = thread_ticks();
    let start_sent = sent;
    let t0 = Instant::now();
    let end = t0 + Duration::from_secs_f64(secs);
    let sample_stride = WATCH_STRIDE;
    let mut samples: Vec<(usize, u64, u64)> = Vec::new();
    let mut w = 0usize;
    let mut n: u64 = 0;
    'run: loop {
        // Send what is due (paced) or as much as the window allows (flat out), 64 at a time.
        let now = Instant::now();
        if now >= end {
            break;
        }
        let due = if rate > 0.0 {
            let due = ((now - t0).as_secs_f64() * rate) as u64;
            due.saturating_sub(n).min(64)
        } else {
            64
        };
        if due == 0 {
            std::thread::sleep(Duration::from_micros(50));
            continue;
        }
        for _ in 0..due {
            while sent >= applied.load(Ordering::Acquire) + window {
                if Instant::now() >= end {
                    break 'run;
                }
                std::thread::sleep(Duration::from_micros(50));
            }
            let seq = seqs[w];
            let ts = send(&mut template, &mut seqs, &mut sent, w);
            if w.is_multiple_of(sample_stride) && seq.is_multiple_of(sampled_every) {
                samples.push((w, seq, ts));
            }
            n += 1;
            w += 1;
            if w == workers {
                w = 0;
            }
        }
    }
    let took = t0.elapsed();
    let me = std::process::id() as u64;
    let cpu = ticks_by(&thread_ticks(), &ticks0, |id, name| {
        if id == me {
            "publish-loop"
        } else if name == "pub-stdin" {
            "feedback-reader"
        } else {
            "libzmq"
        }
    });
    writeln!(
        out,
        "done {} {:.6} {}",
        sent - start_sent,
        took.as_secs_f64(),
        cpu.iter()
            .map(|(k, v)| format!("{k} {:.2}", *v as f64 / TICKS_PER_SEC / took.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(",")
    )
    .unwrap();
    let last: Vec<String> = seqs.iter().map(|s| s.to_string()).collect();
    writeln!(out, "last {}", last.join(" ")).unwrap();
    for (w, seq, ts) in samples {
        writeln!(out, "s {w} {seq} {ts}").unwrap();
    }
    writeln!(out, "end").unwrap();
    out.flush().unwrap();
    // Unsent messages die with the sockets: stay until the harness has them all.
    while !exit.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------
// The harness (router) process.

struct ChildIo {
    child: Child,
    stdin: Arc<Mutex<ChildStdin>>,
    lines: std::io::Lines<BufReader<ChildStdout>>,
}

impl ChildIo {
    fn spawn(env: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.env(CHILD_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        ChildIo {
            child,
            stdin: Arc::new(Mutex::new(stdin)),
            lines: BufReader::new(stdout).lines(),
        }
    }

    fn line(&mut self) -> String {
        self.lines
            .next()
            .expect("publisher process ended early")
            .unwrap()
    }

    fn say(&self, line: &str) {
        let mut stdin = self.stdin.lock().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }
}

fn percentile(sorted: &[u64], p: f64) -> u64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

fn sum_applied(rxs: &[watch::Receiver<WorkerHealth>]) -> u64 {
    rxs.iter().map(|r| r.borrow().batches_applied).sum()
}

/// One thread, no sockets: decode and apply of the same messages, for comparison.
fn stages(workers: usize, depth: u64, messages: usize) {
    let mut template = Template::new();
    let mut index = Index::new();
    let ids: Vec<WorkerId> = (0..workers)
        .map(|i| WorkerId::new(ReplicaId(i as u32), DpRank(0)))
        .collect();
    let mut payloads = Vec::new();
    // Prefill through the index directly, then time decode and apply on fresh steps.
    for step in 0..depth {
        for (w, id) in ids.iter().enumerate() {
            template.fill(w as u32, step, depth, 0.0);
            let batch = decode_batch(&template.payload).unwrap();
            index.apply_batch(*id, &batch);
        }
    }
    let steps = (messages / workers).clamp(1, 1_000) as u64;
    for step in depth..depth + steps {
        for w in 0..workers {
            template.fill(w as u32, step, depth, 0.0);
            payloads.push((w, template.payload.clone()));
        }
    }
    // Decode is timed over three passes (the best one counts); apply once, on fresh steps.
    let mut decode = Duration::MAX;
    let mut batches = Vec::new();
    for _ in 0..3 {
        drop(batches);
        let t = Instant::now();
        batches = payloads
            .iter()
            .map(|(w, p)| (*w, decode_batch(p).unwrap()))
            .collect::<Vec<(usize, KvEventBatch)>>();
        decode = decode.min(t.elapsed());
    }
    let t = Instant::now();
    for (w, b) in &batches {
        index.apply_batch(ids[*w], b);
    }
    let apply = t.elapsed();
    let n = payloads.len() as f64;
    let per = |d: Duration| d.as_secs_f64() / n * 1e6;
    println!(
        "stages, one thread, {} messages of {} bytes, index at {} entries: decode {:.2} µs/msg, \
         apply {:.2} µs/msg, together {:.0} k msg/s = {:.2} M block events/s",
        payloads.len(),
        template.payload.len(),
        index.len(),
        per(decode),
        per(apply),
        n / (decode + apply).as_secs_f64() / 1e3,
        n * EVENTS_PER_BATCH as f64 / (decode + apply).as_secs_f64() / 1e6
    );
}

fn main() {
    if std::env::var_os(CHILD_ENV).is_some() {
        publisher_main();
        return;
    }
    let full = std::env::args().any(|a| a == "--bench");
    let workers: usize = env_or(
        "KINFERENCE_BENCH_FANIN_WORKERS",
        if full { 1000 } else { 8 },
    );
    let secs: f64 = env_or("KINFERENCE_BENCH_FANIN_SECS", if full { 10.0 } else { 0.2 });
    let rate: f64 = env_or("KINFERENCE_BENCH_FANIN_RATE", 0.0);
    let depth: u64 = env_or("KINFERENCE_BENCH_FANIN_DEPTH", if full { 64 } else { 8 });
    let window: u64 = env_or(
        "KINFERENCE_BENCH_FANIN_WINDOW",
        if full { 8192 } else { 256 },
    );
    let threads: usize = env_or("KINFERENCE_BENCH_FANIN_THREADS", 2);
    let shared = env_or("KINFERENCE_BENCH_FANIN_SHARED", 0u8) == 1;

    if let Some(limit) = open_file_limit() {
        // SUB, its monitor and their pair here, XPUB + listener + connection in the child.
        let need = 5 * workers as u64 + 200;
        assert!(
            limit >= need,
            "{workers} workers need about {need} open files; raise it with `ulimit -n {need}`"
        );
    }
    println!(
        "# fan-in: {workers} workers{}, {secs} s, {}, depth {depth} ({} blocks each), window {window}, \
         router runtime {threads} threads",
        if shared { " on one shared bound endpoint" } else { "" },
        if rate > 0.0 {
            format!("offered {rate} msg/s")
        } else {
            "flat out".to_owned()
        },
        depth * PER_STEP as u64,
    );
    stages(workers, depth, if full { 10_000 } else { 500 });

    let runtime_tids = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let tids = runtime_tids.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("router-rt")
        .on_thread_start(move || {
            tids.lock().unwrap().insert(tid());
        })
        .enable_all()
        .build()
        .unwrap();
    let plane = rt.block_on(async { EventPlane::start(EventPlaneConfig::default()).unwrap() });
    let mut env = vec![
        ("KINFERENCE_BENCH_FANIN_WORKERS", workers.to_string()),
        ("KINFERENCE_BENCH_FANIN_SECS", secs.to_string()),
        ("KINFERENCE_BENCH_FANIN_RATE", rate.to_string()),
        ("KINFERENCE_BENCH_FANIN_DEPTH", depth.to_string()),
        ("KINFERENCE_BENCH_FANIN_WINDOW", window.to_string()),
    ];
    let t_setup = Instant::now();
    let mut ids = Vec::with_capacity(workers);
    if shared {
        // A port-0 endpoint is never shared (each asks for a port of its own): pick one.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let ep = format!("tcp://127.0.0.1:{port}");
        rt.block_on(async {
            for i in 0..workers {
                let cfg = WorkerConfig::bind(ReplicaId(i as u32), DpRank(0), &ep)
                    .with_topic(&shared_topic(i));
                ids.push(plane.add_worker(cfg).await.unwrap());
            }
        });
        env.push((SHARED_ENV, ep));
    }
    let mut child = ChildIo::spawn(&env);
    let mut endpoints = Vec::new();
    loop {
        let line = child.line();
        match line.strip_prefix("endpoint ") {
            Some(ep) => endpoints.push(ep.to_owned()),
            None if line == "bound" => break,
            None => panic!("unexpected from publisher: {line}"),
        }
    }
    if !shared {
        assert_eq!(endpoints.len(), workers);
        rt.block_on(async {
            for (i, ep) in endpoints.iter().enumerate() {
                let cfg =
                    WorkerConfig::connect(ReplicaId(i as u32), DpRank(0), ep).with_topic(TOPIC);
                ids.push(plane.add_worker(cfg).await.unwrap());
            }
        });
    }
    let line = child.line();
    assert_eq!(line, "subscribed");
    println!(
        "setup: {workers} subscriptions connected in {:.2?}",
        t_setup.elapsed()
    );
    let rxs: Vec<watch::Receiver<WorkerHealth>> = ids
        .iter()
        .map(|w| plane.watch_health(*w).unwrap())
        .collect();

    // The harness thread: feedback to the publisher and the delay watchers, on its own runtime
    // so its CPU is not the router's.
    let stop = CancellationToken::new();
    let sample_stride = WATCH_STRIDE;
    let harness_tid = Arc::new(AtomicU64::new(0));
    let harness = {
        let harness_tid = harness_tid.clone();
        let rxs = rxs.clone();
        let stdin = child.stdin.clone();
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("fanin-harness".into())
            .spawn(move || {
                harness_tid.store(tid(), Ordering::Release);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let mut watchers = Vec::new();
                    for (w, rx) in rxs.iter().enumerate().step_by(sample_stride) {
                        let mut rx = rx.clone();
                        let stop = stop.clone();
                        watchers.push(tokio::spawn(async move {
                            let mut seen: Vec<(u64, u64)> = Vec::new();
                            loop {
                                tokio::select! {
                                    _ = stop.cancelled() => break,
                                    r = rx.changed() => if r.is_err() { break },
                                }
                                let applied = rx.borrow_and_update().applied_seq;
                                if let Some(s) = applied {
                                    if seen.last().is_none_or(|l| l.0 < s) {
                                        seen.push((s, unix_nanos()));
                                    }
                                }
                            }
                            (w, seen)
                        }));
                    }
                    let mut tick = tokio::time::interval(FEEDBACK_EVERY);
                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                    let mut last = u64::MAX;
                    while !stop.is_cancelled() {
                        tick.tick().await;
                        let n = sum_applied(&rxs);
                        if n != last {
                            last = n;
                            let mut stdin = stdin.lock().unwrap();
                            if writeln!(stdin, "a {n}")
                                .and_then(|_| stdin.flush())
                                .is_err()
                            {
                                break;
                            }
                        }
                    }
                    let mut seen = Vec::new();
                    for w in watchers {
                        seen.push(w.await.unwrap());
                    }
                    seen
                })
            })
            .unwrap()
    };

    let line = child.line();
    let prefilled: u64 = line
        .strip_prefix("prefilled ")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unexpected from publisher: {line}"));
    rt.block_on(async {
        for (w, id) in ids.iter().enumerate() {
            let want = prefilled / workers as u64 - 1;
            plane
                .wait_for(*id, WAIT, |h| h.applied_seq >= Some(want))
                .await
                .unwrap_or_else(|e| panic!("worker {w} prefill: {e}"));
        }
    });
    let entries0 = plane.index().read().len();
    assert_eq!(
        entries0,
        workers * depth as usize * PER_STEP,
        "steady-state size"
    );

    // The timed window.
    let ticks0 = thread_ticks();
    let proc0 = process_ticks();
    let applied0 = sum_applied(&rxs);
    let t0 = Instant::now();
    child.say("go");
    std::thread::sleep(Duration::from_secs_f64(secs));
    let applied1 = sum_applied(&rxs);
    let window_took = t0.elapsed();
    let ticks1 = thread_ticks();
    let proc1 = process_ticks();

    let line = child.line();
    let mut done = line
        .strip_prefix("done ")
        .unwrap_or_else(|| panic!("unexpected from publisher: {line}"))
        .split(' ');
    let sent: u64 = done.next().unwrap().parse().unwrap();
    let pub_secs: f64 = done.next().unwrap().parse().unwrap();
    let pub_cpu = done.collect::<Vec<_>>().join(" ");
    let line = child.line();
    let last: Vec<u64> = line
        .strip_prefix("last ")
        .unwrap()
        .split(' ')
        .map(|s| s.parse().unwrap())
        .collect();
    let mut sent_at: HashMap<usize, Vec<(u64, u64)>> = HashMap::new();
    loop {
        let line = child.line();
        if line == "end" {
            break;
        }
        let mut f = line.strip_prefix("s ").unwrap().split(' ');
        let mut next = || f.next().unwrap().parse::<u64>().unwrap();
        let (w, seq, ts) = (next() as usize, next(), next());
        sent_at.entry(w).or_default().push((seq, ts));
    }

    // Drain: every message sent must be applied, in order, once.
    let t_drain = Instant::now();
    rt.block_on(async {
        for (w, id) in ids.iter().enumerate() {
            let want = last[w] - 1;
            plane
                .wait_for(*id, WAIT, |h| h.applied_seq >= Some(want))
                .await
                .unwrap_or_else(|e| panic!("worker {w} drain: {e}; {:?}", plane.health(*id)));
        }
    });
    let drained = t_drain.elapsed();
    stop.cancel();

    let health: Vec<WorkerHealth> = ids.iter().map(|w| plane.health(*w).unwrap()).collect();
    let total = |f: fn(&WorkerHealth) -> u64| health.iter().map(f).sum::<u64>();
    let entries1 = plane.index().read().len();
    let messages = total(|h| h.messages);
    let expected: u64 = last.iter().sum();

    let seen: Vec<(usize, Vec<(u64, u64)>)> = harness.join().unwrap();
    rt.block_on(async {
        plane.shutdown().await;
    });
    child.say("exit");
    let _ = child.child.wait();

    let applied = applied1 - applied0;
    let secs_w = window_took.as_secs_f64();
    let me = std::process::id() as u64;
    let harness_tid = harness_tid.load(Ordering::Acquire);
    let runtime_tids = runtime_tids.lock().unwrap().clone();
    let router = ticks_by(&ticks1, &ticks0, |id, _| {
        if id == me || id == harness_tid {
            "harness"
        } else if runtime_tids.contains(&id) {
            "tokio"
        } else {
            "libzmq"
        }
    });
    let router_ticks: u64 = router
        .iter()
        .filter(|(k, _)| *k != "harness")
        .map(|(_, v)| v)
        .sum();
    println!(
        "applied in the window: {applied} batches = {} block events in {:.2} s: {:.0} msg/s, \
         {:.3} M block events/s",
        applied * EVENTS_PER_BATCH,
        secs_w,
        applied as f64 / secs_w,
        (applied * EVENTS_PER_BATCH) as f64 / secs_w / 1e6
    );
    println!(
        "published in the window: {sent} msg in {pub_secs:.2} s ({:.0} msg/s); drained the rest in {:.2?}",
        sent as f64 / pub_secs,
        drained
    );
    println!(
        "router CPU (runtime + libzmq threads): {:.2} cores = {:.1} µs per message; whole process {:.2} cores; by thread: {}",
        router_ticks as f64 / TICKS_PER_SEC / secs_w,
        router_ticks as f64 / TICKS_PER_SEC / applied.max(1) as f64 * 1e6,
        proc1.saturating_sub(proc0) as f64 / TICKS_PER_SEC / secs_w,
        router
            .iter()
            .map(|(k, v)| format!("{k} {:.2}", *v as f64 / TICKS_PER_SEC / secs_w))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!("publisher CPU (cores, by thread): {pub_cpu}");
    println!(
        "stream: {messages} messages received, {expected} sent; gaps {}, unrecoverable {}, resets {}, \
         decode errors {}, socket errors {}; index {} entries before, {} after (steady {})",
        total(|h| h.gaps),
        total(|h| h.unrecoverable_gaps),
        total(|h| h.resets),
        total(|h| h.decode_errors),
        total(|h| h.socket_errors),
        entries0,
        entries1,
        workers * depth as usize * PER_STEP
    );
    let mut delays: Vec<u64> = Vec::new();
    for (w, obs) in &seen {
        for &(seq, ts) in sent_at.get(w).map(Vec::as_slice).unwrap_or_default() {
            let i = obs.partition_point(|(s, _)| *s < seq);
            if let Some((_, at)) = obs.get(i) {
                delays.push(at.saturating_sub(ts));
            }
        }
    }
    delays.sort_unstable();
    println!(
        "publish -> applied (seen by a health watcher), {} samples of {} workers: p50 {:.2} ms, \
         p99 {:.2} ms, max {:.2} ms",
        delays.len(),
        seen.len(),
        percentile(&delays, 0.5) as f64 / 1e6,
        percentile(&delays, 0.99) as f64 / 1e6,
        delays.last().copied().unwrap_or(0) as f64 / 1e6,
    );
    assert_eq!(messages, expected, "every message sent was received");
    assert_eq!(
        total(|h| h.gaps) + total(|h| h.decode_errors) + total(|h| h.resets),
        0,
        "no gaps, resets or decode errors"
    );
    assert_eq!(entries1, workers * depth as usize * PER_STEP);
}
