//! The endpoints and the server's state; non-streamed answers (streamed ones: [`super::stream`], request
//! validation: [`super::jobs`], what answers report beyond text: [`super::report`]).
use super::admission::Slot;
use super::jobs::{chat_job, completion_job, Endpoint, Job};
use super::report::{self, Logprobs};
use super::state::{AbortOnDrop, AppState};
use super::stream;
use super::types::*;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::sync::Arc;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tower_http::cors::CorsLayer;

/// The chat page: one self-contained HTML file (no build step, nothing fetched from elsewhere).
const PAGE: &str = include_str!("page.html");

/// The routes, taking bodies of at most `max_body_bytes` (413 beyond); with `cors`, every route (and preflight
/// `OPTIONS`) answers cross-origin requests it allows.
pub fn router(state: Arc<AppState>, cors: Option<CorsLayer>, max_body_bytes: usize) -> Router {
    let router = Router::new()
        .route("/", get(page))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{id}", get(get_model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(super::metrics::metrics))
        .fallback(|| async {
            ApiError::invalid(None, "Unknown endpoint")
                .with_status(StatusCode::NOT_FOUND)
                .with_code("unknown_url")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::invalid(None, "Method not allowed on this endpoint")
                .with_status(StatusCode::METHOD_NOT_ALLOWED)
        })
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(state);
    match cors {
        Some(cors) => router.layer(cors),
        None => router,
    }
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CACHE_CONTROL, "no-cache"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:",
            ),
        ],
        Html(PAGE),
    )
}

/// Liveness, and what a page or a load balancer may want to show: the model and where its blocks run.
async fn health(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({
        "status": "ok",
        "model": state.name,
        "model_id": state.model_id,
        "local": state.generator.is_local(),
        "system_fingerprint": state.fingerprint,
    }))
}

fn model_object(state: &AppState) -> Value {
    json!({"id": state.name, "object": "model", "created": state.created, "owned_by": "petal"})
}

async fn list_models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    state.check_model(&id)?;
    Ok(Json(model_object(&state)))
}

impl AppState {
    pub fn check_model(&self, asked: &str) -> Result<(), ApiError> {
        if asked == self.name || asked == self.model_id {
            Ok(())
        } else {
            Err(ApiError::unknown_model(asked, &self.name))
        }
    }
}

async fn completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    admit_and_run(state, body, |state, v| {
        completion_job(state, parse_fields(v)?, &parse_fields(v)?)
    })
    .await
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    admit_and_run(state, body, |state, v| {
        chat_job(state, parse_fields(v)?, &parse_fields(v)?)
    })
    .await
}

/// Takes a generation slot (or answers 429), then turns the body into a job with `build` (JSON, tokenizer, chat
/// template: up to megabytes of CPU work, so on the blocking pool, inside the slot limit, a few at once), then
/// runs it. From the slot on, the request has `--request-timeout` to be answered.
async fn admit_and_run(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    build: fn(&AppState, &Value) -> Result<Job, ApiError>,
) -> Response {
    let body = match body_bytes(body) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let Slot { permit, deadline } = match state.admission.admit().await {
        Ok(slot) => slot,
        Err(e) => return e.into_response(),
    };
    let prepare = async {
        let cpu = state.admission.cpu().await?;
        let parse_state = state.clone();
        // The job holds the slot (and the core) until it is done, even when the request has given up on it, so
        // that the slots bound the work really running.
        let (permit, job) = tokio::task::spawn_blocking(move || {
            let _cpu = cpu;
            let job = parse_json(&body).and_then(|v| build(&parse_state, &v));
            (permit, job)
        })
        .await
        .map_err(|e| ApiError::internal(format!("parsing the request failed: {e}")))?;
        Ok((permit, job?))
    };
    match state.before(deadline, prepare).await {
        Ok((permit, job)) => run(state, job, permit, deadline).await,
        Err(e) => e.into_response(),
    }
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError::invalid(None, e.body_text()).with_status(e.status()))
}

/// Opens the session (so that a swarm failure is a proper 503 even for a stream), then generates in a task of its
/// own, until `deadline`: past it the task is aborted (its session and slot freed) and the answer is a 504.
async fn run(
    state: Arc<AppState>,
    job: Job,
    permit: OwnedSemaphorePermit,
    deadline: Option<Instant>,
) -> Response {
    // What the request needs now; the decode loop grows the reservation if the answer runs longer.
    let max_length = state
        .generator
        .reservation_for(job.prompt.len(), job.config.max_new_tokens);
    let open = async {
        (state.generator.open_session(max_length).await).map_err(|e| ApiError::from_client(&e))
    };
    let session = match state.before(deadline, open).await {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    tracing::debug!(id = %job.id, prompt_tokens = job.prompt.len(), max_tokens = job.config.max_new_tokens, stream = job.stream, "generating");
    if job.stream {
        return stream::respond(state, job, session, permit, deadline);
    }
    let task_state = state.clone();
    let prompt = job.prompt.clone();
    let config = job.config.clone();
    let mut task = AbortOnDrop(tokio::spawn(async move {
        let _permit = permit;
        let mut session = session;
        let result = task_state
            .generator
            .continue_in(
                &mut session,
                &task_state.tokenizer,
                &prompt,
                &config,
                |_| true,
            )
            .await;
        session.close().await;
        result
    }));
    let generated = async {
        (&mut task.0)
            .await
            .map_err(|e| ApiError::internal(format!("generation task failed: {e}")))?
            .map_err(|e| ApiError::from_client(&e))
    };
    let completion = match state.before(deadline, generated).await {
        Ok(c) => c,
        Err(e) => {
            // Past the deadline the task is still running: dropping its guard aborts it, which frees its session
            // and slot.
            drop(task);
            return e.into_response();
        }
    };
    let usage = Usage::new(job.prompt.len(), completion.sampled.len());
    let reason = finish_reason(completion.output.finish_reason);
    let logprobs = if job.logprobs() {
        Logprobs::new(job.endpoint, &state.tokenizer).format(report::generated(&completion))
    } else {
        Value::Null
    };
    state.metrics.record(&completion);
    let petal = report::petal(&state, &completion);
    let text = completion.output.text;
    let body = match job.endpoint {
        Endpoint::Completions => json!({
            "id": job.id, "object": "text_completion", "created": job.created, "model": state.name,
            "system_fingerprint": state.fingerprint,
            "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}],
            "usage": usage,
            "petal": petal,
        }),
        Endpoint::Chat => json!({
            "id": job.id, "object": "chat.completion", "created": job.created, "model": state.name,
            "system_fingerprint": state.fingerprint,
            "choices": [{
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": reason,
            }],
            "usage": usage,
            "petal": petal,
        }),
    };
    Json(body).into_response()
}
