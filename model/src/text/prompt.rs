//! Turning user text into prompt ids: plain text with the model's BOS convention, or a chat rendered through the
//! model's own template.
use crate::error::{ModelError, Result};
use crate::text::chat::ChatMessage;
use crate::text::tokenizer::Tokenizer;

/// Ids for `text`; with `chat`, `text` is one user message rendered through the chat template after a system
/// message of `system` (see [`chat_messages`]).
pub fn encode_prompt(
    tokenizer: &Tokenizer,
    text: &str,
    chat: bool,
    system: Option<&str>,
) -> Result<Vec<u32>> {
    if chat {
        encode_chat(tokenizer, &chat_messages(text, system))
    } else {
        tokenizer.encode(text, true)
    }
}

/// A one-turn conversation. The system message is always present, empty unless `system` is given: templates such
/// as SmolLM2's inject a default persona when the conversation has no system message, and on that small model the
/// persona derails answers ("What is the capital of France?" stops being answered with Paris). An explicit, empty
/// system turn is what llama.cpp's chat mode amounts to, and `--system` sets a real one.
pub fn chat_messages(user: &str, system: Option<&str>) -> Vec<ChatMessage> {
    vec![
        ChatMessage::system(system.unwrap_or("")),
        ChatMessage::user(user),
    ]
}

/// Ids for a conversation, ending with the assistant's turn opened. Templates that refuse a system role get the
/// conversation without an empty system turn.
pub fn encode_chat(tokenizer: &Tokenizer, messages: &[ChatMessage]) -> Result<Vec<u32>> {
    let template = tokenizer.chat_template().ok_or_else(|| {
        ModelError::ChatTemplate(
            "this model has no chat template (tokenizer_config.json or GGUF metadata)".into(),
        )
    })?;
    let rendered = match template.render(messages, true) {
        Ok(r) => r,
        Err(e) => match messages.split_first() {
            Some((first, rest)) if first.role == "system" && first.content.is_empty() => {
                template.render(rest, true)?
            }
            _ => return Err(e),
        },
    };
    // A template that writes BOS itself must not get a second one from the tokenizer.
    tokenizer.encode(&rendered, !template.renders_bos())
}
