//! Streamed answers (`stream: true`): server-sent events in OpenAI's chunk format, `data: [DONE]` at the end.
//!
//! The generation runs in its own task and sends finished events through a channel; the response body reads them.
//! When the client goes away the body is dropped, which aborts the task and frees its session.
use super::jobs::{Endpoint, Job};
use super::state::{AbortOnDrop, AppState};
use super::types::{finish_reason, ApiError, Usage};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use petal_client::Session;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit};

/// Builds the chunks of one response.
struct Chunks {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
}

impl Chunks {
    fn chunk(&self, choices: Value) -> Value {
        let object = match self.endpoint {
            Endpoint::Completions => "text_completion",
            Endpoint::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices})
    }

    /// A chat stream opens with the assistant's role.
    fn role(&self) -> Value {
        self.chunk(json!([{
            "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null,
        }]))
    }

    fn text(&self, text: &str, finish: Option<&str>) -> Value {
        match self.endpoint {
            Endpoint::Completions => self.chunk(json!([{
                "text": text, "index": 0, "logprobs": null, "finish_reason": finish,
            }])),
            Endpoint::Chat => {
                let delta = if finish.is_some() && text.is_empty() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                self.chunk(json!([{
                    "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish,
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

pub fn respond(
    state: Arc<AppState>,
    job: Job,
    session: Session,
    permit: OwnedSemaphorePermit,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel::<Event>();
    let chunks = Chunks {
        endpoint: job.endpoint,
        id: job.id.clone(),
        created: job.created,
        model: state.name.clone(),
    };
    let task = tokio::spawn(async move {
        let _permit = permit;
        let mut session = session;
        if job.endpoint == Endpoint::Chat {
            let _ = tx.send(event(&chunks.role()));
        }
        let result = state
            .generator
            .continue_in(
                &mut session,
                &state.tokenizer,
                &job.prompt,
                &job.config,
                |text| {
                    if text.is_empty() {
                        return !tx.is_closed();
                    }
                    tx.send(event(&chunks.text(text, None))).is_ok()
                },
            )
            .await;
        session.close().await;
        match result {
            Ok(c) if c.cancelled => {
                tracing::debug!(id = %job.id, "client went away; generation stopped");
                return;
            }
            Ok(c) => {
                let reason = finish_reason(c.output.finish_reason);
                let _ = tx.send(event(&chunks.text("", Some(reason))));
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
