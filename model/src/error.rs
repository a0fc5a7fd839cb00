//! The one error type of the model crate: every bad input names what was wrong.
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file not found: {0}")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("unrecognised model format at {0}: expected a Hugging Face directory (config.json + *.safetensors), a .safetensors file, a .gguf file or a llama2.c .bin file")]
    UnknownFormat(PathBuf),
    #[error("unsupported architecture {0:?}: Petal serves llama, mistral, mixtral, qwen2, qwen3, phi3, gemma2 and gemma3 decoders")]
    UnknownArchitecture(String),
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("corrupt or unreadable {format} file {path}: {reason}")]
    Corrupt {
        format: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("tensor {name:?} is missing from the model files")]
    MissingTensor { name: String },
    #[error("tensor {name:?} has shape {actual:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("invalid block range {range}: {reason}")]
    BlockRange { range: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("device {asked:?} is not available ({reason}); available: {available}")]
    Device {
        asked: String,
        reason: String,
        available: String,
    },
    #[error("hidden states have shape {actual:?}, expected [batch, tokens, {hidden_size}]")]
    HiddenShape {
        actual: Vec<usize>,
        hidden_size: usize,
    },
    #[error("position {position} with {tokens} new tokens exceeds the session's max length {max_length}")]
    TooLong {
        position: usize,
        tokens: usize,
        max_length: usize,
    },
    #[error("position {got} is out of order: the cache holds {expected} positions")]
    Position { expected: usize, got: usize },
    #[error("sampling: {0}")]
    Sampling(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// A hub repository, revision or file that cannot be used as asked (not found, no access, ambiguous GGUF).
    #[error("Hugging Face hub: {0}")]
    Hub(String),
    /// A hub file that is not cached and cannot be downloaded: offline (`HF_HUB_OFFLINE`) or no network.
    #[error("{file} of {repo} is not in the Hugging Face cache {cache} and cannot be downloaded: {reason}")]
    HubOffline {
        /// `org/name@revision`.
        repo: String,
        file: String,
        cache: PathBuf,
        reason: String,
    },
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            return Self::NotFound(path.into());
        }
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
