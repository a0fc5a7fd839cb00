//! Streamed answers (`stream: true`): server-sent events in OpenAI's chunk format, `data: [DONE]` at the end.
//!
//! The generation runs in its own task and sends finished events through a channel; the response body reads them.
//! When the client goes away the body is dropped, which aborts the task and frees its session.
//!
//! A failure after the status line was sent (the swarm fails, or the request runs past `--request-timeout`: then
//! the generation is stopped and its session and slot freed) is reported in the stream as OpenAI does, one event
//! `data: {"error": {"message", "type", "param", "code"}}` (a timeout: type `timeout_error`, code
//! `request_timeout`), followed by `data: [DONE]` like every stream, so that clients that wait for it end cleanly.
//!
//! Every chunk carries `system_fingerprint`. With log-probabilities asked, a chunk carries those of the tokens
//! whose text it holds (a token that completed no text yet, e.g. half a character, rides with the next chunk
//! that has text, or with the finishing chunk). The finishing chunk (the one with `finish_reason`) carries the
//! `petal` object ([`super::report::petal`]).
use super::jobs::{Endpoint, Job};
use super::report::{self, Logprobs};
use super::state::{AbortOnDrop, AppState};
use super::types::{finish_reason, ApiError, Usage};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::FutureExt;
use petal_client::Session;
use petal_model::text::sampling::TokenLogprob;
use petal_model::FinishReason;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio::time::Instant;

/// Builds the chunks of one response.
struct Chunks {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    fingerprint: String,
}

impl Chunks {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "system_fingerprint": self.fingerprint, "choices": choices,
        })
    }

    /// A chat stream opens with the assistant's role.
    fn role(&self) -> Value {
        self.chunk(json!([{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
        }]))
    }

    /// A piece of text (`logprobs`: null, or those of its tokens); the last chunk has `finish` and no text.
    fn text(&self, text: &str, logprobs: Value, finish: Option<&str>) -> Value {
        match self.endpoint {
            Endpoint::Completions => self.chunk(json!([{
                "text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish,
            }])),
            Endpoint::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                self.chunk(json!([{
                    "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                }]))
            }
        }
    }

    /// `stream_options.include_usage`: a last chunk with no choices and the usage.
    fn usage(&self, usage: Usage) -> Value {
        let mut chunk = self.chunk(json!([]));
        chunk["usage"] = json!(usage);
        chunk
    }
}

fn event(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

/// Streams `job`'s generation on `session`, holding `permit` (the request's slot) until the last event, and
/// stopping at `deadline`.
pub fn respond(
    state: Arc<AppState>,
    job: Job,
    session: Session,
    permit: OwnedSemaphorePermit,
    deadline: Option<Instant>,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    let chunks = Chunks {
        endpoint: job.endpoint,
        id: job.id.clone(),
        created: job.created,
        model: state.name.clone(),
        fingerprint: state.fingerprint.clone(),
    };
    let task = tokio::spawn(async move {
        let _permit = permit;
        let mut session = session;
        if job.endpoint == Endpoint::Chat {
            let _ = tx.send(event(&chunks.role()));
        }
        let mut logprobs = Logprobs::new(job.endpoint, &state.tokenizer);
        // Log-probabilities of tokens whose text is not out yet.
        let mut pending: Vec<TokenLogprob> = vec![];
        let wants_logprobs = job.logprobs();
        let generation = state.generator.continue_with(
            &mut session,
            &state.tokenizer,
            &job.prompt,
            &job.config,
            |step| {
                // The end-of-sequence token is not part of the text, nor of its logprobs.
                if step.finished != Some(FinishReason::Eos) {
                    pending.extend(step.logprob.clone());
                }
                if step.text.is_empty() {
                    return !tx.is_closed();
                }
                let lp = if wants_logprobs {
                    logprobs.format(&std::mem::take(&mut pending))
                } else {
                    Value::Null
                };
                tx.send(event(&chunks.text(&step.text, lp, None))).is_ok()
            },
        );
        let result = match state.before(deadline, generation.map(Ok)).await {
            Ok(result) => result,
            Err(timeout) => {
                // Stopped mid-step: the session is dropped, not closed (its servers free it when its streams
                // end, as when a client goes away).
                drop(session);
                tracing::warn!(id = %job.id, error = %timeout.message, "request timed out mid-stream; generation stopped");
                let _ = tx.send(event(&timeout.body()));
                let _ = tx.send(Event::default().data("[DONE]"));
                return;
            }
        };
        session.close().await;
        match result {
            Ok(c) if c.cancelled => {
                tracing::debug!(id = %job.id, "client went away; generation stopped");
                return;
            }
            Ok(c) => {
                let reason = finish_reason(c.output.finish_reason);
                let lp = if wants_logprobs {
                    logprobs.format(&pending)
                } else {
                    Value::Null
                };
                let mut last = chunks.text("", lp, Some(reason));
                state.metrics.record(&c);
                last["petal"] = report::petal(&state, &c);
                let _ = tx.send(event(&last));
                if job.include_usage {
                    let usage = Usage::new(job.prompt.len(), c.sampled.len());
                    let _ = tx.send(event(&chunks.usage(usage)));
                }
            }
            Err(e) => {
                // The status line is sent already: report the failure in the stream, as OpenAI does.
                let error = ApiError::from_client(&e);
                tracing::warn!(id = %job.id, error = %e, "generation failed mid-stream");
                let _ = tx.send(event(&error.body()));
            }
        }
        let _ = tx.send(Event::default().data("[DONE]"));
    });
    let guard = AbortOnDrop(task);
    let events = futures::stream::unfold((rx, guard), |(mut rx, guard)| async move {
        let event = rx.recv().await?;
        Some((Ok::<_, Infallible>(event), (rx, guard)))
    });
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}
