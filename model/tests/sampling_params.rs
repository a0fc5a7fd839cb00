//! Sampler behaviour on fixed logits: greedy, seeded reproducibility, top-k/top-p, repeat penalty, validation.
use candle_core::{Device, Tensor};
use petal_model::text::sampling::{Sampler, SamplingParams};
use petal_model::ModelError;

/// A spread-out distribution over 8 tokens, most likely token 3.
fn logits() -> Tensor {
    Tensor::new(&[0.5f32, 1.0, 0.2, 2.0, 1.5, -1.0, 0.0, 1.8], &Device::Cpu).unwrap()
}

fn draws(params: SamplingParams, n: usize) -> Vec<u32> {
    let mut sampler = Sampler::new(params).unwrap();
    let logits = logits();
    (0..n)
        .map(|_| sampler.sample(&logits, &[]).unwrap())
        .collect()
}

fn warm(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        seed,
        ..SamplingParams::default()
    }
}

#[test]
fn default_is_greedy_and_picks_argmax() {
    let params = SamplingParams::default();
    assert_eq!(params.temperature, 0.0);
    assert_eq!(params.repeat_penalty, 1.0);
    assert_eq!(params.repeat_last_n, 64);
    assert_eq!(params.seed, 299_792_458);
    assert!(params.top_k.is_none() && params.top_p.is_none());
    assert!(draws(params, 20).iter().all(|&t| t == 3));
}

#[test]
fn same_seed_same_tokens_different_seed_differs() {
    let a = draws(warm(42), 100);
    let b = draws(warm(42), 100);
    let c = draws(warm(43), 100);
    assert_eq!(a, b);
    assert_ne!(a, c);
    // Sampling really samples: several different tokens appear, the likeliest most often.
    let mut counts = [0usize; 8];
    for &t in &a {
        counts[t as usize] += 1;
    }
    assert!(counts.iter().filter(|&&c| c > 0).count() >= 4, "{counts:?}");
    assert_eq!(
        counts
            .iter()
            .enumerate()
            .max_by_key(|(_, &c)| c)
            .map(|(i, _)| i),
        Some(3),
        "{counts:?}"
    );
}

#[test]
fn top_k_one_equals_greedy() {
    let params = SamplingParams {
        temperature: 5.0,
        top_k: Some(1),
        ..SamplingParams::default()
    };
    assert!(draws(params, 50).iter().all(|&t| t == 3));
}

#[test]
fn top_k_and_top_p_restrict_the_choice() {
    let top3 = SamplingParams {
        top_k: Some(3),
        ..warm(7)
    };
    // The three likeliest tokens are 3 (2.0), 7 (1.8) and 4 (1.5).
    assert!(draws(top3, 200).iter().all(|t| [3, 7, 4].contains(t)));
    let nucleus = SamplingParams {
        top_p: Some(0.05),
        ..warm(7)
    };
    assert!(draws(nucleus, 50).iter().all(|&t| t == 3));
    let both = SamplingParams {
        top_k: Some(2),
        top_p: Some(0.9),
        ..warm(9)
    };
    assert!(draws(both, 100).iter().all(|t| [3, 7].contains(t)));
    // top_p = 1.0 is no filter at all: same draws as plain sampling.
    let full = SamplingParams {
        top_p: Some(1.0),
        ..warm(11)
    };
    assert_eq!(draws(full, 50), draws(warm(11), 50));
}

#[test]
fn repeat_penalty_lowers_repeated_tokens() {
    let params = SamplingParams {
        repeat_penalty: 10.0,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params).unwrap();
    let logits = logits();
    // 3 was just generated: its logit 2.0 becomes 0.2, so 7 (1.8) wins.
    assert_eq!(sampler.sample(&logits, &[3]).unwrap(), 7);
    assert_eq!(sampler.sample(&logits, &[3, 7]).unwrap(), 4);
    // Only the last repeat_last_n tokens count.
    let mut short = Sampler::new(SamplingParams {
        repeat_penalty: 10.0,
        repeat_last_n: 1,
        ..SamplingParams::default()
    })
    .unwrap();
    assert_eq!(short.sample(&logits, &[3, 7]).unwrap(), 3);
    // Without a penalty the history does not matter.
    let mut plain = Sampler::new(SamplingParams::default()).unwrap();
    assert_eq!(plain.sample(&logits, &[3, 3, 3]).unwrap(), 3);
}

#[test]
fn accepts_batched_shapes_and_other_dtypes() {
    let mut sampler = Sampler::new(SamplingParams::default()).unwrap();
    let batched = logits().reshape((1, 1, 8)).unwrap();
    assert_eq!(sampler.sample(&batched, &[]).unwrap(), 3);
    let half = logits().to_dtype(candle_core::DType::F16).unwrap();
    assert_eq!(sampler.sample(&half, &[]).unwrap(), 3);
    let bad = Tensor::zeros((2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        sampler.sample(&bad, &[]),
        Err(ModelError::Sampling(_))
    ));
}

#[test]
fn invalid_params_are_errors() {
    let bad = [
        SamplingParams {
            temperature: -0.1,
            ..Default::default()
        },
        SamplingParams {
            temperature: f64::NAN,
            ..Default::default()
        },
        SamplingParams {
            temperature: f64::INFINITY,
            ..Default::default()
        },
        SamplingParams {
            top_p: Some(0.0),
            ..Default::default()
        },
        SamplingParams {
            top_p: Some(1.5),
            ..Default::default()
        },
        SamplingParams {
            top_p: Some(f64::NAN),
            ..Default::default()
        },
        SamplingParams {
            top_k: Some(0),
            ..Default::default()
        },
        SamplingParams {
            repeat_penalty: 0.0,
            ..Default::default()
        },
        SamplingParams {
            repeat_penalty: -1.0,
            ..Default::default()
        },
        SamplingParams {
            repeat_penalty: f32::NAN,
            ..Default::default()
        },
    ];
    for params in bad {
        assert!(
            matches!(params.validate(), Err(ModelError::Sampling(_))),
            "{params:?}"
        );
        assert!(
            matches!(Sampler::new(params.clone()), Err(ModelError::Sampling(_))),
            "{params:?}"
        );
    }
    SamplingParams {
        temperature: 0.7,
        top_k: Some(40),
        top_p: Some(0.95),
        repeat_penalty: 1.1,
        ..Default::default()
    }
    .validate()
    .unwrap();
}

#[test]
fn params_round_trip_through_json_with_defaults() {
    let params: SamplingParams =
        serde_json::from_str(r#"{"temperature": 0.8, "top_k": 20}"#).unwrap();
    assert_eq!(params.temperature, 0.8);
    assert_eq!(params.top_k, Some(20));
    assert_eq!(params.seed, 299_792_458);
    let json = serde_json::to_string(&params).unwrap();
    let back: SamplingParams = serde_json::from_str(&json).unwrap();
    assert_eq!(back, params);
}

#[test]
fn openai_penalties_count_the_drawn_tokens() {
    use petal_model::text::sampling::MAX_PENALTY;
    // Token 3 (2.0) wins the first draw; then presence lowers it once, whatever the count: 1.6 < 7's 1.8, and
    // once 7 is drawn too (1.4), 3 (1.6) beats 4 (1.5) for good.
    let presence = SamplingParams {
        presence_penalty: 0.4,
        ..SamplingParams::default()
    };
    assert_eq!(draws(presence, 5), [3, 7, 3, 3, 3]);
    // Frequency grows with each draw: 3 (2.0 - 0.15 n3) against 7 (1.8 - 0.15 n7).
    let frequency = SamplingParams {
        frequency_penalty: 0.15,
        ..SamplingParams::default()
    };
    assert_eq!(draws(frequency, 4), [3, 3, 7, 3]);
    // The prompt does not count: only what the sampler itself drew.
    let mut sampler = Sampler::new(SamplingParams {
        presence_penalty: 2.0,
        ..SamplingParams::default()
    })
    .unwrap();
    assert_eq!(sampler.sample(&logits(), &[3, 3, 3]).unwrap(), 3);
    // Negative values encourage repetition.
    let sticky = SamplingParams {
        presence_penalty: -1.0,
        frequency_penalty: -1.0,
        ..SamplingParams::default()
    };
    assert!(draws(sticky, 10).iter().all(|&t| t == 3));
    // Off by default, and out of range is refused.
    assert_eq!(SamplingParams::default().presence_penalty, 0.0);
    assert_eq!(SamplingParams::default().frequency_penalty, 0.0);
    for bad in [MAX_PENALTY + 0.01, -MAX_PENALTY - 0.01, f32::NAN] {
        let p = SamplingParams {
            presence_penalty: bad,
            ..SamplingParams::default()
        };
        assert!(
            matches!(p.validate(), Err(ModelError::Sampling(_))),
            "{p:?}"
        );
        let f = SamplingParams {
            frequency_penalty: bad,
            ..SamplingParams::default()
        };
        assert!(
            matches!(f.validate(), Err(ModelError::Sampling(_))),
            "{f:?}"
        );
    }
    SamplingParams {
        presence_penalty: MAX_PENALTY,
        frequency_penalty: -MAX_PENALTY,
        ..SamplingParams::default()
    }
    .validate()
    .unwrap();
}

#[test]
fn logprobs_are_the_models_log_softmax() {
    use petal_model::text::sampling::logprobs;
    let values = [0.5f64, 1.0, 0.2, 2.0, 1.5, -1.0, 0.0, 1.8];
    let norm = values.iter().map(|v| v.exp()).sum::<f64>().ln();
    let lp = logprobs(&logits(), 7, 3).unwrap();
    assert_eq!(lp.token, 7);
    assert!((lp.logprob as f64 - (1.8 - norm)).abs() < 1e-6, "{lp:?}");
    let top: Vec<u32> = lp.top.iter().map(|a| a.token).collect();
    assert_eq!(top, [3, 7, 4]);
    assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
    assert!((lp.top[0].logprob as f64 - (2.0 - norm)).abs() < 1e-6);
    // The whole vocabulary's probabilities add up to 1; more than the vocabulary is the vocabulary.
    let all = logprobs(&logits(), 0, 100).unwrap();
    assert_eq!(all.top.len(), 8);
    let total: f64 = all.top.iter().map(|a| (a.logprob as f64).exp()).sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    // Zero alternatives: the chosen token's only; batched shapes and other dtypes work.
    assert!(logprobs(&logits(), 3, 0).unwrap().top.is_empty());
    let half = logits()
        .to_dtype(candle_core::DType::F16)
        .unwrap()
        .reshape((1, 8))
        .unwrap();
    assert_eq!(logprobs(&half, 3, 1).unwrap().top[0].token, 3);
    assert!(matches!(
        logprobs(&logits(), 8, 1),
        Err(ModelError::Sampling(_))
    ));
}
