//! Joining the swarm as a client, finding servers, and remembering which ones failed us.
use crate::bans::Bans;
use crate::error::{ClientError, Result};
use crate::router::{plan_range, Hop, UNKNOWN_RTT};
use petal_model::BlockRange;
use petal_p2p::{find_servers, ConnectionPath, Keypair, Multiaddr, NatStatus, NetConfig, Network};
use petal_p2p::{swarm_key::PreSharedKey, PeerId};
use petal_proto::pb::ServerRecord;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bound on connecting to one candidate server while planning. Candidates are dialed all at once, so records
/// pointing at dead or black-holed addresses cost this much once, not once each. (A server reached through a relay
/// may still be hole punching then; it counts as reachable.)
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Added to the RTT of a server reached through a relay (or, before any connection, of one that announces itself
/// unreachable): every byte takes the relay's detour and shares its limits, so a direct server of equal RTT wins.
pub const RELAYED_PENALTY: Duration = Duration::from_millis(100);
/// How long an optional plan ([`SwarmClient::plan_without`]) reuses the servers the last discovery found, rather
/// than asking the DHT again (a query can wait seconds on peers that left).
pub const RECORDS_FRESH: Duration = Duration::from_secs(30);
/// Bound on an optional plan's own discovery, when it has no fresh one to reuse.
pub const OPTIONAL_DISCOVERY: Duration = Duration::from_secs(2);

/// A client's membership of the swarm: a libp2p peer in DHT client mode. Cheap to clone.
#[derive(Clone)]
pub struct SwarmClient {
    net: Network,
    bans: Arc<Mutex<Bans>>,
    /// Per model id, the hash of every block of the weights this client loaded: servers announcing other hashes
    /// are never chained.
    manifests: Arc<Mutex<HashMap<String, Arc<Vec<String>>>>>,
    /// Per model id, the servers the last discovery found, and when.
    found: Arc<Mutex<HashMap<String, Found>>>,
}

/// When a discovery ran, and the servers it found.
type Found = (Instant, Vec<ServerRecord>);

impl SwarmClient {
    /// Starts a client peer with a fresh identity and joins the DHT through `bootstrap`.
    ///
    /// The client listens on ephemeral TCP and QUIC ports although nobody dials it: outgoing connections then
    /// leave from those ports, so the address its NAT maps them to is stable, which is what hole punching to a
    /// server behind another NAT needs.
    pub async fn connect(bootstrap: Vec<Multiaddr>) -> Result<Self> {
        Self::join(bootstrap, None).await
    }

    /// [`SwarmClient::connect`] to a private swarm when `swarm_key` is set ([`petal_p2p::swarm_key`]).
    pub async fn join(bootstrap: Vec<Multiaddr>, swarm_key: Option<PreSharedKey>) -> Result<Self> {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.bootstrap = bootstrap;
        config.swarm_key = swarm_key;
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
            bans: Arc::default(),
            manifests: Arc::default(),
            found: Arc::default(),
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

    /// Chain only servers of `model_id` whose announced block hashes equal `block_hashes` (every block's, in
    /// order: `ModelSource::manifest`). Without it, any server announcing the model id is chained.
    pub fn expect_weights(&self, model_id: &str, block_hashes: Arc<Vec<String>>) {
        let mut manifests = self.manifests.lock().unwrap_or_else(|e| e.into_inner());
        manifests.insert(model_id.to_string(), block_hashes);
    }

    /// Whether `record`'s announced weights are the ones expected for its model (true when none are expected).
    fn weights_match(&self, record: &ServerRecord) -> bool {
        let manifests = self.manifests.lock().unwrap_or_else(|e| e.into_inner());
        let Some(expected) = manifests.get(&record.model_id) else {
            return true;
        };
        let span = record.start_block as usize..record.end_block as usize;
        let same = expected
            .get(span)
            .is_some_and(|want| want == record.block_hashes.as_slice());
        if !same {
            tracing::warn!(peer = %record.peer_id, name = %record.public_name, blocks = format!("{}..{}", record.start_block, record.end_block), "server announces weights that differ from this model's; never chained");
        }
        same
    }

    /// Leaves `peer` out of routes for a while: longer each time it fails again ([`crate::bans`]).
    pub fn ban(&self, peer: &str) {
        let mut bans = self.bans.lock().unwrap_or_else(|e| e.into_inner());
        let for_ = bans.strike(peer, Instant::now());
        tracing::debug!(%peer, seconds = for_.as_secs_f64(), "server left out of routes");
    }

    /// Leaves `peer` out of routes for the longest ban: its answers were outvoted by two servers that agreed
    /// ([`crate::verification`]), which no network fault explains.
    pub fn convict(&self, peer: &str) {
        let mut bans = self.bans.lock().unwrap_or_else(|e| e.into_inner());
        let for_ = bans.convict(peer, Instant::now());
        tracing::warn!(%peer, seconds = for_.as_secs_f64(), "server gave wrong answers; left out of routes");
    }

    /// Peers currently left out of routes.
    pub fn banned(&self) -> HashSet<String> {
        let mut bans = self.bans.lock().unwrap_or_else(|e| e.into_inner());
        bans.banned(Instant::now())
    }

    /// Peers with a failure still remembered, banned or not.
    pub fn suspects(&self) -> HashSet<String> {
        let mut bans = self.bans.lock().unwrap_or_else(|e| e.into_inner());
        bans.suspects(Instant::now())
    }

    /// Dials every server in `servers` not yet connected, all at once, each within [`DIAL_TIMEOUT`], and bans
    /// those that cannot be reached, so a plan never waits on dead records one after another.
    async fn reach(&self, servers: &[ServerRecord]) {
        let banned = self.banned();
        let dials = servers
            .iter()
            .filter(|s| !banned.contains(&s.peer_id))
            .filter_map(|s| Some((s.peer_id.clone(), s.peer_id.parse::<PeerId>().ok()?)))
            .map(|(id, peer)| async move {
                let result = self.net.connect(peer, DIAL_TIMEOUT).await;
                let connected = result.is_ok() || self.net.connection_path(peer).await.is_some();
                (id, connected, result)
            });
        for (peer, connected, result) in futures::future::join_all(dials).await {
            if let (false, Err(e)) = (connected, result) {
                tracing::debug!(%peer, error = %e, "server unreachable");
                self.ban(&peer);
            }
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
        self.plan_without(model_id, range, &HashSet::new(), timeout, false, 0)
            .await
    }

    /// [`SwarmClient::plan`] for a session of `positions` positions (servers announcing less free cache are
    /// avoided, [`plan_range`]; 0: any), with the peers in `exclude` left out (they are not merely banned: a plan
    /// never falls back to them). An `optional` chain is one the client can do without (checking answers): one discovery
    /// decides (an uncovered range is answered at once), and no peer that failed recently is used or dialed, so
    /// dead or failing servers never slow down a check.
    pub async fn plan_without(
        &self,
        model_id: &str,
        range: BlockRange,
        exclude: &HashSet<String>,
        timeout: Duration,
        optional: bool,
        positions: usize,
    ) -> Result<Vec<Hop>> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let mut servers = match (optional, self.fresh_servers(model_id)) {
                (true, Some(servers)) => servers,
                (true, None) => {
                    self.discover(model_id, left.min(OPTIONAL_DISCOVERY))
                        .await?
                }
                (false, _) => {
                    self.discover(model_id, left.min(Duration::from_secs(5)))
                        .await?
                }
            };
            let suspects = if optional {
                self.suspects()
            } else {
                HashSet::new()
            };
            servers.retain(|s| {
                !exclude.contains(&s.peer_id)
                    && !suspects.contains(&s.peer_id)
                    && self.weights_match(s)
            });
            self.reach(&servers).await;
            let rtts = self.rtts(&servers).await;
            let rtt = |p: &str| rtts.get(p).copied();
            let banned = self.banned();
            let route =
                plan_range(model_id, &servers, range, rtt, &banned, positions).or_else(|e| {
                    // A ban is a preference: when the servers left for some blocks all failed us recently, try them
                    // again rather than give up (the caller ends the attempt if one fails again).
                    match e {
                        ClientError::Uncovered { .. } if !banned.is_empty() && !optional => {
                            plan_range(model_id, &servers, range, rtt, &HashSet::new(), positions)
                                .map_err(|_| e)
                        }
                        e => Err(e),
                    }
                });
            match route {
                Ok(route) => return Ok(route),
                Err(ClientError::Uncovered { .. })
                    if !optional
                        && tokio::time::Instant::now() + Duration::from_millis(500) < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Live servers of `model_id`, remembered for optional plans.
    async fn discover(&self, model_id: &str, timeout: Duration) -> Result<Vec<ServerRecord>> {
        let servers = self.find_servers(Some(model_id), timeout).await?;
        let mut found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        found.insert(model_id.to_string(), (Instant::now(), servers.clone()));
        Ok(servers)
    }

    /// The servers the last discovery of `model_id` found, if it is at most [`RECORDS_FRESH`] old.
    fn fresh_servers(&self, model_id: &str) -> Option<Vec<ServerRecord>> {
        let found = self.found.lock().unwrap_or_else(|e| e.into_inner());
        let (at, servers) = found.get(model_id)?;
        (at.elapsed() < RECORDS_FRESH).then(|| servers.clone())
    }

    /// The round-trip time to each server measured so far, with [`RELAYED_PENALTY`] added for relayed ones.
    async fn rtts(&self, servers: &[ServerRecord]) -> HashMap<String, Duration> {
        let mut rtts = HashMap::new();
        for s in servers {
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
        rtts
    }

    pub async fn shutdown(&self) {
        self.net.shutdown().await;
    }
}
