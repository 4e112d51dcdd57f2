//! Fuzzes the Prometheus text parser every `/metrics` reader in the workspace shares
//! (`kinference_vllm::metrics::text`: the router's scrapes, `kinfctl doctor`, the benchmark),
//! and the vLLM snapshot built on it.
//!
//! Invariants checked: nothing panics; every line is a sample or an error, never both and
//! never skipped unless blank or a comment; each parsed sample's name is non-empty and each of
//! its labels can be looked up again by name; a sample re-rendered from its parts parses back
//! to the same name, labels and value; the snapshot's KV usage stays within [0, 1].
#![no_main]

use kinference_vllm::metrics::text::{self, Sample};
use kinference_vllm::metrics::ReplicaMetrics;
use libfuzzer_sys::fuzz_target;

/// Writes a sample back in the text format, escaping label values.
fn render(s: &Sample<'_>) -> String {
    let labels: Vec<String> = s
        .labels()
        .map(|(k, v)| {
            let v = v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect();
    format!("{}{{{}}} {:?}", s.name, labels.join(","), s.value)
}

fn same_value(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

fn check_sample(s: &Sample<'_>) {
    assert!(!s.name.is_empty());
    for (k, _) in s.labels() {
        assert!(s.label(k).is_some(), "label {k} cannot be looked up");
    }
    let page = render(s);
    let again = match text::parse(&page).next() {
        Some(Ok(again)) => again,
        other => panic!("re-rendered sample {page:?} does not parse: {other:?}"),
    };
    assert_eq!(again.name, s.name);
    assert!(again.labels().eq(s.labels()), "{page:?}");
    assert!(same_value(again.value, s.value), "{page:?}");
}

fuzz_target!(|data: &[u8]| {
    let page = String::from_utf8_lossy(data);
    let content_lines = page
        .lines()
        .map(|l| l.trim_matches([' ', '\t']))
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count();
    let mut seen = 0;
    for item in text::parse(&page) {
        seen += 1;
        if let Ok(s) = item {
            check_sample(&s);
        }
    }
    assert_eq!(seen, content_lines, "a line was neither a sample nor an error");
    let m = ReplicaMetrics::from_exposition(&page);
    for e in m.engines.values() {
        assert!((0.0..=1.0).contains(&e.kv_usage));
    }
});
