//! petal-model: everything about the model itself, shared by the node and the client.
//!
//! A model is opened once ([`ModelSource`]) from a Hugging Face directory, a GGUF file or a llama2.c file; from it a
//! node loads only the [`BlockSpan`] it serves, and a client only the [`Head`] (embeddings, final norm, LM head).
//! Every tensor entering a block passes through [`placement::normalise`].
pub mod block;
pub mod block_range;
pub mod chat;
pub mod error;
pub mod generation;
pub mod head;
pub mod placement;
pub mod prompt;
pub mod sampling;
pub mod source;
pub mod span;
pub mod spec;
pub mod synthetic;
pub mod text_stream;
pub mod tokenizer;
pub mod weights;
pub mod wire;

pub use block_range::BlockRange;
pub use error::{ModelError, Result};
pub use generation::{FinishReason, GenerationConfig, GenerationOutput, LocalModel};
pub use head::Head;
pub use placement::{normalise, DeviceSpec, Placement};
pub use source::{ModelFormat, ModelSource};
pub use span::{BlockSpan, SpanCache};
pub use spec::ModelSpec;
