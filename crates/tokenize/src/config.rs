//! The files beside `tokenizer.json` that decide chat rendering, read as transformers reads
//! them: the chat template (`chat_template.jinja` and `additional_chat_templates/*.jinja` win
//! over `tokenizer_config.json`'s `chat_template`, which is a string or a list of named
//! templates) and the special tokens templates see (`bos_token`, `eos_token`, ...: a string or
//! an `AddedToken` object, from `tokenizer_config.json`, else `special_tokens_map.json`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as JsonValue;

use crate::json::{Json, Map};

use crate::error::{Result, TokenizeError};

/// The special-token attributes transformers exposes as template variables.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// What the config files say.
#[derive(Debug, Default)]
pub(crate) struct ModelConfig {
    /// Named templates; a single unnamed template is "default".
    pub templates: BTreeMap<String, String>,
    /// `bos_token` etc. as strings.
    pub special_tokens: Map,
}

fn read_json(path: &Path) -> Result<Option<JsonValue>> {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| TokenizeError::InvalidModelFile {
                    what: path.display().to_string(),
                    detail: e.to_string(),
                })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// A template file as Python's text mode reads it: universal newlines (`\r\n` and `\r`
/// become `\n`), which is what transformers and vLLM render.
fn read_text(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) if t.contains('\r') => Ok(Some(t.replace("\r\n", "\n").replace('\r', "\n"))),
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizeError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

impl ModelConfig {
    /// Reads `tokenizer_config.json` (optional), `special_tokens_map.json` (optional, beside
    /// it) and the template files: `template_file` if given, else `chat_template.jinja` and
    /// `additional_chat_templates/` in `dir`.
    pub fn load(
        dir: Option<&Path>,
        config_file: Option<&Path>,
        template_file: Option<&Path>,
    ) -> Result<Self> {
        let mut cfg = ModelConfig::default();
        let config = match config_file {
            Some(p) => read_json(p)?,
            None => None,
        };
        if let Some(config) = &config {
            if !config.is_object() {
                return Err(invalid_file("tokenizer_config.json", "not a JSON object"));
            }
            cfg.templates = templates_from_config(config.get("chat_template"))?;
            cfg.special_tokens = special_tokens(config)?;
        }
        let map_file = config_file
            .and_then(Path::parent)
            .or(dir)
            .map(|d| d.join("special_tokens_map.json"));
        if let Some(map) = map_file.as_deref().map(read_json).transpose()?.flatten() {
            for (k, v) in special_tokens(&map)? {
                cfg.special_tokens.entry(k).or_insert(v);
            }
        }
        let mut files = BTreeMap::new();
        if let Some(p) = template_file {
            let text = read_text(p)?.ok_or_else(|| not_found(p))?;
            files.insert("default".to_string(), text);
        } else if let Some(dir) = dir {
            if let Some(t) = read_text(&dir.join("chat_template.jinja"))? {
                files.insert("default".to_string(), t);
            }
            files.extend(additional_templates(
                &dir.join("additional_chat_templates"),
            )?);
        }
        if !files.is_empty() {
            cfg.templates = files;
        }
        Ok(cfg)
    }
}

fn invalid_file(what: &str, detail: &str) -> TokenizeError {
    TokenizeError::InvalidModelFile {
        what: what.into(),
        detail: detail.into(),
    }
}

fn not_found(p: &Path) -> TokenizeError {
    TokenizeError::Io {
        path: p.to_path_buf(),
        source: std::io::Error::from(std::io::ErrorKind::NotFound),
    }
}

fn templates_from_config(v: Option<&JsonValue>) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    match v {
        None | Some(JsonValue::Null) => {}
        Some(JsonValue::String(s)) => {
            out.insert("default".to_string(), s.clone());
        }
        Some(JsonValue::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(JsonValue::as_str);
                let template = item.get("template").and_then(JsonValue::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => {
                        out.insert(n.to_string(), t.to_string());
                    }
                    _ => {
                        return Err(invalid_file(
                            "chat_template",
                            "list items need \"name\" and \"template\"",
                        ))
                    }
                }
            }
        }
        Some(_) => return Err(invalid_file("chat_template", "must be a string or a list")),
    }
    Ok(out)
}

fn additional_templates(dir: &Path) -> Result<Vec<(String, String)>> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(TokenizeError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for entry in rd {
        let path: PathBuf = entry
            .map_err(|source| TokenizeError::Io {
                path: dir.to_path_buf(),
                source,
            })?
            .path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".jinja"));
        if let Some(name) = name {
            let text = read_text(&path)?.ok_or_else(|| not_found(&path))?;
            out.push((name.to_string(), text));
        }
    }
    Ok(out)
}

/// `bos_token` etc. as template strings: a string, or the `content` of an AddedToken object.
fn special_tokens(config: &JsonValue) -> Result<Map> {
    let mut out = Map::new();
    for key in SPECIAL_TOKEN_KEYS {
        let text = match config.get(key) {
            None | Some(JsonValue::Null) => continue,
            Some(JsonValue::String(s)) => s.clone(),
            Some(JsonValue::Object(o)) => match o.get("content") {
                Some(JsonValue::String(s)) => s.clone(),
                _ => return Err(invalid_file(key, "AddedToken without string \"content\"")),
            },
            Some(_) => {
                return Err(invalid_file(
                    key,
                    "must be a string or an AddedToken object",
                ))
            }
        };
        out.insert(key.to_string(), Json::String(text));
    }
    Ok(out)
}
