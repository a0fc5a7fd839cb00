//! Grouped-query self-attention with RoPE, causal over each step's tokens, against a per-session KV cache.
//!
//! The query heads are grouped per KV head, so keys and values are read in place from the cache and never
//! repeated, and queries are taken in chunks, so a step's scores never exceed `chunk x context` per head: memory
//! is linear in the context however long the prompt.
use super::kv_cache::KvCache;
use super::rope::Rope;
use crate::compute::linear::{Linear, Stacked};
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};

/// Query rows scored at once: bounds a step's score memory to this many rows per head.
pub(crate) const QUERY_CHUNK: usize = 256;

/// Queries, keys and values of a step's rows, before RoPE: `[1, rows, heads * head_dim]` and `[1, rows, kv_dim]`.
pub(crate) struct Projected {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// Queries, keys and values, in that order.
    pub(crate) qkv: Stacked,
    pub(crate) o: Linear,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rope: Rope,
}

impl Attention {
    /// Queries, keys and values for the rows of `x` (`[1, rows, hidden]`: the tokens of one or several sessions).
    pub(crate) fn project(&self, x: &Tensor) -> Result<Projected> {
        let mut parts = self.qkv.forward(x)?.into_iter();
        let mut next = || {
            parts
                .next()
                .ok_or_else(|| ModelError::Config("query/key/value projection lost a part".into()))
        };
        Ok(Projected {
            q: next()?,
            k: next()?,
            v: next()?,
        })
    }

    /// One session's attention: `rows` are its `batch x tokens` rows of `p` (`start` the first), at positions
    /// `position..position + tokens`; its keys and values are written into `cache`. Returns `[1, rows, heads *
    /// head_dim]`, to go through [`Attention::output`] with the other sessions' rows.
    pub(crate) fn attend(
        &self,
        p: &Projected,
        (start, batch, tokens): (usize, usize, usize),
        position: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let heads = |x: &Tensor, n: usize| -> Result<Tensor> {
            Ok(x.narrow(1, start, batch * tokens)?
                .reshape((batch, tokens, n, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = self.rope.apply(&heads(&p.q, self.num_heads)?, position)?;
        let k = self
            .rope
            .apply(&heads(&p.k, self.num_kv_heads)?, position)?;
        cache.append(&k, &heads(&p.v, self.num_kv_heads)?)?;
        let y = self.attend_grouped(&q, position, cache)?;
        Ok(y.reshape((1, batch * tokens, self.num_heads * self.head_dim))?)
    }

    /// The output projection of every session's attention rows at once.
    pub(crate) fn output(&self, y: &Tensor) -> Result<Tensor> {
        self.o.forward(y)
    }

    /// Candle ops on any device and dtype: `[batch, kv_heads, group * tokens, head_dim]` queries against each KV
    /// head's keys, scores and softmax in f32 (long contexts overflow half precision).
    fn attend_grouped(&self, q: &Tensor, position: usize, cache: &KvCache) -> Result<Tensor> {
        let (b, h, t, d) = q.dims4()?;
        let group = h / self.num_kv_heads;
        let (k, v) = cache.keys_values().ok_or_else(empty_cache)?;
        // Views into the cache's buffers (f32 caches are not copied): matmuls take their strides as they are.
        let k = k.to_dtype(DType::F32)?;
        let v = v.to_dtype(DType::F32)?;
        let kt = k.t()?;
        let context = k.dim(2)?;
        let q = q
            .to_dtype(DType::F32)?
            .reshape((b, self.num_kv_heads, group, t, d))?;
        let scale = 1.0 / (d as f64).sqrt();
        let mut chunks = Vec::with_capacity(t.div_ceil(QUERY_CHUNK));
        for start in (0..t).step_by(QUERY_CHUNK) {
            let n = QUERY_CHUNK.min(t - start);
            // A whole step in one chunk (every decode step) needs no copy of its queries.
            let qc = if n == t {
                q.clone()
            } else {
                q.narrow(3, start, n)?.contiguous()?
            };
            let qc = qc.reshape((b, self.num_kv_heads, group * n, d))?;
            let scores = (qc.matmul(&kt)? * scale)?;
            let scores = if t > 1 {
                // Query `start + i` sees keys up to `position + start + i`.
                let mask = causal_mask(n, position + start, context, scores.device())?
                    .unsqueeze(0)?
                    .broadcast_as((group, n, context))?
                    .reshape((group * n, context))?
                    .broadcast_as(scores.shape())?;
                let neg_inf = Tensor::new(f32::NEG_INFINITY, scores.device())?
                    .broadcast_as(scores.shape())?;
                mask.where_cond(&neg_inf, &scores)?
            } else {
                scores
            };
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            chunks.push(
                probs
                    .matmul(&v)?
                    .reshape((b, self.num_kv_heads, group, n, d))?,
            );
        }
        let y = match chunks.len() {
            1 => chunks.remove(0),
            _ => Tensor::cat(&chunks, 3)?,
        }
        .reshape((b, h, t, d))?;
        // One token per sequence: `[b, h, 1, d]` is already laid out as `[b, 1, h * d]`.
        let y = if t == 1 {
            y.reshape((b, t, h * d))?
        } else {
            y.transpose(1, 2)?.reshape((b, t, h * d))?
        };
        Ok(y.to_dtype(cache.placement().dtype)?)
    }
}

/// `[rows, context]`, 1 where query `i` (at position `first + i`) must not see key `j`.
fn causal_mask(rows: usize, first: usize, context: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<u8> = (0..rows)
        .flat_map(|i| (0..context).map(move |j| u8::from(j > first + i)))
        .collect();
    Ok(Tensor::from_slice(&mask, (rows, context), device)?)
}

fn empty_cache() -> ModelError {
    ModelError::Config("attention over an empty KV cache".into())
}
