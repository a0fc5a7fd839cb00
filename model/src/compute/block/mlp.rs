//! The gated feed-forward: down(act(gate(x)) * up(x)), SwiGLU or GeGLU.
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
}

impl Mlp {
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        if let (Activation::Silu, Some((gate_up, width))) = (self.activation, self.gate_up.halves())
        {
            return self.down.forward(&silu_mul(&gate_up.forward(x)?, width)?);
        }
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(x)?
            .try_into()
            .map_err(|_| ModelError::Config("gate/up projection lost a part".into()))?;
        let gate = match self.activation {
            Activation::Silu => candle_nn::ops::silu(&gate)?,
            Activation::GeluTanh => gate.gelu()?,
            Activation::Gelu => gate.gelu_erf()?,
        };
        self.down.forward(&(gate * up)?)
    }
}
