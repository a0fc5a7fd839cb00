//! Decoding as a state machine: logits in, a token and the text it completes out. Every generation (local or
//! through the swarm, one-shot, chat, API, bench) drives this one machine, so they sample, stop and detokenise
//! identically.
use crate::error::Result;
use crate::text::sampling::{logprobs, Sampler, SamplingParams, TokenLogprob};
use crate::text::stream::{StopMatcher, TextStream};
use crate::text::tokenizer::Tokenizer;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks, fixed-length comparisons).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Report each step's log-probabilities ([`Step::logprob`]): `Some(k)` gives the chosen token's and the `k`
    /// most likely tokens' (`Some(0)`: the chosen token's only); `None` computes nothing.
    #[serde(default)]
    pub logprobs: Option<usize>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 64,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            logprobs: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// max_new_tokens reached.
    Length,
    /// The model produced an end-of-sequence token.
    Eos,
    /// A stop string appeared.
    Stop,
}

/// What one step produced.
#[derive(Debug, Clone)]
pub struct Step {
    pub token: u32,
    /// Text completed by this token (possibly empty while a character or a possible stop string is pending).
    pub text: String,
    pub finished: Option<FinishReason>,
    /// The step's log-probabilities in the model's distribution, when [`GenerationConfig::logprobs`] asks.
    pub logprob: Option<TokenLogprob>,
}

pub struct Generation<'t> {
    sampler: Sampler,
    /// `None` when driving a model by token ids alone (synthetic weights have no tokenizer): no text, no EOS.
    stream: Option<TextStream<'t>>,
    stop: StopMatcher,
    eos: Vec<u32>,
    history: Vec<u32>,
    generated: Vec<u32>,
    max_new_tokens: usize,
    finished: Option<FinishReason>,
    logprobs: Option<usize>,
}

impl<'t> Generation<'t> {
    /// Decoding that continues `prompt`; without a tokenizer it yields token ids only.
    pub fn new(
        tokenizer: Option<&'t Tokenizer>,
        prompt: &[u32],
        config: &GenerationConfig,
    ) -> Result<Self> {
        Ok(Self {
            sampler: Sampler::new(config.sampling.clone())?,
            stream: tokenizer.map(|t| TextStream::with_context(t, prompt)),
            stop: StopMatcher::new(config.stop.clone()),
            eos: match tokenizer {
                Some(t) if !config.ignore_eos => t.eos_ids().to_vec(),
                _ => vec![],
            },
            history: prompt.to_vec(),
            generated: vec![],
            max_new_tokens: config.max_new_tokens,
            finished: (config.max_new_tokens == 0).then_some(FinishReason::Length),
            logprobs: config.logprobs,
        })
    }

    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Samples the next token from the last position's logits (`[vocab]` or `[1, vocab]`).
    pub fn step(&mut self, logits: &Tensor) -> Result<Step> {
        let _span = tracing::trace_span!("sample").entered();
        let logits = if logits.rank() == 2 {
            logits.squeeze(0)?
        } else {
            logits.clone()
        };
        let token = self.sampler.sample(&logits, &self.history)?;
        let logprob = match self.logprobs {
            Some(top) => Some(logprobs(&logits, token, top)?),
            None => None,
        };
        self.history.push(token);
        let mut text = String::new();
        if self.eos.contains(&token) {
            self.finished = Some(FinishReason::Eos);
        } else {
            self.generated.push(token);
            let piece = match self.stream.as_mut() {
                Some(stream) => stream.push(token)?,
                None => None,
            };
            if let Some(piece) = piece {
                let (emit, stopped) = self.stop.push(&piece);
                text.push_str(&emit);
                if stopped {
                    self.finished = Some(FinishReason::Stop);
                }
            }
            if self.finished.is_none() && self.generated.len() >= self.max_new_tokens {
                self.finished = Some(FinishReason::Length);
            }
        }
        if matches!(
            self.finished,
            Some(FinishReason::Length | FinishReason::Eos)
        ) {
            // Release whatever the detokeniser and the stop matcher still hold.
            let rest = match self.stream.as_mut() {
                Some(stream) => stream.finish()?,
                None => None,
            };
            if let Some(rest) = rest {
                let (emit, stopped) = self.stop.push(&rest);
                text.push_str(&emit);
                if stopped {
                    self.finished = Some(FinishReason::Stop);
                }
            }
            if self.finished != Some(FinishReason::Stop) {
                text.push_str(&self.stop.flush());
            }
        }
        Ok(Step {
            token,
            text,
            finished: self.finished,
            logprob,
        })
    }
}

/// The result of a whole generation, as `petal generate --json` prints it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationOutput {
    pub prompt_tokens: usize,
    /// Generated ids (the EOS token, if any, is not included).
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// Decode speed: tokens after the first, per second of decoding (the prompt's prefill is excluded).
    pub tokens_per_second: f64,
    /// Time to the first token (prefill), in milliseconds.
    pub first_token_ms: f64,
    pub total_ms: f64,
}

/// Times a generation loop and builds its [`GenerationOutput`].
pub struct GenerationTimer {
    start: Instant,
    first: Option<Instant>,
    steps: usize,
}

impl Default for GenerationTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl GenerationTimer {
    pub fn new() -> Self {
        Self {
            start: Instant::now(),
            first: None,
            steps: 0,
        }
    }

    /// Call once per sampled token.
    pub fn tick(&mut self) {
        self.steps += 1;
        self.first.get_or_insert_with(Instant::now);
    }

    pub fn finish(
        &self,
        prompt_tokens: usize,
        generation: &Generation<'_>,
        text: String,
    ) -> GenerationOutput {
        let total = self.start.elapsed();
        let first = self.first.map(|f| f - self.start).unwrap_or(total);
        let decode = total.saturating_sub(first);
        let tokens_per_second = if self.steps > 1 && decode > Duration::ZERO {
            (self.steps - 1) as f64 / decode.as_secs_f64()
        } else if total > Duration::ZERO {
            self.steps as f64 / total.as_secs_f64()
        } else {
            0.0
        };
        GenerationOutput {
            prompt_tokens,
            tokens: generation.generated().to_vec(),
            text,
            finish_reason: generation.finished().unwrap_or(FinishReason::Length),
            tokens_per_second,
            first_token_ms: first.as_secs_f64() * 1e3,
            total_ms: total.as_secs_f64() * 1e3,
        }
    }
}
