//! The crate's one error type. Every variant names which side caused it (the request, the
//! model's files, or this crate) and carries a stable metric label; no input makes the crate
//! panic, a bad request or template becomes one of these.

use std::path::PathBuf;

/// Why loading a tokenizer or tokenizing a request failed.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// A model file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A model file is not the JSON it should be (tokenizer_config.json and the like).
    #[error("invalid {what}: {detail}")]
    InvalidModelFile {
        /// Which file or field.
        what: String,
        /// What is wrong with it.
        detail: String,
    },
    /// `tokenizer.json` could not be loaded by the `tokenizers` library.
    #[error("cannot load tokenizer {path}: {detail}")]
    TokenizerLoad {
        /// The file.
        path: PathBuf,
        /// The library's message.
        detail: String,
    },
    /// A chat request reached a tokenizer that has no chat template (and none was given).
    #[error("the tokenizer has no chat template: give one (chat_template.jinja or an explicit file) to tokenize chat requests")]
    NoChatTemplate,
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    TemplateSyntax(String),
    /// The chat template called `raise_exception(message)`: the template rejects the request.
    #[error("chat template rejected the request: {0}")]
    TemplateRaised(String),
    /// Rendering failed for another reason (an undefined attribute, a bad filter argument).
    #[error("chat template rendering failed: {0}")]
    TemplateRender(String),
    /// The request is not valid (bad JSON, bad message shape, conflicting options).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request is valid for vLLM but needs something this crate does not do
    /// (multimodal content parts, for example).
    #[error("unsupported request: {0}")]
    Unsupported(String),
    /// The `tokenizers` library failed to encode the text.
    #[error("encoding failed: {0}")]
    Encode(String),
}

impl TokenizeError {
    /// A short, stable label for metrics (`kind="..."`).
    pub fn metric_label(&self) -> &'static str {
        match self {
            TokenizeError::Io { .. } => "io",
            TokenizeError::InvalidModelFile { .. } => "invalid_model_file",
            TokenizeError::TokenizerLoad { .. } => "tokenizer_load",
            TokenizeError::NoChatTemplate => "no_chat_template",
            TokenizeError::TemplateSyntax(_) => "template_syntax",
            TokenizeError::TemplateRaised(_) => "template_raised",
            TokenizeError::TemplateRender(_) => "template_render",
            TokenizeError::InvalidRequest(_) => "invalid_request",
            TokenizeError::Unsupported(_) => "unsupported",
            TokenizeError::Encode(_) => "encode",
        }
    }

    /// Whether the request itself is at fault (an HTTP 400 at the edge): a retry of the same
    /// request fails the same way. vLLM answers these with 400 too.
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            TokenizeError::TemplateRaised(_)
                | TokenizeError::InvalidRequest(_)
                | TokenizeError::Unsupported(_)
                | TokenizeError::NoChatTemplate
                | TokenizeError::TemplateRender(_)
        )
    }
}

/// Shorthand for results of this crate.
pub type Result<T, E = TokenizeError> = std::result::Result<T, E>;
