//! What a node's stream handlers share: the span and the scheduler that batches its sessions' steps, the model id,
//! admission control, limits, the announced record and the metrics.
use crate::admission::{Admission, PeerUsage, Usage};
use crate::limits::{PeerLimits, ServeLimits};
use crate::metrics::{BuildInfo, Metrics, MetricsSource};
use crate::push::{PushInbox, Pusher};
use crate::Result;
use petal_model::compute::wire::wire_dtype;
use petal_model::{BlockSpan, SpanScheduler};
use petal_proto::pb;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// What the stream handlers share.
pub struct ServerContext {
    pub span: Arc<BlockSpan>,
    /// Every step of every session runs through it: concurrent sessions' steps are batched into one forward on a
    /// thread of its own, off the async runtime.
    pub scheduler: SpanScheduler,
    pub model_id: String,
    pub wire_dtype: pb::WireDType,
    pub admission: Arc<Admission>,
    /// Per-peer receive pools, frame deadlines, cheap request rates.
    pub peers: PeerLimits,
    pub session_timeout: Duration,
    pub max_frame_bytes: usize,
    /// Most working memory one step may need (0: no limit).
    pub max_step_bytes: u64,
    /// Most positions (batch x tokens) one step may carry, as the record announces (0: no limit).
    pub max_chunk_tokens: usize,
    record: Mutex<pb::ServerRecord>,
    /// Prometheus metrics (rendered by [`crate::metrics::render`]); shared by the contexts of every span the node
    /// serves in turn, so its counters survive a move.
    pub metrics: Arc<Metrics>,
    /// Set when the node has moved to another span and this one's last sessions had their time: its streams end.
    retired: watch::Sender<bool>,
    /// Inputs pushed to this span's sessions by the previous servers of their routes.
    pub inbox: Arc<PushInbox>,
    /// Sends outputs on to the next servers; `None` without a network (tests driving the handler directly).
    pub pusher: Option<Pusher>,
}

impl ServerContext {
    /// The state shared by a node's stream handlers; `record` is the node's announcement (usage fields are filled
    /// in from `admission` whenever it is read).
    pub fn new(
        span: Arc<BlockSpan>,
        model_id: String,
        admission: Arc<Admission>,
        limits: ServeLimits,
        record: pb::ServerRecord,
    ) -> Result<Self> {
        let metrics = Arc::new(Metrics::new(&BuildInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            model: record.model_name.clone(),
            model_id: model_id.clone(),
            blocks: span.range(),
        }));
        Self::with_metrics(span, model_id, admission, limits, record, metrics)
    }

    /// [`ServerContext::new`] counting into existing `metrics` (a node's next span), which now name this span.
    pub fn with_metrics(
        span: Arc<BlockSpan>,
        model_id: String,
        admission: Arc<Admission>,
        limits: ServeLimits,
        record: pb::ServerRecord,
        metrics: Arc<Metrics>,
    ) -> Result<Self> {
        metrics.set_blocks(span.range());
        let scheduler = SpanScheduler::builder(span.clone())
            .on_batch(metrics.batch_recorder())
            .start()?;
        Ok(Self {
            wire_dtype: wire_dtype(span.input_placement().dtype)?,
            span,
            scheduler,
            model_id,
            admission,
            peers: PeerLimits::new(limits),
            session_timeout: limits.session_timeout,
            max_frame_bytes: limits.max_frame_bytes,
            max_step_bytes: limits.max_step_bytes,
            max_chunk_tokens: record.max_chunk_tokens as usize,
            record: Mutex::new(record),
            metrics,
            retired: watch::channel(false).0,
            inbox: Arc::default(),
            pusher: None,
        })
    }

    /// This context forwarding outputs to next servers through `pusher`.
    pub fn with_pusher(mut self, pusher: Pusher) -> Self {
        self.pusher = Some(pusher);
        self
    }

    /// Refuses new sessions and waits, at most `within`, until the open ones have ended. `false`: some are still
    /// open.
    pub async fn drain(&self, within: Duration) -> bool {
        self.admission.drain();
        let mut usage = self.admission.subscribe();
        tokio::time::timeout(within, usage.wait_for(|u| u.sessions == 0))
            .await
            .is_ok_and(|changed| changed.is_ok())
    }

    /// Ends every stream still open on this span (the node serves another now): their sessions' clients replay
    /// elsewhere.
    pub fn retire(&self) {
        self.retired.send_replace(true);
    }

    /// Becomes `true` when the span is retired.
    pub fn retirement(&self) -> watch::Receiver<bool> {
        self.retired.subscribe()
    }

    /// Records AutoNAT's verdict in the announced record.
    pub fn set_reachability(&self, status: &str) {
        if let Ok(mut r) = self.record.lock() {
            r.reachability = status.to_string();
        }
    }

    /// The current record, as answered to InfoRequest.
    pub fn record(&self) -> pb::ServerRecord {
        let mut r = self
            .record
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        apply_usage(&mut r, self.admission.usage());
        r
    }

    /// One step of `tokens` positions (batch x tokens) that took `compute_micros` of compute (the batch it ran in).
    pub fn record_step(&self, tokens: usize, compute_micros: u64) {
        self.metrics.record_step(tokens as u64, compute_micros);
    }
}

impl MetricsSource for ServerContext {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn usage(&self) -> Usage {
        self.admission.usage()
    }

    fn peers(&self) -> Vec<(petal_p2p::PeerId, PeerUsage)> {
        self.admission.peers()
    }

    fn evictions(&self) -> u64 {
        self.admission.evictions()
    }
}

/// Fills in a record's free cache and session count.
fn apply_usage(r: &mut pb::ServerRecord, u: Usage) {
    r.cache_tokens_free = u.tokens_free() as u64;
    r.cache_tokens_total = u.tokens_total as u64;
    r.sessions_open = u.sessions as u32;
}
