//! A span reads only its own blocks' tensors, the head reads no block at all, and bad input is a clear error.
mod common;

use common::*;
use petal_model::{BlockRange, ModelError, ModelSource, Placement};
use std::io::Write;

/// Loads `range` from a fresh source and returns the blocks its tensors belong to, the tensor count and bytes.
fn blocks_read(path: &std::path::Path, range: BlockRange) -> (Vec<Option<usize>>, usize, u64) {
    let source = ModelSource::open(path).unwrap();
    assert_eq!(
        source.load_log().names().len(),
        0,
        "opening must not load tensors"
    );
    source.load_span_on(range, &Placement::cpu_f32()).unwrap();
    let names = source.load_log().names();
    let blocks = names.iter().map(|n| source.weights().block_of(n)).collect();
    (blocks, names.len(), source.load_log().bytes())
}

#[test]
fn gguf_span_reads_only_its_blocks() {
    let (blocks, n, bytes) = blocks_read(&smollm_gguf(), BlockRange::new(10, 20));
    assert_eq!(n, 10 * 9, "9 tensors per block");
    assert!(
        blocks
            .iter()
            .all(|b| matches!(b, Some(i) if (10..20).contains(i))),
        "{blocks:?}"
    );
    // 98 MB file; ten of thirty Q4_1 blocks are well under a third of it.
    let file_len = std::fs::metadata(smollm_gguf()).unwrap().len();
    assert!(bytes < file_len / 3, "read {bytes} of {file_len} bytes");
    eprintln!("span 10..20 of SmolLM2 read {n} tensors, {bytes} bytes of {file_len}");
}

#[test]
fn llama2c_and_hf_spans_read_only_their_blocks() {
    for path in [stories_bin(), stories_hf()] {
        let (blocks, n, _) = blocks_read(&path, BlockRange::new(2, 4));
        assert_eq!(n, 2 * 9);
        assert!(
            blocks.iter().all(|b| matches!(b, Some(2 | 3))),
            "{}: {blocks:?}",
            path.display()
        );
    }
}

#[test]
fn head_reads_no_block() {
    for path in [stories_bin(), stories_hf(), smollm_gguf()] {
        let source = ModelSource::open(&path).unwrap();
        source.load_head(Placement::cpu_f32()).unwrap();
        let names = source.load_log().names();
        assert!(!names.is_empty());
        assert!(
            names.iter().all(|n| source.weights().block_of(n).is_none()),
            "{}: {names:?}",
            path.display()
        );
    }
}

#[test]
fn model_id_fingerprints_weights() {
    let a = ModelSource::open(stories_bin())
        .unwrap()
        .model_id()
        .unwrap();
    let b = ModelSource::open(stories_bin())
        .unwrap()
        .model_id()
        .unwrap();
    assert_eq!(a, b, "deterministic");
    let hf = ModelSource::open(stories_hf()).unwrap().model_id().unwrap();
    assert_ne!(a, hf, "another layout is another id");
    assert!(a.starts_with("stories260K-"), "{a}");

    // One changed weight byte in the middle of a tensor: another id.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("stories260K.bin");
    let mut bytes = std::fs::read(stories_bin()).unwrap();
    let embed_mid = 28 + 512 * 64 * 4 / 2;
    bytes[embed_mid] ^= 0x55;
    std::fs::write(&copy, &bytes).unwrap();
    let c = ModelSource::open(&copy).unwrap().model_id().unwrap();
    assert_ne!(a, c);
}

#[test]
fn missing_file_is_an_error() {
    let err = ModelSource::open("/nonexistent/model.gguf").unwrap_err();
    assert!(matches!(err, ModelError::NotFound(_)), "{err}");
    assert!(err.to_string().contains("/nonexistent/model.gguf"));
}

#[test]
fn blocks_out_of_range_are_errors() {
    let source = ModelSource::open(smollm_gguf()).unwrap();
    let p = Placement::cpu_f32();
    for (range, needle) in [
        (BlockRange::new(10, 40), "30 blocks"),
        (BlockRange::new(5, 5), "empty"),
        (BlockRange::new(20, 10), "reversed"),
    ] {
        let err = source
            .load_span_on(range, &p)
            .err()
            .expect("must fail")
            .to_string();
        assert!(err.contains(needle), "{range}: {err}");
    }
}

fn write(path: &std::path::Path, bytes: &[u8]) {
    std::fs::File::create(path)
        .unwrap()
        .write_all(bytes)
        .unwrap();
}

#[test]
fn corrupt_headers_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    // GGUF magic then garbage.
    let gguf = dir.path().join("bad.gguf");
    write(
        &gguf,
        b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xffjunk",
    );
    let err = ModelSource::open(&gguf).unwrap_err();
    assert!(
        matches!(err, ModelError::Corrupt { format: "GGUF", .. }),
        "{err}"
    );

    // A safetensors whose header length points past the end.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::copy(stories_hf().join("config.json"), hf.join("config.json")).unwrap();
    write(
        &hf.join("model.safetensors"),
        b"\xff\xff\x00\x00\x00\x00\x00\x00{\"a\":",
    );
    let err = ModelSource::open(&hf).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Corrupt {
                format: "safetensors",
                ..
            }
        ),
        "{err}"
    );

    // A llama2.c file cut short.
    let bin = dir.path().join("short.bin");
    let bytes = std::fs::read(stories_bin()).unwrap();
    write(&bin, &bytes[..bytes.len() / 2]);
    let err = ModelSource::open(&bin).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::Corrupt {
                format: "llama2.c",
                ..
            }
        ),
        "{err}"
    );

    // Unknown extension and content.
    let txt = dir.path().join("notes.txt");
    write(&txt, b"hello");
    assert!(matches!(
        ModelSource::open(&txt).unwrap_err(),
        ModelError::UnknownFormat(_)
    ));
}

#[test]
fn unknown_architecture_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let config = std::fs::read_to_string(stories_hf().join("config.json")).unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        config.replace("\"llama\"", "\"gpt2\""),
    )
    .unwrap();
    std::fs::copy(
        stories_hf().join("model.safetensors"),
        dir.path().join("model.safetensors"),
    )
    .unwrap();
    let err = ModelSource::open(dir.path()).unwrap_err();
    assert!(
        matches!(err, ModelError::UnknownArchitecture(ref a) if a == "gpt2"),
        "{err}"
    );
}
