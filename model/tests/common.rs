//! Paths of the shared model files (never downloaded: they sit in ../shared beside the checkout).
#![allow(dead_code)]
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
