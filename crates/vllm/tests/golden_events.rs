//! Golden tests of the KV-event codec and framing against payloads written by vLLM itself.
//!
//! Expected values are derived from the goldens' own JSON (the untyped msgpack decode, the
//! typed decode and, for `kv_events`, the Python `repr` of the typed batch), never copied by
//! hand; re-encoding must reproduce every map-layout payload byte for byte.

// Helpers outside `#[test]` functions unwrap too: a failure here is a test failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use kinference_testkit::shared_dir;
use kinference_vllm::events::codec::{decode_batch_with_stats, DecodeStats};
use kinference_vllm::events::frames::{
    encode_length_prefixed, parse_length_prefixed, parse_live, parse_replay, ReplayFrame,
};
use kinference_vllm::{
    decode_batch, encode_batch, BlockRemoved, BlockStored, ExtraKeyItem, HashValue, KvEvent,
    KvEventBatch, MapHeader,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;

// ---------------------------------------------------------------------------------------------
// Locating and reading the goldens
// ---------------------------------------------------------------------------------------------

fn kv_events_dir() -> PathBuf {
    shared_dir().join("golden/kv_events")
}

fn real_dir() -> PathBuf {
    shared_dir().join("golden/real_vllm_0.32")
}

fn read(p: &Path) -> Vec<u8> {
    fs::read(p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&read(p)).unwrap_or_else(|e| panic!("parse {}: {e}", p.display()))
}

fn read_jsonl(p: &Path) -> Vec<Value> {
    String::from_utf8(read(p))
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

fn files_with(dir: &Path, pred: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(&pred))
        .collect();
    out.sort();
    out
}

fn golden_jsons() -> Vec<PathBuf> {
    let files = files_with(&kv_events_dir(), |n| n.ends_with(".json"));
    assert!(
        files.len() >= 16,
        "expected the 16 kv_events goldens, found {}",
        files.len()
    );
    files
}

/// Every real-capture directory that holds frames (the tokenizer directory holds none).
fn real_capture_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(real_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .filter(|p| !files_with(p, |n| n.ends_with(".bin")).is_empty())
        .collect();
    dirs.sort();
    assert!(
        dirs.len() >= 4,
        "expected run1, run3_cbor, replay1, replay_fresh: {dirs:?}"
    );
    dirs
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex length");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Expected values from the JSON decodes
// ---------------------------------------------------------------------------------------------

const STORED_ORDER: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
const REMOVED_ORDER: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

fn j_u64(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

fn j_u32(v: &Value) -> u32 {
    u32::try_from(j_u64(v)).unwrap()
}

fn j_str(v: &Value) -> String {
    v.as_str()
        .unwrap_or_else(|| panic!("not a string: {v}"))
        .to_owned()
}

fn j_opt<T>(v: &Value, f: impl Fn(&Value) -> T) -> Option<T> {
    if v.is_null() {
        None
    } else {
        Some(f(v))
    }
}

fn j_arr(v: &Value) -> &Vec<Value> {
    v.as_array().unwrap_or_else(|| panic!("not an array: {v}"))
}

/// A hash as the goldens write it: an integer, or `{"bytes_hex": ...}`.
fn j_hash(v: &Value) -> HashValue {
    match v.get("bytes_hex") {
        Some(h) => HashValue::Bytes(hex(h.as_str().unwrap())),
        None => HashValue::Int(j_u64(v)),
    }
}

fn j_extra_item(v: &Value) -> ExtraKeyItem {
    match v {
        Value::Null => ExtraKeyItem::Nil,
        Value::Bool(b) => ExtraKeyItem::Bool(*b),
        Value::String(s) => ExtraKeyItem::Str(s.clone()),
        Value::Array(a) => ExtraKeyItem::Array(a.iter().map(j_extra_item).collect()),
        Value::Number(n) if n.is_i64() => ExtraKeyItem::Int(n.as_i64().unwrap()),
        Value::Number(n) if n.is_u64() => ExtraKeyItem::UInt(n.as_u64().unwrap()),
        other => panic!("unexpected extra key item {other}"),
    }
}

fn set_stored_field(s: &mut BlockStored, key: &str, v: &Value) {
    match key {
        "block_hashes" => s.block_hashes = j_arr(v).iter().map(j_hash).collect(),
        "parent_block_hash" => s.parent_block_hash = j_opt(v, j_hash),
        "token_ids" => s.token_ids = j_arr(v).iter().map(j_u32).collect(),
        "block_size" => s.block_size = j_u32(v),
        "lora_id" => s.lora_id = j_opt(v, |v| v.as_i64().unwrap()),
        "medium" => s.medium = j_opt(v, |v| j_str(v).into()),
        "lora_name" => s.lora_name = j_opt(v, j_str),
        "extra_keys" => {
            s.extra_keys = j_opt(v, |v| {
                j_arr(v)
                    .iter()
                    .map(|e| j_opt(e, |t| j_arr(t).iter().map(j_extra_item).collect()))
                    .collect()
            })
        }
        "group_idx" => s.group_idx = j_opt(v, j_u32),
        "kv_cache_spec_kind" => s.kv_cache_spec_kind = j_opt(v, |v| j_str(v).into()),
        "kv_cache_spec_sliding_window" => s.kv_cache_spec_sliding_window = j_opt(v, j_u32),
        "locality" => s.locality = j_opt(v, j_str),
        "ownership" => s.ownership = j_opt(v, j_str),
        "session_id" => s.session_id = j_opt(v, j_str),
        "lookahead_token_ids" => {
            s.lookahead_token_ids = j_opt(v, |v| {
                j_arr(v)
                    .iter()
                    .map(|l| j_arr(l).iter().map(j_u32).collect())
                    .collect()
            })
        }
        other => panic!("golden has a BlockStored field this test does not know: {other}"),
    }
}

fn set_removed_field(s: &mut BlockRemoved, key: &str, v: &Value) {
    match key {
        "block_hashes" => s.block_hashes = j_arr(v).iter().map(j_hash).collect(),
        "medium" => s.medium = j_opt(v, |v| j_str(v).into()),
        "group_idx" => s.group_idx = j_opt(v, j_u32),
        "locality" => s.locality = j_opt(v, j_str),
        "ownership" => s.ownership = j_opt(v, j_str),
        other => panic!("golden has a BlockRemoved field this test does not know: {other}"),
    }
}

/// The event a JSON decode describes: a map (`{"type": ..}`, also the typed form with every
/// field) or a positional array (≤ 0.23).
fn expected_event(v: &Value, header: MapHeader) -> KvEvent {
    let (tag, fields): (String, Vec<(&str, &Value)>) = match v {
        Value::Object(m) => (
            j_str(&m["type"]),
            m.iter()
                .filter(|(k, _)| *k != "type")
                .map(|(k, v)| (k.as_str(), v))
                .collect(),
        ),
        Value::Array(a) => {
            let tag = j_str(&a[0]);
            let order: &[&str] = match tag.as_str() {
                "BlockStored" => &STORED_ORDER,
                "BlockRemoved" => &REMOVED_ORDER,
                _ => &[],
            };
            assert!(
                a.len() - 1 <= order.len(),
                "longer legacy array than known: {v}"
            );
            (tag, order.iter().copied().zip(a[1..].iter()).collect())
        }
        other => panic!("event is neither map nor array: {other}"),
    };
    match tag.as_str() {
        "BlockStored" => {
            let mut s = BlockStored {
                map_header: header,
                ..Default::default()
            };
            for (k, v) in fields {
                set_stored_field(&mut s, k, v);
            }
            KvEvent::BlockStored(s)
        }
        "BlockRemoved" => {
            let mut s = BlockRemoved::default();
            for (k, v) in fields {
                set_removed_field(&mut s, k, v);
            }
            KvEvent::BlockRemoved(s)
        }
        "AllBlocksCleared" => {
            assert!(fields.is_empty());
            KvEvent::AllBlocksCleared
        }
        other => panic!("unknown tag in golden: {other}"),
    }
}

/// The batch an untyped decode `[ts, events, dp_rank]` describes.
fn expected_from_generic(v: &Value, header: MapHeader) -> KvEventBatch {
    let a = j_arr(v);
    KvEventBatch {
        ts: a[0].as_f64().unwrap(),
        events: j_arr(&a[1])
            .iter()
            .map(|e| expected_event(e, header))
            .collect(),
        data_parallel_rank: a.get(2).and_then(|d| j_opt(d, |d| d.as_i64().unwrap())),
    }
}

/// The map keys vLLM writes for an event: the tag, the fields without a default, and each
/// None-default field that is set.
fn keys_written(ev: &KvEvent) -> Vec<&'static str> {
    let mut keys = vec!["type"];
    match ev {
        KvEvent::BlockStored(s) => {
            keys.extend(&STORED_ORDER[..7]);
            let optional = [
                s.extra_keys.is_some(),
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.kv_cache_spec_sliding_window.is_some(),
                s.locality.is_some(),
                s.ownership.is_some(),
                s.session_id.is_some(),
                s.lookahead_token_ids.is_some(),
            ];
            keys.extend(
                STORED_ORDER[7..]
                    .iter()
                    .zip(optional)
                    .filter(|(_, set)| *set)
                    .map(|(k, _)| *k),
            );
        }
        KvEvent::BlockRemoved(s) => {
            keys.extend(&REMOVED_ORDER[..2]);
            let optional = [
                s.group_idx.is_some(),
                s.locality.is_some(),
                s.ownership.is_some(),
            ];
            keys.extend(
                REMOVED_ORDER[2..]
                    .iter()
                    .zip(optional)
                    .filter(|(_, set)| *set)
                    .map(|(k, _)| *k),
            );
        }
        KvEvent::AllBlocksCleared => {}
    }
    keys
}

/// For map-layout goldens: the keys present in the untyped decode are exactly those the decoded
/// value says are present (so "absent" and "None" line up with the wire).
fn assert_same_keys(generic_events: &Value, decoded: &KvEventBatch, what: &str) {
    for (g, ev) in j_arr(generic_events).iter().zip(&decoded.events) {
        let Value::Object(m) = g else { continue };
        let present: BTreeSet<&str> = m.keys().map(String::as_str).collect();
        let written: BTreeSet<&str> = keys_written(ev).into_iter().collect();
        assert_eq!(present, written, "{what}: keys on the wire");
    }
}

// ---------------------------------------------------------------------------------------------
// The typed decode as Python prints it
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
enum Py {
    None,
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Py>),
    Tuple(Vec<Py>),
    Call(String, Vec<(String, Py)>),
}

/// A parser for the subset of Python `repr` the goldens use.
struct PyParser<'a> {
    s: &'a [u8],
    i: usize,
}

impl PyParser<'_> {
    fn parse(text: &str) -> Py {
        let mut p = PyParser {
            s: text.as_bytes(),
            i: 0,
        };
        let v = p.value();
        p.ws();
        assert_eq!(p.i, p.s.len(), "trailing text in repr");
        v
    }

    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }

    fn peek(&mut self) -> u8 {
        self.ws();
        self.s[self.i]
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.peek() == c {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) {
        assert!(self.eat(c), "expected {:?} at {}", c as char, self.i);
    }

    fn seq(&mut self, close: u8) -> (Vec<Py>, bool) {
        let mut items = Vec::new();
        let mut trailing_comma = false;
        while !self.eat(close) {
            items.push(self.value());
            trailing_comma = self.eat(b',');
        }
        (items, trailing_comma)
    }

    fn value(&mut self) -> Py {
        match self.peek() {
            b'[' => {
                self.i += 1;
                Py::List(self.seq(b']').0)
            }
            b'(' => {
                self.i += 1;
                Py::Tuple(self.seq(b')').0)
            }
            b'\'' | b'"' => Py::Str(String::from_utf8(self.quoted()).unwrap()),
            b'b' if matches!(self.s.get(self.i + 1), Some(b'\'' | b'"')) => {
                self.i += 1;
                Py::Bytes(self.quoted())
            }
            c if c == b'-' || c.is_ascii_digit() => self.number(),
            _ => self.name_or_call(),
        }
    }

    fn number(&mut self) -> Py {
        let start = self.i;
        while self.i < self.s.len()
            && matches!(
                self.s[self.i],
                b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
            )
        {
            self.i += 1;
        }
        let t = std::str::from_utf8(&self.s[start..self.i]).unwrap();
        if t.contains(['.', 'e', 'E']) {
            Py::Float(t.parse().unwrap())
        } else {
            Py::Int(t.parse().unwrap())
        }
    }

    fn quoted(&mut self) -> Vec<u8> {
        let q = self.s[self.i];
        self.i += 1;
        let mut out = Vec::new();
        loop {
            let c = self.s[self.i];
            self.i += 1;
            match c {
                _ if c == q => return out,
                b'\\' => {
                    let e = self.s[self.i];
                    self.i += 1;
                    match e {
                        b'x' => {
                            let h = std::str::from_utf8(&self.s[self.i..self.i + 2]).unwrap();
                            out.push(u8::from_str_radix(h, 16).unwrap());
                            self.i += 2;
                        }
                        b'n' => out.push(b'\n'),
                        b'r' => out.push(b'\r'),
                        b't' => out.push(b'\t'),
                        b'\\' | b'\'' | b'"' => out.push(e),
                        other => panic!("unsupported escape \\{}", other as char),
                    }
                }
                _ => out.push(c),
            }
        }
    }

    fn name_or_call(&mut self) -> Py {
        let start = self.i;
        while self.i < self.s.len()
            && (self.s[self.i].is_ascii_alphanumeric() || self.s[self.i] == b'_')
        {
            self.i += 1;
        }
        let name = std::str::from_utf8(&self.s[start..self.i])
            .unwrap()
            .to_owned();
        assert!(
            !name.is_empty(),
            "unexpected {:?} at {}",
            self.s[self.i] as char,
            self.i
        );
        if name == "None" {
            return Py::None;
        }
        self.expect(b'(');
        let mut kwargs = Vec::new();
        while !self.eat(b')') {
            let k_start = self.i;
            while self.s[self.i] != b'=' {
                self.i += 1;
            }
            let key = std::str::from_utf8(&self.s[k_start..self.i])
                .unwrap()
                .trim()
                .to_owned();
            self.i += 1;
            kwargs.push((key, self.value()));
            self.eat(b',');
        }
        Py::Call(name, kwargs)
    }
}

fn py_hash(h: &HashValue) -> Py {
    match h {
        HashValue::Int(v) => Py::Int(i128::from(*v)),
        HashValue::Bytes(b) => Py::Bytes(b.clone()),
    }
}

fn py_opt<T>(v: &Option<T>, f: impl Fn(&T) -> Py) -> Py {
    v.as_ref().map_or(Py::None, f)
}

fn py_u32s(v: &[u32]) -> Py {
    Py::List(v.iter().map(|t| Py::Int(i128::from(*t))).collect())
}

fn py_str(s: &str) -> Py {
    Py::Str(s.to_owned())
}

fn py_item(i: &ExtraKeyItem) -> Py {
    match i {
        ExtraKeyItem::Nil => Py::None,
        ExtraKeyItem::Int(v) => Py::Int(i128::from(*v)),
        ExtraKeyItem::UInt(v) => Py::Int(i128::from(*v)),
        ExtraKeyItem::Str(s) => py_str(s),
        ExtraKeyItem::Bytes(b) => Py::Bytes(b.clone()),
        ExtraKeyItem::Float(f) => Py::Float(*f),
        ExtraKeyItem::Array(a) => Py::Tuple(a.iter().map(py_item).collect()),
        ExtraKeyItem::Bool(b) => panic!("no bool extra keys in goldens: {b}"),
    }
}

/// The value of one typed field of a decoded event, as Python would print it.
fn py_field(ev: &KvEvent, name: &str) -> Py {
    match ev {
        KvEvent::BlockStored(s) => match name {
            "block_hashes" => Py::List(s.block_hashes.iter().map(py_hash).collect()),
            "parent_block_hash" => py_opt(&s.parent_block_hash, py_hash),
            "token_ids" => py_u32s(&s.token_ids),
            "block_size" => Py::Int(i128::from(s.block_size)),
            "lora_id" => py_opt(&s.lora_id, |v| Py::Int(i128::from(*v))),
            "medium" => py_opt(&s.medium, |v| py_str(v)),
            "lora_name" => py_opt(&s.lora_name, |v| py_str(v)),
            "extra_keys" => py_opt(&s.extra_keys, |keys| {
                Py::List(
                    keys.iter()
                        .map(|k| py_opt(k, |t| Py::Tuple(t.iter().map(py_item).collect())))
                        .collect(),
                )
            }),
            "group_idx" => py_opt(&s.group_idx, |v| Py::Int(i128::from(*v))),
            "kv_cache_spec_kind" => py_opt(&s.kv_cache_spec_kind, |v| py_str(v)),
            "kv_cache_spec_sliding_window" => {
                py_opt(&s.kv_cache_spec_sliding_window, |v| Py::Int(i128::from(*v)))
            }
            "locality" => py_opt(&s.locality, |v| py_str(v)),
            "ownership" => py_opt(&s.ownership, |v| py_str(v)),
            "session_id" => py_opt(&s.session_id, |v| py_str(v)),
            "lookahead_token_ids" => py_opt(&s.lookahead_token_ids, |l| {
                Py::List(l.iter().map(|t| py_u32s(t)).collect())
            }),
            other => panic!("typed repr has an unknown BlockStored field {other}"),
        },
        KvEvent::BlockRemoved(s) => match name {
            "block_hashes" => Py::List(s.block_hashes.iter().map(py_hash).collect()),
            "medium" => py_opt(&s.medium, |v| py_str(v)),
            "group_idx" => py_opt(&s.group_idx, |v| Py::Int(i128::from(*v))),
            "locality" => py_opt(&s.locality, |v| py_str(v)),
            "ownership" => py_opt(&s.ownership, |v| py_str(v)),
            other => panic!("typed repr has an unknown BlockRemoved field {other}"),
        },
        KvEvent::AllBlocksCleared => panic!("AllBlocksCleared has no fields, repr names {name}"),
    }
}

fn event_name(ev: &KvEvent) -> &'static str {
    match ev {
        KvEvent::BlockStored(_) => "BlockStored",
        KvEvent::BlockRemoved(_) => "BlockRemoved",
        KvEvent::AllBlocksCleared => "AllBlocksCleared",
    }
}

/// Compares a decoded batch with the typed `repr`, field by field (every field the repr names,
/// including the ones that are None).
fn assert_matches_repr(b: &KvEventBatch, repr: &str, what: &str) {
    let Py::Call(name, kwargs) = PyParser::parse(repr) else {
        panic!("{what}: repr is not a call")
    };
    assert_eq!(name, "KVEventBatch");
    let mut fields_checked = 0;
    for (k, v) in &kwargs {
        match (k.as_str(), v) {
            ("ts", Py::Float(ts)) => assert_eq!(ts.to_bits(), b.ts.to_bits(), "{what}: ts"),
            ("data_parallel_rank", d) => {
                assert_eq!(
                    *d,
                    py_opt(&b.data_parallel_rank, |r| Py::Int(i128::from(*r))),
                    "{what}: dp"
                )
            }
            ("events", Py::List(events)) => {
                assert_eq!(events.len(), b.events.len(), "{what}: event count");
                for (i, (pe, ev)) in events.iter().zip(&b.events).enumerate() {
                    let Py::Call(ename, efields) = pe else {
                        panic!("{what}: event {i} not a call")
                    };
                    assert_eq!(ename, event_name(ev), "{what}: event {i} type");
                    for (fname, fval) in efields {
                        assert_eq!(
                            &py_field(ev, fname),
                            fval,
                            "{what}: event {i} field {fname}"
                        );
                        fields_checked += 1;
                    }
                }
            }
            other => panic!("{what}: unexpected batch field {other:?}"),
        }
    }
    assert!(fields_checked > 0 || b.events.iter().all(|e| *e == KvEvent::AllBlocksCleared));
}

// ---------------------------------------------------------------------------------------------
// kv_events goldens (vLLM 0.34 and 0.23)
// ---------------------------------------------------------------------------------------------

/// The frames a golden describes parse back to its topic, seq and payload.
fn check_golden_frames(g: &Value, payload: &[u8], what: &str) {
    let frames = &g["zmq_frames"];
    assert_eq!(j_u64(&frames["count"]), 3);
    let topic = hex(frames["frame0_topic_hex"].as_str().unwrap());
    let seq = hex(frames["frame1_seq_hex"].as_str().unwrap());
    let parts = [topic.as_slice(), seq.as_slice(), payload];
    let msg = parse_live(&parts).unwrap();
    assert_eq!(
        msg.topic,
        frames["frame0_topic_utf8"].as_str().unwrap(),
        "{what}: topic"
    );
    assert_eq!(msg.seq, j_u64(&frames["frame1_seq"]), "{what}: seq");
    assert_eq!(
        msg.payload.len() as u64,
        j_u64(&frames["frame2_payload_len"])
    );
}

fn check_kv_golden(path: &Path) {
    let what = path.file_name().unwrap().to_string_lossy().into_owned();
    let g = read_json(path);
    let bin = read(&kv_events_dir().join(j_str(&g["file"])));
    assert_eq!(
        bin,
        hex(g["payload_hex"].as_str().unwrap()),
        "{what}: .bin vs payload_hex"
    );
    check_golden_frames(&g, &bin, &what);

    let legacy = !j_str(&g["vllm_version"]).starts_with("0.34");
    let (decoded, stats) = decode_batch_with_stats(&bin).unwrap();
    let expected_stats = DecodeStats {
        array_events: if legacy { decoded.events.len() } else { 0 },
        ..DecodeStats::default()
    };
    assert_eq!(stats, expected_stats, "{what}: stats");

    let generic = &g["decoded_msgpack_generic"];
    let expected = expected_from_generic(generic, MapHeader::Map16);
    assert_eq!(decoded, expected, "{what}: generic");
    assert_matches_repr(&decoded, g["decoded_typed_repr"].as_str().unwrap(), &what);
    if legacy {
        // Same content as the 0.34 golden of the same name: encoding the legacy decode must
        // give that payload.
        let modern = what
            .trim_start_matches("legacy023_")
            .replace(".json", ".bin");
        let modern = read(&kv_events_dir().join(modern));
        assert_eq!(
            encode_batch(&decoded),
            modern,
            "{what}: legacy → 0.34 bytes"
        );
    } else {
        assert_same_keys(&generic[1], &decoded, &what);
        assert_eq!(encode_batch(&decoded), bin, "{what}: re-encoding");
    }
}

#[test]
fn kv_event_goldens_decode_to_their_json_and_reencode_exactly() {
    let goldens = golden_jsons();
    for path in &goldens {
        check_kv_golden(path);
    }
    let legacy = goldens
        .iter()
        .filter(|p| p.to_string_lossy().contains("legacy"))
        .count();
    assert_eq!(
        (goldens.len(), legacy),
        (16, 3),
        "golden set changed: review this test"
    );
}

// ---------------------------------------------------------------------------------------------
// Real vLLM 0.32 captures
// ---------------------------------------------------------------------------------------------

/// A 0.32 typed event (every field, `type` included) as the expected value.
fn expected_typed_events(events: &Value) -> Vec<KvEvent> {
    j_arr(events)
        .iter()
        .map(|e| expected_event(e, MapHeader::FixMap))
        .collect()
}

fn check_real_payload(
    payload: &[u8],
    ts: &Value,
    dp: &Value,
    typed: &Value,
    what: &str,
) -> KvEventBatch {
    let (decoded, stats) =
        decode_batch_with_stats(payload).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(stats, DecodeStats::default(), "{what}: stats");
    assert_eq!(
        decoded.ts.to_bits(),
        ts.as_f64().unwrap().to_bits(),
        "{what}: ts"
    );
    assert_eq!(decoded.data_parallel_rank, dp.as_i64(), "{what}: dp rank");
    assert_eq!(
        decoded.events,
        expected_typed_events(typed),
        "{what}: typed events"
    );
    assert_eq!(encode_batch(&decoded), payload, "{what}: re-encoding");
    decoded
}

/// One live message of a capture directory against its `events.jsonl` line.
fn check_live_capture(dir: &Path, line: &Value) {
    let n = j_u64(&line["msg"]);
    let what = format!("{}/msg_{n:04}", dir.file_name().unwrap().to_string_lossy());
    let stem = dir.join(format!("msg_{n:04}"));
    let capture = read(&stem.with_extension("bin"));
    let frames = parse_length_prefixed(&capture).unwrap();
    let parts: Vec<Vec<u8>> = (0..3)
        .map(|i| read(&stem.with_extension(format!("f{i}.bin"))))
        .collect();
    assert_eq!(
        frames,
        parts.iter().map(Vec::as_slice).collect::<Vec<_>>(),
        "{what}: frames"
    );
    assert_eq!(
        encode_length_prefixed(&frames),
        capture,
        "{what}: capture re-framing"
    );
    let lens: Vec<u64> = j_arr(&line["frame_lens"]).iter().map(j_u64).collect();
    assert_eq!(
        lens,
        frames.iter().map(|f| f.len() as u64).collect::<Vec<_>>()
    );

    let msg = parse_live(&frames).unwrap();
    assert_eq!(msg.topic, line["topic"].as_str().unwrap(), "{what}: topic");
    assert_eq!(msg.seq, j_u64(&line["seq"]), "{what}: seq");
    let (ts, dp) = (&line["batch_ts"], &line["data_parallel_rank"]);
    let decoded = check_real_payload(msg.payload, ts, dp, &line["events"], &what);
    let raw = &line["raw_untyped"];
    let expected = expected_from_generic(raw, MapHeader::FixMap);
    assert_eq!(decoded, expected, "{what}: untyped");
    assert_same_keys(&raw[1], &decoded, &what);
}

#[test]
fn real_vllm_032_live_captures_decode_and_reencode_exactly() {
    let mut messages = 0;
    for dir in real_capture_dirs() {
        let msg_files = files_with(&dir, |n| {
            n.starts_with("msg_") && n.ends_with(".bin") && !n.contains(".f")
        });
        if msg_files.is_empty() {
            continue;
        }
        let lines = read_jsonl(&dir.join("events.jsonl"));
        assert_eq!(
            lines.len(),
            msg_files.len(),
            "{}: one line per message",
            dir.display()
        );
        for line in &lines {
            check_live_capture(&dir, line);
            messages += 1;
        }
    }
    assert!(
        messages >= 43,
        "run1 (39) and run3_cbor (4) at least, checked {messages}"
    );
}

/// One replay reply of a capture directory; `line` is its `replay.jsonl` entry, `None` for the
/// end marker that closes the reply. Returns whether it was a batch.
fn check_replay_capture(file: &Path, line: Option<&Value>) -> bool {
    let what = file.display().to_string();
    let capture = read(file);
    let frames = parse_length_prefixed(&capture).unwrap();
    assert_eq!(
        frames.len(),
        4,
        "{what}: DEALER sees [\"\", topic, seq, payload]"
    );
    // Without the delimiter (as a REQ socket delivers it) the reply reads the same.
    assert_eq!(
        parse_replay(&frames[1..]).unwrap(),
        parse_replay(&frames).unwrap()
    );
    let Some(line) = line else {
        assert_eq!(
            parse_replay(&frames).unwrap(),
            ReplayFrame::End,
            "{what}: last is End"
        );
        return false;
    };
    let ReplayFrame::Batch {
        topic,
        seq,
        payload,
    } = parse_replay(&frames).unwrap()
    else {
        panic!("{what}: End before the last file")
    };
    assert_eq!(topic, line["topic"].as_str(), "{what}: topic");
    assert_eq!(seq, j_u64(&line["seq"]), "{what}: seq");
    check_real_payload(
        payload,
        &line["ts"],
        &line["dp_rank"],
        &line["events"],
        &what,
    );
    true
}

#[test]
fn real_vllm_032_replay_captures_decode_and_reencode_exactly() {
    let mut batches = 0;
    for dir in real_capture_dirs() {
        let files = files_with(&dir, |n| n.starts_with("replay_") && n.ends_with(".bin"));
        if files.is_empty() {
            continue;
        }
        let lines = read_jsonl(&dir.join("replay.jsonl"));
        assert_eq!(
            files.len(),
            lines.len() + 1,
            "{}: batches + end marker",
            dir.display()
        );
        for (i, file) in files.iter().enumerate() {
            if check_replay_capture(file, lines.get(i)) {
                batches += 1;
            }
        }
    }
    assert!(
        batches >= 6,
        "replay1 (4) and replay_fresh (2) at least, checked {batches}"
    );
}

// ---------------------------------------------------------------------------------------------
// Robustness
// ---------------------------------------------------------------------------------------------

fn all_golden_payloads() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = files_with(&kv_events_dir(), |n| n.ends_with(".bin"))
        .into_iter()
        .map(|p| (p.display().to_string(), read(&p)))
        .collect();
    for dir in real_capture_dirs() {
        for p in files_with(&dir, |n| n.ends_with(".f2.bin")) {
            out.push((p.display().to_string(), read(&p)));
        }
        for p in files_with(&dir, |n| n.starts_with("replay_")) {
            let frames = parse_length_prefixed(&read(&p))
                .unwrap()
                .into_iter()
                .map(<[u8]>::to_vec)
                .collect::<Vec<_>>();
            if let Ok(ReplayFrame::Batch { payload, .. }) = parse_replay(&frames) {
                out.push((p.display().to_string(), payload.to_vec()));
            }
        }
    }
    assert!(out.len() >= 16 + 43 + 6, "payload count {}", out.len());
    out
}

#[test]
fn every_truncated_golden_payload_is_an_error() {
    let mut prefixes = 0;
    for (what, payload) in all_golden_payloads() {
        assert!(decode_batch(&payload).is_ok(), "{what}");
        for len in 0..payload.len() {
            // A batch is one array whose last element ends the payload, so no strict prefix is a
            // complete value.
            assert!(
                decode_batch(&payload[..len]).is_err(),
                "{what}: prefix {len} decoded"
            );
            prefixes += 1;
        }
        // One byte more is trailing data.
        let mut longer = payload.clone();
        longer.push(0xc0);
        assert!(
            decode_batch(&longer).is_err(),
            "{what}: trailing byte accepted"
        );
    }
    assert!(prefixes > 10_000);
}

#[test]
fn every_truncated_capture_splits_only_at_frame_boundaries() {
    for dir in real_capture_dirs() {
        for p in files_with(&dir, |n| {
            (n.starts_with("msg_") && !n.contains(".f")) || n.starts_with("replay_")
        }) {
            let capture = read(&p);
            let frames = parse_length_prefixed(&capture).unwrap();
            let boundaries: Vec<usize> = frames
                .iter()
                .scan(0, |end, f| {
                    *end += 4 + f.len();
                    Some(*end)
                })
                .collect();
            for len in 0..capture.len() {
                match parse_length_prefixed(&capture[..len]) {
                    Ok(prefix) => {
                        let k = prefix.len();
                        assert_eq!(
                            if k == 0 { 0 } else { boundaries[k - 1] },
                            len,
                            "{}: prefix {len}",
                            p.display()
                        );
                        assert_eq!(prefix, frames[..k]);
                    }
                    Err(_) => assert!(
                        !boundaries.contains(&len) && len != 0,
                        "{}: prefix {len}",
                        p.display()
                    ),
                }
            }
        }
    }
}

/// Decoding must never panic; what decodes must survive encode → decode unchanged (compared via
/// bytes and `Debug`, which treat NaN consistently).
fn check_no_panic_and_round_trip(bytes: &[u8]) -> bool {
    let Ok(batch) = decode_batch(bytes) else {
        return false;
    };
    let encoded = encode_batch(&batch);
    let again =
        decode_batch(&encoded).unwrap_or_else(|e| panic!("re-decoding {encoded:02x?}: {e}"));
    assert_eq!(encode_batch(&again), encoded);
    assert_eq!(format!("{again:?}"), format!("{batch:?}"));
    true
}

#[test]
fn random_and_mutated_input_never_panics() {
    let seed = 0x6b76_6576_656e_7473;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let payloads = all_golden_payloads();
    let mut decoded_ok = 0;
    for round in 0..20_000 {
        let bytes: Vec<u8> = if round % 2 == 0 {
            let len = rng.gen_range(0..256);
            (0..len).map(|_| rng.gen()).collect()
        } else {
            let (_, base) = &payloads[rng.gen_range(0..payloads.len())];
            let mut m = base.clone();
            for _ in 0..rng.gen_range(1..4) {
                let i = rng.gen_range(0..m.len());
                match rng.gen_range(0..3) {
                    0 => m[i] = rng.gen(),
                    1 => m[i] ^= 1 << rng.gen_range(0..8),
                    _ => {
                        m.insert(i, rng.gen());
                    }
                }
            }
            m
        };
        if check_no_panic_and_round_trip(&bytes) {
            decoded_ok += 1;
        }
        let frames: Vec<&[u8]> = bytes.chunks(rng.gen_range(1..16)).take(5).collect();
        let _ = parse_live(&frames);
        let _ = parse_replay(&frames);
        let _ = parse_length_prefixed(&bytes);
    }
    // Single-byte mutations of valid payloads often still decode: the round trip is exercised.
    assert!(
        decoded_ok > 100,
        "seed {seed:#x}: only {decoded_ok} inputs decoded"
    );
}

/// Throughput on the ingest path. Run with
/// `cargo test --release -p kinference-vllm --test golden_events -- --ignored --nocapture`.
#[test]
#[ignore]
fn decode_throughput() {
    let events: Vec<KvEvent> = (0..64u64)
        .map(|e| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: (0..32)
                    .map(|i| HashValue::Int((e * 32 + i).wrapping_mul(0x9e37_79b9_7f4a_7c15)))
                    .collect(),
                parent_block_hash: Some(HashValue::Int(e.wrapping_mul(0x1234_5678_9abc_def1))),
                token_ids: (0..32 * 16).map(|t| (t * 7919) % 152_000).collect(),
                block_size: 16,
                medium: Some("GPU".into()),
                extra_keys: Some(vec![None; 32]),
                group_idx: Some(0),
                ..Default::default()
            })
        })
        .collect();
    let hashes_per_batch = 64 * 32;
    let payload = encode_batch(&KvEventBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    });
    let iterations = 2_000;
    let start = std::time::Instant::now();
    let mut total = 0;
    for _ in 0..iterations {
        total += std::hint::black_box(decode_batch(std::hint::black_box(&payload)).unwrap())
            .events
            .len();
    }
    let secs = start.elapsed().as_secs_f64();
    let hashes = (iterations * hashes_per_batch) as f64;
    println!(
        "decoded {iterations} batches of {} bytes ({hashes_per_batch} hashes, 16 tokens each) in {secs:.3}s: \
         {:.2}M hashes/s, {:.0} MB/s",
        payload.len(),
        hashes / secs / 1e6,
        (iterations * payload.len()) as f64 / secs / 1e6
    );
    assert_eq!(total, iterations * 64);
    assert!(hashes / secs > 1e6, "below 1M block hashes/s");
}
