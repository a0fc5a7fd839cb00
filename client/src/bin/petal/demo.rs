//! `petal demo`: a whole swarm in one process on loopback: a bootstrap peer and three nodes splitting the model,
//! then one prompt answered through them with the route shown.
use crate::args::SamplingArgs;
use crate::backend::block_placement;
use anyhow::Context;
use clap::Args;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use petal_client::{RemoteModel, SwarmClient};
use petal_model::prompt::encode_prompt;
use petal_model::{BlockRange, ModelSource, Placement};
use petal_node::{Node, NodeConfig};
use petal_p2p::Keypair;
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Model to split (default: SmolLM2-135M-Instruct from ../shared/models or $PETAL_MODELS).
    #[arg(long)]
    pub model: Option<PathBuf>,
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
        None => petal_client::defaults::default_model()
            .with_context(petal_client::defaults::default_model_missing)?,
    };
    let config = args.sampling.config()?;
    let source = ModelSource::open(&model)?;
    let spans = BlockRange::split_even(source.spec().num_blocks, args.nodes);

    let localhost: petal_p2p::Multiaddr = "/ip4/127.0.0.1/tcp/0".parse()?;
    let bootstrap = petal_node::start_bootstrap(
        Keypair::generate_ed25519(),
        vec![localhost.clone()],
        Duration::from_secs(60),
    )
    .await?;
    let bootstrap_addrs = bootstrap.listen_addrs().await;
    eprintln!(
        "bootstrap  {}",
        bootstrap_addrs
            .first()
            .map(ToString::to_string)
            .unwrap_or_default()
    );

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
    let mut nodes = vec![];
    for (i, range) in spans.iter().enumerate() {
        started.set_message(format!("starting node{}", i + 1));
        let mut cfg = NodeConfig::new(model.clone(), *range);
        cfg.listen = vec![localhost.clone()];
        cfg.bootstrap = bootstrap_addrs.clone();
        cfg.public_name = format!("node{}", i + 1);
        cfg.progress = Some(bars.clone());
        let node = match Node::start(cfg).await {
            Ok(node) => node,
            Err(e) => {
                started.abandon();
                return Err(e)
                    .with_context(|| format!("starting node {} for blocks {range}", i + 1));
            }
        };
        bars.suspend(|| eprintln!("node{}      blocks {range:<7} {}", i + 1, node.peer_id()));
        started.inc(1);
        nodes.push(node);
    }
    started.finish_and_clear();

    let client = SwarmClient::connect(bootstrap_addrs.clone()).await?;
    let placement = block_placement(&source, &Placement::cpu_f32());
    let waiting =
        ProgressBar::new_spinner().with_message("waiting for the swarm to cover the model");
    waiting.enable_steady_tick(Duration::from_millis(100));
    let remote = RemoteModel::open(&client, &source, placement, Duration::from_secs(30)).await;
    waiting.finish_and_clear();
    let remote = remote?;
    let tokenizer = source.tokenizer(None)?;
    let chat = !args.no_chat && tokenizer.chat_template().is_some();
    let prompt = encode_prompt(&tokenizer, &args.prompt, chat, None)?;
    eprintln!(
        "prompt     {:?}{}",
        args.prompt,
        if chat { " (chat)" } else { "" }
    );
    let output = remote
        .generate(&tokenizer, &prompt, &config, |piece| {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        })
        .await?;
    println!();
    eprintln!(
        "route      client -> {} -> client",
        remote.last_route().join(" -> ")
    );
    eprintln!(
        "{} tokens at {:.1} tokens/s, first token after {:.0} ms, {} bytes on the wire",
        output.tokens.len(),
        output.tokens_per_second,
        output.first_token_ms,
        remote.last_bytes_on_wire()
    );
    client.shutdown().await;
    for node in nodes {
        node.shutdown(Duration::from_secs(1)).await;
    }
    bootstrap.shutdown().await;
    Ok(())
}
