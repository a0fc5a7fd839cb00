//! Where model files are found on this machine without being told: the one lookup shared by the demo, the bench
//! and every test. Models are never downloaded.
use std::path::PathBuf;

/// The default model, relative to a models directory: SmolLM2-135M-Instruct as Q4_1 GGUF.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Candidate models directories, in order: `$PETAL_MODELS`, `../shared/models` from the working directory, and
/// `../shared/models` beside this source checkout.
fn roots() -> Vec<PathBuf> {
    let mut roots = vec![];
    if let Some(dir) = std::env::var_os("PETAL_MODELS") {
        roots.push(PathBuf::from(dir));
    }
    roots.push(PathBuf::from("../shared/models"));
    roots.push(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/models"));
    roots
}

/// `relative` (e.g. `stories260K/stories260K.bin`) under the first models directory that has it.
pub fn find_model(relative: &str) -> Option<PathBuf> {
    roots()
        .into_iter()
        .map(|r| r.join(relative))
        .find(|p| p.exists())
}

/// The default model ([`DEFAULT_MODEL`]) under the first models directory that has it.
pub fn default_model() -> Option<PathBuf> {
    find_model(DEFAULT_MODEL)
}

/// What to tell the user when [`find_model`] finds nothing.
pub fn missing_model(relative: &str) -> String {
    format!(
        "model {relative} not found under $PETAL_MODELS or ../shared/models (beside the working directory or the \
         checkout); pass --model PATH"
    )
}
