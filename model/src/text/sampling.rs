//! Choosing the next token from the LM head's logits, and the log-probabilities of the model's distribution.
//!
//! The client samples (nodes only run blocks), so this is the one place temperature, top-k, top-p and the
//! penalties live. The maths is candle's own `LogitsProcessor` and `apply_repeat_penalty`, so results match the
//! candle examples token for token and a fixed seed reproduces a generation exactly; OpenAI's presence and
//! frequency penalties are applied before them, over the tokens this sampler has drawn.
use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};
use serde::{Deserialize, Serialize};

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
    /// OpenAI's `presence_penalty` (-2..=2, 0 = off): subtracted once from the logit of every token generated so
    /// far (the prompt does not count).
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty` (-2..=2, 0 = off): subtracted from a token's logit once per time it was
    /// generated so far.
    pub frequency_penalty: f32,
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
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
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
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !value.is_finite() || !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return Err(ModelError::Sampling(format!(
                    "{name} must be between -{MAX_PENALTY} and {MAX_PENALTY} (0 = off), got {value}"
                )));
            }
        }
        Ok(())
    }

    /// Whether the presence or frequency penalty is on.
    fn penalises_generated(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
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

/// The largest presence or frequency penalty, either sign (OpenAI's range).
pub const MAX_PENALTY: f32 = 2.0;

/// A seeded sampler for one generation. Keep it for the whole generation: its RNG state advances per draw.
pub struct Sampler {
    params: SamplingParams,
    processor: LogitsProcessor,
    /// How often each token was drawn, kept only while a presence or frequency penalty is on.
    drawn: HashMap<u32, u32>,
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
        Ok(Self {
            params,
            processor,
            drawn: HashMap::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `logits` is the LM head output for the last position: 1-D of vocab size (a
    /// `[1, vocab]` or `[1, 1, vocab]` tensor is accepted too), any dtype, any device. `history` is every token so
    /// far, prompt included; only its last `repeat_last_n` feed the repeat penalty. The presence and frequency
    /// penalties count the tokens this sampler drew before (one sampler per generation: the generated tokens).
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
        if self.params.penalises_generated() && !self.drawn.is_empty() {
            logits = self.apply_openai_penalties(&logits)?;
        }
        // Greedy is candle's argmax (`Sampling::ArgMax` draws nothing from the RNG), without its scalar scan.
        let token = if self.params.is_greedy() {
            crate::text::greedy::argmax(&logits)?
        } else {
            self.processor.sample(&logits).map_err(|e| {
                ModelError::Sampling(format!("cannot sample from these logits: {e}"))
            })?
        };
        if self.params.penalises_generated() {
            *self.drawn.entry(token).or_default() += 1;
        }
        Ok(token)
    }

    /// OpenAI's formula over the drawn tokens: `logit -= count * frequency_penalty + (count > 0) * presence_penalty`.
    fn apply_openai_penalties(&self, logits: &Tensor) -> Result<Tensor> {
        let mut values = logits.to_vec1::<f32>()?;
        for (&token, &count) in &self.drawn {
            if let Some(logit) = values.get_mut(token as usize) {
                *logit -=
                    count as f32 * self.params.frequency_penalty + self.params.presence_penalty;
            }
        }
        Ok(Tensor::from_vec(values, logits.dims(), &Device::Cpu)?)
    }
}

/// One alternative of a step: a token and its log-probability.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Alternative {
    pub token: u32,
    pub logprob: f32,
}

/// The log-probability of the token a step chose, and the most likely tokens of that step, in the model's own
/// distribution: the log-softmax of the LM head's logits, before temperature, top-k/top-p and penalties (what
/// OpenAI reports as `logprobs`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The most likely tokens, most likely first (ties: lower id first); as many as asked (at most the vocab).
    pub top: Vec<Alternative>,
}

/// [`TokenLogprob`] of `chosen` with the `top` most likely alternatives, from one position's logits (1-D of
/// vocab size, or any shape with one row; any dtype, any device). Computed in f64 for accuracy.
pub fn logprobs(logits: &Tensor, chosen: u32, top: usize) -> Result<TokenLogprob> {
    let values = logits
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let Some(&chosen_logit) = values.get(chosen as usize) else {
        return Err(ModelError::Sampling(format!(
            "token {chosen} is outside logits of {} entries",
            values.len()
        )));
    };
    let max = values
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return Err(ModelError::Sampling(
            "cannot compute logprobs: the logits have no finite maximum".into(),
        ));
    }
    let sum: f64 = values
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (v as f64 - max).exp())
        .sum();
    let log_norm = max + sum.ln();
    let logprob = |v: f32| (v as f64 - log_norm) as f32;
    let k = top.min(values.len());
    let mut order: Vec<u32> = (0..values.len() as u32).collect();
    let descending = |a: &u32, b: &u32| {
        let (va, vb) = (values[*a as usize], values[*b as usize]);
        vb.total_cmp(&va).then(a.cmp(b))
    };
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, descending);
    }
    order.truncate(k);
    order.sort_by(descending);
    Ok(TokenLogprob {
        token: chosen,
        logprob: logprob(chosen_logit),
        top: order
            .into_iter()
            .map(|token| Alternative {
                token,
                logprob: logprob(values[token as usize]),
            })
            .collect(),
    })
}
