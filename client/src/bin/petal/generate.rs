//! `petal generate`: one prompt, through the swarm or (--local) through the whole model in this process.
use crate::args::SamplingArgs;
use anyhow::Context;
use clap::Args;
use libp2p::Multiaddr;
use petal_model::generation::GenerationOutput;
use petal_model::placement::{parse_dtype, DeviceSpec};
use petal_model::prompt::encode_prompt;
use petal_model::{BlockRange, LocalModel, ModelSource, Placement};
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Model: a Hugging Face directory, a .gguf file or a llama2.c .bin. In swarm mode only its config, tokenizer,
    /// embeddings and LM head are read.
    #[arg(long)]
    pub model: PathBuf,
    #[arg(long)]
    pub prompt: String,
    /// Tokenizer file overriding the one found with the model (tokenizer.json, llama2.c .bin or .gguf).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Run every block in this process instead of through the swarm.
    #[arg(long)]
    pub local: bool,
    /// Bootstrap peer(s) of the swarm, with /p2p/<peer id> (swarm mode).
    #[arg(long)]
    pub bootstrap: Vec<Multiaddr>,
    /// Render the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: an empty one, so the template adds no persona of its own).
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object (prompt_tokens, tokens, text, tokens_per_second, ...) instead of streaming text.
    #[arg(long)]
    pub json: bool,
    /// Device for what runs here (the head; with --local, every block).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype for what runs here (GGUF blocks compute in f32).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Seconds to wait for the swarm to show servers covering the model.
    #[arg(long, default_value_t = 20.0)]
    pub discovery_timeout: f64,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let config = args.sampling.config()?;
    let device = DeviceSpec::parse(&args.device)?.open()?;
    let placement = Placement::new(device, parse_dtype(&args.dtype)?);
    let source = ModelSource::open(&args.model)?;
    let tokenizer = source.tokenizer(args.tokenizer.as_deref())?;
    let prompt = encode_prompt(&tokenizer, &args.prompt, args.chat, args.system.as_deref())?;
    let stream = !args.json;
    let mut on_text = |piece: &str| {
        if stream && !piece.is_empty() {
            print!("{piece}");
            let _ = std::io::stdout().flush();
        }
    };
    let (output, route) = if args.local {
        let span_placement = block_placement(&source, &placement);
        let model = LocalModel {
            head: source.load_head(placement.clone())?,
            spans: vec![source.load_span_on(
                BlockRange::new(0, source.spec().num_blocks),
                &span_placement,
            )?],
        };
        (
            model.generate(&tokenizer, &prompt, &config, &mut on_text)?,
            None,
        )
    } else {
        anyhow::ensure!(
            !args.bootstrap.is_empty(),
            "swarm mode needs --bootstrap MULTIADDR (or use --local)"
        );
        let client = petal_client::SwarmClient::connect(args.bootstrap.clone())
            .await
            .context("joining the swarm")?;
        let timeout = std::time::Duration::from_secs_f64(args.discovery_timeout);
        let model = petal_client::RemoteModel::open(&client, &source, placement, timeout).await?;
        let output = model
            .generate(&tokenizer, &prompt, &config, &mut on_text)
            .await?;
        let route = model.last_route();
        client.shutdown().await;
        (output, Some(route))
    };
    print_output(&output, route, args.json)
}

/// GGUF blocks keep their quantized weights only in f32; other formats compute in the asked dtype.
pub fn block_placement(source: &ModelSource, asked: &Placement) -> Placement {
    match source.format() {
        petal_model::ModelFormat::Gguf => {
            Placement::new(asked.device.clone(), candle_core::DType::F32)
        }
        _ => asked.clone(),
    }
}

fn print_output(
    output: &GenerationOutput,
    route: Option<Vec<String>>,
    json: bool,
) -> anyhow::Result<()> {
    if json {
        let mut v = serde_json::to_value(output)?;
        if let (Some(route), Some(obj)) = (route, v.as_object_mut()) {
            obj.insert("route".into(), serde_json::json!(route));
        }
        println!("{v}");
    } else {
        println!();
        if let Some(route) = route {
            eprintln!("route: {}", route.join(" -> "));
        }
        eprintln!(
            "{} prompt tokens, {} generated ({:?}), {:.1} tokens/s, first token {:.0} ms",
            output.prompt_tokens,
            output.tokens.len(),
            output.finish_reason,
            output.tokens_per_second,
            output.first_token_ms
        );
    }
    Ok(())
}
