//! `petal-bench compare`: Petal's half of the side-by-side benchmark with llama.cpp (`scripts/bench-compare`
//! runs llama-bench for the other half and prints the ratios). Every figure is one llama-bench also reports, or
//! one of the swarm's own goals:
//!
//! - prefill of an exact number of token ids (pp512, pp2048): one forward of the prompt through the blocks and
//!   the head for the last position, on a fresh session, as llama-bench's `pp` test;
//! - decode (tg128): single-token steps after a one-token prompt, as llama-bench's `tg` test starts from an
//!   empty context; decode at depth D: steps after a D-token prefill (llama-bench `-d D`);
//! - one node serving every block with S concurrent sessions against one session alone;
//! - a chain of nodes on loopback against the same model in this process, and the same spans chained with none of
//!   Petal's networking (`chain_floor`: what this machine allows a chain);
//! - the peak resident size of a `petal-node serve` process holding every block, with no session open.
//!
//! Local runs go through [`Generator::local`], swarm runs through [`petal_cli::LocalSwarm`] and
//! [`Generator::remote`]: the one decode loop's step, over either kind of blocks. Progress is logged with
//! `tracing`; the JSON report goes to stdout.
mod chain_floor;
mod node_rss;

use crate::model::{prompt_ids, weights_bytes};
use crate::report::{median, percentile_ms, round};
use crate::runs::chain_config;
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device};
use clap::Args as ClapArgs;
use petal_cli::LocalSwarm;
use petal_client::{Generator, Session, SwarmClient};
use petal_model::models_dir::{default_model, missing_model, DEFAULT_MODEL};
use petal_model::{BlockRange, DeviceSpec, ModelRef, ModelSource, Placement};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Barrier;

/// Prompt of the plain decode test (llama-bench's `tg` starts from an empty context: one token stands for it).
const DECODE_PROMPT: usize = 1;
/// Prompt of each session in the concurrent-sessions test.
const SESSION_PROMPT: usize = 8;
/// Untimed decode steps and prefill length that warm caches, pages and connections before a measurement.
const WARMUP_STEPS: usize = 4;
const WARMUP_PREFILL: usize = 64;
/// Measurements `--skip` can leave out.
const PARTS: [&str; 6] = ["prefill", "decode", "depth", "sessions", "swarm", "rss"];

#[derive(ClapArgs, Debug)]
pub struct CompareArgs {
    /// Model, normally the GGUF llama.cpp is given (default: SmolLM2-135M-Instruct Q4_1 from $PETAL_MODELS or
    /// ../shared/models), or a hub repository org/name[:QUANT][@revision], downloaded whole first.
    #[arg(long)]
    model: Option<ModelRef>,
    /// Timed runs per measurement; medians are reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Prompt lengths of the prefill tests, in token ids.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    prefill: Vec<usize>,
    /// Tokens of the plain decode test.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Context depths of the decode-at-depth tests.
    #[arg(long, value_delimiter = ',', default_value = "2048,4096")]
    depths: Vec<usize>,
    /// Decode steps timed at each depth.
    #[arg(long, default_value_t = 32)]
    depth_steps: usize,
    /// Concurrent sessions on one node serving every block.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Tokens each session decodes in the concurrent-sessions test (and the lone session).
    #[arg(long, default_value_t = 32)]
    session_tokens: usize,
    /// Nodes of the chain compared with local decoding.
    #[arg(long, default_value_t = 3)]
    chain: usize,
    /// The petal-node binary for the resident-size test (default: beside this binary).
    #[arg(long)]
    node_bin: Option<PathBuf>,
    /// Measurements to leave out: prefill, decode, depth, sessions, swarm, rss.
    #[arg(long, value_delimiter = ',')]
    skip: Vec<String>,
    /// KV cache dtype of every Petal run (local, nodes): f32, f16 or bf16 (default: the compute dtype, f32).
    /// llama.cpp's default cache is f16.
    #[arg(long, value_parser = parse_kv_dtype)]
    kv_dtype: Option<DType>,
    /// Device of every Petal run (local model, nodes, the client's head): cpu, cuda:N, metal:N or auto (GPU
    /// builds: `--features cuda`). The node's resident size is measured on the CPU only.
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn parse_kv_dtype(s: &str) -> std::result::Result<DType, String> {
    petal_model::compute::placement::parse_dtype(s).map_err(|e| e.to_string())
}

impl CompareArgs {
    fn runs(&self, part: &str) -> bool {
        !self.skip.iter().any(|s| s == part)
    }

    fn check(&self) -> Result<()> {
        ensure!(self.repeats >= 1, "--repeats must be at least 1");
        ensure!(
            self.decode_tokens >= 1 && self.depth_steps >= 1 && self.session_tokens >= 1,
            "--decode-tokens, --depth-steps and --session-tokens must be at least 1"
        );
        ensure!(self.sessions >= 1, "--sessions must be at least 1");
        ensure!(self.chain >= 1, "--chain must be at least 1");
        ensure!(
            self.prefill.iter().chain(&self.depths).all(|&n| n >= 1),
            "--prefill and --depths take positive token counts"
        );
        if let Some(bad) = self.skip.iter().find(|s| !PARTS.contains(&s.as_str())) {
            bail!("--skip {bad:?}: expected some of {PARTS:?}");
        }
        Ok(())
    }
}

/// The model under test, opened once.
struct Model {
    path: PathBuf,
    source: ModelSource,
    /// `--device`, as named (for the nodes) and opened (for the local model and the head).
    device: DeviceSpec,
    head: Placement,
    span: Placement,
    /// `--kv-dtype`.
    kv_dtype: Option<DType>,
}

impl Model {
    fn open(args: &CompareArgs) -> Result<Self> {
        let path = match &args.model {
            Some(m) => petal_cli::hub::local_path(m)?,
            None => default_model().with_context(|| missing_model(DEFAULT_MODEL))?,
        };
        let device = DeviceSpec::parse(&args.device)?;
        let opened: Device = device.open()?;
        let source =
            ModelSource::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let span = source.block_placement(&opened, Some(DType::F32));
        Ok(Self {
            path,
            device,
            head: Placement::new(opened, DType::F32),
            span,
            kv_dtype: args.kv_dtype,
            source,
        })
    }

    fn vocab(&self) -> usize {
        self.source.spec().vocab_size
    }

    fn blocks(&self) -> usize {
        self.source.spec().num_blocks
    }

    /// Checks that `positions` fit in the model's context.
    fn check_fits(&self, what: &str, positions: usize) -> Result<()> {
        let max = self.source.spec().max_position;
        ensure!(
            positions <= max,
            "{what} needs {positions} positions; the model has {max}"
        );
        Ok(())
    }
}

/// The whole comparison; returns the report.
pub async fn run(args: &CompareArgs) -> Result<Value> {
    args.check()?;
    let started = Instant::now();
    let model = Model::open(args)?;
    for &n in &args.prefill {
        model.check_fits("--prefill", n)?;
    }
    for &d in &args.depths {
        model.check_fits("--depths", d + args.depth_steps)?;
    }
    model.check_fits("--decode-tokens", DECODE_PROMPT + args.decode_tokens)?;
    let mut report = describe(&model, args)?;
    tracing::info!(model = %model.path.display(), threads = candle_core::utils::get_num_threads(), "compare");

    if args.runs("prefill") || args.runs("decode") || args.runs("depth") {
        let local = Generator::local_with_kv(&model.source, model.head.clone(), model.kv_dtype)?;
        warm_up(&local, model.vocab()).await?;
        if args.runs("prefill") {
            report["prefill"] = measure_prefills(&local, &model, args).await?;
        }
        if args.runs("decode") {
            report["decode"] = measure_decode(&local, &model, args).await?;
        }
        if args.runs("depth") {
            report["decode_at_depth"] = measure_depths(&local, &model, args).await?;
        }
    }
    if args.runs("swarm") {
        report["swarm"] = measure_swarm(&model, args).await?;
    }
    if args.runs("sessions") {
        report["sessions"] = measure_sessions(&model, args).await?;
    }
    if args.runs("rss") {
        report["node_rss"] = node_rss::measure(&model, args).await?;
    }
    report["load_avg_end"] = crate::load_average();
    report["elapsed_seconds"] = json!(round(started.elapsed().as_secs_f64(), 1));
    Ok(report)
}

/// What was measured and how: the report's fields other than the figures.
fn describe(model: &Model, args: &CompareArgs) -> Result<Value> {
    Ok(json!({
        "model": model.path.display().to_string(),
        "model_id": model.source.model_id()?,
        "quantization": model.source.quantization(),
        "device": model.device.to_string(),
        "gguf_bytes": weights_bytes(&model.path),
        "compute_dtype": model.span.dtype.as_str(),
        "kv_dtype": model.kv_dtype.unwrap_or(model.span.dtype).as_str(),
        "threads": candle_core::utils::get_num_threads(),
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "repeats": args.repeats,
        "load_avg_start": crate::load_average(),
    }))
}

/// An untimed prefill and a few decode steps: page faults, allocator pools, rayon's threads.
async fn warm_up(generator: &Generator, vocab: usize) -> Result<()> {
    prefill_once(generator, &prompt_ids(WARMUP_PREFILL, vocab)).await?;
    decode_run(generator, &prompt_ids(DECODE_PROMPT, vocab), WARMUP_STEPS).await?;
    Ok(())
}

// --- prefill and decode ----------------------------------------------------------------------------------------

/// The time of one forward of `ids` on a fresh session: embeddings, every block, final norm and LM head for the
/// last position.
async fn prefill_once(generator: &Generator, ids: &[u32]) -> Result<Duration> {
    let mut session = generator.open_session(ids.len()).await?;
    let t = Instant::now();
    // A GPU computes asynchronously: the clock stops once the logits exist, not when their kernels are queued.
    let result = match generator.step(&mut session, ids).await {
        Ok((logits, _)) => logits.device().synchronize().map_err(anyhow::Error::from),
        Err(e) => Err(e.into()),
    };
    let elapsed = t.elapsed();
    session.close().await;
    result?;
    Ok(elapsed)
}

/// Greedy: the id of the largest logit, as the sampler picks it (`greedy::argmax`, a few µs over a vocabulary's
/// logits, so on the calling task: handing the worker's core over would cost more).
fn argmax(logits: &candle_core::Tensor) -> Result<u32> {
    Ok(petal_model::text::greedy::argmax(logits)?)
}

/// Each decode step's wall time (embedding, blocks, head, argmax) and the blocks' share of it.
#[derive(Default)]
struct Steps {
    total: Vec<Duration>,
    blocks: Vec<Duration>,
}

impl Steps {
    fn tokens_per_second(&self) -> f64 {
        let secs: f64 = self.total.iter().map(Duration::as_secs_f64).sum();
        self.total.len() as f64 / secs.max(1e-9)
    }

    fn extend(&mut self, other: Steps) {
        self.total.extend(other.total);
        self.blocks.extend(other.blocks);
    }
}

/// `steps` greedy single-token steps on `session`, which holds a prefilled context whose last logits are
/// `logits`.
async fn decode_steps(
    generator: &Generator,
    session: &mut Session,
    logits: candle_core::Tensor,
    steps: usize,
) -> Result<Steps> {
    let mut token = argmax(&logits)?;
    let mut out = Steps::default();
    for _ in 0..steps {
        let t = Instant::now();
        let (logits, timing) = generator.step(session, &[token]).await?;
        token = argmax(&logits)?;
        out.total.push(t.elapsed());
        out.blocks.push(timing.blocks);
    }
    Ok(out)
}

/// Prefills `prompt` (untimed) on a fresh session, then times `steps` decode steps.
async fn decode_run(generator: &Generator, prompt: &[u32], steps: usize) -> Result<Steps> {
    let mut session = generator.open_session(prompt.len() + steps).await?;
    let result = async {
        let (logits, _) = generator.step(&mut session, prompt).await?;
        decode_steps(generator, &mut session, logits, steps).await
    }
    .await;
    session.close().await;
    result
}

/// Medians over `repeats` of a prefill of exactly `n` token ids, for each `n` of `--prefill`.
async fn measure_prefills(local: &Generator, model: &Model, args: &CompareArgs) -> Result<Value> {
    let mut out = vec![];
    for &n in &args.prefill {
        let ids = prompt_ids(n, model.vocab());
        let mut runs = vec![];
        for _ in 0..args.repeats {
            runs.push(prefill_once(local, &ids).await?.as_secs_f64() * 1e3);
        }
        let ms = median(&runs);
        let tps = n as f64 / (ms / 1e3).max(1e-9);
        tracing::info!(
            tokens = n,
            ms = round(ms, 1),
            tokens_per_second = round(tps, 1),
            "prefill"
        );
        out.push(json!({
            "tokens": n,
            "ms": round(ms, 2),
            "tokens_per_second": round(tps, 2),
            "runs_ms": runs.iter().map(|&r| round(r, 2)).collect::<Vec<_>>(),
        }));
    }
    Ok(json!(out))
}

/// Decode tokens/s of `steps` steps after a `prompt`-token prefill, median over `repeats` runs.
async fn decode_rate(
    generator: &Generator,
    prompt: &[u32],
    steps: usize,
    repeats: usize,
) -> Result<Value> {
    let mut runs = vec![];
    let mut all = Steps::default();
    for _ in 0..repeats {
        let s = decode_run(generator, prompt, steps).await?;
        runs.push(s.tokens_per_second());
        all.extend(s);
    }
    Ok(json!({
        "prompt_tokens": prompt.len(),
        "tokens": steps,
        "tokens_per_second": round(median(&runs), 2),
        "runs_tokens_per_second": runs.iter().map(|&r| round(r, 2)).collect::<Vec<_>>(),
        "ms_per_token_median": round(crate::report::median_ms(&all.total), 3),
        "blocks_ms_per_token_median": round(crate::report::median_ms(&all.blocks), 3),
    }))
}

/// tg128: `--decode-tokens` steps after a one-token prompt.
async fn measure_decode(local: &Generator, model: &Model, args: &CompareArgs) -> Result<Value> {
    let prompt = prompt_ids(DECODE_PROMPT, model.vocab());
    let v = decode_rate(local, &prompt, args.decode_tokens, args.repeats).await?;
    tracing::info!(tokens = args.decode_tokens, tokens_per_second = %v["tokens_per_second"], "decode");
    Ok(v)
}

/// `--depth-steps` decode steps after a prefill of each of `--depths`.
async fn measure_depths(local: &Generator, model: &Model, args: &CompareArgs) -> Result<Value> {
    let mut out = vec![];
    for &depth in &args.depths {
        let prompt = prompt_ids(depth, model.vocab());
        let mut v = decode_rate(local, &prompt, args.depth_steps, args.repeats).await?;
        v["depth"] = json!(depth);
        tracing::info!(depth, tokens_per_second = %v["tokens_per_second"], "decode at depth");
        out.push(v);
    }
    Ok(json!(out))
}

// --- swarms ----------------------------------------------------------------------------------------------------

/// Starts an in-process swarm whose nodes serve `spans`, runs `body` with a client of it, and shuts both down
/// whatever `body` returned.
async fn with_swarm<T>(
    model: &Model,
    spans: &[BlockRange],
    body: impl AsyncFnOnce(&SwarmClient) -> Result<T>,
) -> Result<T> {
    let (device, dtype, kv_dtype) = (model.device, model.span.dtype, model.kv_dtype);
    let swarm = LocalSwarm::start(&model.path, spans, |cfg| {
        cfg.devices = vec![device];
        cfg.dtype = Some(dtype);
        cfg.kv_dtype = kv_dtype;
    })
    .await?;
    let result = match swarm.client().await {
        Ok(client) => {
            let r = body(&client).await;
            client.shutdown().await;
            r
        }
        Err(e) => Err(e.into()),
    };
    swarm.shutdown().await;
    result
}

/// tg128 through a chain of `--chain` nodes on loopback against the same in this process, runs alternated so
/// load drift on a shared machine hits both alike.
async fn measure_swarm(model: &Model, args: &CompareArgs) -> Result<Value> {
    let spans = BlockRange::split_even(model.blocks(), args.chain);
    let local = Generator::local_with_kv(&model.source, model.head.clone(), model.kv_dtype)?;
    let prompt = prompt_ids(DECODE_PROMPT, model.vocab());
    let steps = args.decode_tokens;
    let (local_runs, chain_runs) = with_swarm(model, &spans, async |client| {
        let remote = Generator::remote(client, &model.source, model.head.clone(), chain_config())?;
        warm_up(&local, model.vocab()).await?;
        warm_up(&remote, model.vocab()).await?;
        let (mut l, mut c) = (vec![], vec![]);
        for _ in 0..args.repeats {
            l.push(
                decode_run(&local, &prompt, steps)
                    .await?
                    .tokens_per_second(),
            );
            c.push(
                decode_run(&remote, &prompt, steps)
                    .await?
                    .tokens_per_second(),
            );
        }
        Ok((l, c))
    })
    .await?;
    let (l, c) = (median(&local_runs), median(&chain_runs));
    tracing::info!(
        nodes = args.chain,
        local = round(l, 2),
        chain = round(c, 2),
        "chain decode"
    );
    let list = |v: &[f64]| v.iter().map(|&r| round(r, 2)).collect::<Vec<_>>();
    // The floor's nodes are plain threads on the CPU.
    let floor = if model.span.device.is_cpu() {
        let floor = measure_floor(model, &spans, &prompt, steps, args.repeats).await?;
        let (l, c) = (median(&floor.local), median(&floor.chain));
        tracing::info!(local = round(l, 2), chain = round(c, 2), "chain floor");
        json!({
            "local_tokens_per_second": round(l, 2),
            "chain_tokens_per_second": round(c, 2),
            "ratio_to_local": round(c / l.max(1e-9), 3),
            "runs_local": list(&floor.local),
            "runs_chain": list(&floor.chain),
        })
    } else {
        Value::Null
    };
    Ok(json!({
        "nodes": args.chain,
        "spans": spans.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "tokens": steps,
        "local_tokens_per_second": round(l, 2),
        "chain_tokens_per_second": round(c, 2),
        "ratio_to_local": round(c / l.max(1e-9), 3),
        "runs_local": list(&local_runs),
        "runs_chain": list(&chain_runs),
        "floor": floor,
    }))
}

/// [`chain_floor::measure`] for the swarm row's spans and decode, off the async runtime.
async fn measure_floor(
    model: &Model,
    spans: &[BlockRange],
    prompt: &[u32],
    steps: usize,
    repeats: usize,
) -> Result<chain_floor::Floor> {
    let (path, kv, spans, prompt) = (
        model.path.clone(),
        model.kv_dtype,
        spans.to_vec(),
        prompt.to_vec(),
    );
    let threads = rayon::current_num_threads();
    tokio::task::spawn_blocking(move || {
        let source = ModelSource::open(&path)?;
        chain_floor::measure(&source, kv, &spans, &prompt, steps, repeats, threads)
    })
    .await
    .context("the chain floor's thread panicked")?
}

/// One session's decode in the concurrent test: the steps, and when its decoding started and ended.
struct SessionRun {
    steps: Steps,
    end: Instant,
}

/// `n` sessions on `generator`, each opened and prefilled with its own prompt, then all decoding `tokens` tokens
/// at once (released together by a barrier). Returns each session's run and the instant they were released.
async fn concurrent_sessions(
    generator: Arc<Generator>,
    n: usize,
    tokens: usize,
    vocab: usize,
) -> Result<(Vec<SessionRun>, Instant)> {
    let barrier = Arc::new(Barrier::new(n + 1));
    // Sessions open and prefill at once, as an API server's first users would (tested in tests/batching.rs); only
    // the decoding is measured.
    let prompts = prompt_ids(SESSION_PROMPT * n, vocab);
    let mut tasks = vec![];
    for prompt in prompts.chunks(SESSION_PROMPT) {
        let (generator, barrier, prompt) = (generator.clone(), barrier.clone(), prompt.to_vec());
        tasks.push(tokio::spawn(async move {
            let opened = open_prefilled(&generator, &prompt, tokens).await;
            // Every task reaches the barrier, failed or not, so none waits for ever.
            barrier.wait().await;
            let (mut session, logits) = opened?;
            let steps = decode_steps(&generator, &mut session, logits, tokens).await;
            let end = Instant::now();
            session.close().await;
            Ok::<_, anyhow::Error>(SessionRun { steps: steps?, end })
        }));
    }
    barrier.wait().await;
    let released = Instant::now();
    // Every task is awaited before any error is returned, so none outlives the swarm it runs on.
    let mut results = vec![];
    for task in tasks {
        results.push(task.await.context("a session task panicked"));
    }
    let runs = results
        .into_iter()
        .map(|r| r.and_then(|r| r))
        .collect::<Result<Vec<_>>>()?;
    Ok((runs, released))
}

/// A session with `prompt` prefilled and room for `tokens` more, and the prompt's last logits.
async fn open_prefilled(
    generator: &Generator,
    prompt: &[u32],
    tokens: usize,
) -> Result<(Session, candle_core::Tensor)> {
    let mut session = generator.open_session(prompt.len() + tokens).await?;
    match generator.step(&mut session, prompt).await {
        Ok((logits, _)) => Ok((session, logits)),
        Err(e) => {
            session.close().await;
            Err(e.into())
        }
    }
}

/// Per-token latency statistics of `steps`, in ms.
fn latency_json(steps: &Steps) -> Value {
    json!({
        "ms_per_token_median": round(crate::report::median_ms(&steps.total), 3),
        "ms_per_token_p90": round(percentile_ms(&steps.total, 0.9), 3),
        "blocks_ms_per_token_median": round(crate::report::median_ms(&steps.blocks), 3),
    })
}

/// One node serving every block: `--sessions` sessions decoding at once against one alone, alternated over
/// `--repeats`.
async fn measure_sessions(model: &Model, args: &CompareArgs) -> Result<Value> {
    let spans = [BlockRange::new(0, model.blocks())];
    let (n, tokens, vocab) = (args.sessions, args.session_tokens, model.vocab());
    let (lone, lone_tps, together, aggregate, head) = with_swarm(model, &spans, async |client| {
        let remote = Arc::new(Generator::remote(
            client,
            &model.source,
            model.head.clone(),
            chain_config(),
        )?);
        warm_up(&remote, vocab).await?;
        let prompt = prompt_ids(SESSION_PROMPT, vocab);
        let (mut lone, mut lone_tps) = (Steps::default(), vec![]);
        let (mut together, mut aggregate) = (Steps::default(), vec![]);
        for _ in 0..args.repeats {
            let s = decode_run(&remote, &prompt, tokens).await?;
            lone_tps.push(s.tokens_per_second());
            lone.extend(s);
            let (runs, released) = concurrent_sessions(remote.clone(), n, tokens, vocab).await?;
            let last = runs.iter().map(|r| r.end).max().unwrap_or(released);
            aggregate.push((n * tokens) as f64 / (last - released).as_secs_f64().max(1e-9));
            runs.into_iter().for_each(|r| together.extend(r.steps));
        }
        // How often the sessions' LM heads shared a matmul in the client.
        let head = remote
            .head()
            .batch_stats()
            .map(|b| json!({ "batches": b.batches, "calls": b.calls, "largest": b.largest }));
        Ok((lone, lone_tps, together, aggregate, head))
    })
    .await?;
    let (one, all) = (median(&lone_tps), median(&aggregate));
    let latency_ratio =
        crate::report::median_ms(&together.total) / crate::report::median_ms(&lone.total).max(1e-9);
    tracing::info!(
        sessions = n,
        lone = round(one, 2),
        aggregate = round(all, 2),
        "concurrent sessions"
    );
    Ok(json!({
        "sessions": n,
        "tokens_each": tokens,
        "prompt_tokens": SESSION_PROMPT,
        "lone_tokens_per_second": round(one, 2),
        "aggregate_tokens_per_second": round(all, 2),
        "aggregate_ratio_to_lone": round(all / one.max(1e-9), 3),
        "latency_ratio_to_lone": round(latency_ratio, 3),
        "lone": latency_json(&lone),
        "concurrent": latency_json(&together),
        "runs_lone_tokens_per_second": lone_tps.iter().map(|&r| round(r, 2)).collect::<Vec<_>>(),
        "runs_aggregate_tokens_per_second": aggregate.iter().map(|&r| round(r, 2)).collect::<Vec<_>>(),
        "head_batching": head,
    }))
}
