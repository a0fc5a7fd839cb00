//! Block hashes pin the exact weights: one changed byte in one block changes that block's hash and no other, while
//! the sampled model id stays the same (which is why the hashes exist). Every format hashes the same way.
mod common;
use common::*;
use petal_model::{BlockRange, ModelSource};
use std::path::Path;

/// A copy of `model` (a file, or a directory) in `dir` with the float at `at` of the file `file` (the model file
/// itself when `None`) made huge: its most significant byte is flipped.
fn corrupted_copy(model: &Path, dir: &Path, at: f64) -> std::path::PathBuf {
    let target = dir.join(model.file_name().expect("file name"));
    let mut bytes = std::fs::read(model).expect("read model");
    let offset = ((bytes.len() as f64 * at) as usize) & !3;
    bytes[offset + 3] ^= 0x40;
    std::fs::write(&target, bytes).expect("write copy");
    target
}

fn check(model: &Path, at: f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let honest = ModelSource::open(model).expect("open");
    let bad = ModelSource::open(corrupted_copy(model, dir.path(), at)).expect("open copy");
    let n = honest.spec().num_blocks;
    let (a, b) = (
        honest.manifest().expect("hashes"),
        bad.manifest().expect("hashes"),
    );
    assert_eq!(a.len(), n);
    assert_eq!(a, honest.manifest().expect("again"), "hashes are stable");
    let differing: Vec<usize> = (0..n).filter(|&i| a[i] != b[i]).collect();
    assert_eq!(
        differing.len(),
        1,
        "{}: blocks {differing:?} differ",
        model.display()
    );
    assert_eq!(
        honest.block_hashes(BlockRange::new(1, 3)).expect("range"),
        a[1..3].to_vec()
    );
    assert_eq!(
        honest.model_id().expect("id"),
        bad.model_id().expect("id"),
        "this byte is outside the id's sample, so only the block hashes can tell the two apart"
    );
}

#[test]
fn one_changed_byte_changes_one_block_hash_only() {
    // llama2.c: blocks sit between the embedding table and the final norm.
    check(&stories_bin(), 0.4);
    // GGUF (Q4_1).
    check(&smollm_gguf(), 0.5);
}
