//! A sequence run through a span in one step, in chunks, or token by token gives the same hidden states (f32: up
//! to the order of sums). Quantized-activation kernels (Q4_1 x Q8_1) round each row's inputs to 8 bits, which
//! turns those 1e-7 differences into about 1e-2 over 30 blocks: that is why verification replays a hop's steps
//! exactly as the hop got them (see client/src/chain/verify.rs) rather than batched.
mod common;

use candle_core::{DType, Tensor, D};
use common::*;
use petal_model::{BlockRange, ModelSource, Placement};

/// The span's output for `ids`, sent in steps of `chunks` tokens.
fn run(source: &ModelSource, ids: &[u32], chunks: &[usize]) -> Tensor {
    run_kv(source, ids, chunks, None)
}

/// [`run`] with keys and values stored in `kv` (`None`: f32, the blocks' dtype).
fn run_kv(source: &ModelSource, ids: &[u32], chunks: &[usize], kv: Option<DType>) -> Tensor {
    let p = Placement::cpu_f32();
    let head = source.load_head(p.clone()).unwrap();
    let mut span = source
        .load_span_on(BlockRange::new(0, source.spec().num_blocks), &p)
        .unwrap();
    span.set_kv_dtype(kv);
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

/// A prompt longer than a chunk of queries (256): each chunk scores only the keys its queries may see, and the
/// f16 cache's tiles only theirs. Both match the prompt sent token by token, where every step sees all it holds:
/// f32 to the order of sums (1.6e-6 here), f16 to its rounding (1.2e-3 here, as before the tiles: a 1e-7 change
/// in a key can move its f16 value by a unit in the last place, 5e-4; a wrong mask would be off by far more).
#[test]
fn prompts_longer_than_a_query_chunk_match_token_by_token() {
    let source = ModelSource::open(stories_bin()).unwrap();
    let ids: Vec<u32> = (0..500).map(|i| 10 + (i * 7) % 400).collect();
    for (kv, tolerance) in [(None, 1e-5), (Some(DType::F16), 5e-3)] {
        let steps = run_kv(&source, &ids, &[1; 500], kv);
        for chunks in [vec![500], vec![300, 200], vec![3, 257, 240]] {
            let d = relative(&steps, &run_kv(&source, &ids, &chunks, kv));
            assert!(d < tolerance, "{kv:?}, chunks {chunks:?}: {d:e}");
        }
    }
}
