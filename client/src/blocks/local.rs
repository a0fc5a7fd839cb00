//! The blocks in this process: spans loaded from the model source, one [`SpanCache`] per span per session. Each
//! span has a [`SpanScheduler`], so concurrent sessions (`petal api --local` serving several requests) run their
//! steps batched on its thread, as a node's sessions do.
use super::{BlockSession, BlocksOutput, ModelBlocks};
use crate::error::{ClientError, Result};
use candle_core::{DType, Tensor};
use futures::future::BoxFuture;
use futures::FutureExt;
use petal_model::{
    BatchInfo, BlockRange, BlockSpan, ModelSource, Placement, SessionStep, SpanCache,
    SpanScheduler, Stepped,
};
use std::sync::Arc;

/// Spans that together cover every block of a model, in order, each with its scheduler. Cheap to clone (the
/// weights and the schedulers are shared); the schedulers' threads end when the last clone and session are gone.
#[derive(Clone)]
pub struct LocalSpans {
    schedulers: Arc<[SpanScheduler]>,
}

impl LocalSpans {
    /// Every block of `source` on `placement`'s device, in the dtype [`ModelSource::block_dtype`] picks for
    /// `placement`'s dtype, sessions' keys and values stored in `kv_dtype` (`None`: that dtype).
    pub fn load(
        source: &ModelSource,
        placement: &Placement,
        kv_dtype: Option<DType>,
    ) -> Result<Self> {
        let placement = source.block_placement(&placement.device, Some(placement.dtype));
        let mut span =
            source.load_span_on(BlockRange::new(0, source.spec().num_blocks), &placement)?;
        span.set_kv_dtype(kv_dtype);
        Self::new(vec![span])
    }

    /// Spans already loaded; they must follow each other from block 0 to the model's last. Starts a scheduler
    /// thread per span.
    pub fn new(spans: Vec<BlockSpan>) -> Result<Self> {
        let schedulers = spans
            .into_iter()
            .map(|span| SpanScheduler::start(Arc::new(span)))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(Self {
            schedulers: schedulers.into(),
        })
    }

    /// Each span's scheduler, in block order (`scheduler.span()` is the span).
    pub fn schedulers(&self) -> &[SpanScheduler] {
        &self.schedulers
    }

    /// A session of this process's own (no `Box`), for callers that drive the blocks synchronously
    /// ([`LocalSpansSession::forward_now`]) as well as through [`BlockSession`].
    pub fn open_local(&self, max_length: usize) -> Result<LocalSpansSession> {
        let caches = self
            .schedulers
            .iter()
            .map(|s| s.span().new_cache(s.span().range(), max_length).map(Some))
            .collect::<petal_model::Result<Vec<_>>>()?;
        Ok(LocalSpansSession {
            schedulers: self.schedulers.clone(),
            caches,
            position: 0,
            max_length,
            last_batch: None,
        })
    }
}

impl ModelBlocks for LocalSpans {
    fn open(&self, max_length: usize) -> BoxFuture<'_, Result<Box<dyn BlockSession>>> {
        let session = self
            .open_local(max_length)
            .map(|s| Box::new(s) as Box<dyn BlockSession>);
        async move { session }.boxed()
    }
}

/// The in-process equivalent of a [`crate::ChainSession`].
pub struct LocalSpansSession {
    schedulers: Arc<[SpanScheduler]>,
    /// One per span; `None` only while that span's step is in flight (for good, if its future was dropped then:
    /// the session cannot go on).
    caches: Vec<Option<SpanCache>>,
    position: usize,
    max_length: usize,
    last_batch: Option<BatchInfo>,
}

impl LocalSpansSession {
    /// Runs `hidden` through every span, blocking this thread until done (through the same schedulers as
    /// [`BlockSession::forward`], so it batches with concurrent sessions too). On an async worker thread, call it
    /// under `block_in_place` (as [`crate::generator::compute`] does).
    pub fn forward_now(&mut self, hidden: &Tensor) -> Result<Tensor> {
        let mut x = hidden.clone();
        for i in 0..self.schedulers.len() {
            let step = self.take_step(i, x)?;
            let stepped = self.schedulers[i].step_blocking(step);
            x = self.put_back(i, stepped)?;
        }
        self.advance(hidden)?;
        Ok(x)
    }

    /// The batch the last step ran in on the first span: how many sessions shared it, its rows and compute time.
    pub fn last_batch(&self) -> Option<BatchInfo> {
        self.last_batch
    }

    /// Span `i`'s step for `hidden` at the session's position, with its cache moved in.
    fn take_step(&mut self, i: usize, hidden: Tensor) -> Result<SessionStep> {
        let cache = self.caches.get_mut(i).and_then(Option::take).ok_or_else(|| {
            ClientError::Request(
                "this local session lost its cache (a step was abandoned midway); open a new one".into(),
            )
        })?;
        Ok(SessionStep {
            hidden,
            position: self.position,
            cache,
        })
    }

    /// Takes span `i`'s cache back and returns its output.
    fn put_back(
        &mut self,
        i: usize,
        stepped: std::result::Result<Stepped, petal_model::SchedulerError>,
    ) -> Result<Tensor> {
        let stepped = stepped?;
        if i == 0 {
            self.last_batch = Some(stepped.batch);
        }
        if let Some(slot) = self.caches.get_mut(i) {
            *slot = Some(stepped.cache);
        }
        Ok(stepped.output?)
    }

    fn advance(&mut self, hidden: &Tensor) -> Result<()> {
        self.position += hidden.dim(1).map_err(petal_model::ModelError::from)?;
        Ok(())
    }
}

impl BlockSession for LocalSpansSession {
    fn position(&self) -> usize {
        self.position
    }

    fn max_length(&self) -> usize {
        self.max_length
    }

    fn extend(&mut self, max_length: usize) -> BoxFuture<'_, Result<()>> {
        async move {
            if self.caches.iter().any(Option::is_none) {
                return Err(ClientError::Request(
                    "this local session lost its cache (a step was abandoned midway); open a new one".into(),
                ));
            }
            for cache in self.caches.iter_mut().flatten() {
                cache.extend(max_length);
            }
            self.max_length = self.max_length.max(max_length);
            Ok(())
        }
        .boxed()
    }

    fn forward<'a>(&'a mut self, hidden: &'a Tensor) -> BoxFuture<'a, Result<BlocksOutput>> {
        async move {
            let mut x = hidden.clone();
            for i in 0..self.schedulers.len() {
                let step = self.take_step(i, x)?;
                // Awaiting the batch is also where an aborted request stops and other tasks run.
                let stepped = self.schedulers[i].step(step).await;
                x = self.put_back(i, stepped)?;
            }
            self.advance(hidden)?;
            Ok(BlocksOutput {
                hidden: x,
                hops: vec![],
            })
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async {}.boxed()
    }
}
