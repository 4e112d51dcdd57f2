//! The native chat-template renderers against minijinja, the reference: on every tokenizer of
//! ../shared whose template has a native renderer, 100,000 seeded random requests that it
//! renders (and all those it declines) must give minijinja's text byte for byte, or fail as
//! minijinja fails. The requests mix ShareGPT text with what the templates branch on: roles in
//! any order (system first or later, developer, tool, unknown ones), whitespace Python strips
//! and Rust might not, `<think>` blocks, wrapped tool responses, empty, null and list
//! contents, reasoning and tool calls, `continue_final_message`, and template kwargs that
//! switch thinking off, override the BOS token or shadow `namespace`.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use kinference_tokenize::ChatRequest;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use common::*;

/// Native renders each template must pass.
const RENDERED: usize = 100_000;

/// Text pieces the templates treat specially or Python and Rust strip differently.
const PIECES: [&str; 22] = [
    " ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "\u{a0}",
    "\u{3000}",
    "\u{2028}",
    "\u{1c}",
    "\u{85}",
    "\u{feff}",
    "<think>",
    "</think>",
    "\n<think>\n",
    "\n</think>\n\n",
    "<tool_response>",
    "</tool_response>",
    "<|im_end|>",
    "<|eot_id|>",
    "<｜User｜>",
    "{{ x }}",
    "é",
];

fn snippet(rng: &mut ChaCha8Rng, texts: &[&str]) -> String {
    let text = texts.choose(rng).copied().unwrap_or("");
    let chars: Vec<char> = text.chars().collect();
    let start = rng.gen_range(0..=chars.len());
    let len = rng.gen_range(0..=160usize);
    chars[start..(start + len).min(chars.len())]
        .iter()
        .collect()
}

fn content(rng: &mut ChaCha8Rng, texts: &[&str]) -> Value {
    match rng.gen_range(0..100) {
        0..=3 => return Value::Null,
        4..=7 => {
            let parts: Vec<Value> = (0..rng.gen_range(1..3))
                .map(|_| json!({"type": "text", "text": snippet(rng, texts)}))
                .collect();
            return Value::Array(parts);
        }
        8..=10 => return json!(""),
        _ => {}
    }
    let mut s = String::new();
    for _ in 0..rng.gen_range(1..4) {
        if rng.gen_bool(0.4) {
            for _ in 0..rng.gen_range(1..4) {
                s.push_str(PIECES.choose(rng).unwrap());
            }
        }
        s.push_str(&snippet(rng, texts));
    }
    if rng.gen_bool(0.1) {
        s = format!("<tool_response>{s}</tool_response>");
    }
    Value::String(s)
}

fn random_request(rng: &mut ChaCha8Rng, texts: &[&str]) -> Value {
    let n = rng.gen_range(1..=7);
    let mut messages = Vec::new();
    for i in 0..n {
        let role = match rng.gen_range(0..100) {
            0..=29 if i == 0 => "system",
            0..=39 => "user",
            40..=79 => "assistant",
            80..=87 => "system",
            88..=91 => "tool",
            92..=95 => "developer",
            96..=97 => "narrator",
            _ => "function",
        };
        let mut m = json!({"role": role, "content": content(rng, texts)});
        if role == "assistant" {
            if rng.gen_bool(0.05) {
                m["reasoning"] = json!(snippet(rng, texts));
            }
            if rng.gen_bool(0.05) {
                m["tool_calls"] = json!([{"id": "c1", "type": "function",
                    "function": {"name": "lookup", "arguments": "{\"q\": 1}"}}]);
            }
        }
        if role == "tool" {
            m["tool_call_id"] = json!("c1");
        }
        if rng.gen_bool(0.05) {
            m["name"] = json!("someone");
        }
        messages.push(m);
    }
    let mut req = json!({"model": "m", "messages": messages});
    match rng.gen_range(0..100) {
        0..=4 => {
            req["continue_final_message"] = json!(true);
            req["add_generation_prompt"] = json!(false);
        }
        5..=24 => req["add_generation_prompt"] = json!(false),
        _ => {}
    }
    let kwargs = match rng.gen_range(0..100) {
        0..=9 => Some(json!({"enable_thinking": false})),
        10..=14 => Some(json!({"enable_thinking": true})),
        15..=16 => Some(json!({"enable_thinking": "false"})),
        17 => Some(json!({"enable_thinking": 0})),
        18..=19 => Some(json!({"namespace": 1})),
        20..=21 => Some(json!({"bos_token": "<B>"})),
        22..=23 => Some(json!({"bos_token": 7})),
        24..=25 => Some(json!({"custom": "x", "ns": 2, "loop_messages": []})),
        _ => None,
    };
    if let Some(k) = kwargs {
        req["chat_template_kwargs"] = k;
    }
    if rng.gen_bool(0.02) {
        req["reasoning_effort"] = json!(if rng.gen_bool(0.5) { "none" } else { "low" });
    }
    req
}

#[test]
fn native_renders_equal_minijinja() {
    let convs = sharegpt();
    let texts: Vec<&str> = convs.iter().flatten().map(|(_, t)| t.as_str()).collect();
    let names: Vec<String> = std::fs::read_dir(tokenizers_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("tokenizer.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let known: Vec<(String, &'static str)> = names
        .iter()
        .filter_map(|n| load(n, 0).native_template().map(|k| (n.clone(), k)))
        .collect();
    let mut found: Vec<&str> = known.iter().map(|(_, k)| *k).collect();
    found.sort_unstable();
    assert_eq!(
        found,
        ["deepseek-v3", "llama3", "llama3.1", "qwen3"],
        "every native renderer is written from a template in ../shared ({known:?})"
    );
    std::thread::scope(|s| {
        for (k, (name, _)) in known.iter().enumerate() {
            let texts = &texts;
            s.spawn(move || {
                let tok = load(name, 0);
                let mut rng = ChaCha8Rng::seed_from_u64(17_000 + k as u64);
                let (mut native, mut declined, mut failed) = (0usize, 0usize, 0usize);
                let mut case = 0u64;
                while native < RENDERED {
                    case += 1;
                    let body = random_request(&mut rng, texts).to_string();
                    let req = ChatRequest::from_json(body.as_bytes()).unwrap();
                    // The body walker reads real text as serde_json alone does.
                    let reference = ChatRequest::from_json_reference(body.as_bytes()).unwrap();
                    assert_eq!(format!("{req:?}"), format!("{reference:?}"), "{body}");
                    let want = tok.render_chat_reference(&req);
                    match (tok.render_chat_traced(&req), want) {
                        (Ok((got, used)), Ok(want)) => {
                            assert!(got == want, "{name} case {case}: {body}\n{got:?}\n{want:?}");
                            if used {
                                native += 1;
                            } else {
                                declined += 1;
                            }
                        }
                        (Err(_), Err(_)) => failed += 1,
                        (got, want) => {
                            panic!("{name} case {case}: {body}\nnative {got:?}\nminijinja {want:?}")
                        }
                    }
                }
                println!("{name}: {native} rendered natively, {declined} declined, {failed} failed in both");
            });
        }
    });
}
