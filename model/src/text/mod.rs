//! The text side of a model: token ids from text ([`tokenizer`], [`chat`], [`prompt`]), tokens from logits
//! ([`sampling`], [`greedy`]), and text back from tokens as they come ([`stream`]), tied together by [`decoding`].
pub mod chat;
pub mod decoding;
pub mod greedy;
pub mod prompt;
pub mod sampling;
pub mod stream;
pub mod tokenizer;
