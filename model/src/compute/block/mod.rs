//! One Llama-family decoder block: pre-norm attention and pre-norm SwiGLU MLP, each with a residual.
mod attention;
mod kv_cache;
mod mlp;
mod rope;

pub use attention::Attention;

pub use kv_cache::KvCache;
pub use mlp::Mlp;
pub use rope::Rope;

use crate::compute::linear::{Linear, Stacked};
use crate::compute::placement::{normalise, Placement};
use crate::compute::spec::ModelSpec;
use crate::compute::weights::{BlockTensor, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::{Module, Tensor};
use candle_nn::RmsNorm;

#[derive(Debug, Clone)]
pub struct Block {
    index: usize,
    placement: Placement,
    attn_norm: RmsNorm,
    attn: Attention,
    ffn_norm: RmsNorm,
    mlp: Mlp,
}

impl Block {
    /// Loads block `index` onto `placement`. `rope` must have been built for the same placement.
    pub fn load(
        source: &dyn WeightSource,
        spec: &ModelSpec,
        index: usize,
        placement: Placement,
        rope: Rope,
    ) -> Result<Self> {
        let p = &placement;
        let (h, q_dim, kv_dim, ff) = (
            spec.hidden_size,
            spec.num_heads * spec.head_dim,
            spec.kv_dim(),
            spec.intermediate_size,
        );
        let get = |t: BlockTensor, expected: &[usize]| -> Result<Weight> {
            let w = source.load_block(index, t, &p.device)?;
            if w.dims() != expected {
                return Err(ModelError::TensorShape {
                    name: format!("block {index} {t:?}"),
                    expected: expected.to_vec(),
                    actual: w.dims(),
                });
            }
            Ok(w)
        };
        let norm = |t: BlockTensor| -> Result<RmsNorm> {
            Ok(RmsNorm::new(get(t, &[h])?.dense(p)?, spec.rms_eps))
        };
        let matmul = |t: BlockTensor, out: usize, inp: usize| -> Result<Linear> {
            get(t, &[out, inp])?.matmul(p)
        };
        Ok(Self {
            index,
            attn_norm: norm(BlockTensor::AttnNorm)?,
            attn: Attention {
                qkv: Stacked::new(vec![
                    matmul(BlockTensor::Q, q_dim, h)?,
                    matmul(BlockTensor::K, kv_dim, h)?,
                    matmul(BlockTensor::V, kv_dim, h)?,
                ])?,
                o: matmul(BlockTensor::O, h, q_dim)?,
                num_heads: spec.num_heads,
                num_kv_heads: spec.num_kv_heads,
                head_dim: spec.head_dim,
                rope,
            },
            ffn_norm: norm(BlockTensor::FfnNorm)?,
            mlp: Mlp {
                gate_up: Stacked::new(vec![
                    matmul(BlockTensor::Gate, ff, h)?,
                    matmul(BlockTensor::Up, ff, h)?,
                ])?,
                down: matmul(BlockTensor::Down, h, ff)?,
            },
            placement,
        })
    }

    pub fn index(&self) -> usize {
        self.index
    }

    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// A fresh, empty KV cache on this block's device and dtype, for at most `max_length` positions.
    pub fn new_cache(&self, max_length: usize) -> KvCache {
        KvCache::new(self.placement.clone(), max_length)
    }

    /// `x`: `[batch, tokens, hidden]` for positions `position..position + tokens`. The input is normalised to this
    /// block's placement first: this is the block boundary where devices and dtypes may change.
    pub fn forward(&self, x: &Tensor, position: usize, cache: &mut KvCache) -> Result<Tensor> {
        let mut out = self.forward_batch(&mut [BlockStep {
            hidden: x.clone(),
            position,
            cache,
        }])?;
        Ok(out.remove(0))
    }

    /// Several sessions' steps at once: their rows go through every projection and the MLP as one matrix; RoPE,
    /// the cache and attention are per session. Returns each step's output, in order; a row's result does not
    /// depend on the other rows.
    pub fn forward_batch(&self, steps: &mut [BlockStep<'_>]) -> Result<Vec<Tensor>> {
        let _span =
            tracing::trace_span!("block", index = self.index, sessions = steps.len()).entered();
        // Rows of every step side by side as one `[1, rows, hidden]` sequence: the shape a lone step has, so
        // quantized matmuls take the same kernels batched or not.
        let mut rows = Vec::with_capacity(steps.len());
        let mut shapes = Vec::with_capacity(steps.len());
        for s in steps.iter() {
            let (b, t, h) = s.hidden.dims3()?;
            rows.push(normalise(&s.hidden, &self.placement)?.reshape((1, b * t, h))?);
            shapes.push((b, t, h));
        }
        let x = if rows.len() == 1 {
            rows.remove(0)
        } else {
            Tensor::cat(&rows, 1)?
        };
        let projected = self.attn.project(&self.attn_norm.forward(&x)?)?;
        let mut attended = Vec::with_capacity(steps.len());
        let mut start = 0;
        for (s, &(b, t, _)) in steps.iter_mut().zip(&shapes) {
            attended.push(
                self.attn
                    .attend(&projected, (start, b, t), s.position, s.cache)?,
            );
            start += b * t;
        }
        let y = if attended.len() == 1 {
            attended.remove(0)
        } else {
            Tensor::cat(&attended, 1)?
        };
        let x = (self.attn.output(&y)? + &x)?;
        let x = (self.mlp.run(&self.ffn_norm.forward(&x)?)? + x)?;
        let mut start = 0;
        shapes
            .into_iter()
            .map(|(b, t, h)| {
                let out = x.narrow(1, start, b * t)?.reshape((b, t, h))?;
                start += b * t;
                Ok(out)
            })
            .collect()
    }
}

/// One session's step through a block: hidden states `[batch, tokens, hidden]` at `position`, and its cache.
pub struct BlockStep<'a> {
    pub hidden: Tensor,
    pub position: usize,
    pub cache: &'a mut KvCache,
}

/// Bytes of working memory one step through one block needs at its peak, beside the weights and the KV cache: for
/// `batch` sequences of `tokens` new positions over a `context` of positions (those new ones included).
///
/// Attention dominates: f32 scores, their masked copy and the probabilities for at most [`attention::QUERY_CHUNK`]
/// query rows per sequence and head at a time, against the whole context, plus the keys and values widened to f32.
/// The MLP's and projections' activations come next. An estimate for admission, not an allocator's count: it is
/// linear in `context` and grows with `tokens` only up to the query chunk.
pub fn step_working_bytes(spec: &ModelSpec, batch: usize, tokens: usize, context: usize) -> u64 {
    let f32_bytes = 4u64;
    let (b, t, c) = (batch as u64, tokens as u64, context as u64);
    let rows = b * spec.num_heads as u64 * t.min(attention::QUERY_CHUNK as u64);
    let scores = 3 * rows * c * f32_bytes;
    let kv_f32 = 2 * b * (spec.num_kv_heads * spec.head_dim) as u64 * c * f32_bytes;
    let per_token = (4 * spec.hidden_size + 3 * spec.intermediate_size) as u64;
    let activations = b * t * per_token * f32_bytes;
    scores + kv_f32 + activations
}
