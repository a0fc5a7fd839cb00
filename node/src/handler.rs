//! The server side of the inference protocol: one task per incoming stream, owning that stream's sessions.
//!
//! Sessions belong to the stream that opened them, so another peer can never step or close them, and every way a
//! stream ends (close, idle timeout, disconnect, protocol violation) drops its sessions and their cache budget.
use crate::admission::Reservation;
use crate::context::ServerContext;
use petal_model::compute::wire::{from_wire, to_wire};
use petal_model::{BlockRange, ModelError, SchedulerError, SessionStep, SpanCache};
use petal_p2p::{PeerId, Stream};
use petal_proto::pb::{self, request, response, ErrorCode};
use petal_proto::{FrameError, FramedStream, PROTOCOL_VERSION};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// Sessions one stream may hold at once: a client needs one per hop it routes through this server.
const MAX_SESSIONS_PER_STREAM: usize = 16;
/// Largest batch a step may carry.
const MAX_BATCH: usize = 16;

struct Session {
    /// `None` only while a step runs on the span scheduler.
    cache: Option<SpanCache>,
    last_used: Instant,
    _reservation: Reservation,
}

/// Drops sessions unused for longer than the timeout, even on a stream that stays busy with other requests.
fn evict_idle(sessions: &mut HashMap<u64, Session>, timeout: std::time::Duration) {
    let before = sessions.len();
    sessions.retain(|_, s| s.last_used.elapsed() <= timeout);
    if sessions.len() < before {
        tracing::info!(
            evicted = before - sessions.len(),
            "sessions idle past the session timeout evicted"
        );
    }
}

pub type Reply = response::Kind;

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    response::Kind::Error(pb::Error {
        code: code as i32,
        message: message.into(),
    })
}

/// The sessions of one stream and the request state machine over them, apart from any I/O (so it can be driven
/// directly by tests and the fuzzer).
#[derive(Default)]
pub struct StreamState {
    sessions: HashMap<u64, Session>,
}

impl StreamState {
    /// Answers one request. Never panics, whatever the request.
    pub async fn handle(&mut self, request: pb::Request, ctx: &Arc<ServerContext>) -> Reply {
        match request.kind {
            Some(kind) => {
                evict_idle(&mut self.sessions, ctx.session_timeout);
                handle(kind, &mut self.sessions, ctx).await
            }
            None => error(ErrorCode::BadRequest, "empty or unknown request type"),
        }
    }

    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }
}

/// Serves one stream until it ends; never panics on peer input.
pub async fn serve_stream(stream: Stream, peer: PeerId, ctx: Arc<ServerContext>) {
    let mut framed = FramedStream::new(stream, ctx.max_frame_bytes);
    let mut state = StreamState::default();
    loop {
        let received =
            tokio::time::timeout(ctx.session_timeout, framed.recv::<pb::Request>()).await;
        let reply = match received {
            Err(_) => {
                tracing::info!(%peer, sessions = state.open_sessions(), "stream idle past the session timeout; evicting");
                break;
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(req))) => state.handle(req, &ctx).await,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "bad frame");
                match &e {
                    // A whole frame that did not decode: answer and keep serving.
                    FrameError::Decode(_) => error(ErrorCode::BadRequest, e.to_string()),
                    // The stream is out of sync after an oversized prefix: answer, then close.
                    FrameError::TooLarge { .. } => {
                        let _ = framed
                            .send(&pb::Response {
                                kind: Some(error(ErrorCode::FrameTooLarge, e.to_string())),
                            })
                            .await;
                        break;
                    }
                    _ => break,
                }
            }
        };
        if let Err(e) = framed.send(&pb::Response { kind: Some(reply) }).await {
            tracing::debug!(%peer, error = %e, "cannot answer; dropping the stream");
            break;
        }
    }
    framed.close().await;
    tracing::debug!(%peer, sessions = state.open_sessions(), "stream ended; sessions freed");
}

async fn handle(
    kind: request::Kind,
    sessions: &mut HashMap<u64, Session>,
    ctx: &Arc<ServerContext>,
) -> Reply {
    match kind {
        request::Kind::Open(open) => open_session(open, sessions, ctx),
        request::Kind::Step(step) => run_step(step, sessions, ctx).await,
        request::Kind::Close(close) => match sessions.remove(&close.session_id) {
            Some(_) => response::Kind::Closed(pb::SessionClosed {
                session_id: close.session_id,
            }),
            None => error(
                ErrorCode::UnknownSession,
                format!("no session {} on this stream", close.session_id),
            ),
        },
        request::Kind::Info(_) => response::Kind::Info(ctx.record()),
    }
}

fn open_session(
    open: pb::OpenSession,
    sessions: &mut HashMap<u64, Session>,
    ctx: &Arc<ServerContext>,
) -> Reply {
    if open.protocol_version != PROTOCOL_VERSION {
        return error(
            ErrorCode::VersionMismatch,
            format!(
                "protocol version {} asked, {PROTOCOL_VERSION} served",
                open.protocol_version
            ),
        );
    }
    if open.model_id != ctx.model_id {
        return error(
            ErrorCode::WrongModel,
            format!("this server serves model {}", ctx.model_id),
        );
    }
    let range = BlockRange::new(open.start_block as usize, open.end_block as usize);
    let served = ctx.span.range();
    if range.is_empty() || !served.covers(&range) {
        return error(
            ErrorCode::BlocksNotServed,
            format!("blocks {range} asked, {served} served"),
        );
    }
    let max_length = open.max_length as usize;
    if max_length == 0 || max_length > ctx.span.spec().max_position {
        return error(
            ErrorCode::BadRequest,
            format!(
                "max_length {max_length} must be in 1..={}",
                ctx.span.spec().max_position
            ),
        );
    }
    if sessions.len() >= MAX_SESSIONS_PER_STREAM {
        return error(
            ErrorCode::Busy,
            format!("at most {MAX_SESSIONS_PER_STREAM} sessions per stream"),
        );
    }
    let reservation = match ctx.admission.admit(max_length) {
        Ok(r) => r,
        Err(refusal) => return error(refusal.code(), refusal.to_string()),
    };
    let cache = match ctx.span.new_cache(range, max_length) {
        Ok(c) => c,
        Err(e) => return error(ErrorCode::BadRequest, e.to_string()),
    };
    let mut session_id = rand::random::<u64>();
    while session_id == 0 || sessions.contains_key(&session_id) {
        session_id = rand::random();
    }
    sessions.insert(
        session_id,
        Session {
            cache: Some(cache),
            last_used: Instant::now(),
            _reservation: reservation,
        },
    );
    response::Kind::Opened(pb::SessionOpened {
        session_id,
        start_block: range.start as u32,
        end_block: range.end as u32,
        dtype: ctx.wire_dtype as i32,
        max_length: max_length as u32,
    })
}

async fn run_step(
    step: pb::Step,
    sessions: &mut HashMap<u64, Session>,
    ctx: &Arc<ServerContext>,
) -> Reply {
    let Some(session) = sessions.get_mut(&step.session_id) else {
        return error(
            ErrorCode::UnknownSession,
            format!("no session {} on this stream", step.session_id),
        );
    };
    session.last_used = Instant::now();
    let Some(cache) = session.cache.as_ref() else {
        return error(ErrorCode::Internal, "session is busy");
    };
    let Some(hidden) = step.hidden.as_ref() else {
        return error(ErrorCode::BadRequest, "step without hidden states");
    };
    let hidden_size = ctx.span.spec().hidden_size;
    let max_elements = MAX_BATCH * cache.max_length() * hidden_size;
    let (dtype, shape) = match petal_proto::tensor::validate(hidden, max_elements) {
        Ok(v) => v,
        Err(e) => return error(e.error_code(), e.to_string()),
    };
    if dtype != ctx.wire_dtype {
        return error(
            ErrorCode::DtypeMismatch,
            format!(
                "hidden states in {}, this session takes {}",
                dtype.name(),
                ctx.wire_dtype.name()
            ),
        );
    }
    if shape.len() != 3 || shape[2] != hidden_size || shape[0] > MAX_BATCH {
        return error(
            ErrorCode::ShapeMismatch,
            format!("hidden states of shape {shape:?}, expected [batch<={MAX_BATCH}, tokens, {hidden_size}]"),
        );
    }
    let positions = shape[0] * shape[1];
    if ctx.max_chunk_tokens > 0 && positions > ctx.max_chunk_tokens {
        // Refused before any compute: a step's memory grows with its positions (attention scores with their
        // square), and this bound is what the node was sized for.
        return error(
            ErrorCode::StepTooLarge,
            format!(
                "a step of {positions} positions (batch {} x {} tokens); this server takes at most {} per step: split the prompt",
                shape[0], shape[1], ctx.max_chunk_tokens
            ),
        );
    }
    if let Err(e) = petal_proto::tensor::check_finite(dtype, &hidden.data) {
        return error(ErrorCode::NonFinite, e.to_string());
    }
    let position = step.position as usize;
    if position != cache.position() || position + shape[1] > cache.max_length() {
        return error(
            ErrorCode::BadPosition,
            format!(
                "step at position {position} with {} tokens; the session holds {} of at most {}",
                shape[1],
                cache.position(),
                cache.max_length()
            ),
        );
    }
    let x = match from_wire(hidden, dtype, &shape) {
        Ok(x) => x,
        Err(e) => return error(ErrorCode::BadRequest, e.to_string()),
    };
    // Compute off the async runtime, batched with the other sessions' steps: the cache travels to the span
    // scheduler's thread and back.
    let Some(cache) = session.cache.take() else {
        return error(ErrorCode::Internal, "session is busy");
    };
    let tokens = shape[0] * shape[1];
    let stepped = ctx
        .scheduler
        .step(SessionStep {
            hidden: x,
            position,
            cache,
        })
        .await;
    let (out, batch) = match stepped {
        Ok(done) => {
            session.cache = Some(done.cache);
            (done.output, done.batch)
        }
        Err(e) => {
            // The scheduler's thread is gone and the cache with it.
            sessions.remove(&step.session_id);
            return error(ErrorCode::Internal, format!("step failed: {e}"));
        }
    };
    // The compute time of the batch the step ran in (shared with the steps batched with it).
    let compute_micros = u64::try_from(batch.compute.as_micros()).unwrap_or(u64::MAX);
    ctx.record_step(tokens, compute_micros);
    match out.and_then(|t| Ok(to_wire(&t, ctx.wire_dtype)?)) {
        Ok(hidden) => response::Kind::Step(pb::StepResult {
            session_id: step.session_id,
            position: step.position,
            hidden: Some(hidden),
            compute_micros,
        }),
        Err(SchedulerError::Model(
            e @ (ModelError::Position { .. } | ModelError::TooLong { .. }),
        )) => error(ErrorCode::BadPosition, e.to_string()),
        Err(e) => {
            // The cache may be half-updated: the session cannot continue.
            sessions.remove(&step.session_id);
            tracing::warn!(error = %e, "step failed; session dropped");
            error(ErrorCode::Internal, e.to_string())
        }
    }
}
