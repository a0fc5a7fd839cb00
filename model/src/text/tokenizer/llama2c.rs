//! llama2.c's tokenizer file (`tokenizer.bin`, `tok512.bin`, ...): Llama's SentencePiece vocabulary exported as
//! `i32 max_token_length`, then per piece `f32 score, i32 byte_len, bytes`, until the end of the file.
//!
//! The export writes '▁' as a plain space and BOS/EOS as "\n<s>\n" / "\n</s>\n"; we undo both so that the
//! rebuilt tokenizer is the Hugging Face Llama tokenizer for the same vocabulary (ids 0 `<unk>`, 1 `<s>`,
//! 2 `</s>`, 3..=258 byte pieces `<0x00>`..`<0xFF>` as in every Llama vocabulary).
use std::path::Path;

use super::spm::{Piece, PieceKind, SPACE_MARKER};
use crate::error::{ModelError, Result};

/// Larger files are not tokenizers (Llama 3's 128k vocabulary is about 2 MiB); refusing them avoids reading a
/// multi-gigabyte checkpoint passed by mistake.
const MAX_FILE_BYTES: u64 = 64 << 20;

/// llama2.c's fixed special ids.
pub(crate) const BOS_ID: u32 = 1;
pub(crate) const EOS_ID: u32 = 2;

/// Reads and parses a llama2.c tokenizer file.
pub(crate) fn read(path: &Path) -> Result<Vec<Piece>> {
    let len = std::fs::metadata(path)
        .map_err(|e| super::read_error(path, &e))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(not_llama2c(path, format!("{len} bytes is too large")));
    }
    let bytes = std::fs::read(path).map_err(|e| super::read_error(path, &e))?;
    parse(&bytes).map_err(|reason| not_llama2c(path, reason))
}

fn not_llama2c(path: &Path, reason: String) -> ModelError {
    ModelError::Tokenizer(format!(
        "{} is not a llama2.c tokenizer file ({reason})",
        path.display()
    ))
}

/// Parses the file body; the error is a reason to show after the file name.
pub(crate) fn parse(bytes: &[u8]) -> std::result::Result<Vec<Piece>, String> {
    let mut cursor = Cursor { bytes, pos: 0 };
    let max_len = cursor
        .i32()
        .ok_or_else(|| "shorter than its 4-byte header".to_string())?;
    if !(1..=4096).contains(&max_len) {
        return Err(format!("implausible max token length {max_len}"));
    }
    let mut pieces = Vec::new();
    while !cursor.at_end() {
        let id = pieces.len();
        let score = cursor
            .f32()
            .ok_or_else(|| format!("truncated score of piece {id}"))?;
        let len = cursor
            .i32()
            .ok_or_else(|| format!("truncated length of piece {id}"))?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= max_len as usize + 2)
            .ok_or_else(|| format!("piece {id} has length {len}, max is {max_len}"))?;
        let raw = cursor
            .take(len)
            .ok_or_else(|| format!("piece {id} runs past the end of the file"))?;
        if !score.is_finite() {
            return Err(format!("piece {id} has score {score}"));
        }
        let text =
            std::str::from_utf8(raw).map_err(|_| format!("piece {id} is not valid UTF-8"))?;
        pieces.push(piece(id, text, score));
    }
    if pieces.len() < 3 {
        return Err(format!(
            "only {} pieces; a Llama vocabulary has <unk>, <s>, </s> first",
            pieces.len()
        ));
    }
    Ok(pieces)
}

/// Restores the SentencePiece form of one exported piece.
fn piece(id: usize, text: &str, score: f32) -> Piece {
    let (text, kind) = match id {
        0 => (text.trim().to_string(), PieceKind::Unknown),
        1 | 2 => (text.trim().to_string(), PieceKind::Control),
        _ if is_byte_piece(text) => (text.to_string(), PieceKind::Byte),
        _ => (
            text.replace(' ', &SPACE_MARKER.to_string()),
            PieceKind::Normal,
        ),
    };
    Piece { text, score, kind }
}

/// `<0xAB>`: SentencePiece's byte-fallback pieces.
fn is_byte_piece(text: &str) -> bool {
    text.len() == 6
        && text.starts_with("<0x")
        && text.ends_with('>')
        && text[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

/// The vocabulary size in a llama2.c model file's header (7 x i32: dim, hidden_dim, n_layers, n_heads,
/// n_kv_heads, vocab_size (negative when the classifier is not shared), seq_len), to pick `tok{vocab}.bin`.
pub(crate) fn model_vocab_size(model: &Path) -> Option<usize> {
    use std::io::Read;
    let mut header = [0u8; 28];
    std::fs::File::open(model)
        .ok()?
        .read_exact(&mut header)
        .ok()?;
    let field = |i: usize| {
        i32::from_le_bytes([
            header[4 * i],
            header[4 * i + 1],
            header[4 * i + 2],
            header[4 * i + 3],
        ])
    };
    let vocab = field(5).unsigned_abs() as usize;
    let plausible = (0..5).all(|i| field(i) > 0) && (1..=1 << 20).contains(&vocab);
    plausible.then_some(vocab)
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn at_end(&self) -> bool {
        self.pos >= self.bytes.len()
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let out = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(out)
    }

    fn array4(&mut self) -> Option<[u8; 4]> {
        self.take(4)?.try_into().ok()
    }

    fn i32(&mut self) -> Option<i32> {
        self.array4().map(i32::from_le_bytes)
    }

    fn f32(&mut self) -> Option<f32> {
        self.array4().map(f32::from_le_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(max_len: i32, pieces: &[(&str, f32)]) -> Vec<u8> {
        let mut out = max_len.to_le_bytes().to_vec();
        for (text, score) in pieces {
            out.extend(score.to_le_bytes());
            out.extend((text.len() as i32).to_le_bytes());
            out.extend(text.as_bytes());
        }
        out
    }

    #[test]
    fn parses_and_restores_pieces() {
        let bytes = encode(
            7,
            &[
                ("<unk>", 0.0),
                ("\n<s>\n", 0.0),
                ("\n</s>\n", 0.0),
                ("<0x0A>", 0.0),
                (" the", -1.0),
            ],
        );
        let pieces = parse(&bytes).unwrap();
        let texts: Vec<&str> = pieces.iter().map(|p| p.text.as_str()).collect();
        assert_eq!(texts, ["<unk>", "<s>", "</s>", "<0x0A>", "\u{2581}the"]);
        assert_eq!(pieces[3].kind, PieceKind::Byte);
        assert_eq!(pieces[4].kind, PieceKind::Normal);
    }

    #[test]
    fn rejects_garbage() {
        assert!(parse(&[]).is_err());
        assert!(parse(&[1, 0]).is_err());
        assert!(parse(&encode(0, &[])).is_err());
        let mut bytes = encode(7, &[("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]);
        bytes.extend(0f32.to_le_bytes());
        bytes.extend(1000i32.to_le_bytes());
        assert!(parse(&bytes).unwrap_err().contains("length 1000"));
        let mut truncated = encode(7, &[("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]);
        truncated.pop();
        assert!(parse(&truncated).is_err());
    }
}
