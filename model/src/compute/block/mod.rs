//! One Llama-family decoder block: pre-norm attention and pre-norm SwiGLU MLP, each with a residual.
mod attention;
mod kv_cache;
mod mlp;
mod rope;

pub use attention::Attention;
pub use kv_cache::KvCache;
pub use mlp::Mlp;
pub use rope::Rope;

use crate::compute::placement::{normalise, Placement};
use crate::compute::spec::ModelSpec;
use crate::compute::weights::{BlockTensor, Weight, WeightSource};
use crate::error::{ModelError, Result};
use candle_core::quantized::QMatMul;
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
        let matmul = |t: BlockTensor, out: usize, inp: usize| -> Result<QMatMul> {
            get(t, &[out, inp])?.matmul(p)
        };
        Ok(Self {
            index,
            attn_norm: norm(BlockTensor::AttnNorm)?,
            attn: Attention {
                q: matmul(BlockTensor::Q, q_dim, h)?,
                k: matmul(BlockTensor::K, kv_dim, h)?,
                v: matmul(BlockTensor::V, kv_dim, h)?,
                o: matmul(BlockTensor::O, h, q_dim)?,
                num_heads: spec.num_heads,
                num_kv_heads: spec.num_kv_heads,
                head_dim: spec.head_dim,
                rope,
            },
            ffn_norm: norm(BlockTensor::FfnNorm)?,
            mlp: Mlp {
                gate: matmul(BlockTensor::Gate, ff, h)?,
                up: matmul(BlockTensor::Up, ff, h)?,
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

    /// A fresh, empty KV cache on this block's device and dtype.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.placement.clone())
    }

    /// `x`: `[batch, tokens, hidden]` for positions `position..position + tokens`. The input is normalised to this
    /// block's placement first: this is the block boundary where devices and dtypes may change.
    pub fn forward(&self, x: &Tensor, position: usize, cache: &mut KvCache) -> Result<Tensor> {
        let _span = tracing::trace_span!("block", index = self.index).entered();
        let x = normalise(x, &self.placement)?;
        let h = self
            .attn
            .forward(&self.attn_norm.forward(&x)?, position, cache)?;
        let x = (h + &x)?;
        let h = self.mlp.run(&self.ffn_norm.forward(&x)?)?;
        Ok((h + x)?)
    }
}
