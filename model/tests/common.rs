//! Paths of the shared model files (never downloaded: they sit in ../shared beside the checkout).
#![allow(dead_code)]
use candle_core::Tensor;
use petal_model::{BlockRange, BlockSpan, Head, ModelSource, Placement, SpanCache};
use std::path::PathBuf;

/// A shared model file, found by the one lookup (`$PETAL_MODELS`, else ../shared/models).
pub fn shared_model(relative: &str) -> PathBuf {
    petal_model::models_dir::find_model(relative)
        .unwrap_or_else(|| panic!("{}", petal_model::models_dir::missing_model(relative)))
}

pub fn stories_bin() -> PathBuf {
    shared_model("stories260K/stories260K.bin")
}

pub fn stories_hf() -> PathBuf {
    shared_model("stories260K/hf")
}

pub fn smollm_gguf() -> PathBuf {
    shared_model(petal_model::models_dir::DEFAULT_MODEL)
}

/// Largest absolute difference between two f32 tensors of the same shape.
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn argmax(logits: &candle_core::Tensor) -> u32 {
    logits
        .flatten_all()
        .unwrap()
        .argmax(0)
        .unwrap()
        .to_scalar::<u32>()
        .unwrap()
}

/// The oracle harness: a span-by-span run must match candle-transformers' monolithic models, logits within 1e-4
/// (f32) and the same greedy tokens over 64 steps.
pub const STEPS: usize = 64;
pub const TOLERANCE: f32 = 1e-4;

/// The model as Petal runs it: a head plus several spans, each with its own session cache.
pub struct Composed {
    head: Head,
    spans: Vec<(BlockSpan, SpanCache)>,
    position: usize,
}

impl Composed {
    pub fn new(source: &ModelSource, cuts: &[(usize, usize)]) -> Self {
        let p = Placement::cpu_f32();
        let head = source.load_head(p.clone()).unwrap();
        let spans = cuts
            .iter()
            .map(|&(a, b)| {
                let span = source.load_span_on(BlockRange::new(a, b), &p).unwrap();
                let cache = span
                    .new_cache(span.range(), source.spec().max_position)
                    .unwrap();
                (span, cache)
            })
            .collect();
        Self {
            head,
            spans,
            position: 0,
        }
    }

    pub fn logits(&mut self, ids: &[u32]) -> Tensor {
        let mut x = self.head.embed(ids).unwrap();
        for (span, cache) in &mut self.spans {
            x = span.forward(&x, self.position, cache).unwrap();
        }
        self.position += ids.len();
        self.head.logits(&x).unwrap().squeeze(0).unwrap()
    }
}

/// Runs the prompt, then 64 greedy steps, through both; each step compares logits and the chosen token.
pub fn compare(
    ours: &mut Composed,
    oracle: impl FnMut(&[u32], usize) -> Tensor,
    prompt: &[u32],
) -> Vec<u32> {
    compare_within(ours, oracle, prompt, TOLERANCE, Greedy::Same)
}

/// How [`compare_within`] judges our greedy token against the oracle's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Greedy {
    /// The oracle's own argmax.
    Same,
    /// A token whose oracle logit is within twice the tolerance of the oracle's best (a near tie may go either way
    /// when the oracle sums in another order); both models are fed our token, so they stay in step.
    NearBest,
}

/// [`compare`] with logits within `tolerance` of the oracle's and our tokens judged by `greedy`.
pub fn compare_within(
    ours: &mut Composed,
    mut oracle: impl FnMut(&[u32], usize) -> Tensor,
    prompt: &[u32],
    tolerance: f32,
    greedy: Greedy,
) -> Vec<u32> {
    let mut input = prompt.to_vec();
    let mut pos = 0;
    let mut tokens = vec![];
    let mut worst = 0f32;
    for step in 0..STEPS {
        let a = ours.logits(&input);
        let b = oracle(&input, pos);
        let diff = max_abs_diff(&a, &b);
        worst = worst.max(diff);
        assert!(diff < tolerance, "step {step}: logits differ by {diff}");
        let (ta, tb) = (argmax(&a), argmax(&b));
        match greedy {
            Greedy::Same => assert_eq!(ta, tb, "step {step}: greedy tokens differ"),
            Greedy::NearBest => {
                let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
                let gap = b[tb as usize] - b[ta as usize];
                assert!(
                    gap <= 2.0 * tolerance,
                    "step {step}: our token {ta} is {gap} below the oracle's {tb}"
                );
            }
        }
        pos += input.len();
        tokens.push(ta);
        input = vec![ta];
    }
    eprintln!("max |logit diff| over {STEPS} steps: {worst:e}");
    tokens
}
