//! The simulator against a real vLLM 0.32 capture (`shared/golden/real_vllm_0.32/run1`):
//! the same prompts must produce the same `BlockStored` events — byte for byte on the wire —
//! and the same prefix-cache counters as the real engine reported.
//!
//! Prompt tokens come from the capture's own events (only full blocks are published, so the
//! unpublished tail of each prompt is filled with arbitrary tokens: partial blocks are never
//! hashed, so they cannot change any event).

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::PathBuf;

use kinference_sim::{Engine, EngineConfig, Request, SimTime, StepOutput};
use kinference_testkit::shared;
use kinference_vllm::{decode_batch, encode_batch, KvEvent, KvEventBatch};
use serde_json::Value;

fn run1() -> PathBuf {
    shared("golden/real_vllm_0.32/run1")
}

fn messages() -> Vec<Value> {
    let text = fs::read_to_string(run1().join("events.jsonl")).unwrap();
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn payload(msg: usize) -> Vec<u8> {
    fs::read(run1().join(format!("msg_{msg:04}.f2.bin"))).unwrap()
}

fn tokens(msg: &Value) -> Vec<u32> {
    msg["events"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn metric_delta(step: usize, name: &str) -> u64 {
    let text = fs::read_to_string(run1().join("requests.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["steps"][step]["metrics_delta"][name].as_f64().unwrap() as u64
}

/// The capture's server: block size 32, sha256 without PYTHONHASHSEED, integer hashes.
fn engine() -> Engine {
    let mut cfg = EngineConfig::small(512, 32);
    cfg.max_model_len = 4096;
    Engine::new(cfg).unwrap()
}

fn drain(e: &mut Engine, mut now: SimTime) -> (Vec<StepOutput>, SimTime) {
    let mut outs = Vec::new();
    while e.has_work() {
        let o = e.step(now);
        now = o.finished_at;
        outs.push(o);
    }
    (outs, now)
}

fn batches(outs: &[StepOutput]) -> Vec<KvEventBatch> {
    outs.iter().filter_map(|o| o.events.clone()).collect()
}

/// Our batch, re-stamped with the capture's timestamp, must encode to the captured payload.
fn assert_same_wire(ours: &KvEventBatch, msg: usize) {
    let real = payload(msg);
    let decoded = decode_batch(&real).unwrap();
    let restamped = KvEventBatch {
        ts: decoded.ts,
        ..ours.clone()
    };
    assert_eq!(restamped.events, decoded.events, "msg {msg}: events differ");
    assert_eq!(restamped.data_parallel_rank, decoded.data_parallel_rank);
    assert_eq!(
        encode_batch(&restamped),
        real,
        "msg {msg}: wire bytes differ"
    );
}

#[test]
fn completions_reproduce_the_captured_events_and_counters() {
    let msgs = messages();
    let (m0, m1) = (&msgs[0], &msgs[1]);
    let t0 = tokens(m0);
    assert_eq!(t0.len(), 160);
    let mut e = engine();

    // completion_0: 161 prompt tokens, 4 output tokens.
    let p0: Vec<u32> = t0.iter().copied().chain([271]).collect();
    e.add_request(Request::new("completion_0", p0, 4), SimTime::ZERO)
        .unwrap();
    let (outs, now) = drain(&mut e, SimTime::ZERO);
    let b = batches(&outs);
    assert_eq!(
        b.len(),
        1,
        "only the prefill step stores blocks (164 computed tokens < 6 blocks)"
    );
    assert_same_wire(&b[0], 0);
    let m = e.metrics();
    assert_eq!(
        m.prefix_cache_queries,
        metric_delta(0, "vllm:prefix_cache_queries_total")
    );
    assert_eq!(
        m.prefix_cache_hits,
        metric_delta(0, "vllm:prefix_cache_hits_total")
    );
    assert_eq!(
        m.generation_tokens,
        metric_delta(0, "vllm:generation_tokens_total")
    );

    // completion_1: shares four blocks, then one new block and two more tokens (162).
    let p1: Vec<u32> = t0[..128]
        .iter()
        .chain(&tokens(m1))
        .copied()
        .chain([11, 12])
        .collect();
    e.add_request(Request::new("completion_1", p1, 4), now)
        .unwrap();
    let (outs, _) = drain(&mut e, now);
    let b = batches(&outs);
    assert_eq!(b.len(), 1);
    assert_same_wire(&b[0], 1);
    let m2 = e.metrics();
    assert_eq!(
        m2.prefix_cache_queries - m.prefix_cache_queries,
        metric_delta(1, "vllm:prefix_cache_queries_total")
    );
    assert_eq!(
        m2.prefix_cache_hits - m.prefix_cache_hits,
        metric_delta(1, "vllm:prefix_cache_hits_total")
    );
    let cached = outs
        .iter()
        .flat_map(|o| &o.outputs)
        .find_map(|o| o.finished.as_ref())
        .unwrap()
        .usage
        .cached_tokens as u64;
    assert_eq!(cached, metric_delta(1, "vllm:prompt_tokens_cached_total"));
}

#[test]
fn chats_reproduce_the_captured_events_and_counters() {
    let msgs = messages();
    let t2 = tokens(&msgs[2]);
    assert_eq!(t2.len(), 128);
    let mut e = engine();
    // chat_0: 153 tokens (4 full blocks); chat_1: 155 tokens sharing those 4 blocks.
    let p0: Vec<u32> = t2.iter().copied().chain(1000..1025).collect();
    e.add_request(Request::new("chat_0", p0, 4), SimTime::ZERO)
        .unwrap();
    let (outs, now) = drain(&mut e, SimTime::ZERO);
    let b = batches(&outs);
    assert_eq!(b.len(), 1);
    assert_same_wire(&b[0], 2);
    let p1: Vec<u32> = t2.iter().copied().chain(2000..2027).collect();
    e.add_request(Request::new("chat_1", p1, 4), now).unwrap();
    let (outs, _) = drain(&mut e, now);
    assert!(
        batches(&outs).is_empty(),
        "every full block was a hit: nothing is stored"
    );
    let m = e.metrics();
    assert_eq!(
        m.prefix_cache_queries,
        metric_delta(2, "vllm:prefix_cache_queries_total")
            + metric_delta(3, "vllm:prefix_cache_queries_total")
    );
    assert_eq!(
        m.prefix_cache_hits,
        metric_delta(3, "vllm:prefix_cache_hits_total")
    );
}

#[test]
fn long_prompt_and_decode_blocks_have_the_captured_shape() {
    // msg 3: a 15-block prompt with no parent; msgs 5..: one block at a time during decode.
    let msgs = messages();
    let t3 = tokens(&msgs[3]);
    assert_eq!(t3.len(), 480);
    let mut e = engine();
    let p: Vec<u32> = t3.iter().copied().chain([5, 6, 7]).collect();
    e.add_request(Request::new("long", p, 200), SimTime::ZERO)
        .unwrap();
    let (outs, _) = drain(&mut e, SimTime::ZERO);
    let b = batches(&outs);
    assert_same_wire(&b[0], 3);
    for (batch, real) in b[1..].iter().zip(&msgs[5..]) {
        let KvEvent::BlockStored(s) = &batch.events[0] else {
            panic!("{batch:?}")
        };
        let r = &real["events"][0];
        assert_eq!(
            s.block_hashes.len(),
            r["block_hashes"].as_array().unwrap().len()
        );
        assert_eq!(s.token_ids.len(), r["token_ids"].as_array().unwrap().len());
        assert!(s.parent_block_hash.is_some() && !r["parent_block_hash"].is_null());
        assert_eq!(s.extra_keys.as_ref().map(Vec::len), Some(1));
    }
    // 483 + 199 computed tokens = 682 -> 21 full blocks: 15 at prefill, 6 in decode, as captured.
    assert_eq!(b.len(), 1 + 6);
}
