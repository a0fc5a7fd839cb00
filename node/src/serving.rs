//! The span a node serves now, and how it changes to another when the balancer moves it: the new span is loaded
//! next to the old one, new streams go to it and the announced record follows at once; the old span's sessions
//! get the drain time to finish, then its remaining streams are closed (their clients replay elsewhere) and it is
//! dropped with its caches.
use crate::admission::{Admission, AdmissionLimits, PeerUsage, Usage};
use crate::context::ServerContext;
use crate::limits::ServeLimits;
use crate::loader::{measure_throughput, SpanLoader};
use crate::metrics::{Metrics, MetricsSource};
use crate::push::Pusher;
use crate::{NodeError, Result};
use petal_model::BlockRange;
use petal_proto::pb;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// What every span a node serves shares: its limits and how its throughput is known.
#[derive(Debug, Clone, Copy)]
pub struct SpanSettings {
    pub admission: AdmissionLimits,
    pub limits: ServeLimits,
    /// Announced as given (`--throughput`); `None`: measured through each span once loaded.
    pub throughput: Option<f64>,
}

/// The node's current span, switchable.
pub struct Serving {
    loader: Arc<SpanLoader>,
    pusher: Pusher,
    settings: SpanSettings,
    model_id: String,
    /// The record's fields that do not depend on the span (peer, model, version, limits).
    template: pb::ServerRecord,
    metrics: Arc<Metrics>,
    current: watch::Sender<Arc<ServerContext>>,
    /// Sessions evicted on the spans served before the current one (the metrics' counter must not go back).
    past_evictions: AtomicU64,
}

impl Serving {
    /// Loads `range` and makes it the span served.
    pub async fn start(
        loader: Arc<SpanLoader>,
        settings: SpanSettings,
        model_id: String,
        template: pb::ServerRecord,
        metrics: Arc<Metrics>,
        pusher: Pusher,
        range: BlockRange,
    ) -> Result<Arc<Self>> {
        let first = build_context(
            &loader, &settings, &model_id, &template, &metrics, &pusher, range,
        )
        .await?;
        Ok(Arc::new(Self {
            loader,
            pusher,
            settings,
            model_id,
            template,
            metrics,
            current: watch::channel(first).0,
            past_evictions: AtomicU64::new(0),
        }))
    }

    /// The span served now.
    pub fn current(&self) -> Arc<ServerContext> {
        self.current.borrow().clone()
    }

    /// Sees every switch to another span.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ServerContext>> {
        self.current.subscribe()
    }

    /// The loader the node opened its model and devices with.
    pub fn loader(&self) -> &SpanLoader {
        &self.loader
    }

    /// Loads `range` (and measures it) next to the span served, ready for [`Serving::switch_to`]. Dropping the
    /// result abandons the move.
    pub async fn prepare(&self, range: BlockRange) -> Result<Arc<ServerContext>> {
        let mut template = self.template.clone();
        template.reachability = self.current().record().reachability;
        build_context(
            &self.loader,
            &self.settings,
            &self.model_id,
            &template,
            &self.metrics,
            &self.pusher,
            range,
        )
        .await
    }

    /// Serves `next` from now on: new streams and the announced record switch at once; the old span refuses new
    /// sessions, its open ones get up to `drain` to finish, then its streams are closed.
    pub async fn switch_to(&self, next: Arc<ServerContext>, drain: Duration) {
        let range = next.span.range();
        let old = self.current.send_replace(next);
        tracing::info!(from = %old.span.range(), to = %range, "now serving the new span; draining the old one");
        if !old.drain(drain).await {
            tracing::info!(
                sessions = old.admission.usage().sessions,
                "drain time over: closing the old span's streams; their clients replay elsewhere"
            );
        }
        self.past_evictions
            .fetch_add(old.admission.evictions(), Ordering::Relaxed);
        old.retire();
    }
}

/// Loads `range` and builds the context that serves it, on the blocking pool.
async fn build_context(
    loader: &Arc<SpanLoader>,
    settings: &SpanSettings,
    model_id: &str,
    template: &pb::ServerRecord,
    metrics: &Arc<Metrics>,
    pusher: &Pusher,
    range: BlockRange,
) -> Result<Arc<ServerContext>> {
    let loaded = {
        let loader = loader.clone();
        tokio::task::spawn_blocking(move || loader.load(range))
            .await
            .map_err(|source| NodeError::Join {
                task: "loading the span",
                source,
            })??
    };
    let throughput = match settings.throughput {
        Some(announced) => announced,
        None => {
            let span = loaded.span.clone();
            tokio::task::spawn_blocking(move || measure_throughput(&span))
                .await
                .map_err(|source| NodeError::Join {
                    task: "measuring throughput",
                    source,
                })??
        }
    };
    let record = pb::ServerRecord {
        start_block: range.start as u32,
        end_block: range.end as u32,
        throughput_tokens_per_sec: throughput as f32,
        devices: loaded.devices,
        block_hashes: loaded.block_hashes,
        weight_bytes: loaded.weight_bytes,
        ..template.clone()
    };
    Ok(Arc::new(
        ServerContext::with_metrics(
            loaded.span,
            model_id.to_string(),
            Admission::new(settings.admission),
            settings.limits,
            record,
            metrics.clone(),
        )?
        .with_pusher(pusher.clone()),
    ))
}

impl MetricsSource for Serving {
    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn usage(&self) -> Usage {
        self.current().admission.usage()
    }

    fn peers(&self) -> Vec<(petal_p2p::PeerId, PeerUsage)> {
        self.current().admission.peers()
    }

    fn evictions(&self) -> u64 {
        self.past_evictions.load(Ordering::Relaxed) + self.current().admission.evictions()
    }
}
