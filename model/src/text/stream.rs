//! Turning generated tokens into text as they arrive, and cutting generation at stop strings.
//!
//! Decoding tokens one at a time is wrong in two ways: a character may be split over several byte-fallback /
//! byte-level tokens (decoding half of it yields U+FFFD), and SentencePiece decoders strip the leading space of
//! the first token of every `decode` call ("▁the" alone decodes to "the"). So, as HF's `TextStreamer`, TGI and
//! candle's `TokenOutputStream` do, [`TextStream`] decodes a small window that starts at an already emitted
//! token and emits only what the new token added to that window's text, once the text no longer ends in an
//! incomplete character.
use crate::error::Result;
use crate::text::tokenizer::Tokenizer;

/// How many tokens may wait for an incomplete character before we give up and emit the replacement character:
/// one UTF-8 character is at most 4 bytes, so more pending tokens means the bytes are simply invalid.
const MAX_PENDING: usize = 8;

/// How many prompt tokens [`TextStream::with_context`] keeps as the first decode window.
const CONTEXT_TOKENS: usize = 8;

/// Incremental detokeniser for one generation. Special tokens (BOS, `<|im_end|>`, ...) are skipped.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    tokens: Vec<u32>,
    /// Start of the decode window: the first token of the last emitted chunk (or the context).
    prefix_offset: usize,
    /// Tokens before this are emitted; those after it are pending.
    read_offset: usize,
    text: String,
}

impl<'a> TextStream<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            tokens: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            text: String::new(),
        }
    }

    /// A stream that continues after `context` (the prompt): its last tokens seed the decode window without
    /// being emitted, so a first generated token like "▁there" keeps its leading space.
    pub fn with_context(tokenizer: &'a Tokenizer, context: &[u32]) -> Self {
        let start = context.len().saturating_sub(CONTEXT_TOKENS);
        let tokens = context[start..].to_vec();
        let read_offset = tokens.len();
        Self {
            tokenizer,
            tokens,
            prefix_offset: 0,
            read_offset,
            text: String::new(),
        }
    }

    /// Appends a token; returns the text it completed, if any. Never returns half a character.
    pub fn push(&mut self, token: u32) -> Result<Option<String>> {
        self.tokens.push(token);
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.tokens.len())?;
        let pending = self.tokens.len() - self.read_offset;
        let incomplete = new_text.ends_with(char::REPLACEMENT_CHARACTER);
        if new_text.len() <= prefix_text.len() || (incomplete && pending < MAX_PENDING) {
            return Ok(None);
        }
        Ok(self.emit(&prefix_text, &new_text))
    }

    /// Emits whatever is still pending (e.g. a truncated character at the end of generation).
    pub fn finish(&mut self) -> Result<Option<String>> {
        if self.read_offset >= self.tokens.len() {
            return Ok(None);
        }
        let prefix_text = self.decode(self.prefix_offset, self.read_offset)?;
        let new_text = self.decode(self.prefix_offset, self.tokens.len())?;
        Ok(self.emit(&prefix_text, &new_text))
    }

    /// All text emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Every token pushed (after any context).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn decode(&self, from: usize, to: usize) -> Result<String> {
        self.tokenizer.decode(&self.tokens[from..to], true)
    }

    /// Emits the part of `new_text` after `prefix_text` and slides the window forward.
    fn emit(&mut self, prefix_text: &str, new_text: &str) -> Option<String> {
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        // The window's text normally only grows at its end. Should a decoder rewrite earlier text, emit from the
        // first difference: text already shown cannot be taken back.
        let start = if new_text.starts_with(prefix_text) {
            prefix_text.len()
        } else {
            common_prefix_len(prefix_text, new_text)
        };
        let delta = &new_text[start..];
        if delta.is_empty() {
            return None;
        }
        self.text.push_str(delta);
        Some(delta.to_string())
    }
}

/// Length in bytes of the longest common prefix of `a` and `b`, on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

/// Stop-string detection over streamed text. Text that might be the start of a stop string is held back until
/// the next push shows whether it is, so a stop string split across tokens is never shown to the user.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    stopped: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            stopped: false,
        }
    }

    /// Feeds newly decoded text; returns the text that is safe to show now and whether a stop string was found.
    /// On a stop the returned text ends right before the stop string; later pushes return nothing.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.held.push_str(text);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|stop| self.held.find(stop.as_str()))
            .min();
        if let Some(at) = first_stop {
            self.held.truncate(at);
            self.stopped = true;
            return (std::mem::take(&mut self.held), true);
        }
        let keep = self.partial_stop_len();
        let out: String = self.held.drain(..self.held.len() - keep).collect();
        (out, false)
    }

    /// At the end of generation: releases the held-back text (nothing if a stop string was found).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Whether a stop string has been seen.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Length of the longest suffix of the held text that is a proper prefix of some stop string.
    fn partial_stop_len(&self) -> usize {
        self.stops
            .iter()
            .filter_map(|stop| {
                (1..stop.len())
                    .rev()
                    .filter(|&k| stop.is_char_boundary(k))
                    .find(|&k| self.held.ends_with(&stop[..k]))
            })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_on_char_boundary() {
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("é", "è"), 0);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
    }

    #[test]
    fn stop_matcher_holds_partial_multibyte_prefix() {
        let mut m = StopMatcher::new(vec!["☃☃".into(), String::new()]);
        assert_eq!(m.push("a☃"), ("a".to_string(), false));
        assert_eq!(m.push("b"), ("☃b".to_string(), false));
        assert_eq!(m.push("☃"), (String::new(), false));
        assert_eq!(m.push("☃c"), (String::new(), true));
        assert_eq!(m.push("more"), (String::new(), true));
        assert_eq!(m.flush(), "");
    }
}
