//! The LM head of concurrent sessions runs as one matmul: every caller gets exactly the logits it would get alone.
mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use petal_model::compute::placement::Placement;
use petal_model::ModelSource;
use std::sync::Barrier;

#[test]
fn concurrent_callers_get_the_logits_each_gets_alone() {
    let source = ModelSource::open(smollm_gguf()).unwrap();
    let head = source
        .load_head(Placement::new(Device::Cpu, DType::F32))
        .unwrap();
    // SmolLM2's tied head is Q8_0: one of our kernels, so its rows are batched.
    assert!(head.batch_stats().is_some());
    // No position at all is a shape error, not a panic.
    let empty = Tensor::zeros((1, 0, 576), DType::F32, &Device::Cpu).unwrap();
    assert!(head.logits(&empty).is_err());
    let hidden: Vec<Tensor> = (0..8)
        .map(|i| {
            let tokens = 1 + i % 3;
            (Tensor::randn(0f32, 1.0, (1, tokens, 576), &Device::Cpu).unwrap() * (1.0 + i as f64))
                .unwrap()
        })
        .collect();
    let logits = |h: &Tensor| -> Vec<f32> {
        let l = head.logits(h).unwrap();
        l.flatten_all().unwrap().to_vec1().unwrap()
    };
    let alone: Vec<Vec<f32>> = hidden.iter().map(logits).collect();
    let before = head.batch_stats().unwrap();
    let barrier = Barrier::new(hidden.len());
    std::thread::scope(|s| {
        let threads: Vec<_> = hidden
            .iter()
            .map(|h| {
                let (logits, barrier) = (&logits, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    (0..20).map(|_| logits(h)).collect::<Vec<Vec<f32>>>()
                })
            })
            .collect();
        for (t, want) in threads.into_iter().zip(&alone) {
            for got in t.join().unwrap() {
                assert!(got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    });
    let after = head.batch_stats().unwrap();
    assert_eq!(after.calls - before.calls, 8 * 20);
}
