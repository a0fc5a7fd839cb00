//! `petal demo`: a whole swarm in one process on loopback: a bootstrap peer and three nodes splitting the model,
//! then one prompt answered through them with the route shown.
use crate::args::SamplingArgs;
use anyhow::Context;
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use petal_cli::LocalSwarm;
use petal_client::{ChainConfig, Generator};
use petal_model::text::prompt::encode_prompt;
use petal_model::{models_dir, BlockRange, GenerationConfig, ModelRef, ModelSource, Placement};
use std::io::Write;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Model to split (default: SmolLM2-135M-Instruct from ../shared/models or $PETAL_MODELS): a path or a hub
    /// repository org/name[:QUANT][@revision]; each node downloads only the shards of its blocks.
    #[arg(long)]
    pub model: Option<ModelRef>,
    #[arg(long, default_value = "What is the capital of France?")]
    pub prompt: String,
    /// Nodes to split the model across.
    #[arg(long, default_value_t = 3)]
    pub nodes: usize,
    /// Send the prompt as plain text instead of through the chat template.
    #[arg(long)]
    pub no_chat: bool,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let model = match args.model {
        Some(m) => m,
        None => ModelRef::Local(
            models_dir::default_model()
                .with_context(|| models_dir::missing_model(models_dir::DEFAULT_MODEL))?,
        ),
    };
    let config = args.sampling.config()?;
    let source = petal_model::hub::open(&model, &petal_cli::hub::config(None))?;
    let spans = BlockRange::split_even(source.spec().num_blocks, args.nodes);

    let mut swarm = LocalSwarm::bootstrap().await?;
    eprintln!(
        "bootstrap  {}",
        swarm
            .bootstrap_addrs()
            .first()
            .map(ToString::to_string)
            .unwrap_or_default()
    );
    let result = answer(
        &mut swarm,
        &model,
        &source,
        &spans,
        &args.prompt,
        !args.no_chat,
        &config,
    )
    .await;
    swarm.shutdown().await;
    result
}

/// Starts the nodes, then answers the prompt through them.
async fn answer(
    swarm: &mut LocalSwarm,
    model: &ModelRef,
    source: &ModelSource,
    spans: &[BlockRange],
    prompt: &str,
    chat: bool,
    config: &GenerationConfig,
) -> anyhow::Result<()> {
    // Progress on stderr: nodes started, and below it the blocks of the node loading now. Hidden when stderr is
    // not a terminal; lines printed meanwhile go through `bars.suspend` so they never tear a bar.
    let bars = MultiProgress::new();
    let started = bars.add(
        ProgressBar::new(spans.len() as u64).with_style(
            ProgressStyle::with_template("{msg:<24} [{bar:30}] {pos}/{len} nodes ({elapsed})")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        ),
    );
    for (i, range) in spans.iter().enumerate() {
        started.set_message(format!("starting node{}", i + 1));
        let mut cfg = swarm.node_config(model, *range);
        cfg.progress = Some(bars.clone());
        cfg.hub = petal_cli::hub::config(Some(&bars));
        let node = match swarm.add_node(cfg).await {
            Ok(node) => node,
            Err(e) => {
                started.abandon();
                return Err(e.into());
            }
        };
        bars.suspend(|| eprintln!("node{}      blocks {range:<7} {}", i + 1, node.peer_id()));
        started.inc(1);
    }
    started.finish_and_clear();

    let client = swarm.client().await?;
    let chain = ChainConfig {
        discovery_timeout: Duration::from_secs(30),
        ..ChainConfig::default()
    };
    let generator = Generator::remote(&client, source, Placement::cpu_f32(), chain)?;
    let tokenizer = source.tokenizer(None)?;
    let chat = chat && tokenizer.chat_template().is_some();
    let ids = encode_prompt(&tokenizer, prompt, chat, None)?;
    eprintln!("prompt     {prompt:?}{}", if chat { " (chat)" } else { "" });
    let waiting =
        ProgressBar::new_spinner().with_message("waiting for the swarm to cover the model");
    waiting.enable_steady_tick(Duration::from_millis(100));
    let mut first = true;
    let completion = generator
        .generate(&tokenizer, &ids, config, |piece| {
            if first {
                waiting.finish_and_clear();
                first = false;
            }
            print!("{piece}");
            let _ = std::io::stdout().flush();
            true
        })
        .await;
    waiting.finish_and_clear();
    client.shutdown().await;
    let completion = completion?;
    println!();
    let output = &completion.output;
    eprintln!(
        "route      client -> {} -> client",
        completion.cost.route.join(" -> ")
    );
    eprintln!(
        "{} tokens at {:.1} tokens/s, first token after {:.0} ms, {} bytes on the wire",
        output.tokens.len(),
        output.tokens_per_second,
        output.first_token_ms,
        completion.cost.bytes_on_wire
    );
    Ok(())
}
