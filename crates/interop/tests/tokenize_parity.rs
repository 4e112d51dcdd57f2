//! The router's tokenization against a real vLLM's `/tokenize`: for ShareGPT conversations
//! (chat, template applied with the generation prompt) and their user turns (completions,
//! special tokens added), `kinference-tokenize` with the server's own tokenizer directory must
//! produce exactly the ids the server does. Skips without a configured vLLM
//! (`scripts/interop.sh` sets it up).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::BufRead;

use kinference_interop::env::model_dir;
use kinference_interop::env::SKIP_MESSAGE;
use kinference_interop::http::{ChatMessage, VllmHttp};
use kinference_interop::RealVllmEnv;
use kinference_tokenize::{ChatRequest, Tokenizer};
use serde_json::{json, Value};

/// Conversations checked (of the 3,000 in the trace file), and turns kept per conversation.
const CONVERSATIONS: usize = 120;
const MAX_TURNS: usize = 6;
/// Keeps every prompt inside the tiny model's 2,048-token context (its `/tokenize` refuses
/// longer ones).
const MAX_TURN_CHARS: usize = 1_200;

fn conversations() -> Vec<Vec<ChatMessage>> {
    let path =
        kinference_testkit::shared("data/traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz");
    let file = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("ShareGPT trace required at {}: {e}", path.display()));
    let reader = std::io::BufReader::new(flate2::read::GzDecoder::new(file));
    let mut out = Vec::new();
    for line in reader.lines() {
        let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
        let turns = v["conversations"].as_array().cloned().unwrap_or_default();
        let mut msgs: Vec<ChatMessage> = turns
            .iter()
            .take(MAX_TURNS)
            .map(|t| {
                let role = if t["from"] == "human" {
                    "user"
                } else {
                    "assistant"
                };
                let text: String = t["value"]
                    .as_str()
                    .unwrap_or("")
                    .chars()
                    .take(MAX_TURN_CHARS)
                    .collect();
                ChatMessage::new(role, &text)
            })
            .collect();
        // A request ends with the user's turn.
        while msgs.last().is_some_and(|m| m.role != "user") {
            msgs.pop();
        }
        if msgs.first().is_some_and(|m| m.role == "user") {
            out.push(msgs);
        }
        if out.len() == CONVERSATIONS {
            break;
        }
    }
    out
}

fn first_difference(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_tokenization_equals_vllm_tokenize() {
    let Some(env) = RealVllmEnv::from_env().expect("interop environment") else {
        println!("{SKIP_MESSAGE}");
        return;
    };
    let dir = model_dir();
    let tokenizer = Tokenizer::from_dir(&dir)
        .unwrap_or_else(|e| panic!("the server's tokenizer at {}: {e}", dir.display()));
    let client = VllmHttp::new(&env.url, "tiny").unwrap();
    let convs = conversations();
    assert_eq!(
        convs.len(),
        CONVERSATIONS,
        "not enough conversations in the trace"
    );

    let (mut chats, mut prompts, mut tokens) = (0usize, 0usize, 0usize);
    for (i, msgs) in convs.iter().enumerate() {
        let body = json!({ "model": "tiny", "messages": msgs }).to_string();
        let req = ChatRequest::from_json(body.as_bytes()).unwrap();
        let ours = tokenizer.encode_chat(&req).unwrap();
        let theirs = client.tokenize_chat(msgs).await.unwrap();
        assert!(
            ours == theirs,
            "conversation {i}: chat ids differ at {} of {}/{} (ours {:?}, vLLM {:?})",
            first_difference(&ours, &theirs),
            ours.len(),
            theirs.len(),
            &ours[first_difference(&ours, &theirs)..]
                .iter()
                .take(8)
                .collect::<Vec<_>>(),
            &theirs[first_difference(&ours, &theirs)..]
                .iter()
                .take(8)
                .collect::<Vec<_>>(),
        );
        chats += 1;
        tokens += ours.len();
        for (j, m) in msgs.iter().filter(|m| m.role == "user").enumerate() {
            let ours = tokenizer.encode_completion(&m.content).unwrap();
            let theirs = client.tokenize_text(&m.content).await.unwrap();
            assert!(
                ours == theirs,
                "conversation {i}, user turn {j}: completion ids differ at {} of {}/{}",
                first_difference(&ours, &theirs),
                ours.len(),
                theirs.len()
            );
            prompts += 1;
            tokens += ours.len();
        }
    }
    println!(
        "tokenization parity with {}: {chats} chats and {prompts} completion prompts, {tokens} tokens, all equal",
        env.url
    );
}
