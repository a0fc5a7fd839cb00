//! `Generation` with log-probabilities asked: the same tokens as without, and each step's numbers are the log-softmax
//! of the logits it was given.
mod common;

use candle_core::{Device, Tensor};
use petal_model::text::sampling::SamplingParams;
use petal_model::text::tokenizer::Tokenizer;
use petal_model::{Generation, GenerationConfig};

fn stories() -> Tokenizer {
    Tokenizer::from_file(&common::shared_model("stories260K/tok512.bin")).unwrap()
}

/// Deterministic pseudo-random logits over 512 tokens, different at each step.
fn logits(step: usize) -> Tensor {
    let values: Vec<f32> = (0..512u32)
        .map(|i| {
            let x = (i as f32 * 12.9898 + step as f32 * 78.233).sin() * 43_758.547;
            (x - x.floor()) * 8.0 - 4.0
        })
        .collect();
    Tensor::new(values, &Device::Cpu).unwrap()
}

fn run(config: &GenerationConfig, tok: &Tokenizer) -> Vec<petal_model::text::decoding::Step> {
    let mut generation = Generation::new(Some(tok), &[1], config).unwrap();
    let mut steps = vec![];
    for i in 0..config.max_new_tokens {
        let step = generation.step(&logits(i)).unwrap();
        let done = step.finished.is_some();
        steps.push(step);
        if done {
            break;
        }
    }
    steps
}

#[test]
fn logprobs_change_no_token_and_match_the_logits() {
    let tok = stories();
    for sampling in [
        SamplingParams::default(),
        SamplingParams {
            temperature: 0.8,
            top_p: Some(0.9),
            seed: 5,
            ..SamplingParams::default()
        },
        SamplingParams {
            presence_penalty: 1.0,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        },
    ] {
        let plain = GenerationConfig {
            max_new_tokens: 12,
            sampling: sampling.clone(),
            ignore_eos: true,
            ..GenerationConfig::default()
        };
        let asked = GenerationConfig {
            logprobs: Some(5),
            ..plain.clone()
        };
        let a = run(&plain, &tok);
        let b = run(&asked, &tok);
        assert_eq!(
            a.iter().map(|s| s.token).collect::<Vec<_>>(),
            b.iter().map(|s| s.token).collect::<Vec<_>>()
        );
        assert_eq!(
            a.iter().map(|s| s.text.as_str()).collect::<String>(),
            b.iter().map(|s| s.text.as_str()).collect::<String>()
        );
        assert!(a.iter().all(|s| s.logprob.is_none()));
        for (i, step) in b.iter().enumerate() {
            let lp = step.logprob.as_ref().expect("asked for logprobs");
            assert_eq!(lp.token, step.token);
            assert_eq!(lp.top.len(), 5);
            assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
            let values = logits(i).to_vec1::<f32>().unwrap();
            let norm = values.iter().map(|&v| (v as f64).exp()).sum::<f64>().ln();
            let expected = values[step.token as usize] as f64 - norm;
            assert!((lp.logprob as f64 - expected).abs() < 1e-5, "{lp:?}");
            assert!(lp.top.iter().map(|a| (a.logprob as f64).exp()).sum::<f64>() <= 1.0 + 1e-6);
            if sampling.is_greedy() && sampling.presence_penalty == 0.0 {
                assert_eq!(lp.top[0].token, step.token);
                assert_eq!(lp.top[0].logprob, lp.logprob);
            }
        }
    }
}
