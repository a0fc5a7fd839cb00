//! Generations, locally and through in-process swarms, all through the one decode loop
//! ([`petal_client::Generator`]): what each run produced and how long its steps took.
use crate::model::Bench;
use crate::report::{median_ms, Chain, Summary};
use crate::{load_average, probe, WARMUP_TOKENS};
use anyhow::Result;
use petal_cli::LocalSwarm;
use petal_client::{ChainConfig, Completion, Generator, LocalSpans, SwarmClient, VerifyPolicy};
use petal_model::{BlockRange, GenerationConfig};
use serde_json::Value;
use std::time::{Duration, Instant};

/// How long the client waits for the swarm's records to cover the model.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Timeouts of the bench's chain sessions and probe hops: the library's, with a longer wait for the freshly
/// started nodes' records.
pub fn chain_config() -> ChainConfig {
    ChainConfig {
        discovery_timeout: DISCOVERY_TIMEOUT,
        ..ChainConfig::default()
    }
}

/// What checking servers' answers costs: a swarm of two spans, each served by two nodes, and `repeats`
/// generations under each of `policies` in turn (the first is the baseline). Null when `policies` is empty.
pub async fn measure_verification(bench: &Bench, policies: &[VerifyPolicy]) -> Result<Value> {
    let Some(baseline) = policies.first() else {
        return Ok(Value::Null);
    };
    let halves = BlockRange::split_even(bench.source.spec().num_blocks, 2);
    let spans: Vec<BlockRange> = halves.iter().chain(&halves).copied().collect();
    let (device, dtype) = (bench.device, bench.span_placement.dtype);
    let swarm = LocalSwarm::start(&bench.path, &spans, |cfg| {
        cfg.devices = vec![device];
        cfg.dtype = Some(dtype);
    })
    .await?;
    let client = swarm.client().await?;
    let mut rows = vec![];
    let mut result = Ok(());
    for policy in policies {
        let config = ChainConfig {
            verify: *policy,
            ..chain_config()
        };
        let generator =
            match Generator::remote(&client, &bench.source, bench.head_placement.clone(), config) {
                Ok(g) => g,
                Err(e) => {
                    result = Err(e.into());
                    break;
                }
            };
        match measure_checked(bench, &generator).await {
            Ok(row) => rows.push((*policy, row)),
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    client.shutdown().await;
    swarm.shutdown().await;
    result?;
    let base = rows
        .iter()
        .find(|(p, _)| p == baseline)
        .map_or(1.0, |(_, r)| r.0.tokens_per_second);
    let rows: Vec<Value> = rows
        .into_iter()
        .map(|(policy, (summary, checked, mismatches))| {
            eprintln!(
                "verify {policy:<5} {:.2} tokens/s ({:.2}x of {baseline}), {checked} hop steps checked",
                summary.tokens_per_second,
                summary.tokens_per_second / base
            );
            serde_json::json!({
                "policy": policy.to_string(),
                "tokens_per_second": summary.tokens_per_second,
                "ratio": summary.tokens_per_second / base,
                "checked_steps_per_run": checked,
                "mismatches": mismatches,
            })
        })
        .collect();
    Ok(
        serde_json::json!({ "spans": spans.iter().map(ToString::to_string).collect::<Vec<_>>(), "runs": rows }),
    )
}

/// A warm-up and `repeats` generations through `generator`: their summary, and the median hop steps checked and
/// the mismatches found per run.
async fn measure_checked(bench: &Bench, generator: &Generator) -> Result<(Summary, u64, usize)> {
    generate(generator, bench, WARMUP_TOKENS).await?;
    let (mut runs, mut checked, mut mismatches) = (vec![], vec![], 0);
    for _ in 0..bench.repeats {
        let run = generate(generator, bench, bench.workload.new_tokens()).await?;
        checked.push(run.checked_steps);
        mismatches += run.mismatches;
        runs.push(run);
    }
    checked.sort_unstable();
    Ok((Summary::of(&runs), checked[checked.len() / 2], mismatches))
}

/// The whole model in this process: a generator over `spans`, which the probe also runs directly.
pub struct Local {
    pub generator: Generator,
    /// The generator's blocks (shared weights, not a second copy).
    pub spans: LocalSpans,
}

impl Local {
    pub fn load(bench: &Bench) -> Result<Self> {
        let source = &bench.source;
        let spans = LocalSpans::load(source, &bench.span_placement, None)?;
        let generator = Generator::new(
            source.load_head(bench.head_placement.clone())?,
            spans.clone(),
            source.model_id()?,
            source.spec().max_position,
        );
        Ok(Self { generator, spans })
    }
}

/// One generation's measurements.
#[derive(Debug, Clone)]
pub struct Run {
    pub tokens: Vec<u32>,
    /// Decode speed: tokens after the first per second (the prompt's prefill excluded).
    pub tokens_per_second: f64,
    pub first_token_ms: f64,
    pub bytes_on_wire: u64,
    pub route: Vec<String>,
    /// Medians over the decode steps (the prefill excluded), in ms: the blocks (local compute, or the chain's
    /// round trips), and the head's share (embedding, final norm and LM head, sampling).
    pub blocks_ms: f64,
    pub head_ms: f64,
    /// Hop steps checked on a second server, and the checks that disagreed.
    pub checked_steps: u64,
    pub mismatches: usize,
}

impl Run {
    fn of(completion: Completion) -> Self {
        let decode = completion.cost.steps.get(1..).unwrap_or_default();
        let blocks: Vec<Duration> = decode.iter().map(|s| s.blocks).collect();
        let heads: Vec<Duration> = decode.iter().map(|s| s.embed + s.head + s.sample).collect();
        Self {
            tokens: completion.output.tokens,
            tokens_per_second: completion.output.tokens_per_second,
            first_token_ms: completion.output.first_token_ms,
            bytes_on_wire: completion.cost.bytes_on_wire,
            route: completion.cost.route,
            blocks_ms: median_ms(&blocks),
            head_ms: median_ms(&heads),
            checked_steps: completion.cost.verification.checked_steps,
            mismatches: completion.cost.verification.mismatches.len(),
        }
    }
}

/// One generation of `new_tokens` tokens through `generator`: text through the tokenizer, or token ids alone.
async fn generate(generator: &Generator, bench: &Bench, new_tokens: usize) -> Result<Run> {
    let workload = &bench.workload;
    let config = GenerationConfig {
        max_new_tokens: new_tokens,
        ..workload.config.clone()
    };
    let completion = match &workload.tokenizer {
        Some(tokenizer) => {
            generator
                .generate(tokenizer, &workload.prompt, &config, |_| true)
                .await?
        }
        None => generator.generate_ids(&workload.prompt, &config).await?,
    };
    Ok(Run::of(completion))
}

/// An untimed warm-up, then up to `repeats` timed generations through `generator`, each preceded by one through
/// `paired` when given (so drifting load hits both alike). Returns both sets of runs.
async fn measure(
    bench: &Bench,
    generator: &Generator,
    paired: Option<&Generator>,
) -> Result<(Vec<Run>, Vec<Run>)> {
    generate(generator, bench, WARMUP_TOKENS).await?;
    let n = bench.workload.new_tokens();
    let (mut runs, mut paired_runs) = (vec![], vec![]);
    for i in 0..bench.repeats {
        if !bench.should_repeat(i) {
            break;
        }
        if let Some(paired) = paired {
            paired_runs.push(generate(paired, bench, n).await?);
        }
        runs.push(generate(generator, bench, n).await?);
    }
    Ok((runs, paired_runs))
}

/// A warm-up, then `repeats` timed local generations.
pub async fn measure_local(bench: &Bench, local: &Local) -> Result<Vec<Run>> {
    Ok(measure(bench, &local.generator, None).await?.0)
}

/// Starts a swarm of `k` nodes, generates `repeats` times through it (alternating with local runs when `local`
/// is kept), probes it, and stops it.
pub async fn measure_chain(bench: &Bench, k: usize, local: Option<&Local>) -> Result<Chain> {
    let spans = BlockRange::split_even(bench.source.spec().num_blocks, k);
    let load_avg = load_average();
    let t = Instant::now();
    let (device, dtype) = (bench.device, bench.span_placement.dtype);
    let swarm = LocalSwarm::start(&bench.path, &spans, |cfg| {
        cfg.devices = vec![device];
        cfg.dtype = Some(dtype);
    })
    .await?;
    let result = match swarm.client().await {
        Ok(client) => {
            let startup_seconds = t.elapsed().as_secs_f64();
            let runs = chain_runs(bench, &client, local).await;
            client.shutdown().await;
            runs.map(|runs| (startup_seconds, runs))
        }
        Err(e) => Err(e.into()),
    };
    swarm.shutdown().await;
    let (startup_seconds, (runs, paired_local, probe)) = result?;
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

/// Swarm runs (with paired local runs when `local` is given), then a probe of the per-hop costs.
async fn chain_runs(
    bench: &Bench,
    client: &SwarmClient,
    local: Option<&Local>,
) -> Result<(Vec<Run>, Vec<Run>, Value)> {
    let remote = Generator::remote(
        client,
        &bench.source,
        bench.head_placement.clone(),
        chain_config(),
    )?;
    let (runs, paired) = measure(bench, &remote, local.map(|l| &l.generator)).await?;
    let probe = probe::probe_chain(bench, &remote, client, local, bench.probe_steps()).await?;
    Ok((runs, paired, probe))
}
