//! Reading the Mooncake conversation trace (FAST'25 release) into engine requests.
//!
//! Each trace line gives an arrival time (ms), input and output lengths and the ids of the
//! prompt's 512-token prefix blocks. Each id becomes 512 pseudo-random token ids seeded by the
//! id, so requests sharing ids share token prefixes (and hence vLLM block hashes); the last
//! block is cut to the input length. The mapping is deterministic: the same line always gives
//! the same prompt.

use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};

use kinference_sim::request::{pseudo_token, splitmix64};
use kinference_sim::{Arrival, Request, SimTime};
use serde::Deserialize;

/// Tokens per Mooncake hash id.
pub const TRACE_BLOCK: usize = 512;

/// One request of the trace, as published.
#[derive(Clone, Debug, Deserialize)]
pub struct TraceLine {
    pub timestamp: u64,
    pub input_length: usize,
    pub output_length: u32,
    pub hash_ids: Vec<u64>,
}

/// Which lines to keep: at most `limit` lines, arriving before `until_ms` (trace time).
#[derive(Clone, Copy, Debug)]
pub struct Slice {
    pub limit: usize,
    pub until_ms: u64,
}

/// The conversation trace in the shared reference data, found from this crate's directory.
/// The file is required: a missing one is an error naming the path looked at.
pub fn default_trace_path() -> Result<PathBuf, Box<dyn Error>> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/traces/mooncake/conversation_trace.jsonl");
    p.canonicalize().map_err(|e| {
        format!(
            "the Mooncake conversation trace is required at {}: {e}",
            p.display()
        )
        .into()
    })
}

/// Reads the lines of `path` selected by `slice`, in file (= arrival) order.
pub fn read_trace(path: &Path, slice: Slice) -> Result<Vec<TraceLine>, Box<dyn Error>> {
    let text = fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if out.len() >= slice.limit {
            break;
        }
        let l: TraceLine = serde_json::from_str(line)
            .map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))?;
        if l.timestamp >= slice.until_ms {
            break;
        }
        out.push(l);
    }
    Ok(out)
}

/// The prompt of one trace line: 512 tokens per hash id, cut to `input_length`.
pub fn prompt(line: &TraceLine, vocab: u32) -> Vec<u32> {
    let mut p = Vec::with_capacity(line.input_length);
    for &id in &line.hash_ids {
        let seed = splitmix64(id ^ 0x6d6f_6f6e_6361_6b65);
        let take = line.input_length.saturating_sub(p.len()).min(TRACE_BLOCK);
        p.extend((0..take as u64).map(|j| pseudo_token(seed, j, vocab)));
        if p.len() >= line.input_length {
            break;
        }
    }
    p
}

/// Line `i` as an arrival: request id `req-{i}`, at least one output token.
pub fn arrival(i: usize, line: &TraceLine, vocab: u32) -> Arrival {
    Arrival {
        at: SimTime::from_millis(line.timestamp),
        request: Request::new(
            format!("req-{i}"),
            prompt(line, vocab),
            line.output_length.max(1),
        ),
    }
}
