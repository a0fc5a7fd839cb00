//! Keys and values stored in f16 (`--kv-dtype f16`) while the blocks compute in f32: half the cache's bytes, the
//! same greedy tokens as the f32 cache on the real SmolLM2 GGUF, and a batched step equal to the same step alone
//! (to the matmuls' last bits, as for f32 caches).
mod common;

use candle_core::{DType, Tensor};
use common::*;
use petal_model::{BatchStep, BlockRange, BlockSpan, ModelSource, Placement};

fn span(source: &ModelSource, kv: Option<DType>) -> BlockSpan {
    let range = BlockRange::new(0, source.spec().num_blocks);
    let mut span = source.load_span_on(range, &Placement::cpu_f32()).unwrap();
    span.set_kv_dtype(kv);
    span
}

/// Greedy decoding: the prompt, then `steps` tokens; every step's logits.
fn greedy(source: &ModelSource, kv: Option<DType>, prompt: &[u32], steps: usize) -> Vec<Tensor> {
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    let span = span(source, kv);
    let mut cache = span.new_cache(span.range(), 256).unwrap();
    let (mut input, mut position, mut all) = (prompt.to_vec(), 0, vec![]);
    for _ in 0..steps {
        let x = span
            .forward(&head.embed(&input).unwrap(), position, &mut cache)
            .unwrap();
        let logits = head.logits(&x).unwrap().squeeze(0).unwrap();
        position += input.len();
        input = vec![argmax(&logits)];
        all.push(logits);
    }
    let expected = if kv == Some(DType::F16) {
        DType::F16
    } else {
        DType::F32
    };
    assert!(cache
        .caches()
        .iter()
        .all(|c| c.placement().dtype == expected));
    all
}

#[test]
fn an_f16_cache_gives_the_f32_caches_greedy_tokens_on_smollm2() {
    let source = ModelSource::open(smollm_gguf()).unwrap();
    let prompt = source
        .tokenizer(None)
        .unwrap()
        .encode("Once upon a time, in a small village,", true)
        .unwrap();
    let reference = greedy(&source, None, &prompt, 48);
    let half = greedy(&source, Some(DType::F16), &prompt, 48);
    let tokens = |l: &[Tensor]| l.iter().map(argmax).collect::<Vec<_>>();
    assert_eq!(tokens(&half), tokens(&reference));
    // The logits move by the keys' and values' rounding to f16, not more.
    let worst = half
        .iter()
        .zip(&reference)
        .map(|(a, b)| max_abs_diff(a, b))
        .fold(0f32, f32::max);
    assert!(worst > 0.0 && worst < 2.0, "logits differ by {worst}");
}

#[test]
fn an_f16_cache_takes_half_the_bytes() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    let x = head.embed(&[1, 403, 407, 261, 378]).unwrap();
    let bytes = |kv| {
        let span = span(&source, kv);
        let mut cache = span.new_cache(span.range(), 64).unwrap();
        span.forward(&x, 0, &mut cache).unwrap();
        cache.bytes()
    };
    assert_eq!(bytes(Some(DType::F16)) * 2, bytes(None));
}

#[test]
fn a_batched_step_on_f16_caches_equals_each_step_alone() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    let span = span(&source, Some(DType::F16));
    let prompts: [&[u32]; 2] = [&[1, 403, 407, 261, 378, 300, 12], &[1, 45, 99]];
    // Two sessions at different positions: prefilled alone, then one decode step each, batched and alone.
    let prefilled = || {
        prompts
            .iter()
            .map(|p| {
                let mut c = span.new_cache(span.range(), 64).unwrap();
                span.forward(&head.embed(p).unwrap(), 0, &mut c).unwrap();
                c
            })
            .collect::<Vec<_>>()
    };
    let next = [head.embed(&[77]).unwrap(), head.embed(&[5]).unwrap()];
    let mut alone = prefilled();
    let alone: Vec<Tensor> = alone
        .iter_mut()
        .zip(&next)
        .zip(prompts)
        .map(|((c, x), p)| span.forward(x, p.len(), c).unwrap())
        .collect();
    let mut caches = prefilled();
    let mut steps: Vec<BatchStep> = caches
        .iter_mut()
        .zip(&next)
        .zip(prompts)
        .map(|((cache, x), p)| BatchStep {
            hidden: x.clone(),
            position: p.len(),
            cache,
        })
        .collect();
    let batched = span.forward_batch(&mut steps);
    // Attention reads each session's cache on its own, as alone; the projections' matmul over both sessions'
    // rows may round the last bits differently for another row count (as with f32 caches: tests/scheduler.rs).
    for (b, a) in batched.into_iter().zip(&alone) {
        let scale = max_abs_diff(a, &a.zeros_like().unwrap()).max(1.0);
        let diff = max_abs_diff(&b.unwrap(), a) / scale;
        assert!(
            diff < 1e-5,
            "batched differs from alone by {diff} (relative)"
        );
    }
}
