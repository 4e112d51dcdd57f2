//! Fixtures the workspace's tests share, so each is written once: where the reference data
//! lives, loopback addresses, the bound on every wait, the Prometheus series a test reads, and
//! (feature `sim`) small simulated vLLM replicas on ephemeral ports.
//!
//! Invariants: nothing here picks a port by probing when the code under test can bind port 0
//! itself; servers are started on listeners bound to `127.0.0.1:0` and their addresses read
//! back. These are test fixtures: on a broken environment they panic with a message naming
//! what is missing, which is how a test should fail. Used only as a dev-dependency.

use std::path::{Path, PathBuf};
use std::time::Duration;

#[cfg(feature = "sim")]
pub mod sim;

/// The bound on every wait in a test, so that a regression fails instead of hanging; generous
/// because CI shares two cores between builds and tests.
pub const WAIT: Duration = Duration::from_secs(20);

/// A seeded xorshift64 stream, for tests that need reproducible varied inputs and no more
/// (`seed` must not be 0). Each call returns the next value.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `../shared` beside the repository: vLLM's contracts, golden vectors, traces and tokenizers.
/// The tests require it, so a missing directory panics.
pub fn shared_dir() -> PathBuf {
    let p = repo_root().join("../shared");
    p.canonicalize().unwrap_or_else(|e| {
        panic!(
            "the reference files are required at {} (../shared from the repo root): {e}",
            p.display()
        )
    })
}

/// A path inside [`shared_dir`], which must exist.
pub fn shared(rel: &str) -> PathBuf {
    let p = shared_dir().join(rel);
    assert!(p.exists(), "{} is missing", p.display());
    p
}

/// The tokenizer of the tiny Llama model the golden vectors were recorded with.
pub fn tokenizer_dir() -> PathBuf {
    shared("golden/real_vllm_0.32/tiny-llama-tokenizer")
}

/// A bound endpoint (`tcp://0.0.0.0:PORT`, `tcp://*:PORT`) as a loopback address to dial.
pub fn loopback(bound: &str) -> String {
    let port = bound.rsplit(':').next().unwrap_or(bound);
    format!("tcp://127.0.0.1:{port}")
}

/// A loopback TCP port nobody listens on at the moment of the call, for code that needs a port
/// number before it binds, or an address that refuses connections.
///
/// The port is taken below the kernel's ephemeral range, which `bind(0)` and the source ports
/// of outgoing connections come from: a ZMQ socket redialing a loopback port nobody listens on
/// yet can otherwise be given that very port as its source and connect to itself, and
/// another test's `bind(0)` can be handed it, both of which made a later bind fail with
/// "address in use". Only an explicit bind of the same number can still take it.
pub fn unused_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let (from, span) = (10_000u32, low.saturating_sub(10_000).max(1));
    // Spread over the range by process and call, so concurrent test processes rarely try the
    // same numbers.
    let seed = std::process::id().wrapping_mul(2_654_435_761);
    for _ in 0..span.min(4096) {
        let n = NEXT.fetch_add(7919, Ordering::Relaxed);
        let port = u16::try_from(from + seed.wrapping_add(n) % span).unwrap_or(0);
        if port != 0 && std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port below the ephemeral range ({from}..{low})")
}

/// The value of one series on a Prometheus page, read with the workspace's parser: `series`
/// is written as on the page (`name{label="v",...}` or a bare name) and matches a sample with
/// exactly that name and label set. Panics, showing the page, when the series is missing.
pub fn metric(page: &str, series: &str) -> f64 {
    let wanted = one_sample(series);
    let found = kinference_vllm::metrics::text::parse(page)
        .filter_map(Result::ok)
        .find(|s| s.name == wanted.0 && label_set(s) == wanted.1);
    match found {
        Some(s) => s.value,
        None => panic!("{series} missing in\n{page}"),
    }
}

type LabelSet = Vec<(String, String)>;

fn label_set(s: &kinference_vllm::metrics::text::Sample<'_>) -> LabelSet {
    let mut labels: LabelSet = s
        .labels()
        .map(|(k, v)| (k.to_owned(), v.into_owned()))
        .collect();
    labels.sort();
    labels
}

fn one_sample(series: &str) -> (String, LabelSet) {
    let line = format!("{series} 0");
    match kinference_vllm::metrics::text::parse(&line).next() {
        Some(Ok(s)) => (s.name.to_owned(), label_set(&s)),
        other => panic!("{series:?} is not a series: {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_data_is_found_from_any_crate() {
        assert!(shared_dir().join("spec").is_dir());
        assert!(tokenizer_dir().join("tokenizer.json").is_file());
    }

    #[test]
    fn bound_endpoints_become_dialable() {
        assert_eq!(loopback("tcp://0.0.0.0:5557"), "tcp://127.0.0.1:5557");
        assert_eq!(loopback("tcp://*:6000"), "tcp://127.0.0.1:6000");
    }

    #[test]
    fn unused_ports_are_free_and_outside_the_ephemeral_range() {
        let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next()?.parse().ok())
            .unwrap_or(32768);
        let ports: Vec<u16> = (0..50).map(|_| unused_port()).collect();
        for &p in &ports {
            assert!((10_000..low).contains(&p), "{p}");
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 40, "{ports:?}");
    }

    #[test]
    fn series_match_by_name_and_whole_label_set() {
        let page = "# TYPE a counter\na{x=\"1\",y=\"2\"} 3\na{x=\"1\"} 4\nb 5\n";
        assert_eq!(metric(page, "a{x=\"1\",y=\"2\"}"), 3.0);
        assert_eq!(metric(page, "a{y=\"2\",x=\"1\"}"), 3.0);
        assert_eq!(metric(page, "a{x=\"1\"}"), 4.0);
        assert_eq!(metric(page, "b"), 5.0);
        let missing = std::panic::catch_unwind(|| metric(page, "a"));
        assert!(missing.is_err());
    }
}
