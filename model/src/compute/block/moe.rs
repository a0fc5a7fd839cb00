//! A sparse mixture of experts (Mixtral, Qwen3-MoE, DeepSeek, gpt-oss): a router scores every expert per token, the best
//! `experts_per_token` run on it, and their outputs are summed weighted by the router's scores, plus the shared
//! experts' where the family has them. A node serving a block holds all its experts, so routing never leaves the
//! node.
use super::mlp::Mlp;
use crate::compute::family::{ExpertGroups, ExpertScoring};
use crate::compute::linear::Linear;
use crate::error::{ModelError, Result};
use candle_core::{DType, Tensor};

#[derive(Debug, Clone)]
pub struct MixtureOfExperts {
    /// `[experts, hidden]`: one score per expert.
    pub(crate) router: Linear,
    /// Added to the router's logits (gpt-oss).
    pub(crate) router_bias: Option<Tensor>,
    pub(crate) experts: Vec<Mlp>,
    pub(crate) routing: Routing,
    /// The experts every token goes through (DeepSeek).
    pub(crate) shared: Option<Mlp>,
}

/// How one token's scores choose its experts and weigh them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Routing {
    pub experts_per_token: usize,
    pub scoring: ExpertScoring,
    /// Renormalise the chosen experts' weights to sum to 1.
    pub normalize_top_k: bool,
    pub groups: Option<ExpertGroups>,
    /// Added to the scores to choose experts, not to weigh them (DeepSeek-V3).
    pub choice_bias: Option<Vec<f32>>,
    /// Multiplies the chosen weights.
    pub routed_scale: f32,
}

impl Routing {
    /// The experts `scores` (one per expert, after the softmax or sigmoid) choose, with their weights, best first.
    /// Equal scores keep the lower expert (or group) first, as a stable top-k does.
    pub fn choose(&self, scores: &[f32]) -> Vec<(usize, f32)> {
        let mut choice: Vec<f32> = match &self.choice_bias {
            Some(bias) => scores.iter().zip(bias).map(|(s, b)| s + b).collect(),
            None => scores.to_vec(),
        };
        if let Some(g) = self.groups {
            let size = (scores.len() / g.count.max(1)).max(1);
            let group_scores: Vec<f32> = choice
                .chunks(size)
                .map(|group| match self.scoring {
                    ExpertScoring::Softmax => group.iter().copied().fold(f32::MIN, f32::max),
                    ExpertScoring::Sigmoid => best(group, 2).iter().map(|&e| group[e]).sum(),
                })
                .collect();
            let kept = best(&group_scores, g.chosen);
            // As DeepSeek's HF code: experts of the other groups score 0 (not minus infinity).
            for (i, score) in choice.iter_mut().enumerate() {
                if !kept.contains(&(i / size)) {
                    *score = 0.0;
                }
            }
        }
        let top = best(&choice, self.experts_per_token);
        let sum: f32 = top.iter().map(|&e| scores[e]).sum();
        top.into_iter()
            .map(|e| {
                let w = if self.normalize_top_k {
                    scores[e] / sum
                } else {
                    scores[e]
                };
                (e, w * self.routed_scale)
            })
            .collect()
    }
}

/// Indices of the `k` highest of `values`, highest first; equal values keep the lower index first.
fn best(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]));
    order.truncate(k);
    order
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
        let logits = self.router.forward(&x)?;
        let logits = match &self.router_bias {
            Some(b) => logits.broadcast_add(b)?,
            None => logits,
        }
        .to_dtype(DType::F32)?;
        let scores = match self.routing.scoring {
            ExpertScoring::Softmax => candle_nn::ops::softmax_last_dim(&logits)?,
            ExpertScoring::Sigmoid => candle_nn::ops::sigmoid(&logits)?,
        }
        .to_vec2::<f32>()?;
        // Per expert: the rows that chose it and the weight each gives it.
        let mut chosen: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (row, p) in scores.iter().enumerate() {
            for (e, w) in self.routing.choose(p) {
                chosen[e].0.push(row as u32);
                chosen[e].1.push(w);
            }
        }
        let zeros = || Tensor::zeros((rows, hidden), x.dtype(), x.device());
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
                None => zeros()?,
            };
            out = Some(o.index_add(&index, &y.broadcast_mul(&weights)?, 0)?);
        }
        let out = match out {
            Some(o) => o,
            None => zeros()?,
        };
        let out = match &self.shared {
            Some(shared) => (out + shared.run(&x)?)?,
            None => out,
        };
        Ok(out.reshape(dims)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn routing(per_token: usize, scoring: ExpertScoring) -> Routing {
        Routing {
            experts_per_token: per_token,
            scoring,
            normalize_top_k: false,
            groups: None,
            choice_bias: None,
            routed_scale: 1.0,
        }
    }

    fn close(got: &[(usize, f32)], want: &[(usize, f32)]) {
        assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
        for (g, w) in got.iter().zip(want) {
            assert!(
                g.0 == w.0 && (g.1 - w.1).abs() < 1e-6,
                "{got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn top_k_weights_are_scaled_without_renormalising() {
        let r = Routing {
            routed_scale: 1.5,
            ..routing(2, ExpertScoring::Softmax)
        };
        close(&r.choose(&[0.1, 0.4, 0.2, 0.3]), &[(1, 0.6), (3, 0.45)]);
        let r = Routing {
            normalize_top_k: true,
            ..r
        };
        close(
            &r.choose(&[0.1, 0.4, 0.2, 0.3]),
            &[(1, 1.5 * 4.0 / 7.0), (3, 1.5 * 3.0 / 7.0)],
        );
    }

    /// DeepSeek-V2's group-limited greedy: a group scores its best expert, and experts come from the best groups
    /// only (expert 2 outscores expert 0 but its group lost).
    #[test]
    fn softmax_groups_score_their_best_expert() {
        let r = Routing {
            groups: Some(ExpertGroups {
                count: 2,
                chosen: 1,
            }),
            ..routing(2, ExpertScoring::Softmax)
        };
        close(&r.choose(&[0.1, 0.35, 0.3, 0.25]), &[(1, 0.35), (0, 0.1)]);
    }

    /// DeepSeek-V3: groups score the sum of their best two bias-corrected scores, the bias chooses but does not
    /// weigh, and the weights are renormalised then scaled.
    #[test]
    fn sigmoid_groups_sum_their_best_two_with_the_choice_bias() {
        let scores = [0.9, 0.1, 0.6, 0.6, 0.5, 0.55, 0.2, 0.3];
        let r = Routing {
            normalize_top_k: true,
            groups: Some(ExpertGroups {
                count: 4,
                chosen: 2,
            }),
            routed_scale: 2.5,
            ..routing(2, ExpertScoring::Sigmoid)
        };
        // Unbiased: groups 1 (1.2) and 2 (1.05) win, not group 0 with the best expert; 2 and 3 tie, lower first.
        close(&r.choose(&scores), &[(2, 1.25), (3, 1.25)]);
        let biased = Routing {
            choice_bias: Some(vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5]),
            ..r
        };
        // Group 3 now sums 1.5: experts 7 and 6, weighed by their own scores 0.3 and 0.2.
        close(&biased.choose(&scores), &[(7, 1.5), (6, 1.0)]);
    }
}
