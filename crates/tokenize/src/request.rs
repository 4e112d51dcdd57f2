//! The parts of OpenAI-style request bodies that decide the token ids vLLM hashes: chat
//! (`/v1/chat/completions`, `/tokenize` with `messages`) and completions (`/v1/completions`,
//! `/tokenize` with `prompt`). Every other field is ignored. Parsing never panics: bad JSON or a
//! wrong shape is a [`TokenizeError::InvalidRequest`].

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde::Deserialize;

use crate::error::{Result, TokenizeError};
use crate::json::{Json, Map};
use crate::walk::{Seen, Walker};

fn default_true() -> bool {
    true
}

/// A chat request (the fields vLLM's chat preprocessing reads). Message texts without escapes
/// borrow the body's bytes (`'a`); the rest of the request is owned.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest<'a> {
    /// The conversation.
    #[serde(borrow)]
    pub messages: Vec<ChatMessage<'a>>,
    /// Tool (function) definitions; rendered by templates that support tools.
    #[serde(default)]
    pub tools: Option<Vec<Json>>,
    /// Only checked for consistency with `tools`, as vLLM does.
    #[serde(default)]
    pub tool_choice: Option<Json>,
    /// Append the assistant header (vLLM's default: true).
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// Leave the last message open for the model to continue (default false).
    #[serde(default)]
    pub continue_final_message: bool,
    /// Add the tokenizer's special tokens (BOS) on top of the template's (default false).
    #[serde(default)]
    pub add_special_tokens: bool,
    /// Extra template variables (`enable_thinking`, ...).
    #[serde(default)]
    pub chat_template_kwargs: Option<Map>,
    /// RAG documents, passed to the template as `documents`.
    #[serde(default)]
    pub documents: Option<Vec<Json>>,
    /// Passed to the template as `reasoning_effort`; also sets `enable_thinking` like vLLM.
    #[serde(default)]
    pub reasoning_effort: Option<String>,
    /// A request-supplied template: refused, as vLLM refuses it unless started with
    /// `--trust-request-chat-template`.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Not read for tokenization: the model a router routes by, parsed with the rest so the
    /// body is read once.
    #[serde(default)]
    pub model: Option<String>,
    /// Not read for tokenization: vLLM's per-request salt of the block hashes.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

/// One message of a chat request. The fields most messages lack are boxed: serde grows the
/// messages' list by doubling and moves each message into it, and with them inline a message
/// was 440 bytes (120 now), each copied again as the list grew.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage<'a> {
    /// `system`, `developer`, `user`, `assistant`, `tool` (kept without an allocation), or a
    /// custom role (kept as sent).
    #[serde(deserialize_with = "role")]
    pub role: Cow<'static, str>,
    /// A string, a list of content parts, or absent/null.
    #[serde(default, borrow)]
    pub content: Option<MessageContent<'a>>,
    /// Participant or function name.
    #[serde(default)]
    pub name: Option<Box<Json>>,
    /// Assistant tool calls (`arguments` may be a JSON string; it is parsed as vLLM does).
    #[serde(default)]
    pub tool_calls: Option<Box<Json>>,
    /// The tool call a `tool` message answers.
    #[serde(default)]
    pub tool_call_id: Option<Box<Json>>,
    /// Assistant reasoning for interleaved thinking (vLLM passes it as `reasoning` and
    /// `reasoning_content`).
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Tools attached to a `developer` message.
    #[serde(default)]
    pub tools: Option<Box<Json>>,
    /// Model-specific task marker (passed through).
    #[serde(default)]
    pub task: Option<Box<Json>>,
}

/// Message content as sent.
#[derive(Debug, Clone)]
pub enum MessageContent<'a> {
    /// Plain text: borrowed from the body unless it had escapes to undo.
    Text(Cow<'a, str>),
    /// Content parts (`{"type": "text", "text": ...}`, ...), kept as JSON.
    Parts(Vec<Json>),
}

impl MessageContent<'_> {
    /// The same content, owning its text.
    pub fn into_owned(self) -> MessageContent<'static> {
        match self {
            MessageContent::Text(t) => MessageContent::Text(Cow::Owned(t.into_owned())),
            MessageContent::Parts(p) => MessageContent::Parts(p),
        }
    }
}

/// The roles of the OpenAI API: every message names one, so they are not allocated per message.
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A role as kept: one of [`ROLES`] borrowed, any other string owned.
fn known_role(v: &str) -> Cow<'static, str> {
    match ROLES.iter().find(|r| **r == v) {
        Some(r) => Cow::Borrowed(r),
        None => Cow::Owned(v.to_owned()),
    }
}

/// A message's role: one of [`ROLES`] borrowed, any other string owned.
fn role<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Cow<'static, str>, D::Error> {
    struct RoleVisitor;

    impl Visitor<'_> for RoleVisitor {
        type Value = Cow<'static, str>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E>(self, v: &str) -> std::result::Result<Cow<'static, str>, E> {
            Ok(known_role(v))
        }
    }

    d.deserialize_str(RoleVisitor)
}

/// What `#[serde(untagged)]` accepted (a string, or an array of any JSON values), read in one
/// pass: untagged buffered every content into serde's generic `Content` first and copied the text
/// out of it again, and contents are most of a chat request's bytes. A text the parser can lend
/// whole (no escapes) is borrowed, not copied.
impl<'de: 'a, 'a> Deserialize<'de> for MessageContent<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct ContentVisitor<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for ContentVisitor<'a> {
            type Value = MessageContent<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string or a list of content parts")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Self::Value, E> {
                Ok(MessageContent::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
                Ok(MessageContent::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
                Ok(MessageContent::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                let mut parts = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(part) = seq.next_element::<Json>()? {
                    parts.push(part);
                }
                Ok(MessageContent::Parts(parts))
            }
        }

        d.deserialize_any(ContentVisitor(std::marker::PhantomData))
    }
}

/// A JSON body as text, its UTF-8 checked in one pass over all of it (SIMD where the CPU has
/// it) instead of string by string as `serde_json::from_slice` does: the bodies are mostly
/// message text, and checking it cost as many instructions as the rest of the scan for string
/// ends. The same bodies are refused, invalid UTF-8 anywhere being invalid JSON.
fn utf8(body: &[u8]) -> Result<&str> {
    simdutf8::basic::from_utf8(body).map_err(|_| {
        // Only for the error's position.
        let at = std::str::from_utf8(body)
            .err()
            .map_or(body.len(), |e| e.valid_up_to());
        TokenizeError::InvalidRequest(format!(
            "the request body is not valid UTF-8 (at byte {at})"
        ))
    })
}

/// The body read by serde_json alone: the reference [`crate::walk`] answers as, and what reads
/// every body the walker leaves.
fn reference<'de, T: Deserialize<'de>>(text: &'de str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| TokenizeError::InvalidRequest(e.to_string()))
}

/// A body read by its walker, or by serde_json whole where the walker gives up.
fn parse<'de, T: Deserialize<'de>>(body: &'de [u8], walk: fn(&'de str) -> Option<T>) -> Result<T> {
    let text = utf8(body)?;
    walk(text).map_or_else(|| reference(text), Ok)
}

/// Reads a member's value with serde_json as the field's type, once per object.
macro_rules! field {
    ($w:expr, $seen:expr, $i:expr, $slot:expr) => {{
        $seen.first($i)?;
        $slot = $w.value()?;
    }};
}

impl<'a> ChatRequest<'a> {
    /// Parses a request body; the request borrows message texts from it.
    pub fn from_json(body: &'a [u8]) -> Result<Self> {
        parse(body, Self::walk)
    }

    /// [`ChatRequest::from_json`] by serde_json alone, for tests and fuzzing to compare with.
    pub fn from_json_reference(body: &'a [u8]) -> Result<Self> {
        reference(utf8(body)?)
    }

    /// The request as serde's derived reader reads it, or `None` (see [`crate::walk`]).
    fn walk(text: &'a str) -> Option<Self> {
        let mut w = Walker::new(text);
        let mut r = ChatRequest::from_messages(Vec::new());
        let mut seen = Seen::default();
        w.object(|w, key| {
            match key.as_ref() {
                "messages" => {
                    seen.first(0)?;
                    w.array(|w| {
                        r.messages.push(ChatMessage::walk(w)?);
                        Some(())
                    })?;
                }
                "tools" => field!(w, seen, 1, r.tools),
                "tool_choice" => field!(w, seen, 2, r.tool_choice),
                "add_generation_prompt" => field!(w, seen, 3, r.add_generation_prompt),
                "continue_final_message" => field!(w, seen, 4, r.continue_final_message),
                "add_special_tokens" => field!(w, seen, 5, r.add_special_tokens),
                "chat_template_kwargs" => field!(w, seen, 6, r.chat_template_kwargs),
                "documents" => field!(w, seen, 7, r.documents),
                "reasoning_effort" => field!(w, seen, 8, r.reasoning_effort),
                "chat_template" => field!(w, seen, 9, r.chat_template),
                "model" => field!(w, seen, 10, r.model),
                "cache_salt" => field!(w, seen, 11, r.cache_salt),
                _ => {
                    w.value::<IgnoredAny>()?;
                }
            }
            Some(())
        })?;
        (seen.has(0) && w.at_end()).then_some(r)
    }

    /// A request with these messages and vLLM's defaults for everything else.
    pub fn from_messages(messages: Vec<ChatMessage<'a>>) -> Self {
        ChatRequest {
            messages,
            tools: None,
            tool_choice: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
            chat_template_kwargs: None,
            documents: None,
            reasoning_effort: None,
            chat_template: None,
            model: None,
            cache_salt: None,
        }
    }
}

impl<'a> ChatMessage<'a> {
    /// One message as serde's derived reader reads it, or `None`.
    fn walk(w: &mut Walker<'a>) -> Option<Self> {
        let mut m = ChatMessage {
            role: Cow::Borrowed(""),
            content: None,
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning: None,
            tools: None,
            task: None,
        };
        let mut seen = Seen::default();
        w.object(|w, key| {
            match key.as_ref() {
                "role" => {
                    seen.first(0)?;
                    m.role = known_role(&w.string()?);
                }
                "content" => {
                    seen.first(1)?;
                    m.content = match w.peek()? {
                        b'"' => Some(MessageContent::Text(w.string()?)),
                        _ => w.value()?,
                    };
                }
                "name" => field!(w, seen, 2, m.name),
                "tool_calls" => field!(w, seen, 3, m.tool_calls),
                "tool_call_id" => field!(w, seen, 4, m.tool_call_id),
                "reasoning" => field!(w, seen, 5, m.reasoning),
                "tools" => field!(w, seen, 6, m.tools),
                "task" => field!(w, seen, 7, m.task),
                _ => {
                    w.value::<IgnoredAny>()?;
                }
            }
            Some(())
        })?;
        seen.has(0).then_some(m)
    }
}

impl ChatMessage<'static> {
    /// A message with plain text content (owned).
    pub fn text(role: &str, content: &str) -> Self {
        ChatMessage {
            role: Cow::Owned(role.to_owned()),
            content: Some(MessageContent::Text(Cow::Owned(content.to_owned()))),
            name: None,
            tool_calls: None,
            tool_call_id: None,
            reasoning: None,
            tools: None,
            task: None,
        }
    }
}

/// The `prompt` of a completions request, in the four forms the OpenAI API allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionPrompt<'a> {
    /// One text prompt: borrowed from the body unless it had escapes to undo.
    Text(Cow<'a, str>),
    /// One prompt given as token ids (used as is).
    Ids(Vec<u32>),
    /// Several text prompts (a batch: vLLM runs each as its own request).
    Texts(Vec<String>),
    /// Several prompts given as token ids.
    IdLists(Vec<Vec<u32>>),
}

/// What `#[serde(untagged)]` accepted, read in one pass: untagged buffered the prompt into
/// serde's generic `Content` and copied the text out again (a prompt is most of a completions
/// request's bytes). An array's first element decides which list it is; an empty one is
/// `Ids`, as untagged tried `Ids` first. Tested against the untagged enum.
impl<'de: 'a, 'a> Deserialize<'de> for CompletionPrompt<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        /// The first element of an array prompt.
        enum First {
            Id(u32),
            Text(String),
            Ids(Vec<u32>),
        }

        impl<'de> Deserialize<'de> for First {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                struct FirstVisitor;

                impl<'de> Visitor<'de> for FirstVisitor {
                    type Value = First;

                    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                        f.write_str("a token id, a string or a list of token ids")
                    }
                    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<First, E> {
                        u32::try_from(v)
                            .map(First::Id)
                            .map_err(|_| E::invalid_value(de::Unexpected::Unsigned(v), &self))
                    }
                    fn visit_str<E>(self, v: &str) -> std::result::Result<First, E> {
                        Ok(First::Text(v.to_owned()))
                    }
                    fn visit_string<E>(self, v: String) -> std::result::Result<First, E> {
                        Ok(First::Text(v))
                    }
                    fn visit_seq<A: SeqAccess<'de>>(
                        self,
                        seq: A,
                    ) -> std::result::Result<First, A::Error> {
                        rest(Vec::new(), seq).map(First::Ids)
                    }
                }

                d.deserialize_any(FirstVisitor)
            }
        }

        /// `first` and the rest of `seq`, each a `T`.
        fn rest<'de, T: Deserialize<'de>, A: SeqAccess<'de>>(
            first: Vec<T>,
            mut seq: A,
        ) -> std::result::Result<Vec<T>, A::Error> {
            let mut all = first;
            all.reserve(seq.size_hint().unwrap_or(0).min(64 * 1024));
            while let Some(x) = seq.next_element()? {
                all.push(x);
            }
            Ok(all)
        }

        struct PromptVisitor<'a>(std::marker::PhantomData<&'a ()>);

        impl<'de: 'a, 'a> Visitor<'de> for PromptVisitor<'a> {
            type Value = CompletionPrompt<'a>;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a string, a list of strings, a list of token ids or a list of lists of \
                     token ids",
                )
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> std::result::Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> std::result::Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> std::result::Result<Self::Value, E> {
                Ok(CompletionPrompt::Text(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Self::Value, A::Error> {
                Ok(match seq.next_element::<First>()? {
                    None => CompletionPrompt::Ids(Vec::new()),
                    Some(First::Id(id)) => CompletionPrompt::Ids(rest(vec![id], seq)?),
                    Some(First::Text(t)) => CompletionPrompt::Texts(rest(vec![t], seq)?),
                    Some(First::Ids(ids)) => CompletionPrompt::IdLists(rest(vec![ids], seq)?),
                })
            }
        }

        d.deserialize_any(PromptVisitor(std::marker::PhantomData))
    }
}

/// A completions request (the fields that decide its token ids). A text prompt without
/// escapes borrows the body's bytes (`'a`).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest<'a> {
    /// The prompt or prompts.
    #[serde(borrow)]
    pub prompt: CompletionPrompt<'a>,
    /// Add the tokenizer's special tokens (vLLM's default for completions: true).
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    /// Not read for tokenization: the model a router routes by, parsed with the rest so the
    /// body is read once.
    #[serde(default)]
    pub model: Option<String>,
    /// Not read for tokenization: vLLM's per-request salt of the block hashes.
    #[serde(default)]
    pub cache_salt: Option<String>,
}

impl<'a> CompletionRequest<'a> {
    /// Parses a request body; a text prompt borrows from it.
    pub fn from_json(body: &'a [u8]) -> Result<Self> {
        parse(body, Self::walk)
    }

    /// [`CompletionRequest::from_json`] by serde_json alone, for tests and fuzzing to compare
    /// with.
    pub fn from_json_reference(body: &'a [u8]) -> Result<Self> {
        reference(utf8(body)?)
    }

    /// The request as serde's derived reader reads it, or `None` (see [`crate::walk`]).
    fn walk(text: &'a str) -> Option<Self> {
        let mut w = Walker::new(text);
        let mut prompt = None;
        let mut r = CompletionRequest {
            prompt: CompletionPrompt::Ids(Vec::new()),
            add_special_tokens: true,
            model: None,
            cache_salt: None,
        };
        let mut seen = Seen::default();
        w.object(|w, key| {
            match key.as_ref() {
                "prompt" => {
                    seen.first(0)?;
                    prompt = Some(match w.peek()? {
                        b'"' => CompletionPrompt::Text(w.string()?),
                        _ => w.value()?,
                    });
                }
                "add_special_tokens" => field!(w, seen, 1, r.add_special_tokens),
                "model" => field!(w, seen, 2, r.model),
                "cache_salt" => field!(w, seen, 3, r.cache_salt),
                _ => {
                    w.value::<IgnoredAny>()?;
                }
            }
            Some(())
        })?;
        r.prompt = prompt?;
        w.at_end().then_some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content(json: &str) -> Result<Option<MessageContent<'static>>> {
        let body = format!(r#"{{"messages": [{{"role": "user"{json}}}]}}"#);
        let mut req = ChatRequest::from_json(body.as_bytes())?;
        Ok(req
            .messages
            .pop()
            .and_then(|m| m.content)
            .map(MessageContent::into_owned))
    }

    #[test]
    fn known_roles_are_borrowed_and_any_other_is_kept_as_sent() {
        let roles = |json: &str| -> Result<Vec<Cow<'static, str>>> {
            let body = format!(r#"{{"messages": {json}}}"#);
            let req = ChatRequest::from_json(body.as_bytes())?;
            Ok(req.messages.into_iter().map(|m| m.role).collect())
        };
        let got = roles(
            r#"[{"role": "system"}, {"role": "us\u0065r"}, {"role": "assistant"},
                {"role": "tool"}, {"role": "developer"}, {"role": "User"}, {"role": "critic"}]"#,
        )
        .unwrap();
        let want = [
            "system",
            "user",
            "assistant",
            "tool",
            "developer",
            "User",
            "critic",
        ];
        assert_eq!(got, want);
        let borrowed: Vec<bool> = got.iter().map(|r| matches!(r, Cow::Borrowed(_))).collect();
        assert_eq!(borrowed, [true, true, true, true, true, false, false]);
        for bad in [
            r#"[{"role": 1}]"#,
            r#"[{"role": null}]"#,
            r#"[{"content": "hi"}]"#,
        ] {
            assert!(roles(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn bodies_that_are_not_utf8_are_refused_where_serde_json_refuses_them() {
        let good = r#"{"model": "m", "messages": [{"role": "user", "content": "h\u00e9 é 😀"}]}"#;
        let req = ChatRequest::from_json(good.as_bytes()).unwrap();
        assert!(
            matches!(&req.messages[0].content, Some(MessageContent::Text(t)) if t == "hé é 😀")
        );
        let mut bad = good.as_bytes().to_vec();
        let at = good.find('é').unwrap();
        // A lone continuation byte, a truncated sequence, an overlong form: in a string and
        // outside one.
        for (pos, bytes) in [
            (at, &[0x80u8][..]),
            (at, &[0xc3][..]),
            (at, &[0xc0, 0xaf][..]),
            (1, &[0xff][..]),
        ] {
            bad.splice(pos..pos, bytes.iter().copied());
            assert!(serde_json::from_slice::<serde_json::Value>(&bad).is_err());
            match ChatRequest::from_json(&bad) {
                Err(TokenizeError::InvalidRequest(m)) => {
                    assert!(m.contains(&format!("at byte {pos}")), "{m}")
                }
                other => panic!("{other:?}"),
            }
            assert!(CompletionRequest::from_json(&bad).is_err());
            bad = good.as_bytes().to_vec();
        }
    }

    /// The reference: what the prompt was parsed with before it had its own visitor.
    #[derive(Debug, Deserialize)]
    #[serde(untagged)]
    enum UntaggedPrompt {
        Text(String),
        Ids(Vec<u32>),
        Texts(Vec<String>),
        IdLists(Vec<Vec<u32>>),
    }

    impl From<UntaggedPrompt> for CompletionPrompt<'static> {
        fn from(p: UntaggedPrompt) -> Self {
            match p {
                UntaggedPrompt::Text(t) => CompletionPrompt::Text(t.into()),
                UntaggedPrompt::Ids(v) => CompletionPrompt::Ids(v),
                UntaggedPrompt::Texts(v) => CompletionPrompt::Texts(v),
                UntaggedPrompt::IdLists(v) => CompletionPrompt::IdLists(v),
            }
        }
    }

    /// The visitor accepts what the untagged enum accepted, as the same variant, and refuses
    /// what it refused: hand-picked shapes, then seeded random JSON built from the pieces a
    /// prompt is made of (strings with escapes, ids at and past `u32`'s bounds, negatives,
    /// floats, nesting, nulls, objects).
    #[test]
    fn prompts_parse_as_the_untagged_enum_parsed_them() {
        use rand::{Rng, SeedableRng};
        let check = |json: &str| {
            let ours = serde_json::from_str::<CompletionPrompt>(json).ok();
            let reference = serde_json::from_str::<UntaggedPrompt>(json)
                .ok()
                .map(CompletionPrompt::from);
            assert_eq!(ours, reference, "{json}");
            ours.is_some()
        };
        let picked = [
            r#""plain""#,
            r#""a\n\"b\"\u00e9""#,
            "[]",
            "[1, 2, 4294967295]",
            "[4294967296]",
            "[-1]",
            "[1.5]",
            r#"["a", "b"]"#,
            "[[1, 2], [], [3]]",
            "[[]]",
            r#"[1, "a"]"#,
            r#"["a", 1]"#,
            "[[1], 2]",
            "[[1, -2]]",
            r#"[["a"]]"#,
            "[null]",
            "null",
            "1",
            "{}",
            r#"[{"a": 1}]"#,
            "[1, 2",
        ];
        for json in picked {
            check(json);
        }
        fn value(r: &mut rand_chacha::ChaCha8Rng, depth: u32) -> String {
            match r.gen_range(0..if depth < 2 { 9 } else { 7 }) {
                0 => format!("{}", r.gen_range(0..1000u64)),
                1 => ["4294967295", "4294967296", "-1", "0", "1.0", "1e3"][r.gen_range(0..6)]
                    .to_owned(),
                2 | 3 => {
                    let s = ["x", "é", "\\n", "\\\"", "\\u00e9", " ", "😀"];
                    let n = r.gen_range(0..4);
                    format!(
                        "\"{}\"",
                        (0..n)
                            .map(|_| s[r.gen_range(0..s.len())])
                            .collect::<String>()
                    )
                }
                4 => "null".to_owned(),
                5 => "true".to_owned(),
                6 => r#"{"k": 1}"#.to_owned(),
                _ => {
                    let n = r.gen_range(0..4);
                    let items: Vec<String> = (0..n).map(|_| value(r, depth + 1)).collect();
                    format!("[{}]", items.join(", "))
                }
            }
        }
        let mut r = rand_chacha::ChaCha8Rng::seed_from_u64(17);
        let mut accepted = 0;
        for _ in 0..20_000 {
            // Arrays most of the time: a uniform element type is what makes them valid.
            let json = if r.gen_bool(0.8) {
                let kind = r.gen_range(0..3);
                let n = r.gen_range(0..5);
                let items: Vec<String> = (0..n)
                    .map(|_| match (kind, r.gen_bool(0.9)) {
                        (0, true) => format!("{}", r.gen_range(0..100_000u64)),
                        (1, true) => format!("\"w{}\\n\"", r.gen_range(0..9)),
                        (2, true) => format!("[{}]", r.gen_range(0..9)),
                        _ => value(&mut r, 1),
                    })
                    .collect();
                format!("[{}]", items.join(", "))
            } else {
                value(&mut r, 0)
            };
            accepted += usize::from(check(&json));
        }
        // Both outcomes were exercised.
        assert!((2_000..18_000).contains(&accepted), "{accepted}");
    }

    /// The rarely sent fields stay boxed: the parse moves every message again as the list of
    /// messages grows (440 bytes a message with them inline).
    #[test]
    fn a_chat_message_stays_small() {
        let size = std::mem::size_of::<ChatMessage<'static>>();
        assert!(size <= 128, "{size} bytes");
    }

    #[test]
    fn content_is_a_string_a_list_or_nothing() {
        let text = |c| match c {
            Ok(Some(MessageContent::Text(t))) => Some(t),
            _ => None,
        };
        assert_eq!(
            text(content(r#", "content": "plain""#)).as_deref(),
            Some("plain")
        );
        assert_eq!(
            text(content(r#", "content": "a\n\"b\"\u00e9\ud83d\ude00""#)).as_deref(),
            Some("a\n\"b\"é😀")
        );
        match content(r#", "content": ["s", {"type": "text", "text": "t"}, 1, null]"#) {
            Ok(Some(MessageContent::Parts(p))) => assert_eq!(
                Json::Array(p).to_string(),
                r#"["s",{"type":"text","text":"t"},1,null]"#
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            content(r#", "content": []"#),
            Ok(Some(MessageContent::Parts(p))) if p.is_empty()
        ));
        assert!(matches!(content(r#", "content": null"#), Ok(None)));
        assert!(matches!(content(""), Ok(None)));
        // A text the body holds as it is is borrowed from it; one with escapes is unescaped.
        let body = r#"{"messages": [{"role": "user", "content": "plain é"},
                                     {"role": "user", "content": "esc\naped"}]}"#;
        let req = ChatRequest::from_json(body.as_bytes()).unwrap();
        let texts: Vec<(bool, &str)> = req
            .messages
            .iter()
            .filter_map(|m| match &m.content {
                Some(MessageContent::Text(t)) => Some((matches!(t, Cow::Borrowed(_)), t.as_ref())),
                _ => None,
            })
            .collect();
        assert_eq!(texts, [(true, "plain é"), (false, "esc\naped")]);
        let prompt = |body: &'static str| CompletionRequest::from_json(body.as_bytes()).unwrap();
        assert!(matches!(
            prompt(r#"{"prompt": "plain é"}"#).prompt,
            CompletionPrompt::Text(Cow::Borrowed("plain é"))
        ));
        assert!(matches!(
            prompt(r#"{"prompt": "a\u0062"}"#).prompt,
            CompletionPrompt::Text(Cow::Owned(t)) if t == "ab"
        ));
        for bad in ["1", "true", "{}", r#"{"type": "text"}"#, r#"["unclosed"#] {
            let got = content(&format!(r#", "content": {bad}"#));
            assert!(
                matches!(got, Err(TokenizeError::InvalidRequest(_))),
                "{bad}: {got:?}"
            );
        }
    }

    /// The walker reads bodies as serde_json's derived readers do, or leaves them to them:
    /// seeded random bodies of the fields both requests have, in any order, repeated, missing,
    /// of the wrong kind, null, with escaped keys, unknown fields of every JSON kind, odd
    /// whitespace and bytes after the body. Every body parses to the same request (or is
    /// refused) either way, and the walker read most of them itself.
    #[test]
    fn bodies_read_as_serde_json_reads_them() {
        use rand::{Rng, SeedableRng};
        type Rng8 = rand_chacha::ChaCha8Rng;
        /// A field's name and what writes a plausible value of it.
        type Field = (&'static str, fn(&mut Rng8) -> String);
        fn pick<'s>(r: &mut Rng8, xs: &[&'s str]) -> &'s str {
            xs[r.gen_range(0..xs.len())]
        }
        fn text(r: &mut Rng8) -> String {
            let pieces = [
                "hi",
                " ",
                "é",
                "😀",
                "\\n",
                "\\\"",
                "\\u00e9",
                "\\ud83d\\ude00",
                "\\t",
                "x",
                "\\u0000",
                "\\/",
            ];
            let n = r.gen_range(0..6);
            let body: String = (0..n).map(|_| pick(r, &pieces)).collect();
            format!("\"{body}\"")
        }
        fn any(r: &mut Rng8, depth: u32) -> String {
            match r.gen_range(0..if depth < 2 { 9 } else { 6 }) {
                0 => pick(r, &["0", "-1", "1.5", "1e3", "4294967296", "01", "1."]).to_owned(),
                1 => pick(r, &["true", "false", "null", "nul"]).to_owned(),
                2 | 3 => text(r),
                4 => "{}".to_owned(),
                5 => "[]".to_owned(),
                6 => {
                    let n = r.gen_range(0..3);
                    let items: Vec<String> = (0..n).map(|_| any(r, depth + 1)).collect();
                    format!("[{}]", items.join(", "))
                }
                _ => {
                    let n = r.gen_range(0..3);
                    let items: Vec<String> = (0..n)
                        .map(|_| format!("{}: {}", text(r), any(r, depth + 1)))
                        .collect();
                    format!("{{{}}}", items.join(", "))
                }
            }
        }
        fn ws(r: &mut Rng8) -> &'static str {
            pick(r, &["", "", " ", "\n\t ", "\r\n"])
        }
        fn object(r: &mut Rng8, members: Vec<(String, String)>) -> String {
            let inner: Vec<String> = members
                .into_iter()
                .map(|(k, v)| format!("{}{k}{}:{}{v}{}", ws(r), ws(r), ws(r), ws(r)))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
        fn key(r: &mut Rng8, name: &str) -> String {
            if r.gen_bool(0.05) {
                // The same key with its first letter escaped.
                let mut c = name.chars();
                let first = c.next().map_or(0, u32::from);
                format!("\"\\u{first:04x}{}\"", c.as_str())
            } else {
                format!("\"{name}\"")
            }
        }
        fn members(r: &mut Rng8, fields: &[Field]) -> String {
            let mut m: Vec<(String, String)> = Vec::new();
            for (k, v) in fields {
                if r.gen_bool(0.85) {
                    let value = if r.gen_bool(0.08) { any(r, 1) } else { v(r) };
                    m.push((key(r, k), value));
                }
            }
            if r.gen_bool(0.3) {
                m.push((text(r), any(r, 0)));
            }
            if r.gen_bool(0.05) && !m.is_empty() {
                let dup = m[r.gen_range(0..m.len())].clone();
                m.push(dup);
            }
            let n = m.len();
            for i in 0..n {
                m.swap(i, r.gen_range(0..n));
            }
            object(r, m)
        }
        fn role(r: &mut Rng8) -> String {
            pick(
                r,
                &[
                    "\"user\"",
                    "\"assistant\"",
                    "\"system\"",
                    "\"critic\"",
                    "\"us\\u0065r\"",
                ],
            )
            .to_owned()
        }
        fn content(r: &mut Rng8) -> String {
            match r.gen_range(0..6) {
                0 => "null".to_owned(),
                1 => r#"[{"type": "text", "text": "part"}, "s"]"#.to_owned(),
                _ => text(r),
            }
        }
        fn json(r: &mut Rng8) -> String {
            any(r, 0)
        }
        fn flag(r: &mut Rng8) -> String {
            pick(r, &["true", "false", "null"]).to_owned()
        }
        fn opt_text(r: &mut Rng8) -> String {
            if r.gen_bool(0.2) {
                "null".to_owned()
            } else {
                text(r)
            }
        }
        fn list(r: &mut Rng8) -> String {
            pick(
                r,
                &[
                    "[]",
                    r#"[{"type": "function", "function": {"name": "f"}}]"#,
                    "null",
                ],
            )
            .to_owned()
        }
        fn kwargs(r: &mut Rng8) -> String {
            pick(
                r,
                &["{}", r#"{"enable_thinking": false, "b": [1]}"#, "null"],
            )
            .to_owned()
        }
        fn message(r: &mut Rng8) -> String {
            if r.gen_bool(0.02) {
                return r#"["user", "as a list"]"#.to_owned();
            }
            let fields: [Field; 8] = [
                ("role", role),
                ("content", content),
                ("name", json),
                ("tool_calls", json),
                ("tool_call_id", json),
                ("reasoning", opt_text),
                ("tools", json),
                ("task", json),
            ];
            members(r, &fields)
        }
        fn messages(r: &mut Rng8) -> String {
            let n = r.gen_range(0..4);
            let items: Vec<String> = (0..n).map(|_| message(r)).collect();
            format!("[{}]", items.join(", "))
        }
        fn prompt(r: &mut Rng8) -> String {
            match r.gen_range(0..5) {
                0 => r#"[1, 2, 3]"#.to_owned(),
                1 => r#"["a", "b\n"]"#.to_owned(),
                _ => text(r),
            }
        }
        let chat: [Field; 12] = [
            ("messages", messages),
            ("tools", list),
            ("tool_choice", json),
            ("add_generation_prompt", flag),
            ("continue_final_message", flag),
            ("add_special_tokens", flag),
            ("chat_template_kwargs", kwargs),
            ("documents", list),
            ("reasoning_effort", opt_text),
            ("chat_template", opt_text),
            ("model", opt_text),
            ("cache_salt", opt_text),
        ];
        let completion: [Field; 4] = [
            ("prompt", prompt),
            ("add_special_tokens", flag),
            ("model", opt_text),
            ("cache_salt", opt_text),
        ];
        let mut r = Rng8::seed_from_u64(41);
        let (mut walked, mut accepted, mut total) = (0usize, 0usize, 0usize);
        for case in 0..40_000 {
            let chat_case = case % 2 == 0;
            let mut body = members(&mut r, if chat_case { &chat } else { &completion });
            match r.gen_range(0..40) {
                0 => body.push_str(" x"),
                1 => body.push('\n'),
                2 => body.truncate(body.len() - 1),
                3 => body = format!("[{body}]"),
                _ => {}
            }
            let (ours, reference, walker) = if chat_case {
                (
                    format!("{:?}", ChatRequest::from_json(body.as_bytes()).ok()),
                    format!(
                        "{:?}",
                        ChatRequest::from_json_reference(body.as_bytes()).ok()
                    ),
                    ChatRequest::walk(&body).is_some(),
                )
            } else {
                (
                    format!("{:?}", CompletionRequest::from_json(body.as_bytes()).ok()),
                    format!(
                        "{:?}",
                        CompletionRequest::from_json_reference(body.as_bytes()).ok()
                    ),
                    CompletionRequest::walk(&body).is_some(),
                )
            };
            assert_eq!(ours, reference, "{body}");
            total += 1;
            walked += usize::from(walker);
            accepted += usize::from(reference != "None");
            // The walker never reads a body serde_json refuses.
            assert!(!walker || reference != "None", "{body}");
        }
        eprintln!("the walker read {walked} of {accepted} accepted bodies ({total} in all)");
        // Both outcomes were exercised, and the walker read most accepted bodies.
        assert!(
            (total / 10..total * 9 / 10).contains(&accepted),
            "{accepted} of {total}"
        );
        assert!(walked * 10 > accepted * 6, "{walked} of {accepted}");
    }

    /// The walker names every field serde's derived readers know: a field added to a request
    /// or a message and not to its `walk` would be dropped by the walker as unknown. The lists
    /// below are the walkers' match arms; this test fails until both name a new field.
    #[test]
    fn the_walker_knows_every_field() {
        use std::cell::Cell;
        type Fields = &'static [&'static str];
        struct Capture<'c>(&'c Cell<Fields>);
        impl<'de> Deserializer<'de> for Capture<'_> {
            type Error = de::value::Error;
            fn deserialize_any<V: Visitor<'de>>(
                self,
                _: V,
            ) -> std::result::Result<V::Value, Self::Error> {
                Err(de::Error::custom("only structs are captured"))
            }
            fn deserialize_struct<V: Visitor<'de>>(
                self,
                _: &'static str,
                fields: Fields,
                _: V,
            ) -> std::result::Result<V::Value, Self::Error> {
                self.0.set(fields);
                Err(de::Error::custom("captured"))
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
                identifier ignored_any
            }
        }
        let fields = |f: fn(Capture<'_>) -> bool| {
            let cell = Cell::new(&[][..]);
            assert!(!f(Capture(&cell)));
            cell.get()
        };
        let chat = fields(|c| ChatRequest::deserialize(c).is_ok());
        let message = fields(|c| ChatMessage::deserialize(c).is_ok());
        let completion = fields(|c| CompletionRequest::deserialize(c).is_ok());
        assert_eq!(
            chat,
            [
                "messages",
                "tools",
                "tool_choice",
                "add_generation_prompt",
                "continue_final_message",
                "add_special_tokens",
                "chat_template_kwargs",
                "documents",
                "reasoning_effort",
                "chat_template",
                "model",
                "cache_salt"
            ]
        );
        assert_eq!(
            message,
            [
                "role",
                "content",
                "name",
                "tool_calls",
                "tool_call_id",
                "reasoning",
                "tools",
                "task"
            ]
        );
        assert_eq!(
            completion,
            ["prompt", "add_special_tokens", "model", "cache_salt"]
        );
    }
}
