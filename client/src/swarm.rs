//! Joining the swarm as a client, finding servers, and remembering which ones failed us.
use crate::error::{ClientError, Result};
use crate::router::{plan_range, Hop, UNKNOWN_RTT};
use petal_model::BlockRange;
use petal_p2p::{find_servers, ConnectionPath, Keypair, Multiaddr, NatStatus, NetConfig, Network};
use petal_proto::pb::ServerRecord;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long a server that failed a request is left out of new routes.
pub const BAN_DURATION: Duration = Duration::from_secs(60);
/// Added to the RTT of a server reached through a relay (or, before any connection, of one that announces itself
/// unreachable): every byte takes the relay's detour and shares its limits, so a direct server of equal RTT wins.
pub const RELAYED_PENALTY: Duration = Duration::from_millis(100);

/// A client's membership of the swarm: a libp2p peer in DHT client mode. Cheap to clone.
#[derive(Clone)]
pub struct SwarmClient {
    net: Network,
    banned: Arc<Mutex<HashMap<String, Instant>>>,
}

impl SwarmClient {
    /// Starts a client peer with a fresh identity and joins the DHT through `bootstrap`.
    ///
    /// The client listens on ephemeral TCP and QUIC ports although nobody dials it: outgoing connections then
    /// leave from those ports, so the address its NAT maps them to is stable, which is what hole punching to a
    /// server behind another NAT needs.
    pub async fn connect(bootstrap: Vec<Multiaddr>) -> Result<Self> {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.bootstrap = bootstrap;
        config.listen = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
            .iter()
            .filter_map(|a| a.parse().ok())
            .collect();
        let net = Network::start(config).await?;
        if let Err(e) = net.bootstrap().await {
            tracing::warn!(error = %e, "DHT bootstrap failed; discovery may be incomplete");
        }
        Ok(Self {
            net,
            banned: Arc::default(),
        })
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

    /// Leaves `peer` out of routes for [`BAN_DURATION`].
    pub fn ban(&self, peer: &str) {
        if let Ok(mut b) = self.banned.lock() {
            b.insert(peer.to_string(), Instant::now() + BAN_DURATION);
        }
    }

    /// Peers currently banned.
    pub fn banned(&self) -> HashSet<String> {
        let now = Instant::now();
        match self.banned.lock() {
            Ok(mut b) => {
                b.retain(|_, until| *until > now);
                b.keys().cloned().collect()
            }
            Err(_) => HashSet::new(),
        }
    }

    /// Finds servers and plans a chain covering `range`, retrying discovery until `timeout` while some blocks are
    /// uncovered (records spread through the DHT within seconds of a node starting).
    pub async fn plan(
        &self,
        model_id: &str,
        range: BlockRange,
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
                    let relayed = match self.net.connection_path(peer).await {
                        Some(path) => path == ConnectionPath::Relayed,
                        None => s.reachability == NatStatus::Private.as_str(),
                    };
                    let rtt = self.net.rtt(peer).await;
                    let rtt = if relayed {
                        Some(rtt.unwrap_or(UNKNOWN_RTT) + RELAYED_PENALTY)
                    } else {
                        rtt
                    };
                    if let Some(rtt) = rtt {
                        rtts.insert(s.peer_id.clone(), rtt);
                    }
                }
            }
            match plan_range(
                model_id,
                &servers,
                range,
                |p| rtts.get(p).copied(),
                &self.banned(),
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
