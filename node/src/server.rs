//! A running node: the span it serves, its network, its announcer and the stream handlers.
use crate::admission::{Admission, AdmissionLimits, Usage};
use crate::context::ServerContext;
use crate::limits::ServeLimits;
use crate::{devices, handler, metrics, NodeError, Result};
use candle_core::DType;
use petal_model::compute::placement::DeviceSpec;
use petal_model::compute::wire::wire_dtype;
use petal_model::{BlockRange, BlockSpan, ModelSource};
use petal_p2p::swarm_key::PreSharedKey;
use petal_p2p::{
    Announcer, AnnouncerHandle, Keypair, Multiaddr, NetConfig, Network, PeerId, Reachability,
    RelayLimits,
};
use petal_proto::pb;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Everything `petal-node serve` is told.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    pub model: PathBuf,
    pub blocks: BlockRange,
    /// One device, or several to split the span across.
    pub devices: Vec<DeviceSpec>,
    pub split: Option<Vec<usize>>,
    /// Compute dtype asked for (`--dtype`); the blocks run in [`ModelSource::block_dtype`] of it. `None`: f32. A
    /// GGUF model keeps its quantized weights and computes in f32 unless f16 or bf16 is asked, which dequantizes
    /// the weights into that dtype.
    pub dtype: Option<DType>,
    pub keypair: Keypair,
    pub listen: Vec<Multiaddr>,
    pub bootstrap: Vec<Multiaddr>,
    /// Addresses the node is reachable at that it cannot see itself (`--announce-addr`: a port forward, a
    /// container's published port, a DNS name).
    pub announce: Vec<Multiaddr>,
    /// Relay for peers behind NAT with these limits (`None`: `--no-relay`).
    pub relay: Option<RelayLimits>,
    /// The private swarm's key (`--swarm-key`); `None`: an open swarm.
    pub swarm_key: Option<PreSharedKey>,
    pub public_name: String,
    /// KV cache budget in positions (batch x tokens) across all sessions.
    pub cache_tokens: usize,
    pub max_sessions: usize,
    /// Most sessions one peer may hold (`--max-sessions-per-peer`).
    pub max_sessions_per_peer: usize,
    /// A session idle this long may be evicted for a peer below its fair share (`--reclaim-idle`).
    pub reclaim_idle: Duration,
    /// Timeouts and per-peer bounds on frames, step memory and cheap requests.
    pub limits: ServeLimits,
    pub record_ttl: Duration,
    /// Most positions (batch x tokens) one step may carry (`--max-chunk-tokens`), announced so clients split
    /// long prompts: it bounds a step's activations and attention scores, whatever the prompt's length.
    pub max_chunk_tokens: usize,
    /// Tokens per second to announce (`--throughput`); `None`: measured at start through the span. Routers weigh
    /// servers by it: an owner who knows the node's sustained speed (shared hardware, thermal limits) says so.
    pub throughput: Option<f64>,
    /// Serve Prometheus metrics on `GET http://ADDR/metrics` (`--metrics-listen`); `None`: no metrics server.
    pub metrics_listen: Option<SocketAddr>,
    /// Draw the block-loading progress bar in this group of bars (the demo's); `None`: a bar of its own. Bars go
    /// to stderr and are hidden when it is not a terminal.
    pub progress: Option<indicatif::MultiProgress>,
}

impl NodeConfig {
    pub fn new(model: PathBuf, blocks: BlockRange) -> Self {
        Self {
            model,
            blocks,
            devices: vec![DeviceSpec::Cpu],
            split: None,
            dtype: None,
            keypair: Keypair::generate_ed25519(),
            listen: vec![],
            bootstrap: vec![],
            announce: vec![],
            relay: Some(RelayLimits::default()),
            swarm_key: None,
            public_name: String::new(),
            cache_tokens: 16384,
            max_sessions: 64,
            max_sessions_per_peer: 32,
            reclaim_idle: Duration::from_secs(30),
            limits: ServeLimits::default(),
            record_ttl: petal_p2p::DEFAULT_RECORD_TTL,
            max_chunk_tokens: DEFAULT_MAX_CHUNK_TOKENS,
            metrics_listen: None,
            throughput: None,
            progress: None,
        }
    }
}

/// Default `--max-chunk-tokens`: a prompt's prefill in steps of 512 positions costs next to nothing in speed
/// (each is a full matrix product) and bounds a step's attention scores to 512 x context per head.
pub const DEFAULT_MAX_CHUNK_TOKENS: usize = 512;

/// How long `Node::start` waits for its first DHT announcement.
const FIRST_ANNOUNCE_WAIT: Duration = Duration::from_secs(10);

/// A started node.
pub struct Node {
    net: Network,
    announcer: AnnouncerHandle,
    ctx: Arc<ServerContext>,
    listen_addrs: Vec<Multiaddr>,
    accept_task: tokio::task::JoinHandle<()>,
    metrics_addr: Option<SocketAddr>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
}

impl Node {
    /// Loads the span, joins the swarm, starts serving and announcing. Bad models, ranges and devices fail here.
    pub async fn start(config: NodeConfig) -> Result<Node> {
        config.limits.validate().map_err(NodeError::Limits)?;
        // Bound first, so a taken port fails before minutes of loading.
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(metrics::bind(addr).await?),
            None => None,
        };
        let (span, source, block_hashes) = {
            let config = config.clone();
            tokio::task::spawn_blocking(move || load_span(&config))
                .await
                .map_err(|source| NodeError::Join {
                    task: "loading the span",
                    source,
                })??
        };
        let model_id = source.model_id()?;
        let span = Arc::new(span);
        let (device_infos, quantization) = (span_infos(&config, &span), source.quantization());
        let wire = wire_dtype(span.input_placement().dtype)?;
        let throughput = match config.throughput {
            Some(announced) => announced,
            None => {
                let span = span.clone();
                tokio::task::spawn_blocking(move || measure_throughput(&span))
                    .await
                    .map_err(|source| NodeError::Join {
                        task: "measuring throughput",
                        source,
                    })??
            }
        };

        let mut net_config = NetConfig::new(config.keypair.clone());
        net_config.listen = config.listen.clone();
        net_config.bootstrap = config.bootstrap.clone();
        net_config.dht_server = true;
        net_config.record_ttl = config.record_ttl;
        net_config.announce = config.announce.clone();
        net_config.relay = config.relay.clone();
        net_config.use_relays = true;
        net_config.swarm_key = config.swarm_key;
        let net = Network::start(net_config).await?;
        let listen_addrs = net.listen_addrs().await;
        if let Err(e) = net.bootstrap().await {
            tracing::warn!(error = %e, "DHT bootstrap failed; announcing to whoever connects");
        }

        let spec = source.spec();
        let admission = Admission::new(AdmissionLimits {
            cache_tokens: config.cache_tokens,
            max_sessions: config.max_sessions,
            max_sessions_per_peer: config.max_sessions_per_peer,
            reclaim_idle: config.reclaim_idle,
        });
        let max_chunk_tokens = fit_chunk(spec, config.max_chunk_tokens, &config.limits, wire)?;
        let record = pb::ServerRecord {
            record_version: petal_proto::RECORD_VERSION,
            model_id: model_id.clone(),
            model_name: spec.name.clone(),
            num_blocks: spec.num_blocks as u32,
            peer_id: net.peer_id().to_string(),
            // Left empty: the announcer fills in the addresses current at each publication (relayed ones appear
            // once AutoNAT finds the node unreachable and a relay holds a slot for it).
            addrs: vec![],
            relay: config.relay.is_some(),
            reachability: petal_p2p::NatStatus::Unknown.as_str().to_string(),
            start_block: config.blocks.start as u32,
            end_block: config.blocks.end as u32,
            dtype: wire as i32,
            quantization,
            throughput_tokens_per_sec: throughput as f32,
            petal_version: env!("CARGO_PKG_VERSION").to_string(),
            public_name: config.public_name.clone(),
            devices: device_infos,
            block_hashes,
            max_chunk_tokens: u32::try_from(max_chunk_tokens).unwrap_or(u32::MAX),
            ..Default::default()
        };
        let ctx = Arc::new(ServerContext::new(
            span,
            model_id,
            admission.clone(),
            config.limits,
            record,
        )?);
        let (record_tx, record_rx) = watch::channel(ctx.record());
        tokio::spawn(keep_record_current(
            ctx.clone(),
            admission.subscribe(),
            net.reachability(),
            record_tx,
        ));
        let announcer = Announcer::spawn(net.clone(), record_rx, config.record_ttl);
        // "Serving" means findable: wait for the first announcement (bounded: a lone first node has nobody to
        // store at and still serves).
        if !announcer.first_published(FIRST_ANNOUNCE_WAIT).await {
            tracing::warn!("the first announcement is taking long; serving meanwhile");
        }

        let (metrics_addr, metrics_task) = match metrics_listener {
            Some(listener) => {
                let addr = listener.local_addr()?;
                tracing::info!(%addr, "metrics on http://{addr}/metrics");
                let task = tokio::spawn(metrics::serve(listener, ctx.clone()));
                (Some(addr), Some(task))
            }
            None => (None, None),
        };

        let mut incoming = net.accept_streams()?;
        let accept_ctx = ctx.clone();
        let accept_task = tokio::spawn(async move {
            use futures::StreamExt;
            while let Some((peer, stream)) = incoming.next().await {
                tokio::spawn(handler::serve_stream(stream, peer, accept_ctx.clone()));
            }
        });
        tracing::info!(
            model = %ctx.model_id, blocks = %config.blocks, throughput = format!("{throughput:.1} tokens/s"),
            "serving"
        );
        Ok(Node {
            net,
            announcer,
            ctx,
            listen_addrs,
            accept_task,
            metrics_addr,
            metrics_task,
        })
    }

    /// Where the metrics server listens (with the real port when `--metrics-listen` asked for port 0).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    pub fn peer_id(&self) -> PeerId {
        self.net.peer_id()
    }

    /// Full listen addresses, with `/p2p/<peer id>`.
    pub fn listen_addrs(&self) -> &[Multiaddr] {
        &self.listen_addrs
    }

    pub fn model_id(&self) -> &str {
        &self.ctx.model_id
    }

    pub fn context(&self) -> &Arc<ServerContext> {
        &self.ctx
    }

    /// Graceful stop: withdraw the record, refuse new sessions, let running sessions go on for up to `drain`,
    /// then close the network.
    pub async fn shutdown(self, drain: Duration) {
        self.ctx.admission.drain();
        if let Err(e) = self.announcer.withdraw().await {
            tracing::warn!(error = %e, "could not withdraw the DHT record; it expires by itself");
        }
        let deadline = tokio::time::Instant::now() + drain;
        while self.ctx.admission.usage().sessions > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.accept_task.abort();
        if let Some(task) = &self.metrics_task {
            task.abort();
        }
        self.net.shutdown().await;
        tracing::info!("node stopped");
    }
}

/// The steps the node announces: at most `asked` positions, and few enough that a step at the end of the model's
/// context fits in `max_step_bytes` of working memory, so a client that follows the record is never refused for
/// memory. A budget too small for even one position at full context is a start-up error.
fn fit_chunk(
    spec: &petal_model::ModelSpec,
    asked: usize,
    limits: &ServeLimits,
    wire: pb::WireDType,
) -> Result<usize> {
    use petal_model::compute::block::step_working_bytes;
    let max_step_bytes = limits.max_step_bytes;
    // A step's hidden states must also fit one frame, or the client could not send it.
    let fits_frame =
        petal_proto::tensor::tokens_per_frame(limits.max_frame_bytes, 1, spec.hidden_size, wire);
    let asked = if asked == 0 {
        fits_frame
    } else {
        asked.min(fits_frame)
    };
    let fits = |n: usize| {
        max_step_bytes == 0 || step_working_bytes(spec, 1, n, spec.max_position) <= max_step_bytes
    };
    if !fits(1) {
        return Err(NodeError::Limits(format!(
            "--max-step-memory {} MiB cannot hold one step at the model's full context of {} positions (it needs {} MiB)",
            max_step_bytes >> 20,
            spec.max_position,
            step_working_bytes(spec, 1, 1, spec.max_position) >> 20
        )));
    }
    // Working memory grows with the step's tokens: the largest that fits, by bisection.
    let (mut lo, mut hi) = (1, asked.max(1));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    if lo < asked {
        tracing::info!(
            asked,
            announced = lo,
            "steps limited further so that one at full context fits --max-step-memory"
        );
    }
    Ok(lo)
}

/// Opens the devices and the model, checks the range and loads the span (on the blocking pool), returning the
/// source too for the model id and metadata, and the served blocks' hashes (read from those blocks only).
fn load_span(config: &NodeConfig) -> Result<(BlockSpan, ModelSource, Vec<String>)> {
    let devices = devices::open_devices(&config.devices)?;
    let source = ModelSource::open(&config.model)?;
    config.blocks.validate(source.spec().num_blocks)?;
    let dtype = source.block_dtype(config.dtype);
    let counts = devices::plan_split(config.blocks.len(), &devices, config.split.as_deref())?;
    let placements = devices::placements(&devices, &counts, dtype);
    let bar = indicatif::ProgressBar::new(config.blocks.len() as u64)
        .with_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {pos}/{len} blocks ({elapsed})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        )
        .with_message(format!("loading blocks {}", config.blocks));
    let bar = match &config.progress {
        Some(group) => group.add(bar),
        None => bar,
    };
    let span = source.load_span_with_progress(config.blocks, &placements, |_| bar.inc(1));
    bar.finish_and_clear();
    let hashes = source.block_hashes(config.blocks)?;
    Ok((span?, source, hashes))
}

/// The devices of the span as announced: consecutive blocks grouped by the device they were placed on.
fn span_infos(config: &NodeConfig, span: &BlockSpan) -> Vec<pb::DeviceInfo> {
    let mut devices: Vec<candle_core::Device> = vec![];
    let mut counts: Vec<usize> = vec![];
    for b in span.blocks() {
        let d = &b.placement().device;
        match (devices.last(), counts.last_mut()) {
            (Some(last), Some(count)) if last.same_device(d) => *count += 1,
            _ => {
                devices.push(d.clone());
                counts.push(1);
            }
        }
    }
    devices::device_infos(&devices, &counts, config.blocks)
}

/// Decode tokens per second through the whole span, from a few single-token steps of a throwaway session.
fn measure_throughput(span: &BlockSpan) -> Result<f64> {
    const STEPS: usize = 8;
    let mut session = span.new_cache(span.range(), STEPS + 1)?;
    let p = span.input_placement();
    let x = candle_core::Tensor::zeros((1, 1, span.spec().hidden_size), p.dtype, &p.device)?;
    span.forward(&x, 0, &mut session)?; // warm-up
    let started = std::time::Instant::now();
    for pos in 1..=STEPS {
        span.forward(&x, pos, &mut session)?;
    }
    Ok(STEPS as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// Keeps the announced record's free cache and session count current.
async fn keep_record_current(
    ctx: Arc<ServerContext>,
    mut usage: watch::Receiver<Usage>,
    mut reachability: watch::Receiver<Reachability>,
    record: watch::Sender<pb::ServerRecord>,
) {
    loop {
        tokio::select! {
            changed = usage.changed() => if changed.is_err() { break },
            // New relayed or confirmed addresses: the announcer reads them when it stamps the record.
            changed = reachability.changed() => {
                if changed.is_err() {
                    break;
                }
                let status = reachability.borrow_and_update().status;
                ctx.set_reachability(status.as_str());
            }
        }
        // Coalesce bursts of opens/closes into one DHT update.
        tokio::time::sleep(Duration::from_millis(200)).await;
        usage.borrow_and_update();
        if record.send(ctx.record()).is_err() {
            break;
        }
    }
}

/// A bootstrap peer: a DHT server that hosts no blocks, and (unless `config.relay` is `None`) a relay for peers
/// behind NAT. `config.dht_server` is forced on.
pub async fn start_bootstrap(mut config: NetConfig) -> Result<Network> {
    config.dht_server = true;
    Ok(Network::start(config).await?)
}
