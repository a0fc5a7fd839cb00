//! Matmul weights (`y = x W^T`): candle's `QMatMul`, or our own CPU kernels for the formats where candle's are
//! slow (Q4_1: candle's dot product is its generic scalar loop).
pub mod dot;
pub mod q4_1;
pub mod q8_1;
mod stacked;

pub use q4_1::Q4_1Matrix;
pub use stacked::Stacked;

use crate::error::Result;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Linear {
    Candle(QMatMul),
    Q4_1(Arc<Q4_1Matrix>),
}

impl Linear {
    /// A quantized weight: ours where we have a kernel for its format on this device, else candle's.
    pub fn quantized(q: Arc<QTensor>, device: &Device) -> Result<Self> {
        if device.is_cpu() {
            if let Some(m) = Q4_1Matrix::from_qtensor(&q)? {
                return Ok(Self::Q4_1(Arc::new(m)));
            }
        }
        Ok(Self::Candle(QMatMul::from_arc(q)?))
    }

    pub fn dense(w: Tensor) -> Self {
        Self::Candle(QMatMul::Tensor(w))
    }

    /// `x`: `[..., in]` to `[..., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::Candle(m) => m.forward(x)?,
            Self::Q4_1(m) => {
                let x = if x.dtype() == DType::F32 {
                    x.contiguous()?
                } else {
                    x.to_dtype(DType::F32)?
                };
                x.apply_op1_no_bwd(m.as_ref())?
            }
        })
    }
}
