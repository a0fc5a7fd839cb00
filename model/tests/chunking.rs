//! A sequence run through a span in one step, in chunks, or token by token gives the same hidden states (f32: up
//! to the order of sums). Quantized-activation kernels (Q4_1 x Q8_1) round each row's inputs to 8 bits, which
//! turns those 1e-7 differences into about 1e-2 over 30 blocks: that is why verification replays a hop's steps
//! exactly as the hop got them (see client/src/chain/verify.rs) rather than batched.
mod common;

use candle_core::{Tensor, D};
use common::*;
use petal_model::{BlockRange, ModelSource, Placement};

/// The span's output for `ids`, sent in steps of `chunks` tokens.
fn run(source: &ModelSource, ids: &[u32], chunks: &[usize]) -> Tensor {
    let p = Placement::cpu_f32();
    let head = source.load_head(p.clone()).unwrap();
    let span = source
        .load_span_on(BlockRange::new(0, source.spec().num_blocks), &p)
        .unwrap();
    let mut cache = span.new_cache(span.range(), 512).unwrap();
    let mut outs = vec![];
    let mut pos = 0;
    for &n in chunks {
        let x = head.embed(&ids[pos..pos + n]).unwrap();
        outs.push(span.forward(&x, pos, &mut cache).unwrap());
        pos += n;
    }
    Tensor::cat(&outs, 1).unwrap()
}

/// The worst row's relative L2 distance.
fn relative(a: &Tensor, b: &Tensor) -> f32 {
    let norm = |t: &Tensor| t.sqr().unwrap().sum(D::Minus1).unwrap().sqrt().unwrap();
    let r = (norm(&(a - b).unwrap()) / norm(a)).unwrap();
    r.flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

#[test]
fn f32_chunks_and_single_tokens_match_one_step() {
    let source = ModelSource::open(stories_bin()).unwrap();
    let ids: Vec<u32> = (0..40).map(|i| 10 + i * 7).collect();
    let whole = run(&source, &ids, &[40]);
    for chunks in [vec![20, 20], vec![7, 1, 32], vec![1; 40]] {
        let d = relative(&whole, &run(&source, &ids, &chunks));
        assert!(d < 1e-5, "chunks {chunks:?}: {d:e}");
    }
}
