//! Defaults shared by `petal demo` and `petal-bench`.
use std::path::PathBuf;

/// The default model, relative to a models root: SmolLM2-135M-Instruct as Q4_1 GGUF.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model under `$PETAL_MODELS`, `../shared/models` (from the working directory), or the repository's
/// `../shared/models`, whichever has it first. Models are never downloaded.
pub fn default_model() -> Option<PathBuf> {
    let mut roots = vec![];
    if let Ok(dir) = std::env::var("PETAL_MODELS") {
        roots.push(PathBuf::from(dir));
    }
    roots.push(PathBuf::from("../shared/models"));
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models"));
    roots
        .into_iter()
        .map(|r| r.join(DEFAULT_MODEL))
        .find(|p| p.exists())
}

/// The error text when [`default_model`] finds nothing.
pub fn default_model_missing() -> String {
    format!("default model {DEFAULT_MODEL} not found under $PETAL_MODELS or ../shared/models; pass --model PATH")
}
