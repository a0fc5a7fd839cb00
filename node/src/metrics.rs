//! Prometheus metrics for one node, served as OpenMetrics text on `GET /metrics` (`petal-node serve
//! --metrics-listen ADDR`).
//!
//! | metric | type | meaning |
//! | --- | --- | --- |
//! | `petal_steps_total` | counter | inference steps computed |
//! | `petal_tokens_processed_total` | counter | token positions computed (batch x tokens, summed over steps) |
//! | `petal_step_duration_seconds` | histogram | compute time of one step: the batch it ran in |
//! | `petal_batch_sessions` | histogram | steps (sessions) per batched forward; `_count` batches, `_sum` steps |
//! | `petal_sessions_open` | gauge | sessions holding a cache reservation |
//! | `petal_kv_cache_tokens_used` / `_free` / `_total` | gauge | KV cache budget (`--cache-tokens`) in positions |
//! | `petal_refusals_total` | counter | requests refused, label `reason` (`cache_full`, `busy`, `peer_busy`, `step_too_large`, `step_memory`, `rate_limited`, `frame_too_large`, `frame_timeout`, `shutting_down`) |
//! | `petal_sessions_evicted_total` | counter | idle sessions evicted for a peer below its fair share |
//! | `petal_peer_sessions` / `petal_peer_cache_tokens` | gauge | per peer holding sessions (label `peer`): its sessions and reserved positions |
//! | `petal_build_info` | gauge (always 1) | labels `version`, `model`, `model_id`, `blocks` |
//!
//! Counters and the step histogram are updated by [`Metrics::record_step`] after each step, the batch histogram by
//! [`Metrics::batch_recorder`] on the span scheduler's thread after each batch; the gauges are read from
//! [`MetricsSource::usage`] (the node's admission control) when the page is rendered, so they are never stale.
//!
//! This module knows nothing of the server: the HTTP endpoint renders any [`MetricsSource`], which the server
//! context implements.
use crate::admission::{PeerUsage, Usage};
use crate::{NodeError, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use petal_model::{BatchInfo, BlockRange};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpListener;

/// The OpenMetrics text exposition's content type (Prometheus asks for it and parses it).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the step latency buckets, in seconds: 100 µs to 10 s in 1-2.5-5 steps (a 135M-parameter span
/// on a GPU is well under a millisecond; a long prompt through a big span on a CPU takes seconds).
pub const STEP_SECONDS_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Upper bounds of the batch size buckets, in steps: 1 (no batching) to 64 (the default session limit).
pub const BATCH_SESSIONS_BUCKETS: [f64; 9] = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0];

/// What `petal_build_info` says about the node.
#[derive(Debug, Clone)]
pub struct BuildInfo {
    pub version: String,
    pub model: String,
    pub model_id: String,
    pub blocks: BlockRange,
}

/// A node's metrics and the registry that renders them.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    steps: Counter,
    tokens: Counter,
    step_seconds: Histogram,
    batch_sessions: Histogram,
    sessions_open: Gauge,
    cache_used: Gauge,
    cache_free: Gauge,
    cache_total: Gauge,
    refusals: Family<Vec<(String, String)>, Counter>,
    evicted: Counter,
    peer_sessions: Family<Vec<(String, String)>, Gauge>,
    peer_tokens: Family<Vec<(String, String)>, Gauge>,
    build_info: Family<Vec<(String, String)>, Gauge>,
    build: std::sync::Mutex<BuildInfo>,
}

impl BuildInfo {
    fn labels(&self) -> Vec<(String, String)> {
        vec![
            ("version".into(), self.version.clone()),
            ("model".into(), self.model.clone()),
            ("model_id".into(), self.model_id.clone()),
            ("blocks".into(), self.blocks.to_string()),
        ]
    }
}

impl Metrics {
    pub fn new(build: &BuildInfo) -> Self {
        let mut registry = Registry::default();
        let steps = Counter::default();
        let tokens = Counter::default();
        let step_seconds = Histogram::new(STEP_SECONDS_BUCKETS);
        let batch_sessions = Histogram::new(BATCH_SESSIONS_BUCKETS);
        let (sessions_open, cache_used, cache_free, cache_total): (Gauge, Gauge, Gauge, Gauge) =
            Default::default();
        registry.register(
            "petal_steps",
            "Inference steps computed by this node",
            steps.clone(),
        );
        registry.register(
            "petal_tokens_processed",
            "Token positions computed (batch x tokens, summed over steps)",
            tokens.clone(),
        );
        registry.register_with_unit(
            "petal_step_duration",
            "Compute time of one inference step through the session's blocks (the batch it ran in)",
            Unit::Seconds,
            step_seconds.clone(),
        );
        registry.register(
            "petal_batch_sessions",
            "Steps (sessions) computed together in one batched forward",
            batch_sessions.clone(),
        );
        registry.register(
            "petal_sessions_open",
            "Inference sessions open (each holds a KV cache reservation)",
            sessions_open.clone(),
        );
        registry.register(
            "petal_kv_cache_tokens_used",
            "KV cache positions reserved by open sessions",
            cache_used.clone(),
        );
        registry.register(
            "petal_kv_cache_tokens_free",
            "KV cache positions still free for new sessions",
            cache_free.clone(),
        );
        registry.register(
            "petal_kv_cache_tokens_total",
            "KV cache budget in positions (--cache-tokens)",
            cache_total.clone(),
        );
        let refusals = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "petal_refusals",
            "Requests refused, by reason",
            refusals.clone(),
        );
        let evicted = Counter::default();
        registry.register(
            "petal_sessions_evicted",
            "Idle sessions evicted to make room for a peer below its fair share",
            evicted.clone(),
        );
        let (peer_sessions, peer_tokens) = (
            Family::<Vec<(String, String)>, Gauge>::default(),
            Family::<Vec<(String, String)>, Gauge>::default(),
        );
        registry.register(
            "petal_peer_sessions",
            "Sessions held, per peer holding any",
            peer_sessions.clone(),
        );
        registry.register(
            "petal_peer_cache_tokens",
            "KV cache positions reserved, per peer holding any",
            peer_tokens.clone(),
        );
        let build_info = Family::<Vec<(String, String)>, Gauge>::default();
        build_info.get_or_create(&build.labels()).set(1);
        registry.register(
            "petal_build_info",
            "Always 1; the labels describe the build and the span served",
            build_info.clone(),
        );
        Self {
            registry,
            steps,
            tokens,
            step_seconds,
            batch_sessions,
            sessions_open,
            cache_used,
            cache_free,
            cache_total,
            refusals,
            evicted,
            peer_sessions,
            peer_tokens,
            build_info,
            build: std::sync::Mutex::new(build.clone()),
        }
    }

    /// The node now serves `blocks` (it moved): `petal_build_info` says so.
    pub fn set_blocks(&self, blocks: BlockRange) {
        let mut build = self
            .build
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        build.blocks = blocks;
        self.build_info.clear();
        self.build_info.get_or_create(&build.labels()).set(1);
    }

    /// One request refused for `reason` (see the table above).
    pub fn refused(&self, reason: &str) {
        self.refusals
            .get_or_create(&vec![("reason".into(), reason.to_string())])
            .inc();
    }

    /// Sets the per-peer gauges to exactly the peers holding sessions now, and the eviction count.
    pub fn set_peers(&self, peers: &[(petal_p2p::PeerId, PeerUsage)], evictions: u64) {
        self.peer_sessions.clear();
        self.peer_tokens.clear();
        for (peer, u) in peers {
            let label = vec![("peer".to_string(), peer.to_string())];
            self.peer_sessions
                .get_or_create(&label)
                .set(gauge_value(u.sessions));
            self.peer_tokens
                .get_or_create(&label)
                .set(gauge_value(u.tokens));
        }
        self.evicted
            .inc_by(evictions.saturating_sub(self.evicted.get()));
    }

    /// One step of `tokens` positions that took `compute_micros` of compute.
    pub fn record_step(&self, tokens: u64, compute_micros: u64) {
        self.steps.inc();
        self.tokens.inc_by(tokens);
        self.step_seconds.observe(compute_micros as f64 / 1e6);
    }

    /// What the span scheduler calls after each batch: observes the batch's size in `petal_batch_sessions`.
    pub fn batch_recorder(&self) -> impl Fn(&BatchInfo) + Send + Sync + 'static {
        let batch_sessions = self.batch_sessions.clone();
        move |batch: &BatchInfo| batch_sessions.observe(batch.sessions as f64)
    }

    /// Sets the session and cache gauges.
    pub fn set_usage(&self, u: Usage) {
        self.sessions_open.set(gauge_value(u.sessions));
        self.cache_used.set(gauge_value(u.tokens_used));
        self.cache_free.set(gauge_value(u.tokens_free()));
        self.cache_total.set(gauge_value(u.tokens_total));
    }

    /// The whole exposition, ending in `# EOF`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an error would only come from a metric's own encoder.
        if let Err(e) = encode(&mut out, &self.registry) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        out
    }
}

fn gauge_value(v: usize) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// What a metrics page is rendered from: a node's [`Metrics`] and its cache usage now.
pub trait MetricsSource: Send + Sync + 'static {
    fn metrics(&self) -> &Metrics;
    fn usage(&self) -> Usage;
    /// What each peer holding sessions holds.
    fn peers(&self) -> Vec<(petal_p2p::PeerId, PeerUsage)>;
    /// Sessions evicted for other peers since start.
    fn evictions(&self) -> u64;
}

/// The node's metrics page, with the gauges read from its admission control now.
pub fn render(source: &dyn MetricsSource) -> String {
    let metrics = source.metrics();
    metrics.set_usage(source.usage());
    metrics.set_peers(&source.peers(), source.evictions());
    metrics.render()
}

/// `GET /metrics` (anything else is 404).
pub fn router(source: Arc<dyn MetricsSource>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_page))
        .with_state(source)
}

async fn metrics_page(State(source): State<Arc<dyn MetricsSource>>) -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, CONTENT_TYPE)],
        render(source.as_ref()),
    )
}

/// Binds the metrics listener, with an error that names the flag (called before the span loads, so a taken port
/// fails at once).
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| NodeError::MetricsBind { addr, source })
}

/// Serves `GET /metrics` on `listener` until the task is dropped or aborted.
pub async fn serve(listener: TcpListener, source: Arc<dyn MetricsSource>) {
    let addr = listener.local_addr().ok();
    if let Err(e) = axum::serve(listener, router(source)).await {
        tracing::warn!(?addr, error = %e, "metrics server stopped");
    }
}
