//! kinference-tokenize: request → token ids exactly as a vLLM replica computes them, so the
//! router hashes the same blocks the replica hashes.
//!
//! - Chat (`/v1/chat/completions`): the messages are normalized as vLLM normalizes them
//!   ([`conversation`]), the model's chat template is rendered as transformers renders it
//!   ([`template`]: `add_generation_prompt` true by default, `continue_final_message` false),
//!   and the text is encoded **without** special tokens (BOS comes from the template text).
//! - Completions (`/v1/completions`): `encode(prompt, add_special_tokens=True)`; a prompt given
//!   as token ids is used as is; a list of prompts yields one id list per prompt (vLLM serves
//!   each as its own request, so each is routed/hashed on its own).
//! - A [`PrefixCache`] makes a new turn of a long conversation cost only its new text; its
//!   result is always equal to encoding the whole text (see [`cache`]).
//!
//! Not covered: multimodal content parts (an [`TokenizeError::Unsupported`] error), Mistral's
//! `mistral-common` request encoding (`--tokenizer-mode mistral`), processor chat templates,
//! request-supplied chat templates (refused, as vLLM refuses them by default), truncation.

pub mod cache;
mod config;
pub mod content_format;
pub mod conversation;
mod encoder;
pub mod error;
mod fast_bpe;
pub mod json;
mod native;
mod pretok;
pub mod pyfmt;
pub mod request;
pub mod template;
pub mod value;
mod walk;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

pub use cache::{CacheStats, EntryRef, PrefixCache, Reuse};
pub use content_format::ContentFormat;
pub use error::{Result, TokenizeError};
pub use json::{Json, Map};
pub use request::{ChatMessage, ChatRequest, CompletionPrompt, CompletionRequest, MessageContent};
pub use template::ChatTemplate;

/// Default prefix-cache capacity: 256 MiB of text, ids and split points.
pub const DEFAULT_CACHE_BYTES: usize = 256 << 20;

/// How a [`Tokenizer`] is set up beyond its files.
#[derive(Debug, Clone)]
pub struct TokenizerOptions {
    /// A chat template that replaces the model's (vLLM's `--chat-template`), as template text.
    pub chat_template: Option<String>,
    /// Force the content format (vLLM's `--chat-template-content-format`); `None` detects it.
    pub content_format: Option<ContentFormat>,
    /// Template variables every request gets unless it sets them
    /// (vLLM's `--default-chat-template-kwargs`).
    pub default_chat_template_kwargs: Map,
    /// Prefix-cache capacity in bytes; 0 turns the cache off.
    pub cache_capacity_bytes: usize,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        TokenizerOptions {
            chat_template: None,
            content_format: None,
            default_chat_template_kwargs: Map::new(),
            cache_capacity_bytes: DEFAULT_CACHE_BYTES,
        }
    }
}

#[derive(Debug)]
struct Template {
    compiled: ChatTemplate,
    format: ContentFormat,
    /// The native renderer of exactly this source, if there is one.
    native: Option<native::Known>,
}

/// A model's tokenizer and chat templates. `Send + Sync`: share one per model.
#[derive(Debug)]
pub struct Tokenizer {
    encoder: encoder::Encoder,
    templates: BTreeMap<String, Template>,
    template_error: Option<String>,
    special_tokens: Map,
    default_kwargs: Map,
    cache: PrefixCache,
}

impl Tokenizer {
    /// Loads a model directory: `tokenizer.json`, and when present `tokenizer_config.json`,
    /// `special_tokens_map.json`, `chat_template.jinja`, `additional_chat_templates/`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_dir_with(dir, TokenizerOptions::default())
    }

    /// [`Tokenizer::from_dir`] with options.
    pub fn from_dir_with(dir: impl AsRef<Path>, options: TokenizerOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let config = dir.join("tokenizer_config.json");
        let config = config.exists().then_some(config);
        let cfg = config::ModelConfig::load(Some(dir), config.as_deref(), None)?;
        Self::build(&dir.join("tokenizer.json"), cfg, options)
    }

    /// Loads from explicit files: `tokenizer.json`, an optional `tokenizer_config.json`, and an
    /// optional chat template file that replaces any template in the config.
    pub fn from_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config: Option<&Path>,
        chat_template_file: Option<&Path>,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let cfg = config::ModelConfig::load(None, tokenizer_config, chat_template_file)?;
        Self::build(tokenizer_json.as_ref(), cfg, options)
    }

    fn build(
        tokenizer_json: &Path,
        mut cfg: config::ModelConfig,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let encoder = encoder::Encoder::from_file(tokenizer_json)?;
        if let Some(t) = options.chat_template {
            cfg.templates = BTreeMap::from([("default".to_string(), t)]);
        }
        let mut templates = BTreeMap::new();
        let mut template_error = None;
        for (name, src) in &cfg.templates {
            // A template that does not compile fails chat requests, not loading: completions
            // still work, as in vLLM.
            match ChatTemplate::new(src) {
                Ok(compiled) => {
                    let format = options
                        .content_format
                        .unwrap_or_else(|| content_format::detect(src));
                    let native = native::Known::of(src);
                    templates.insert(
                        name.clone(),
                        Template {
                            compiled,
                            format,
                            native,
                        },
                    );
                }
                Err(e) => template_error = Some(format!("{name}: {e}")),
            }
        }
        Ok(Tokenizer {
            encoder,
            templates,
            template_error,
            special_tokens: cfg.special_tokens,
            default_kwargs: options.default_chat_template_kwargs,
            cache: PrefixCache::new(options.cache_capacity_bytes),
        })
    }

    /// Whether chat requests can be tokenized (a default template exists and compiles).
    pub fn has_chat_template(&self) -> bool {
        self.templates.contains_key("default")
    }

    /// The content format of the default template.
    pub fn content_format(&self) -> Option<ContentFormat> {
        self.templates.get("default").map(|t| t.format)
    }

    /// Whether the prefix cache can be used with this tokenizer (see [`cache`]).
    pub fn prefix_cache_supported(&self) -> bool {
        self.encoder.split_safe
    }

    /// Whether the prefix cache also restarts at word boundaries in plain text with this
    /// tokenizer (see [`cache`]).
    pub fn word_splits_supported(&self) -> bool {
        self.encoder.word_splits
    }

    /// Whether encoding takes the exact byte-level BPE fast path (see `fast_bpe`), or why this
    /// tokenizer keeps the `tokenizers` pipeline.
    pub fn fast_path(&self) -> std::result::Result<(), &str> {
        self.encoder.fast_path()
    }

    /// `tokenizer.encode` through the `tokenizers` pipeline alone, bypassing the prefix cache and
    /// the fast path: the reference both are tested against.
    pub fn encode_reference(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encoder.encode_reference(text, add_special_tokens)
    }

    /// Prefix-cache counters.
    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// `tokenizer.encode(prompt, add_special_tokens=True)`: a completions prompt.
    pub fn encode_completion(&self, prompt: &str) -> Result<Vec<u32>> {
        self.encode_text(prompt, true)
    }

    /// `tokenizer.encode(text, add_special_tokens=...)`, through the prefix cache.
    pub fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        Ok(Arc::unwrap_or_clone(
            self.encode_text_reuse(text, add_special_tokens)?.0,
        ))
    }

    /// [`Tokenizer::encode_text`], with the prefix cache's [`Reuse`] (its `at` counts the
    /// special tokens added in front of the cached ids). Empty when the special tokens could not
    /// be added around cached ids. The ids may be the cache entry's own (shared, not copied).
    pub fn encode_text_reuse(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Arc<Vec<u32>>, Reuse)> {
        self.encode_cow_reuse(Cow::Borrowed(text), add_special_tokens)
    }

    /// [`Tokenizer::encode_text_reuse`] of a text the cache may keep as it is when it is owned
    /// (a rendered chat: a long conversation's text is not copied again to be stored).
    fn encode_cow_reuse(
        &self,
        text: Cow<'_, str>,
        add_special_tokens: bool,
    ) -> Result<(Arc<Vec<u32>>, Reuse)> {
        if !add_special_tokens {
            return self.cache.encode_reuse(&self.encoder, text);
        }
        let (core, reuse) = self
            .cache
            .encode_reuse(&self.encoder, Cow::Borrowed(&text))?;
        let at = self.encoder.special_prefix_len();
        match (
            self.encoder.add_special_affixes(Arc::unwrap_or_clone(core)),
            at,
        ) {
            (Some(ids), Some(at)) => Ok((Arc::new(ids), Reuse { at, ..reuse })),
            _ => Ok((
                Arc::new(self.encoder.encode(&text, true)?),
                Reuse::default(),
            )),
        }
    }

    /// `tokenizer.encode` without the prefix cache (the reference the cache is tested against).
    pub fn encode_uncached(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.encoder.encode(text, add_special_tokens)
    }

    /// The ids of each prompt of a completions request (one list per prompt; see the crate docs).
    /// Empty prompts are refused, as vLLM refuses them.
    pub fn encode_completion_request(&self, req: &CompletionRequest) -> Result<Vec<Vec<u32>>> {
        Ok(self.encode_completion_request_reuse(req)?.0)
    }

    /// [`Tokenizer::encode_completion_request`], with the prefix cache's [`Reuse`] for a single
    /// text prompt (empty for the other forms).
    pub fn encode_completion_request_reuse(
        &self,
        req: &CompletionRequest,
    ) -> Result<(Vec<Vec<u32>>, Reuse)> {
        let mut reuse = Reuse::default();
        let out = match &req.prompt {
            CompletionPrompt::Text(t) => {
                let (ids, r) = self.encode_text_reuse(t, req.add_special_tokens)?;
                reuse = r;
                vec![Arc::unwrap_or_clone(ids)]
            }
            CompletionPrompt::Ids(ids) => vec![ids.clone()],
            CompletionPrompt::Texts(ts) => ts
                .iter()
                .map(|t| self.encode_text(t, req.add_special_tokens))
                .collect::<Result<_>>()?,
            CompletionPrompt::IdLists(l) => l.clone(),
        };
        if out.is_empty() || out.iter().any(Vec::is_empty) {
            return Err(TokenizeError::InvalidRequest(
                "prompt cannot be empty".into(),
            ));
        }
        Ok((out, reuse))
    }

    fn template_for(&self, req: &ChatRequest) -> Result<&Template> {
        let has_tools = req.tools.is_some();
        let name = if has_tools && self.templates.contains_key("tool_use") {
            "tool_use"
        } else {
            "default"
        };
        match self.templates.get(name) {
            Some(t) => Ok(t),
            None => match &self.template_error {
                Some(e) => Err(TokenizeError::TemplateSyntax(e.clone())),
                None => Err(TokenizeError::NoChatTemplate),
            },
        }
    }

    /// The prompt text vLLM renders for a chat request: natively where the template is one
    /// of those `native` knows and the request is within what it models, else by minijinja.
    pub fn render_chat(&self, req: &ChatRequest) -> Result<String> {
        Ok(self.render_chat_traced(req)?.0)
    }

    /// [`Tokenizer::render_chat`], saying whether a native renderer made the text.
    pub fn render_chat_traced(&self, req: &ChatRequest) -> Result<(String, bool)> {
        self.render_chat_with(req, true)
    }

    /// [`Tokenizer::render_chat`] by minijinja alone (the reference native renders are
    /// tested against).
    pub fn render_chat_reference(&self, req: &ChatRequest) -> Result<String> {
        Ok(self.render_chat_with(req, false)?.0)
    }

    /// The native renderer of the template a request without tools gets, by name, if any.
    pub fn native_template(&self) -> Option<&'static str> {
        let t = self.templates.get("default")?;
        t.native.map(native::Known::name)
    }

    fn render_chat_with(&self, req: &ChatRequest, allow_native: bool) -> Result<(String, bool)> {
        let t = self.template_for(req)?;
        let prepared =
            conversation::prepare(req, t.format, t.compiled.source(), &self.default_kwargs)?;
        let native = t
            .native
            .filter(|_| allow_native)
            .and_then(|k| k.render(&prepared, &self.special_tokens));
        let used_native = native.is_some();
        let text = match native {
            Some(text) => text,
            None => t.compiled.render(prepared.context(&self.special_tokens))?,
        };
        let text = match &prepared.continue_text {
            Some(final_text) => conversation::cut_at_continue_tag(&text, final_text)?,
            None => text,
        };
        Ok((text, used_native))
    }

    /// The token ids vLLM computes (and hashes) for a chat request.
    pub fn encode_chat(&self, req: &ChatRequest) -> Result<Vec<u32>> {
        Ok(Arc::unwrap_or_clone(self.encode_chat_reuse(req)?.0))
    }

    /// [`Tokenizer::encode_chat`], with the prefix cache's [`Reuse`]: the ids from `at` on
    /// are the cached entries' ids, so what a caller attaches to `stored`
    /// ([`Tokenizer::attach`]) it can read back from a later request's `from`, for as many ids
    /// as `from` says. The ids may be the cache entry's own (shared, not copied).
    pub fn encode_chat_reuse(&self, req: &ChatRequest) -> Result<(Arc<Vec<u32>>, Reuse)> {
        let text = self.render_chat(req)?;
        let (ids, reuse) = self.encode_cow_reuse(Cow::Owned(text), req.add_special_tokens)?;
        if ids.is_empty() {
            return Err(TokenizeError::InvalidRequest(
                "the rendered prompt is empty".into(),
            ));
        }
        Ok((ids, reuse))
    }

    /// Keeps `value` with a prefix-cache entry (see [`PrefixCache::attach`]).
    pub fn attach(
        &self,
        entry: &EntryRef,
        value: Box<dyn std::any::Any + Send + Sync>,
        bytes: usize,
    ) {
        self.cache.attach(entry, value, bytes);
    }
}
