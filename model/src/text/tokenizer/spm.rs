//! SentencePiece-BPE vocabularies (llama2.c `tokenizer.bin`, GGUF `tokenizer.ggml.model == "llama"`) rebuilt as a
//! Hugging Face `tokenizers` BPE with byte fallback.
//!
//! These formats store only pieces and scores; SentencePiece merges the adjacent pair whose merged piece scores
//! highest. A BPE whose merge ranks follow the merged pieces' scores does the same, so we derive the merges exactly
//! as `transformers`' `SentencePieceExtractor` does (every split of a piece into two vocabulary pieces, ranked by
//! the piece's score, ties in vocabulary order). The result is the same tokenizer.json `transformers` writes for
//! Llama, so ids match a Hugging Face tokenizer for the same model.
use serde_json::{json, Map, Value};

use crate::error::{ModelError, Result};

/// SentencePiece's word-boundary marker, which stands for a space inside pieces.
pub(crate) const SPACE_MARKER: char = '\u{2581}';

/// Piece kinds as GGUF's `tokenizer.ggml.token_type` numbers them (SentencePiece's own `Type` enum).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PieceKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl PieceKind {
    /// GGUF / SentencePiece numbering; unknown numbers are treated as normal pieces.
    pub(crate) fn from_gguf(kind: i64) -> Self {
        match kind {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: PieceKind,
}

/// Builds the tokenizer. `add_space_prefix` is SentencePiece's `add_dummy_prefix` (true for Llama): a space is
/// prepended to the text, and the decoder strips it again.
pub(crate) fn build(pieces: &[Piece], add_space_prefix: bool) -> Result<tokenizers::Tokenizer> {
    if pieces.is_empty() {
        return Err(ModelError::Tokenizer("the vocabulary is empty".into()));
    }
    let mut vocab = Map::new();
    let mut ids = std::collections::HashMap::with_capacity(pieces.len());
    for (id, piece) in pieces.iter().enumerate() {
        // A duplicated piece keeps its first id, as SentencePiece's piece-to-id map does.
        if !ids.contains_key(piece.text.as_str()) {
            ids.insert(piece.text.as_str(), id as u32);
            vocab.insert(piece.text.clone(), json!(id));
        }
    }

    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for piece in pieces.iter().filter(|p| p.kind == PieceKind::Normal) {
        let mut local: Vec<(&str, &str, u32, u32)> = piece
            .text
            .char_indices()
            .skip(1)
            .filter_map(|(i, _)| {
                let (left, right) = piece.text.split_at(i);
                Some((left, right, *ids.get(left)?, *ids.get(right)?))
            })
            .collect();
        local.sort_by_key(|&(_, _, l, r)| (l, r));
        merges.extend(local.into_iter().map(|(l, r, _, _)| (l, r, piece.score)));
    }
    // Stable: equal scores keep vocabulary order, as Python's `sorted(..., reverse=True)` does.
    merges.sort_by(|a, b| b.2.total_cmp(&a.2));
    let merges: Vec<Value> = merges.iter().map(|(l, r, _)| json!([l, r])).collect();

    let added_tokens: Vec<Value> = pieces
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            matches!(
                p.kind,
                PieceKind::Unknown | PieceKind::Control | PieceKind::UserDefined
            )
        })
        .map(|(id, p)| {
            json!({
                "id": id,
                "content": p.text,
                "single_word": false,
                "lstrip": false,
                "rstrip": false,
                "normalized": false,
                "special": p.kind != PieceKind::UserDefined,
            })
        })
        .collect();
    let unk = pieces
        .iter()
        .find(|p| p.kind == PieceKind::Unknown)
        .map(|p| p.text.clone());

    let marker = SPACE_MARKER.to_string();
    let replace_space = json!({"type": "Replace", "pattern": {"String": " "}, "content": marker});
    let normalizer = if add_space_prefix {
        json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": marker}, replace_space]})
    } else {
        replace_space
    };
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": marker}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_space_prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {
            "type": "BPE",
            "dropout": null,
            "unk_token": unk,
            "continuing_subword_prefix": null,
            "end_of_word_suffix": null,
            "fuse_unk": true,
            "byte_fallback": true,
            "ignore_merges": false,
            "vocab": vocab,
            "merges": merges,
        },
    });
    super::from_json_value(&spec)
}
