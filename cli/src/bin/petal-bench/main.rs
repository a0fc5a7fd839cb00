//! `petal-bench`: what a Petal swarm costs compared with running the model in one process.
//!
//! The model runs locally first (greedy, a fixed number of tokens, EOS ignored), then through in-process swarms on
//! loopback (a bootstrap peer and `k` nodes splitting the blocks evenly, for each `k` of `--chains`). One JSON
//! object on stdout reports tokens/s, the ratio to local, the latency each hop adds, bytes on the wire per token
//! and whether the swarm produced exactly the local tokens. Microbenchmarks of the per-hop costs (serialisation,
//! a libp2p round trip of the same frames, the hand-off to the blocking pool) say what bounds the added latency.
//! Progress goes to stderr. See docs/benchmarks.md.
//!
//! Every generation, local or through a swarm, goes through the one decode loop ([`petal_client::Generator`]); the
//! probe speaks the per-hop protocol through [`petal_client::HopClient`]; the swarms are [`petal_cli::LocalSwarm`]s.
//!
//! `petal-bench compare` measures Petal's side of the side-by-side benchmark with llama.cpp instead
//! (`scripts/bench-compare`; see [`compare`]). `petal-bench gguf` writes a random-weight GGUF of a real shape
//! (see [`gguf`]).
mod compare;
mod gguf;
mod model;
mod overhead;
mod probe;
mod report;
mod runs;

use anyhow::{bail, ensure, Result};
use clap::{Parser, Subcommand};
use petal_cli::app::{self, CommonArgs};
use petal_client::VerifyPolicy;
use report::{round, Summary};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Tokens of the untimed warm-up run before each measurement (page faults, connections, caches).
const WARMUP_TOKENS: usize = 8;
/// Models whose weights take at most this many bytes keep the local copy loaded during the swarm runs, so local and
/// swarm runs alternate and load drift on a shared machine hits both alike. Bigger ones are dropped before the
/// nodes load their spans, so the weights are never held twice.
const PAIRED_MAX_BYTES: u64 = 1 << 30;

#[derive(Parser, Debug)]
#[command(
    name = "petal-bench",
    version,
    about = "Compare local generation with in-process Petal swarms on loopback; prints one JSON object"
)]
struct Args {
    #[command(flatten)]
    common: CommonArgs,
    #[command(subcommand)]
    command: Option<Command>,
    /// Model: a Hugging Face directory, a .gguf file or a llama2.c .bin (default: SmolLM2-135M-Instruct Q4_1
    /// from $PETAL_MODELS or ../shared/models), or a hub repository org/name[:QUANT][@revision], downloaded whole
    /// first (the bench compares the same files in every setting).
    #[arg(long, conflicts_with = "synthetic")]
    model: Option<petal_model::ModelRef>,
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
    /// Family of the synthetic model: llama, mistral, mixtral, qwen2, qwen3, phi3, gemma2 or gemma3 (its
    /// widths are the shape's; its tensors, norms and attention the family's).
    #[arg(long, default_value = "llama", requires = "synthetic")]
    family: String,
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
    /// Compute dtype (f32, f16, bf16); synthetic weights are also written in it. GGUF blocks stay quantized (f32
    /// compute) unless f16 or bf16 is asked.
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
    /// What checking servers' answers costs: on a swarm of 2 spans, each served twice, a run per policy (e.g.
    /// off,0.05,all; the first is the baseline of the ratios). Empty: not measured.
    #[arg(long, value_delimiter = ',', value_name = "POLICY,...")]
    verify: Vec<VerifyPolicy>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Petal's half of the side-by-side benchmark with llama.cpp (prefill, decode, decode at depth, concurrent
    /// sessions, a chain against local, a node's resident size); scripts/bench-compare runs it with llama-bench.
    Compare(compare::CompareArgs),
    /// Write a random-weight model of a real shape (8b, 14b, 70b, 30b-a3b, deepseek-v2-lite, gpt-oss-20b) as a
    /// GGUF file (q4_0, q8_0, q4_k_m, q5_k_m, f32, mxfp4_moe) and print what was written.
    Gguf(gguf::GgufArgs),
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Some(Command::Gguf(gguf)) = &args.command {
        return app::run(&args.common, "warn", async {
            println!("{}", serde_json::to_string_pretty(&gguf::run(gguf)?)?);
            Ok(())
        });
    }
    if let Some(Command::Compare(compare)) = &args.command {
        // Progress of the comparison is logged at info; nodes and libp2p stay at warn.
        return app::run(
            &args.common,
            "warn,libp2p_kad=error,petal_bench=info",
            async {
                let report = compare::run(compare).await?;
                println!("{}", serde_json::to_string_pretty(&report)?);
                Ok(())
            },
        );
    }
    // Kademlia warns that the bootstrap peer, which has no peers of its own, cannot bootstrap: expected here.
    app::run(&args.common, "warn,libp2p_kad=error", async {
        let report = run(&args).await?;
        // The report is this binary's output.
        println!("{}", serde_json::to_string_pretty(&report)?);
        Ok(())
    })
}

/// The whole bench: local, overhead microbenchmarks, then each chain; returns the report.
async fn run(args: &Args) -> Result<Value> {
    let started = Instant::now();
    let load_start = load_average();
    check_args(args)?;
    let target = model::Target::parse(args)?;
    let (path, synthetic, _temp) = model::resolve(args)?;
    let deadline = started + Duration::from_secs_f64(args.budget_seconds);
    let bench = model::prepare(args, path, target, deadline)?;
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

    let local = runs::Local::load(&bench)?;
    let local_runs = runs::measure_local(&bench, &local).await?;
    let local_summary = Summary::of(&local_runs);
    eprintln!(
        "local      {:.2} tokens/s ({:.2} ms/token)",
        local_summary.tokens_per_second, local_summary.ms_per_token
    );
    // Bigger models drop the local copy here, before any node loads its span.
    let paired = (model::weights_bytes(&bench.path) <= PAIRED_MAX_BYTES).then_some(local);

    let overhead = if args.no_overhead {
        Value::Null
    } else {
        let spec = bench.source.spec();
        overhead::measure(spec.hidden_size, bench.span_placement.dtype).await?
    };
    let mut chains = vec![];
    for &k in &args.chains {
        chains.push(runs::measure_chain(&bench, k, paired.as_ref()).await?);
    }
    drop(paired);
    let verification = runs::measure_verification(&bench, &args.verify).await?;

    let mut report = describe(&bench, args, synthetic)?;
    report["machine"] = json!({
        "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        "compute_threads": candle_core::utils::get_num_threads(),
        "load_avg_start": load_start,
        "load_avg_end": load_average(),
    });
    report["local"] = local_summary.to_json();
    // The greedy tokens themselves, so runs on different devices or builds can be compared.
    report["local"]["tokens"] = json!(local_runs.first().map(|r| r.tokens.clone()));
    report["chains"] = chains
        .iter()
        .map(|c| c.to_json(&local_summary, &local_runs))
        .collect();
    report["overhead"] = overhead;
    report["verification"] = verification;
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

/// What was measured and how: the report's fields other than the figures.
fn describe(bench: &model::Bench, args: &Args, synthetic: Value) -> Result<Value> {
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
