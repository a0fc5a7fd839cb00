//! The gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU or GeGLU, or gpt-oss's clamped SwiGLU with biases.
use super::swiglu::silu_mul;
use crate::compute::family::Activation;
use crate::compute::linear::{Linear, Stacked};
use crate::error::{ModelError, Result};
use candle_core::Tensor;

#[derive(Debug, Clone)]
pub struct Mlp {
    /// Gate and up, in that order.
    pub(crate) gate_up: Stacked,
    pub(crate) down: Linear,
    pub(crate) activation: Activation,
    /// Biases of the gate, up and down projections (gpt-oss's experts).
    pub(crate) biases: Option<[Tensor; 3]>,
}

impl Mlp {
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        if let (Activation::Silu, Some((gate_up, width)), None) =
            (self.activation, self.gate_up.halves(), &self.biases)
        {
            return self.down.forward(&silu_mul(&gate_up.forward(x)?, width)?);
        }
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(x)?
            .try_into()
            .map_err(|_| ModelError::Config("gate/up projection lost a part".into()))?;
        let (gate, up) = match &self.biases {
            Some([bg, bu, _]) => (gate.broadcast_add(bg)?, up.broadcast_add(bu)?),
            None => (gate, up),
        };
        let y = match self.activation {
            Activation::Silu => (candle_nn::ops::silu(&gate)? * up)?,
            Activation::GeluTanh => (gate.gelu()? * up)?,
            Activation::Gelu => (gate.gelu_erf()? * up)?,
            Activation::ClampedSwiglu { alpha, limit } => {
                let (alpha, limit) = (f64::from(alpha), f64::from(limit));
                let gate = gate.minimum(limit)?;
                let up = up.clamp(-limit, limit)?;
                let glu = (&gate * candle_nn::ops::sigmoid(&(&gate * alpha)?)?)?;
                ((up + 1.0)? * glu)?
            }
        };
        let y = self.down.forward(&y)?;
        Ok(match &self.biases {
            Some([_, _, bd]) => y.broadcast_add(bd)?,
            None => y,
        })
    }
}
