//! `petal api`: an OpenAI-compatible HTTP server (`GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions`, streaming as server-sent events) generating through the swarm, or with `--local`
//! through the whole model in this process; a chat page at `/` (`page.html`, built into the binary) that talks to
//! the same chat endpoint, and `GET /health`.
//!
//! Every request runs in a task of its own on a session of its own (through the swarm: its own chain of server
//! sessions), so requests are served concurrently; `--max-concurrent` bounds how many generate at once (the rest
//! wait their turn, up to `--max-queue`; beyond, 429 with `Retry-After`). Parsing, tokenizing and rendering the
//! chat template run inside that limit, on the blocking pool, on every core but one; bodies are capped at
//! `--max-body-bytes`. A request whose client goes away is aborted and its session freed, and so is one that runs
//! past `--request-timeout` after getting its slot (answered 504, or a stream's error event).
mod admission;
mod jobs;
mod metrics;
mod report;
mod routes;
mod state;
mod stream;
mod types;

use crate::backend::ModelArgs;
use anyhow::Context;
use clap::Args;
use petal_cli::seconds::{positive_seconds, seconds};
use std::net::SocketAddr;
use std::sync::Arc;
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

#[derive(Args, Debug)]
pub struct ApiArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to serve HTTP on (port 0: any free port; the address is printed as `listening on http://...`).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Name clients use in `model` (default: the model file's name without extension).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Requests generating at once; more wait for a free slot.
    #[arg(long, default_value_t = 8)]
    pub max_concurrent: usize,
    /// Requests that may wait for a slot; more are answered 429 with `Retry-After` at once.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Seconds a request may wait for a slot before it is answered 429.
    #[arg(long, default_value = "60", value_parser = positive_seconds)]
    pub queue_timeout: std::time::Duration,
    /// Seconds a request may take once it has its slot (preparing, generating, streaming; 0 = no limit). Past it
    /// the generation is stopped and the request answered 504 (a stream ends with an error event).
    #[arg(long, default_value = "600", value_parser = seconds)]
    pub request_timeout: std::time::Duration,
    /// Largest request body accepted, in bytes (413 beyond).
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Let web pages from ORIGIN (e.g. `https://chat.example.org`; repeatable; `*` for any) call the API from a
    /// browser (CORS, preflight included). Without it only the API's own page (same origin) can.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
}

/// The CORS layer `--cors-origin` asks for (none without it): GET/POST from the allowed origins, any request
/// headers (an `Authorization` header included), preflight answers cached for an hour.
fn cors_layer(origins: &[String]) -> anyhow::Result<Option<CorsLayer>> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        let mut values = Vec::with_capacity(origins.len());
        for origin in origins {
            let trimmed = origin.trim_end_matches('/');
            let scheme_ok = trimmed.starts_with("http://") || trimmed.starts_with("https://");
            let host = trimmed.split_once("://").map_or("", |(_, rest)| rest);
            anyhow::ensure!(
                scheme_ok && !host.is_empty() && !host.contains('/'),
                "--cors-origin {origin:?} is not an origin: give scheme://host[:port], e.g. http://localhost:3000, or *"
            );
            values.push(trimmed.parse().with_context(|| {
                format!("--cors-origin {origin:?} is not a valid header value")
            })?);
        }
        AllowOrigin::list(values)
    };
    let methods = [
        axum::http::Method::GET,
        axum::http::Method::POST,
        axum::http::Method::OPTIONS,
    ];
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods(methods)
            .allow_headers(AllowHeaders::mirror_request())
            .max_age(std::time::Duration::from_secs(3600)),
    ))
}

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.max_concurrent > 0,
        "--max-concurrent must be at least 1"
    );
    let cors = cors_layer(&args.cors_origins)?;
    let loaded = args.model.load().await?;
    let name = args
        .model_name
        .clone()
        .unwrap_or_else(|| match &args.model.model {
            petal_model::ModelRef::Local(path) => default_name(path),
            petal_model::ModelRef::Hub(hub) => hub.repo.clone(),
        });
    let model_id = loaded.generator.model_id().to_string();
    let client = loaded.client.clone();
    // Preparing requests may take every core but one, which stays with the async runtime (admission.rs).
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    let preparers = cores.saturating_sub(1).max(1);
    tracing::debug!(
        preparers,
        request_timeout_s = args.request_timeout.as_secs_f64(),
        "API limits"
    );
    let state = Arc::new(state::AppState {
        generator: loaded.generator,
        tokenizer: loaded.tokenizer,
        name: name.clone(),
        fingerprint: state::system_fingerprint(&model_id),
        model_id,
        created: types::now(),
        admission: admission::Admission::new(
            args.max_concurrent,
            args.max_queue,
            args.queue_timeout,
            Some(args.request_timeout),
            preparers,
        ),
        metrics: Default::default(),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!("serving model {name:?} ({})", state.model_id);
    println!("listening on http://{addr}");
    println!("chat page at http://{addr}/");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    tracing::info!(%addr, model = %name, local = state.generator.is_local(), "OpenAI-compatible API up");
    axum::serve(listener, routes::router(state, cors, args.max_body_bytes))
        .with_graceful_shutdown(shutdown_signal())
        .await
        .context("HTTP server failed")?;
    if let Some(client) = client {
        client.shutdown().await;
    }
    Ok(())
}

/// The model file's name without its extension (a directory's own name).
fn default_name(path: &std::path::Path) -> String {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    };
    name.and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .unwrap_or("petal")
        .to_string()
}

/// Ctrl-C or SIGTERM: stop accepting connections and let running requests finish.
async fn shutdown_signal() {
    if let Err(e) = petal_cli::app::shutdown_signal().await {
        tracing::warn!(error = %e, "cannot listen for signals; stop the server by killing it");
        std::future::pending::<()>().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cors_origins_are_checked() {
        assert!(cors_layer(&[]).unwrap().is_none());
        assert!(cors_layer(&["*".into()]).unwrap().is_some());
        assert!(cors_layer(&[
            "http://localhost:3000".into(),
            "https://chat.example.org/".into()
        ])
        .unwrap()
        .is_some());
        for bad in [
            "localhost:3000",
            "http://",
            "https://a.org/path",
            "ftp://a.org",
        ] {
            assert!(cors_layer(&[bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn system_fingerprint_names_version_and_weights() {
        let fp =
            state::system_fingerprint("SmolLM2-135M-Instruct-0123456789abcdef0123456789abcdef");
        assert_eq!(
            fp,
            format!("petal-{}-0123456789ab", env!("CARGO_PKG_VERSION"))
        );
    }
}
