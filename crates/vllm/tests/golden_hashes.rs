//! Block hashing against vectors produced by vLLM's own code: every case of
//! `shared/golden/vllm_block_hashes.json` block by block (serialised input, digest, event value,
//! extra keys, NONE_HASH), and the hashes a real vLLM 0.32 published in `real_vllm_0.32/`.
//! Failures are collected and reported together, each naming its case id and block index.

// Helpers below run only inside tests, where a panic is the failure report.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::path::Path;

use kinference_testkit::shared_dir;
use kinference_vllm::hashing::{
    BlockDigest, BlockHasher, ExtraKeysFormat, HashAlgo, Lora, MmItem, RequestExtras,
};
use kinference_vllm::ExtraKeyItem;
use serde_json::Value;

fn load_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON in {}: {e}", path.display()))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn str_field<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

fn item_json(item: &ExtraKeyItem) -> Value {
    match item {
        ExtraKeyItem::Str(s) => Value::from(s.as_str()),
        ExtraKeyItem::Int(i) => Value::from(*i),
        ExtraKeyItem::UInt(u) => Value::from(*u),
        ExtraKeyItem::Array(items) => Value::Array(items.iter().map(item_json).collect()),
        ExtraKeyItem::Bytes(b) => Value::from(hex(b)),
        ExtraKeyItem::Nil => Value::Null,
        ExtraKeyItem::Bool(b) => Value::from(*b),
        ExtraKeyItem::Float(f) => Value::from(*f),
    }
}

fn keys_json(keys: Option<Vec<ExtraKeyItem>>) -> Value {
    keys.map_or(Value::Null, |k| {
        Value::Array(k.iter().map(item_json).collect())
    })
}

fn extras_of(case: &Value) -> RequestExtras {
    let lora = case.get("lora").filter(|l| !l.is_null()).map(|l| Lora {
        name: str_field(l, "lora_name").unwrap().to_string(),
        path: str_field(l, "lora_path").unwrap().to_string(),
    });
    let mm = case["mm_features"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| MmItem {
            identifier: str_field(m, "identifier").unwrap().to_string(),
            offset: m["offset"].as_u64().unwrap() as usize,
            length: m["length"].as_u64().unwrap() as usize,
        })
        .collect();
    RequestExtras {
        lora,
        mm,
        cache_salt: str_field(case, "cache_salt").map(str::to_string),
        prompt_embeds_digests: Vec::new(),
    }
}

fn hasher_of(case: &Value) -> BlockHasher {
    let algo: HashAlgo = str_field(case, "hash_algo").unwrap().parse().unwrap();
    let format = if str_field(case, "vllm_version") == Some("0.34.0") {
        ExtraKeysFormat::Tagged
    } else {
        ExtraKeysFormat::Untagged
    };
    let block_size = case["block_size"].as_u64().unwrap() as usize;
    BlockHasher::new(algo, block_size, str_field(case, "PYTHONHASHSEED"), format).unwrap()
}

/// Collects mismatches, each naming its case and block.
struct Checker<'a> {
    id: &'a str,
    failures: &'a mut Vec<String>,
}

impl Checker<'_> {
    fn eq(&mut self, block: Option<usize>, what: &str, got: impl ToString, want: impl ToString) {
        let (got, want) = (got.to_string(), want.to_string());
        if got != want {
            let at = block.map_or(String::new(), |b| format!(" block {b}"));
            self.failures
                .push(format!("{}{at}: {what}: got {got}, want {want}", self.id));
        }
    }
}

fn tokens_of(case: &Value) -> Vec<u32> {
    case["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

/// Checks one case: NONE_HASH, then every block, then the whole-sequence event values.
fn check_case(case: &Value, failures: &mut Vec<String>) {
    let mut c = Checker {
        id: str_field(case, "id").unwrap(),
        failures,
    };
    let h = hasher_of(case);
    let extras = extras_of(case);
    let tokens = tokens_of(case);
    let seed_hex = str_field(case, "none_hash_seed_serialized_hex").unwrap();
    c.eq(
        None,
        "NONE_HASH input",
        hex(&h.none_hash_input_bytes()),
        seed_hex,
    );
    let none_hex = str_field(case, "none_hash_hex").unwrap();
    c.eq(None, "NONE_HASH", h.none_hash().to_hex(), none_hex);

    let blocks = case["blocks"].as_array().unwrap();
    let whole = h.hash_blocks(&tokens, &extras);
    let num_full = case["num_full_blocks"].as_u64().unwrap();
    c.eq(None, "full blocks hashed", whole.len(), num_full);
    c.eq(None, "golden blocks", blocks.len(), num_full);
    let mut parent: Option<BlockDigest> = None;
    for (i, block) in blocks.iter().enumerate() {
        let digest = check_block(&mut c, &h, &extras, &tokens, parent.as_ref(), i, block);
        let from_whole = whole.get(i).map(BlockDigest::to_hex);
        c.eq(
            Some(i),
            "hash_blocks",
            format!("{from_whole:?}"),
            format!("{:?}", Some(digest.to_hex())),
        );
        parent = Some(digest);
    }
    let events: Vec<u64> = whole.iter().map(|d| d.event_hash().0).collect();
    let want_events: Vec<u64> = case["event_block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    c.eq(
        None,
        "event_block_hashes",
        format!("{events:?}"),
        format!("{want_events:?}"),
    );
}

/// Checks block `i` given its parent; returns its digest so the chain continues.
fn check_block(
    c: &mut Checker<'_>,
    h: &BlockHasher,
    extras: &RequestExtras,
    tokens: &[u32],
    parent: Option<&BlockDigest>,
    i: usize,
    block: &Value,
) -> BlockDigest {
    let range = block["token_range"].as_array().unwrap();
    let (start, end) = (
        range[0].as_u64().unwrap() as usize,
        range[1].as_u64().unwrap() as usize,
    );
    let block_tokens = &tokens[start..end];
    let got_parent = parent.unwrap_or(h.none_hash()).to_hex();
    c.eq(
        Some(i),
        "parent",
        got_parent,
        str_field(block, "parent_hash_hex").unwrap(),
    );
    c.eq(
        Some(i),
        "parent is NONE_HASH",
        parent.is_none(),
        &block["parent_is_none_hash"],
    );
    let input = h.hash_input_bytes(parent, block_tokens, i, extras).unwrap();
    let want_input = str_field(block, "serialized_hash_input_hex").unwrap();
    c.eq(Some(i), "serialised input", hex(&input), want_input);
    let digest = h.hash_block(parent, block_tokens, i, extras).unwrap();
    c.eq(
        Some(i),
        "digest",
        digest.to_hex(),
        str_field(block, "block_hash_hex").unwrap(),
    );
    c.eq(
        Some(i),
        "event value",
        digest.event_hash().0,
        &block["event_block_hash_u64"],
    );
    let hash_keys = keys_json(h.hash_extra_keys(i, extras));
    c.eq(
        Some(i),
        "hash extra keys",
        hash_keys,
        &block["hash_extra_keys"],
    );
    let event_keys = keys_json(h.event_extra_keys(i, extras));
    c.eq(
        Some(i),
        "event extra keys",
        event_keys,
        &block["event_extra_keys"],
    );
    digest
}

#[test]
fn every_golden_case_matches_block_by_block() {
    let golden = load_json(&shared_dir().join("golden/vllm_block_hashes.json"));
    let cases = golden["cases"].as_array().expect("cases array");
    assert_eq!(cases.len() as u64, golden["num_cases"].as_u64().unwrap());
    assert_eq!(cases.len(), 48, "the golden file has 48 cases");
    let mut failures = Vec::new();
    let mut blocks = 0;
    for case in cases {
        check_case(case, &mut failures);
        blocks += case["blocks"].as_array().unwrap().len();
    }
    assert!(blocks > 100, "only {blocks} blocks checked");
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn every_algorithm_and_both_formats_are_covered() {
    let golden = load_json(&shared_dir().join("golden/vllm_block_hashes.json"));
    let cases = golden["cases"].as_array().unwrap();
    for algo in HashAlgo::ALL {
        assert!(cases
            .iter()
            .any(|c| str_field(c, "hash_algo") == Some(algo.as_str())));
    }
    let mm2 = cases
        .iter()
        .find(|c| str_field(c, "id") == Some("sha256-bs16-mm2-in-one-block-2full+0"))
        .expect("mm2 case");
    // The second "mm" tag of block 0 is the memo reference BINGET 2.
    let input = str_field(&mm2["blocks"][0], "serialized_hash_input_hex").unwrap();
    assert!(input.contains("68028c05696d672d62"));
}

/// Hashes a real vLLM 0.32 published (block size 32, no `PYTHONHASHSEED`), recomputed from each
/// `BlockStored`'s token ids, following parents through the digests already computed.
#[test]
fn real_vllm_032_published_hashes_reproduce() {
    for (dir, algo) in [
        ("run1", HashAlgo::Sha256),
        ("run3_cbor", HashAlgo::Sha256Cbor),
    ] {
        let path = shared_dir()
            .join("golden/real_vllm_0.32")
            .join(dir)
            .join("events.jsonl");
        let text = std::fs::read_to_string(&path).unwrap();
        let mut known: HashMap<u64, BlockDigest> = HashMap::new();
        let (mut verified, mut unchained) = (0, 0);
        for line in text.lines() {
            let msg: Value = serde_json::from_str(line).unwrap();
            for ev in msg["events"].as_array().unwrap() {
                if str_field(ev, "type") != Some("BlockStored") {
                    continue;
                }
                let block_size = ev["block_size"].as_u64().unwrap() as usize;
                let h = BlockHasher::new(algo, block_size, None, ExtraKeysFormat::Tagged).unwrap();
                let mut parent = match ev["parent_block_hash"].as_u64() {
                    None => None,
                    Some(p) => match known.get(&p) {
                        Some(d) => Some(*d),
                        None => {
                            unchained += 1;
                            continue;
                        }
                    },
                };
                let tokens: Vec<u32> = ev["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
                let want = ev["block_hashes"].as_array().unwrap();
                assert_eq!(
                    tokens.len(),
                    want.len() * block_size,
                    "{dir} seq {}",
                    msg["seq"]
                );
                for (i, block) in tokens.chunks_exact(block_size).enumerate() {
                    let d = h
                        .hash_block(parent.as_ref(), block, 0, &RequestExtras::default())
                        .unwrap();
                    assert_eq!(
                        Some(d.event_hash().0),
                        want[i].as_u64(),
                        "{dir} seq {} block {i}",
                        msg["seq"]
                    );
                    known.insert(d.event_hash().0, d);
                    parent = Some(d);
                    verified += 1;
                }
            }
        }
        assert!(
            verified >= 10,
            "{dir}: only {verified} hashes verified ({unchained} unchained)"
        );
    }
}
