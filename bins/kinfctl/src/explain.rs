//! `kinfctl explain`: where a running router would send a request body, and why. Posts the
//! body to the admin port's `POST /debug/explain`, which tokenizes, hashes and scores it
//! exactly as the data plane would, without forwarding it or changing any routing state.
//!
//! The body is read from `--body FILE` or stdin, and is sent as given except for `model` when
//! `--model` overrides it.

use std::fmt::Write as _;
use std::io::Read;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use kinference_proxy::api::{CandidateScore, ExplainResponse};
use serde_json::Value;

use crate::status::{table, Admin, AdminArgs};

#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    #[command(flatten)]
    admin: AdminArgs,
    /// A completions or chat request body (JSON); default: read from stdin.
    #[arg(long)]
    body: Option<PathBuf>,
    /// Sets the body's `model`.
    #[arg(long)]
    model: Option<String>,
    /// `chat` or `completions`; default: a body with `messages` is chat.
    #[arg(long, value_parser = ["chat", "completions"])]
    api: Option<String>,
    /// The router's answer (`ExplainResponse`) as one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &ExplainArgs) -> Result<String> {
    let raw = match &args.body {
        Some(path) => std::fs::read(path)
            .with_context(|| format!("reading the request body {}", path.display()))?,
        None => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .context("reading the request body from stdin")?;
            buf
        }
    };
    let body = request_body(&raw, args.model.as_deref())?;
    let admin = Admin::new(&args.admin)?;
    let path = match &args.api {
        Some(api) => format!("/debug/explain?api={api}"),
        None => "/debug/explain".to_owned(),
    };
    let answer: ExplainResponse = admin.post(&path, body)?;
    if args.json {
        return Ok(format!("{}\n", serde_json::to_string(&answer)?));
    }
    Ok(render(&answer))
}

/// The bytes to post: the input unchanged, or with `model` replaced.
fn request_body(raw: &[u8], model: Option<&str>) -> Result<Vec<u8>> {
    let from = "the request body (from --body or stdin)";
    let mut value: Value =
        serde_json::from_slice(raw).with_context(|| format!("{from} is not JSON"))?;
    let Value::Object(fields) = &mut value else {
        bail!("{from} must be a JSON object (a completions or chat request)");
    };
    let Some(model) = model else {
        // Unchanged bytes: the router sees exactly what a client would send.
        return Ok(raw.to_vec());
    };
    fields.insert("model".into(), model.into());
    Ok(serde_json::to_vec(&value)?)
}

/// The decision first, then every candidate, best first.
pub fn render(e: &ExplainResponse) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "pool {}, model {}, {}: {} prompt tokens, {} full blocks of {}",
        e.pool, e.model, e.api, e.prompt_tokens, e.blocks, e.block_size
    );
    if let Some(err) = &e.tokenize_error {
        let _ = writeln!(out, "! not tokenized, routed by load only: {err}");
    }
    match e.chosen.as_deref() {
        Some(chosen) => {
            let url = e
                .candidates
                .iter()
                .find(|c| c.worker == chosen)
                .map(|c| format!(" ({})", c.replica))
                .unwrap_or_default();
            let _ = writeln!(
                out,
                "chosen: {chosen}{url}, reason {}, policy {}",
                e.reason, e.policy
            );
        }
        None => {
            let _ = writeln!(
                out,
                "chosen: none (no replica available), reason {}, policy {}",
                e.reason, e.policy
            );
        }
    }
    let mut rows = vec![[
        "#",
        "WORKER",
        "REPLICA",
        "GPU",
        "OFFLOADED",
        "SPECULATIVE",
        "CACHED-TOKENS",
        "LOAD",
        "OVER-CAP",
        "SCORABLE",
        "SCORE",
    ]
    .map(String::from)
    .to_vec()];
    rows.extend(
        e.candidates
            .iter()
            .enumerate()
            .map(|(i, c)| candidate_row(i + 1, c)),
    );
    out.push_str(&table(&rows, "  "));
    out
}

fn candidate_row(place: usize, c: &CandidateScore) -> Vec<String> {
    vec![
        place.to_string(),
        c.worker.clone(),
        c.replica.clone(),
        c.gpu_blocks.to_string(),
        c.offloaded_blocks.to_string(),
        c.speculative_blocks.to_string(),
        c.predicted_cached_tokens.to_string(),
        format!("{:.2}", c.load),
        if c.over_cap { "yes" } else { "no" }.into(),
        if c.scorable { "yes" } else { "NO" }.into(),
        format!("{:.3}", c.value),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_kept_byte_for_byte_unless_the_model_is_set() {
        let raw = br#"{"prompt": "hi",  "max_tokens": 1}"#;
        assert_eq!(request_body(raw, None).unwrap(), raw.to_vec());
        let set: Value = serde_json::from_slice(&request_body(raw, Some("m")).unwrap()).unwrap();
        assert_eq!(set["model"], "m");
        assert_eq!(set["prompt"], "hi");
        assert!(request_body(b"[1]", None).is_err());
        assert!(request_body(b"{", Some("m")).is_err());
    }
}
