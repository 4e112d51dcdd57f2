//! kinfctl: the operator CLI. `hash` prints vLLM's block hashes for token ids; `decode-events`
//! prints KV-event captures with vLLM's field names.
//!
//! Output is one line per item (a block, a batch) so it can be piped; `--json` makes every line a
//! JSON object. Errors go to stderr with a non-zero exit status. `hash` takes token ids, or text
//! with `--tokenizer DIR` (`--prompt` for completions, `--messages` for chat), tokenized exactly
//! as vLLM would. `status`, `explain`, `savings` and `top` read a running router's admin port:
//! the fleet it sees, where it would send a request body and why, what its cache hits saved,
//! and a live view of all of it.

mod doctor;
mod explain;
mod savings;
mod status;

use std::io::{self, BufWriter, Write};
use std::num::ParseIntError;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use kinference_tokenize::{ChatRequest, Tokenizer};
use kinference_vllm::events::codec::{decode_batch_with_stats, DecodeStats};
use kinference_vllm::events::frames::{parse_length_prefixed, parse_replay, ReplayFrame};
use kinference_vllm::hashing::{
    BlockHasher, ExtraKeysFormat, HashAlgo, Lora, MmItem, RequestExtras,
};
use kinference_vllm::{BlockRemoved, BlockStored, ExtraKeyItem, HashValue, KvEvent, KvEventBatch};
use serde_json::Value;

#[derive(Debug, Parser)]
#[command(name = "kinfctl", version, about = "kinference operator CLI")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Hash token ids into block hashes exactly as a vLLM replica would.
    Hash(HashArgs),
    /// Decode KV-event captures: raw msgpack payloads or length-prefixed multipart messages.
    DecodeEvents(DecodeArgs),
    /// Check against a live replica that the router's hashing agrees with it, and if not, why.
    /// Exits with 1 when the hashes differ.
    Doctor(doctor::DoctorArgs),
    /// Show a running router's fleet: per pool and replica its health, scorability, load,
    /// KV-event stream and index entries. Exits with 1 when the router is not ready.
    Status(status::StatusArgs),
    /// Show where a running router would send a request body (--body FILE or stdin) and why:
    /// every candidate's cached blocks, predicted cached tokens, load and score.
    Explain(explain::ExplainArgs),
    /// Show what a running router's cache hits saved since it started: prefill tokens not
    /// recomputed, GPU-seconds, kWh and dollars, per pool.
    Savings(savings::SavingsArgs),
    /// A live view of a running router in the terminal: savings, rates, hit rates, TTFT,
    /// decisions and every replica's load and event stream; q or Ctrl-C quits.
    Top(savings::TopArgs),
}

#[derive(Debug, clap::Args)]
struct HashArgs {
    /// Tokens per block (the replica's `block_size`).
    #[arg(long)]
    block_size: usize,
    /// sha256, sha256_cbor, xxhash or xxhash_cbor (`--prefix-caching-hash-algo`).
    #[arg(long, default_value = "sha256")]
    algo: HashAlgo,
    /// The replica's PYTHONHASHSEED; required for the xxhash algorithms.
    #[arg(long)]
    seed: Option<String>,
    /// LoRA adapter as NAME:PATH (the path is part of the hash).
    #[arg(long, value_parser = parse_lora)]
    lora: Option<Lora>,
    /// The request's cache_salt.
    #[arg(long)]
    cache_salt: Option<String>,
    /// Multimodal item as IDENTIFIER:OFFSET:LENGTH (token positions); repeatable.
    #[arg(long = "mm", value_parser = parse_mm)]
    mm: Vec<MmItem>,
    /// tagged (vLLM 0.34) or untagged (vLLM ≤ 0.24) extra keys.
    #[arg(long, default_value = "tagged")]
    extra_keys_format: ExtraKeysFormat,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(
        long,
        value_parser = parse_tokens,
        allow_hyphen_values = true,
        required_unless_present = "tokenizer",
        conflicts_with = "tokenizer"
    )]
    tokens: Option<Tokens>,
    /// A tokenizer directory (tokenizer.json, tokenizer_config.json, chat template): tokenize
    /// --prompt or --messages exactly as a vLLM replica serving that tokenizer would.
    #[arg(long, requires = "text")]
    tokenizer: Option<PathBuf>,
    /// A completions prompt (encoded with special tokens, as `/v1/completions` does).
    #[arg(long, group = "text", requires = "tokenizer")]
    prompt: Option<String>,
    /// Chat messages as JSON: an array of messages, or a whole chat request body; rendered with
    /// the chat template and `add_generation_prompt` (default true), as `/v1/chat/completions` does.
    #[arg(long, group = "text", requires = "tokenizer")]
    messages: Option<String>,
    /// One JSON object per block.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct DecodeArgs {
    /// Capture files: a msgpack payload, or frames stored as u32 big-endian length + bytes.
    #[arg(required = true)]
    files: Vec<PathBuf>,
    /// One JSON object per batch.
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Debug)]
struct Tokens(Vec<u32>);

/// Why a flag's value does not parse (clap prints it after the flag's name).
#[derive(Debug, thiserror::Error)]
enum FlagError {
    #[error("token id {token:?}: {error} (expected 0..=4294967295)")]
    TokenId { token: String, error: ParseIntError },
    #[error("expected NAME:PATH, got {0:?}")]
    Lora(String),
    #[error("expected IDENTIFIER:OFFSET:LENGTH, got {0:?}")]
    MmShape(String),
    #[error("{what} {value:?} in {item:?}: {error}")]
    MmNumber {
        what: &'static str,
        value: String,
        item: String,
        error: ParseIntError,
    },
}

fn parse_tokens(s: &str) -> Result<Tokens, FlagError> {
    let inner = s.trim().trim_start_matches('[').trim_end_matches(']');
    inner
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>().map_err(|error| FlagError::TokenId {
                token: t.to_owned(),
                error,
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Tokens)
}

fn parse_lora(s: &str) -> Result<Lora, FlagError> {
    match s.split_once(':') {
        Some((name, path)) if !name.is_empty() => Ok(Lora {
            name: name.to_string(),
            path: path.to_string(),
        }),
        _ => Err(FlagError::Lora(s.to_owned())),
    }
}

/// Splits from the right so identifiers may contain ':'.
fn parse_mm(s: &str) -> Result<MmItem, FlagError> {
    let mut parts = s.rsplitn(3, ':');
    let (Some(length), Some(offset), Some(identifier)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(FlagError::MmShape(s.to_owned()));
    };
    let num = |value: &str, what: &'static str| {
        value.parse::<usize>().map_err(|error| FlagError::MmNumber {
            what,
            value: value.to_owned(),
            item: s.to_owned(),
            error,
        })
    };
    Ok(MmItem {
        identifier: identifier.to_string(),
        offset: num(offset, "offset")?,
        length: num(length, "length")?,
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Quiet unless RUST_LOG asks: the commands' output is their report.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(io::stderr)
        .init();
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut verdict = ExitCode::SUCCESS;
    let result = match cli.command {
        Command::Hash(args) => run_hash(&args, &mut out),
        Command::DecodeEvents(args) => run_decode(&args, &mut out),
        Command::Doctor(args) => doctor::run(&args).and_then(|(ok, text)| {
            if !ok {
                verdict = ExitCode::FAILURE;
            }
            out.write_all(text.as_bytes()).context("writing to stdout")
        }),
        Command::Status(args) => status::run(&args).and_then(|(ready, text)| {
            if !ready {
                verdict = ExitCode::FAILURE;
            }
            out.write_all(text.as_bytes()).context("writing to stdout")
        }),
        Command::Explain(args) => explain::run(&args)
            .and_then(|text| out.write_all(text.as_bytes()).context("writing to stdout")),
        Command::Savings(args) => savings::savings(&args)
            .and_then(|text| out.write_all(text.as_bytes()).context("writing to stdout")),
        Command::Top(args) => savings::top(&args),
    };
    let flushed = out.flush().context("writing to stdout");
    match result.and(flushed) {
        Ok(()) => verdict,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run_hash(args: &HashArgs, out: &mut impl Write) -> Result<()> {
    let hasher = BlockHasher::new(
        args.algo,
        args.block_size,
        args.seed.as_deref(),
        args.extra_keys_format,
    )?;
    let extras = RequestExtras {
        lora: args.lora.clone(),
        mm: args.mm.clone(),
        cache_salt: args.cache_salt.clone(),
        prompt_embeds_digests: Vec::new(),
    };
    let tokens = token_ids(args)?;
    let digests = hasher.hash_blocks(&tokens, &extras);
    if digests.is_empty() {
        eprintln!(
            "no full block: {} tokens, block size {}",
            tokens.len(),
            args.block_size
        );
    }
    for (index, digest) in digests.iter().enumerate() {
        if args.json {
            let line = [
                ("index", Value::from(index)),
                ("digest", digest.to_hex().into()),
                ("event_hash", digest.event_hash().0.into()),
            ];
            writeln!(out, "{}", object_json(&line))?;
        } else {
            writeln!(out, "{index}\t{digest}\t{}", digest.event_hash().0)?;
        }
    }
    Ok(())
}

/// The token ids to hash: given, or tokenized from --prompt / --messages with --tokenizer.
fn token_ids(args: &HashArgs) -> Result<Vec<u32>> {
    if let Some(tokens) = &args.tokens {
        if args.prompt.is_some() || args.messages.is_some() {
            bail!("--prompt and --messages need --tokenizer, not --tokens");
        }
        return Ok(tokens.0.clone());
    }
    let Some(dir) = &args.tokenizer else {
        bail!("give --tokens, or --tokenizer with --prompt or --messages");
    };
    let tokenizer = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
    if let Some(prompt) = &args.prompt {
        return Ok(tokenizer.encode_completion(prompt)?);
    }
    let Some(messages) = &args.messages else {
        bail!("--tokenizer needs --prompt or --messages");
    };
    let body: Value = serde_json::from_str(messages).context("--messages is not valid JSON")?;
    let body = match body {
        Value::Array(_) => serde_json::json!({ "messages": body }),
        Value::Object(_) => body,
        _ => bail!("--messages must be a JSON array of messages or a chat request object"),
    };
    let body = body.to_string();
    let request = ChatRequest::from_json(body.as_bytes())?;
    Ok(tokenizer.encode_chat(&request)?)
}

/// What one capture file holds.
enum Capture {
    /// A bare msgpack batch.
    Payload(KvEventBatch, DecodeStats),
    /// A multipart message carrying a batch.
    Message {
        topic: Option<String>,
        seq: u64,
        batch: KvEventBatch,
        stats: DecodeStats,
    },
    /// The replay socket's end marker.
    ReplayEnd,
}

/// Tries a bare payload first, then a length-prefixed capture; reports both failures if
/// neither fits. The two cannot be confused: a payload starts with 0x93 (a 3-array), which as a
/// frame length would run far past the end of any capture.
fn read_capture(bytes: &[u8]) -> Result<Capture> {
    let as_payload = match decode_batch_with_stats(bytes) {
        Ok((batch, stats)) => return Ok(Capture::Payload(batch, stats)),
        Err(e) => e,
    };
    let as_frames = (|| -> Result<Capture> {
        let frames = parse_length_prefixed(bytes)?;
        match parse_replay(&frames)? {
            ReplayFrame::End => Ok(Capture::ReplayEnd),
            ReplayFrame::Batch {
                topic,
                seq,
                payload,
            } => {
                let (batch, stats) = decode_batch_with_stats(payload)
                    .with_context(|| format!("payload of message seq {seq}"))?;
                Ok(Capture::Message {
                    topic: topic.map(str::to_string),
                    seq,
                    batch,
                    stats,
                })
            }
        }
    })();
    as_frames.map_err(|frames_err| {
        anyhow::anyhow!(
            "not a KV-event capture: as a msgpack payload: {as_payload}; \
             as length-prefixed frames: {frames_err:#}"
        )
    })
}

fn run_decode(args: &DecodeArgs, out: &mut impl Write) -> Result<()> {
    let mut failed = 0;
    for path in &args.files {
        match decode_file(path, args.json, out) {
            Ok(()) => {}
            Err(e) => {
                failed += 1;
                eprintln!("{}: {e:#}", path.display());
            }
        }
    }
    if failed > 0 {
        out.flush()?;
        bail!(
            "{failed} of {} files could not be decoded",
            args.files.len()
        );
    }
    Ok(())
}

fn decode_file(path: &Path, as_json: bool, out: &mut impl Write) -> Result<()> {
    let bytes = std::fs::read(path).context("reading the file")?;
    let file = path.display().to_string();
    let mut header: Fields = vec![("file", file.as_str().into())];
    let (batch, stats) = match read_capture(&bytes)? {
        Capture::ReplayEnd => {
            header.push(("replay_end", true.into()));
            return write_batch(out, as_json, &header, &[]);
        }
        Capture::Payload(batch, stats) => (batch, stats),
        Capture::Message {
            topic,
            seq,
            batch,
            stats,
        } => {
            if let Some(topic) = topic {
                header.push(("topic", topic.into()));
            }
            header.push(("seq", seq.into()));
            (batch, stats)
        }
    };
    header.push(("ts", batch.ts.into()));
    header.push(("data_parallel_rank", batch.data_parallel_rank.into()));
    if stats.unknown_events > 0 || stats.ignored_fields > 0 {
        header.push(("skipped_unknown_events", stats.unknown_events.into()));
        header.push(("skipped_fields", stats.ignored_fields.into()));
    }
    let events: Vec<Fields> = batch.events.iter().map(event_fields).collect();
    write_batch(out, as_json, &header, &events)
}

/// A JSON object's members in the order they are printed (vLLM's field order).
type Fields = Vec<(&'static str, Value)>;

fn member(key: &str, value: &Value) -> String {
    format!("{}:{value}", Value::from(key))
}

fn object_json(fields: &[(&'static str, Value)]) -> String {
    let members: Vec<String> = fields.iter().map(|(k, v)| member(k, v)).collect();
    format!("{{{}}}", members.join(","))
}

/// JSON: one object per batch, events nested. Human: a header line, then one line per event.
fn write_batch(
    out: &mut impl Write,
    as_json: bool,
    header: &[(&'static str, Value)],
    events: &[Fields],
) -> Result<()> {
    let is_end = header.iter().any(|(k, _)| *k == "replay_end");
    if as_json {
        let mut members: Vec<String> = header.iter().map(|(k, v)| member(k, v)).collect();
        if !is_end {
            let events: Vec<String> = events.iter().map(|e| object_json(e)).collect();
            members.push(format!("\"events\":[{}]", events.join(",")));
        }
        writeln!(out, "{{{}}}", members.join(","))?;
        return Ok(());
    }
    let mut parts: Vec<String> = Vec::new();
    for (k, v) in header {
        match (*k, v) {
            ("file", Value::String(f)) => parts.push(format!("{f}:")),
            ("replay_end", _) => parts.push("end of replay".into()),
            _ => parts.push(format!("{k}={v}")),
        }
    }
    if !is_end {
        parts.push(format!("events={}", events.len()));
    }
    writeln!(out, "{}", parts.join(" "))?;
    for event in events {
        let mut line = String::from(" ");
        for (k, v) in event {
            match (*k, v) {
                ("type", Value::String(t)) => line.push_str(&format!(" {t}")),
                _ => line.push_str(&format!(" {k}={v}")),
            }
        }
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// An event as vLLM names its fields: fields without a default always, defaulted ones when set.
fn event_fields(event: &KvEvent) -> Fields {
    match event {
        KvEvent::BlockStored(s) => stored_fields(s),
        KvEvent::BlockRemoved(r) => removed_fields(r),
        KvEvent::AllBlocksCleared => vec![("type", "AllBlocksCleared".into())],
    }
}

fn stored_fields(s: &BlockStored) -> Fields {
    let mut f: Fields = vec![
        ("type", "BlockStored".into()),
        ("block_hashes", hashes_json(&s.block_hashes)),
        (
            "parent_block_hash",
            s.parent_block_hash.as_ref().map_or(Value::Null, hash_json),
        ),
        ("token_ids", s.token_ids.clone().into()),
        ("block_size", s.block_size.into()),
        ("lora_id", s.lora_id.into()),
        ("medium", s.medium.clone().into()),
        ("lora_name", s.lora_name.clone().into()),
    ];
    if let Some(keys) = &s.extra_keys {
        let per_block = keys
            .iter()
            .map(|k| k.as_ref().map_or(Value::Null, |items| items_json(items)))
            .collect();
        f.push(("extra_keys", Value::Array(per_block)));
    }
    let optional: [(&'static str, Value); 7] = [
        ("group_idx", s.group_idx.into()),
        ("kv_cache_spec_kind", s.kv_cache_spec_kind.clone().into()),
        (
            "kv_cache_spec_sliding_window",
            s.kv_cache_spec_sliding_window.into(),
        ),
        ("locality", s.locality.clone().into()),
        ("ownership", s.ownership.clone().into()),
        ("session_id", s.session_id.clone().into()),
        ("lookahead_token_ids", s.lookahead_token_ids.clone().into()),
    ];
    f.extend(optional.into_iter().filter(|(_, v)| !v.is_null()));
    f
}

fn removed_fields(r: &BlockRemoved) -> Fields {
    let mut f: Fields = vec![
        ("type", "BlockRemoved".into()),
        ("block_hashes", hashes_json(&r.block_hashes)),
        ("medium", r.medium.clone().into()),
    ];
    let optional: [(&'static str, Value); 3] = [
        ("group_idx", r.group_idx.into()),
        ("locality", r.locality.clone().into()),
        ("ownership", r.ownership.clone().into()),
    ];
    f.extend(optional.into_iter().filter(|(_, v)| !v.is_null()));
    f
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Integer hashes as JSON numbers; byte hashes as hex strings.
fn hash_json(h: &HashValue) -> Value {
    match h {
        HashValue::Int(v) => (*v).into(),
        HashValue::Bytes(b) => hex(b).into(),
    }
}

fn hashes_json(hashes: &[HashValue]) -> Value {
    Value::Array(hashes.iter().map(hash_json).collect())
}

fn items_json(items: &[ExtraKeyItem]) -> Value {
    Value::Array(items.iter().map(item_json).collect())
}

fn item_json(item: &ExtraKeyItem) -> Value {
    match item {
        ExtraKeyItem::Nil => Value::Null,
        ExtraKeyItem::Bool(b) => (*b).into(),
        ExtraKeyItem::Int(v) => (*v).into(),
        ExtraKeyItem::UInt(v) => (*v).into(),
        ExtraKeyItem::Float(v) => (*v).into(),
        ExtraKeyItem::Str(s) => s.as_str().into(),
        ExtraKeyItem::Bytes(b) => hex(b).into(),
        ExtraKeyItem::Array(items) => items_json(items),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_parse() {
        assert_eq!(parse_tokens("1, 2,3").unwrap().0, vec![1, 2, 3]);
        assert_eq!(parse_tokens("[7]").unwrap().0, vec![7]);
        assert!(parse_tokens("").unwrap().0.is_empty());
        assert!(parse_tokens("1,-2").is_err());
        assert!(parse_tokens("4294967296").is_err());
    }

    #[test]
    fn lora_and_mm_parse() {
        let l = parse_lora("sql:/a/b:c").unwrap();
        assert_eq!((l.name.as_str(), l.path.as_str()), ("sql", "/a/b:c"));
        assert!(parse_lora("nocolon").is_err());
        let m = parse_mm("lora:img:5:20").unwrap();
        assert_eq!(
            (m.identifier.as_str(), m.offset, m.length),
            ("lora:img", 5, 20)
        );
        assert!(parse_mm("img:5").is_err());
        assert!(parse_mm("img:x:2").is_err());
    }

    #[test]
    fn garbage_is_rejected_with_both_reasons() {
        let err = read_capture(b"\x01\x02\x03").err().unwrap().to_string();
        assert!(err.contains("msgpack payload"), "{err}");
        assert!(err.contains("length-prefixed"), "{err}");
    }
}
