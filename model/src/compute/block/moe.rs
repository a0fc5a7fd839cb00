//! A sparse mixture of experts (Mixtral): a router scores every expert per token, the best `experts_per_token`
//! run on it, and their outputs are summed weighted by the router's softmax. A node serving a block holds all its
//! experts, so routing never leaves the node.
use super::mlp::Mlp;
use crate::compute::linear::Linear;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};

#[derive(Debug, Clone)]
pub struct MixtureOfExperts {
    /// `[experts, hidden]`: one score per expert.
    pub(crate) router: Linear,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) experts_per_token: usize,
    /// Renormalise the chosen experts' weights to sum to 1.
    pub(crate) normalize_top_k: bool,
}

impl MixtureOfExperts {
    /// `x`: `[..., rows, hidden]`. Rows are grouped by expert, so each expert runs once per step on all the rows
    /// that chose it, whatever session they belong to.
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        let _span = tracing::trace_span!("experts").entered();
        let dims = x.dims().to_vec();
        let hidden = *dims
            .last()
            .ok_or_else(|| ModelError::Config("expert input has no dimensions".into()))?;
        let x = x.reshape(((), hidden))?;
        let rows = x.dim(0)?;
        let scores = self.router.forward(&x)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?.to_vec2::<f32>()?;
        // Per expert: the rows that chose it and the weight each gives it.
        let mut chosen: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (row, p) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..p.len()).collect();
            // Highest first; equal scores keep the lower expert first, as a stable top-k does.
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            let top = &order[..self.experts_per_token.min(order.len())];
            let sum: f32 = top.iter().map(|&e| p[e]).sum();
            for &e in top {
                let w = if self.normalize_top_k {
                    p[e] / sum
                } else {
                    p[e]
                };
                chosen[e].0.push(row as u32);
                chosen[e].1.push(w);
            }
        }
        let mut out: Option<Tensor> = None;
        for (expert, (rows_of, weights)) in self.experts.iter().zip(chosen) {
            if rows_of.is_empty() {
                continue;
            }
            let n = rows_of.len();
            let weights = Tensor::from_vec(weights, (n, 1), x.device())?.to_dtype(x.dtype())?;
            // An expert every row chose (always so in a one-row decode step) takes the rows as they are.
            if n == rows {
                let y = expert.run(&x)?.broadcast_mul(&weights)?;
                out = Some(match out {
                    Some(o) => (o + y)?,
                    None => y,
                });
                continue;
            }
            let index = Tensor::from_vec(rows_of, n, x.device())?;
            let y = expert.run(&x.index_select(&index, 0)?)?;
            let o = match out {
                Some(o) => o,
                None => Tensor::zeros((rows, hidden), x.dtype(), x.device())?,
            };
            out = Some(o.index_add(&index, &y.broadcast_mul(&weights)?, 0)?);
        }
        let out = match out {
            Some(o) => o,
            None => Tensor::zeros((rows, hidden), x.dtype(), x.device())?,
        };
        Ok(out.reshape(dims)?)
    }
}
