//! Grouped-query self-attention with RoPE, a causal mask for multi-token steps, and a per-session KV cache.
use super::kv_cache::KvCache;
use super::rope::Rope;
use crate::error::Result;
use candle_core::quantized::QMatMul;
use candle_core::{DType, Module, Tensor};

#[derive(Debug, Clone)]
pub struct Attention {
    pub(crate) q: QMatMul,
    pub(crate) k: QMatMul,
    pub(crate) v: QMatMul,
    pub(crate) o: QMatMul,
    pub(crate) num_heads: usize,
    pub(crate) num_kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) rope: Rope,
}

impl Attention {
    /// `x`: `[batch, tokens, hidden]` for positions `position..position + tokens`.
    pub fn forward(&self, x: &Tensor, position: usize, cache: &mut KvCache) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let heads = |w: &QMatMul, n: usize| -> Result<Tensor> {
            Ok(w.forward(x)?
                .reshape((b, t, n, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let q = self
            .rope
            .apply(&heads(&self.q, self.num_heads)?, position)?;
        let k = self
            .rope
            .apply(&heads(&self.k, self.num_kv_heads)?, position)?;
        let v = heads(&self.v, self.num_kv_heads)?;
        let (k, v) = cache.append(&k, &v)?;

        let n_rep = self.num_heads / self.num_kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, n_rep)?;
        let v = candle_transformers::utils::repeat_kv(v, n_rep)?;
        // Scores and softmax in f32 even for f16/bf16 blocks: long contexts overflow half precision.
        let in_dtype = q.dtype();
        let (q, k, v) = (
            q.to_dtype(DType::F32)?,
            k.to_dtype(DType::F32)?,
            v.to_dtype(DType::F32)?,
        );
        let scores = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
        let scores = if t > 1 {
            let mask = candle_transformers::utils::build_causal_mask(t, position, scores.device())?
                .broadcast_as(scores.shape())?;
            let neg_inf =
                Tensor::new(f32::NEG_INFINITY, scores.device())?.broadcast_as(scores.shape())?;
            mask.where_cond(&neg_inf, &scores)?
        } else {
            scores
        };
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let y = probs.matmul(&v.contiguous()?)?.to_dtype(in_dtype)?;
        let y = y
            .transpose(1, 2)?
            .reshape((b, t, self.num_heads * self.head_dim))?;
        Ok(self.o.forward(&y)?)
    }
}
