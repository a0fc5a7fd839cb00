//! A whole swarm in this process on loopback: a bootstrap peer and nodes serving spans of one model. `petal demo`,
//! `petal-bench` and the in-process tests start theirs here.
use petal_client::{ClientError, SwarmClient};
use petal_model::{BlockRange, ModelRef};
use petal_node::{Node, NodeConfig, NodeError};
use petal_p2p::{Keypair, Multiaddr, NetConfig, Network};
use std::time::Duration;

/// How long the bootstrap keeps DHT records (the nodes' own TTL decides when theirs expire).
const BOOTSTRAP_RECORD_TTL: Duration = Duration::from_secs(60);
/// Drain time for the nodes at shutdown: nothing in flight is worth waiting for here.
const DRAIN: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum LocalSwarmError {
    /// The bootstrap peer did not start.
    #[error("starting the bootstrap peer: {0}")]
    Bootstrap(#[source] NodeError),
    /// A node did not start (its model, blocks, device or network).
    #[error("starting node {index} for blocks {blocks}: {source}")]
    Node {
        index: usize,
        blocks: petal_node::SpanChoice,
        #[source]
        source: NodeError,
    },
    /// The client could not join.
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// A bootstrap peer and the nodes started so far, all on 127.0.0.1.
pub struct LocalSwarm {
    bootstrap: Network,
    bootstrap_addrs: Vec<Multiaddr>,
    nodes: Vec<Node>,
}

impl LocalSwarm {
    /// A bootstrap peer and no node yet.
    pub async fn bootstrap() -> Result<Self, LocalSwarmError> {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.listen = vec![loopback()];
        config.record_ttl = BOOTSTRAP_RECORD_TTL;
        let bootstrap = petal_node::start_bootstrap(config)
            .await
            .map_err(LocalSwarmError::Bootstrap)?;
        let bootstrap_addrs = bootstrap.listen_addrs().await;
        Ok(Self {
            bootstrap,
            bootstrap_addrs,
            nodes: vec![],
        })
    }

    /// A bootstrap and one node per span of `model`, named node1, node2, ...; `configure` adjusts each node's
    /// configuration (device, dtype, budgets) before it starts.
    pub async fn start(
        model: impl Into<ModelRef>,
        spans: &[BlockRange],
        configure: impl Fn(&mut NodeConfig),
    ) -> Result<Self, LocalSwarmError> {
        let model = model.into();
        let mut swarm = Self::bootstrap().await?;
        for range in spans {
            let mut config = swarm.node_config(&model, *range);
            configure(&mut config);
            if let Err(e) = swarm.add_node(config).await {
                swarm.shutdown().await;
                return Err(e);
            }
        }
        Ok(swarm)
    }

    /// The configuration of the next node: blocks `blocks` of `model`, listening on loopback, joined through this
    /// swarm's bootstrap, named `node<N>`.
    pub fn node_config(&self, model: impl Into<ModelRef>, blocks: BlockRange) -> NodeConfig {
        let mut config = NodeConfig::new(model, blocks);
        config.listen = vec![loopback()];
        config.bootstrap = self.bootstrap_addrs.clone();
        config.public_name = format!("node{}", self.nodes.len() + 1);
        config
    }

    /// Starts a node (loading its blocks) and adds it to the swarm.
    pub async fn add_node(&mut self, config: NodeConfig) -> Result<&Node, LocalSwarmError> {
        let blocks = config.blocks;
        let index = self.nodes.len() + 1;
        let node = Node::start(config)
            .await
            .map_err(|source| LocalSwarmError::Node {
                index,
                blocks,
                source,
            })?;
        self.nodes.push(node);
        Ok(&self.nodes[index - 1])
    }

    /// The bootstrap's full addresses (with `/p2p/<peer id>`).
    pub fn bootstrap_addrs(&self) -> &[Multiaddr] {
        &self.bootstrap_addrs
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// A client that joined this swarm.
    pub async fn client(&self) -> Result<SwarmClient, LocalSwarmError> {
        Ok(SwarmClient::connect(self.bootstrap_addrs.clone()).await?)
    }

    /// Stops every node, then the bootstrap.
    pub async fn shutdown(self) {
        for node in self.nodes {
            node.shutdown(DRAIN).await;
        }
        self.bootstrap.shutdown().await;
    }
}

fn loopback() -> Multiaddr {
    Multiaddr::from(std::net::Ipv4Addr::LOCALHOST).with(libp2p::multiaddr::Protocol::Tcp(0))
}
