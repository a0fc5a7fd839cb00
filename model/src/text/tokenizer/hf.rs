//! Hugging Face tokenizers: `tokenizer.json` plus the side files that say what it alone does not: whether to
//! add BOS, which tokens are BOS/EOS, and the chat template.
//!
//! - `tokenizer_config.json`: `add_bos_token`, `bos_token` / `eos_token` (a string or `{"content": ...}`),
//!   `chat_template` (a string, or a list of named templates).
//! - `chat_template.jinja` / `chat_template.json`: where newer `transformers` versions save the template.
//! - `config.json` / `generation_config.json`: `bos_token_id`, `eos_token_id` (an id or a list of ids).
use std::path::Path;

use serde_json::Value;

use super::{SpecialRef, Specials};
use crate::error::{ModelError, Result};

/// Parses a tokenizer.json.
pub(crate) fn load_tokenizer_json(path: &Path) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|e| super::read_error(path, &e))?;
    tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
        ModelError::Tokenizer(format!(
            "cannot parse {} as a tokenizer.json: {e}",
            path.display()
        ))
    })
}

/// Collects what the side files in `dir` say. A malformed tokenizer_config.json is an error (it decides how
/// prompts are tokenized); malformed model configs are only warned about, as the model loader reports them.
pub(crate) fn dir_specials(dir: &Path) -> Result<Specials> {
    let mut specials = Specials::default();
    let tokenizer_config = dir.join("tokenizer_config.json");
    if let Some(config) = read_json(&tokenizer_config)? {
        specials.add_bos = config.get("add_bos_token").and_then(Value::as_bool);
        specials.bos = config
            .get("bos_token")
            .and_then(token_text)
            .map(SpecialRef::Text);
        specials.eos.extend(
            config
                .get("eos_token")
                .and_then(token_text)
                .map(SpecialRef::Text),
        );
        specials.chat_template = config.get("chat_template").and_then(template_text);
    }
    if specials.chat_template.is_none() {
        specials.chat_template = read_template_file(dir)?;
    }
    for name in ["config.json", "generation_config.json"] {
        let path = dir.join(name);
        let config = match read_json(&path) {
            Ok(Some(config)) => config,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "ignoring unreadable model config");
                continue;
            }
        };
        if specials.bos.is_none() {
            specials.bos = config
                .get("bos_token_id")
                .and_then(as_id)
                .map(SpecialRef::Id);
        }
        specials
            .eos
            .extend(ids(config.get("eos_token_id")).map(SpecialRef::Id));
    }
    Ok(specials)
}

/// `chat_template.jinja` (raw Jinja) or `chat_template.json` (`{"chat_template": ...}`).
fn read_template_file(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja).map_err(|e| super::read_error(&jinja, &e))?;
        return Ok(Some(text));
    }
    Ok(read_json(&dir.join("chat_template.json"))?
        .and_then(|v| v.get("chat_template").and_then(template_text)))
}

/// Reads a JSON file if it exists.
fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let bytes = std::fs::read(path).map_err(|e| super::read_error(path, &e))?;
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|e| ModelError::Tokenizer(format!("cannot parse {}: {e}", path.display())))
}

/// `"<s>"` or `{"content": "<s>", ...}` (an `AddedToken` as older transformers saved it).
fn token_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A template string, or from `[{"name": "default", "template": ...}, ...]` the default (else the first) one.
fn template_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => {
            let named = |name: &str| {
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some(name))
            };
            named("default")
                .or_else(|| list.first())?
                .get("template")?
                .as_str()
                .map(str::to_string)
        }
        _ => None,
    }
}

fn as_id(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|v| u32::try_from(v).ok())
}

/// An id or a list of ids.
fn ids(value: Option<&Value>) -> impl Iterator<Item = u32> + '_ {
    let list: Vec<&Value> = match value {
        Some(Value::Array(items)) => items.iter().collect(),
        Some(v) => vec![v],
        None => Vec::new(),
    };
    list.into_iter().filter_map(as_id)
}
