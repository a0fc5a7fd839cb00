//! Rotary position embeddings: cos/sin tables built once per placement, applied with candle's fused kernels.
use crate::compute::placement::Placement;
use crate::compute::spec::{ModelSpec, RopeStyle};
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};

#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
    max_position: usize,
}

impl Rope {
    pub fn new(spec: &ModelSpec, p: &Placement) -> Result<Self> {
        let inv_freq = inverse_frequencies(spec);
        let n = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, n), &p.device)?;
        let positions = Tensor::arange(0u32, spec.max_position as u32, &p.device)?
            .to_dtype(DType::F32)?
            .reshape((spec.max_position, 1))?;
        // Angles in f32, then cast: the tables are as exact as the dtype allows.
        let angles = positions.matmul(&inv_freq)?;
        Ok(Self {
            cos: angles.cos()?.to_dtype(p.dtype)?,
            sin: angles.sin()?.to_dtype(p.dtype)?,
            style: spec.rope_style,
            max_position: spec.max_position,
        })
    }

    /// Rotates `x` of shape `[batch, heads, tokens, head_dim]` for positions `position..position + tokens`.
    pub fn apply(&self, x: &Tensor, position: usize) -> Result<Tensor> {
        let (_, _, tokens, _) = x.dims4()?;
        if position + tokens > self.max_position {
            return Err(ModelError::TooLong {
                position,
                tokens,
                max_length: self.max_position,
            });
        }
        let cos = self.cos.narrow(0, position, tokens)?;
        let sin = self.sin.narrow(0, position, tokens)?;
        let x = x.contiguous()?;
        Ok(match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
        })
    }
}

/// Per-pair inverse frequencies, with Llama 3 scaling when the config asks for it.
fn inverse_frequencies(spec: &ModelSpec) -> Vec<f32> {
    let d = spec.head_dim;
    let base: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / spec.rope_theta.powf(i as f32 / d as f32))
        .collect();
    let Some(s) = spec.rope_scaling else {
        return base;
    };
    let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor;
    base.into_iter()
        .map(|freq| {
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                freq
            } else if wavelen > low_wavelen {
                freq / s.factor
            } else {
                let smooth = (s.original_max_position_embeddings as f32 / wavelen
                    - s.low_freq_factor)
                    / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * freq / s.factor + smooth * freq
            }
        })
        .collect()
}
