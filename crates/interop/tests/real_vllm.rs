//! End-to-end interop with a real vLLM: block hashes, the KV-event plane and the index.
//!
//! Runs only when `KINFERENCE_REAL_VLLM_URL` (and the other `KINFERENCE_REAL_VLLM_*` variables)
//! are set — `scripts/interop.sh` starts a server with a small KV cache and sets them; otherwise
//! each test prints why it skipped and passes. The server's replay buffer must still start at
//! seq 0 (a fresh server), and its cache must be small (`--num-gpu-blocks-override`) to evict.
//! Run with `--test-threads=1`: the tests share the server and its events endpoint; each starts
//! with `/reset_prefix_cache`, so their order does not matter.
//!
//! Every step is checked (see `kinference_interop::harness`): the index's prediction against the
//! cached tokens vLLM reports, and the index's content against the engine's event log.
//! - `real_vllm_hashes_events_and_index_agree`: completions sharing a long prefix, a chat growing
//!   turn by turn, token-id prompts, evictions interleaved with revisits, `/reset_prefix_cache`,
//!   and a fresh subscriber that must rebuild the index from vLLM's replay buffer.
//! - `real_vllm_duplicate_block_copies`: a prompt of exactly two blocks sent twice makes vLLM
//!   recompute its last block and cache a second copy under the same hash; evicting one copy
//!   publishes `BlockRemoved` while the other still serves hits.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Instant;

use kinference_interop::env::SKIP_MESSAGE;
use kinference_interop::{ChatMessage, Harness, RealVllmEnv, Request, StepReport};

const SHARED_PREFIX: &str = "A cache-aware router keeps a map from block hashes to the servers \
that hold them. When a request arrives it tokenizes the prompt exactly as the engine would, \
splits the token ids into fixed-size blocks, hashes every full block together with the hash of \
the block before it, and looks up how many leading blocks each server still caches. The server \
with the longest cached prefix skips most of the prefill, so the router sends the request \
there unless that server is already overloaded. Engines announce every block they cache and \
every block they evict over a publish socket, and the router applies those announcements in \
order, replaying any it missed. ";

const QUESTIONS: [&str; 4] = [
    "Question one: what exactly is a block?",
    "Question two: why does every hash depend on its parent?",
    "Question three: what happens when the engine evicts a block?",
    "Question four: how does the router notice a restarted engine?",
];

const SYSTEM: &str = "You are a precise assistant for questions about key-value caches, \
prefix caching, block hashing and request routing in language model serving systems. Answer \
in one short paragraph and name the component responsible for each step.";

const USER_TURNS: [&str; 4] = [
    "How does the engine decide which blocks it may reuse for a new request?",
    "And what does the router need to know to predict that reuse before sending the request?",
    "What goes wrong if the router misses an eviction message from the engine?",
    "Summarise the whole flow for a conversation that grows by one turn at a time.",
];

fn line(r: &StepReport) {
    println!(
        "  {:<28} tokens {:>4}  blocks {:>3}  predicted {:>3}  cached {:>4}  new {:>3}  \
         removed {:>3}  seq {:>4}  index {:>3}",
        r.name,
        r.prompt_tokens,
        r.blocks,
        r.predicted_blocks,
        r.cached_tokens,
        r.announced,
        r.removed,
        r.applied_seq.map_or("-".to_owned(), |s| s.to_string()),
        r.entries
    );
}

/// Deterministic token ids in `[5, 4000)` (ids below 5 are the tokenizer's special tokens).
fn ids(seed: u64, len: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            5 + (x % 3995) as u32
        })
        .collect()
}

async fn shared_prefix_completions(h: &mut Harness) {
    println!("completions sharing a prefix:");
    for (i, q) in QUESTIONS.iter().enumerate() {
        let req = Request::Text(format!("{SHARED_PREFIX}{q}"));
        let r = h.request(&format!("completion-{i}"), &req).await.unwrap();
        line(&r);
        if i > 0 {
            assert!(
                r.cached_tokens > 0,
                "completion {i} must reuse the shared prefix"
            );
        }
    }
}

async fn chat_conversation(h: &mut Harness) {
    println!("chat growing turn by turn:");
    let mut messages = vec![ChatMessage::new("system", SYSTEM)];
    for (i, turn) in USER_TURNS.iter().enumerate() {
        messages.push(ChatMessage::new("user", turn));
        let r = h
            .request(&format!("chat-turn-{i}"), &Request::Chat(messages.clone()))
            .await
            .unwrap();
        line(&r);
        if i > 0 {
            assert!(
                r.cached_tokens > 0,
                "turn {i} must reuse the conversation so far"
            );
        }
        let reply = format!("{} That is the short answer to part {i}.", r.reply);
        messages.push(ChatMessage::new("assistant", &reply));
    }
}

async fn token_id_prompts(h: &mut Harness, bs: usize) {
    println!("token-id prompts:");
    let base = ids(1, 5 * bs + 7);
    for i in 0..3u64 {
        let mut prompt = base.clone();
        prompt.extend(ids(100 + i, bs + 11));
        let r = h
            .request(&format!("ids-{i}"), &Request::Ids(prompt))
            .await
            .unwrap();
        line(&r);
        if i > 0 {
            assert!(
                r.cached_tokens as usize >= 5 * bs,
                "ids-{i} reuses the 5 shared blocks"
            );
        }
    }
}

/// Distinct 10-block prompts until the cache has turned over twice, revisiting earlier prompts
/// (their prefixes shrink as blocks are evicted).
async fn evictions(h: &mut Harness, bs: usize, num_blocks: usize) {
    println!("evictions ({num_blocks} blocks):");
    let rounds = 2 * num_blocks / 10 + 2;
    let removals_before = h.log().model().removals;
    for i in 0..rounds {
        let req = Request::Ids(ids(1000 + i as u64, 10 * bs));
        line(&h.request(&format!("evict-{i}"), &req).await.unwrap());
        if i % 3 == 2 {
            let text = Request::Text(format!("{SHARED_PREFIX}{}", QUESTIONS[0]));
            line(
                &h.request(&format!("revisit-completion-{i}"), &text)
                    .await
                    .unwrap(),
            );
            let mut prompt = ids(1, 5 * bs + 7);
            prompt.extend(ids(100, bs + 11));
            let ids_req = Request::Ids(prompt);
            line(
                &h.request(&format!("revisit-ids-{i}"), &ids_req)
                    .await
                    .unwrap(),
            );
        }
    }
    let model = h.log().model();
    let removed = model.removals - removals_before;
    println!(
        "  removals {removed}, unknown removals {}",
        model.unknown_removals
    );
    assert!(removed > 0, "the small KV cache must have evicted blocks");
    assert_eq!(
        model.unknown_removals, 0,
        "vLLM removed a block it never announced"
    );
}

async fn reset(h: &mut Harness, bs: usize) -> Vec<u32> {
    println!("reset_prefix_cache:");
    let probe = ids(7, 3 * bs + 3);
    let r = h
        .reset_and_probe("reset-probe", &Request::Ids(probe.clone()))
        .await
        .unwrap();
    line(&r);
    assert!(
        !h.log().clear_seqs().is_empty(),
        "AllBlocksCleared after the reset"
    );
    probe
}

async fn late_subscriber(h: &mut Harness, bs: usize, probe: Vec<u32>) {
    println!("fresh subscriber joining mid-stream:");
    h.restart_plane().await.unwrap();
    let r = h
        .request("late-fresh", &Request::Ids(ids(8, 2 * bs + 1)))
        .await
        .unwrap();
    line(&r);
    let r = h
        .request("late-revisit-probe", &Request::Ids(probe))
        .await
        .unwrap();
    line(&r);
    assert_eq!(
        r.predicted_blocks, 3,
        "the rebuilt index knows the blocks cached before it started"
    );
    let health = h.health().unwrap();
    println!(
        "  health: gaps {} replays {}/{} replayed batches {} sync {:?}",
        health.gaps,
        health.replays_succeeded,
        health.replays_attempted,
        health.replayed_batches,
        health.sync
    );
    assert!(
        health.replayed_batches > 0,
        "the fresh subscriber must have used the replay"
    );
}

/// The harness for the configured server, or `None` (after printing why) when not configured.
async fn connect() -> Option<Harness> {
    let Some(env) = RealVllmEnv::from_env().expect("interop environment") else {
        println!("{SKIP_MESSAGE}");
        return None;
    };
    println!(
        "real vLLM at {} ({}), events {}",
        env.url, env.hash_algo, env.events
    );
    let h = Harness::connect(env).await.unwrap();
    let num_blocks = h.server().num_gpu_blocks;
    assert!(
        num_blocks <= 1024,
        "the server caches {num_blocks} blocks: start it with a small NUM_BLOCKS so it evicts"
    );
    Some(h)
}

/// Asserts that nothing disagreed, after shutting the harness down.
async fn finish(mut h: Harness, started: Instant) {
    let check = h.check_hashes().unwrap();
    println!(
        "hashes: {} of {} blocks announced during the test reproduced from /tokenize output; \
         {} batches in the log; {:.1}s",
        check.reproduced,
        check.stored_blocks,
        h.log().batches().len(),
        started.elapsed().as_secs_f64()
    );
    let problems = h.problems().to_vec();
    h.shutdown().await;
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
    assert!(check.stored_blocks > 0);
    assert_eq!(check.reproduced, check.stored_blocks);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_hashes_events_and_index_agree() {
    let Some(mut h) = connect().await else { return };
    let started = Instant::now();
    let bs = h.server().block_size as usize;
    let num_blocks = h.server().num_gpu_blocks as usize;
    // Start from an empty cache, whatever ran on the server before.
    let r = h
        .reset_and_probe("start-reset", &Request::Ids(ids(9, bs + 1)))
        .await
        .unwrap();
    line(&r);
    shared_prefix_completions(&mut h).await;
    chat_conversation(&mut h).await;
    token_id_prompts(&mut h, bs).await;
    evictions(&mut h, bs, num_blocks).await;
    let probe = reset(&mut h, bs).await;
    late_subscriber(&mut h, bs, probe).await;
    finish(h, started).await;
}

/// vLLM caches a second physical copy of a block it recomputes, announcing the same hash again;
/// evicting one copy announces `BlockRemoved` although the other copy still serves hits. The
/// index must keep predicting the hit (vLLM's `cached_tokens` is the ground truth).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_duplicate_block_copies() {
    let Some(mut h) = connect().await else { return };
    let started = Instant::now();
    let bs = h.server().block_size as usize;
    let num_blocks = h.server().num_gpu_blocks as usize;
    println!("duplicate copies of one block:");
    let r = h
        .reset_and_probe("dup-reset", &Request::Ids(ids(20, bs + 1)))
        .await
        .unwrap();
    line(&r);
    let exact = ids(21, 2 * bs);
    for i in 0..2 {
        let r = h
            .request(&format!("exact-{i}"), &Request::Ids(exact.clone()))
            .await
            .unwrap();
        line(&r);
    }
    let model = h.log().model();
    let second = *model.held().iter().find(|b| model.copies(**b) == 2).expect(
        "a fully cached prompt of whole blocks recomputes its last block and caches a second copy",
    );
    let longer = Request::Ids([exact, ids(22, bs + 5)].concat());
    line(&h.request("longer-0", &longer).await.unwrap());
    // Evict, keeping the copy the longer prompt hits warm, until one copy is gone.
    let mut evicted_one = false;
    for i in 0..2 * num_blocks / 10 + 2 {
        let req = Request::Ids(ids(2000 + i as u64, 10 * bs));
        line(&h.request(&format!("dup-evict-{i}"), &req).await.unwrap());
        let m = h.log().model();
        if m.removals_leaving_copies > 0 && m.copies(second) == 1 {
            evicted_one = true;
            break;
        }
        line(
            &h.request(&format!("longer-{}", i + 1), &longer)
                .await
                .unwrap(),
        );
    }
    assert!(
        evicted_one,
        "no eviction removed one copy while the other stayed cached"
    );
    let r = h.request("longer-after-removal", &longer).await.unwrap();
    line(&r);
    assert!(
        r.cached_tokens as usize >= 2 * bs,
        "vLLM still serves the block whose other copy it announced as removed"
    );
    finish(h, started).await;
}
