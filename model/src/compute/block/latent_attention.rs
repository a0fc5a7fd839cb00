//! Multi-head latent attention (DeepSeek-V2/V3), with the cache holding only the compressed latent.
//!
//! Every head's key and value are expansions of one latent `c` of `kv_rank` values per position (plus `rope_dim`
//! rotated key values shared by all heads), so the cache keeps `[c ; k_rope]` and nothing per head: 576 values a
//! position for DeepSeek-V3, where its 128 heads' keys and values would be 40,960. Attention runs in the latent
//! ("absorbed"): each head's non-rotated query is multiplied into the latent by that head's key expansion, scored
//! against `[c ; k_rope]` of every position as one shared KV head, and the weighted sum of latents is expanded to the
//! head's value only after the softmax, one small matmul per step rather than per cached position.
use super::attention::{attend_chunked, Scoring, SessionRows};
use super::rope::Rope;
use crate::compute::linear::Linear;
use crate::compute::rms_norm::RmsNorm;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor, D};

/// The query projection: one matrix, or a low-rank pair with a norm between.
#[derive(Debug, Clone)]
pub enum QueryProjection {
    Full(Linear),
    LowRank {
        down: Linear,
        norm: RmsNorm,
        up: Linear,
    },
}

impl QueryProjection {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(q) => q.forward(x),
            Self::LowRank { down, norm, up } => up.forward(&norm.forward(&down.forward(x)?)?),
        }
    }
}

#[derive(Debug, Clone)]
pub struct LatentAttention {
    pub(crate) q: QueryProjection,
    /// `hidden -> kv_rank + rope_dim`: the latent and the shared key part that RoPE rotates.
    pub(crate) kv_down: Linear,
    pub(crate) kv_norm: RmsNorm,
    /// Each head's expansion of the latent to its key's non-rotated part, `[heads, nope_dim, kv_rank]`, and to its
    /// value, `[heads, value_dim, kv_rank]`, in the block's dtype.
    pub(crate) key_up: Tensor,
    pub(crate) value_up: Tensor,
    pub(crate) o: Linear,
    pub(crate) num_heads: usize,
    pub(crate) kv_rank: usize,
    pub(crate) nope_dim: usize,
    pub(crate) rope_dim: usize,
    pub(crate) value_dim: usize,
    /// `1/sqrt(nope_dim + rope_dim)`, times YaRN's temperature squared.
    pub(crate) scale: f64,
    pub(crate) rope: Rope,
}

impl LatentAttention {
    /// `kv_up`: the files' `[heads * (nope_dim + value_dim), kv_rank]` expansion, split here per head.
    pub(crate) fn split_expansion(
        kv_up: &Tensor,
        heads: usize,
        nope_dim: usize,
        value_dim: usize,
    ) -> Result<(Tensor, Tensor)> {
        let rank = kv_up.dim(1)?;
        let w = kv_up.reshape((heads, nope_dim + value_dim, rank))?;
        Ok((
            w.narrow(1, 0, nope_dim)?.contiguous()?,
            w.narrow(1, nope_dim, value_dim)?.contiguous()?,
        ))
    }

    /// The cache's KV heads and the width of each of its halves: one latent of `kv_rank + rope_dim`, split in two.
    pub(crate) fn cache_shape(&self) -> (usize, usize) {
        (1, (self.kv_rank + self.rope_dim) / 2)
    }

    /// One new position per sequence against the cache's two halves as they are (`[b, 1, context, half]` each, the
    /// latent's first half and its rest): the query is split the same way, so no copy joins the halves, and the
    /// weighted latent is the probabilities times the first half, then times the second's first `rank - half`
    /// values. Queries `[b, h, 1, kv_rank + rope_dim]`; returns `[b, h, 1, kv_rank]` in f32.
    fn attend_one(&self, q: &Tensor, first: &Tensor, second: &Tensor) -> Result<Tensor> {
        let (b, h, _, width) = q.dims4()?;
        let half = width / 2;
        let first = first.to_dtype(DType::F32)?;
        let second = second.to_dtype(DType::F32)?;
        // All heads of a sequence as the rows of one matrix against its one latent "head".
        let q = q.to_dtype(DType::F32)?.reshape((b, 1, h, width))?;
        let (q1, q2) = (
            q.narrow(3, 0, half)?.contiguous()?,
            q.narrow(3, half, half)?.contiguous()?,
        );
        let scores = ((q1.matmul(&first.t()?)? + q2.matmul(&second.t()?)?)? * self.scale)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let rest = self.kv_rank - half;
        let y = Tensor::cat(
            &[
                probs.matmul(&first)?,
                probs.matmul(&second.narrow(3, 0, rest)?.contiguous()?)?,
            ],
            D::Minus1,
        )?;
        Ok(y.reshape((b, h, 1, self.kv_rank))?)
    }

    /// Every session's attention and the output projection, for the normed rows `x` (`[1, rows, hidden]`).
    pub(crate) fn forward(&self, x: &Tensor, sessions: &mut [SessionRows<'_>]) -> Result<Tensor> {
        let q = self.q.forward(x)?;
        let kv = self.kv_down.forward(x)?;
        let mut attended = sessions
            .iter_mut()
            .map(|s| self.attend(&q, &kv, s))
            .collect::<Result<Vec<_>>>()?;
        let y = if attended.len() == 1 {
            attended.remove(0)
        } else {
            Tensor::cat(&attended, 1)?
        };
        self.o.forward(&y)
    }

    /// One session's rows: its latents appended to its cache, its heads' attention in the latent, expanded to
    /// values. Returns `[1, rows, heads * value_dim]`.
    fn attend(&self, q: &Tensor, kv: &Tensor, s: &mut SessionRows<'_>) -> Result<Tensor> {
        let (b, t, h) = (s.batch, s.tokens, self.num_heads);
        let (rank, rope, nope) = (self.kv_rank, self.rope_dim, self.nope_dim);
        let rows = b * t;
        let q = q
            .narrow(1, s.start, rows)?
            .reshape((b, t, h, nope + rope))?
            .transpose(1, 2)?;
        let q_rope = self
            .rope
            .apply(&q.narrow(3, nope, rope)?.contiguous()?, s.position)?;
        // `[h, rows, nope] x [h, nope, rank]`: each head's query moved into the latent.
        let q_latent = q
            .narrow(3, 0, nope)?
            .transpose(0, 1)?
            .reshape((h, rows, nope))?
            .matmul(&self.key_up)?
            .reshape((h, b, t, rank))?
            .transpose(0, 1)?;
        let q = Tensor::cat(&[&q_latent, &q_rope], D::Minus1)?.contiguous()?;

        let kv = kv.narrow(1, s.start, rows)?.reshape((b, t, rank + rope))?;
        let latent = self
            .kv_norm
            .forward(&kv.narrow(2, 0, rank)?.contiguous()?)?;
        let k_rope = self.rope.apply(
            &kv.narrow(2, rank, rope)?.reshape((b, 1, t, rope))?,
            s.position,
        )?;
        let entry = Tensor::cat(&[&latent.unsqueeze(1)?, &k_rope], D::Minus1)?;
        let (_, half) = self.cache_shape();
        s.cache
            .append(&entry.narrow(3, 0, half)?, &entry.narrow(3, half, half)?)?;
        let (first, second) = s
            .cache
            .keys_values()
            .ok_or_else(|| ModelError::Config("latent attention over an empty cache".into()))?;
        // `[b, h, t, rank]`: each head's weighted latent, then its value.
        let y = if t == 1 && rank >= half {
            self.attend_one(&q, &first, &second)?
        } else {
            let keys = Tensor::cat(&[&first, &second], D::Minus1)?;
            let values = keys.narrow(3, 0, rank)?;
            let scoring = Scoring {
                kv_heads: 1,
                scale: self.scale,
                softcap: None,
                window: None,
                sinks: None,
            };
            attend_chunked(&q, s.position, (keys, values), scoring)?
        };
        let y = y
            .to_dtype(self.value_up.dtype())?
            .transpose(0, 1)?
            .reshape((h, rows, rank))?
            .matmul(&self.value_up.t()?)?
            .reshape((h, b, t, self.value_dim))?
            .permute((1, 2, 0, 3))?
            .reshape((1, rows, h * self.value_dim))?;
        Ok(y)
    }
}
