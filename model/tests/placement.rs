//! Every tensor entering a block is normalised to the block's placement: from the wire (a CPU tensor in the wire
//! dtype), from the previous block (another dtype or device), and KV restored from elsewhere. On CPU the dtypes
//! stand in for devices: without the normalise step each case below fails with a dtype mismatch.
mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use petal_model::compute::placement::{is_placed, normalise};
use petal_model::{BlockRange, ModelSource, Placement};

fn placement(dtype: DType) -> Placement {
    Placement::new(Device::Cpu, dtype)
}

fn prompt_hidden(source: &ModelSource) -> Tensor {
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    head.embed(&[1, 403, 407, 261, 378]).unwrap()
}

#[test]
fn wire_input_in_another_dtype_is_normalised() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let x = prompt_hidden(&source);
    for (wire, block) in [
        (DType::F32, DType::F16),
        (DType::F16, DType::F32),
        (DType::F32, DType::BF16),
    ] {
        let span = source
            .load_span_on(BlockRange::new(0, 5), &placement(block))
            .unwrap();
        let mut session = span.new_cache(span.range(), 16).unwrap();
        let out = span
            .forward(&x.to_dtype(wire).unwrap(), 0, &mut session)
            .unwrap();
        assert!(
            is_placed(&out, &placement(block)),
            "{wire:?} into a {block:?} span"
        );
        for cache in session.caches() {
            let (k, v) = cache.snapshot().unwrap();
            assert_eq!(
                (k.dtype(), v.dtype()),
                (block, block),
                "KV lives in the block's dtype"
            );
        }
    }
}

#[test]
fn mixed_placements_in_one_span_match_f32() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let x = prompt_hidden(&source);
    let reference = {
        let span = source
            .load_span_on(BlockRange::new(0, 5), &Placement::cpu_f32())
            .unwrap();
        let mut s = span.new_cache(span.range(), 16).unwrap();
        span.forward(&x, 0, &mut s).unwrap()
    };
    // Alternate dtypes block by block: every block boundary is a placement change.
    let mixed: Vec<Placement> = [DType::F32, DType::F16, DType::BF16, DType::F32, DType::F16]
        .into_iter()
        .map(placement)
        .collect();
    let span = source.load_span(BlockRange::new(0, 5), &mixed).unwrap();
    let mut s = span.new_cache(span.range(), 16).unwrap();
    let out = span.forward(&x, 0, &mut s).unwrap();
    assert_eq!(out.dtype(), DType::F16);
    let diff = max_abs_diff(&out.to_dtype(DType::F32).unwrap(), &reference);
    let scale = reference
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(
        diff < 0.05 * scale,
        "mixed-precision span drifted: {diff} (scale {scale})"
    );
}

#[test]
fn restored_kv_in_another_dtype_is_normalised() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    let prompt = head.embed(&[1, 403, 407, 261, 378]).unwrap();
    let next = head.embed(&[432]).unwrap();

    // An f32 session computes the prompt; its KV is then restored into an f16 session.
    let f32_span = source
        .load_span_on(BlockRange::new(0, 5), &Placement::cpu_f32())
        .unwrap();
    let mut a = f32_span.new_cache(f32_span.range(), 16).unwrap();
    f32_span.forward(&prompt, 0, &mut a).unwrap();
    let kv: Vec<(Tensor, Tensor)> = a.caches().iter().map(|c| c.snapshot().unwrap()).collect();
    assert!(kv.iter().all(|(k, _)| k.dtype() == DType::F32));

    let f16_span = source
        .load_span_on(BlockRange::new(0, 5), &placement(DType::F16))
        .unwrap();
    let mut b = f16_span.new_cache(f16_span.range(), 16).unwrap();
    b.restore(&kv).unwrap();
    assert_eq!(b.position(), 5);
    for cache in b.caches() {
        assert_eq!(
            cache.snapshot().unwrap().0.dtype(),
            DType::F16,
            "restored KV must be normalised"
        );
    }
    // The next step concatenates f16 keys onto the restored ones and must agree with the f32 session.
    let out_b = f16_span.forward(&next, 5, &mut b).unwrap();
    let out_a = f32_span.forward(&next, 5, &mut a).unwrap();
    let la = head.logits(&out_a).unwrap();
    let lb = head.logits(&out_b).unwrap();
    assert_eq!(
        argmax(&la),
        argmax(&lb),
        "f16 continuation of restored KV picks another token"
    );
}

#[test]
fn normalise_moves_and_casts_once() {
    let t = Tensor::new(&[[1f32, 2.0]], &Device::Cpu).unwrap();
    let p = placement(DType::BF16);
    let n = normalise(&t, &p).unwrap();
    assert!(is_placed(&n, &p));
    // Already placed: the same storage comes back, no copy.
    let again = normalise(&n, &p).unwrap();
    assert!(again.is_contiguous() && is_placed(&again, &p));
}

#[test]
fn refused_steps_leave_the_session_untouched() {
    let source = ModelSource::open(stories_hf()).unwrap();
    let span = source
        .load_span_on(BlockRange::new(0, 5), &Placement::cpu_f32())
        .unwrap();
    let mut s = span.new_cache(span.range(), 8).unwrap();
    let x = prompt_hidden(&source);
    assert!(
        span.forward(&x, 3, &mut s).is_err(),
        "out-of-order position"
    );
    let wrong = Tensor::zeros((1, 2, 63), DType::F32, &Device::Cpu).unwrap();
    assert!(
        span.forward(&wrong, 0, &mut s).is_err(),
        "wrong hidden size"
    );
    span.forward(&x, 0, &mut s).unwrap();
    let long = Tensor::zeros((1, 4, 64), DType::F32, &Device::Cpu).unwrap();
    assert!(span.forward(&long, 5, &mut s).is_err(), "past max_length");
    assert_eq!(s.position(), 5);
}
