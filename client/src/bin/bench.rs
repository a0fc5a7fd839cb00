//! `petal-bench`: what a Petal swarm costs compared with running the model in one process.
//!
//! The model runs locally first (greedy, a fixed number of tokens, EOS ignored), then through in-process swarms on
//! loopback (a bootstrap peer and `k` nodes splitting the blocks evenly, for each `k` of `--chains`). One JSON
//! object on stdout reports tokens/s, the ratio to local, the latency each hop adds, bytes on the wire per token
//! and whether the swarm produced exactly the local tokens. Microbenchmarks of the per-hop costs (serialisation,
//! a libp2p round trip of the same frames, the hand-off to the blocking pool) say what bounds the added latency.
//! Progress goes to stderr. See docs/benchmarks.md.
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Parser;
use futures::StreamExt;
use petal_client::{RemoteModel, SwarmClient};
use petal_model::generation::GenerationConfig;
use petal_model::placement::{parse_dtype, DeviceSpec};
use petal_model::prompt::encode_prompt;
use petal_model::sampling::SamplingParams;
use petal_model::tokenizer::Tokenizer;
use petal_model::wire::{from_wire, to_wire, wire_dtype};
use petal_model::{BlockRange, Head, LocalModel, ModelFormat, ModelSource, Placement};
use petal_node::{Node, NodeConfig};
use petal_p2p::{Keypair, Multiaddr, NetConfig, Network};
use petal_proto::frame::{decode_frame, encode_frame};
use petal_proto::pb::{self, request, response};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use petal_model::synthetic::{self, SyntheticShape, WeightDType};

/// Seed of synthetic weights and prompts: the same shape always gives the same model id and tokens.
const SEED: u64 = 0x5EED_2024;
/// How long the client waits for the swarm's records to cover the model.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// Tokens of the untimed warm-up run before each measurement (page faults, connections, caches).
const WARMUP_TOKENS: usize = 8;
/// Models whose weights take at most this many bytes keep the local copy loaded during the swarm runs, so local and
/// swarm runs alternate and load drift on a shared machine hits both alike. Bigger ones are dropped before the
/// nodes load their spans, so the weights are never held twice.
const PAIRED_MAX_BYTES: u64 = 1 << 30;
/// Round trips timed after an idle gap, and the gap: about one decode step of a small model, long enough for
/// tokio's and the kernel's threads to park, as they do while a node computes.
const IDLE_ITERS: usize = 50;
const IDLE_GAP: Duration = Duration::from_millis(20);
/// Decode steps of the per-hop probe (fewer when fewer tokens are generated).
const PROBE_STEPS: usize = 32;
/// Iterations of the per-hop microbenchmarks (each is microseconds, so this costs well under a second).
const OVERHEAD_ITERS: usize = 400;

#[derive(Parser, Debug)]
#[command(
    name = "petal-bench",
    version,
    about = "Compare local generation with in-process Petal swarms on loopback; prints one JSON object"
)]
struct Args {
    /// Model: a Hugging Face directory, a .gguf file or a llama2.c .bin (default: SmolLM2-135M-Instruct Q4_1
    /// from $PETAL_MODELS or ../shared/models).
    #[arg(long, conflicts_with = "synthetic")]
    model: Option<PathBuf>,
    /// Prompt for models with a tokenizer; rendered through the chat template when the model has one.
    #[arg(long, default_value = "What is the capital of France?")]
    prompt: String,
    /// Encode the prompt as plain text even if the model has a chat template.
    #[arg(long)]
    no_chat: bool,
    /// Tokens generated per run [default: 64; synthetic 1b: 16].
    #[arg(long)]
    new_tokens: Option<usize>,
    /// Chain lengths: for each, a swarm of that many nodes splitting the blocks evenly.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    chains: Vec<usize>,
    /// Benchmark a random-weight model of this shape instead (tiny, 135m, 160m, 1b), driven with token ids, no
    /// tokenizer needed.
    #[arg(long)]
    synthetic: Option<String>,
    /// Keep the synthetic model in this directory (reused when shape, dtype and seed match) instead of a
    /// temporary one.
    #[arg(long, requires = "synthetic")]
    synthetic_dir: Option<PathBuf>,
    /// Prompt length, in random token ids, for models driven without a tokenizer.
    #[arg(long, default_value_t = 8)]
    id_prompt_tokens: usize,
    /// Device of the local model, the nodes and the client's head: cpu, cuda:N, metal:N or auto (GPU builds:
    /// `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Compute dtype (f32, f16, bf16); synthetic weights are also written in it. GGUF blocks compute in f32.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Runs per measurement; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Past this many seconds, measurements still to come run once (and the probe shortens), so a run on a busy
    /// machine still ends in reasonable time; the JSON says how many runs each figure rests on.
    #[arg(long, default_value_t = 90.0)]
    budget_seconds: f64,
    /// Skip the per-hop overhead microbenchmarks.
    #[arg(long)]
    no_overhead: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // Kademlia warns that the bootstrap peer, which has no peers of its own, cannot bootstrap: expected here.
    petal_node::logging::init("text", "warn,libp2p_kad=error");
    match run(args) {
        Ok(report) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&report).unwrap_or_default()
            );
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Everything a measurement needs to know about the model under test.
struct Bench {
    path: PathBuf,
    source: ModelSource,
    /// Where the client's head (embeddings, norm, LM head) computes.
    head_placement: Placement,
    /// Where blocks compute, locally and on the nodes.
    span_placement: Placement,
    device: DeviceSpec,
    workload: Workload,
    repeats: usize,
    /// When extra repeats stop (see `--budget-seconds`).
    deadline: Instant,
}

impl Bench {
    /// Whether repeat number `i` (0-based) of a measurement should run: the first always does.
    fn should_repeat(&self, i: usize) -> bool {
        i == 0 || (i < self.repeats && Instant::now() < self.deadline)
    }

    /// Probe steps: fewer once past the budget.
    fn probe_steps(&self) -> usize {
        let steps = self.workload.new_tokens().min(PROBE_STEPS);
        if Instant::now() < self.deadline {
            steps
        } else {
            steps.min(8)
        }
    }
}

/// What is generated: text through the real sampler and detokeniser, or greedy token ids straight through the
/// head and the spans (models without a tokenizer, such as synthetic ones).
enum Workload {
    Text {
        tokenizer: Box<Tokenizer>,
        prompt: Vec<u32>,
        config: GenerationConfig,
    },
    Ids {
        prompt: Vec<u32>,
        new_tokens: usize,
    },
}

impl Workload {
    fn prompt_len(&self) -> usize {
        match self {
            Self::Text { prompt, .. } | Self::Ids { prompt, .. } => prompt.len(),
        }
    }

    fn new_tokens(&self) -> usize {
        match self {
            Self::Text { config, .. } => config.max_new_tokens,
            Self::Ids { new_tokens, .. } => *new_tokens,
        }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Text { .. } => "text",
            Self::Ids { .. } => "token_ids",
        }
    }
}

/// One generation's measurements.
#[derive(Debug, Clone, Default)]
struct Run {
    tokens: Vec<u32>,
    /// Decode speed: tokens after the first per second (the prompt's prefill excluded).
    tokens_per_second: f64,
    first_token_ms: f64,
    bytes_on_wire: u64,
    route: Vec<String>,
    /// Token-id runs only: median milliseconds of a decode step in the blocks (locally) and in the head.
    blocks_ms: Option<f64>,
    head_ms: Option<f64>,
}

/// The whole bench: local, overhead microbenchmarks, then each chain; returns the report.
fn run(args: Args) -> Result<Value> {
    let started = Instant::now();
    let load_start = load_average();
    check_args(&args)?;
    let dtype = parse_dtype(&args.dtype)?;
    let device = DeviceSpec::parse(&args.device)?;
    let opened = device.open()?;
    let (path, synthetic, _temp) = resolve_model(&args)?;
    let deadline = started + Duration::from_secs_f64(args.budget_seconds);
    let bench = prepare(&args, path, (device, opened), dtype, deadline)?;
    let spec = bench.source.spec();
    if let Some(&k) = args.chains.iter().find(|&&k| k > spec.num_blocks) {
        bail!(
            "a chain of {k} nodes cannot split {} blocks",
            spec.num_blocks
        );
    }
    eprintln!(
        "model      {} ({} blocks, hidden {}, {}), {} prompt tokens, {} new tokens, {} repeats",
        bench.path.display(),
        spec.num_blocks,
        spec.hidden_size,
        bench.source.quantization(),
        bench.workload.prompt_len(),
        bench.workload.new_tokens(),
        bench.repeats
    );

    let model = load_local(&bench)?;
    let local = measure_local(&bench, &model)?;
    let local_summary = Summary::of(&local);
    eprintln!(
        "local      {:.2} tokens/s ({:.2} ms/token)",
        local_summary.tokens_per_second, local_summary.ms_per_token
    );
    let paired = (weights_bytes(&bench.path) <= PAIRED_MAX_BYTES).then_some(model);
    let (overhead, chains) = measure_swarms(&bench, &args, paired)?;

    let mut report = describe(&bench, &args, synthetic)?;
    report["machine"] = json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "compute_threads": candle_core::utils::get_num_threads(),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    });
    report["local"] = local_summary.to_json();
    report["chains"] = chains
        .iter()
        .map(|c| c.to_json(&local_summary, &local))
        .collect();
    report["overhead"] = overhead;
    report["elapsed_seconds"] = json!(round(started.elapsed().as_secs_f64(), 1));
    Ok(report)
}

/// Refuses arguments that would make the bench meaningless, before anything is written or loaded.
fn check_args(args: &Args) -> Result<()> {
    ensure!(args.repeats >= 1, "--repeats must be at least 1");
    ensure!(
        args.chains.iter().all(|&k| k >= 1),
        "--chains takes positive node counts"
    );
    ensure!(
        args.budget_seconds.is_finite() && args.budget_seconds >= 0.0,
        "--budget-seconds must be a non-negative number"
    );
    Ok(())
}

/// The overhead microbenchmarks and every chain, on an async runtime (the local phase needs none). `paired`, the
/// local model when it is small enough to keep, is dropped at the end.
fn measure_swarms(
    bench: &Bench,
    args: &Args,
    paired: Option<LocalModel>,
) -> Result<(Value, Vec<Chain>)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let overhead = if args.no_overhead {
            Value::Null
        } else {
            let spec = bench.source.spec();
            measure_overhead(spec.hidden_size, bench.span_placement.dtype).await?
        };
        let mut chains = vec![];
        for &k in &args.chains {
            chains.push(measure_chain(bench, k, paired.as_ref()).await?);
        }
        Ok((overhead, chains))
    })
}

/// What was measured and how: the report's fields other than the figures.
fn describe(bench: &Bench, args: &Args, synthetic: Value) -> Result<Value> {
    let spec = bench.source.spec();
    Ok(json!({
        "model": bench.path.display().to_string(),
        "model_id": bench.source.model_id()?,
        "format": format!("{:?}", bench.source.format()),
        "quantization": bench.source.quantization(),
        "device": bench.device.to_string(),
        "compute_dtype": bench.span_placement.dtype.as_str(),
        "synthetic": synthetic,
        "blocks": spec.num_blocks,
        "hidden_size": spec.hidden_size,
        "workload": bench.workload.kind(),
        "prompt_tokens": bench.workload.prompt_len(),
        "new_tokens": bench.workload.new_tokens(),
        "repeats": bench.repeats,
        "budget_seconds": args.budget_seconds,
        "warmup_tokens": WARMUP_TOKENS,
    }))
}

/// A directory removed when the bench ends, however it ends.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The model to benchmark: `--model`, a freshly written synthetic one, or the default SmolLM2. Returns its path,
/// what was written (JSON, for synthetic models) and the temp dir to remove at the end.
fn resolve_model(args: &Args) -> Result<(PathBuf, Value, Option<TempDir>)> {
    let Some(name) = &args.synthetic else {
        let path = match &args.model {
            Some(m) => m.clone(),
            None => petal_client::defaults::default_model()
                .with_context(petal_client::defaults::default_model_missing)?,
        };
        return Ok((path, Value::Null, None));
    };
    let shape = SyntheticShape::named(name).with_context(|| {
        let names: Vec<&str> = synthetic::SHAPES.iter().map(|s| s.name).collect();
        format!("unknown synthetic shape {name:?}: expected one of {names:?}")
    })?;
    let dtype = WeightDType::parse(&args.dtype)
        .with_context(|| format!("--dtype {:?}: expected f32, f16 or bf16", args.dtype))?;
    // The directory's name becomes the model's name (and part of its id), so keep it stable.
    let leaf = format!("synthetic-{}-{}", shape.name, dtype.name());
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
        "parameters": shape.parameters(),
        "weight_dtype": dtype.name(),
        "file_bytes": written.bytes,
        "written": written.written,
        "write_seconds": round(t.elapsed().as_secs_f64(), 2),
    });
    Ok((dir, info, temp))
}

/// Opens the model and decides placements (on `device`, as named and as opened) and the workload.
fn prepare(
    args: &Args,
    path: PathBuf,
    device: (DeviceSpec, Device),
    dtype: DType,
    deadline: Instant,
) -> Result<Bench> {
    let source = ModelSource::open(&path).with_context(|| format!("opening {}", path.display()))?;
    // GGUF blocks keep their quantized weights only in f32 (as `petal generate` and the nodes do).
    let span_dtype = if source.format() == ModelFormat::Gguf {
        DType::F32
    } else {
        dtype
    };
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
    let workload = match (args.synthetic.is_some(), source.tokenizer(None)) {
        (false, Ok(tokenizer)) => text_workload(args, tokenizer, new_tokens)?,
        (synthetic, tokenizer) => {
            if let (false, Err(e)) = (synthetic, tokenizer) {
                eprintln!("note       no tokenizer ({e}); driving the model with token ids");
            }
            Workload::Ids {
                prompt: prompt_ids(args.id_prompt_tokens, source.spec().vocab_size),
                new_tokens,
            }
        }
    };
    let max = source.spec().max_position;
    ensure!(
        workload.prompt_len() + new_tokens <= max,
        "prompt ({}) plus new tokens ({new_tokens}) exceed the model's {max} positions",
        workload.prompt_len()
    );
    let (device, opened) = device;
    Ok(Bench {
        path,
        head_placement: Placement::new(opened.clone(), dtype),
        span_placement: Placement::new(opened, span_dtype),
        device,
        source,
        workload,
        repeats: args.repeats,
        deadline,
    })
}

/// Greedy generation of exactly `new_tokens` tokens from the encoded prompt.
fn text_workload(args: &Args, tokenizer: Tokenizer, new_tokens: usize) -> Result<Workload> {
    let chat = !args.no_chat && tokenizer.chat_template().is_some();
    let prompt = encode_prompt(&tokenizer, &args.prompt, chat, None)?;
    ensure!(!prompt.is_empty(), "the prompt encodes to no tokens");
    Ok(Workload::Text {
        tokenizer: Box::new(tokenizer),
        prompt,
        config: GenerationConfig {
            max_new_tokens: new_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: true,
        },
    })
}

/// A fixed pseudo-random prompt of `n` ids, avoiding the usual special ids 0..3.
fn prompt_ids(n: usize, vocab: usize) -> Vec<u32> {
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

/// The whole model in this process.
fn load_local(bench: &Bench) -> Result<LocalModel> {
    let spec = bench.source.spec();
    Ok(LocalModel {
        head: bench.source.load_head(bench.head_placement.clone())?,
        spans: vec![bench
            .source
            .load_span_on(BlockRange::new(0, spec.num_blocks), &bench.span_placement)?],
    })
}

/// A warm-up, then `repeats` timed local generations.
fn measure_local(bench: &Bench, model: &LocalModel) -> Result<Vec<Run>> {
    local_run(model, &bench.workload, WARMUP_TOKENS)?;
    let mut runs = vec![];
    for i in 0..bench.repeats {
        if !bench.should_repeat(i) {
            break;
        }
        runs.push(local_run(
            model,
            &bench.workload,
            bench.workload.new_tokens(),
        )?);
    }
    Ok(runs)
}

/// One local generation of `new_tokens` tokens.
fn local_run(model: &LocalModel, workload: &Workload, new_tokens: usize) -> Result<Run> {
    match workload {
        Workload::Text {
            tokenizer,
            prompt,
            config,
        } => {
            let config = GenerationConfig {
                max_new_tokens: new_tokens,
                ..config.clone()
            };
            let out = model.generate(tokenizer, prompt, &config, |_| {})?;
            Ok(Run {
                tokens: out.tokens,
                tokens_per_second: out.tokens_per_second,
                first_token_ms: out.first_token_ms,
                ..Run::default()
            })
        }
        Workload::Ids { prompt, .. } => local_ids(model, prompt, new_tokens),
    }
}

/// Bytes of the model's weight files: the file itself, or a directory's safetensors.
fn weights_bytes(path: &Path) -> u64 {
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

/// Greedy decoding by hand, timing the blocks and the head of each decode step separately.
fn local_ids(model: &LocalModel, prompt: &[u32], new_tokens: usize) -> Result<Run> {
    let max_length = prompt.len() + new_tokens;
    let mut caches = model
        .spans
        .iter()
        .map(|s| s.new_session(s.range(), max_length))
        .collect::<petal_model::Result<Vec<_>>>()?;
    let mut timer = StepTimer::default();
    let (mut input, mut position, mut tokens) = (prompt.to_vec(), 0, vec![]);
    for _ in 0..new_tokens {
        let t0 = Instant::now();
        let mut x = model.head.embed(&input)?;
        let t1 = Instant::now();
        for (span, cache) in model.spans.iter().zip(&mut caches) {
            x = span.forward(&x, position, cache)?;
        }
        // GPU kernels run asynchronously: wait for them before reading the clock.
        x.device().synchronize()?;
        let t2 = Instant::now();
        let next = greedy(&model.head, &x)?;
        timer.record(t0, t1, t2);
        position += input.len();
        tokens.push(next);
        input = vec![next];
    }
    Ok(timer.finish(tokens))
}

/// The argmax of the last position's logits.
fn greedy(head: &Head, hidden: &Tensor) -> Result<u32> {
    Ok(head
        .logits(hidden)?
        .flatten_all()?
        .argmax(0)?
        .to_scalar::<u32>()?)
}

/// Per-step timings of a token-id run: the first step is prefill, the rest are decode steps.
#[derive(Default)]
struct StepTimer {
    first: Option<Duration>,
    steps: Vec<Duration>,
    blocks: Vec<Duration>,
    heads: Vec<Duration>,
}

impl StepTimer {
    /// A step that started at `t0`, sent its embeddings to the blocks at `t1` and got their output at `t2`.
    fn record(&mut self, t0: Instant, t1: Instant, t2: Instant) {
        let now = Instant::now();
        if self.first.is_none() {
            self.first = Some(now - t0);
            return;
        }
        self.steps.push(now - t0);
        self.blocks.push(t2 - t1);
        self.heads.push((now - t0).saturating_sub(t2 - t1));
    }

    fn finish(self, tokens: Vec<u32>) -> Run {
        let decode: Duration = self.steps.iter().sum();
        Run {
            tokens,
            tokens_per_second: self.steps.len() as f64 / decode.as_secs_f64().max(1e-9),
            first_token_ms: self.first.unwrap_or_default().as_secs_f64() * 1e3,
            blocks_ms: Some(median_ms(&self.blocks)),
            head_ms: Some(median_ms(&self.heads)),
            ..Run::default()
        }
    }
}

/// Medians over repeats.
struct Summary {
    tokens_per_second: f64,
    ms_per_token: f64,
    runs: Vec<f64>,
    first_token_ms: f64,
    blocks_ms: Option<f64>,
    head_ms: Option<f64>,
}

impl Summary {
    fn of(runs: &[Run]) -> Self {
        let tps: Vec<f64> = runs.iter().map(|r| r.tokens_per_second).collect();
        let tokens_per_second = median(&tps);
        let opt = |f: fn(&Run) -> Option<f64>| {
            let v: Vec<f64> = runs.iter().filter_map(f).collect();
            (!v.is_empty()).then(|| median(&v))
        };
        Self {
            tokens_per_second,
            ms_per_token: 1e3 / tokens_per_second.max(1e-9),
            runs: tps,
            first_token_ms: median(&runs.iter().map(|r| r.first_token_ms).collect::<Vec<_>>()),
            blocks_ms: opt(|r| r.blocks_ms),
            head_ms: opt(|r| r.head_ms),
        }
    }

    fn to_json(&self) -> Value {
        let mut v = json!({
            "tokens_per_second": round(self.tokens_per_second, 2),
            "ms_per_token": round(self.ms_per_token, 3),
            "runs_tokens_per_second": self.runs.iter().map(|&t| round(t, 2)).collect::<Vec<_>>(),
            "first_token_ms": round(self.first_token_ms, 1),
        });
        if let (Some(b), Some(h)) = (self.blocks_ms, self.head_ms) {
            v["blocks_ms_per_token"] = json!(round(b, 3));
            v["head_ms_per_token"] = json!(round(h, 3));
        }
        v
    }
}

/// One chain length's results.
struct Chain {
    nodes: usize,
    spans: Vec<BlockRange>,
    startup_seconds: f64,
    runs: Vec<Run>,
    /// Local runs alternated with the swarm runs (small models only).
    paired_local: Vec<Run>,
    new_tokens: usize,
    /// Load averages when the chain started: the machine is shared, so each figure carries its own.
    load_avg: Value,
    /// Per-hop round trip against server compute, from [`probe_chain`].
    probe: Value,
}

impl Chain {
    /// The chain's figures, relative to the paired local runs when there are some, else to the local phase.
    fn to_json(&self, local: &Summary, local_runs: &[Run]) -> Value {
        let s = Summary::of(&self.runs);
        let paired = (!self.paired_local.is_empty()).then(|| Summary::of(&self.paired_local));
        let base = paired.as_ref().unwrap_or(local);
        let reference = local_runs
            .first()
            .map(|r| r.tokens.as_slice())
            .unwrap_or(&[]);
        let tokens_match = self
            .runs
            .iter()
            .chain(&self.paired_local)
            .all(|r| r.tokens == reference);
        let bytes: Vec<f64> = self.runs.iter().map(|r| r.bytes_on_wire as f64).collect();
        let mut v = json!({
            "nodes": self.nodes,
            "spans": self.spans.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "route": self.runs.first().map(|r| r.route.clone()).unwrap_or_default(),
            "startup_seconds": round(self.startup_seconds, 2),
            "tokens_per_second": round(s.tokens_per_second, 2),
            "ms_per_token": round(s.ms_per_token, 3),
            "runs_tokens_per_second": s.runs.iter().map(|&t| round(t, 2)).collect::<Vec<_>>(),
            "first_token_ms": round(s.first_token_ms, 1),
            "local_paired": paired.is_some(),
            "local_tokens_per_second": round(base.tokens_per_second, 2),
            "ratio_to_local": round(s.tokens_per_second / base.tokens_per_second.max(1e-9), 3),
            "added_ms_per_hop": round((s.ms_per_token - base.ms_per_token) / self.nodes as f64, 3),
            "bytes_per_token": round(median(&bytes) / self.new_tokens.max(1) as f64, 1),
            "tokens_match": tokens_match,
            "load_avg": self.load_avg,
            "probe": self.probe,
        });
        if let Some(h) = s.head_ms {
            // Client-side view of a decode step: the head, and the chain's round trips (server compute included).
            v["head_ms_per_token"] = json!(round(h, 3));
            v["chain_ms_per_token"] = json!(round(s.blocks_ms.unwrap_or_default(), 3));
            if let Some(b) = base.blocks_ms {
                v["added_ms_per_hop_in_chain"] = json!(round(
                    (s.blocks_ms.unwrap_or_default() - b) / self.nodes as f64,
                    3
                ));
            }
        }
        v
    }
}

/// A bootstrap peer, `k` nodes and a client, all in this process on 127.0.0.1.
struct LocalSwarm {
    bootstrap: Network,
    nodes: Vec<Node>,
    client: SwarmClient,
}

impl LocalSwarm {
    async fn start(
        model: &Path,
        spans: &[BlockRange],
        device: DeviceSpec,
        dtype: DType,
    ) -> Result<Self> {
        let localhost: Multiaddr = "/ip4/127.0.0.1/tcp/0".parse()?;
        let bootstrap = petal_node::start_bootstrap(
            Keypair::generate_ed25519(),
            vec![localhost.clone()],
            Duration::from_secs(60),
        )
        .await?;
        let bootstrap_addrs = bootstrap.listen_addrs().await;
        let mut nodes = vec![];
        for (i, range) in spans.iter().enumerate() {
            let mut cfg = NodeConfig::new(model.to_path_buf(), *range);
            cfg.listen = vec![localhost.clone()];
            cfg.bootstrap = bootstrap_addrs.clone();
            cfg.public_name = format!("node{}", i + 1);
            cfg.devices = vec![device];
            cfg.dtype = Some(dtype);
            let node = Node::start(cfg)
                .await
                .with_context(|| format!("starting node {} for blocks {range}", i + 1))?;
            nodes.push(node);
        }
        let client = SwarmClient::connect(bootstrap_addrs).await?;
        Ok(Self {
            bootstrap,
            nodes,
            client,
        })
    }

    async fn shutdown(self) {
        self.client.shutdown().await;
        for node in self.nodes {
            node.shutdown(Duration::from_secs(1)).await;
        }
        self.bootstrap.shutdown().await;
    }
}

/// Starts a swarm of `k` nodes, generates `repeats` times through it (alternating with local runs when `local`
/// is kept), and stops it.
async fn measure_chain(bench: &Bench, k: usize, local: Option<&LocalModel>) -> Result<Chain> {
    let spans = BlockRange::split_even(bench.source.spec().num_blocks, k);
    let load_avg = load_average();
    let t = Instant::now();
    let swarm = LocalSwarm::start(
        &bench.path,
        &spans,
        bench.device,
        bench.span_placement.dtype,
    )
    .await?;
    let startup_seconds = t.elapsed().as_secs_f64();
    let result = chain_runs(bench, &swarm.client, local).await;
    swarm.shutdown().await;
    let (runs, paired_local, probe) = result?;
    let s = Summary::of(&runs);
    eprintln!(
        "chain {k}    {:.2} tokens/s ({:.2} ms/token), started in {:.1} s",
        s.tokens_per_second, s.ms_per_token, startup_seconds
    );
    Ok(Chain {
        nodes: k,
        spans,
        startup_seconds,
        runs,
        paired_local,
        new_tokens: bench.workload.new_tokens(),
        load_avg,
        probe,
    })
}

/// A warm-up through the swarm, then `repeats` swarm runs, each preceded by a local one when `local` is given,
/// then a probe of the per-hop costs.
async fn chain_runs(
    bench: &Bench,
    client: &SwarmClient,
    local: Option<&LocalModel>,
) -> Result<(Vec<Run>, Vec<Run>, Value)> {
    let remote = RemoteModel::open(
        client,
        &bench.source,
        bench.head_placement.clone(),
        DISCOVERY_TIMEOUT,
    )
    .await?;
    swarm_run(&remote, &bench.workload, WARMUP_TOKENS).await?;
    let n = bench.workload.new_tokens();
    let (mut runs, mut paired) = (vec![], vec![]);
    for i in 0..bench.repeats {
        if !bench.should_repeat(i) {
            break;
        }
        if let Some(model) = local {
            paired.push(local_run(model, &bench.workload, n)?);
        }
        runs.push(swarm_run(&remote, &bench.workload, n).await?);
    }
    let probe = probe_chain(bench, &remote, client, local, bench.probe_steps()).await?;
    Ok((runs, paired, probe))
}

/// One generation of `new_tokens` tokens through the swarm: `petal generate`'s path for text, or greedy decoding
/// by hand through an inference session for token ids.
async fn swarm_run(remote: &RemoteModel, workload: &Workload, new_tokens: usize) -> Result<Run> {
    match workload {
        Workload::Text {
            tokenizer,
            prompt,
            config,
        } => {
            let config = GenerationConfig {
                max_new_tokens: new_tokens,
                ..config.clone()
            };
            let out = remote.generate(tokenizer, prompt, &config, |_| {}).await?;
            Ok(Run {
                tokens: out.tokens,
                tokens_per_second: out.tokens_per_second,
                first_token_ms: out.first_token_ms,
                bytes_on_wire: remote.last_bytes_on_wire(),
                route: remote.last_route(),
                ..Run::default()
            })
        }
        Workload::Ids { prompt, .. } => swarm_ids(remote, prompt, new_tokens).await,
    }
}

/// Greedy decoding by hand through an inference session, timing the chain and the head of each step.
async fn swarm_ids(remote: &RemoteModel, prompt: &[u32], new_tokens: usize) -> Result<Run> {
    let head = remote.head();
    let mut session = remote.open_session(prompt.len() + new_tokens).await?;
    let mut timer = StepTimer::default();
    let (mut input, mut tokens) = (prompt.to_vec(), vec![]);
    let result = async {
        for _ in 0..new_tokens {
            let t0 = Instant::now();
            let x = head.embed(&input)?;
            let t1 = Instant::now();
            let out = session.step(&x).await?;
            let t2 = Instant::now();
            let next = greedy(head, &out)?;
            timer.record(t0, t1, t2);
            tokens.push(next);
            input = vec![next];
        }
        anyhow::Ok(())
    }
    .await;
    let (bytes, route) = (session.bytes_on_wire(), session.route());
    session.close().await;
    result?;
    let mut run = timer.finish(tokens);
    run.bytes_on_wire = bytes;
    run.route = route;
    Ok(run)
}

/// Decode steps through the chain hop by hop over the raw protocol, to split each hop's round trip into what the
/// server reports as compute (`StepResult.compute_micros`: its blocks, including the hand-off to the blocking
/// pool) and the rest (serialisation at both ends, libp2p, task wake-ups), which the session API does not expose.
/// With `local`, every step also runs through the local blocks on the same input just before, so the swarm's
/// added time is measured step by step, milliseconds apart, and load bursts on a shared machine hit both alike.
async fn probe_chain(
    bench: &Bench,
    remote: &RemoteModel,
    client: &SwarmClient,
    local: Option<&LocalModel>,
    steps: usize,
) -> Result<Value> {
    let spec = bench.source.spec();
    let route = client
        .plan(
            remote.model_id(),
            BlockRange::new(0, spec.num_blocks),
            DISCOVERY_TIMEOUT,
        )
        .await?;
    let mut hops = vec![];
    for hop in &route {
        hops.push(ProbeHop::open(client.network(), remote.model_id(), hop, steps).await?);
    }
    let mut caches = match local {
        Some(m) => Some(
            m.spans
                .iter()
                .map(|s| s.new_session(s.range(), steps))
                .collect::<petal_model::Result<Vec<_>>>()?,
        ),
        None => None,
    };
    let mut times = ProbeTimes::default();
    for (position, id) in prompt_ids(steps, spec.vocab_size).into_iter().enumerate() {
        // The first steps (two, when there are more) warm up caches and connections.
        times.recording = position >= 2.min(steps - 1);
        let t0 = Instant::now();
        let x = remote.head().embed(&[id])?;
        let embed = t0.elapsed();
        let local_out = match (local, caches.as_mut()) {
            (Some(model), Some(caches)) => Some(local_forward(model, &x, position, caches)?),
            _ => None,
        };
        let t1 = Instant::now();
        let mut y = x;
        for hop in &mut hops {
            let t = Instant::now();
            let (out, compute) = hop.step(&y, position).await?;
            times.hop(t.elapsed(), compute);
            y = out;
        }
        let chain = t1.elapsed();
        let t2 = Instant::now();
        greedy(remote.head(), &y)?;
        times.step(chain, embed + t2.elapsed(), local_out, &y)?;
    }
    for hop in hops {
        hop.close().await;
    }
    Ok(times.to_json(steps, route.len()))
}

/// The local blocks on `x` at `position`, and how long they took.
fn local_forward(
    model: &LocalModel,
    x: &Tensor,
    position: usize,
    caches: &mut [petal_model::SpanCache],
) -> Result<(Tensor, Duration)> {
    let t = Instant::now();
    let mut y = x.clone();
    for (span, cache) in model.spans.iter().zip(caches) {
        y = span.forward(&y, position, cache)?;
    }
    y.device().synchronize()?;
    Ok((y, t.elapsed()))
}

/// What [`probe_chain`] records, per hop and per step.
#[derive(Default)]
struct ProbeTimes {
    recording: bool,
    hop_round_trips: Vec<Duration>,
    hop_computes: Vec<Duration>,
    hop_overheads: Vec<Duration>,
    chain: Vec<Duration>,
    head: Vec<Duration>,
    local: Vec<Duration>,
    /// Per step: chain time minus local blocks time, in ms (negative when the chain was faster).
    added: Vec<f64>,
    /// Largest difference between the chain's and the local blocks' outputs.
    max_abs_diff: f32,
}

impl ProbeTimes {
    fn hop(&mut self, round_trip: Duration, compute: Duration) {
        if self.recording {
            self.hop_round_trips.push(round_trip);
            self.hop_computes.push(compute);
            self.hop_overheads.push(round_trip.saturating_sub(compute));
        }
    }

    fn step(
        &mut self,
        chain: Duration,
        head: Duration,
        local: Option<(Tensor, Duration)>,
        chain_out: &Tensor,
    ) -> Result<()> {
        if let Some((local_out, _)) = &local {
            let diff = (local_out.to_dtype(DType::F32)? - chain_out.to_dtype(DType::F32)?)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            self.max_abs_diff = self.max_abs_diff.max(diff);
        }
        if self.recording {
            self.chain.push(chain);
            self.head.push(head);
            if let Some((_, l)) = local {
                self.local.push(l);
                self.added
                    .push((chain.as_secs_f64() - l.as_secs_f64()) * 1e3);
            }
        }
        Ok(())
    }

    fn to_json(&self, steps: usize, hops: usize) -> Value {
        let mut v = json!({
            "steps": steps,
            "hop_round_trip_ms": round(median_ms(&self.hop_round_trips), 3),
            "server_compute_ms": round(median_ms(&self.hop_computes), 3),
            "overhead_ms_per_hop": round(median_ms(&self.hop_overheads), 3),
            "overhead_ms_per_hop_p90": round(percentile_ms(&self.hop_overheads, 0.9), 3),
            "overhead_ms_per_hop_mean": round(mean_ms(&self.hop_overheads), 3),
            "chain_ms": round(median_ms(&self.chain), 3),
            "head_ms": round(median_ms(&self.head), 3),
        });
        if !self.local.is_empty() {
            let (chain, head, local) = (
                median_ms(&self.chain),
                median_ms(&self.head),
                median_ms(&self.local),
            );
            v["local_blocks_ms"] = json!(round(local, 3));
            let per_hop = |v: f64| json!(round(v / hops.max(1) as f64, 3));
            v["added_ms_per_hop"] = per_hop(median(&self.added));
            v["added_ms_per_hop_mean"] =
                per_hop(self.added.iter().sum::<f64>() / self.added.len() as f64);
            v["step_ratio_to_local"] = json!(round((head + local) / (head + chain).max(1e-9), 3));
            v["max_abs_diff"] = json!(self.max_abs_diff);
        }
        v
    }
}

/// One hop's session, driven frame by frame.
struct ProbeHop {
    stream: FramedStream<petal_p2p::Stream>,
    session_id: u64,
    dtype: pb::WireDType,
}

impl ProbeHop {
    async fn open(
        net: &Network,
        model_id: &str,
        hop: &petal_client::Hop,
        max_length: usize,
    ) -> Result<Self> {
        let peer = hop
            .record
            .peer_id
            .parse()
            .context("record with a bad peer id")?;
        let stream = net.open_stream(peer).await?;
        let mut probe = Self {
            stream: FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES),
            session_id: 0,
            dtype: pb::WireDType::F32,
        };
        let open = request::Kind::Open(pb::OpenSession {
            protocol_version: petal_proto::PROTOCOL_VERSION,
            model_id: model_id.to_string(),
            start_block: hop.range.start as u32,
            end_block: hop.range.end as u32,
            max_length: max_length as u32,
        });
        match probe.call(open).await? {
            response::Kind::Opened(o) => {
                probe.session_id = o.session_id;
                probe.dtype = pb::WireDType::try_from(o.dtype).context("unknown wire dtype")?;
                Ok(probe)
            }
            other => bail!("expected SessionOpened, got {other:?}"),
        }
    }

    async fn call(&mut self, kind: request::Kind) -> Result<response::Kind> {
        self.stream.send(&pb::Request { kind: Some(kind) }).await?;
        match self.stream.recv::<pb::Response>().await? {
            Some(pb::Response {
                kind: Some(response::Kind::Error(e)),
            }) => bail!("server error {}: {}", e.code, e.message),
            Some(pb::Response { kind: Some(kind) }) => Ok(kind),
            _ => bail!("stream closed"),
        }
    }

    /// One step: the output hidden states and the compute time the server reports.
    async fn step(&mut self, hidden: &Tensor, position: usize) -> Result<(Tensor, Duration)> {
        let step = request::Kind::Step(pb::Step {
            session_id: self.session_id,
            position: position as u32,
            hidden: Some(to_wire(hidden, self.dtype)?),
        });
        match self.call(step).await? {
            response::Kind::Step(r) => {
                let out = r.hidden.context("StepResult without hidden states")?;
                let x = checked_hidden(out, hidden.elem_count())?;
                Ok((x, Duration::from_micros(r.compute_micros)))
            }
            other => bail!("expected StepResult, got {other:?}"),
        }
    }

    async fn close(mut self) {
        let close = request::Kind::Close(pb::CloseSession {
            session_id: self.session_id,
        });
        let _ = self.call(close).await;
        self.stream.close().await;
    }
}

/// Per-hop costs of one decode step, measured apart from the model.
async fn measure_overhead(hidden_size: usize, dtype: DType) -> Result<Value> {
    eprintln!("overhead   serialisation, loopback round trip, blocking-pool hand-off");
    let wire = measure_serialisation(hidden_size, dtype)?;
    let (transport, transport_idle) = measure_round_trip(&wire.request).await?;
    let (handoff, handoff_idle) = measure_spawn_blocking().await?;
    let serialise_us = wire.client_encode_us
        + wire.server_decode_us
        + wire.server_encode_us
        + wire.client_decode_us;
    Ok(json!({
        "wire_dtype": dtype.as_str(),
        "hidden_bytes_per_token": hidden_size * dtype.size_in_bytes(),
        "request_frame_bytes": wire.request_frame_bytes,
        "response_frame_bytes": wire.response_frame_bytes,
        "serialise_us_per_hop": {
            "client_encode": round(wire.client_encode_us, 2),
            "server_decode": round(wire.server_decode_us, 2),
            "server_encode": round(wire.server_encode_us, 2),
            "client_decode": round(wire.client_decode_us, 2),
            "total": round(serialise_us, 2),
        },
        "loopback_round_trip_us": round(transport, 1),
        "loopback_round_trip_after_idle_us": round(transport_idle, 1),
        "spawn_blocking_us": round(handoff, 1),
        "spawn_blocking_after_idle_us": round(handoff_idle, 1),
        "idle_gap_ms": IDLE_GAP.as_secs_f64() * 1e3,
        "predicted_ms_per_hop": round((serialise_us + transport + handoff) / 1e3, 3),
        "predicted_ms_per_hop_after_idle": round((serialise_us + transport_idle + handoff_idle) / 1e3, 3),
    }))
}

/// What one decode step costs to serialise at each end of one hop (medians, microseconds).
struct WireCost {
    request: pb::Request,
    request_frame_bytes: usize,
    response_frame_bytes: usize,
    client_encode_us: f64,
    server_decode_us: f64,
    server_encode_us: f64,
    client_decode_us: f64,
}

/// Times the four conversions one hop of one decode step goes through, exactly as the client's session and the
/// node's handler do them: tensor to wire bytes and frame, frame to checked tensor, and back.
fn measure_serialisation(hidden_size: usize, dtype: DType) -> Result<WireCost> {
    let wd = wire_dtype(dtype)?;
    let hidden = Tensor::randn(0f32, 1.0, (1, 1, hidden_size), &Device::Cpu)?.to_dtype(dtype)?;
    let max = DEFAULT_MAX_FRAME_BYTES;
    let mut phases: [Vec<Duration>; 4] = Default::default();
    let (mut request, mut request_bytes, mut response_bytes) = (None, 0, 0);
    for _ in 0..OVERHEAD_ITERS {
        let t0 = Instant::now();
        let w = to_wire(&hidden, wd)?;
        let req = pb::Request {
            kind: Some(request::Kind::Step(pb::Step {
                session_id: 1,
                position: 0,
                // The session keeps a copy of every input for replay; clone as it does.
                hidden: Some(w.clone()),
            })),
        };
        let frame = encode_frame(&req);
        let t1 = Instant::now();
        let (got, _) = decode_frame::<pb::Request>(&frame, max)?;
        let x = checked_hidden(step_hidden(got)?, hidden_size)?;
        let t2 = Instant::now();
        let resp = pb::Response {
            kind: Some(response::Kind::Step(pb::StepResult {
                session_id: 1,
                position: 0,
                hidden: Some(to_wire(&x, wd)?),
                compute_micros: 0,
            })),
        };
        let back = encode_frame(&resp);
        let t3 = Instant::now();
        let (got, _) = decode_frame::<pb::Response>(&back, max)?;
        let out = match got.kind {
            Some(response::Kind::Step(s)) => s.hidden,
            _ => None,
        };
        checked_hidden(out.context("no hidden states")?, hidden_size)?;
        let t4 = Instant::now();
        for (p, d) in phases.iter_mut().zip([t1 - t0, t2 - t1, t3 - t2, t4 - t3]) {
            p.push(d);
        }
        (request_bytes, response_bytes) = (frame.len(), back.len());
        request = Some(req);
    }
    let us = |d: &[Duration]| median_ms(d) * 1e3;
    Ok(WireCost {
        request: request.context("no iteration ran")?,
        request_frame_bytes: request_bytes,
        response_frame_bytes: response_bytes,
        client_encode_us: us(&phases[0]),
        server_decode_us: us(&phases[1]),
        server_encode_us: us(&phases[2]),
        client_decode_us: us(&phases[3]),
    })
}

fn step_hidden(req: pb::Request) -> Result<pb::Tensor> {
    match req.kind {
        Some(request::Kind::Step(s)) => s.hidden.context("step without hidden states"),
        _ => bail!("not a step"),
    }
}

/// The receiving end's checks and conversion: shape and size, finiteness, then a CPU tensor.
fn checked_hidden(t: pb::Tensor, hidden_size: usize) -> Result<Tensor> {
    let (dtype, shape) = petal_proto::tensor::validate(&t, hidden_size)?;
    petal_proto::tensor::check_finite(dtype, &t.data)?;
    Ok(from_wire(&t, dtype, &shape)?)
}

/// Median round trips of one decode step's frames over a libp2p stream between two in-process peers on loopback
/// (TCP, noise, yamux, as between a client and a node), with a server that echoes the hidden states back: back to
/// back (threads hot), and after an idle gap as long as a decode step (threads parked, as during a node's compute).
async fn measure_round_trip(request: &pb::Request) -> Result<(f64, f64)> {
    let mut server_config = NetConfig::new(Keypair::generate_ed25519());
    server_config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse()?];
    let server = Network::start(server_config).await?;
    let mut incoming = server.accept_streams()?;
    let echo = tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            tokio::spawn(echo_steps(stream));
        }
    });
    let client = Network::start(NetConfig::new(Keypair::generate_ed25519())).await?;
    client
        .add_addresses(server.peer_id(), server.listen_addrs().await)
        .await;
    let stream = client.open_stream(server.peer_id()).await?;
    let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
    // The first round trips warm up the connection and the yamux windows.
    for _ in 0..20 {
        round_trip(&mut framed, request).await?;
    }
    let mut hot = vec![];
    for _ in 0..OVERHEAD_ITERS {
        hot.push(round_trip(&mut framed, request).await?);
    }
    let mut idle = vec![];
    for _ in 0..IDLE_ITERS {
        tokio::time::sleep(IDLE_GAP).await;
        idle.push(round_trip(&mut framed, request).await?);
    }
    framed.close().await;
    client.shutdown().await;
    server.shutdown().await;
    echo.abort();
    Ok((median_ms(&hot) * 1e3, median_ms(&idle) * 1e3))
}

async fn round_trip(
    framed: &mut FramedStream<petal_p2p::Stream>,
    request: &pb::Request,
) -> Result<Duration> {
    let t = Instant::now();
    framed.send(request).await?;
    framed
        .recv::<pb::Response>()
        .await?
        .context("echo stream closed")?;
    Ok(t.elapsed())
}

/// Answers every step with its own hidden states, as a node with no blocks would.
async fn echo_steps(stream: petal_p2p::Stream) {
    let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
    while let Ok(Some(req)) = framed.recv::<pb::Request>().await {
        let hidden = step_hidden(req).ok();
        let reply = pb::Response {
            kind: Some(response::Kind::Step(pb::StepResult {
                session_id: 1,
                position: 0,
                hidden,
                compute_micros: 0,
            })),
        };
        if framed.send(&reply).await.is_err() {
            break;
        }
    }
}

/// Median times to hand an empty job to tokio's blocking pool and get its result back, as the node does for every
/// step's compute: back to back, and after an idle gap as long as a decode step.
async fn measure_spawn_blocking() -> Result<(f64, f64)> {
    let mut hot = vec![];
    for _ in 0..OVERHEAD_ITERS {
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ()).await?;
        hot.push(t.elapsed());
    }
    let mut idle = vec![];
    for _ in 0..IDLE_ITERS {
        tokio::time::sleep(IDLE_GAP).await;
        let t = Instant::now();
        tokio::task::spawn_blocking(|| ()).await?;
        idle.push(t.elapsed());
    }
    Ok((median_ms(&hot) * 1e3, median_ms(&idle) * 1e3))
}

/// The 1, 5 and 15 minute load averages (Linux), or null elsewhere.
fn load_average() -> Value {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|s| {
            s.split_whitespace()
                .take(3)
                .filter_map(|v| v.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .map_or(Value::Null, |v| json!(v))
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

/// The `q` quantile (0..=1, nearest rank) of `durations`, in ms.
fn percentile_ms(durations: &[Duration], q: f64) -> f64 {
    let mut v: Vec<f64> = durations.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    v[rank]
}

fn mean_ms(durations: &[Duration]) -> f64 {
    if durations.is_empty() {
        return 0.0;
    }
    durations.iter().map(|d| d.as_secs_f64() * 1e3).sum::<f64>() / durations.len() as f64
}

fn median_ms(durations: &[Duration]) -> f64 {
    median(
        &durations
            .iter()
            .map(|d| d.as_secs_f64() * 1e3)
            .collect::<Vec<_>>(),
    )
}

/// `v` rounded to `digits` decimals, so the JSON stays readable.
fn round(v: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (v * p).round() / p
}
