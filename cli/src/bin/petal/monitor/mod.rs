//! `petal monitor`: a page (and `GET /api/v1/state`) showing the swarm's health: per model, how many servers hold
//! each block (red where none does), and each server's span, throughput, load, free cache, reachability and
//! version. One task looks at the swarm every `--refresh` seconds; the page polls the state and redraws.
mod state;

use anyhow::Context;
use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use clap::Args;
use libp2p::Multiaddr;
use petal_cli::app::shutdown_signal;
use petal_client::SwarmClient;
use state::{KnownModels, SwarmState};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

const PAGE: &str = include_str!("page.html");

#[derive(Args, Debug)]
pub struct MonitorArgs {
    /// Bootstrap peer(s), with /p2p/<peer id>.
    #[arg(long, required = true)]
    pub bootstrap: Vec<Multiaddr>,
    /// Address to serve the page on (port 0: any free port; printed as `listening on http://...`).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The private swarm's key file (`petal-node swarm-key --new`).
    #[arg(long, value_name = "FILE")]
    pub swarm_key: Option<std::path::PathBuf>,
    /// Seconds between looks at the swarm (each look waits at most this long, up to 5 s, for answers).
    #[arg(long, default_value = "5", value_parser = petal_cli::seconds::positive_seconds)]
    pub refresh: Duration,
}

pub async fn run(args: MonitorArgs) -> anyhow::Result<()> {
    let swarm_key = petal_cli::load_swarm_key(args.swarm_key.as_deref())?;
    let client = SwarmClient::join(args.bootstrap, swarm_key).await?;
    let (state_tx, state_rx) = watch::channel(Arc::new(SwarmState::default()));
    let watcher = tokio::spawn(watch_swarm(client.clone(), args.refresh, state_tx));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let addr = listener.local_addr()?;
    println!("listening on http://{addr}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    tracing::info!(%addr, "swarm monitor up");
    let served = axum::serve(listener, router(state_rx))
        .with_graceful_shutdown(async {
            let _ = shutdown_signal().await;
        })
        .await;
    watcher.abort();
    client.shutdown().await;
    served.context("HTTP server failed")
}

/// Looks at the swarm every `refresh`, publishing each view.
async fn watch_swarm(
    client: SwarmClient,
    refresh: Duration,
    state: watch::Sender<Arc<SwarmState>>,
) {
    let mut known = KnownModels::new();
    let lookup = refresh.min(Duration::from_secs(5));
    loop {
        let started = tokio::time::Instant::now();
        match client.find_servers(None, lookup).await {
            Ok(records) => {
                let view = state::build(&records, &mut known, petal_p2p::records::now_unix_ms());
                state.send_replace(Arc::new(view));
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot look at the swarm");
                state.send_modify(|s| {
                    let mut view = (**s).clone();
                    view.error = Some(e.to_string());
                    *s = Arc::new(view);
                });
            }
        }
        tokio::time::sleep_until(started + refresh).await;
    }
}

fn router(state: watch::Receiver<Arc<SwarmState>>) -> Router {
    Router::new()
        .route("/", get(page))
        .route("/api/v1/state", get(current_state))
        .with_state(state)
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
}

async fn current_state(State(state): State<watch::Receiver<Arc<SwarmState>>>) -> impl IntoResponse {
    let view = SwarmState::clone(&state.borrow());
    ([(header::CACHE_CONTROL, "no-store")], Json(view))
}
