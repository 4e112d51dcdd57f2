//! From an OpenAI chat request to the variables a chat template sees, step for step as vLLM 0.32
//! builds them (`renderers/chat_utils.py::parse_chat_messages`, `renderers/hf.py::
//! safe_apply_chat_template`, `ChatCompletionRequest.build_chat_params`) and transformers passes
//! them (`apply_chat_template` → `render_jinja_template`):
//! - content becomes one string (text parts joined with `"\n"`) or a list of text parts,
//!   by the template's [`ContentFormat`]; null content is `""` / `[]`;
//! - assistant `tool_calls[].function.arguments` JSON strings become objects; empty
//!   `tool_calls` are dropped; `reasoning` is also given as `reasoning_content`;
//! - `developer` messages become `system` (merged into one leading system message) unless the
//!   template mentions the `developer` role;
//! - tools are normalized as vLLM's pydantic models dump them;
//! - `chat_template_kwargs`, `reasoning_effort`, `documents` and the special tokens are merged
//!   in vLLM's order.
//!
//! Messages keep vLLM's key order, since templates may print whole messages or tools.

use std::borrow::Cow;

use crate::json::{Json, Map};
use minijinja::Value;

use crate::content_format::ContentFormat;
use crate::error::{Result, TokenizeError};
use crate::request::{ChatMessage, ChatRequest, MessageContent};
use crate::value::{json_to_value, SmallMap};

/// transformers' marker for `continue_final_message`.
pub(crate) const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Parameters of `apply_chat_template` that it consumes instead of passing to the template.
const APPLY_PARAMS: [&str; 13] = [
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
];

const BILLING_HEADER: &str = "x-anthropic-billing-header";

/// A request's messages and template keyword arguments as vLLM normalizes them, before they
/// become template variables ([`Prepared::context`]) or go to a native renderer.
#[derive(Debug)]
pub(crate) struct Prepared<'a> {
    messages: Vec<Message<'a>>,
    kwargs: Map,
    add_generation_prompt: bool,
    /// The final message's text, when the render must be cut to continue it.
    pub continue_text: Option<String>,
}

/// One message seen by a native renderer: role, text content, the other fields.
pub(crate) struct TextMessage<'m> {
    pub role: &'m str,
    pub content: &'m str,
    pub rest: &'m Map,
}

/// Normalizes `req` for a template of content format `format` whose source is `template_src`.
pub(crate) fn prepare<'a>(
    req: &'a ChatRequest,
    format: ContentFormat,
    template_src: &str,
    default_kwargs: &Map,
) -> Result<Prepared<'a>> {
    validate(req)?;
    let mut messages = req
        .messages
        .iter()
        .map(|m| normalize_message(m, format))
        .collect::<Result<Vec<_>>>()?;
    if messages.iter().any(|m| m.role == "developer")
        && !template_src.contains("\"developer\"")
        && !template_src.contains("'developer'")
    {
        messages = consolidate_system(developer_to_system(messages));
    }
    let continue_text = if req.continue_final_message {
        Some(mark_final(&mut messages)?)
    } else {
        None
    };
    let tools = match &req.tools {
        Some(tools) => Some(
            tools
                .iter()
                .map(normalize_tool)
                .collect::<Result<Vec<_>>>()?,
        ),
        None => None,
    };
    let kwargs = merge_kwargs(req, tools, default_kwargs)?;
    Ok(Prepared {
        messages,
        kwargs,
        add_generation_prompt: req.add_generation_prompt,
        continue_text,
    })
}

impl Prepared<'_> {
    /// The template variables: the special tokens, then the keyword arguments (a later value
    /// replaces an earlier one in its place, as in a Python dict), then `tools`, `documents`,
    /// `add_generation_prompt` and `messages`.
    pub(crate) fn context(&self, special_tokens: &Map) -> Value {
        let mut ctx: Vec<(Value, Value)> =
            Vec::with_capacity(special_tokens.len() + self.kwargs.len() + 4);
        let mut set =
            |k: &str, v: Value| match ctx.iter_mut().find(|(key, _)| key.as_str() == Some(k)) {
                Some(slot) => slot.1 = v,
                None => ctx.push((Value::from(k), v)),
            };
        for (k, v) in special_tokens.iter().chain(self.kwargs.iter()) {
            if !APPLY_PARAMS.contains(&k.as_str()) {
                set(k, json_to_value(v));
            }
        }
        let get = |k: &str| {
            self.kwargs
                .get(k)
                .map(json_to_value)
                .unwrap_or(Value::from(()))
        };
        set("tools", get("tools"));
        set("documents", get("documents"));
        set(
            "add_generation_prompt",
            Value::from(self.add_generation_prompt),
        );
        let msgs: Vec<Value> = self.messages.iter().map(Message::to_value).collect();
        set("messages", Value::from(msgs));
        SmallMap::value(ctx)
    }

    /// The value [`Prepared::context`] gives `name`, for a name other than `tools`,
    /// `documents`, `add_generation_prompt` and `messages` (`None`: undefined).
    pub(crate) fn variable<'m>(&'m self, special_tokens: &'m Map, name: &str) -> Option<&'m Json> {
        if APPLY_PARAMS.contains(&name) {
            return special_tokens.get(name);
        }
        self.kwargs.get(name).or_else(|| special_tokens.get(name))
    }

    /// `tools` and `documents` are both unset (`None` in the template).
    pub(crate) fn no_tools_or_documents(&self) -> bool {
        ["tools", "documents"]
            .iter()
            .all(|k| self.kwargs.get(*k).is_none_or(Json::is_null))
    }

    pub(crate) fn add_generation_prompt(&self) -> bool {
        self.add_generation_prompt
    }

    /// The messages, if every content is a string.
    pub(crate) fn text_messages(&self) -> Option<Vec<TextMessage<'_>>> {
        self.messages
            .iter()
            .map(|m| match &m.content {
                Content::Text(t) => Some(TextMessage {
                    role: &m.role,
                    content: t,
                    rest: &m.rest,
                }),
                Content::Json(_) => None,
            })
            .collect()
    }
}

fn invalid(msg: impl Into<String>) -> TokenizeError {
    TokenizeError::InvalidRequest(msg.into())
}

fn validate(req: &ChatRequest) -> Result<()> {
    if req.messages.is_empty() {
        return Err(invalid(
            "Cannot apply chat template to an empty conversation.",
        ));
    }
    if req.chat_template.is_some() {
        return Err(invalid("chat template is passed with request, but the server does not trust request chat templates"));
    }
    if req.tools.as_ref().is_some_and(Vec::is_empty) {
        return Err(invalid("`tools` must not be an empty array."));
    }
    if let Some(choice) = &req.tool_choice {
        let none = choice.is_null() || choice.as_str() == Some("none");
        if !none && req.tools.is_none() {
            return Err(invalid("When using `tool_choice`, `tools` must be set."));
        }
    }
    if req.continue_final_message && req.add_generation_prompt {
        return Err(invalid(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
        ));
    }
    if let Some(kw) = &req.chat_template_kwargs {
        for bad in ["chat_template", "tokenize", "messages", "conversation"] {
            if kw.contains_key(bad) {
                return Err(invalid(format!(
                    "Found unexpected chat template kwargs from request: {bad}"
                )));
            }
        }
    }
    Ok(())
}

/// One normalized message: the dict vLLM passes to the template, whose keys are always `role`,
/// `content`, then the role's other fields. Role and content borrow the request's text where
/// vLLM passes it unchanged (nearly always), so the one copy of a message's text is the one
/// into its template value.
#[derive(Debug)]
struct Message<'a> {
    role: Cow<'a, str>,
    content: Content<'a>,
    /// The keys after `content`, in order.
    rest: Map,
}

#[derive(Debug)]
enum Content<'a> {
    Text(Cow<'a, str>),
    /// Anything but a string (a list of parts).
    Json(Json),
}

impl Content<'_> {
    fn from_json(v: Json) -> Self {
        match v {
            Json::String(s) => Content::Text(Cow::Owned(s)),
            other => Content::Json(other),
        }
    }
}

impl Message<'_> {
    fn to_value(&self) -> Value {
        let content = match &self.content {
            Content::Text(s) => Value::from(s.as_ref()),
            Content::Json(v) => json_to_value(v),
        };
        let mut pairs = Vec::with_capacity(2 + self.rest.len());
        pairs.push((Value::from("role"), Value::from(self.role.as_ref())));
        pairs.push((Value::from("content"), content));
        // Distinct keys, as SmallMap needs: `rest` is a map and never holds role or content.
        for (k, v) in &self.rest {
            pairs.push((Value::from(k.as_str()), json_to_value(v)));
        }
        SmallMap::value(pairs)
    }
}

/// One message as vLLM's `_parse_chat_message_content` + `_postprocess_messages` leave it.
fn normalize_message<'m>(m: &'m ChatMessage<'_>, format: ContentFormat) -> Result<Message<'m>> {
    let content = match &m.content {
        // The common case, without building a parts list.
        Some(MessageContent::Text(s))
            if format == ContentFormat::String && !s.starts_with(BILLING_HEADER) =>
        {
            Content::Text(Cow::Borrowed(s))
        }
        _ => Content::from_json(content_value(&message_parts(m), format)?),
    };
    let out = Message {
        role: Cow::Borrowed(&m.role),
        content,
        rest: Map::new(),
    };
    add_role_fields(m, out)
}

fn message_parts(m: &ChatMessage) -> Vec<Json> {
    let parts: Vec<Json> = match &m.content {
        None => Vec::new(),
        Some(MessageContent::Text(s)) => vec![text_part(s, None, ContentFormat::OpenAi)],
        Some(MessageContent::Parts(p)) => p.clone(),
    };
    if m.role == "system" {
        return strip_billing_header(parts);
    }
    parts
}

/// The fields besides role and content that vLLM keeps, per role.
fn add_role_fields<'a>(m: &ChatMessage, mut out: Message<'a>) -> Result<Message<'a>> {
    if m.role == "assistant" {
        if let Some(calls) = m.tool_calls.as_deref().filter(|c| !c.is_null()) {
            if let Some(calls) = normalize_tool_calls(calls)? {
                out.rest.insert("tool_calls".into(), calls);
            }
        }
        if let Some(r) = &m.reasoning {
            out.rest.insert("reasoning".into(), Json::String(r.clone()));
            out.rest
                .insert("reasoning_content".into(), Json::String(r.clone()));
        }
    } else if m.role == "tool" {
        if let Some(id) = m.tool_call_id.as_deref() {
            out.rest.insert("tool_call_id".into(), id.clone());
        }
        if let Content::Json(Json::Array(items)) = &out.content {
            let all_text = items
                .iter()
                .all(|i| i.get("type").and_then(Json::as_str) == Some("text"));
            if all_text {
                let texts: Vec<&str> = items
                    .iter()
                    .map(|i| i.get("text").and_then(Json::as_str).unwrap_or(""))
                    .collect();
                out.content = Content::Text(Cow::Owned(texts.join("\n")));
            }
        }
    }
    if let Some(Json::String(name)) = m.name.as_deref() {
        out.rest.insert("name".into(), Json::String(name.clone()));
    }
    if let Some(Json::String(task)) = m.task.as_deref() {
        out.rest.insert("task".into(), Json::String(task.clone()));
    }
    if m.role == "developer" {
        out.rest.insert(
            "tools".into(),
            m.tools.as_deref().cloned().unwrap_or(Json::Null),
        );
    }
    Ok(out)
}

/// Drops the per-request attribution line some clients put in the system prompt (vLLM does, so
/// the prompt stays cacheable).
fn strip_billing_header(parts: Vec<Json>) -> Vec<Json> {
    parts
        .into_iter()
        .filter_map(|p| {
            let text = match &p {
                Json::String(s) => Some(s.as_str()),
                Json::Object(o) if o.get("type").and_then(Json::as_str) == Some("text") => {
                    o.get("text").and_then(Json::as_str)
                }
                _ => None,
            };
            let rest = text
                .filter(|t| t.starts_with(BILLING_HEADER))
                .map(|t| t.split_once('\n').map(|(_, r)| r).unwrap_or("").to_string());
            match rest {
                Some(rest) => {
                    if rest.is_empty() {
                        return None;
                    }
                    Some(match p {
                        Json::String(_) => Json::String(rest),
                        Json::Object(mut o) => {
                            o.insert("text".into(), Json::String(rest));
                            Json::Object(o)
                        }
                        other => other,
                    })
                }
                None => Some(p),
            }
        })
        .collect()
}

/// Content-part fields vLLM knows; other fields of a text part are kept in "openai" format.
const KNOWN_PART_FIELDS: [&str; 16] = [
    "type",
    "text",
    "refusal",
    "thinking",
    "image_url",
    "input_audio",
    "audio_url",
    "video_url",
    "file",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "uuid",
    "closed",
    "name",
];

fn content_value(parts: &[Json], format: ContentFormat) -> Result<Json> {
    let mut texts: Vec<Json> = Vec::with_capacity(parts.len());
    for part in parts {
        let obj = match part {
            Json::String(s) => {
                texts.push(text_part(s, None, format));
                continue;
            }
            Json::Object(o) => o,
            _ => return Err(invalid("content parts must be strings or objects")),
        };
        let ty = match obj.get("type") {
            Some(Json::String(t)) => t.as_str(),
            None | Some(Json::Null) => {
                return Err(TokenizeError::Unsupported(
                    "content part without 'type' (multimodal data)".into(),
                ))
            }
            Some(_) => return Err(invalid("Invalid 'type' field in multimodal part.")),
        };
        let key = match ty {
            "text" | "input_text" | "output_text" => "text",
            "refusal" => "refusal",
            "thinking" => "thinking",
            "tool_reference" => {
                let name = obj.get("name").and_then(Json::as_str).unwrap_or_default();
                texts.push(match format {
                    ContentFormat::String => Json::String(name.to_string()),
                    ContentFormat::OpenAi => Json::Object(Map::from_iter([
                        ("type".to_string(), Json::from("tool_reference")),
                        ("name".to_string(), Json::from(name)),
                    ])),
                });
                continue;
            }
            other => {
                return Err(TokenizeError::Unsupported(format!(
                    "content part of type '{other}' (multimodal input is not tokenized here)"
                )))
            }
        };
        match obj.get(key) {
            Some(Json::String(t)) => texts.push(text_part(t, Some(obj), format)),
            None | Some(Json::Null) if matches!(ty, "text" | "refusal") => {}
            _ => {
                return Err(invalid(format!(
                    "content part '{ty}' needs a string '{key}'"
                )))
            }
        }
    }
    Ok(match format {
        ContentFormat::OpenAi => Json::Array(texts),
        ContentFormat::String => {
            let strs: Vec<&str> = texts.iter().filter_map(Json::as_str).collect();
            Json::String(strs.join("\n"))
        }
    })
}

fn text_part(text: &str, part: Option<&Map>, format: ContentFormat) -> Json {
    match format {
        ContentFormat::String => Json::String(text.to_string()),
        ContentFormat::OpenAi => {
            let mut o = Map::new();
            o.insert("type".into(), Json::String("text".into()));
            o.insert("text".into(), Json::String(text.to_string()));
            for (k, v) in part.into_iter().flatten() {
                if !KNOWN_PART_FIELDS.contains(&k.as_str()) {
                    o.insert(k.clone(), v.clone());
                }
            }
            Json::Object(o)
        }
    }
}

/// `_postprocess_messages`: arguments become objects; `None` means "drop the key".
fn normalize_tool_calls(calls: &Json) -> Result<Option<Json>> {
    let Json::Array(items) = calls else {
        return Ok(Some(calls.clone()));
    };
    if items.is_empty() {
        return Ok(None);
    }
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let Json::Object(call) = item else {
            return Err(invalid("assistant tool_calls entries must be objects."));
        };
        let mut call = call.clone();
        let ty_ok = call
            .get("type")
            .is_none_or(|t| t.as_str() == Some("function"));
        let Some(Json::Object(function)) = call.get_mut("function").filter(|_| ty_ok) else {
            return Err(invalid(
                "chat completions only support assistant tool_calls of type 'function'.",
            ));
        };
        let parsed = match function.get("arguments") {
            Some(Json::Object(o)) => Json::Object(o.clone()),
            Some(Json::String(s)) if !s.is_empty() => match Json::parse(s) {
                Ok(Json::Object(o)) => Json::Object(o),
                _ => Json::Object(Map::new()),
            },
            _ => Json::Object(Map::new()),
        };
        function.insert("arguments".into(), parsed);
        out.push(Json::Object(call));
    }
    Ok(Some(Json::Array(out)))
}

fn developer_to_system(messages: Vec<Message<'_>>) -> Vec<Message<'_>> {
    messages
        .into_iter()
        .map(|mut m| {
            if m.role == "developer" {
                m.role = Cow::Borrowed("system");
                m.rest.shift_remove("tools");
            }
            m
        })
        .collect()
}

/// `_consolidate_system_messages`: all system messages merged into one leading message when any
/// is not first or there are several.
fn consolidate_system(messages: Vec<Message<'_>>) -> Vec<Message<'_>> {
    let mut contents: Vec<String> = Vec::new();
    let mut needed = false;
    for (i, m) in messages.iter().enumerate() {
        if m.role != "system" {
            continue;
        }
        if i > 0 || !contents.is_empty() {
            needed = true;
        }
        let text = match &m.content {
            Content::Text(s) => s.to_string(),
            Content::Json(Json::Array(parts)) => parts
                .iter()
                .filter_map(|p| match p {
                    Json::String(s) => Some(s.as_str()),
                    Json::Object(o) => o.get("text").and_then(Json::as_str),
                    _ => None,
                })
                .collect::<Vec<_>>()
                .join("\n"),
            _ => String::new(),
        };
        if !text.is_empty() {
            contents.push(text);
        }
    }
    if !needed {
        return messages;
    }
    let merged = Message {
        role: Cow::Borrowed("system"),
        content: Content::Text(Cow::Owned(contents.join("\n\n"))),
        rest: Map::new(),
    };
    let others = messages.into_iter().filter(|m| m.role != "system");
    std::iter::once(merged).chain(others).collect()
}

/// Appends transformers' continuation tag to the final message; returns its original text.
fn mark_final(messages: &mut [Message<'_>]) -> Result<String> {
    let no_content = || {
        invalid(
            "continue_final_message is set but the final message has no \"content\" to continue!",
        )
    };
    let last = messages.last_mut().ok_or_else(no_content)?;
    match &mut last.content {
        Content::Text(s) => {
            let orig = s.to_string();
            s.to_mut().push_str(CONTINUE_TAG);
            Ok(orig)
        }
        Content::Json(Json::Array(parts)) => {
            for part in parts.iter_mut().rev() {
                if let Some(Json::String(t)) = part.get_mut("text") {
                    let orig = t.clone();
                    t.push_str(CONTINUE_TAG);
                    return Ok(orig);
                }
            }
            Err(invalid("continue_final_message is set but we could not find any text to continue in the final message!"))
        }
        _ => Err(no_content()),
    }
}

/// A tool as `ChatCompletionToolsParam.model_dump()` gives it.
fn normalize_tool(tool: &Json) -> Result<Json> {
    let bad = |m: &str| invalid(format!("invalid tool: {m}"));
    let Json::Object(t) = tool else {
        return Err(bad("not an object"));
    };
    if t.get("type")
        .is_some_and(|ty| ty.as_str() != Some("function"))
    {
        return Err(bad("type must be \"function\""));
    }
    let Some(Json::Object(f)) = t.get("function") else {
        return Err(bad("missing function"));
    };
    let Some(Json::String(name)) = f.get("name") else {
        return Err(bad("function.name must be a string"));
    };
    let opt = |k: &str| f.get(k).cloned().unwrap_or(Json::Null);
    let description = opt("description");
    if !(description.is_null() || description.is_string()) {
        return Err(bad("function.description must be a string"));
    }
    let parameters = opt("parameters");
    if !(parameters.is_null() || parameters.is_object()) {
        return Err(bad("function.parameters must be an object"));
    }
    let tool_defer = t.get("defer_loading").cloned().unwrap_or(Json::Null);
    let mut func = Map::new();
    func.insert("name".into(), Json::String(name.clone()));
    func.insert("description".into(), description);
    func.insert("parameters".into(), parameters);
    if !opt("strict").is_null() {
        func.insert("strict".into(), opt("strict"));
    }
    let defer = if opt("defer_loading").is_null() {
        tool_defer.clone()
    } else {
        opt("defer_loading")
    };
    if !defer.is_null() {
        func.insert("defer_loading".into(), defer);
    }
    let mut out = Map::new();
    out.insert("type".into(), Json::String("function".into()));
    out.insert("function".into(), Json::Object(func));
    if !tool_defer.is_null() {
        out.insert("defer_loading".into(), tool_defer);
    }
    Ok(Json::Object(out))
}

fn is_unset(v: &Json) -> bool {
    v.is_null() || v.as_str() == Some("auto")
}

/// The keyword arguments vLLM hands to `apply_chat_template`, merged in its order:
/// server defaults and tools, then the request's `chat_template_kwargs` (null/"auto" values
/// ignored), then the request's own fields. `add_generation_prompt` and
/// `continue_final_message` are left out: like every name in [`APPLY_PARAMS`], the template
/// never sees them through the keyword arguments ([`Prepared::context`] and
/// [`Prepared::variable`] skip those names), and [`Prepared`] keeps the first as a field. So
/// a request with neither defaults nor its own keyword arguments allocates nothing here.
fn merge_kwargs(req: &ChatRequest, tools: Option<Vec<Json>>, defaults: &Map) -> Result<Map> {
    let mut kw = defaults.clone();
    if let Some(tools) = tools {
        kw.insert("tools".into(), Json::Array(tools));
    }
    let user = req.chat_template_kwargs.as_ref();
    for (k, v) in user.into_iter().flatten() {
        if !is_unset(v) {
            kw.insert(k.clone(), v.clone());
        }
    }
    if let Some(docs) = &req.documents {
        kw.insert("documents".into(), Json::Array(docs.clone()));
    }
    if let Some(effort) = req.reasoning_effort.as_deref().filter(|e| *e != "auto") {
        kw.insert("reasoning_effort".into(), Json::String(effort.into()));
        if !user.is_some_and(|u| u.contains_key("enable_thinking")) {
            kw.insert("enable_thinking".into(), Json::Bool(effort != "none"));
        }
    }
    if let Some(Json::Array(docs)) = kw.get("documents") {
        if docs.iter().any(|d| !d.is_object()) {
            return Err(invalid(
                "Documents should be a list of dicts with 'title' and 'text' keys!",
            ));
        }
    }
    Ok(kw)
}

/// transformers' cut after rendering with `continue_final_message`: everything from the tag on
/// is dropped (and trailing whitespace too when the template trimmed the tag's space).
pub(crate) fn cut_at_continue_tag(rendered: &str, final_text: &str) -> Result<String> {
    let tag = CONTINUE_TAG.trim();
    if !rendered.contains(final_text.trim()) || !rendered.contains(tag) {
        return Err(invalid(
            "continue_final_message is set but the final message does not appear in the chat after applying the chat template!",
        ));
    }
    let loc = rendered.rfind(tag).unwrap_or(rendered.len());
    if rendered[loc..].starts_with(CONTINUE_TAG) {
        Ok(rendered[..loc].to_string())
    } else {
        Ok(rendered[..loc]
            .trim_end_matches(crate::pyfmt::py_is_space)
            .to_string())
    }
}
