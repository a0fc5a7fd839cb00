//! Tokenizers stored in GGUF metadata (`tokenizer.ggml.*`), as llama.cpp writes them.
//!
//! GGUF files usually ship without a tokenizer.json, so we rebuild the Hugging Face tokenizer the metadata came
//! from: `gpt2` vocabularies are byte-level BPE with explicit merges and a pre-tokenizer named by
//! `tokenizer.ggml.pre`; `llama` vocabularies are SentencePiece pieces with scores (see [`super::spm`]).
use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::{json, Map, Value};

use super::spm::{self, Piece, PieceKind};
use super::{SpecialRef, Specials};
use crate::error::{ModelError, Result};

pub(crate) type Metadata = HashMap<String, GgufValue>;

/// Reads only the header (metadata and tensor index), not the tensor data.
pub(crate) fn read_metadata(path: &Path) -> Result<Metadata> {
    let mut file = std::fs::File::open(path).map_err(|e| super::read_error(path, &e))?;
    let content = crate::compute::weights::read_gguf_header(&mut file).map_err(|e| {
        ModelError::Tokenizer(format!(
            "cannot read GGUF metadata from {}: {e}",
            path.display()
        ))
    })?;
    Ok(content.metadata)
}

/// Builds the tokenizer and its special tokens from a GGUF file's metadata.
pub(crate) fn load(path: &Path) -> Result<(tokenizers::Tokenizer, Specials)> {
    let md = read_metadata(path)?;
    let bad = |reason: String| ModelError::Tokenizer(format!("{}: {reason}", path.display()));
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| {
            bad("no tokenizer in the GGUF metadata (tokenizer.ggml.model is missing)".into())
        })?
        .clone();
    let tokens = string_array(&md, "tokenizer.ggml.tokens").map_err(&bad)?;
    let kinds = match md.get("tokenizer.ggml.token_type") {
        Some(v) => int_array(v)
            .ok_or_else(|| bad("tokenizer.ggml.token_type is not an integer array".into()))?,
        None => Vec::new(),
    };
    if !kinds.is_empty() && kinds.len() != tokens.len() {
        return Err(bad(format!(
            "{} token types for {} tokens",
            kinds.len(),
            tokens.len()
        )));
    }
    let kind = |id: usize| {
        kinds
            .get(id)
            .map_or(PieceKind::Normal, |&k| PieceKind::from_gguf(k))
    };

    let (tokenizer, default_add_bos) = match model.as_str() {
        "gpt2" => (build_bpe(&md, &tokens, kind).map_err(&bad)?, false),
        "llama" => (build_spm(&md, &tokens, kind).map_err(&bad)?, true),
        other => {
            return Err(bad(format!(
                "tokenizer model {other:?} is not supported (supported: gpt2, llama); pass --tokenizer \
                 with the model's tokenizer.json"
            )))
        }
    };
    Ok((tokenizer, specials(&md, default_add_bos)))
}

/// Special tokens and chat template from the metadata; also used for a GGUF that has a tokenizer.json beside it.
pub(crate) fn specials(md: &Metadata, default_add_bos: bool) -> Specials {
    let id = |key: &str| md.get(key).and_then(as_u32);
    let eos = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|key| id(key))
    .map(SpecialRef::Id)
    .collect();
    Specials {
        bos: id("tokenizer.ggml.bos_token_id").map(SpecialRef::Id),
        eos,
        add_bos: Some(
            md.get("tokenizer.ggml.add_bos_token")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(default_add_bos),
        ),
        chat_template: md
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .cloned(),
    }
}

/// Byte-level BPE (GPT-2, StarCoder, SmolLM, Llama 3, Qwen 2, ...).
fn build_bpe(
    md: &Metadata,
    tokens: &[String],
    kind: impl Fn(usize) -> PieceKind,
) -> std::result::Result<tokenizers::Tokenizer, String> {
    let merges = string_array(md, "tokenizer.ggml.merges")?;
    let merges: Vec<Value> = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(l, r)| json!([l, r]))
                .ok_or_else(|| format!("merge {i} ({m:?}) is not two tokens separated by a space"))
        })
        .collect::<std::result::Result<_, _>>()?;
    let mut vocab = Map::new();
    for (id, token) in tokens.iter().enumerate() {
        if !vocab.contains_key(token) {
            vocab.insert(token.clone(), json!(id));
        }
    }
    let added_tokens: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter_map(|(id, token)| {
            let special = match kind(id) {
                PieceKind::Control | PieceKind::Unknown => true,
                PieceKind::UserDefined => false,
                _ => return None,
            };
            Some(json!({
                "id": id, "content": token, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": special,
            }))
        })
        .collect();

    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map_or("default", |s| s.as_str());
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let (normalizer, pre_tokenizer, ignore_merges) = match pre {
        // llama.cpp's STARCODER pre-type: every digit alone, then GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r" | "exaone" | "minerva-7b" => {
            (
                Value::Null,
                json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
                false,
            )
        }
        "llama3" | "llama-bpe" | "smaug-bpe" | "dbrx" | "falcon3" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_REGEX), byte_level(false)]}),
            true,
        ),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_REGEX), byte_level(false)]}),
            false,
        ),
        other => {
            if !matches!(
                other,
                "default" | "gpt-2" | "gpt2" | "phi-2" | "olmo" | "mpt"
            ) {
                tracing::warn!(
                    pre_tokenizer = other,
                    "unknown GGUF pre-tokenizer; using GPT-2's (ids may differ from the original tokenizer: \
                     pass --tokenizer tokenizer.json to be exact)"
                );
            }
            (Value::Null, byte_level(true), false)
        }
    };
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": null,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": false,
            "byte_fallback": false,
            "ignore_merges": ignore_merges,
            "vocab": vocab,
            "merges": merges,
        },
    });
    super::from_json_value(&spec).map_err(|e| e.to_string())
}

/// Llama 3's pre-tokenizer split (numbers in groups of up to three).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's: as Llama 3's but every digit alone.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// SentencePiece vocabularies (Llama 1/2, Mistral, TinyLlama, ...).
fn build_spm(
    md: &Metadata,
    tokens: &[String],
    kind: impl Fn(usize) -> PieceKind,
) -> std::result::Result<tokenizers::Tokenizer, String> {
    let scores = match md.get("tokenizer.ggml.scores") {
        Some(v) => v
            .to_vec()
            .map_err(|e| e.to_string())?
            .iter()
            .map(as_f32)
            .collect::<Option<Vec<f32>>>()
            .ok_or("tokenizer.ggml.scores is not a float array")?,
        None => return Err("tokenizer.ggml.scores is missing".into()),
    };
    if scores.len() != tokens.len() {
        return Err(format!(
            "{} scores for {} tokens",
            scores.len(),
            tokens.len()
        ));
    }
    let unk_id = md.get("tokenizer.ggml.unknown_token_id").and_then(as_u32);
    let pieces: Vec<Piece> = tokens
        .iter()
        .zip(&scores)
        .enumerate()
        .map(|(id, (text, &score))| {
            let kind = if unk_id == Some(id as u32) {
                PieceKind::Unknown
            } else {
                kind(id)
            };
            Piece {
                text: text.clone(),
                score,
                kind,
            }
        })
        .collect();
    let add_space_prefix = md
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.to_bool().ok())
        .unwrap_or(true);
    spm::build(&pieces, add_space_prefix).map_err(|e| e.to_string())
}

fn string_array(md: &Metadata, key: &str) -> std::result::Result<Vec<String>, String> {
    let values = md
        .get(key)
        .ok_or_else(|| format!("{key} is missing"))?
        .to_vec()
        .map_err(|_| format!("{key} is not an array"))?;
    values
        .iter()
        .map(|v| {
            v.to_string()
                .cloned()
                .map_err(|_| format!("{key} holds a non-string"))
        })
        .collect()
}

fn int_array(value: &GgufValue) -> Option<Vec<i64>> {
    value.to_vec().ok()?.iter().map(as_i64).collect()
}

/// Any integer GGUF value (writers differ in the width they use for ids and flags).
fn as_i64(value: &GgufValue) -> Option<i64> {
    Some(match value {
        GgufValue::U8(v) => i64::from(*v),
        GgufValue::I8(v) => i64::from(*v),
        GgufValue::U16(v) => i64::from(*v),
        GgufValue::I16(v) => i64::from(*v),
        GgufValue::U32(v) => i64::from(*v),
        GgufValue::I32(v) => i64::from(*v),
        GgufValue::U64(v) => i64::try_from(*v).ok()?,
        GgufValue::I64(v) => *v,
        _ => return None,
    })
}

fn as_u32(value: &GgufValue) -> Option<u32> {
    u32::try_from(as_i64(value)?).ok()
}

fn as_f32(value: &GgufValue) -> Option<f32> {
    match value {
        GgufValue::F32(v) => Some(*v),
        GgufValue::F64(v) => Some(*v as f32),
        other => as_i64(other).map(|v| v as f32),
    }
}
