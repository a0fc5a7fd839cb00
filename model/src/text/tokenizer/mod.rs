//! Text <-> token ids for every model format Petal opens, behind one type.
//!
//! Everything is a Hugging Face `tokenizers::Tokenizer` underneath: a tokenizer.json is loaded as is, and the
//! other formats (llama2.c `tokenizer.bin`, GGUF metadata) are rebuilt into the tokenizer.json that
//! `transformers` would produce for them, so one code path encodes and decodes, and ids match the reference
//! implementation. What a tokenizer.json does not say (add BOS or not, which ids end generation, the chat
//! template) comes from the format's side files or metadata and is resolved once here.
mod gguf;
mod hf;
mod llama2c;
mod spm;

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};
use crate::text::chat::ChatTemplate;

/// Tokens that end a chat turn in common templates. They stop generation when the chat template uses them,
/// even where the model's configured EOS is another token (e.g. Llama 3's `<|eot_id|>`).
const END_OF_TURN_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
];

/// Generic end-of-text tokens: they end generation whenever they are special tokens of the vocabulary.
const END_OF_TEXT_TOKENS: &[&str] = &["<|endoftext|>"];

/// Where to look for BOS / EOS when nothing names them.
const BOS_GUESSES: &[&str] = &["<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"];
const EOS_GUESSES: &[&str] = &["</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>"];

/// A tokenizer with the special-token facts needed to build prompts and stop generation.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    add_bos: bool,
    vocab_size: usize,
    chat_template: Option<ChatTemplate>,
    /// The decoder maps GPT-2's byte-level characters back to bytes (as opposed to SentencePiece's `▁` and
    /// `<0xHH>` byte pieces): how [`Tokenizer::token_bytes`] reads a piece.
    byte_level: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// A special token as a side file names it: by id or by text.
#[derive(Clone, Debug)]
pub(crate) enum SpecialRef {
    Id(u32),
    Text(String),
}

/// What a format's side files or metadata say beyond the tokenizer itself; each field is optional because each
/// source says only part of it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Specials {
    pub bos: Option<SpecialRef>,
    pub eos: Vec<SpecialRef>,
    pub add_bos: Option<bool>,
    pub chat_template: Option<String>,
}

impl Specials {
    /// Fills what `self` lacks from `other` (a lower-priority source).
    fn or(mut self, other: Specials) -> Specials {
        if self.bos.is_none() {
            self.bos = other.bos;
        }
        if self.eos.is_empty() {
            self.eos = other.eos;
        }
        if self.add_bos.is_none() {
            self.add_bos = other.add_bos;
        }
        if self.chat_template.is_none() {
            self.chat_template = other.chat_template;
        }
        self
    }
}

impl Tokenizer {
    /// Finds and loads the tokenizer of a model path. `override_path` (the CLI's `--tokenizer`) wins when given.
    ///
    /// - Hugging Face directory (or a `.safetensors` file in one): `tokenizer.json`, with `tokenizer_config.json`,
    ///   `config.json` and `generation_config.json` when present.
    /// - `.gguf`: a `tokenizer.json` beside it, else the tokenizer in its metadata.
    /// - llama2.c `.bin`: `tokenizer.json` beside it, else a llama2.c tokenizer beside it (`tok{vocab}.bin`,
    ///   `tokenizer.bin`, `tok*.bin`), else `hf/tokenizer.json` below its directory. llama2.c models always use
    ///   BOS 1 (added to prompts) and EOS 2, whatever tokenizer file is used.
    pub fn for_model(model_path: &Path, override_path: Option<&Path>) -> Result<Self> {
        let mut tokenizer = match override_path {
            Some(path) => Self::from_file(path)?,
            None => Self::discover(model_path)?,
        };
        if is_llama2c_model(model_path) {
            tokenizer.apply_llama2c_conventions();
        }
        Ok(tokenizer)
    }

    /// Loads one explicit file: a tokenizer.json (with the side files of its directory), a llama2.c tokenizer
    /// `.bin`, or a `.gguf` (its metadata). A directory is read as a Hugging Face model directory.
    pub fn from_file(path: &Path) -> Result<Self> {
        if path.is_dir() {
            return Self::from_hf_json(&path.join("tokenizer.json"));
        }
        if !path.is_file() {
            return Err(ModelError::Tokenizer(format!(
                "tokenizer file {} does not exist",
                path.display()
            )));
        }
        match extension(path).as_deref() {
            Some("json") => Self::from_hf_json(path),
            Some("model") => Err(ModelError::Tokenizer(format!(
                "{} looks like a SentencePiece .model file, which is not supported; use the model's \
                 tokenizer.json (or a llama2.c tokenizer.bin / a .gguf with a tokenizer)",
                path.display()
            ))),
            _ if is_gguf(path) => Self::from_gguf(path),
            Some("gguf") => Err(ModelError::Tokenizer(format!(
                "{} is not a GGUF file (bad magic)",
                path.display()
            ))),
            _ => Self::from_llama2c(path),
        }
    }

    /// Encodes text. With `add_bos`, the BOS token is prepended when this model expects one
    /// ([`Self::add_bos_default`]) and the text does not already start with it. Special-token texts in `text`
    /// (e.g. `<|im_start|>` from a chat template) become their special ids.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(format!("cannot encode text: {e}")))?;
        let mut ids = encoding.get_ids().to_vec();
        if add_bos && self.add_bos {
            if let Some(bos) = self.bos_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    /// Decodes ids; ids outside the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| ModelError::Tokenizer(format!("cannot decode tokens: {e}")))
    }

    /// Whether prompts of this model start with BOS.
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Every id that ends generation: the model's EOS ids plus the end-of-turn token its chat template uses.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_ids.contains(&id)
    }

    /// Number of ids (highest id + 1, added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes one token stands for, as it would appear inside generated text (a SentencePiece `▁the` is
    /// ` the`, a byte piece `<0x0A>` is `\n`, a byte-level BPE piece may be part of a UTF-8 character). Special
    /// tokens give their text; an id outside the vocabulary gives nothing.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let Some(piece) = self.inner.id_to_token(id) else {
            return vec![];
        };
        if self.inner.get_added_vocabulary().is_special_token(&piece) {
            return piece.into_bytes();
        }
        if let Some(byte) = byte_piece(&piece) {
            return vec![byte];
        }
        if self.byte_level {
            if let Some(bytes) = piece.chars().map(byte_level_byte).collect() {
                return bytes;
            }
        }
        piece.replace('\u{2581}', " ").into_bytes()
    }

    /// The underlying Hugging Face tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Tries each place a model format keeps its tokenizer, in order.
    fn discover(model: &Path) -> Result<Self> {
        if model.is_dir() {
            let json = model.join("tokenizer.json");
            if json.is_file() {
                return Self::from_hf_json(&json);
            }
            return Err(not_found(model, &[json]));
        }
        if !model.is_file() {
            return Err(ModelError::Tokenizer(format!(
                "model path {} does not exist",
                model.display()
            )));
        }
        let dir = parent_dir(model);
        let beside_json = dir.join("tokenizer.json");
        match extension(model).as_deref() {
            Some("safetensors") => {
                if beside_json.is_file() {
                    return Self::from_hf_json(&beside_json);
                }
                Err(not_found(model, &[beside_json]))
            }
            _ if is_gguf(model) => {
                if beside_json.is_file() {
                    return Self::from_hf_json_with_gguf(&beside_json, model);
                }
                Self::from_gguf(model)
            }
            _ => {
                let mut tried = vec![beside_json.clone()];
                if beside_json.is_file() {
                    return Self::from_hf_json(&beside_json);
                }
                for candidate in llama2c_tokenizer_candidates(model, &dir) {
                    if candidate.is_file() {
                        return Self::from_llama2c(&candidate);
                    }
                    tried.push(candidate);
                }
                let hf_json = dir.join("hf").join("tokenizer.json");
                if hf_json.is_file() {
                    return Self::from_hf_json(&hf_json);
                }
                tried.push(hf_json);
                Err(not_found(model, &tried))
            }
        }
    }

    fn from_hf_json(path: &Path) -> Result<Self> {
        let inner = hf::load_tokenizer_json(path)?;
        let specials = hf::dir_specials(&parent_dir(path))?;
        Self::assemble(inner, specials)
    }

    /// A tokenizer.json beside a GGUF: its side files first, the GGUF metadata for anything they lack (typically
    /// the chat template and special ids).
    fn from_hf_json_with_gguf(path: &Path, gguf_path: &Path) -> Result<Self> {
        let inner = hf::load_tokenizer_json(path)?;
        let mut specials = hf::dir_specials(&parent_dir(path))?;
        match gguf::read_metadata(gguf_path) {
            Ok(md) => {
                let mut from_gguf = gguf::specials(&md, false);
                // Whether to add BOS is the tokenizer.json's business (its post-processor) unless a side file says.
                from_gguf.add_bos = md
                    .get("tokenizer.ggml.add_bos_token")
                    .and_then(|v| v.to_bool().ok());
                specials = specials.or(from_gguf);
            }
            Err(e) => tracing::warn!(error = %e, "ignoring GGUF metadata beside tokenizer.json"),
        }
        Self::assemble(inner, specials)
    }

    fn from_gguf(path: &Path) -> Result<Self> {
        let (inner, specials) = gguf::load(path)?;
        Self::assemble(inner, specials)
    }

    fn from_llama2c(path: &Path) -> Result<Self> {
        let pieces = llama2c::read(path)?;
        let inner = spm::build(&pieces, true)?;
        let specials = Specials {
            bos: Some(SpecialRef::Id(llama2c::BOS_ID)),
            eos: vec![SpecialRef::Id(llama2c::EOS_ID)],
            add_bos: Some(true),
            chat_template: None,
        };
        Self::assemble(inner, specials)
    }

    /// Resolves the special tokens against the vocabulary and compiles the chat template.
    fn assemble(mut inner: tokenizers::Tokenizer, specials: Specials) -> Result<Self> {
        // A tokenizer.json may carry truncation/padding for training; prompts must never be cut or padded.
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| ModelError::Tokenizer(format!("cannot disable truncation: {e}")))?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&max| max as usize + 1);
        let resolve = |r: &SpecialRef| match r {
            SpecialRef::Id(id) => inner.id_to_token(*id).map(|_| *id),
            SpecialRef::Text(text) => inner.token_to_id(text),
        };
        let first_present = |names: &[&str]| names.iter().find_map(|t| inner.token_to_id(t));

        let bos_id = specials
            .bos
            .as_ref()
            .and_then(resolve)
            .or_else(|| first_present(BOS_GUESSES));
        let mut eos_ids: Vec<u32> = Vec::new();
        for id in specials.eos.iter().filter_map(resolve) {
            push_unique(&mut eos_ids, id);
        }
        if eos_ids.is_empty() {
            eos_ids.extend(first_present(EOS_GUESSES));
        }
        let template_source = specials.chat_template.as_deref().unwrap_or("");
        for token in END_OF_TURN_TOKENS {
            if template_source.contains(token) {
                if let Some(id) = inner.token_to_id(token) {
                    push_unique(&mut eos_ids, id);
                }
            }
        }
        let added = inner.get_added_vocabulary();
        for token in END_OF_TEXT_TOKENS {
            if added.is_special_token(token) {
                if let Some(id) = inner.token_to_id(token) {
                    push_unique(&mut eos_ids, id);
                }
            }
        }

        let add_bos = match specials.add_bos {
            Some(add) => add,
            None => post_processor_adds(&inner, bos_id),
        };
        if add_bos && bos_id.is_none() {
            tracing::warn!("the tokenizer should add BOS but has no BOS token; prompts get none");
        }
        let bos_text = bos_id.and_then(|id| inner.id_to_token(id));
        let eos_text = eos_ids.first().and_then(|&id| inner.id_to_token(id));
        let chat_template = specials.chat_template.as_deref().and_then(|source| {
            ChatTemplate::new(source, bos_text, eos_text)
                .map_err(|e| tracing::warn!(error = %e, "ignoring the model's chat template"))
                .ok()
        });
        let byte_level = inner
            .get_decoder()
            .and_then(|d| serde_json::to_string(d).ok())
            .is_some_and(|json| json.contains("\"ByteLevel\""));
        Ok(Self {
            inner,
            bos_id,
            eos_ids,
            add_bos,
            vocab_size,
            chat_template,
            byte_level,
        })
    }

    /// llama2.c's `run.c` always prepends BOS 1 and stops at EOS 2 (or BOS 1), whatever the tokenizer file says.
    fn apply_llama2c_conventions(&mut self) {
        if self.inner.id_to_token(llama2c::BOS_ID).is_some() {
            self.bos_id = Some(llama2c::BOS_ID);
            self.add_bos = true;
        }
        if self.inner.id_to_token(llama2c::EOS_ID).is_some() && !self.is_eos(llama2c::EOS_ID) {
            self.eos_ids.insert(0, llama2c::EOS_ID);
        }
    }
}

fn push_unique(ids: &mut Vec<u32>, id: u32) {
    if !ids.contains(&id) {
        ids.push(id);
    }
}

/// Whether the tokenizer.json's post-processor adds BOS itself (Llama 3 style), for files that do not say.
fn post_processor_adds(inner: &tokenizers::Tokenizer, bos: Option<u32>) -> bool {
    let Some(bos) = bos else {
        return false;
    };
    let first = |special| {
        inner
            .encode("a", special)
            .ok()
            .and_then(|e| e.get_ids().first().copied())
    };
    first(true) == Some(bos) && first(false) != Some(bos)
}

/// llama2.c tokenizer files that may sit beside a model, best first: `tok{vocab}.bin` (named after the model's
/// vocabulary size, as in llama2.c's repository), `tokenizer.bin`, then any other `tok*.bin`.
fn llama2c_tokenizer_candidates(model: &Path, dir: &Path) -> Vec<PathBuf> {
    let mut candidates = Vec::new();
    if let Some(vocab) = llama2c::model_vocab_size(model) {
        candidates.push(dir.join(format!("tok{vocab}.bin")));
    }
    candidates.push(dir.join("tokenizer.bin"));
    let mut others: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|entry| entry.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("tok") && name.ends_with(".bin") && p.as_path() != model
        })
        .filter(|p| !candidates.contains(p))
        .collect();
    others.sort();
    candidates.extend(others);
    candidates
}

fn not_found(model: &Path, tried: &[PathBuf]) -> ModelError {
    let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    ModelError::Tokenizer(format!(
        "no tokenizer found for {} (tried {}); pass --tokenizer with a tokenizer.json, a llama2.c tokenizer.bin \
         or a .gguf that contains one",
        model.display(),
        tried.join(", ")
    ))
}

/// A model is llama2.c's when it is a `.bin` that is not GGUF.
fn is_llama2c_model(path: &Path) -> bool {
    path.is_file() && extension(path).as_deref() == Some("bin") && !is_gguf(path)
}

/// GGUF files start with the magic "GGUF".
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

fn extension(path: &Path) -> Option<String> {
    path.extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
}

/// The directory holding `path` ("." for a bare file name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// I/O errors on tokenizer files, reported as tokenizer errors that name the file.
pub(crate) fn read_error(path: &Path, err: &std::io::Error) -> ModelError {
    ModelError::Tokenizer(format!("cannot read {}: {err}", path.display()))
}

/// Loads a tokenizer.json built in memory.
pub(crate) fn from_json_value(spec: &serde_json::Value) -> Result<tokenizers::Tokenizer> {
    let bytes = serde_json::to_vec(spec)
        .map_err(|e| ModelError::Tokenizer(format!("cannot serialise tokenizer: {e}")))?;
    tokenizers::Tokenizer::from_bytes(bytes)
        .map_err(|e| ModelError::Tokenizer(format!("cannot build tokenizer: {e}")))
}

/// SentencePiece's byte-fallback piece `<0xHH>`.
fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

/// The byte GPT-2's byte-level alphabet writes as `c`: printable bytes stand for themselves, the other 68 are
/// shifted to U+0100.. in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let code = c as u32;
    if code < 256 {
        return printable(code).then_some(code as u8);
    }
    let n = code - 256;
    (0..256u32)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    /// Tokenizers are shared between tasks and threads (the client's sessions, the node's API).
    #[test]
    fn tokenizer_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<super::Tokenizer>();
        assert_send_sync::<crate::text::chat::ChatTemplate>();
        assert_send_sync::<crate::text::sampling::Sampler>();
        assert_send_sync::<crate::text::stream::StopMatcher>();
    }

    #[test]
    fn byte_pieces_and_byte_level_alphabet() {
        assert_eq!(super::byte_piece("<0x0A>"), Some(b'\n'));
        assert_eq!(super::byte_piece("<0xE2>"), Some(0xE2));
        assert_eq!(super::byte_piece("<0x0A0>"), None);
        assert_eq!(super::byte_piece("the"), None);
        assert_eq!(super::byte_level_byte('a'), Some(b'a'));
        assert_eq!(super::byte_level_byte('\u{0120}'), Some(b' ')); // Ġ
        assert_eq!(super::byte_level_byte('\u{010A}'), Some(b'\n')); // Ċ
        assert_eq!(super::byte_level_byte('\u{0100}'), Some(0));
        assert_eq!(super::byte_level_byte('\u{0143}'), Some(0xAD)); // the last of the 68 shifted bytes
        assert_eq!(super::byte_level_byte('\u{0144}'), None);
        assert_eq!(super::byte_level_byte(' '), None);
        // Every byte has exactly one character.
        let mut seen = [false; 256];
        for c in (0u32..0x200).filter_map(char::from_u32) {
            if let Some(b) = super::byte_level_byte(c) {
                assert!(!seen[b as usize], "{b} twice");
                seen[b as usize] = true;
            }
        }
        assert!(seen.iter().all(|&s| s));
    }
}
