//! petal-model: everything about the model itself, shared by the node and the client.
//!
//! [`compute`]: a model is opened once ([`ModelSource`]) from a Hugging Face directory, a GGUF file or a llama2.c
//! file; from it a node loads only the [`BlockSpan`] it serves, and a client only the [`Head`] (embeddings, final
//! norm, LM head). Every tensor entering a block passes through [`normalise`].
//!
//! [`text`]: tokenizers, chat templates, sampling and the [`Generation`] state machine that turns logits into
//! tokens and text.
//!
//! With the `synthetic` feature, [`synthetic`] writes random-weight models of a chosen shape (benchmarks, tests).
pub mod compute;
pub mod error;
pub mod hub;
pub mod models_dir;
#[cfg(feature = "synthetic")]
pub mod synthetic;
pub mod text;

pub use compute::block_range::BlockRange;
pub use compute::head::Head;
pub use compute::placement::{normalise, DeviceSpec, Placement};
pub use compute::scheduler::{
    BatchInfo, PendingStep, SchedulerError, SessionStep, SpanScheduler, Stepped,
};
pub use compute::source::{ModelFormat, ModelSource};
pub use compute::span::{BatchStep, BlockSpan, SpanCache};
pub use compute::spec::ModelSpec;
pub use error::{ModelError, Result};
pub use hub::{HubConfig, ModelRef};
pub use text::decoding::{FinishReason, Generation, GenerationConfig, GenerationOutput};
pub use text::tokenizer::Tokenizer;
