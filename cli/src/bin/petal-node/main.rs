//! `petal-node`: serve a span of blocks, run a bootstrap peer, or make an identity.
use clap::{Args, Parser, Subcommand};
use petal_cli::app::{self, shutdown_signal, CommonArgs};
use petal_cli::seconds::{positive_seconds, seconds};
use petal_model::compute::placement::{parse_dtype, DeviceSpec};
use petal_model::{BlockRange, ModelRef};
use petal_node::{devices, BalanceConfig, Node, NodeConfig, SpanChoice};
use petal_p2p::{swarm_key::PreSharedKey, Keypair, Multiaddr, NetConfig, RelayLimits};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "petal-node",
    version,
    about = "Serve transformer blocks to a Petal swarm"
)]
struct Cli {
    #[command(flatten)]
    common: CommonArgs,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve blocks of a model: A..B, or where the swarm needs them most.
    Serve(Box<ServeArgs>),
    /// Run a bootstrap peer: a DHT entry point that serves no blocks.
    Bootstrap(BootstrapArgs),
    /// Create a node identity (an ed25519 key) and print its peer id.
    Identity {
        /// File to write the new key to (refuses to overwrite).
        #[arg(long = "new", value_name = "FILE")]
        new: PathBuf,
    },
    /// Create a private swarm's key and print its fingerprint; give the file to every peer with --swarm-key.
    SwarmKey {
        /// File to write the new key to (refuses to overwrite).
        #[arg(long = "new", value_name = "FILE")]
        new: PathBuf,
    },
}

#[derive(Args)]
struct NetArgs {
    /// Address to listen on (repeatable), e.g. /ip4/0.0.0.0/tcp/31337 or /ip4/0.0.0.0/udp/31337/quic-v1.
    #[arg(long, default_values = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"])]
    listen: Vec<Multiaddr>,
    /// Key file from `petal-node identity --new` (a fresh identity when absent).
    #[arg(long)]
    identity: Option<PathBuf>,
    /// Join the private swarm of this key (from `petal-node swarm-key --new`): only peers holding it can connect.
    /// TCP only (QUIC cannot carry the key).
    #[arg(long, value_name = "FILE")]
    swarm_key: Option<PathBuf>,
    /// How long DHT records live without a refresh (a killed node disappears within this).
    #[arg(long, default_value = "60", value_parser = positive_seconds)]
    record_ttl: Duration,
    /// An address this node is reachable at that it cannot see itself (repeatable): a port forward on the NAT
    /// router, a container's published port, a DNS name, e.g. /ip4/203.0.113.7/tcp/31337 or /dns4/node.example/tcp/31337.
    #[arg(long = "announce-addr", value_name = "MULTIADDR")]
    announce: Vec<Multiaddr>,
    /// Do not relay for peers behind NAT (a reachable node relays by default).
    #[arg(long)]
    no_relay: bool,
    /// Relayed connections this node carries at once.
    #[arg(long, default_value_t = RelayLimits::default().max_circuits)]
    relay_max_circuits: usize,
    /// Peers behind NAT holding a slot on this relay at once.
    #[arg(long, default_value_t = RelayLimits::default().max_reservations)]
    relay_max_reservations: usize,
    /// Seconds one relayed connection may last (a client reconnects, with replay, when it ends).
    #[arg(long, default_value = "3600", value_parser = positive_seconds)]
    relay_circuit_seconds: Duration,
    /// Bytes one relayed connection may carry in each direction.
    #[arg(long, default_value_t = RelayLimits::default().max_circuit_bytes)]
    relay_circuit_bytes: u64,
}

impl NetArgs {
    fn keypair(&self) -> anyhow::Result<Keypair> {
        Ok(match &self.identity {
            Some(path) => petal_p2p::load_from_file(path)?,
            None => Keypair::generate_ed25519(),
        })
    }

    fn swarm_key(&self) -> anyhow::Result<Option<PreSharedKey>> {
        petal_cli::load_swarm_key(self.swarm_key.as_deref())
    }

    fn relay(&self) -> Option<RelayLimits> {
        (!self.no_relay).then(|| RelayLimits {
            max_reservations: self.relay_max_reservations,
            max_circuits: self.relay_max_circuits,
            max_circuits_per_peer: RelayLimits::default().max_circuits_per_peer,
            max_circuit_duration: self.relay_circuit_seconds,
            max_circuit_bytes: self.relay_circuit_bytes,
        })
    }
}

#[derive(Args)]
struct ServeArgs {
    /// Model: a Hugging Face directory, a .gguf file, a llama2.c .bin, or a Hugging Face hub repository
    /// org/name[:QUANT][@revision] (an existing local path wins). Only the served blocks are read; from the hub,
    /// only config, tokenizer, index and the shards holding the served blocks are downloaded.
    #[arg(long)]
    model: ModelRef,
    /// The .gguf file to use from a hub repository holding several (or give org/name:QUANT).
    #[arg(long, value_name = "NAME")]
    gguf_file: Option<String>,
    /// Blocks to serve, START..END (end exclusive), e.g. 10..20, for as long as the node runs. Without it the
    /// node chooses its blocks where the swarm's throughput is lowest, and moves as the swarm changes.
    #[arg(long, conflicts_with = "num_blocks")]
    blocks: Option<BlockRange>,
    /// How many blocks to choose without --blocks (default: as many as fit the device's free memory with the
    /// --cache-tokens budget).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    num_blocks: Option<u32>,
    /// Seconds between a node's checks whether moving elsewhere would help the swarm (jittered between half and
    /// all of it); 0: never move. Only without --blocks.
    #[arg(long, default_value = "120", value_parser = seconds, conflicts_with = "blocks")]
    balance_period: Duration,
    /// A node moves for speed only if the swarm's slowest block would get faster by more than this factor (moves
    /// that fill a gap need no factor).
    #[arg(long, default_value_t = petal_node::BalanceConfig::default().quality, value_parser = above_one, conflicts_with = "blocks")]
    balance_quality: f64,
    /// Device for every block: cpu, cuda:N, metal:N or auto.
    #[arg(long, default_value = "cpu", conflicts_with = "devices")]
    device: String,
    /// Several devices to split the span across, e.g. cuda:0,cuda:1 or cpu,cuda:0.
    #[arg(long)]
    devices: Option<String>,
    /// Blocks per device with --devices, e.g. 6,4 (default: in proportion to free memory).
    #[arg(long, value_delimiter = ',', requires = "devices")]
    split: Option<Vec<usize>>,
    /// Compute dtype: f32, f16 or bf16 (default f32; GGUF weights stay quantized only in f32).
    #[arg(long)]
    dtype: Option<String>,
    /// KV cache dtype: f32, f16 or bf16 (default: the compute dtype). f16 halves the cache's memory and what each
    /// decode step reads from it (llama.cpp's default cache type); f32 is the reference's arithmetic bit for bit.
    #[arg(long)]
    kv_dtype: Option<String>,
    /// Bootstrap peer(s), with /p2p/<peer id>.
    #[arg(long)]
    bootstrap: Vec<Multiaddr>,
    /// A name shown in `petal swarm` and routes.
    #[arg(long, default_value = "")]
    public_name: String,
    /// Most KV cache, in positions (batch x tokens) summed over all sessions; less when the memory budget leaves
    /// less after the weights.
    #[arg(long, default_value_t = 16384)]
    cache_tokens: usize,
    /// Memory the node may use for weights, KV cache and workspace ("12GiB", "1500MB"; default: what the
    /// devices report free, less a tenth). Without --blocks the node takes as many blocks as fit; with --blocks a
    /// span that does not fit is refused before anything is read.
    #[arg(long, value_parser = memory_size)]
    max_memory: Option<u64>,
    /// Most sessions open at once.
    #[arg(long, default_value_t = 64)]
    max_sessions: usize,
    /// Most sessions one peer may hold at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    max_sessions_per_peer: u32,
    /// Seconds a session must be idle before it may be evicted to make room for a peer below its fair share.
    #[arg(long, default_value = "30", value_parser = seconds)]
    reclaim_idle: Duration,
    /// Most working memory (MiB) one step may need; steps are announced small enough to fit at full context.
    #[arg(long, default_value_t = 4096)]
    max_step_memory: u64,
    /// Seconds a frame may take to arrive once its first byte has.
    #[arg(long, default_value = "60", value_parser = positive_seconds)]
    frame_timeout: Duration,
    /// MiB of received, not yet handled frames one peer may hold across its streams (at least one frame: 64).
    #[arg(long, default_value_t = 128)]
    peer_buffer: usize,
    /// MiB of received, not yet handled frames all peers together may hold.
    #[arg(long, default_value_t = 512)]
    recv_buffer: usize,
    /// Info requests and undecodable frames one peer may send per second (bursts of five times as many).
    #[arg(long, default_value_t = 20.0)]
    cheap_rate: f64,
    /// Most positions (batch x tokens) one step may carry; clients split longer prompts into steps of this size.
    #[arg(long, default_value_t = petal_node::server::DEFAULT_MAX_CHUNK_TOKENS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    max_chunk_tokens: u32,
    /// Seconds a session may sit idle before it is evicted.
    #[arg(long, default_value = "300", value_parser = positive_seconds)]
    session_timeout: Duration,
    /// Seconds running sessions get to finish after SIGTERM.
    #[arg(long, default_value = "10", value_parser = seconds)]
    drain_timeout: Duration,
    /// Tokens per second to announce instead of the one measured at start (routers prefer faster servers).
    #[arg(long, value_name = "TOKENS_PER_SEC", value_parser = positive_throughput)]
    throughput: Option<f64>,
    /// Serve Prometheus metrics on http://ADDR/metrics, e.g. 127.0.0.1:9100 (off by default).
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    net: NetArgs,
}

#[derive(Args)]
struct BootstrapArgs {
    #[command(flatten)]
    net: NetArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    app::run(&cli.common, "info", async {
        match cli.command {
            Command::Serve(args) => serve(*args).await,
            Command::Bootstrap(args) => bootstrap(args).await,
            Command::Identity { new } => {
                let peer = petal_p2p::generate_to_file(&new)?;
                println!("{peer}");
                Ok(())
            }
            Command::SwarmKey { new } => {
                let key = petal_p2p::swarm_key::generate_to_file(&new)?;
                println!("{}", key.fingerprint());
                Ok(())
            }
        }
    })
}

/// Prints each listen address on its own line, so scripts and tests can pick them up.
fn announce_addrs(addrs: &[Multiaddr]) {
    let mut out = std::io::stdout().lock();
    for a in addrs {
        let _ = writeln!(out, "listening on {a}");
    }
    let _ = out.flush();
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let blocks = match args.blocks {
        Some(range) => SpanChoice::Fixed(range),
        None => SpanChoice::Auto {
            num_blocks: args.num_blocks.map(|n| n as usize),
        },
    };
    let model = petal_cli::hub::model_ref(&args.model, args.gguf_file.as_deref())?;
    let mut config = NodeConfig::with_span(model, blocks);
    config.hub = petal_cli::hub::config(None);
    config.balance = (!args.balance_period.is_zero()).then_some(BalanceConfig {
        period: args.balance_period,
        quality: args.balance_quality,
    });
    config.move_drain = args.drain_timeout;
    config.devices = match &args.devices {
        Some(list) => devices::parse_devices(list)?,
        None => vec![DeviceSpec::parse(&args.device)?],
    };
    config.split = args.split;
    config.dtype = args.dtype.as_deref().map(parse_dtype).transpose()?;
    config.kv_dtype = args.kv_dtype.as_deref().map(parse_dtype).transpose()?;
    config.keypair = args.net.keypair()?;
    config.listen = args.net.listen.clone();
    config.announce = args.net.announce.clone();
    config.relay = args.net.relay();
    config.swarm_key = args.net.swarm_key()?;
    config.bootstrap = args.bootstrap;
    config.public_name = args.public_name;
    config.cache_tokens = args.cache_tokens;
    config.max_memory = args.max_memory;
    config.max_sessions = args.max_sessions;
    config.max_chunk_tokens = args.max_chunk_tokens as usize;
    config.max_sessions_per_peer = args.max_sessions_per_peer as usize;
    config.reclaim_idle = args.reclaim_idle;
    config.limits.session_timeout = args.session_timeout;
    config.limits.max_step_bytes = args.max_step_memory << 20;
    config.limits.frame_timeout = args.frame_timeout;
    config.limits.peer_buffer_bytes = args.peer_buffer << 20;
    config.limits.buffer_bytes = args.recv_buffer << 20;
    config.limits.cheap_per_sec = args.cheap_rate;
    config.limits.cheap_burst = args.cheap_rate * 5.0;
    config.record_ttl = args.net.record_ttl;
    config.metrics_listen = args.metrics_listen;
    config.throughput = args.throughput;
    let node = Node::start(config).await?;
    announce_addrs(node.listen_addrs());
    if let Some(addr) = node.metrics_addr() {
        println!("metrics on http://{addr}/metrics");
    }
    println!(
        "serving blocks {} of model {}",
        node.blocks(),
        node.model_id()
    );
    let _ = std::io::stdout().flush();
    shutdown_signal().await?;
    node.shutdown(args.drain_timeout).await;
    Ok(())
}

async fn bootstrap(args: BootstrapArgs) -> anyhow::Result<()> {
    let mut config = NetConfig::new(args.net.keypair()?);
    config.listen = args.net.listen.clone();
    config.record_ttl = args.net.record_ttl;
    config.announce = args.net.announce.clone();
    config.relay = args.net.relay();
    config.swarm_key = args.net.swarm_key()?;
    let net = petal_node::start_bootstrap(config).await?;
    announce_addrs(&net.listen_addrs().await);
    shutdown_signal().await?;
    net.shutdown().await;
    Ok(())
}

/// A finite factor above 1.
fn above_one(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 1.0 => Ok(v),
        _ => Err(format!("{s:?} is not a factor above 1")),
    }
}

/// A finite throughput above zero.
fn positive_throughput(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a throughput in tokens per second above 0"
        )),
    }
}

/// A memory size as people write one: "12GiB", "1.5 GB", "800MiB", or bytes.
fn memory_size(s: &str) -> Result<u64, String> {
    let size: bytesize::ByteSize = s
        .parse()
        .map_err(|e| format!("{e}; say a size such as 12GiB or 1500MB"))?;
    if size.as_u64() == 0 {
        return Err("the memory budget must be more than 0 bytes".into());
    }
    Ok(size.as_u64())
}
