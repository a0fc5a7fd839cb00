//! Several matmuls over the same input (queries, keys and values; gate and up) run as one where the weights allow:
//! the input is quantized once and the threads are woken once. Rows of a stacked matrix are computed exactly as
//! they would be alone, so results do not change.
use super::{Linear, Q4_1Matrix};
use crate::error::Result;
use candle_core::Tensor;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub enum Stacked {
    /// One matrix whose output splits into parts of these widths.
    One(Linear, Vec<usize>),
    /// Weights that cannot be stacked (candle's formats), run one after another.
    Many(Vec<Linear>),
}

impl Stacked {
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let q4_1: Vec<&Q4_1Matrix> = parts
            .iter()
            .filter_map(|p| match p {
                Linear::Q4_1(m) => Some(m.as_ref()),
                Linear::Candle(_) | Linear::Q8_0(_) => None,
            })
            .collect();
        if q4_1.len() == parts.len() && parts.len() > 1 {
            let widths = q4_1.iter().map(|m| m.rows()).collect();
            let stacked = Q4_1Matrix::concat_rows(&q4_1)?;
            return Ok(Self::One(Linear::Q4_1(Arc::new(stacked)), widths));
        }
        Ok(Self::Many(parts))
    }

    /// One matrix already holding the parts' rows one after another (a file's fused q/k/v or gate/up).
    pub fn split(fused: Linear, widths: Vec<usize>) -> Self {
        Self::One(fused, widths)
    }

    /// The one matrix of two parts of equal width, and that width: its output can be used whole.
    pub fn halves(&self) -> Option<(&Linear, usize)> {
        match self {
            Self::One(linear, widths) if widths.len() == 2 && widths[0] == widths[1] => {
                Some((linear, widths[0]))
            }
            _ => None,
        }
    }

    /// Each part's output for `x` (`[..., in]`), in order.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        match self {
            Self::Many(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Self::One(linear, widths) => {
                let y = linear.forward(x)?;
                let last = y.rank() - 1;
                let mut start = 0;
                widths
                    .iter()
                    .map(|&w| {
                        let part = y.narrow(last, start, w)?;
                        start += w;
                        Ok(part)
                    })
                    .collect()
            }
        }
    }
}
