//! The SwiGLU feed-forward: down(silu(gate(x)) * up(x)).
use crate::error::Result;
use candle_core::quantized::QMatMul;
use candle_core::{Module, Tensor};

#[derive(Debug, Clone)]
pub struct Mlp {
    pub(crate) gate: QMatMul,
    pub(crate) up: QMatMul,
    pub(crate) down: QMatMul,
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate.forward(x)?)?;
        self.down.forward(&(gate * self.up.forward(x)?)?)
    }
}

impl Mlp {
    pub fn run(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward(x)?)
    }
}
