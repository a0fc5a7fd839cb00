//! Joining the swarm as a client and finding servers.
use crate::error::{ClientError, Result};
use crate::router::{plan_route, Hop};
use petal_p2p::{find_servers, Keypair, Multiaddr, NetConfig, Network};
use petal_proto::pb::ServerRecord;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// A client's membership of the swarm: a libp2p peer in DHT client mode.
pub struct SwarmClient {
    net: Network,
}

impl SwarmClient {
    /// Starts a client peer with a fresh identity and joins the DHT through `bootstrap`.
    pub async fn connect(bootstrap: Vec<Multiaddr>) -> Result<Self> {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.bootstrap = bootstrap;
        let net = Network::start(config).await?;
        if let Err(e) = net.bootstrap().await {
            tracing::warn!(error = %e, "DHT bootstrap failed; discovery may be incomplete");
        }
        Ok(Self { net })
    }

    pub fn network(&self) -> &Network {
        &self.net
    }

    /// Live servers of `model_id`, or of every model with `None`.
    pub async fn find_servers(
        &self,
        model_id: Option<&str>,
        timeout: Duration,
    ) -> Result<Vec<ServerRecord>> {
        Ok(find_servers(&self.net, model_id, timeout).await?)
    }

    /// Finds servers and plans a chain covering `num_blocks` blocks, retrying discovery until `timeout` while some
    /// blocks are uncovered (records spread through the DHT within seconds of a node starting).
    pub async fn plan(
        &self,
        model_id: &str,
        num_blocks: usize,
        banned: &HashSet<String>,
        timeout: Duration,
    ) -> Result<Vec<Hop>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let servers = self
                .find_servers(Some(model_id), left.min(Duration::from_secs(5)))
                .await?;
            let mut rtts = HashMap::new();
            for s in &servers {
                if let Ok(peer) = s.peer_id.parse() {
                    if let Some(rtt) = self.net.rtt(peer).await {
                        rtts.insert(s.peer_id.clone(), rtt);
                    }
                }
            }
            match plan_route(
                model_id,
                &servers,
                num_blocks,
                |p| rtts.get(p).copied(),
                banned,
            ) {
                Ok(route) => return Ok(route),
                Err(ClientError::Uncovered { .. })
                    if tokio::time::Instant::now() + Duration::from_millis(500) < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub async fn shutdown(&self) {
        self.net.shutdown().await;
    }
}
