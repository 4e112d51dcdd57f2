//! Runs the built `kinfctl` binary against the golden vectors: `hash --json` must print vLLM's
//! digests and event values, `decode-events` must decode captured payloads and multipart
//! messages with vLLM's field names, and bad input must fail with a message.

// Helpers below run only inside tests, where a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use kinference_testkit::shared_dir;
use serde_json::Value;

fn kinfctl(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kinfctl"))
        .args(args)
        .output()
        .expect("run kinfctl")
}

fn stdout_lines(out: &Output) -> Vec<String> {
    assert!(
        out.status.success(),
        "kinfctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

fn golden_case(id: &str) -> Value {
    let path = shared_dir().join("golden/vllm_block_hashes.json");
    let golden: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("golden case {id} missing"))
        .clone()
}

fn token_arg(case: &Value) -> String {
    let ids: Vec<String> = case["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(Value::to_string)
        .collect();
    ids.join(",")
}

/// Runs `hash --json` with `extra` flags and compares every line with the case's blocks.
fn check_hash_case(id: &str, extra: &[&str]) {
    let case = golden_case(id);
    let block_size = case["block_size"].to_string();
    let tokens = token_arg(&case);
    let mut args = vec![
        "hash",
        "--block-size",
        &block_size,
        "--algo",
        case["hash_algo"].as_str().unwrap(),
        "--tokens",
        &tokens,
        "--json",
    ];
    args.extend_from_slice(extra);
    let lines = stdout_lines(&kinfctl(&args));
    let blocks = case["blocks"].as_array().unwrap();
    assert_eq!(lines.len(), blocks.len(), "{id}: one line per full block");
    for (line, block) in lines.iter().zip(blocks) {
        assert!(line.starts_with("{\"index\":"), "{id}: field order: {line}");
        let got: Value = serde_json::from_str(line).unwrap();
        assert_eq!(got["index"], block["index"], "{id}");
        assert_eq!(
            got["digest"], block["block_hash_hex"],
            "{id} block {}",
            block["index"]
        );
        assert_eq!(
            got["event_hash"], block["event_block_hash_u64"],
            "{id} block {}",
            block["index"]
        );
    }
}

#[test]
fn hash_json_matches_golden_cases() {
    check_hash_case("sha256-bs16-6full+5", &[]);
    check_hash_case(
        "sha256-bs32-lora+salt-4full+3",
        &[
            "--lora",
            "sql-lora:/adapters/sql-lora",
            "--cache-salt",
            "tenant-42",
        ],
    );
    check_hash_case(
        "sha256-bs16-mm2-in-one-block-2full+0",
        &["--mm", "img-a:2:3", "--mm", "img-b:8:4"],
    );
    check_hash_case("xxhash_cbor-bs16-seed12345-2full+3", &["--seed", "12345"]);
    check_hash_case(
        "legacy023-sha256-seed0-bs16-lora+salt-3full",
        &[
            "--seed",
            "0",
            "--extra-keys-format",
            "untagged",
            "--lora",
            "sql-lora:/adapters/sql-lora",
            "--cache-salt",
            "tenant-42",
        ],
    );
}

#[test]
fn hash_human_output_is_one_line_per_full_block() {
    let case = golden_case("sha256-bs64-2full+1");
    let tokens = token_arg(&case);
    let lines = stdout_lines(&kinfctl(&[
        "hash",
        "--block-size",
        "64",
        "--tokens",
        &tokens,
    ]));
    assert_eq!(lines.len(), 2);
    for (line, block) in lines.iter().zip(case["blocks"].as_array().unwrap()) {
        let fields: Vec<&str> = line.split('\t').collect();
        assert_eq!(fields[0], block["index"].to_string());
        assert_eq!(fields[1], block["block_hash_hex"].as_str().unwrap());
        assert_eq!(fields[2], block["event_block_hash_u64"].to_string());
    }
}

#[test]
fn hash_refuses_unseeded_xxhash() {
    let out = kinfctl(&[
        "hash",
        "--block-size",
        "4",
        "--algo",
        "xxhash",
        "--tokens",
        "1,2,3,4",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("PYTHONHASHSEED"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn decode_events_raw_payload_matches_golden_decode() {
    let dir = shared_dir().join("golden/kv_events");
    for name in [
        "ev03_stored_lora",
        "ev05_evictions_then_stored",
        "legacy023_ev01_stored_root_4blocks",
    ] {
        let bin = dir.join(format!("{name}.bin"));
        let lines = stdout_lines(&kinfctl(&[
            "decode-events",
            "--json",
            bin.to_str().unwrap(),
        ]));
        assert_eq!(lines.len(), 1, "{name}: one line per batch");
        let got: Value = serde_json::from_str(&lines[0]).unwrap();
        let golden: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        )
        .unwrap();
        let want = &golden["decoded_msgpack_generic"];
        assert_eq!(got["ts"], want[0], "{name}");
        assert_eq!(got["data_parallel_rank"], want[2], "{name}");
        let (got_events, want_events) = (
            got["events"].as_array().unwrap(),
            want[1].as_array().unwrap(),
        );
        assert_eq!(got_events.len(), want_events.len(), "{name}");
        for (g, w) in got_events.iter().zip(want_events) {
            // Legacy array events have no field names on the wire; compare by vLLM's names.
            let kind = if w.is_array() { &w[0] } else { &w["type"] };
            assert_eq!(&g["type"], kind, "{name}");
            let want_hashes = if w.is_array() {
                &w[1]
            } else {
                &w["block_hashes"]
            };
            assert_eq!(&g["block_hashes"], want_hashes, "{name}");
            if let Some(w) = w.as_object() {
                for (key, value) in w {
                    assert_eq!(&g[key], value, "{name}: field {key}");
                }
            }
        }
    }
}

#[test]
fn decode_events_multipart_capture_has_topic_and_seq() {
    let run = shared_dir().join("golden/real_vllm_0.32/run1");
    let first_line = std::fs::read_to_string(run.join("events.jsonl")).unwrap();
    let want: Value = serde_json::from_str(first_line.lines().next().unwrap()).unwrap();
    let bin = run.join("msg_0000.bin");
    let lines = stdout_lines(&kinfctl(&[
        "decode-events",
        "--json",
        bin.to_str().unwrap(),
    ]));
    let got: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(got["topic"], "kv-events");
    assert_eq!(got["seq"], want["seq"]);
    assert_eq!(got["ts"], want["batch_ts"]);
    let (g, w) = (&got["events"][0], &want["events"][0]);
    for key in [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "medium",
        "group_idx",
        "kv_cache_spec_kind",
    ] {
        assert_eq!(g[key], w[key], "field {key}");
    }

    // Human form: a header naming topic and seq, then one line per event.
    let lines = stdout_lines(&kinfctl(&["decode-events", bin.to_str().unwrap()]));
    assert!(
        lines[0].contains("topic=\"kv-events\"") && lines[0].contains("seq=4"),
        "{}",
        lines[0]
    );
    assert!(
        lines[1]
            .trim_start()
            .starts_with("BlockStored block_hashes=["),
        "{}",
        lines[1]
    );
}

#[test]
fn decode_events_replay_capture_and_end_marker() {
    let dir = shared_dir().join("golden/real_vllm_0.32/replay1");
    let (batch, end) = (dir.join("replay_0000.bin"), dir.join("replay_0004.bin"));
    let lines = stdout_lines(&kinfctl(&[
        "decode-events",
        "--json",
        batch.to_str().unwrap(),
        end.to_str().unwrap(),
    ]));
    assert_eq!(lines.len(), 2);
    let got: Value = serde_json::from_str(&lines[0]).unwrap();
    assert_eq!(got["seq"], 0);
    assert_eq!(got["topic"], "kv-events");
    assert_eq!(got["events"][0]["type"], "BlockStored");
    let end: Value = serde_json::from_str(&lines[1]).unwrap();
    assert_eq!(end["replay_end"], true);
}

#[test]
fn decode_events_rejects_garbage_clearly() {
    let dir = std::env::temp_dir().join(format!("kinfctl-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let garbage = dir.join("garbage.bin");
    std::fs::write(&garbage, b"\x00\x00\x00\x09kv-ev").unwrap();
    let good = shared_dir().join("golden/kv_events/ev06_all_blocks_cleared.bin");
    let out = kinfctl(&[
        "decode-events",
        good.to_str().unwrap(),
        garbage.to_str().unwrap(),
    ]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("garbage.bin: not a KV-event capture"), "{err}");
    assert!(err.contains("1 of 2 files"), "{err}");
    // The good file is still printed.
    assert!(String::from_utf8_lossy(&out.stdout).contains("AllBlocksCleared"));
}

/// `hash --tokenizer` must hash the very ids a real vLLM 0.32 returned from `/tokenize` for the
/// same completions prompt or chat request (recorded in `real_vllm_0.32/run1/requests.json`).
#[test]
fn hash_with_tokenizer_matches_real_vllm_tokenize() {
    let golden = shared_dir().join("golden/real_vllm_0.32");
    let tokenizer = golden.join("tiny-llama-tokenizer");
    let tokenizer = tokenizer.to_str().unwrap();
    let text = std::fs::read_to_string(golden.join("run1/requests.json")).unwrap();
    let requests: Value = serde_json::from_str(&text).unwrap();
    let steps = requests["steps"].as_array().unwrap();
    assert!(steps.len() >= 4, "expected completions and chat steps");
    let (mut prompts, mut chats) = (0, 0);
    for step in steps {
        let name = step["name"].as_str().unwrap();
        let ids: Vec<String> = step["tokenize"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap().to_string())
            .collect();
        let expected = stdout_lines(&kinfctl(&[
            "hash",
            "--block-size",
            "32",
            "--json",
            "--tokens",
            &ids.join(","),
        ]));
        assert!(
            !expected.is_empty(),
            "{name}: no full block in the golden ids"
        );
        let request = &step["tokenize_request"];
        let got = if let Some(prompt) = request["prompt"].as_str() {
            prompts += 1;
            kinfctl(&[
                "hash",
                "--block-size",
                "32",
                "--json",
                "--tokenizer",
                tokenizer,
                "--prompt",
                prompt,
            ])
        } else {
            chats += 1;
            let body = request.to_string();
            kinfctl(&[
                "hash",
                "--block-size",
                "32",
                "--json",
                "--tokenizer",
                tokenizer,
                "--messages",
                &body,
            ])
        };
        assert_eq!(stdout_lines(&got), expected, "{name}");
    }
    assert!(
        prompts > 0 && chats > 0,
        "both request kinds must be covered"
    );
}

#[test]
fn hash_text_needs_a_tokenizer() {
    let out = kinfctl(&[
        "hash",
        "--block-size",
        "4",
        "--tokens",
        "1,2,3,4",
        "--prompt",
        "x",
    ]);
    assert!(!out.status.success());
    let out = kinfctl(&["hash", "--block-size", "4"]);
    assert!(!out.status.success());
}
