//! Grouped-query self-attention with RoPE, causal over each step's tokens, against a per-session KV cache.
//!
//! The query heads are grouped per KV head, so keys and values are read in place from the cache and never
//! repeated, and queries are taken in chunks, so a step's scores never exceed `chunk x context` per head: memory
//! is linear in the context however long the prompt.
use super::flash_attention::FlashAttention;
use super::kv_cache::KvCache;
use super::rope::Rope;
use crate::compute::linear::{Linear, Stacked};
use crate::compute::rms_norm::RmsNorm;
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor};

/// Query rows scored at once: bounds a step's score memory to this many rows per head.
pub(crate) const QUERY_CHUNK: usize = 256;

/// Queries, keys and values of a step's rows, before RoPE: `[1, rows, heads * head_dim]` and `[1, rows, kv_dim]`.
pub(crate) struct Projected {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

/// One session's rows of a step's projections: `batch x tokens` rows from `start`, at positions `position..position
/// + tokens`, with its cache.
pub(crate) struct SessionRows<'a> {
    pub start: usize,
    pub batch: usize,
    pub tokens: usize,
    pub position: usize,
    pub cache: &'a mut KvCache,
}

#[derive(Debug, Clone)]
pub struct Attention {
    /// Queries, keys and values, in that order.
    pub(crate) qkv: Stacked,
    /// Their biases (Qwen2).
    pub(crate) qkv_bias: Option<[Tensor; 3]>,
    /// RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3).
    pub(crate) qk_norm: Option<[RmsNorm; 2]>,
    pub(crate) o: Linear,
    /// The output projection's bias (gpt-oss).
    pub(crate) o_bias: Option<Tensor>,
    /// One logit per query head that joins its softmax with no value (gpt-oss): `[heads]`, f32.
    pub(crate) sinks: Option<Sinks>,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    /// Multiplies the scores: `1/sqrt(head_dim)` unless the family says otherwise.
    pub(crate) scale: f64,
    /// `cap * tanh(scores / cap)` before the softmax (Gemma 2).
    pub(crate) softcap: Option<f64>,
    /// Keys at most this many positions back (the query's own included) are seen; `None`: all.
    pub(crate) window: Option<usize>,
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
        let (mut q, mut k, mut v) = (next()?, next()?, next()?);
        if let Some([bq, bk, bv]) = &self.qkv_bias {
            q = q.broadcast_add(bq)?;
            k = k.broadcast_add(bk)?;
            v = v.broadcast_add(bv)?;
        }
        Ok(Projected { q, k, v })
    }

    /// Every session's attention (`sessions` in the order of their rows): `[1, rows, heads * head_dim]`, to go
    /// through [`Attention::output`]. On the CPU with f16 caches, all sessions at once
    /// ([`super::host_attention`]); on other devices, several sessions' one-token steps in one call
    /// ([`super::decode_attention`]); otherwise one after another.
    pub(crate) fn attend_all(
        &self,
        p: &Projected,
        sessions: &mut [SessionRows<'_>],
    ) -> Result<Tensor> {
        if let Some(y) = super::host_attention::attend(self, p, sessions)? {
            return Ok(y);
        }
        if super::decode_attention::applies(p, sessions) {
            if let Some(y) = super::decode_attention::attend(self, p, sessions)? {
                return Ok(y);
            }
        }
        let mut attended = sessions
            .iter_mut()
            .map(|s| self.attend(p, (s.start, s.batch, s.tokens), s.position, s.cache))
            .collect::<Result<Vec<_>>>()?;
        Ok(if attended.len() == 1 {
            attended.remove(0)
        } else {
            Tensor::cat(&attended, 1)?
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
        let (mut q, mut k) = (
            heads(&p.q, self.num_heads)?,
            heads(&p.k, self.num_kv_heads)?,
        );
        if let Some([qn, kn]) = &self.qk_norm {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = self.rope.apply(&q, position)?;
        let k = self.rope.apply(&k, position)?;
        cache.append(&k, &heads(&p.v, self.num_kv_heads)?)?;
        let y = self.attend_grouped(&q, position, cache)?;
        Ok(y.reshape((1, batch * tokens, self.num_heads * self.head_dim))?)
    }

    /// The in-place kernel's parameters for a step at `position`.
    pub(crate) fn flash(&self, position: usize) -> FlashAttention {
        FlashAttention {
            scale: self.scale as f32,
            softcap: self.softcap.map(|c| c as f32),
            window: self.window,
            position,
            group: self.num_heads / self.num_kv_heads,
            sinks: self.sinks.as_ref().map(|s| s.values.clone()),
        }
    }

    /// The keys `first..last` (of `context` held) that any of `queries` queries from position `first_query` on may
    /// see: none after the last query, none before the first query's window.
    pub(crate) fn visible_keys(
        &self,
        first_query: usize,
        queries: usize,
        context: usize,
    ) -> (usize, usize) {
        self.scoring().visible_keys(first_query, queries, context)
    }

    /// How this layer's scores are scaled, capped and windowed.
    pub(crate) fn scoring(&self) -> Scoring<'_> {
        Scoring {
            kv_heads: self.num_kv_heads,
            scale: self.scale,
            softcap: self.softcap,
            window: self.window,
            sinks: self.sinks.as_ref().map(|s| &s.tensor),
        }
    }

    /// The output projection of every session's attention rows at once.
    pub(crate) fn output(&self, y: &Tensor) -> Result<Tensor> {
        let y = self.o.forward(y)?;
        Ok(match &self.o_bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `[batch, heads, tokens, head_dim]` queries against the cache, grouped per KV head: on an f16 CPU cache
    /// through [`FlashAttention`] (the cache read in place), anything else through candle's ops.
    /// Returns `[batch, tokens, heads * head_dim]` in the queries' dtype.
    fn attend_grouped(&self, q: &Tensor, position: usize, cache: &KvCache) -> Result<Tensor> {
        let (b, h, t, d) = q.dims4()?;
        let group = h / self.num_kv_heads;
        let (k, v) = cache.keys_values().ok_or_else(empty_cache)?;
        // f32 caches stay on candle's ops, whose arithmetic is the reference's bit for bit (a quantized model
        // requantizes every activation, so any other rounding moves its logits visibly); f16 caches have no
        // reference and are read in place, half the bytes of f32.
        let in_place = q.device().is_cpu() && cache.placement().dtype == DType::F16;
        let y = if in_place {
            let op = self.flash(position);
            let q = q.to_dtype(DType::F32)?.contiguous()?.reshape((
                b,
                self.num_kv_heads,
                group,
                t,
                d,
            ))?;
            q.apply_op3_no_bwd(&k, &v, &op)?.reshape((b, h, t, d))?
        } else {
            attend_chunked(q, position, (k, v), self.scoring())?
        };
        // One token per sequence: `[b, h, 1, d]` is already laid out as `[b, 1, h * d]`.
        let y = if t == 1 {
            y.reshape((b, t, h * d))?
        } else {
            y.transpose(1, 2)?.reshape((b, t, h * d))?
        };
        Ok(y.to_dtype(q.dtype())?)
    }
}

/// Attention sinks (gpt-oss): per query head, a logit that joins the softmax over its keys and takes weight from
/// them without adding a value, as the tensor the candle path concatenates and the values the host kernel reads.
#[derive(Debug, Clone)]
pub(crate) struct Sinks {
    /// `[heads]`, f32, on the block's device.
    pub tensor: Tensor,
    pub values: std::sync::Arc<[f32]>,
}

impl Sinks {
    pub(crate) fn new(tensor: &Tensor) -> Result<Self> {
        let tensor = tensor.to_dtype(DType::F32)?;
        let values = tensor.to_vec1::<f32>()?.into();
        Ok(Self { tensor, values })
    }

    /// `[1, kv_heads, group * rows, 1]` for scores `[b, kv_heads, group * rows, keys]` (query head `k * group + g`
    /// at rows `g * rows..(g + 1) * rows` of KV head `k`).
    pub(crate) fn column(tensor: &Tensor, kv_heads: usize, rows: usize) -> Result<Tensor> {
        let group = tensor.dim(0)? / kv_heads;
        Ok(tensor
            .reshape((1, kv_heads, group, 1))?
            .broadcast_as((1, kv_heads, group, rows))?
            .reshape((1, kv_heads, group * rows, 1))?)
    }

    /// The softmax of `scores` (f32, keys last) with `column` (each score row's sink, broadcast to the scores'
    /// shape but one wide) as one more key, which is dropped after: the keys' weights sum to less than one.
    pub(crate) fn softmax(scores: &Tensor, column: &Tensor) -> Result<Tensor> {
        let mut dims = scores.dims().to_vec();
        let last = dims.len() - 1;
        let keys = std::mem::replace(&mut dims[last], 1);
        let column = column.broadcast_as(dims)?;
        let all = Tensor::cat(&[scores, &column], last)?.contiguous()?;
        let probs = candle_nn::ops::softmax_last_dim(&all)?;
        Ok(probs.narrow(last, 0, keys)?)
    }
}

/// What turns a query's products with the keys into attention weights: which KV head a query head reads, the scale,
/// the cap, the window and the sinks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scoring<'a> {
    pub kv_heads: usize,
    /// Multiplies the scores.
    pub scale: f64,
    /// `cap * tanh(scores / cap)` before the softmax.
    pub softcap: Option<f64>,
    /// Keys at most this many positions back (the query's own included) are seen; `None`: all.
    pub window: Option<usize>,
    /// [`Sinks::tensor`], `[heads]`.
    pub sinks: Option<&'a Tensor>,
}

impl Scoring<'_> {
    /// The keys `first..last` (of `context` held) that any of `queries` queries from position `first_query` on may
    /// see: none after the last query, none before the first query's window.
    pub(crate) fn visible_keys(
        &self,
        first_query: usize,
        queries: usize,
        context: usize,
    ) -> (usize, usize) {
        let last = (first_query + queries).min(context);
        let first = match self.window {
            Some(w) => (first_query + 1).saturating_sub(w).min(last),
            None => 0,
        };
        (first, last)
    }
}

/// Candle ops on any device and dtype, for prompts and caches the in-place kernel does not take: queries in
/// chunks of [`QUERY_CHUNK`] rows against each KV head's keys, scores and softmax in f32. Queries `[b, h, t,
/// d]`, keys `[b, kv_heads, context, d]`, values `[b, kv_heads, context, dv]`; returns `[b, h, t, dv]`.
pub(crate) fn attend_chunked(
    q: &Tensor,
    position: usize,
    (k, v): (Tensor, Tensor),
    scoring: Scoring<'_>,
) -> Result<Tensor> {
    let (b, h, t, d) = q.dims4()?;
    let dv = v.dim(3)?;
    let group = h / scoring.kv_heads;
    // Views into the cache's buffers (f32 caches are not copied): matmuls take their strides as they are.
    let k = k.to_dtype(DType::F32)?;
    let v = v.to_dtype(DType::F32)?;
    let context = k.dim(2)?;
    let q = q
        .to_dtype(DType::F32)?
        .reshape((b, scoring.kv_heads, group, t, d))?;
    let mut chunks = Vec::with_capacity(t.div_ceil(QUERY_CHUNK));
    for start in (0..t).step_by(QUERY_CHUNK) {
        let n = QUERY_CHUNK.min(t - start);
        // A whole step in one chunk (every decode step) needs no copy of its queries.
        let qc = if n == t {
            q.clone()
        } else {
            q.narrow(3, start, n)?.contiguous()?
        };
        let qc = qc.reshape((b, scoring.kv_heads, group * n, d))?;
        // Keys before the chunk's first query's window, and after its last query, are never seen by any of
        // its queries: leave them out (a prompt's chunks score about half of the `T x T` pairs, not all).
        let first_query = position + start;
        let (first_key, last_key) = scoring.visible_keys(first_query, n, context);
        let keys = last_key - first_key;
        let (kc, vc) = if keys == context {
            (k.clone(), v.clone())
        } else {
            (k.narrow(2, first_key, keys)?, v.narrow(2, first_key, keys)?)
        };
        let scores = (qc.matmul(&kc.t()?)? * scoring.scale)?;
        let scores = match scoring.softcap {
            Some(cap) => ((scores / cap)?.tanh()? * cap)?,
            None => scores,
        };
        let scores = if n > 1 {
            let mask = attention_mask(
                n,
                first_query,
                first_key,
                keys,
                scoring.window,
                scores.device(),
            )?
            .unsqueeze(0)?
            .broadcast_as((group, n, keys))?
            .reshape((group * n, keys))?
            .broadcast_as(scores.shape())?;
            let neg_inf =
                Tensor::new(f32::NEG_INFINITY, scores.device())?.broadcast_as(scores.shape())?;
            mask.where_cond(&neg_inf, &scores)?
        } else {
            scores
        };
        let probs = match scoring.sinks {
            Some(sinks) => Sinks::softmax(&scores, &Sinks::column(sinks, scoring.kv_heads, n)?)?,
            None => candle_nn::ops::softmax_last_dim(&scores)?,
        };
        chunks.push(
            probs
                .matmul(&vc)?
                .reshape((b, scoring.kv_heads, group, n, dv))?,
        );
    }
    Ok(match chunks.len() {
        1 => chunks.remove(0),
        _ => Tensor::cat(&chunks, 3)?,
    }
    .reshape((b, h, t, dv))?)
}

/// `[rows, keys]`, 1 where query `i` (at position `first_query + i`) must not see key `j` (at position
/// `first_key + j`): a later key, or one outside the window.
fn attention_mask(
    rows: usize,
    first_query: usize,
    first_key: usize,
    keys: usize,
    window: Option<usize>,
    device: &Device,
) -> Result<Tensor> {
    let mask: Vec<u8> = (0..rows)
        .flat_map(|i| {
            let query = first_query + i;
            (0..keys).map(move |j| {
                let key = first_key + j;
                u8::from(key > query || window.is_some_and(|w| query - key >= w))
            })
        })
        .collect();
    Ok(Tensor::from_slice(&mask, (rows, keys), device)?)
}

fn empty_cache() -> ModelError {
    ModelError::Config("attention over an empty KV cache".into())
}
