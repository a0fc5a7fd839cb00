//! The endpoints and the server's state; non-streamed answers (streamed ones: [`super::stream`], request
//! validation: [`super::jobs`], what answers report beyond text: [`super::report`]).
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
/// template: up to megabytes of CPU work, so on the blocking pool and inside the slot limit), then runs it.
async fn admit_and_run(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    build: fn(&AppState, &Value) -> Result<Job, ApiError>,
) -> Response {
    let body = match body_bytes(body) {
        Ok(body) => body,
        Err(e) => return e.into_response(),
    };
    let permit = match state.admission.admit().await {
        Ok(permit) => permit,
        Err(e) => return e.into_response(),
    };
    let parse_state = state.clone();
    let job = tokio::task::spawn_blocking(move || build(&parse_state, &parse_json(&body)?)).await;
    match job {
        Ok(Ok(job)) => run(state, job, permit).await,
        Ok(Err(e)) => e.into_response(),
        Err(e) => ApiError::internal(format!("parsing the request failed: {e}")).into_response(),
    }
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| ApiError::invalid(None, e.body_text()).with_status(e.status()))
}

/// Opens the session (so that a swarm failure is a proper 503 even for a stream), then generates in a task of its
/// own.
async fn run(state: Arc<AppState>, job: Job, permit: OwnedSemaphorePermit) -> Response {
    let max_length =
        (job.prompt.len() + job.config.max_new_tokens).min(state.generator.max_position());
    let session = match state.generator.open_session(max_length).await {
        Ok(s) => s,
        Err(e) => return ApiError::from_client(&e).into_response(),
    };
    tracing::debug!(id = %job.id, prompt_tokens = job.prompt.len(), max_tokens = job.config.max_new_tokens, stream = job.stream, "generating");
    if job.stream {
        return stream::respond(state, job, session, permit);
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
    let completion = match (&mut task.0).await {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => return ApiError::from_client(&e).into_response(),
        Err(e) => {
            return ApiError::internal(format!("generation task failed: {e}")).into_response()
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
