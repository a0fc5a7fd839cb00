//! The model options of `petal generate`, `petal chat` and `petal api`, and loading a [`Generator`] from them: the
//! whole model in this process (`--local`) or its head here and the blocks through the swarm.
use anyhow::Context;
use clap::Args;
use libp2p::Multiaddr;
use petal_cli::seconds::positive_seconds;
use petal_client::{ChainConfig, Generator, SwarmClient, VerifyPolicy};
use petal_model::compute::placement::parse_dtype;
use petal_model::{DeviceSpec, ModelRef, Placement, Tokenizer};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a Hugging Face directory, a .gguf file, a llama2.c .bin, or a Hugging Face hub repository
    /// org/name[:QUANT][@revision] (an existing local path wins). In swarm mode only its config, tokenizer,
    /// embeddings and LM head are read (and, from the hub, downloaded).
    #[arg(long)]
    pub model: ModelRef,
    /// The .gguf file to use from a hub repository holding several (or give org/name:QUANT).
    #[arg(long, value_name = "NAME")]
    pub gguf_file: Option<String>,
    /// Tokenizer file overriding the one found with the model (tokenizer.json, llama2.c .bin or .gguf).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Run every block in this process instead of through the swarm.
    #[arg(long)]
    pub local: bool,
    /// Bootstrap peer(s) of the swarm, with /p2p/<peer id> (swarm mode).
    #[arg(long)]
    pub bootstrap: Vec<Multiaddr>,
    /// The private swarm's key file (`petal-node swarm-key --new`), in swarm mode.
    #[arg(long, value_name = "FILE")]
    pub swarm_key: Option<PathBuf>,
    /// Device for what runs here (the head; with --local, every block).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype for what runs here (with --local, GGUF blocks keep their quantized weights in f32; f16/bf16
    /// dequantize them).
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// With --local: the KV cache dtype, f32, f16 or bf16 (default: the blocks' dtype). f16 halves the cache's
    /// memory and what each decode step reads from it; f32 keeps the reference's arithmetic bit for bit.
    #[arg(long, requires = "local")]
    pub kv_dtype: Option<String>,
    /// Seconds to wait for the swarm to show servers covering the model.
    #[arg(long, default_value = "20", value_parser = positive_seconds)]
    pub discovery_timeout: Duration,
    /// Check servers' answers on other servers holding the same blocks (swarm mode): a fraction of hop steps
    /// drawn at random (0.05 or 5%), `all`, or `off`. A server outvoted by two that agree is banned and replaced.
    #[arg(long, default_value_t = VerifyPolicy::default(), value_name = "RATE|all|off")]
    pub verify: VerifyPolicy,
    /// Drive every hop from here instead of letting servers push decode steps to each other (each token then
    /// crosses two links per hop instead of one).
    #[arg(long)]
    pub no_push: bool,
}

/// A loaded model: the generator, its tokenizer, and the swarm membership to shut down at the end.
pub struct Loaded {
    pub generator: Generator,
    pub tokenizer: Tokenizer,
    pub client: Option<SwarmClient>,
}

impl ModelArgs {
    pub async fn load(&self) -> anyhow::Result<Loaded> {
        let device = DeviceSpec::parse(&self.device)?.open()?;
        let placement = Placement::new(device, parse_dtype(&self.dtype)?);
        let model = petal_cli::hub::model_ref(&self.model, self.gguf_file.as_deref())?;
        let source = petal_model::hub::open(&model, &petal_cli::hub::config(None))
            .with_context(|| format!("opening the model {model}"))?;
        let tokenizer = source.tokenizer(self.tokenizer.as_deref())?;
        if self.local {
            return Ok(Loaded {
                generator: Generator::local_with_kv(
                    &source,
                    placement,
                    self.kv_dtype.as_deref().map(parse_dtype).transpose()?,
                )?,
                tokenizer,
                client: None,
            });
        }
        anyhow::ensure!(
            !self.bootstrap.is_empty(),
            "swarm mode needs --bootstrap MULTIADDR (or use --local)"
        );
        let swarm_key = petal_cli::load_swarm_key(self.swarm_key.as_deref())?;
        let client = SwarmClient::join(self.bootstrap.clone(), swarm_key)
            .await
            .context("joining the swarm")?;
        let config = ChainConfig {
            discovery_timeout: self.discovery_timeout,
            verify: self.verify,
            push: !self.no_push,
            ..ChainConfig::default()
        };
        Ok(Loaded {
            generator: Generator::remote(&client, &source, placement, config)?,
            tokenizer,
            client: Some(client),
        })
    }
}
