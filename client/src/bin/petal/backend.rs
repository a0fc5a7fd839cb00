//! The model options of `petal api` and `petal chat`, and loading a [`Generator`] from them: the whole model in
//! this process (`--local`) or its head here and the blocks through the swarm.
use anyhow::Context;
use clap::Args;
use libp2p::Multiaddr;
use petal_client::{Generator, RemoteModel, SwarmClient};
use petal_model::placement::{parse_dtype, DeviceSpec};
use petal_model::tokenizer::Tokenizer;
use petal_model::{BlockRange, LocalModel, ModelSource, Placement};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a Hugging Face directory, a .gguf file or a llama2.c .bin. In swarm mode only its config, tokenizer,
    /// embeddings and LM head are read.
    #[arg(long)]
    pub model: PathBuf,
    /// Tokenizer file overriding the one found with the model (tokenizer.json, llama2.c .bin or .gguf).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Run every block in this process instead of through the swarm.
    #[arg(long)]
    pub local: bool,
    /// Bootstrap peer(s) of the swarm, with /p2p/<peer id> (swarm mode).
    #[arg(long)]
    pub bootstrap: Vec<Multiaddr>,
    /// Device for what runs here (the head; with --local, every block).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype for what runs here (GGUF blocks compute in f32).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// Seconds to wait for the swarm to show servers covering the model.
    #[arg(long, default_value_t = 20.0)]
    pub discovery_timeout: f64,
}

/// A loaded model: the generator, its tokenizer, and the swarm membership to shut down at the end.
pub struct Loaded {
    pub generator: Generator,
    pub tokenizer: Tokenizer,
    pub source: ModelSource,
    pub client: Option<SwarmClient>,
}

impl ModelArgs {
    pub async fn load(&self) -> anyhow::Result<Loaded> {
        let device = DeviceSpec::parse(&self.device)?.open()?;
        let placement = Placement::new(device, parse_dtype(&self.dtype)?);
        let source = ModelSource::open(&self.model)
            .with_context(|| format!("opening the model {}", self.model.display()))?;
        let tokenizer = source.tokenizer(self.tokenizer.as_deref())?;
        if self.local {
            let model = LocalModel {
                head: source.load_head(placement.clone())?,
                spans: vec![source.load_span_on(
                    BlockRange::new(0, source.spec().num_blocks),
                    &block_placement(&source, &placement),
                )?],
            };
            return Ok(Loaded {
                generator: Generator::Local(model),
                tokenizer,
                source,
                client: None,
            });
        }
        anyhow::ensure!(
            !self.bootstrap.is_empty(),
            "swarm mode needs --bootstrap MULTIADDR (or use --local)"
        );
        anyhow::ensure!(
            self.discovery_timeout.is_finite() && self.discovery_timeout > 0.0,
            "--discovery-timeout must be a positive number of seconds"
        );
        let client = SwarmClient::connect(self.bootstrap.clone())
            .await
            .context("joining the swarm")?;
        let timeout = Duration::from_secs_f64(self.discovery_timeout);
        let model = RemoteModel::open(&client, &source, placement, timeout).await?;
        Ok(Loaded {
            generator: Generator::Remote(model),
            tokenizer,
            source,
            client: Some(client),
        })
    }
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
