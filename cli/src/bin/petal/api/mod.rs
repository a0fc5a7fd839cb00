//! `petal api`: an OpenAI-compatible HTTP server (`GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions`, streaming as server-sent events) generating through the swarm, or with `--local`
//! through the whole model in this process.
//!
//! Every request runs in a task of its own on a session of its own (through the swarm: its own chain of server
//! sessions), so requests are served concurrently; `--max-concurrent` bounds how many generate at once (the rest
//! wait their turn). A request whose client goes away is aborted and its session freed.
mod jobs;
mod routes;
mod state;
mod stream;
mod types;

use crate::backend::ModelArgs;
use anyhow::Context;
use clap::Args;
use std::net::SocketAddr;
use std::sync::Arc;

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
}

pub async fn run(args: ApiArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.max_concurrent > 0,
        "--max-concurrent must be at least 1"
    );
    let loaded = args.model.load().await?;
    let name = args
        .model_name
        .clone()
        .unwrap_or_else(|| default_name(&args.model.model));
    let model_id = loaded.generator.model_id().to_string();
    let client = loaded.client.clone();
    let state = Arc::new(state::AppState {
        generator: loaded.generator,
        tokenizer: loaded.tokenizer,
        name: name.clone(),
        model_id,
        created: types::now(),
        permits: Arc::new(tokio::sync::Semaphore::new(args.max_concurrent)),
    });
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!("serving model {name:?} ({})", state.model_id);
    println!("listening on http://{addr}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    tracing::info!(%addr, model = %name, local = state.generator.is_local(), "OpenAI-compatible API up");
    axum::serve(listener, routes::router(state))
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
