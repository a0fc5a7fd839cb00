//! `petal-bench gguf`: writes a random-weight model of a real shape (8B, 14B, 70B, Qwen3-30B-A3B) as a GGUF file
//! in a format users download, for the bench, the tests and a GPU host, none of which can be sent a 4-40 GB file.
use anyhow::{Context, Result};
use petal_model::models_dir::{default_model, missing_model, DEFAULT_MODEL};
use petal_model::synthetic::{self, GgufFormat, GgufTokenizer};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct GgufArgs {
    /// Shape: 8b (Llama-3-8B), 14b, 70b (Llama-3-70B), 30b-a3b (Qwen3-30B-A3B, a mixture of experts),
    /// deepseek-v2-lite, gpt-oss-20b, moe-1b, or a smaller one of `--synthetic`'s.
    #[arg(long, default_value = "8b")]
    shape: String,
    /// File type, as llama-quantize names it: q4_0, q8_0, q4_k_m, q5_k_m, f32 or mxfp4_moe (experts in MXFP4,
    /// the rest Q8_0: gpt-oss's files).
    #[arg(long, default_value = "q4_0")]
    format: String,
    /// The GGUF whose tokenizer (and so vocabulary) the file carries [default: SmolLM2's, a 49152-token
    /// vocabulary, from $PETAL_MODELS or ../shared/models].
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where to write it; kept as is when it already holds this shape, format, tokenizer and seed.
    #[arg(long)]
    out: PathBuf,
}

/// Writes the file; returns what was written, as JSON.
pub fn run(args: &GgufArgs) -> Result<Value> {
    let shape = crate::model::named_shape(&args.shape)?;
    let format = GgufFormat::parse(&args.format).with_context(|| {
        let names: Vec<&str> = GgufFormat::ALL.iter().map(|f| f.name()).collect();
        format!(
            "unknown format {:?}: expected one of {names:?}",
            args.format
        )
    })?;
    let tokenizer_path = match &args.tokenizer {
        Some(p) => p.clone(),
        None => default_model().with_context(|| missing_model(DEFAULT_MODEL))?,
    };
    let tokenizer = GgufTokenizer::from_gguf(&tokenizer_path)
        .with_context(|| format!("reading the tokenizer of {}", tokenizer_path.display()))?;
    let started = Instant::now();
    let written = synthetic::write_gguf(&args.out, &shape, format, &tokenizer, args.seed)
        .with_context(|| format!("writing {}", args.out.display()))?;
    let seconds = started.elapsed().as_secs_f64();
    Ok(json!({
        "path": written.path,
        "shape": shape.name,
        "format": format.name(),
        "vocab": tokenizer.vocab_size(),
        "bytes": written.bytes,
        "written": written.written,
        "seconds": (seconds * 100.0).round() / 100.0,
    }))
}
