//! Options shared by the commands that generate text.
use clap::Args;
use petal_model::text::sampling::SamplingParams;
use petal_model::GenerationConfig;

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy (the default, reproducible).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Sample only among the K most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample only among the most likely tokens whose probabilities add up to P.
    #[arg(long)]
    pub top_p: Option<f64>,
    /// Penalty on tokens already present in the last 64 (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed: the same seed gives the same text.
    #[arg(long, default_value_t = 299_792_458)]
    pub seed: u64,
    /// Stop before this string (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (fixed-length runs and comparisons).
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn config(&self) -> anyhow::Result<GenerationConfig> {
        let sampling = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: 64,
            seed: self.seed,
            ..SamplingParams::default()
        };
        sampling.validate()?;
        Ok(GenerationConfig {
            max_new_tokens: self.max_new_tokens,
            sampling,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: None,
        })
    }
}
