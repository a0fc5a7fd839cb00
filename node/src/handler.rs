//! The server side of the inference protocol: one task per incoming stream, owning that stream's sessions.
//!
//! Sessions belong to the stream that opened them, so another peer can never step or close them, and every way a
//! stream ends (close, idle timeout, disconnect, protocol violation) drops its sessions and their cache budget.
//! Admission may also evict a session for another peer ([`crate::admission`]): the stream is woken and drops its
//! cache at once, and the session's next use is answered `EVICTED`.
use crate::admission::Reservation;
use crate::context::ServerContext;
use crate::push::{self, AwaitError, Registration};
use petal_model::compute::block::step_working_bytes;
use petal_model::compute::wire::{from_wire, to_wire};
use petal_model::{BlockRange, ModelError, SchedulerError, SessionStep, SpanCache};
use petal_p2p::{PeerId, Stream};
use petal_proto::pb::{self, request, response, ErrorCode};
use petal_proto::{FrameError, FramedStream, PROTOCOL_VERSION};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// Sessions one stream may hold at once: a client needs one per hop it routes through this server.
const MAX_SESSIONS_PER_STREAM: usize = 16;
/// Largest batch a session may ask for.
const MAX_BATCH: usize = 16;
/// Longest a pushed step waits for its input, whatever the client asks: the stream answers nothing else meanwhile.
const MAX_PUSH_WAIT: Duration = Duration::from_secs(60);
/// Evicted session ids a stream remembers, to answer `EVICTED` rather than `UNKNOWN_SESSION`.
const REMEMBERED_EVICTIONS: usize = MAX_SESSIONS_PER_STREAM;

struct Session {
    /// `None` only while a step runs on the span scheduler.
    cache: Option<SpanCache>,
    /// Lets the previous server of the client's route push this session's inputs; removed with the session.
    _push: Registration,
    /// Most sequences a step may carry; the reservation is this many times `max_length`.
    max_batch: usize,
    last_used: Instant,
    reservation: Reservation,
}

pub type Reply = response::Kind;

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    response::Kind::Error(pb::Error {
        code: code as i32,
        message: message.into(),
    })
}

/// A refusal counted in the node's metrics under `reason`.
fn refuse(ctx: &ServerContext, reason: &str, code: ErrorCode, message: impl Into<String>) -> Reply {
    ctx.metrics.refused(reason);
    error(code, message)
}

/// The sessions of one stream and the request state machine over them, apart from any I/O (so it can be driven
/// directly by tests and the fuzzer).
pub struct StreamState {
    peer: PeerId,
    sessions: HashMap<u64, Session>,
    /// Notified by admission when it evicts one of these sessions.
    wake: Arc<Notify>,
    evicted: VecDeque<u64>,
}

impl StreamState {
    /// The state of a stream opened by `peer` (whose fair share admission counts this stream's sessions in).
    pub fn new(peer: PeerId) -> Self {
        Self {
            peer,
            sessions: HashMap::new(),
            wake: Arc::new(Notify::new()),
            evicted: VecDeque::new(),
        }
    }

    /// Answers one request. Never panics, whatever the request.
    pub async fn handle(&mut self, request: pb::Request, ctx: &Arc<ServerContext>) -> Reply {
        self.drop_evicted();
        match request.kind {
            Some(request::Kind::Info(_)) if !ctx.peers.allow_cheap(self.peer) => refuse(
                ctx,
                "rate_limited",
                ErrorCode::RateLimited,
                "too many Info requests from this peer: slow down",
            ),
            Some(kind) => {
                self.evict_idle(ctx.session_timeout);
                handle(kind, self, ctx).await
            }
            None => error(ErrorCode::BadRequest, "empty or unknown request type"),
        }
    }

    pub fn open_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// What admission notifies when it evicts one of this stream's sessions.
    pub fn wake(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    /// Drops the sessions admission evicted (their positions are already free; this frees their caches).
    pub fn drop_evicted(&mut self) {
        let gone: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.reservation.is_evicted())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.sessions.remove(&id);
            if self.evicted.len() == REMEMBERED_EVICTIONS {
                self.evicted.pop_front();
            }
            self.evicted.push_back(id);
            tracing::info!(peer = %self.peer, session = id, "session evicted for another peer");
        }
    }

    /// Drops sessions unused for longer than the timeout, even on a stream that stays busy with other requests.
    fn evict_idle(&mut self, timeout: std::time::Duration) {
        let before = self.sessions.len();
        self.sessions
            .retain(|_, s| s.last_used.elapsed() <= timeout);
        if self.sessions.len() < before {
            tracing::info!(
                evicted = before - self.sessions.len(),
                "sessions idle past the session timeout evicted"
            );
        }
    }

    /// The error for a session id this stream does not hold.
    fn missing(&self, session_id: u64) -> Reply {
        if self.evicted.contains(&session_id) {
            error(
                ErrorCode::Evicted,
                format!("session {session_id} was evicted for another peer's: open a new one and replay"),
            )
        } else {
            error(
                ErrorCode::UnknownSession,
                format!("no session {session_id} on this stream"),
            )
        }
    }
}

/// Serves one stream until it ends; never panics on peer input.
pub async fn serve_stream(stream: Stream, peer: PeerId, ctx: Arc<ServerContext>) {
    let mut framed =
        FramedStream::new(stream, ctx.max_frame_bytes).with_limits(ctx.peers.recv_limits(peer));
    let mut state = StreamState::new(peer);
    let wake = state.wake();
    let mut retirement = ctx.retirement();
    // Whether the peer misbehaved mid-frame: then the stream is reset rather than closed, since a graceful close
    // would leave a peer blocked on writing the rest of its frame waiting for credit that never comes.
    let mut reset = false;
    loop {
        // `recv` keeps a partly read frame in `framed`, so an eviction may interrupt it.
        let received = tokio::select! {
            _ = wake.notified() => {
                state.drop_evicted();
                continue;
            }
            _ = retirement.wait_for(|retired| *retired) => {
                tracing::info!(%peer, sessions = state.open_sessions(), "span retired: the node moved; closing the stream");
                break;
            }
            received = tokio::time::timeout(ctx.session_timeout, framed.recv::<pb::Request>()) => received,
        };
        let reply = match received {
            Err(_) => {
                tracing::info!(%peer, sessions = state.open_sessions(), "stream idle past the session timeout; evicting");
                break;
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(req))) if req.is_unanswered_push() => {
                if let response::Kind::Error(e) = state.handle(req, &ctx).await {
                    tracing::debug!(%peer, code = e.code, message = %e.message, "unanswered push refused");
                    // No answer slows a sender of refused pushes down, so refusals draw on the peer's budget of
                    // cheap requests; past it, the stream is reset.
                    if !ctx.peers.allow_cheap(peer) {
                        ctx.metrics.refused("rate_limited");
                        tracing::info!(%peer, "too many refused pushes; resetting the stream");
                        reset = true;
                        break;
                    }
                }
                continue;
            }
            Ok(Ok(Some(req))) => state.handle(req, &ctx).await,
            Ok(Err(e)) => {
                tracing::debug!(%peer, error = %e, "bad frame");
                match &e {
                    // A whole frame that did not decode: answer and keep serving, within the peer's rate.
                    FrameError::Decode(_) if ctx.peers.allow_cheap(peer) => {
                        error(ErrorCode::BadRequest, e.to_string())
                    }
                    FrameError::Decode(_) => {
                        let reply = refuse(
                            &ctx,
                            "rate_limited",
                            ErrorCode::RateLimited,
                            "too many undecodable frames from this peer; closing the stream",
                        );
                        let _ = framed.send(&pb::Response { kind: Some(reply) }).await;
                        reset = true;
                        break;
                    }
                    // The stream is out of sync after an oversized prefix: answer, then close.
                    FrameError::TooLarge { .. } => {
                        let reply = refuse(
                            &ctx,
                            "frame_too_large",
                            ErrorCode::FrameTooLarge,
                            e.to_string(),
                        );
                        let _ = framed.send(&pb::Response { kind: Some(reply) }).await;
                        reset = true;
                        break;
                    }
                    FrameError::Timeout { .. } => {
                        ctx.metrics.refused("frame_timeout");
                        tracing::info!(%peer, error = %e, "resetting a stream that did not deliver its frame in time");
                        reset = true;
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
    if !reset {
        framed.close().await;
    }
    // Dropping a stream that is not closed resets it.
    drop(framed);
    tracing::debug!(%peer, sessions = state.open_sessions(), "stream ended; sessions freed");
}

async fn handle(kind: request::Kind, state: &mut StreamState, ctx: &Arc<ServerContext>) -> Reply {
    match kind {
        request::Kind::Open(open) => open_session(open, state, ctx),
        request::Kind::Step(step) => run_step(step, state, ctx).await,
        request::Kind::Extend(extend) => extend_session(extend, state, ctx),
        request::Kind::Close(close) => match state.sessions.remove(&close.session_id) {
            Some(_) => response::Kind::Closed(pb::SessionClosed {
                session_id: close.session_id,
            }),
            None => state.missing(close.session_id),
        },
        request::Kind::Info(_) => response::Kind::Info(ctx.record()),
        request::Kind::Push(push) => accept_push(push, ctx),
    }
}

/// Hidden states for another client's session, from the previous server of its route.
fn accept_push(push: pb::Push, ctx: &Arc<ServerContext>) -> Reply {
    tracing::trace!("push received");
    let Some(hidden) = push.hidden else {
        return error(ErrorCode::BadRequest, "push without hidden states");
    };
    if ctx
        .inbox
        .deliver(push.session_id, &push.push_token, push.position, hidden)
    {
        response::Kind::Pushed(pb::Pushed {
            session_id: push.session_id,
            position: push.position,
        })
    } else {
        error(
            ErrorCode::UnknownSession,
            format!("no session {} with that push token", push.session_id),
        )
    }
}

fn open_session(open: pb::OpenSession, state: &mut StreamState, ctx: &Arc<ServerContext>) -> Reply {
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
    let max_batch = (open.max_batch as usize).max(1);
    if max_batch > MAX_BATCH {
        return error(
            ErrorCode::BadRequest,
            format!("max_batch {max_batch} must be in 1..={MAX_BATCH}"),
        );
    }
    if state.sessions.len() >= MAX_SESSIONS_PER_STREAM {
        return refuse(
            ctx,
            "busy",
            ErrorCode::Busy,
            format!("at most {MAX_SESSIONS_PER_STREAM} sessions per stream"),
        );
    }
    // Every sequence of a batch has its own keys and values.
    let positions = max_batch * max_length;
    let reservation = match ctx.admission.admit(state.peer, positions, &state.wake) {
        Ok(r) => r,
        Err(refusal) => return refuse(ctx, refusal.reason(), refusal.code(), refusal.to_string()),
    };
    let cache = match ctx.span.new_cache(range, max_length) {
        Ok(c) => c,
        Err(e) => return error(ErrorCode::BadRequest, e.to_string()),
    };
    let mut session_id = rand::random::<u64>();
    while session_id == 0 || state.sessions.contains_key(&session_id) {
        session_id = rand::random();
    }
    let push_token = push::new_token();
    state.sessions.insert(
        session_id,
        Session {
            cache: Some(cache),
            _push: ctx.inbox.register(session_id, push_token),
            max_batch,
            last_used: Instant::now(),
            reservation,
        },
    );
    response::Kind::Opened(pb::SessionOpened {
        session_id,
        start_block: range.start as u32,
        end_block: range.end as u32,
        dtype: ctx.wire_dtype as i32,
        max_length: max_length as u32,
        push_token: push_token.to_vec(),
    })
}

/// Raises a session's `max_length`: its reservation grows by the same rules as a new session's, or nothing changes.
fn extend_session(
    extend: pb::ExtendSession,
    state: &mut StreamState,
    ctx: &Arc<ServerContext>,
) -> Reply {
    let Some(session) = state.sessions.get_mut(&extend.session_id) else {
        return state.missing(extend.session_id);
    };
    session.last_used = Instant::now();
    let Some(cache) = session.cache.as_mut() else {
        return error(ErrorCode::Internal, "session is busy");
    };
    let max_length = extend.max_length as usize;
    let context = ctx.span.spec().max_position;
    if max_length < cache.max_length() || max_length > context {
        return error(
            ErrorCode::BadRequest,
            format!(
                "max_length {max_length} must be in {}..={context}",
                cache.max_length()
            ),
        );
    }
    if let Err(refusal) = session.reservation.grow_to(session.max_batch * max_length) {
        return refuse(ctx, refusal.reason(), refusal.code(), refusal.to_string());
    }
    cache.extend(max_length);
    response::Kind::Extended(pb::SessionExtended {
        session_id: extend.session_id,
        max_length: max_length as u32,
    })
}

async fn run_step(mut step: pb::Step, state: &mut StreamState, ctx: &Arc<ServerContext>) -> Reply {
    // A pushed step's input comes from the previous server of the route; it is then checked like any other.
    let mut pushed = None;
    if step.await_push {
        if !state.sessions.contains_key(&step.session_id) {
            return state.missing(step.session_id);
        }
        let wait = Duration::from_millis(step.push_wait_ms.into()).min(MAX_PUSH_WAIT);
        match ctx.inbox.take(step.session_id, step.position, wait).await {
            Ok(hidden) => {
                tracing::trace!(position = step.position, "pushed input taken");
                step.hidden = Some(hidden.clone());
                pushed = Some(hidden);
            }
            Err(AwaitError::Timeout) => {
                return error(
                    ErrorCode::PushTimeout,
                    format!(
                        "no input pushed for position {} within {} ms; send it in the step",
                        step.position,
                        wait.as_millis()
                    ),
                )
            }
            Err(AwaitError::Unknown) => return state.missing(step.session_id),
        }
    }
    let Some(session) = state.sessions.get_mut(&step.session_id) else {
        return state.missing(step.session_id);
    };
    session.last_used = Instant::now();
    session.reservation.touch();
    let Some(cache) = session.cache.as_ref() else {
        return error(ErrorCode::Internal, "session is busy");
    };
    let Some(hidden) = step.hidden.as_ref() else {
        return error(ErrorCode::BadRequest, "step without hidden states");
    };
    let hidden_size = ctx.span.spec().hidden_size;
    // A loose bound before the precise checks below (batch, positions), which give the better error.
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
    if shape.len() != 3 || shape[2] != hidden_size {
        return error(
            ErrorCode::ShapeMismatch,
            format!("hidden states of shape {shape:?}, expected [batch, tokens, {hidden_size}]"),
        );
    }
    let positions = shape[0] * shape[1];
    if ctx.max_chunk_tokens > 0 && positions > ctx.max_chunk_tokens {
        // Refused before any compute: a step's memory grows with its positions (attention scores with their
        // square), and this bound is what the node was sized for.
        return refuse(
            ctx,
            "step_too_large",
            ErrorCode::StepTooLarge,
            format!(
                "a step of {positions} positions (batch {} x {} tokens); this server takes at most {} per step: split the prompt",
                shape[0], shape[1], ctx.max_chunk_tokens
            ),
        );
    }
    if shape[0] > session.max_batch {
        return error(
            ErrorCode::ShapeMismatch,
            format!(
                "a batch of {} sequences; the session was opened for at most {}",
                shape[0], session.max_batch
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
    let working = step_working_bytes(ctx.span.spec(), shape[0], shape[1], position + shape[1]);
    if ctx.max_step_bytes > 0 && working > ctx.max_step_bytes {
        return refuse(
            ctx,
            "step_memory",
            ErrorCode::StepTooLarge,
            format!(
                "this step would need about {} MiB of working memory at {} positions of context; this server allows {} MiB: send fewer tokens per step",
                working >> 20,
                position + shape[1],
                ctx.max_step_bytes >> 20
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
    tracing::trace!("step queued for the span scheduler");
    let stepped = ctx
        .scheduler
        .step(SessionStep {
            hidden: x,
            position,
            cache,
        })
        .await;
    tracing::trace!("step answered by the span scheduler");
    let (out, batch) = match stepped {
        Ok(done) => {
            session.reservation.touch();
            session.cache = Some(done.cache);
            (done.output, done.batch)
        }
        Err(e) => {
            // The scheduler's thread is gone and the cache with it.
            state.sessions.remove(&step.session_id);
            return error(ErrorCode::Internal, format!("step failed: {e}"));
        }
    };
    // The compute time of the batch the step ran in (shared with the steps batched with it).
    let compute_micros = u64::try_from(batch.compute.as_micros()).unwrap_or(u64::MAX);
    ctx.record_step(tokens, compute_micros);
    match out.and_then(|t| Ok(to_wire(&t, ctx.wire_dtype)?)) {
        Ok(hidden) => {
            match (&step.forward, &ctx.pusher) {
                (Some(target), Some(pusher)) => {
                    pusher.push(target, step.position, hidden.clone());
                    tracing::trace!("output queued for the next server");
                    // The push is what the next server waits for: let its link write it before this answer.
                    tokio::task::yield_now().await;
                }
                (Some(_), None) => tracing::debug!("asked to push, but this server has no network"),
                _ => {}
            }
            response::Kind::Step(pb::StepResult {
                session_id: step.session_id,
                position: step.position,
                hidden: Some(hidden),
                compute_micros,
                input: pushed,
            })
        }
        Err(SchedulerError::Model(
            e @ (ModelError::Position { .. } | ModelError::TooLong { .. }),
        )) => error(ErrorCode::BadPosition, e.to_string()),
        Err(e) => {
            // The cache may be half-updated: the session cannot continue.
            state.sessions.remove(&step.session_id);
            tracing::warn!(error = %e, "step failed; session dropped");
            error(ErrorCode::Internal, e.to_string())
        }
    }
}
