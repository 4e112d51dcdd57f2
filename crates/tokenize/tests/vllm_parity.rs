//! Parity with what vLLM hashes: (1) the real vLLM 0.32 `/tokenize` outputs recorded in
//! ../shared/golden/real_vllm_0.32 (tiny-llama tokenizer, completions and chat); (2) Python
//! transformers' `apply_chat_template` / `encode` on >= 1,000 ShareGPT cases per tokenizer, from
//! the expectation files scripts/tokenizer_expectations.py writes.
//!
//! Expectations are read from $KINFERENCE_TOKENIZER_EXPECT_DIR when set (generated there with
//! the Python of $KINFERENCE_PYTHON, default ~/.cache/kinference/py/bin/python, when missing),
//! else from the files committed in tests/expectations.

// Test code: a failed unwrap is a failed test with its message.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use kinference_tokenize::Json;
use kinference_tokenize::{ChatRequest, Tokenizer, TokenizerOptions};

use common::*;

fn uncached() -> TokenizerOptions {
    TokenizerOptions {
        cache_capacity_bytes: 0,
        ..TokenizerOptions::default()
    }
}

#[test]
fn real_vllm_tokenize_outputs_match() {
    let tok = Tokenizer::from_dir(tiny_llama_dir()).unwrap();
    let mut checked = 0;
    for run in ["run1", "run3_cbor"] {
        let path = shared_dir()
            .join("golden/real_vllm_0.32")
            .join(run)
            .join("requests.json");
        let data = Json::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for step in data["steps"].as_array().unwrap() {
            let (Some(req), Some(out)) = (step.get("tokenize_request"), step.get("tokenize"))
            else {
                continue;
            };
            let want: Vec<u32> = out["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let got = if let Some(prompt) = req.get("prompt").and_then(Json::as_str) {
                tok.encode_completion(prompt).unwrap()
            } else {
                let body = req.to_string();
                let chat = ChatRequest::from_json(body.as_bytes()).unwrap();
                tok.encode_chat(&chat).unwrap()
            };
            assert_eq!(got, want, "{run} {}", step["name"]);
            // The request actually served must give the same ids as its /tokenize twin.
            let served = &step["request"];
            if served.get("messages").is_some() {
                let body = served.to_string();
                let chat = ChatRequest::from_json(body.as_bytes()).unwrap();
                assert_eq!(
                    tok.encode_chat(&chat).unwrap(),
                    want,
                    "{run} {} (served request)",
                    step["name"]
                );
            }
            checked += 1;
        }
    }
    assert_eq!(
        checked, 8,
        "expected 4 tokenize outputs in each of run1 and run3_cbor"
    );
}

fn python() -> PathBuf {
    match std::env::var_os("KINFERENCE_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/kinference/py/bin/python"),
    }
}

/// The expectation directory, generated first when it is an env-var directory without files.
fn expectations_dir() -> PathBuf {
    let Some(dir) = std::env::var_os("KINFERENCE_TOKENIZER_EXPECT_DIR").map(PathBuf::from) else {
        return Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/expectations");
    };
    if dir.join("COMPLETE").exists() {
        return dir;
    }
    let py = python();
    assert!(
        py.exists(),
        "{} has no expectation files and {} does not exist.\nInstall the pinned Python packages with \
         `bash scripts/python-deps.sh` (creates ~/.cache/kinference/py), or point KINFERENCE_PYTHON at a \
         python with transformers==5.19.0 tokenizers==0.23.3 jinja2==3.1.6, or unset \
         KINFERENCE_TOKENIZER_EXPECT_DIR to use the committed expectations.",
        dir.display(),
        py.display()
    );
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tokenizer_expectations.py");
    let status = Command::new(&py)
        .arg(&script)
        .arg("--out")
        .arg(&dir)
        .arg("--shared")
        .arg(shared_dir())
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", py.display()));
    assert!(status.success(), "{} failed ({status})", script.display());
    dir
}

#[derive(Default)]
struct Tally {
    completions: usize,
    chats: usize,
    rejections: usize,
    failures: Vec<String>,
}

fn check_set(path: &Path, convs: &[Vec<(bool, String)>]) -> Tally {
    let t0 = std::time::Instant::now();
    let lines = read_jsonl_gz(path);
    let header = &lines[0];
    let dir = shared_dir().join(header["dir"].as_str().unwrap());
    let tok = match header["template"].as_str() {
        Some(t) => {
            let config = dir.join("tokenizer_config.json");
            let config = config.exists().then_some(config);
            Tokenizer::from_files(
                dir.join("tokenizer.json"),
                config.as_deref(),
                Some(&shared_dir().join(t)),
                uncached(),
            )
        }
        None => Tokenizer::from_dir_with(&dir, uncached()),
    }
    .unwrap();
    let set = header["set"].as_str().unwrap();
    let loaded = t0.elapsed();
    let mut t = Tally::default();
    for line in &lines[1..] {
        if let Some(case) = line.get("completion") {
            let ids = tok
                .encode_completion(&completion_text(convs, case))
                .unwrap();
            if line["ids"].as_str() != Some(digest_ids(&ids).as_str())
                || line["n"].as_u64() != Some(ids.len() as u64)
            {
                t.failures.push(format!(
                    "{set} completion {case}: {} ids, want {}",
                    ids.len(),
                    line["n"]
                ));
            }
            t.completions += 1;
            continue;
        }
        let case = &line["case"];
        let req = case_request(convs, case);
        let got = ChatRequest::from_json(req.to_string().as_bytes()).and_then(|r| {
            let text = tok.render_chat(&r)?;
            Ok((tok.encode_chat(&r)?, text))
        });
        match (got, line.get("error")) {
            (Err(_), Some(_)) => t.rejections += 1,
            (Err(e), None) => t.failures.push(format!("{set} {case}: error {e}")),
            (Ok(_), Some(err)) => t
                .failures
                .push(format!("{set} {case}: accepted, Python raised {err}")),
            (Ok((ids, text)), None) => {
                if line["text"].as_str() != Some(digest_text(&text).as_str()) {
                    t.failures.push(format!(
                        "{set} {case}: rendered text differs: {:?}",
                        truncate(&text)
                    ));
                } else if line["ids"].as_str() != Some(digest_ids(&ids).as_str()) {
                    t.failures.push(format!(
                        "{set} {case}: ids differ ({} vs {})",
                        ids.len(),
                        line["n"]
                    ));
                }
            }
        }
        t.chats += 1;
    }
    println!(
        "{set}: loaded in {loaded:?}, checked in {:?}",
        t0.elapsed() - loaded
    );
    t
}

fn truncate(s: &str) -> String {
    s.chars().take(400).collect()
}

#[test]
fn transformers_expectations_match() {
    let dir = expectations_dir();
    let convs = sharegpt();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".jsonl.gz"))
        .collect();
    files.sort();
    assert_eq!(
        files.len(),
        10,
        "expected 10 expectation sets in {}",
        dir.display()
    );
    // One thread per set: the sets are independent and loading a tokenizer is the slow part.
    let tallies: Vec<(PathBuf, Tally)> = std::thread::scope(|s| {
        let handles: Vec<_> = files
            .iter()
            .map(|f| (f.clone(), s.spawn(|| check_set(f, &convs))))
            .collect();
        handles
            .into_iter()
            .map(|(f, h)| (f, h.join().unwrap()))
            .collect()
    });
    let mut failures = Vec::new();
    for (f, t) in &tallies {
        let name = f.file_name().unwrap().to_string_lossy();
        println!(
            "{name}: {} completions, {} chats ({} rejected as in Python), {} failures",
            t.completions,
            t.chats,
            t.rejections,
            t.failures.len()
        );
        assert!(
            t.completions >= 1000,
            "{name}: only {} completion cases",
            t.completions
        );
        if !name.starts_with("qwen2.") && !name.starts_with("gpt2") && !name.starts_with("mistral")
        {
            assert!(t.chats >= 1000, "{name}: only {} chat cases", t.chats);
        }
        failures.extend(t.failures.iter().cloned());
    }
    assert!(
        failures.is_empty(),
        "{} mismatches, first ones:\n{}",
        failures.len(),
        failures[..failures.len().min(15)].join("\n")
    );
}
