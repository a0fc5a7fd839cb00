//! A contiguous span of blocks as a node serves it, and the per-session state that goes with it.
use crate::compute::block::{
    join_rows, session_rows, split_rows, Block, BlockStep, KvCache, Rope, RopeParams,
};
use crate::compute::block_range::BlockRange;
use crate::compute::lanes;
use crate::compute::placement::Placement;
use crate::compute::pool::on_compute_pool;
use crate::compute::spec::ModelSpec;
use crate::compute::weights::WeightSource;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};
use std::sync::Arc;

/// Blocks `range` of a model, each on its own placement.
pub struct BlockSpan {
    spec: Arc<ModelSpec>,
    range: BlockRange,
    blocks: Vec<Block>,
    /// The dtype sessions' keys and values are stored in; `None`: each block's compute dtype.
    kv_dtype: Option<DType>,
    /// The positions a block's caches hold together at most (a node's budget), bounding GPU arenas.
    kv_budget: Option<usize>,
}

impl BlockSpan {
    /// Loads blocks `range`; `placements[i]` is where block `range.start + i` lives. Reads only those blocks' tensors.
    pub fn load(
        source: &dyn WeightSource,
        spec: Arc<ModelSpec>,
        range: BlockRange,
        placements: &[Placement],
    ) -> Result<Self> {
        Self::load_with_progress(source, spec, range, placements, |_| {})
    }

    /// [`BlockSpan::load`], calling `on_block(i)` after block `i` (a model-wide index) is loaded, e.g. to tick a
    /// progress bar.
    pub fn load_with_progress(
        source: &dyn WeightSource,
        spec: Arc<ModelSpec>,
        range: BlockRange,
        placements: &[Placement],
        mut on_block: impl FnMut(usize),
    ) -> Result<Self> {
        range.validate(spec.num_blocks)?;
        if placements.len() != range.len() {
            return Err(ModelError::Config(format!(
                "{} placements given for the {} blocks of {range}",
                placements.len(),
                range.len()
            )));
        }
        // One RoPE table per distinct placement and parameters, shared by the blocks with both.
        let mut ropes: Vec<(Placement, RopeParams, Rope)> = Vec::new();
        let mut blocks = Vec::with_capacity(range.len());
        for (i, p) in (range.start..range.end).zip(placements) {
            let params = RopeParams::for_layer(&spec, i);
            let rope = match ropes.iter().find(|(q, k, _)| {
                q.device.same_device(&p.device) && q.dtype == p.dtype && *k == params
            }) {
                Some((_, _, r)) => r.clone(),
                None => {
                    let r = Rope::with_params(&spec, p, params)?;
                    ropes.push((p.clone(), params, r.clone()));
                    r
                }
            };
            tracing::debug!(block = i, placement = %p, "loading block");
            blocks.push(Block::load(source, &spec, i, p.clone(), rope)?);
            on_block(i);
        }
        Ok(Self {
            spec,
            range,
            blocks,
            kv_dtype: None,
            kv_budget: None,
        })
    }

    /// Stores sessions' keys and values in `dtype` (e.g. f16: half the bytes to hold and to read per step, as
    /// llama.cpp's default cache) instead of the compute dtype; `None` restores the default. Caches opened before
    /// keep theirs.
    pub fn set_kv_dtype(&mut self, dtype: Option<DType>) {
        self.kv_dtype = dtype;
    }

    /// The positions the sessions' caches of a block hold at most together (a node's KV budget): on a GPU, the
    /// size of each block's arena ([`crate::compute::block`]), allocated whole with the first session. `None`
    /// (the default): arenas grow as they need. Arenas already made keep theirs.
    pub fn set_kv_budget(&mut self, positions: Option<usize>) {
        self.kv_budget = positions;
    }

    pub fn range(&self) -> BlockRange {
        self.range
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    pub fn blocks(&self) -> &[Block] {
        &self.blocks
    }

    /// Where hidden states enter the span.
    pub fn input_placement(&self) -> &Placement {
        self.blocks[0].placement()
    }

    /// Where hidden states leave the span.
    pub fn output_placement(&self) -> &Placement {
        self.blocks[self.blocks.len() - 1].placement()
    }

    /// A fresh KV cache (one session's state) over `sub` (a part of this span, or all of it) holding at most `max_length` positions.
    pub fn new_cache(&self, sub: BlockRange, max_length: usize) -> Result<SpanCache> {
        sub.validate(self.spec.num_blocks)?;
        if !self.range.covers(&sub) {
            return Err(ModelError::BlockRange {
                range: sub.to_string(),
                reason: format!("this span serves {}", self.range),
            });
        }
        if max_length == 0 || max_length > self.spec.max_position {
            return Err(ModelError::Config(format!(
                "max_length {max_length} must be in 1..={}",
                self.spec.max_position
            )));
        }
        let caches = (sub.start..sub.end)
            .map(|i| {
                self.blocks[i - self.range.start].new_cache(
                    max_length,
                    self.kv_dtype,
                    self.kv_budget,
                )
            })
            .collect();
        Ok(SpanCache {
            id: NEXT_CACHE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            range: sub,
            caches,
            position: 0,
            max_length,
        })
    }

    /// Runs `hidden` (`[batch, tokens, hidden_size]`, positions `position..position + tokens`) through the session's
    /// blocks. Every check happens before any compute, so a refused step leaves the session as it was.
    pub fn forward(
        &self,
        hidden: &Tensor,
        position: usize,
        session: &mut SpanCache,
    ) -> Result<Tensor> {
        let mut steps = [BatchStep {
            hidden: hidden.clone(),
            position,
            cache: session,
        }];
        self.forward_batch(&mut steps).remove(0)
    }

    /// Runs several sessions' steps as one forward where they share blocks: one matmul over all their rows,
    /// attention per session against its own cache. Each step is checked on its own, so a bad step fails alone and
    /// leaves its session as it was; the others run. A session's result does not depend on the others in the batch.
    pub fn forward_batch(&self, steps: &mut [BatchStep<'_>]) -> Vec<Result<Tensor>> {
        on_compute_pool(&self.input_placement().device, || self.forward_here(steps))
    }

    /// How many [`lanes`] a batch of `rows` rows in `sessions` sessions goes through, on the compute pool of the
    /// calling thread (rayon's shared pool outside any): one off the CPU, where a device's kernels take the whole
    /// batch in one launch.
    pub fn lanes(&self, rows: usize, sessions: usize) -> usize {
        if !self.blocks.iter().all(|b| b.placement().device.is_cpu()) {
            return 1;
        }
        lanes::count(rows, sessions, rayon::current_num_threads())
    }

    /// [`Self::forward_batch`] from a thread of the compute pool: on the CPU, in [`lanes`] when the batch is big
    /// enough.
    fn forward_here(&self, steps: &mut [BatchStep<'_>]) -> Vec<Result<Tensor>> {
        let rows: Vec<usize> = steps
            .iter()
            .map(|s| s.hidden.dims().iter().take(2).product::<usize>())
            .collect();
        let total: usize = rows.iter().sum();
        let lanes = self.lanes(total, steps.len());
        let _span =
            tracing::trace_span!("span_forward", sessions = steps.len(), rows = total, lanes)
                .entered();
        self.forward_lanes(steps, &rows, lanes)
    }

    /// `steps` (of `rows` rows each) cut into `lanes` lanes, the two halves of each cut on two threads of the pool.
    fn forward_lanes(
        &self,
        steps: &mut [BatchStep<'_>],
        rows: &[usize],
        lanes: usize,
    ) -> Vec<Result<Tensor>> {
        let at = match lanes {
            0 | 1 => 0,
            _ => lanes::cut(rows, lanes / 2, lanes),
        };
        // `cut` gives 0 when there are fewer than two steps to share.
        if at == 0 {
            return self.forward_lane(steps);
        }
        let (left, right) = steps.split_at_mut(at);
        let (left_rows, right_rows) = rows.split_at(at);
        let (mut out, right) = rayon::join(
            || self.forward_lanes(left, left_rows, lanes / 2),
            || self.forward_lanes(right, right_rows, lanes - lanes / 2),
        );
        out.extend(right);
        out
    }

    /// Steps through every block as one batch, on the calling thread (its ops in parallel on the pool).
    fn forward_lane(&self, steps: &mut [BatchStep<'_>]) -> Vec<Result<Tensor>> {
        let mut results: Vec<Result<Tensor>> = steps
            .iter()
            .map(|s| {
                self.check(&s.hidden, s.position, s.cache)
                    .map(|()| s.hidden.clone())
            })
            .collect();
        let live: Vec<usize> = (0..steps.len()).filter(|&s| results[s].is_ok()).collect();
        if live.is_empty() {
            return results;
        }
        // `check` let through only sessions within this span: those that take all of it can stay together.
        if live.iter().all(|&s| steps[s].cache.range == self.range) {
            self.forward_together(steps, &live, &mut results);
        } else {
            self.forward_block_by_block(steps, &mut results);
        }
        for (s, r) in steps.iter_mut().zip(&results) {
            if r.is_ok() {
                s.cache.position += s.hidden.dims()[1];
            }
        }
        results
    }

    /// The `live` steps, which all take every block: their rows joined once into one `[1, rows, hidden]`
    /// sequence, through every block ([`Block::forward_rows`]), and split once at the end, where joining and
    /// splitting them at each block is some 65 tensor ops a block for sixteen sessions (a 16-session batch took
    /// 0.2-3.5% longer that way in six runs that alternated the two batch by batch).
    fn forward_together(
        &self,
        steps: &mut [BatchStep<'_>],
        live: &[usize],
        results: &mut [Result<Tensor>],
    ) {
        let outcome = (|| {
            let inputs = live.iter().filter_map(|&s| results[s].as_ref().ok());
            let (mut x, shapes) = join_rows(inputs, self.input_placement())
                .map_err(|e| format!("span input: {e}"))?;
            let positions: Vec<usize> = live.iter().map(|&s| steps[s].position).collect();
            for block in &self.blocks {
                let i = block.index();
                let mut sessions = session_rows(&shapes, &positions, caches_at(steps, live, i));
                x = block
                    .forward_rows(&x, &mut sessions)
                    .map_err(|e| format!("block {i}: {e}"))?;
            }
            split_rows(&x, &shapes).map_err(|e| format!("span output: {e}"))
        })();
        match outcome {
            Ok(outs) => {
                for (&s, out) in live.iter().zip(outs) {
                    results[s] = Ok(out);
                }
            }
            Err(e) => {
                for &s in live {
                    results[s] = Err(ModelError::Config(e.clone()));
                }
            }
        }
    }

    /// Block after block, each block taking the steps whose sessions include it (sessions of sub-ranges of the
    /// span).
    fn forward_block_by_block(&self, steps: &mut [BatchStep<'_>], results: &mut [Result<Tensor>]) {
        for block in &self.blocks {
            let i = block.index();
            // The steps still running whose sessions include this block.
            let live: Vec<usize> = (0..steps.len())
                .filter(|&s| results[s].is_ok() && steps[s].cache.range.contains(i))
                .collect();
            if live.is_empty() {
                continue;
            }
            let inputs: Vec<(Tensor, usize)> = live
                .iter()
                .filter_map(|&s| Some((results[s].as_ref().ok()?.clone(), steps[s].position)))
                .collect();
            let mut batch: Vec<BlockStep> = inputs
                .into_iter()
                .zip(caches_at(steps, &live, i))
                .map(|((hidden, position), cache)| BlockStep {
                    hidden,
                    position,
                    cache,
                })
                .collect();
            match block.forward_batch(&mut batch) {
                Ok(outs) => {
                    for (&s, out) in live.iter().zip(outs) {
                        results[s] = Ok(out);
                    }
                }
                Err(e) => {
                    for &s in &live {
                        results[s] = Err(ModelError::Config(format!("block {i}: {e}")));
                    }
                }
            }
        }
    }

    /// Everything checked before a step computes.
    fn check(&self, hidden: &Tensor, position: usize, session: &SpanCache) -> Result<()> {
        let dims = hidden.dims();
        if dims.len() != 3 || dims[2] != self.spec.hidden_size || dims[0] == 0 || dims[1] == 0 {
            return Err(ModelError::HiddenShape {
                actual: dims.to_vec(),
                hidden_size: self.spec.hidden_size,
            });
        }
        if !self.range.covers(&session.range) {
            return Err(ModelError::BlockRange {
                range: session.range.to_string(),
                reason: format!("this span serves {}", self.range),
            });
        }
        session.check_step(position, dims[1])
    }
}

/// The caches of block `block` of the steps `live` (whose sessions all include it), borrowed mutably together.
fn caches_at<'s>(
    steps: &'s mut [BatchStep<'_>],
    live: &[usize],
    block: usize,
) -> Vec<&'s mut KvCache> {
    steps
        .iter_mut()
        .enumerate()
        .filter(|(s, _)| live.contains(s))
        .map(|(_, step)| {
            let first = step.cache.range.start;
            &mut step.cache.caches[block - first]
        })
        .collect()
}

/// One session's step in a batch: hidden states `[batch, tokens, hidden_size]` at `position`, and that session's
/// cache. Sessions in one batch may differ in position, length and sub-range.
pub struct BatchStep<'a> {
    pub hidden: Tensor,
    pub position: usize,
    pub cache: &'a mut SpanCache,
}

/// Identities of span caches, unique in this process.
static NEXT_CACHE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One session's state on one span: a KV cache per block and the next expected position.
#[derive(Debug)]
pub struct SpanCache {
    /// Unique in this process: the scheduler knows a session's steps by it.
    id: u64,
    range: BlockRange,
    caches: Vec<KvCache>,
    position: usize,
    max_length: usize,
}

impl SpanCache {
    /// This cache's identity, unique in this process.
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn range(&self) -> BlockRange {
        self.range
    }

    /// Positions processed so far (the next step must start here).
    pub fn position(&self) -> usize {
        self.position
    }

    pub fn max_length(&self) -> usize {
        self.max_length
    }

    pub fn caches(&self) -> &[KvCache] {
        &self.caches
    }

    /// Restores KV for every block (e.g. a session moved from another node); tensors are normalised to each block's
    /// placement whatever device and dtype they come in.
    pub fn restore(&mut self, kv: &[(Tensor, Tensor)]) -> Result<()> {
        if kv.len() != self.caches.len() {
            return Err(ModelError::Config(format!(
                "{} KV pairs restored into a session of {} blocks",
                kv.len(),
                self.caches.len()
            )));
        }
        let mut len = None;
        for ((k, v), cache) in kv.iter().zip(&mut self.caches) {
            let n = k.dim(2)?;
            if *len.get_or_insert(n) != n || v.dims() != k.dims() || n > self.max_length {
                return Err(ModelError::Config(
                    "restored KV tensors disagree in shape".into(),
                ));
            }
            cache.restore(k, v)?;
        }
        self.position = len.unwrap_or(0);
        Ok(())
    }

    /// Raises the positions the session may hold to `max_length` (at most the model's context, checked by the
    /// caller, which knows it); never lowers it.
    pub fn extend(&mut self, max_length: usize) {
        self.max_length = self.max_length.max(max_length);
        for cache in &mut self.caches {
            cache.extend(self.max_length);
        }
    }

    /// Bytes of KV held across the session's blocks.
    pub fn bytes(&self) -> usize {
        self.caches.iter().map(KvCache::bytes).sum()
    }

    fn check_step(&self, position: usize, tokens: usize) -> Result<()> {
        if position != self.position {
            return Err(ModelError::Position {
                expected: self.position,
                got: position,
            });
        }
        if position + tokens > self.max_length {
            return Err(ModelError::TooLong {
                position,
                tokens,
                max_length: self.max_length,
            });
        }
        Ok(())
    }
}
