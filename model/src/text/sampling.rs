//! Choosing the next token from the LM head's logits.
//!
//! The client samples (nodes only run blocks), so this is the one place temperature, top-k, top-p and the repeat
//! penalty live. The maths is candle's own `LogitsProcessor` and `apply_repeat_penalty`, so results match the
//! candle examples token for token and a fixed seed reproduces a generation exactly.
use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use crate::error::{ModelError, Result};

/// The seed used when none is given: the speed of light in m/s, as in the candle examples.
pub const DEFAULT_SEED: u64 = 299_792_458;

/// How to pick tokens. `Default` is greedy decoding with no penalty, which is deterministic for a given model.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; `<= 0` means greedy (argmax).
    pub temperature: f64,
    /// Sample only among the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Nucleus sampling: only among the most likely tokens whose probabilities add up to `p`; 1.0 = off.
    pub top_p: Option<f64>,
    /// Divides positive (multiplies negative) logits of tokens seen in the last `repeat_last_n`; 1.0 = off.
    pub repeat_penalty: f32,
    /// How many of the most recent tokens the repeat penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the sampling RNG: the same seed, params and logits give the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: DEFAULT_SEED,
        }
    }
}

impl SamplingParams {
    /// Rejects values that would make sampling meaningless or panic deep inside the maths.
    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::Sampling(format!(
                "temperature must be a finite number >= 0 (0 = greedy), got {}",
                self.temperature
            )));
        }
        if let Some(p) = self.top_p {
            if !p.is_finite() || p <= 0.0 || p > 1.0 {
                return Err(ModelError::Sampling(format!(
                    "top_p must be in (0, 1], got {p}"
                )));
            }
        }
        if self.top_k == Some(0) {
            return Err(ModelError::Sampling("top_k must be at least 1".into()));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return Err(ModelError::Sampling(format!(
                "repeat_penalty must be a finite number > 0 (1.0 = off), got {}",
                self.repeat_penalty
            )));
        }
        Ok(())
    }

    /// True when the choice does not depend on the RNG.
    pub fn is_greedy(&self) -> bool {
        self.temperature < MIN_TEMPERATURE
    }

    /// The candle sampling strategy these params describe.
    fn sampling(&self) -> Sampling {
        if self.is_greedy() {
            return Sampling::ArgMax;
        }
        let temperature = self.temperature;
        // top_p = 1.0 keeps every token: the same as no nucleus filter, and cheaper.
        let top_p = self.top_p.filter(|&p| p < 1.0);
        match (self.top_k, top_p) {
            (None, None) => Sampling::All { temperature },
            (Some(k), None) => Sampling::TopK { k, temperature },
            (None, Some(p)) => Sampling::TopP { p, temperature },
            (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
        }
    }
}

/// Temperatures below this are treated as greedy, as candle's `LogitsProcessor::new` does: dividing by a
/// near-zero temperature overflows the softmax.
const MIN_TEMPERATURE: f64 = 1e-7;

/// A seeded sampler for one generation. Keep it for the whole generation: its RNG state advances per draw.
pub struct Sampler {
    params: SamplingParams,
    processor: LogitsProcessor,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let processor = LogitsProcessor::from_sampling(params.seed, params.sampling());
        Ok(Self { params, processor })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` is the LM head output for the last position: 1-D of vocab size (a
    /// `[1, vocab]` or `[1, 1, vocab]` tensor is accepted too), any dtype, any device. `history` is every token so
    /// far, prompt included; only its last `repeat_last_n` feed the repeat penalty.
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<u32> {
        let dims = logits.dims();
        let vocab = dims.last().copied().unwrap_or(0);
        if vocab == 0 || dims.iter().rev().skip(1).any(|&d| d != 1) {
            return Err(ModelError::Sampling(format!(
                "expected 1-D logits of vocab size, got shape {dims:?}"
            )));
        }
        let mut logits = logits
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .reshape(vocab)?;
        if self.params.repeat_penalty != 1.0 && self.params.repeat_last_n > 0 {
            let start = history.len().saturating_sub(self.params.repeat_last_n);
            let recent = &history[start..];
            if !recent.is_empty() {
                logits = candle_transformers::utils::apply_repeat_penalty(
                    &logits,
                    self.params.repeat_penalty,
                    recent,
                )?;
            }
        }
        self.processor
            .sample(&logits)
            .map_err(|e| ModelError::Sampling(format!("cannot sample from these logits: {e}")))
    }
}
