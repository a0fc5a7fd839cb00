//! The numeric side of a model: what it is ([`spec`]), where its tensors come from ([`source`], [`weights`]), the
//! blocks a node serves ([`block`], [`span`], whose big CPU batches go in [`lanes`]) and the thread that batches
//! their sessions' steps ([`scheduler`]), the client's local parts ([`head`]) and the one matmul its concurrent
//! sessions' LM heads share ([`row_batcher`]), when both batchers wait for more callers ([`gathering`]), where
//! tensors live ([`placement`]), the threads CPU compute runs on ([`pool`]) and how hidden states cross the wire
//! ([`wire`]).
pub mod block;
pub mod block_range;
mod cuda;
mod deepseek_gguf;
pub mod family;
pub(crate) mod gathering;
pub mod hash_cache;
pub mod head;
pub(crate) mod lanes;
pub mod linear;
pub mod placement;
pub mod pool;
pub mod rms_norm;
pub mod row_batcher;
pub mod scheduler;
pub mod source;
pub mod span;
pub mod spec;
pub mod weights;
pub mod wire;
