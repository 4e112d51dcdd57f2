//! Engine behaviour on a virtual clock: prefix hits, chunked prefill, preemption, abort,
//! reset, decode-filled blocks, LoRA/salt keys, determinism and input validation.

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kinference_sim::{
    AddRequestError, ConfigError, Engine, EngineConfig, Request, ResetError, SimTime, StepOutput,
};
use kinference_vllm::{
    BlockHash, EventHashForm, ExtraKeyItem, HashValue, KvEvent, Lora, RequestExtras,
};

fn engine(blocks: usize, block_size: usize) -> Engine {
    Engine::new(EngineConfig::small(blocks, block_size)).unwrap()
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 10_000 + i).collect()
}

/// Steps until idle, returning every step's output; the clock follows the steps.
fn run(e: &mut Engine, mut now: SimTime) -> Vec<StepOutput> {
    let mut outs = Vec::new();
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        let o = e.step(now);
        now = o.finished_at;
        e.check_invariants().unwrap();
        outs.push(o);
    }
    assert!(!e.has_work(), "engine did not drain");
    outs
}

fn events(outs: &[StepOutput]) -> Vec<KvEvent> {
    outs.iter()
        .filter_map(|o| o.events.as_ref())
        .flat_map(|b| b.events.clone())
        .collect()
}

fn stored_hashes(evs: &[KvEvent]) -> Vec<u64> {
    evs.iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(
                s.block_hashes
                    .iter()
                    .map(|h| h.block_hash().0)
                    .collect::<Vec<_>>(),
            ),
            _ => None,
        })
        .flatten()
        .collect()
}

fn finished_usage(outs: &[StepOutput], id: &str) -> kinference_sim::Usage {
    outs.iter()
        .flat_map(|o| &o.outputs)
        .find(|o| &*o.request_id == id && o.finished.is_some())
        .and_then(|o| o.finished.as_ref())
        .map(|f| f.usage)
        .unwrap()
}

#[test]
fn identical_prompt_hits_all_but_the_last_blocks_worth() {
    // 10 tokens, block size 4: two full blocks. Hits are capped at len - 1 = 9 -> 2 blocks.
    let mut e = engine(64, 4);
    // Two output tokens: the model computes 11 tokens, so no block fills during decode.
    e.add_request(Request::new("a", prompt(1, 10), 2), SimTime::ZERO)
        .unwrap();
    let first = run(&mut e, SimTime::ZERO);
    e.add_request(
        Request::new("b", prompt(1, 10), 2),
        first.last().unwrap().finished_at,
    )
    .unwrap();
    let second = run(&mut e, first.last().unwrap().finished_at);
    assert_eq!(finished_usage(&first, "a").cached_tokens, 0);
    assert_eq!(finished_usage(&second, "b").cached_tokens, 8);
    let m = e.metrics();
    assert_eq!(m.prefix_cache_queries, 20);
    assert_eq!(m.prefix_cache_hits, 8);
    // No prompt block is stored again: both full blocks were hits.
    let evs = events(&second);
    assert!(stored_hashes(&evs).is_empty(), "{evs:?}");

    // A prompt of exactly 3 blocks can hit only 2 (len - 1 = 11): its last block is recomputed
    // into a fresh block and published again — vLLM does not de-duplicate.
    let t = second.last().unwrap().finished_at;
    e.add_request(Request::new("c", prompt(2, 12), 1), t)
        .unwrap();
    let third = run(&mut e, t);
    e.add_request(
        Request::new("d", prompt(2, 12), 1),
        third.last().unwrap().finished_at,
    )
    .unwrap();
    let fourth = run(&mut e, third.last().unwrap().finished_at);
    assert_eq!(finished_usage(&fourth, "d").cached_tokens, 8);
    let first_store = stored_hashes(&events(&third));
    let again = events(&fourth);
    let KvEvent::BlockStored(s) = &again[0] else {
        panic!("{again:?}")
    };
    assert_eq!(s.block_hashes.len(), 1);
    assert_eq!(s.block_hashes[0].block_hash().0, first_store[2]);
    assert_eq!(
        s.parent_block_hash.as_ref().map(|h| h.block_hash().0),
        Some(first_store[1])
    );
    assert_eq!(s.token_ids, prompt(2, 12)[8..12].to_vec());
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let mut cfg = EngineConfig::small(256, 16);
    cfg.max_num_batched_tokens = 100;
    let mut e = Engine::new(cfg).unwrap();
    e.add_request(Request::new("long", prompt(1, 350), 2), SimTime::ZERO)
        .unwrap();
    e.add_request(Request::new("short", prompt(2, 30), 2), SimTime::ZERO)
        .unwrap();
    let outs = run(&mut e, SimTime::ZERO);
    for o in &outs {
        assert!(o.scheduled_tokens <= 100, "{}", o.scheduled_tokens);
    }
    // 350 prompt tokens need four chunks before the first token of "long".
    let first_token_step = outs
        .iter()
        .position(|o| o.outputs.iter().any(|x| &*x.request_id == "long"))
        .unwrap();
    assert_eq!(first_token_step, 3);
    assert_eq!(outs[0].scheduled_tokens, 100);
    assert_eq!(
        outs[0].scheduled_requests, 1,
        "the budget went to the first prompt's chunk"
    );
    assert_eq!(finished_usage(&outs, "long").completion_tokens, 2);
    assert_eq!(finished_usage(&outs, "short").completion_tokens, 2);
}

#[test]
fn without_chunked_prefill_a_prompt_is_never_split() {
    let mut cfg = EngineConfig::small(256, 16);
    cfg.enable_chunked_prefill = false;
    cfg.max_num_batched_tokens = 1000;
    cfg.max_model_len = 1000;
    let mut e = Engine::new(cfg).unwrap();
    e.add_request(Request::new("a", prompt(1, 600), 1), SimTime::ZERO)
        .unwrap();
    e.add_request(Request::new("b", prompt(2, 600), 1), SimTime::ZERO)
        .unwrap();
    let o = e.step(SimTime::ZERO);
    assert_eq!(o.scheduled_tokens, 600);
    assert_eq!(o.scheduled_requests, 1);
    let o = e.step(o.finished_at);
    assert_eq!(o.scheduled_tokens, 600);
}

#[test]
fn long_prefill_threshold_caps_chunks_only_under_contention() {
    let mut cfg = EngineConfig::small(256, 16);
    cfg.long_prefill_token_threshold = 64;
    let mut e = Engine::new(cfg).unwrap();
    e.add_request(Request::new("alone", prompt(1, 300), 1), SimTime::ZERO)
        .unwrap();
    assert_eq!(e.step(SimTime::ZERO).scheduled_tokens, 300);
    let mut e = Engine::new({
        let mut c = EngineConfig::small(256, 16);
        c.long_prefill_token_threshold = 64;
        c
    })
    .unwrap();
    e.add_request(Request::new("a", prompt(1, 300), 1), SimTime::ZERO)
        .unwrap();
    e.add_request(Request::new("b", prompt(2, 300), 1), SimTime::ZERO)
        .unwrap();
    assert_eq!(e.step(SimTime::ZERO).scheduled_tokens, 128);
}

#[test]
fn preemption_under_kv_pressure_publishes_nothing_itself() {
    // 6 usable blocks of 4 tokens; two 10-token prompts take 3 blocks each.
    let mut e = engine(7, 4);
    e.add_request(Request::new("a", prompt(1, 10), 8), SimTime::ZERO)
        .unwrap();
    e.add_request(Request::new("b", prompt(2, 10), 8), SimTime::ZERO)
        .unwrap();
    let mut now = SimTime::ZERO;
    let mut preempt_step = None;
    let mut all = Vec::new();
    for _ in 0..4 {
        let o = e.step(now);
        now = o.finished_at;
        e.check_invariants().unwrap();
        if o.num_preempted > 0 {
            preempt_step = Some(o.clone());
        }
        all.push(o);
    }
    let o = preempt_step.expect("no preemption happened");
    assert_eq!(o.num_preempted, 1);
    assert_eq!(e.metrics().num_preemptions, 1);
    // "b" was preempted (last running); "a" reused b's tail block, evicting exactly that one.
    let evs = o.events.map(|b| b.events).unwrap_or_default();
    assert_eq!(evs.len(), 1, "{evs:?}");
    let stored_b: Vec<u64> = stored_hashes(&events(&all[..all.len() - 1]))
        .into_iter()
        .skip(2) // a's two prompt blocks come first
        .collect();
    let KvEvent::BlockRemoved(r) = &evs[0] else {
        panic!("{evs:?}")
    };
    assert!(stored_b.contains(&r.block_hashes[0].block_hash().0));
    // b's other blocks stay cached and serve its re-admission.
    let rest = run(&mut e, now);
    let m = e.metrics();
    assert!(m.preempted_prefix_cache_hits > 0, "{m:?}");
    assert_eq!(
        m.prefix_cache_queries, 20,
        "re-admissions stay out of the main counters"
    );
    assert_eq!(finished_usage(&rest, "b").completion_tokens, 8);
    assert_eq!(finished_usage(&rest, "b").cached_tokens, 0);
}

#[test]
fn abort_frees_blocks_and_keeps_them_cached() {
    let mut e = engine(32, 4);
    e.add_request(Request::new("a", prompt(1, 20), 100), SimTime::ZERO)
        .unwrap();
    let o = e.step(SimTime::ZERO);
    assert!(e.block_pool().num_free() < 31);
    let cached_before = e.block_pool().cached_blocks().len();
    assert!(e.abort("a"));
    assert!(!e.abort("a"));
    assert_eq!(e.block_pool().num_free(), 31);
    assert_eq!(e.block_pool().cached_blocks().len(), cached_before);
    assert_eq!(e.metrics().requests_aborted, 1);
    assert!(!e.has_work());
    let o2 = e.step(o.finished_at);
    assert!(o2.events.is_none() && o2.outputs.is_empty());
    // A waiting request can be aborted too.
    e.add_request(Request::new("w", prompt(3, 8), 1), o.finished_at)
        .unwrap();
    assert!(e.abort("w"));
    assert_eq!(e.num_waiting(), 0);
    e.check_invariants().unwrap();
}

#[test]
fn stop_finishes_early_frees_blocks_and_counts_as_stop() {
    let mut e = engine(32, 4);
    e.add_request(Request::new("s", prompt(4, 20), 100), SimTime::ZERO)
        .unwrap();
    let mut now = SimTime::ZERO;
    for _ in 0..3 {
        now = e.step(now).finished_at;
    }
    let cached_before = e.block_pool().cached_blocks().len();
    let fin = e.stop("s", now).unwrap();
    assert!(e.stop("s", now).is_none(), "already finished");
    assert_eq!(fin.reason, kinference_sim::FinishReason::Stop);
    assert_eq!(fin.usage.prompt_tokens, 20);
    assert_eq!(fin.usage.completion_tokens, 3);
    assert_eq!(fin.finished_at, now, "ends at its last token");
    assert_eq!(e.block_pool().num_free(), 31);
    assert_eq!(e.block_pool().cached_blocks().len(), cached_before);
    let m = e.metrics();
    assert_eq!(
        (
            m.requests_finished_stop,
            m.requests_aborted,
            m.requests_finished_length
        ),
        (1, 0, 0)
    );
    assert_eq!(m.e2e.count, 1);
    assert!(!e.has_work());
    e.check_invariants().unwrap();
}

#[test]
fn reset_prefix_cache_emits_one_all_blocks_cleared() {
    let mut e = engine(32, 4);
    e.add_request(Request::new("a", prompt(1, 20), 5), SimTime::ZERO)
        .unwrap();
    let o = e.step(SimTime::ZERO);
    assert!(matches!(
        e.reset_prefix_cache(),
        Err(ResetError::BlocksInUse(_))
    ));
    let outs = run(&mut e, o.finished_at);
    let t = outs.last().unwrap().finished_at;
    e.reset_prefix_cache().unwrap();
    assert!(e.has_work(), "the event waits to be published");
    let flush = e.step(t);
    assert_eq!(flush.duration, Duration::ZERO);
    assert_eq!(
        flush.events.unwrap().events,
        vec![KvEvent::AllBlocksCleared]
    );
    assert!(e.block_pool().cached_blocks().is_empty());
    e.add_request(Request::new("b", prompt(1, 20), 1), t)
        .unwrap();
    let outs = run(&mut e, t);
    assert_eq!(finished_usage(&outs, "b").cached_tokens, 0);
}

#[test]
fn decode_tokens_fill_blocks_and_are_published() {
    let mut e = engine(32, 4);
    // 6 prompt tokens + 7 outputs: the model computes 12 tokens -> blocks 1 and 2 fill in decode.
    e.add_request(Request::new("a", prompt(1, 6), 7), SimTime::ZERO)
        .unwrap();
    let outs = run(&mut e, SimTime::ZERO);
    let evs = events(&outs);
    let stored: Vec<_> = evs
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(stored.len(), 3, "{stored:?}");
    let generated: Vec<u32> = outs
        .iter()
        .flat_map(|o| &o.outputs)
        .map(|o| o.token)
        .collect();
    assert_eq!(generated.len(), 7);
    assert_eq!(
        stored[1].token_ids,
        [&prompt(1, 6)[4..6], &generated[..2]].concat()
    );
    assert_eq!(stored[2].token_ids, generated[2..6].to_vec());
    assert_eq!(
        stored[1].parent_block_hash,
        Some(stored[0].block_hashes[0].clone())
    );
    assert_eq!(
        stored[2].parent_block_hash,
        Some(stored[1].block_hashes[0].clone())
    );
    // The block hashes are those of the full token sequence.
    let all: Vec<u32> = [prompt(1, 6), generated.clone()].concat();
    let want: Vec<u64> = e
        .hasher()
        .unwrap()
        .hash_blocks(&all[..12], &RequestExtras::default())
        .iter()
        .map(|d| d.event_hash().0)
        .collect();
    assert_eq!(stored_hashes(&evs), want);
    let m = e.metrics();
    assert_eq!(m.generation_tokens, 7);
    assert_eq!(m.prompt_tokens, 6);
    assert_eq!(m.ttft.count, 1);
    assert_eq!(m.itl.count, 6);
    assert_eq!(m.e2e.count, 1);
    assert_eq!(m.requests_finished_length, 1);
}

#[test]
fn lora_and_cache_salt_reach_hashes_and_events() {
    let mut e = engine(32, 4);
    let extras = RequestExtras {
        lora: Some(Lora {
            name: "sql".into(),
            path: "/adapters/sql".into(),
        }),
        cache_salt: Some("tenant-a".into()),
        ..RequestExtras::default()
    };
    e.add_request(
        Request::new("a", prompt(1, 9), 1)
            .with_extras(extras.clone())
            .with_lora_id(7),
        SimTime::ZERO,
    )
    .unwrap();
    let outs = run(&mut e, SimTime::ZERO);
    let evs = events(&outs);
    let KvEvent::BlockStored(s) = &evs[0] else {
        panic!("{evs:?}")
    };
    assert_eq!(s.lora_name.as_deref(), Some("sql"));
    assert_eq!(s.lora_id, Some(7));
    let keys = s.extra_keys.as_ref().unwrap();
    assert_eq!(keys.len(), 2);
    assert_eq!(
        keys[0],
        Some(vec![
            ExtraKeyItem::Str("sql".into()),
            ExtraKeyItem::Str("tenant-a".into())
        ])
    );
    assert_eq!(keys[1], Some(vec![ExtraKeyItem::Str("sql".into())]));
    let want = e.hasher().unwrap().hash_blocks(&prompt(1, 8), &extras);
    assert_eq!(s.block_hashes[0], HashValue::Int(want[0].event_hash().0));
    // Without the salt the same tokens do not hit.
    let t = outs.last().unwrap().finished_at;
    assert_eq!(
        e.cached_prefix_tokens(&prompt(1, 9), &RequestExtras::default()),
        0
    );
    assert_eq!(e.cached_prefix_tokens(&prompt(1, 9), &extras), 8);
    let _ = t;
}

#[test]
fn byte_form_hashes_when_configured() {
    let mut cfg = EngineConfig::small(32, 4);
    cfg.events.hash_form = EventHashForm::Bytes;
    let mut e = Engine::new(cfg).unwrap();
    e.add_request(Request::new("a", prompt(1, 5), 1), SimTime::ZERO)
        .unwrap();
    let outs = run(&mut e, SimTime::ZERO);
    let evs = events(&outs);
    let KvEvent::BlockStored(s) = &evs[0] else {
        panic!()
    };
    let HashValue::Bytes(b) = &s.block_hashes[0] else {
        panic!()
    };
    assert_eq!(b.len(), 32);
    assert_eq!(s.block_hashes[0].block_hash(), BlockHash::from_digest(b));
}

#[test]
fn runs_are_deterministic() {
    let go = || {
        let mut e = engine(40, 4);
        for i in 0..12u32 {
            let p = prompt(i % 3, 8 + (i as usize * 5) % 23);
            e.add_request(
                Request::new(format!("r{i}"), p, 3 + i % 5),
                SimTime::from_millis(u64::from(i)),
            )
            .unwrap();
        }
        run(&mut e, SimTime::ZERO)
    };
    assert_eq!(go(), go());
}

#[test]
fn step_never_starts_before_the_previous_step_ends() {
    let mut e = engine(32, 4);
    e.add_request(Request::new("a", prompt(1, 8), 3), SimTime::ZERO)
        .unwrap();
    let o1 = e.step(SimTime::ZERO);
    let o2 = e.step(SimTime::ZERO);
    assert_eq!(o2.started_at, o1.finished_at);
    assert_eq!(o1.events.as_ref().unwrap().ts, o1.finished_at.as_secs_f64());
    assert_eq!(o1.events.as_ref().unwrap().data_parallel_rank, Some(0));
}

#[test]
fn bad_input_is_an_error() {
    let mut e = engine(8, 4);
    assert_eq!(
        e.add_request(Request::new("a", vec![], 1), SimTime::ZERO),
        Err(AddRequestError::EmptyPrompt)
    );
    assert_eq!(
        e.add_request(Request::new("a", vec![1], 0), SimTime::ZERO),
        Err(AddRequestError::ZeroMaxTokens)
    );
    assert!(matches!(
        e.add_request(Request::new("a", vec![1; 29], 1), SimTime::ZERO),
        Err(AddRequestError::PromptTooLong { .. })
    ));
    e.add_request(Request::new("a", vec![1; 4], 1), SimTime::ZERO)
        .unwrap();
    assert!(matches!(
        e.add_request(Request::new("a", vec![1; 4], 1), SimTime::ZERO),
        Err(AddRequestError::DuplicateId(_))
    ));
    let mut c = EngineConfig::small(8, 4);
    c.max_model_len = 29;
    assert!(matches!(
        Engine::new(c),
        Err(ConfigError::ModelLenExceedsCache { .. })
    ));
    let mut c = EngineConfig::small(8, 4);
    c.num_gpu_blocks = 1;
    assert!(matches!(Engine::new(c), Err(ConfigError::TooFewBlocks(1))));
    let mut c = EngineConfig::small(8, 4);
    c.block_size = 0;
    assert!(matches!(
        Engine::new(c),
        Err(ConfigError::Zero("block_size"))
    ));
    let mut c = EngineConfig::small(8, 4);
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 10;
    assert!(matches!(
        Engine::new(c),
        Err(ConfigError::BudgetBelowModelLen { .. })
    ));
}

#[test]
fn max_model_len_stops_generation() {
    let mut c = EngineConfig::small(8, 4);
    c.max_model_len = 12;
    let mut e = Engine::new(c).unwrap();
    e.add_request(Request::new("a", prompt(1, 10), 100), SimTime::ZERO)
        .unwrap();
    let outs = run(&mut e, SimTime::ZERO);
    assert_eq!(finished_usage(&outs, "a").completion_tokens, 2);
}
