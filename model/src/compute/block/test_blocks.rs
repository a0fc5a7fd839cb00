//! What the block tests share: the default model's blocks, a model's blocks on a placement, every synthetic
//! family's blocks, and the largest magnitude of a tensor.
use super::Block;
use crate::compute::placement::Placement;
use crate::models_dir::{find_model, missing_model, DEFAULT_MODEL};
use crate::{BlockRange, ModelSource};
use candle_core::{DType, Tensor};
use std::path::{Path, PathBuf};

/// The default model (SmolLM2-135M-Instruct Q4_1); the test fails saying where it looked when it is missing.
pub(crate) fn default_model() -> PathBuf {
    find_model(DEFAULT_MODEL).unwrap_or_else(|| panic!("{}", missing_model(DEFAULT_MODEL)))
}

/// Every block of the model at `path`, loaded onto `placement`, and its hidden size.
pub(crate) fn blocks_of(path: &Path, placement: &Placement) -> (Vec<Block>, usize) {
    let source = ModelSource::open(path).unwrap();
    let range = BlockRange::new(0, source.spec().num_blocks);
    let span = source.load_span_on(range, placement).unwrap();
    (span.blocks().to_vec(), source.spec().hidden_size)
}

/// Every synthetic family's attention and blocks, for tests of what families vary (QK norms, softcaps, windows, a
/// second RoPE base, interleaved RoPE, fused projections): the small `MINI` shape with windows of four positions,
/// f32 weights, loaded onto `placement` and handed to `check` with the hidden size.
#[cfg(feature = "synthetic")]
pub(crate) fn for_each_family(placement: &Placement, mut check: impl FnMut(&[Block], usize)) {
    use crate::synthetic::{write_model, SyntheticFamily, SyntheticShape, WeightDType, MINI};
    for family in SyntheticFamily::ALL {
        let dir = tempfile::tempdir().unwrap();
        let shape = SyntheticShape {
            sliding_window: Some(4),
            ..MINI.with_family(family)
        };
        write_model(dir.path(), &shape, WeightDType::F32, 7).unwrap();
        let (blocks, hidden) = blocks_of(dir.path(), placement);
        check(&blocks, hidden);
    }
}

/// The largest absolute value of `t`, in f32.
pub(crate) fn largest_abs(t: &Tensor) -> f32 {
    t.to_dtype(DType::F32)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}
