//! Shared test helpers: locating ../shared, reading ShareGPT, building chat requests the way
//! scripts/tokenizer_expectations.py builds them, and the digests it records.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};

pub use kinference_testkit::shared_dir;
use kinference_tokenize::{Json, Map, Tokenizer, TokenizerOptions};
use sha2::{Digest, Sha256};

pub fn tokenizers_dir() -> PathBuf {
    shared_dir().join("data/tokenizers")
}

pub fn tiny_llama_dir() -> PathBuf {
    kinference_testkit::tokenizer_dir()
}

/// A shared tokenizer by directory name (`@tiny`: the real-vLLM interop model's) with a prefix
/// cache of `capacity` bytes.
pub fn load(name: &str, capacity: usize) -> Tokenizer {
    let dir = if name == "@tiny" {
        tiny_llama_dir()
    } else {
        tokenizers_dir().join(name)
    };
    Tokenizer::from_dir_with(
        dir,
        TokenizerOptions {
            cache_capacity_bytes: capacity,
            ..TokenizerOptions::default()
        },
    )
    .unwrap()
}

/// Reads a `.jsonl.gz` file into JSON values.
pub fn read_jsonl_gz(path: &Path) -> Vec<Json> {
    let f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut text = String::new();
    flate2::read::GzDecoder::new(f)
        .read_to_string(&mut text)
        .unwrap();
    text.lines()
        .filter(|l| !l.is_empty())
        .map(|l| Json::parse(l).unwrap())
        .collect()
}

/// ShareGPT conversations: each a list of (is_human, text).
pub fn sharegpt() -> Vec<Vec<(bool, String)>> {
    let path = shared_dir().join("data/traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz");
    read_jsonl_gz(&path)
        .into_iter()
        .map(|c| {
            c["conversations"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    (
                        t["from"].as_str() == Some("human"),
                        t["value"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .collect()
}

pub const SYSTEM_PROMPTS: [&str; 3] = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in at most three sentences.\nUse Markdown when it helps.",
    "  Système: réponds en français, s'il te plaît. 日本語も可。 ",
];

/// The request a chat case of the expectation files describes (`sharegpt_request` there).
pub fn case_request(convs: &[Vec<(bool, String)>], case: &Json) -> Json {
    if let Some(r) = case.get("request") {
        return r.clone();
    }
    let msg = |role: &str, content: Json| {
        Json::Object(Map::from_iter([
            ("role".to_string(), Json::from(role)),
            ("content".to_string(), content),
        ]))
    };
    let text_part = |t: String| {
        Json::Object(Map::from_iter([
            ("type".to_string(), Json::from("text")),
            ("text".to_string(), Json::from(t)),
        ]))
    };
    let conv = &convs[case["conv"].as_u64().unwrap() as usize];
    let k = case["k"].as_u64().unwrap() as usize;
    let mut msgs = Vec::new();
    if let Some(s) = case.get("system").and_then(Json::as_u64) {
        let role = case
            .get("system_role")
            .and_then(Json::as_str)
            .unwrap_or("system");
        msgs.push(msg(role, Json::from(SYSTEM_PROMPTS[s as usize])));
    }
    let parts = case.get("parts").and_then(Json::as_bool).unwrap_or(false);
    for (human, text) in conv.iter().take(k) {
        let role = if *human { "user" } else { "assistant" };
        if parts && *human {
            let chars: Vec<char> = text.chars().collect();
            let half = chars.len() / 2;
            let (a, b) = (
                chars[..half].iter().collect(),
                chars[half..].iter().collect(),
            );
            msgs.push(msg(role, Json::Array(vec![text_part(a), text_part(b)])));
        } else {
            msgs.push(msg(role, Json::from(text.as_str())));
        }
    }
    let mut req = Map::from_iter([("messages".to_string(), Json::Array(msgs))]);
    if let Some(extra) = case.get("extra").and_then(Json::as_object) {
        for (k, v) in extra {
            req.insert(k.clone(), v.clone());
        }
    }
    Json::Object(req)
}

/// The text a completion case describes (`completion_text` there).
pub fn completion_text(convs: &[Vec<(bool, String)>], case: &Json) -> String {
    if let Some(t) = case.get("text").and_then(Json::as_str) {
        return t.to_string();
    }
    let conv = &convs[case["conv"].as_u64().unwrap() as usize];
    if case.get("joined").and_then(Json::as_bool).unwrap_or(false) {
        return conv
            .iter()
            .map(|(_, t)| t.as_str())
            .collect::<Vec<_>>()
            .join("\n");
    }
    conv[case["msg"].as_u64().unwrap() as usize].1.clone()
}

/// First 16 hex digits of sha256 over the ids as little-endian u32.
pub fn digest_ids(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for id in ids {
        h.update(id.to_le_bytes());
    }
    hex16(&h.finalize())
}

pub fn digest_text(text: &str) -> String {
    hex16(&Sha256::digest(text.as_bytes()))
}

fn hex16(bytes: &[u8]) -> String {
    bytes.iter().take(8).map(|b| format!("{b:02x}")).collect()
}
