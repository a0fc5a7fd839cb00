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

/// Hashes are kept on disk after the first read: a second source over the unchanged file takes them from the
/// cache (shown by a planted value coming back), and a file with a new modification time, or a cache file that is
/// not JSON, makes them read and hashed again.
#[test]
fn block_hashes_are_cached_until_the_file_changes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("stories260K.bin");
    std::fs::copy(stories_bin(), &model).expect("copy model");
    let cache_dir = dir.path().join("cache");
    let open = || {
        let mut source = ModelSource::open(&model).expect("open");
        source.set_hash_cache(Some(cache_dir.clone()));
        source
    };
    let cache_files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(cache_dir.join("block-hashes"))
            .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
            .unwrap_or_default()
    };
    let truth = open().manifest().expect("hashes").to_vec();
    let files = cache_files();
    assert_eq!(files.len(), 1, "one cache file: {files:?}");

    let planted = "ab".repeat(32);
    let mut entry: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&files[0]).expect("read cache")).expect("json");
    assert_eq!(
        entry["blocks"].as_object().map(|b| b.len()),
        Some(truth.len())
    );
    entry["blocks"]["0"] = planted.clone().into();
    std::fs::write(&files[0], entry.to_string()).expect("plant");
    let cached = open().block_hashes(BlockRange::new(0, 2)).expect("cached");
    assert_eq!(
        cached,
        vec![planted, truth[1].clone()],
        "read from the cache"
    );

    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&model)
        .and_then(|f| f.set_modified(later))
        .expect("touch");
    assert_eq!(open().manifest().expect("rehashed").to_vec(), truth);
    assert_eq!(cache_files().len(), 2, "a new entry for the changed file");
    for file in cache_files() {
        std::fs::write(file, "not json").expect("garble");
    }
    assert_eq!(open().manifest().expect("rehashed").to_vec(), truth);
}
