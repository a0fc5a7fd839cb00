//! The SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
use crate::compute::linear::{Linear, Stacked};
use crate::error::{ModelError, Result};
use candle_core::Tensor;

#[derive(Debug, Clone)]
pub struct Mlp {
    /// Gate and up, in that order.
    pub(crate) gate_up: Stacked,
    pub(crate) down: Linear,
}

impl Mlp {
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        let [gate, up]: [Tensor; 2] = self
            .gate_up
            .forward(x)?
            .try_into()
            .map_err(|_| ModelError::Config("gate/up projection lost a part".into()))?;
        self.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)
    }
}
