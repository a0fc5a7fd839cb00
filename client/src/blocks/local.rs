//! The blocks in this process: spans loaded from the model source, one [`SpanCache`] per span per session.
use super::{BlockSession, BlocksOutput, ModelBlocks};
use crate::error::Result;
use crate::generator::compute;
use candle_core::Tensor;
use futures::future::BoxFuture;
use futures::FutureExt;
use petal_model::{BlockRange, BlockSpan, ModelSource, Placement, SpanCache};
use std::sync::Arc;

/// Spans that together cover every block of a model, in order. Cheap to clone (the weights are shared).
#[derive(Clone)]
pub struct LocalSpans {
    spans: Arc<[BlockSpan]>,
}

impl LocalSpans {
    /// Every block of `source` on `placement`'s device, in the dtype [`ModelSource::block_dtype`] picks for
    /// `placement`'s dtype.
    pub fn load(source: &ModelSource, placement: &Placement) -> Result<Self> {
        let placement = source.block_placement(&placement.device, Some(placement.dtype));
        let span = source.load_span_on(BlockRange::new(0, source.spec().num_blocks), &placement)?;
        Ok(Self::new(vec![span]))
    }

    /// Spans already loaded; they must follow each other from block 0 to the model's last.
    pub fn new(spans: Vec<BlockSpan>) -> Self {
        Self {
            spans: spans.into(),
        }
    }

    pub fn spans(&self) -> &[BlockSpan] {
        &self.spans
    }

    /// A session of this process's own (no `Box`, no future), for callers that drive the blocks synchronously.
    pub fn open_local(&self, max_length: usize) -> Result<LocalSpansSession> {
        let caches = self
            .spans
            .iter()
            .map(|s| s.new_cache(s.range(), max_length))
            .collect::<petal_model::Result<Vec<_>>>()?;
        Ok(LocalSpansSession {
            spans: self.spans.clone(),
            caches,
            position: 0,
            max_length,
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
    spans: Arc<[BlockSpan]>,
    caches: Vec<SpanCache>,
    position: usize,
    max_length: usize,
}

impl LocalSpansSession {
    /// Runs `hidden` through every span, synchronously.
    pub fn forward_now(&mut self, hidden: &Tensor) -> Result<Tensor> {
        let mut x = hidden.clone();
        for (span, cache) in self.spans.iter().zip(&mut self.caches) {
            x = span.forward(&x, self.position, cache)?;
        }
        // GPU kernels run asynchronously: wait for them, so the step's timings split blocks from head correctly.
        x.device()
            .synchronize()
            .map_err(petal_model::ModelError::from)?;
        self.position += hidden.dim(1).map_err(petal_model::ModelError::from)?;
        Ok(x)
    }
}

impl BlockSession for LocalSpansSession {
    fn position(&self) -> usize {
        self.position
    }

    fn max_length(&self) -> usize {
        self.max_length
    }

    fn forward<'a>(&'a mut self, hidden: &'a Tensor) -> BoxFuture<'a, Result<BlocksOutput>> {
        async move {
            let hidden = compute(|| self.forward_now(hidden))?;
            // Let the runtime cancel an aborted request, and other tasks run, between steps.
            tokio::task::yield_now().await;
            Ok(BlocksOutput {
                hidden,
                hops: vec![],
            })
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async {}.boxed()
    }
}
