//! A running node: the span it serves, its network, its announcer, its balancer and the stream handlers.
use crate::admission::AdmissionLimits;
use crate::balance::{self, balancer::BalanceConfig};
use crate::context::ServerContext;
use crate::limits::ServeLimits;
use crate::loader::SpanLoader;
use crate::memory::{self, Budget};
use crate::metrics::{BuildInfo, Metrics};
use crate::push::Pusher;
use crate::serving::{Serving, SpanSettings};
use crate::{handler, metrics, NodeError, Result};
use candle_core::DType;
use petal_model::compute::placement::DeviceSpec;
use petal_model::compute::wire::wire_dtype;
use petal_model::{BlockRange, HubConfig, ModelRef};
use petal_p2p::swarm_key::PreSharedKey;
use petal_p2p::{
    Announcer, AnnouncerHandle, Keypair, Multiaddr, NetConfig, Network, PeerId, Reachability,
    RelayLimits,
};
use petal_proto::pb;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Which blocks a node serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanChoice {
    /// These, for as long as it runs (`--blocks A..B`).
    Fixed(BlockRange),
    /// This many consecutive blocks where the swarm's throughput is lowest, moving as the swarm changes
    /// (`--num-blocks N`; `None`: as many as fit the devices' free memory with the KV cache budget).
    Auto { num_blocks: Option<usize> },
}

impl std::fmt::Display for SpanChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Fixed(range) => write!(f, "{range}"),
            Self::Auto {
                num_blocks: Some(n),
            } => write!(f, "{n} automatic blocks"),
            Self::Auto { num_blocks: None } => write!(f, "automatic blocks"),
        }
    }
}

/// Everything `petal-node serve` is told.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// A local path, or a hub repository whose shards are downloaded as the node loads the blocks in them.
    pub model: ModelRef,
    /// How hub models are reached and cached (`HF_ENDPOINT`, `HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE`).
    pub hub: HubConfig,
    pub blocks: SpanChoice,
    /// How an automatic span rebalances (`--balance-period`, `--balance-quality`); `None`: it stays where it
    /// started. Fixed spans never move.
    pub balance: Option<BalanceConfig>,
    /// How long the sessions of a span the node moves away from may go on before their streams are closed.
    pub move_drain: Duration,
    /// One device, or several to split the span across.
    pub devices: Vec<DeviceSpec>,
    pub split: Option<Vec<usize>>,
    /// Compute dtype asked for (`--dtype`); the blocks run in [`ModelSource::block_dtype`] of it. `None`: f32. A
    /// GGUF model keeps its quantized weights and computes in f32 unless f16 or bf16 is asked, which dequantizes
    /// the weights into that dtype.
    pub dtype: Option<DType>,
    /// The dtype sessions' keys and values are stored in (`--kv-dtype`); `None`: the compute dtype. f16 halves
    /// the cache's memory and what a decode step reads from it, as llama.cpp's default cache does; f32 keeps the
    /// reference's arithmetic bit for bit.
    pub kv_dtype: Option<DType>,
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
    /// Most KV cache in positions (batch x tokens) across all sessions (`--cache-tokens`): the node admits this
    /// many, or what the memory budget leaves after weights and workspace if that is less.
    pub cache_tokens: usize,
    /// Bytes the node may use for weights, KV reservations and workspace (`--max-memory`); `None`: what the
    /// devices report free, less a margin.
    pub max_memory: Option<u64>,
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
    /// A node serving `blocks`.
    pub fn new(model: impl Into<ModelRef>, blocks: BlockRange) -> Self {
        Self::with_span(model, SpanChoice::Fixed(blocks))
    }

    /// A node serving blocks as `blocks` says, balancing with the default settings when automatic.
    pub fn with_span(model: impl Into<ModelRef>, blocks: SpanChoice) -> Self {
        Self {
            model: model.into(),
            hub: HubConfig::from_env(),
            blocks,
            balance: Some(BalanceConfig::default()),
            move_drain: Duration::from_secs(10),
            devices: vec![DeviceSpec::Cpu],
            split: None,
            dtype: None,
            kv_dtype: None,
            keypair: Keypair::generate_ed25519(),
            listen: vec![],
            bootstrap: vec![],
            announce: vec![],
            relay: Some(RelayLimits::default()),
            swarm_key: None,
            public_name: String::new(),
            cache_tokens: 16384,
            max_memory: None,
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
    serving: Arc<Serving>,
    listen_addrs: Vec<Multiaddr>,
    accept_task: tokio::task::JoinHandle<()>,
    metrics_addr: Option<SocketAddr>,
    metrics_task: Option<tokio::task::JoinHandle<()>>,
    balance_task: Option<tokio::task::JoinHandle<()>>,
}

impl Node {
    /// Opens the model and devices, joins the swarm, chooses the span (as configured, or where the swarm needs it),
    /// loads it and starts serving and announcing. Bad models, ranges and devices fail here, before the network
    /// starts.
    pub async fn start(config: NodeConfig) -> Result<Node> {
        config.limits.validate().map_err(NodeError::Limits)?;
        // Bound first, so a taken port fails before minutes of loading.
        let metrics_listener = match config.metrics_listen {
            Some(addr) => Some(metrics::bind(addr).await?),
            None => None,
        };
        let loader = {
            let config = config.clone();
            tokio::task::spawn_blocking(move || SpanLoader::open(&config))
                .await
                .map_err(|source| NodeError::Join {
                    task: "opening the model",
                    source,
                })??
        };
        let source = loader.source();
        let spec = source.spec().clone();
        let model_id = source.model_id()?;
        let quantization = source.quantization();
        let wire = wire_dtype(loader.dtype())?;
        let max_chunk_tokens = fit_chunk(&spec, config.max_chunk_tokens, &config.limits, wire)?;
        // How many blocks, and whether they fit the memory budget, checked before the network starts and before
        // anything is read.
        let needs = loader.memory_needs(max_chunk_tokens, config.cache_tokens, &config.limits);
        let budget = Budget::new(config.max_memory, loader.free_memory());
        let plan = match config.blocks {
            SpanChoice::Fixed(range) => {
                range.validate(spec.num_blocks)?;
                needs.fixed(budget, range, config.cache_tokens)?
            }
            SpanChoice::Auto {
                num_blocks: Some(n),
            } if n == 0 || n > spec.num_blocks => {
                return Err(NodeError::Limits(format!(
                    "--num-blocks {n}: the model has {} blocks",
                    spec.num_blocks
                )))
            }
            SpanChoice::Auto {
                num_blocks: Some(n),
            } => needs.any_window(budget, n, config.cache_tokens)?,
            SpanChoice::Auto { num_blocks: None } => {
                needs.most_that_fit(budget, config.cache_tokens)?
            }
        };
        let span_len = plan.num_blocks;
        tracing::info!(
            blocks = span_len,
            weights = %memory::size(plan.weight_bytes),
            kv = %format!("{} ({} positions)", memory::size(plan.kv_bytes()), plan.cache_tokens),
            workspace = %memory::size(plan.workspace_bytes),
            budget = %plan.budget.map_or("none known".into(), |b| memory::size(b.bytes)),
            "memory planned"
        );
        let mut loader = loader;
        loader.set_cache_tokens(plan.cache_tokens);
        let loader = Arc::new(loader);

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
        let range = match config.blocks {
            SpanChoice::Fixed(range) => range,
            SpanChoice::Auto { .. } => {
                match balance::choose_span(&net, &model_id, spec.num_blocks, span_len).await {
                    Ok(range) => range,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot see the swarm; serving the first blocks");
                        BlockRange::new(0, span_len)
                    }
                }
            }
        };

        let template = pb::ServerRecord {
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
            dtype: wire as i32,
            quantization,
            petal_version: env!("CARGO_PKG_VERSION").to_string(),
            public_name: config.public_name.clone(),
            max_chunk_tokens: u32::try_from(max_chunk_tokens).unwrap_or(u32::MAX),
            memory_budget_bytes: plan.budget.map_or(0, |b| b.bytes),
            kv_position_bytes: plan.position_bytes,
            ..Default::default()
        };
        let metrics = Arc::new(Metrics::new(&BuildInfo {
            version: env!("CARGO_PKG_VERSION").to_string(),
            model: spec.name.clone(),
            model_id: model_id.clone(),
            blocks: range,
        }));
        let settings = SpanSettings {
            admission: AdmissionLimits {
                cache_tokens: plan.cache_tokens,
                position_bytes: plan.position_bytes,
                max_sessions: config.max_sessions,
                max_sessions_per_peer: config.max_sessions_per_peer,
                reclaim_idle: config.reclaim_idle,
            },
            limits: config.limits,
            throughput: config.throughput,
        };
        let pusher = Pusher::new(net.clone(), config.limits.max_frame_bytes);
        let serving =
            Serving::start(loader, settings, model_id, template, metrics, pusher, range).await?;
        let (record_tx, record_rx) = watch::channel(serving.current().record());
        tokio::spawn(keep_record_current(
            serving.subscribe(),
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
                let task = tokio::spawn(metrics::serve(listener, serving.clone()));
                (Some(addr), Some(task))
            }
            None => (None, None),
        };

        let mut incoming = net.accept_streams()?;
        let accept_serving = serving.clone();
        let accept_task = tokio::spawn(async move {
            use futures::StreamExt;
            while let Some((peer, stream)) = incoming.next().await {
                // Each stream stays on the span served when it opened, until that span retires.
                tokio::spawn(handler::serve_stream(
                    stream,
                    peer,
                    accept_serving.current(),
                ));
            }
        });
        let balance_task = match (config.blocks, config.balance) {
            (SpanChoice::Auto { .. }, Some(balance)) => Some(tokio::spawn(balance::run(
                serving.clone(),
                net.clone(),
                balance,
                config.move_drain,
            ))),
            _ => None,
        };
        let ctx = serving.current();
        tracing::info!(
            model = %ctx.model_id, blocks = %range,
            throughput = format!("{:.1} tokens/s", ctx.record().throughput_tokens_per_sec),
            "serving"
        );
        Ok(Node {
            net,
            announcer,
            serving,
            listen_addrs,
            accept_task,
            metrics_addr,
            metrics_task,
            balance_task,
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

    pub fn model_id(&self) -> String {
        self.serving.current().model_id.clone()
    }

    /// The blocks served now (an automatic span's balancer may move them).
    pub fn blocks(&self) -> BlockRange {
        self.serving.current().span.range()
    }

    /// The state the handlers of the span served now share.
    pub fn context(&self) -> Arc<ServerContext> {
        self.serving.current()
    }

    /// Graceful stop: stop balancing, withdraw the record, refuse new sessions, let running sessions go on for up
    /// to `drain`, then close the network.
    pub async fn shutdown(self, drain: Duration) {
        if let Some(task) = &self.balance_task {
            task.abort();
        }
        let ctx = self.serving.current();
        ctx.admission.drain();
        if let Err(e) = self.announcer.withdraw().await {
            tracing::warn!(error = %e, "could not withdraw the DHT record; it expires by itself");
        }
        ctx.drain(drain).await;
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

/// Keeps the announced record current: free cache and session count as they change, reachability as AutoNAT
/// finds it, and the span itself when the node moves.
async fn keep_record_current(
    mut serving: watch::Receiver<Arc<ServerContext>>,
    mut reachability: watch::Receiver<Reachability>,
    record: watch::Sender<pb::ServerRecord>,
) {
    loop {
        let ctx = serving.borrow_and_update().clone();
        ctx.set_reachability(reachability.borrow().status.as_str());
        if record.send(ctx.record()).is_err() {
            return;
        }
        let mut usage = ctx.admission.subscribe();
        loop {
            tokio::select! {
                changed = serving.changed() => match changed {
                    Ok(()) => break,
                    Err(_) => return,
                },
                changed = usage.changed() => if changed.is_err() { return },
                // New relayed or confirmed addresses: the announcer reads them when it stamps the record.
                changed = reachability.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let status = reachability.borrow_and_update().status;
                    ctx.set_reachability(status.as_str());
                }
            }
            // Coalesce bursts of opens/closes into one DHT update.
            tokio::time::sleep(Duration::from_millis(200)).await;
            usage.borrow_and_update();
            if record.send(ctx.record()).is_err() {
                return;
            }
        }
    }
}

/// A bootstrap peer: a DHT server that hosts no blocks, and (unless `config.relay` is `None`) a relay for peers
/// behind NAT. `config.dht_server` is forced on.
pub async fn start_bootstrap(mut config: NetConfig) -> Result<Network> {
    config.dht_server = true;
    Ok(Network::start(config).await?)
}
