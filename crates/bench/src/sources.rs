//! Readers for the published traces: Mooncake JSONL (plain or gzip), ShareGPT multi-turn
//! conversations (JSONL, gzip) and the Azure LLM inference CSVs.
//!
//! * Mooncake: one request per line, `timestamp` (ms), `input_length`, `output_length`,
//!   `hash_ids` (prefix-chained ids of `block_tokens`-token blocks: 512 in the FAST'25
//!   release, 16 in the ShareGPT-derived file). Each line becomes a [`Prompt::Blocks`].
//! * ShareGPT: one conversation per line, `{"id", "conversations": [{"from", "value"}...]}`.
//!   Human turn `t` becomes a chat request carrying the whole history before it (the gold
//!   assistant replies stand in for the model's), as a chat client sends it.
//! * Azure: `TIMESTAMP,ContextTokens,GeneratedTokens`; no prefix information, so it gives
//!   arrival times and length shapes only.
//!
//! Readers stop at the first `limit` records; a malformed record is an error naming its line.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use crate::error::BenchError;
use crate::workload::{exponential, Message, Prompt, WorkRequest, Workload};

/// Tokens per hash id in the Mooncake FAST'25 release.
pub const MOONCAKE_BLOCK: usize = 512;

/// The shared reference data (`shared/data` beside the repository), found from this crate's
/// source directory; `None` when it is not there.
pub fn default_data_dir() -> Option<PathBuf> {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .canonicalize()
        .ok()
}

/// A file under [`default_data_dir`], or an error naming where it was looked for.
pub fn data_file(relative: &str) -> Result<PathBuf, BenchError> {
    let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data");
    let p = base.join(relative);
    p.canonicalize().map_err(|e| BenchError::io(p, e))
}

fn open(path: &Path) -> Result<Box<dyn BufRead>, BenchError> {
    let f = std::fs::File::open(path).map_err(|e| BenchError::io(path, e))?;
    let gz = path.extension().is_some_and(|e| e == "gz");
    let r: Box<dyn Read> = if gz {
        Box::new(flate2::read::GzDecoder::new(f))
    } else {
        Box::new(f)
    };
    Ok(Box::new(BufReader::new(r)))
}

/// Calls `f(line_number, line)` for each non-empty line, up to `limit` of them.
fn for_lines(
    path: &Path,
    limit: usize,
    mut f: impl FnMut(usize, &str) -> Result<(), BenchError>,
) -> Result<(), BenchError> {
    let mut taken = 0;
    for (i, line) in open(path)?.lines().enumerate() {
        if taken >= limit {
            break;
        }
        let line = line.map_err(|e| BenchError::io(path, e))?;
        if line.trim().is_empty() {
            continue;
        }
        f(i + 1, &line)?;
        taken += 1;
    }
    Ok(())
}

fn parse_err(path: &Path, line: usize, e: impl ToString) -> BenchError {
    BenchError::Parse {
        path: path.to_path_buf(),
        line,
        message: e.to_string(),
    }
}

#[derive(Deserialize)]
struct MooncakeLine {
    timestamp: f64,
    input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake-format trace whose ids stand for `block_tokens`-token blocks.
pub fn read_mooncake(
    path: &Path,
    block_tokens: usize,
    limit: usize,
) -> Result<Workload, BenchError> {
    if block_tokens == 0 {
        return Err(BenchError::Config(
            "trace block size must be positive".into(),
        ));
    }
    let mut reqs = Vec::new();
    for_lines(path, limit, |n, line| {
        let l: MooncakeLine = serde_json::from_str(line).map_err(|e| parse_err(path, n, e))?;
        if l.input_length == 0 {
            return Err(parse_err(path, n, "input_length is 0"));
        }
        if l.hash_ids.len() * block_tokens < l.input_length {
            return Err(parse_err(
                path,
                n,
                format!(
                    "{} hash ids of {block_tokens} tokens cannot cover {} input tokens",
                    l.hash_ids.len(),
                    l.input_length
                ),
            ));
        }
        reqs.push(WorkRequest {
            at: l.timestamp / 1000.0,
            session: None,
            prompt: Prompt::Blocks {
                ids: l.hash_ids,
                len: l.input_length,
                block_tokens,
            },
            max_tokens: l.output_length.max(1),
        });
        Ok(())
    })?;
    Ok(Workload::new(file_stem(path), reqs))
}

#[derive(Deserialize)]
struct ShareGptTurn {
    from: String,
    value: String,
}

#[derive(Deserialize)]
struct ShareGptConversation {
    conversations: Vec<ShareGptTurn>,
}

/// How ShareGPT conversations are laid out in time (the reader invents arrivals: the data
/// set has none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ConversationTiming {
    /// Conversations start as a Poisson process at this rate, per second.
    pub start_rate: f64,
    /// A user's pause before the next turn, on top of reading the reply, seconds.
    pub think_secs: f64,
    /// Reply tokens a user reads per second.
    pub read_tokens_per_sec: f64,
    pub seed: u64,
}

impl Default for ConversationTiming {
    fn default() -> Self {
        // The same shape the shared ShareGPT-derived trace uses: starts 1/s, 5 s of thinking
        // plus the reply read at 50 tokens/s.
        ConversationTiming {
            start_rate: 1.0,
            think_secs: 5.0,
            read_tokens_per_sec: 50.0,
            seed: 7,
        }
    }
}

/// Reads up to `max_conversations` ShareGPT conversations as chat requests, one per human
/// turn. Output lengths are estimated from the gold reply (about 4 characters per token).
pub fn read_sharegpt(
    path: &Path,
    max_conversations: usize,
    timing: ConversationTiming,
) -> Result<Workload, BenchError> {
    if !(timing.start_rate > 0.0 && timing.read_tokens_per_sec > 0.0) {
        return Err(BenchError::Config(
            "conversation rates must be positive".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(timing.seed);
    let mut reqs = Vec::new();
    let mut start = 0.0;
    let mut conv_id = 0u64;
    for_lines(path, max_conversations, |n, line| {
        let c: ShareGptConversation =
            serde_json::from_str(line).map_err(|e| parse_err(path, n, e))?;
        let mut history: Vec<Message> = Vec::new();
        let mut at = start;
        let turns = &c.conversations;
        for (i, t) in turns.iter().enumerate() {
            let role = match t.from.as_str() {
                "human" | "user" => "user",
                "gpt" | "assistant" | "chatgpt" | "bard" => "assistant",
                "system" => "system",
                _ => continue,
            };
            history.push(Message {
                role: role.into(),
                content: t.value.clone(),
            });
            if role != "user" {
                continue;
            }
            let reply = turns.get(i + 1).map_or(64, |r| (r.value.len() / 4).max(1));
            let max_tokens = u32::try_from(reply).unwrap_or(u32::MAX).clamp(1, 4096);
            reqs.push(WorkRequest {
                at,
                session: Some(conv_id),
                prompt: Prompt::Chat(history.clone()),
                max_tokens,
            });
            at += timing.think_secs + f64::from(max_tokens) / timing.read_tokens_per_sec;
        }
        conv_id += 1;
        start += exponential(&mut rng, timing.start_rate);
        Ok(())
    })?;
    Ok(Workload::new(file_stem(path), reqs))
}

/// One row of an Azure LLM inference trace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AzureRow {
    /// Seconds since the first row.
    pub at: f64,
    pub context_tokens: usize,
    pub generated_tokens: u32,
}

/// Reads an Azure trace (`TIMESTAMP,ContextTokens,GeneratedTokens`).
pub fn read_azure(path: &Path, limit: usize) -> Result<Vec<AzureRow>, BenchError> {
    let mut rows = Vec::new();
    let mut first: Option<f64> = None;
    for_lines(path, limit.saturating_add(1), |n, line| {
        if n == 1 && line.starts_with("TIMESTAMP") {
            return Ok(());
        }
        let mut f = line.split(',');
        let (Some(ts), Some(ctx), Some(gen)) = (f.next(), f.next(), f.next()) else {
            return Err(parse_err(path, n, "expected 3 comma-separated fields"));
        };
        let secs = parse_timestamp(ts).ok_or_else(|| parse_err(path, n, "bad timestamp"))?;
        let t0 = *first.get_or_insert(secs);
        rows.push(AzureRow {
            at: secs - t0,
            context_tokens: ctx.trim().parse().map_err(|e| parse_err(path, n, e))?,
            generated_tokens: gen.trim().parse().map_err(|e| parse_err(path, n, e))?,
        });
        Ok(())
    })?;
    rows.truncate(limit);
    Ok(rows)
}

/// `YYYY-MM-DD HH:MM:SS.fffffff` → seconds since an arbitrary epoch (days since
/// 2000-01-01 are enough: a trace spans hours).
fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut t = time.split(':');
    let (h, min, sec) = (
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
        t.next()?.parse::<f64>().ok()?,
    );
    // Days from civil (Howard Hinnant's algorithm), exact for the Gregorian calendar.
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe;
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + sec)
}

/// An Azure trace as a workload: every prompt unique (the trace has no prefix information),
/// lengths and times as recorded.
pub fn azure_workload(name: &str, rows: &[AzureRow], seed: u64) -> Workload {
    let block = 64;
    let reqs = rows
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let len = r.context_tokens.max(1);
            let base = (seed << 40) ^ ((i as u64) << 20);
            WorkRequest {
                at: r.at,
                session: None,
                prompt: Prompt::Blocks {
                    ids: (0..len.div_ceil(block) as u64).map(|j| base + j).collect(),
                    len,
                    block_tokens: block,
                },
                max_tokens: r.generated_tokens.max(1),
            }
        })
        .collect();
    Workload::new(name, reqs)
}

fn file_stem(path: &Path) -> String {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    name.trim_end_matches(".gz")
        .trim_end_matches(".jsonl")
        .trim_end_matches(".csv")
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_timestamps_are_seconds() {
        let a = parse_timestamp("2023-11-16 18:15:46.6805900").unwrap();
        let b = parse_timestamp("2023-11-17 00:00:00.0").unwrap();
        assert!((b - a - (5.0 * 3600.0 + 44.0 * 60.0 + 13.31941)).abs() < 1e-3);
        assert!(parse_timestamp("garbage").is_none());
    }

    #[test]
    fn shared_data_readers() {
        let Ok(p) = data_file("traces/mooncake/conversation_trace.jsonl") else {
            panic!("the shared Mooncake trace is required for this test");
        };
        let w = read_mooncake(&p, MOONCAKE_BLOCK, 50).unwrap();
        assert_eq!(w.len(), 50);
        for r in &w.requests {
            let Prompt::Blocks { ids, len, .. } = &r.prompt else {
                panic!("not blocks")
            };
            assert_eq!(ids.len(), len.div_ceil(MOONCAKE_BLOCK));
        }
        let s = data_file("traces/sharegpt/sharegpt_v3_multiturn_3000.jsonl.gz").unwrap();
        let w = read_sharegpt(&s, 5, ConversationTiming::default()).unwrap();
        assert!(w.len() >= 10, "{}", w.len());
        // Later turns of a conversation carry the earlier ones.
        let conv0: Vec<&WorkRequest> = w.requests.iter().filter(|r| r.session == Some(0)).collect();
        assert!(conv0.len() >= 2);
        let (Prompt::Chat(a), Prompt::Chat(b)) = (&conv0[0].prompt, &conv0[1].prompt) else {
            panic!("not chat")
        };
        assert!(b.len() > a.len() && b.starts_with(a));
        assert!(conv0[1].at > conv0[0].at);
        let az = data_file("traces/azure/AzureLLMInferenceTrace_conv.csv").unwrap();
        let rows = read_azure(&az, 100).unwrap();
        assert_eq!(rows.len(), 100);
        assert_eq!(rows[0].at, 0.0);
        assert!(rows.windows(2).all(|r| r[0].at <= r[1].at));
    }
}
