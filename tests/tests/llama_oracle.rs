//! llama.cpp as the oracle of the GGUF architectures candle has no CPU model of: a random-weight GGUF of each (f32
//! matrices, so that no quantized kernel of either engine stands between them; SmolLM2's tokenizer, so both tokenize
//! the same text) gives llama.cpp's `llama-simple` greedy text, 16 tokens, run locally and over a 2-node split.
//!
//! Ignored by default: it needs llama.cpp's `llama-simple`, which `scripts/llama-oracle` builds from the
//! llama-cpp-python sdist (about ten minutes on two cores, beyond CI's budget) and then runs these with
//! `LLAMA_SIMPLE` naming it.
use petal_model::synthetic::{
    gpt_oss_gguf_from_hf, gpt_oss_mxfp4_checkpoint, write_gguf, write_model, GgufFormat,
    GgufTokenizer, SyntheticFamily, SyntheticShape, WeightDType,
};
use petal_tests::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const NEW_TOKENS: usize = 16;
const PROMPT: &str = "The capital of France is";
const SEED: u64 = 3;

fn llama_simple() -> PathBuf {
    let path = std::env::var_os("LLAMA_SIMPLE")
        .map(PathBuf::from)
        .expect("LLAMA_SIMPLE names llama.cpp's llama-simple (scripts/llama-oracle builds it)");
    assert!(path.is_file(), "no llama-simple at {}", path.display());
    path
}

/// llama.cpp's greedy continuation of `PROMPT` (`llama-simple` prints the prompt, then what it generated).
fn llama_text(model: &Path) -> String {
    let mut cmd = Command::new(llama_simple());
    cmd.arg("-m")
        .arg(model)
        .args(["-n", &NEW_TOKENS.to_string(), PROMPT]);
    let out = run_with_timeout(cmd, Duration::from_secs(120));
    assert!(out.success(), "{out}");
    let text = out.stdout.trim_end_matches('\n');
    text.strip_prefix(PROMPT)
        .unwrap_or_else(|| panic!("llama-simple did not echo the prompt: {text:?}"))
        .to_string()
}

/// The shape written as an f32 GGUF with SmolLM2's tokenizer, llama.cpp's text, and ours locally and over two nodes.
fn matches_llama_cpp(shape: SyntheticShape, spans: [&str; 2]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let path = dir.path().join(format!("{}-f32.gguf", shape.name));
    write_gguf(&path, &shape, GgufFormat::F32, &tokenizer, SEED).expect("write the GGUF");
    file_matches_llama_cpp(shape.name, &path, spans);
}

/// llama.cpp's text of the GGUF at `path`, and ours locally and over two nodes.
fn file_matches_llama_cpp(name: &str, path: &Path, spans: [&str; 2]) {
    let expected = llama_text(path);
    let greedy = |g: Generate| {
        g.max_new_tokens(NEW_TOKENS)
            .ignore_eos()
            .args(&["--temperature", "0"])
            .run_json()
    };
    let local = greedy(Generate::new(path, PROMPT).local());
    assert_eq!(local.tokens.len(), NEW_TOKENS);
    assert_eq!(local.text, expected, "{name}: local run vs llama.cpp");
    let swarm = Swarm::builder()
        .node_with(path, spans[0], &[])
        .node_with(path, spans[1], &[])
        .start();
    let remote = greedy(swarm.generate(path, PROMPT));
    assert_eq!(remote.text, expected, "{name}: two nodes vs llama.cpp");
}

fn tiny(name: &str) -> SyntheticShape {
    SyntheticShape::named(name).expect("a named shape")
}

/// DeepSeek-V3: sigmoid routing over the best two of four groups with the choice bias, renormalised and scaled
/// weights, a shared expert, low-rank queries, latent attention split as llama.cpp's MLA files are, YaRN.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn deepseek_v3_gguf_equals_llama_cpp() {
    matches_llama_cpp(tiny("deepseek-tiny"), ["0..3", "3..6"]);
}

/// DeepSeek-V2: softmax routing, weights scaled and not renormalised, no groups.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn deepseek_v2_gguf_equals_llama_cpp() {
    matches_llama_cpp(
        tiny("deepseek-tiny").with_family(SyntheticFamily::DeepseekV2),
        ["0..2", "2..6"],
    );
}

/// Qwen3-MoE, stacked experts renormalised.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn qwen3moe_gguf_equals_llama_cpp() {
    matches_llama_cpp(tiny("moe-tiny"), ["0..3", "3..6"]);
}

/// gpt-oss: attention sinks, every other layer windowed (a window the generation outgrows), biases on attention,
/// router and experts, the clamped SwiGLU (biases large enough to reach the clamp), YaRN, softmax over the best
/// experts' logits.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn gpt_oss_gguf_equals_llama_cpp() {
    matches_llama_cpp(tiny("gpt-oss-tiny"), ["0..1", "1..4"]);
}

/// gpt-oss from its HF checkpoint's layout (stacked, input-major experts with gate and up interleaved): the
/// checkpoint converted as llama.cpp's converter does gives llama.cpp's text; tests/tests/families.rs checks that
/// the checkpoint itself gives the converted file's tokens.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn gpt_oss_hf_converted_equals_llama_cpp() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let shape = SyntheticShape {
        vocab_size: tokenizer.vocab_size(),
        ..tiny("gpt-oss-tiny")
    };
    let hf = dir.path().join("hf");
    write_model(&hf, &shape, WeightDType::BF16, SEED).expect("write the checkpoint");
    let path = dir.path().join("converted.gguf");
    gpt_oss_gguf_from_hf(&shape, &hf, &path, Some(&tokenizer)).expect("convert");
    file_matches_llama_cpp("gpt-oss converted", &path, ["0..2", "2..4"]);
}

/// gpt-oss as OpenAI ships it, experts in MXFP4, converted as llama.cpp's converter does (the experts stay MXFP4,
/// the rest f32): llama.cpp's MXFP4 kernels (with Q8_0 activations) against ours, in the same order of sums.
/// tests/tests/families.rs checks that the checkpoint itself gives the converted file's tokens.
#[test]
#[ignore = "needs llama.cpp's llama-simple: scripts/llama-oracle"]
fn gpt_oss_mxfp4_converted_equals_llama_cpp() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let shape = SyntheticShape {
        vocab_size: tokenizer.vocab_size(),
        ..tiny("gpt-oss-tiny")
    };
    let (hf, mxfp4) = (dir.path().join("hf"), dir.path().join("mxfp4"));
    write_model(&hf, &shape, WeightDType::BF16, SEED).expect("write the checkpoint");
    gpt_oss_mxfp4_checkpoint(&hf, &mxfp4).expect("quantize its experts");
    let path = dir.path().join("converted-mxfp4.gguf");
    gpt_oss_gguf_from_hf(&shape, &mxfp4, &path, Some(&tokenizer)).expect("convert");
    file_matches_llama_cpp("gpt-oss MXFP4 converted", &path, ["0..2", "2..4"]);
}
