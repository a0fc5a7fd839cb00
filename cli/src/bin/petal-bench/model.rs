//! The model under test: which one (`--model`, a freshly written synthetic one, or the default), where its parts
//! compute, and what is generated from it.
use crate::report::round;
use crate::Args;
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device};
use petal_model::compute::placement::parse_dtype;
use petal_model::models_dir::{default_model, missing_model, DEFAULT_MODEL};
use petal_model::synthetic::{self, SyntheticFamily, SyntheticShape, WeightDType};
use petal_model::text::prompt::encode_prompt;
use petal_model::{DeviceSpec, GenerationConfig, ModelSource, Placement, Tokenizer};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Seed of synthetic weights and prompts: the same shape always gives the same model id and tokens.
const SEED: u64 = 0x5EED_2024;
/// Decode steps of the per-hop probe (fewer when fewer tokens are generated).
const PROBE_STEPS: usize = 32;

/// Everything a measurement needs to know about the model under test.
pub struct Bench {
    pub path: PathBuf,
    pub source: ModelSource,
    /// Where the client's head (embeddings, norm, LM head) computes.
    pub head_placement: Placement,
    /// Where blocks compute, locally and on the nodes (the dtype the source's policy picks for `--dtype`).
    pub span_placement: Placement,
    pub device: DeviceSpec,
    pub workload: Workload,
    pub repeats: usize,
    /// When extra repeats stop (see `--budget-seconds`).
    pub deadline: Instant,
}

impl Bench {
    /// Whether repeat number `i` (0-based) of a measurement should run: the first always does.
    pub fn should_repeat(&self, i: usize) -> bool {
        i == 0 || (i < self.repeats && Instant::now() < self.deadline)
    }

    /// Probe steps: fewer once past the budget.
    pub fn probe_steps(&self) -> usize {
        let steps = self.workload.new_tokens().min(PROBE_STEPS);
        if Instant::now() < self.deadline {
            steps
        } else {
            steps.min(8)
        }
    }
}

/// What is generated: exactly `config.max_new_tokens` greedy tokens (EOS ignored) from `prompt`, as text through
/// the real sampler and detokeniser when the model has a tokenizer, else as token ids alone (synthetic models).
pub struct Workload {
    pub tokenizer: Option<Box<Tokenizer>>,
    pub prompt: Vec<u32>,
    pub config: GenerationConfig,
}

impl Workload {
    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    pub fn new_tokens(&self) -> usize {
        self.config.max_new_tokens
    }

    pub fn kind(&self) -> &'static str {
        if self.tokenizer.is_some() {
            "text"
        } else {
            "token_ids"
        }
    }
}

/// A directory removed when the bench ends, however it ends.
pub struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The synthetic shape called `name`, or an error listing them.
pub fn named_shape(name: &str) -> Result<SyntheticShape> {
    SyntheticShape::named(name).with_context(|| {
        let names: Vec<&str> = synthetic::SHAPES.iter().map(|s| s.name).collect();
        format!("unknown synthetic shape {name:?}: expected one of {names:?}")
    })
}

/// The model to benchmark: `--model`, a freshly written synthetic one, or the default SmolLM2. Returns its path,
/// what was written (JSON, for synthetic models) and the temp dir to remove at the end.
pub fn resolve(args: &Args) -> Result<(PathBuf, Value, Option<TempDir>)> {
    let Some(name) = &args.synthetic else {
        let path = match &args.model {
            Some(m) => petal_cli::hub::local_path(m)?,
            None => default_model().with_context(|| missing_model(DEFAULT_MODEL))?,
        };
        return Ok((path, Value::Null, None));
    };
    let shape = named_shape(name)?;
    let family = SyntheticFamily::parse(&args.family).with_context(|| {
        let names: Vec<&str> = SyntheticFamily::ALL.iter().map(|f| f.name()).collect();
        format!(
            "unknown family {:?}: expected one of {names:?}",
            args.family
        )
    })?;
    let shape = shape.with_family(family);
    let dtype = WeightDType::parse(&args.dtype)
        .with_context(|| format!("--dtype {:?}: expected f32, f16 or bf16", args.dtype))?;
    // The directory's name becomes the model's name (and part of its id), so keep it stable.
    let leaf = match family {
        SyntheticFamily::Llama => format!("synthetic-{}-{}", shape.name, dtype.name()),
        f => format!("synthetic-{}-{}-{}", shape.name, f.name(), dtype.name()),
    };
    let (dir, temp) = match &args.synthetic_dir {
        Some(d) => (d.clone(), None),
        None => {
            let root = std::env::temp_dir().join(format!("petal-bench-{}", std::process::id()));
            (root.join(&leaf), Some(TempDir(root)))
        }
    };
    eprintln!(
        "synthetic  writing {} ({:.0}M parameters, {}) to {}",
        shape.name,
        shape.parameters() as f64 / 1e6,
        dtype.name(),
        dir.display()
    );
    let t = Instant::now();
    let written = synthetic::write_model(&dir, &shape, dtype, SEED)
        .with_context(|| format!("writing the synthetic model to {}", dir.display()))?;
    let info = json!({
        "shape": shape.name,
        "family": family.name(),
        "parameters": shape.parameters(),
        "weight_dtype": dtype.name(),
        "file_bytes": written.bytes,
        "written": written.written,
        "write_seconds": round(t.elapsed().as_secs_f64(), 2),
    });
    Ok((dir, info, temp))
}

/// Where the model computes: `--device` as named and as opened, and `--dtype`. Checked before the model is
/// written or loaded.
pub struct Target {
    pub device: DeviceSpec,
    pub opened: Device,
    pub dtype: DType,
}

impl Target {
    pub fn parse(args: &Args) -> Result<Self> {
        let dtype = parse_dtype(&args.dtype)?;
        let device = DeviceSpec::parse(&args.device)?;
        let opened = device.open()?;
        Ok(Self {
            device,
            opened,
            dtype,
        })
    }
}

/// Opens the model and decides the placements (on `target`) and the workload.
pub fn prepare(args: &Args, path: PathBuf, target: Target, deadline: Instant) -> Result<Bench> {
    let Target {
        device,
        opened,
        dtype,
    } = target;
    let source = ModelSource::open(&path).with_context(|| format!("opening {}", path.display()))?;
    let synthetic_1b = args
        .synthetic
        .as_deref()
        .is_some_and(|s| s.trim().eq_ignore_ascii_case("1b"));
    let new_tokens = args
        .new_tokens
        .unwrap_or(if synthetic_1b { 16 } else { 64 });
    ensure!(
        new_tokens >= 2,
        "--new-tokens must be at least 2 (the first token is prefill)"
    );
    let workload = workload(args, &source, new_tokens)?;
    let max = source.spec().max_position;
    ensure!(
        workload.prompt_len() + new_tokens <= max,
        "prompt ({}) plus new tokens ({new_tokens}) exceed the model's {max} positions",
        workload.prompt_len()
    );
    Ok(Bench {
        path,
        span_placement: source.block_placement(&opened, Some(dtype)),
        head_placement: Placement::new(opened, dtype),
        device,
        source,
        workload,
        repeats: args.repeats,
        deadline,
    })
}

/// The encoded prompt through the model's tokenizer, or (synthetic models, models without one) random ids.
fn workload(args: &Args, source: &ModelSource, new_tokens: usize) -> Result<Workload> {
    let config = GenerationConfig {
        max_new_tokens: new_tokens,
        ignore_eos: true,
        ..GenerationConfig::default()
    };
    let tokenizer = match (args.synthetic.is_some(), source.tokenizer(None)) {
        (false, Ok(tokenizer)) => tokenizer,
        (synthetic, tokenizer) => {
            if let (false, Err(e)) = (synthetic, tokenizer) {
                eprintln!("note       no tokenizer ({e}); driving the model with token ids");
            }
            let prompt = prompt_ids(args.id_prompt_tokens, source.spec().vocab_size);
            return Ok(Workload {
                tokenizer: None,
                prompt,
                config,
            });
        }
    };
    let chat = !args.no_chat && tokenizer.chat_template().is_some();
    let prompt = encode_prompt(&tokenizer, &args.prompt, chat, None)?;
    ensure!(!prompt.is_empty(), "the prompt encodes to no tokens");
    Ok(Workload {
        tokenizer: Some(Box::new(tokenizer)),
        prompt,
        config,
    })
}

/// A fixed pseudo-random prompt of `n` ids, avoiding the usual special ids 0..3.
pub fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(3).max(1) as u64;
    let mut state = SEED;
    (0..n.max(1))
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (3 + (state >> 33) % span) as u32
        })
        .collect()
}

/// Bytes of the model's weight files: the file itself, or a directory's safetensors.
pub fn weights_bytes(path: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
    if !path.is_dir() {
        return size(path);
    }
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .map(|p| size(&p))
                .sum()
        })
        .unwrap_or(0)
}
