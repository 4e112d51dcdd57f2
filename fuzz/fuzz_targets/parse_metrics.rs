//! Fuzzes the Prometheus exposition parser a router runs on every replica scrape.
#![no_main]

use kinference_vllm::metrics::ReplicaMetrics;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let m = ReplicaMetrics::from_exposition(&text);
    for e in m.engines.values() {
        assert!((0.0..=1.0).contains(&e.kv_usage));
    }
});
