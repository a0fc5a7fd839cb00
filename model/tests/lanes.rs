//! A CPU batch big enough to go through the span in lanes (its sessions split between the pool's threads) gives
//! every session what it gives alone, bit for bit, and a bad step in a lane fails alone: whether its sessions all
//! take the whole span (their rows then stay joined from block to block) or some take only part of it.
mod common;

use candle_core::{DType, Tensor};
use common::*;
use petal_model::{
    BatchStep, BlockRange, BlockSpan, ModelError, ModelSource, Placement, SpanCache,
};

const SESSIONS: usize = 16;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

/// Sixteen sessions, session `i` over `ranges[i % ranges.len()]` of the span.
fn batch_in_lanes_equals_each_step_alone(kv: Option<DType>, ranges: &[(usize, usize)]) {
    let source = ModelSource::open(smollm_gguf()).unwrap();
    let head = source.load_head(Placement::cpu_f32()).unwrap();
    let range = BlockRange::new(0, source.spec().num_blocks);
    let mut span: BlockSpan = source.load_span_on(range, &Placement::cpu_f32()).unwrap();
    span.set_kv_dtype(kv);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    assert_eq!(pool.install(|| span.lanes(SESSIONS, SESSIONS)), 2);
    assert_eq!(
        pool.install(|| span.lanes(4, 4)),
        1,
        "too few rows for two lanes"
    );
    // Sixteen sessions at different positions (prompts of 1 to 4 tokens), each prefilled alone.
    let prompts: Vec<Vec<u32>> = (0..SESSIONS as u32)
        .map(|i| (0..1 + i % 4).map(|k| 17 + 131 * i + 7 * k).collect())
        .collect();
    let prefilled = || -> Vec<SpanCache> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let (first, last) = ranges[i % ranges.len()];
                let mut c = span.new_cache(BlockRange::new(first, last), 64).unwrap();
                span.forward(&head.embed(p).unwrap(), 0, &mut c).unwrap();
                c
            })
            .collect()
    };
    let next: Vec<Tensor> = (0..SESSIONS as u32)
        .map(|i| head.embed(&[300 + i]).unwrap())
        .collect();
    let mut caches = prefilled();
    let alone: Vec<Tensor> = caches
        .iter_mut()
        .zip(&next)
        .zip(&prompts)
        .map(|((c, x), p)| span.forward(x, p.len(), c).unwrap())
        .collect();
    let mut caches = prefilled();
    // A step at a wrong position, in the second lane.
    let mut wrong = span.new_cache(span.range(), 64).unwrap();
    let mut steps: Vec<BatchStep> = caches
        .iter_mut()
        .zip(&next)
        .zip(&prompts)
        .map(|((cache, x), p)| BatchStep {
            hidden: x.clone(),
            position: p.len(),
            cache,
        })
        .collect();
    steps.insert(
        12,
        BatchStep {
            hidden: head.embed(&[5]).unwrap(),
            position: 3,
            cache: &mut wrong,
        },
    );
    let mut batched = pool.install(|| span.forward_batch(&mut steps));
    drop(steps);
    let refused = batched.remove(12);
    assert!(
        matches!(
            refused,
            Err(ModelError::Position {
                expected: 0,
                got: 3
            })
        ),
        "{refused:?}"
    );
    assert_eq!(wrong.position(), 0, "a refused step changes nothing");
    for (i, (b, a)) in batched.into_iter().zip(&alone).enumerate() {
        let b = b.unwrap_or_else(|e| panic!("session {i}: {e}"));
        assert_eq!(
            bits(&b),
            bits(a),
            "session {i}: batched in lanes differs from alone"
        );
    }
    for (c, p) in caches.iter().zip(&prompts) {
        assert_eq!(c.position(), p.len() + 1);
    }
}

const WHOLE: [(usize, usize); 1] = [(0, 30)];
/// Whole and partial: lanes in which the rows cannot stay joined.
const PARTS: [(usize, usize); 4] = [(0, 30), (0, 10), (10, 30), (5, 25)];

#[test]
fn a_batch_in_lanes_equals_each_step_alone_on_f32_caches() {
    batch_in_lanes_equals_each_step_alone(None, &WHOLE);
}

#[test]
fn a_batch_in_lanes_equals_each_step_alone_on_f16_caches() {
    batch_in_lanes_equals_each_step_alone(Some(DType::F16), &WHOLE);
}

#[test]
fn sessions_of_parts_of_the_span_batched_in_lanes_equal_each_alone() {
    batch_in_lanes_equals_each_step_alone(Some(DType::F16), &PARTS);
}
