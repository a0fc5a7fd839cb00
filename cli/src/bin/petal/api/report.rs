//! What an answer reports beyond its text: log-probabilities in OpenAI's two shapes, and the `petal` object (the
//! route through the swarm, speed, failovers) that the chat page shows under each answer.
use super::jobs::Endpoint;
use super::state::AppState;
use petal_client::Completion;
use petal_model::text::sampling::TokenLogprob;
use petal_model::Tokenizer;
use serde_json::{json, Map, Value};

/// Formats log-probabilities for one answer; a stream calls it once per chunk, so legacy `text_offset`s keep
/// counting across chunks.
pub struct Logprobs<'a> {
    endpoint: Endpoint,
    tokenizer: &'a Tokenizer,
    /// Characters of the completion before the next token.
    offset: usize,
}

impl<'a> Logprobs<'a> {
    pub fn new(endpoint: Endpoint, tokenizer: &'a Tokenizer) -> Self {
        Self {
            endpoint,
            tokenizer,
            offset: 0,
        }
    }

    /// A token's text (invalid UTF-8, such as part of a character, as U+FFFD) and its exact bytes.
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id);
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// The `logprobs` of a choice (or of a chunk) holding `entries`: chat's `{"content": [...]}`, or the legacy
    /// completions' `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`.
    pub fn format(&mut self, entries: &[TokenLogprob]) -> Value {
        match self.endpoint {
            Endpoint::Chat => {
                let content: Vec<Value> = entries
                    .iter()
                    .map(|e| {
                        let (token, bytes) = self.token(e.token);
                        let top: Vec<Value> = e
                            .top
                            .iter()
                            .map(|a| {
                                let (token, bytes) = self.token(a.token);
                                json!({"token": token, "logprob": a.logprob, "bytes": bytes})
                            })
                            .collect();
                        json!({"token": token, "logprob": e.logprob, "bytes": bytes, "top_logprobs": top})
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Endpoint::Completions => {
                let (mut tokens, mut logprobs, mut tops, mut offsets) =
                    (vec![], vec![], vec![], vec![]);
                for e in entries {
                    let (token, _) = self.token(e.token);
                    offsets.push(self.offset);
                    self.offset += token.chars().count();
                    tokens.push(token);
                    logprobs.push(e.logprob);
                    let mut top = Map::new();
                    for a in &e.top {
                        top.entry(self.token(a.token).0)
                            .or_insert_with(|| json!(a.logprob));
                    }
                    tops.push(Value::Object(top));
                }
                json!({"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets})
            }
        }
    }
}

/// The log-probabilities of the tokens a completion's text came from: one per generated token, the
/// end-of-sequence token that ended it excluded.
pub fn generated(completion: &Completion) -> &[TokenLogprob] {
    let n = completion
        .output
        .tokens
        .len()
        .min(completion.logprobs.len());
    &completion.logprobs[..n]
}

/// Petal's own report on an answer, as the extra field `petal` (OpenAI clients ignore fields they do not know):
/// the route (`name(peer)[blocks]` per hop; empty when the whole model runs in the API process), decode speed,
/// time to the first token, bytes over the network, every failover (a server replaced mid-answer) and what the
/// checks of servers' answers found.
pub fn petal(state: &AppState, completion: &Completion) -> Value {
    let out = &completion.output;
    let failovers: Vec<Value> = completion
        .cost
        .failovers
        .iter()
        .map(|f| {
            json!({
                "failed_peer": f.failed_peer,
                "blocks": f.range.to_string(),
                "reason": f.reason,
                "replayed_steps": f.replayed_steps,
                "elapsed_ms": round(f.elapsed.as_secs_f64() * 1e3),
            })
        })
        .collect();
    json!({
        "route": completion.cost.route,
        "local": state.generator.is_local(),
        "completion_tokens": completion.sampled.len(),
        "tokens_per_second": round(out.tokens_per_second),
        "first_token_ms": round(out.first_token_ms),
        "total_ms": round(out.total_ms),
        "bytes_on_wire": completion.cost.bytes_on_wire,
        "failovers": failovers,
        "verification": completion.cost.verification,
    })
}

/// Two decimals are plenty for a person and keep the JSON short.
fn round(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}
