//! Rotary position embeddings: cos/sin tables built once per placement, applied with candle's fused kernels.
use crate::compute::family::Yarn;
use crate::compute::placement::Placement;
use crate::compute::spec::{ModelSpec, RopeStyle};
use crate::error::{ModelError, Result};
use candle_core::{CpuStorage, DType, Storage, StorageRef, Tensor};

#[derive(Debug, Clone)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    style: RopeStyle,
    max_position: usize,
}

/// What a layer's RoPE table depends on besides the model: its base and its linear scaling. Layers with equal
/// parameters on one placement share a table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeParams {
    pub theta: f32,
    pub linear_factor: Option<f32>,
}

impl RopeParams {
    /// Layer `layer`'s parameters: Gemma 3's windowed layers have their own base and no scaling.
    pub fn for_layer(spec: &ModelSpec, layer: usize) -> Self {
        let o = &spec.options;
        match (spec.window(layer), o.local_rope_theta) {
            (Some(_), Some(theta)) => Self {
                theta,
                linear_factor: None,
            },
            _ => Self {
                theta: spec.rope_theta,
                linear_factor: o.rope_linear_factor,
            },
        }
    }
}

impl Rope {
    /// The table of a model's layers when they all share one (every family but Gemma 3).
    pub fn new(spec: &ModelSpec, p: &Placement) -> Result<Self> {
        Self::with_params(spec, p, RopeParams::for_layer(spec, 0))
    }

    /// The table of layer `layer`.
    pub fn for_layer(spec: &ModelSpec, p: &Placement, layer: usize) -> Result<Self> {
        Self::with_params(spec, p, RopeParams::for_layer(spec, layer))
    }

    pub fn with_params(spec: &ModelSpec, p: &Placement, params: RopeParams) -> Result<Self> {
        let inv_freq = inverse_frequencies(spec, params);
        let n = inv_freq.len();
        let inv_freq = Tensor::from_vec(inv_freq, (1, n), &p.device)?;
        let positions = Tensor::arange(0u32, spec.max_position as u32, &p.device)?
            .to_dtype(DType::F32)?
            .reshape((spec.max_position, 1))?;
        // Angles in f32, then cast: the tables are as exact as the dtype allows.
        let angles = positions.matmul(&inv_freq)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        // YaRN scales the tables by its magnitude ratio (1 when `mscale` equals `mscale_all_dim`).
        let (cos, sin) = match spec.options.yarn.filter(|_| params.linear_factor.is_none()) {
            Some(y) => {
                let m = (y.get_mscale(y.mscale) / y.get_mscale(y.mscale_all_dim)) as f64;
                ((cos * m)?, (sin * m)?)
            }
            None => (cos, sin),
        };
        Ok(Self {
            cos: cos.to_dtype(p.dtype)?,
            sin: sin.to_dtype(p.dtype)?,
            style: spec.rope_style,
            max_position: spec.max_position,
        })
    }

    /// Rotates each of `xs` (`[sequences, heads, 1, head_dim]`, one token per sequence, sequence `i` at
    /// `positions[i]`; queries and keys, say): one gather of the tables' rows serves them all, and each is one
    /// rotation, with the same arithmetic per element as [`Self::apply`] on each sequence alone.
    pub fn apply_each(&self, xs: &[&Tensor], positions: &[usize]) -> Result<Vec<Tensor>> {
        if let Some(&position) = positions.iter().find(|&&p| p >= self.max_position) {
            return Err(ModelError::TooLong {
                position,
                tokens: 1,
                max_length: self.max_position,
            });
        }
        let sequences = positions.len();
        let half = self.cos.dim(1)?;
        let rows: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
        let rows = Tensor::from_vec(rows, sequences, self.cos.device())?;
        // `[sequences, 1, head_dim / 2]`: candle's kernels take one table per sequence.
        let table = |t: &Tensor| -> Result<Tensor> {
            Ok(t.index_select(&rows, 0)?.reshape((sequences, 1, half))?)
        };
        let (cos, sin) = (table(&self.cos)?, table(&self.sin)?);
        xs.iter()
            .map(|x| {
                let (n, heads, tokens, head_dim) = x.dims4()?;
                if (n, tokens, head_dim) != (sequences, 1, 2 * half) {
                    return Err(ModelError::TensorShape {
                        name: "rotated rows".into(),
                        expected: vec![sequences, heads, 1, 2 * half],
                        actual: x.dims().to_vec(),
                    });
                }
                self.rotate(x, &cos, &sin)
            })
            .collect()
    }

    /// The tables read in place, when they are f32 on the CPU and laid out from their start (they always are when
    /// built there); `None` otherwise.
    pub(crate) fn host(&self) -> Option<HostRope<'_>> {
        let (cos, cl) = self.cos.storage_and_layout();
        let (sin, sl) = self.sin.storage_and_layout();
        let from_start =
            |l: &candle_core::Layout| l.contiguous_offsets().is_some_and(|(s, _)| s == 0);
        let f32_cpu = |s: &Storage| matches!(s, Storage::Cpu(CpuStorage::F32(_)));
        (f32_cpu(&cos) && f32_cpu(&sin) && from_start(cl) && from_start(sl)).then(|| HostRope {
            cos,
            sin,
            style: self.style,
            max_position: self.max_position,
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
        self.rotate(x, &cos, &sin)
    }

    /// `x` rotated by candle's fused kernel of this table's style, with tables already taken for its positions.
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let x = x.contiguous()?;
        Ok(match self.style {
            RopeStyle::Half => candle_nn::rotary_emb::rope(&x, cos, sin)?,
            RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, cos, sin)?,
        })
    }
}

/// A table read in place on the CPU, for kernels that rotate rows themselves ([`Rope::host`]).
pub(crate) struct HostRope<'a> {
    cos: StorageRef<'a>,
    sin: StorageRef<'a>,
    style: RopeStyle,
    max_position: usize,
}

impl HostRope<'_> {
    pub fn max_position(&self) -> usize {
        self.max_position
    }

    /// `x` (one head's `head_dim` values) rotated for `position` into `out`, with the arithmetic of candle's CPU
    /// `rope` and `rope_i` kernels, so the result is theirs bit for bit.
    pub fn rotate(&self, x: &[f32], position: usize, out: &mut [f32]) {
        let (Storage::Cpu(CpuStorage::F32(cos)), Storage::Cpu(CpuStorage::F32(sin))) =
            (&*self.cos, &*self.sin)
        else {
            unreachable!("Rope::host checked the tables");
        };
        let half = x.len() / 2;
        let (cos, sin) = (
            &cos[position * half..(position + 1) * half],
            &sin[position * half..(position + 1) * half],
        );
        match self.style {
            RopeStyle::Half => {
                for i in 0..half {
                    let (a, b) = (x[i], x[i + half]);
                    out[i] = a * cos[i] - b * sin[i];
                    out[i + half] = a * sin[i] + b * cos[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..half {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    out[2 * i] = a * cos[i] - b * sin[i];
                    out[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
        }
    }
}

/// Per-pair inverse frequencies, with linear, YaRN or Llama 3 scaling when the config asks for it.
fn inverse_frequencies(spec: &ModelSpec, params: RopeParams) -> Vec<f32> {
    let d = spec.rope_dim();
    let base: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / params.theta.powf(i as f32 / d as f32))
        .collect();
    if let Some(factor) = params.linear_factor {
        return base.into_iter().map(|f| f / factor).collect();
    }
    if let Some(y) = spec.options.yarn {
        return yarn_frequencies(d, params.theta, y);
    }
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

/// YaRN's blend (as HF computes it): pairs rotating fewer than `beta_slow` times over the original
/// context are interpolated by `factor`, those rotating more than `beta_fast` times kept, a linear ramp between.
fn yarn_frequencies(d: usize, theta: f32, y: Yarn) -> Vec<f32> {
    let correction_dim = |rotations: f32| {
        d as f32 * (y.original_max_position as f32 / (rotations * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * theta.ln())
    };
    let (low, high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
    let (low, high) = if y.truncate {
        (low.floor(), high.ceil())
    } else {
        (low, high)
    };
    let (low, mut high) = (low.max(0.0), high.min(d as f32 - 1.0));
    if low == high {
        high += 0.001;
    }
    (0..d / 2)
        .map(|j| {
            let power = theta.powf((2 * j) as f32 / d as f32);
            let (extra, inter) = (1.0 / power, 1.0 / (y.factor * power));
            let ramp = ((j as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let keep = 1.0 - ramp;
            inter * (1.0 - keep) + extra * keep
        })
        .collect()
}
