//! Native renderers of widely used chat templates (Llama 3 and 3.1, Qwen3, DeepSeek-V3), each
//! used only for a template whose source is byte for byte the one it was written from (its
//! SHA-256), and only for requests inside what it models: text contents, no tools or documents,
//! none of the message fields the template reads besides role and content, no variable
//! shadowing a global the template calls. Every other request is rendered by minijinja
//! ([`crate::template`]), the reference; a renderer says `None` to send it there.
//!
//! Why: rendering the template was the largest part of routing a chat request, most of it the
//! interpreter's own work (its loop bookkeeping, and each `+` copying both sides) around a few
//! string appends per message. Invariant: for every request a renderer accepts, its text is
//! minijinja's byte for byte (`tests/native_render.rs`: every tokenizer of `../shared` whose
//! template is known, over 100,000 varied requests each).

use sha2::{Digest, Sha256};

use crate::conversation::{Prepared, TextMessage};
use crate::json::{Json, Map};
use crate::pyfmt::py_is_space;

/// A chat template this module renders natively.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Known {
    /// Meta Llama 3 Instruct: the assistant header always follows.
    Llama3,
    /// Meta Llama 3.1 as shipped in `llama3.1`: the header only with `add_generation_prompt`.
    Llama31,
    /// Qwen3's template (with its reasoning and tool branches).
    Qwen3,
    /// DeepSeek-V3's template.
    DeepSeekV3,
}

/// SHA-256 of each template's source, as its `tokenizer_config.json` holds it.
const SOURCES: [(&str, Known); 4] = [
    (
        "b48c47f6443892716176eb200bf4ef108f64e06ca26ed0fa8ebc0a4b3992fcb2",
        Known::Llama3,
    ),
    (
        "ba03a121d097859c7b5b9cd03af99aafe95275210d2876f642ad9929a150f122",
        Known::Llama31,
    ),
    (
        "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
        Known::Qwen3,
    ),
    (
        "3b8267e54b67df6500f231ffa969955cc9d26b3444a291ced4eb96ca7d3ca1ea",
        Known::DeepSeekV3,
    ),
];

impl Known {
    /// The renderer written from exactly this source, if any.
    pub(crate) fn of(source: &str) -> Option<Known> {
        let digest = Sha256::digest(source.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        SOURCES.iter().find(|(h, _)| *h == hex).map(|(_, k)| *k)
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Known::Llama3 => "llama3",
            Known::Llama31 => "llama3.1",
            Known::Qwen3 => "qwen3",
            Known::DeepSeekV3 => "deepseek-v3",
        }
    }

    /// The rendered prompt, or `None` when the request is outside what this renderer models.
    pub(crate) fn render(self, p: &Prepared<'_>, special_tokens: &Map) -> Option<String> {
        let messages = p.text_messages()?;
        let var = |name: &str| p.variable(special_tokens, name);
        let size = messages
            .iter()
            .map(|m| m.role.len() + m.content.len() + 32)
            .sum::<usize>()
            + 64;
        let mut out = String::with_capacity(size);
        match self {
            Known::Llama3 | Known::Llama31 => {
                let Some(Json::String(bos)) = var("bos_token") else {
                    return None;
                };
                llama3(&mut out, &messages, bos);
                if self == Known::Llama3 || p.add_generation_prompt() {
                    out.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
                }
            }
            Known::Qwen3 => {
                let plain = messages.iter().all(|m| {
                    m.role != "tool"
                        && !m.rest.contains_key("reasoning_content")
                        && !m.rest.contains_key("tool_calls")
                });
                if !plain || !p.no_tools_or_documents() || var("namespace").is_some() {
                    return None;
                }
                qwen3(&mut out, &messages);
                if p.add_generation_prompt() {
                    out.push_str("<|im_start|>assistant\n");
                    if matches!(var("enable_thinking"), Some(Json::Bool(false))) {
                        out.push_str("<think>\n\n</think>\n\n");
                    }
                }
            }
            Known::DeepSeekV3 => {
                let Some(Json::String(bos)) = var("bos_token") else {
                    return None;
                };
                if messages.iter().any(|m| m.role == "tool") || var("namespace").is_some() {
                    return None;
                }
                deepseek_v3(&mut out, &messages, bos);
                if p.add_generation_prompt() {
                    out.push_str("<｜Assistant｜>");
                }
            }
        }
        Some(out)
    }
}

/// Each message as `<|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>`,
/// the first after the BOS token.
fn llama3(out: &mut String, messages: &[TextMessage<'_>], bos: &str) {
    for (i, m) in messages.iter().enumerate() {
        if i == 0 {
            out.push_str(bos);
        }
        out.push_str("<|start_header_id|>");
        out.push_str(m.role);
        out.push_str("<|end_header_id|>\n\n");
        // jinja2's `trim`: Python's `str.strip()`.
        out.push_str(m.content.trim_matches(py_is_space));
        out.push_str("<|eot_id|>");
    }
}

/// Qwen3 without tools: a leading system message, then user and later system messages as they
/// are, and assistant messages with their reasoning moved into a `<think>` block after the last
/// real user query (and dropped before it).
fn qwen3(out: &mut String, messages: &[TextMessage<'_>]) {
    let first_system = messages.first().is_some_and(|m| m.role == "system");
    if first_system {
        if let Some(m) = messages.first() {
            push_all(out, &["<|im_start|>system\n", m.content, "<|im_end|>\n"]);
        }
    }
    // The last user message that is not a wrapped tool response (the last index when none).
    let last_query = messages
        .iter()
        .rposition(|m| {
            m.role == "user"
                && !(m.content.starts_with("<tool_response>")
                    && m.content.ends_with("</tool_response>"))
        })
        .unwrap_or(messages.len().saturating_sub(1));
    let last = messages.len().saturating_sub(1);
    for (i, m) in messages.iter().enumerate() {
        if m.role == "user" || (m.role == "system" && i != 0) {
            push_all(
                out,
                &["<|im_start|>", m.role, "\n", m.content, "<|im_end|>\n"],
            );
        } else if m.role == "assistant" {
            let (content, reasoning) = match m.content.contains("</think>") {
                true => {
                    // Python's `s.split(sep)[-1]` and `s.split(sep)[0]`.
                    let after = m.content.rsplit_once("</think>").map_or(m.content, |x| x.1);
                    let before = m.content.split_once("</think>").map_or(m.content, |x| x.0);
                    let before = before.trim_end_matches('\n');
                    let thought = before.rsplit_once("<think>").map_or(before, |x| x.1);
                    (
                        after.trim_start_matches('\n'),
                        thought.trim_start_matches('\n'),
                    )
                }
                false => (m.content, ""),
            };
            if i > last_query && (i == last || !reasoning.is_empty()) {
                push_all(
                    out,
                    &[
                        "<|im_start|>",
                        m.role,
                        "\n<think>\n",
                        reasoning.trim_matches('\n'),
                        "\n</think>\n\n",
                        content.trim_start_matches('\n'),
                    ],
                );
            } else {
                push_all(out, &["<|im_start|>", m.role, "\n", content]);
            }
            out.push_str("<|im_end|>\n");
        }
    }
}

/// DeepSeek-V3 without tool messages: BOS, the system messages joined by blank lines, then
/// user and assistant turns behind their markers.
fn deepseek_v3(out: &mut String, messages: &[TextMessage<'_>], bos: &str) {
    out.push_str(bos);
    let mut first = true;
    for m in messages.iter().filter(|m| m.role == "system") {
        if !first {
            out.push_str("\n\n");
        }
        out.push_str(m.content);
        first = false;
    }
    for m in messages {
        if m.role == "user" {
            push_all(out, &["<｜User｜>", m.content]);
        } else if m.role == "assistant" {
            push_all(
                out,
                &["<｜Assistant｜>", m.content, "<｜end▁of▁sentence｜>"],
            );
        }
    }
}

fn push_all(out: &mut String, parts: &[&str]) {
    for p in parts {
        out.push_str(p);
    }
}
