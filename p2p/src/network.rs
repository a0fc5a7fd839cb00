//! [`Network`]: the cheap, cloneable handle the node and the client hold. It builds the swarm, spawns the
//! [`Actor`](crate::actor::Actor) and talks to it only through typed [`Command`]s.

use std::{collections::HashSet, future::Future, time::Duration};

use libp2p::{
    core::{muxing::StreamMuxerBox, transport::Boxed, upgrade, Transport},
    identity::Keypair,
    kad::QueryId,
    multiaddr::Protocol,
    noise,
    pnet::{PnetConfig, PreSharedKey},
    tcp, yamux, Multiaddr, PeerId, Stream, StreamProtocol, Swarm, SwarmBuilder,
};
use tokio::sync::{mpsc, oneshot};

use crate::{
    actor::Actor,
    behaviour::PetalBehaviour,
    command::{Command, Reply},
    reachability::{ConnectionPath, Reachability, ReachabilityState},
    NetConfig, NetError,
};
use petal_proto::pb::ServerRecord;

/// Bound on binding listeners in [`Network::start`].
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on dialing a peer and negotiating the inference protocol in [`Network::open_stream`].
pub const OPEN_STREAM_TIMEOUT: Duration = Duration::from_secs(20);
/// Commands queued to the actor before senders wait; a burst bigger than this just awaits briefly.
const COMMAND_QUEUE: usize = 256;

/// The inference protocol as a libp2p `StreamProtocol`.
pub fn inference_protocol() -> StreamProtocol {
    StreamProtocol::new(petal_proto::INFERENCE_PROTOCOL)
}

/// Handle to a running peer. Clones share the same swarm; the swarm stops when [`Network::shutdown`] is called or
/// the last clone is dropped.
#[derive(Clone)]
pub struct Network {
    commands: mpsc::Sender<Command>,
    control: crate::streams::Control,
    peer_id: PeerId,
    /// Signs this peer's server record.
    keypair: Keypair,
    reachability: tokio::sync::watch::Receiver<Reachability>,
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network")
            .field("peer_id", &self.peer_id)
            .finish_non_exhaustive()
    }
}

/// Splits `/.../p2p/<id>` into the peer id and the address (the `/p2p` part is kept: Kademlia and the dialer
/// accept it and check it against the handshake).
fn parse_bootstrap(addr: &Multiaddr) -> Result<PeerId, NetError> {
    match addr.iter().last() {
        Some(Protocol::P2p(peer)) => Ok(peer),
        _ => Err(NetError::BadBootstrap(format!(
            "{addr} does not end in /p2p/<peer id> (the bootstrap node prints its full address at start)"
        ))),
    }
}

/// The swarm over `transport_builder` (a builder in its transport phase): DNS, the relay client, the behaviour.
macro_rules! finish_swarm {
    ($transport_builder:expr, $config:expr) => {
        $transport_builder
            // /dns4 and /dns6 addresses (compose service names, `--announce-addr` host names).
            .with_dns()
            .map_err(|e| NetError::Transport(format!("dns: {e}")))?
            .with_relay_client(noise::Config::new, yamux::Config::default)
            .map_err(|e| NetError::Transport(format!("relay client: {e}")))?
            .with_behaviour(|key, relay_client| PetalBehaviour::new(key, relay_client, $config))
            .map_err(|e| NetError::Transport(format!("behaviour: {e}")))?
            .with_swarm_config(|c| c.with_idle_connection_timeout($config.idle_connection_timeout))
            .build()
    };
}

/// A connection whose security and multiplexer are not negotiated by then is dropped. Without a bound, a peer that
/// never answers (or one holding another swarm key, whose bytes decrypt to garbage that can read as a long length
/// prefix) keeps the dial, and every DHT query waiting for it, pending for as long as the socket lives.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP, noise and yamux, bounded by [`HANDSHAKE_TIMEOUT`]; in a private swarm every connection is first wrapped in
/// pnet with `swarm_key`.
fn tcp_transport(
    key: &Keypair,
    swarm_key: Option<PreSharedKey>,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    // Inference steps are small request/response frames: Nagle would add latency to each.
    let tcp = tcp::tokio::Transport::new(tcp::Config::default().nodelay(true));
    let noise = noise::Config::new(key)?;
    Ok(match swarm_key {
        None => secured(tcp, noise),
        Some(psk) => secured(
            tcp.and_then(move |socket, _| PnetConfig::new(psk).handshake(socket)),
            noise,
        ),
    })
}

/// `transport` upgraded with noise and yamux, the whole negotiation bounded by [`HANDSHAKE_TIMEOUT`].
fn secured<T>(transport: T, noise: noise::Config) -> Boxed<(PeerId, StreamMuxerBox)>
where
    T: Transport + Send + Unpin + 'static,
    T::Output: futures::AsyncRead + futures::AsyncWrite + Unpin + Send + 'static,
    T::Error: Send + Sync + 'static,
    T::Dial: Send + 'static,
    T::ListenerUpgrade: Send + 'static,
{
    transport
        .upgrade(upgrade::Version::V1Lazy)
        .authenticate(noise)
        .multiplex(yamux::Config::default())
        .timeout(HANDSHAKE_TIMEOUT)
        .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
        .boxed()
}

fn build_swarm(config: &NetConfig) -> Result<Swarm<PetalBehaviour>, NetError> {
    let keypair: Keypair = config.keypair.clone();
    let builder = SwarmBuilder::with_existing_identity(keypair).with_tokio();
    let tcp = |key: &Keypair| tcp_transport(key, config.swarm_key);
    let swarm = match config.swarm_key {
        None => finish_swarm!(
            builder
                .with_quic()
                .with_other_transport(tcp)
                .map_err(|e| NetError::Transport(format!("tcp/noise: {e}")))?,
            config
        ),
        // A private swarm: TCP only (QUIC has no pnet).
        Some(_) => finish_swarm!(
            builder
                .with_other_transport(tcp)
                .map_err(|e| NetError::Transport(format!("tcp/pnet/noise: {e}")))?,
            config
        ),
    };
    Ok(swarm)
}

impl Network {
    /// Builds the swarm (TCP + noise + yamux, and QUIC), binds `config.listen`, dials the bootstrap peers and
    /// spawns the actor. Returns once every listener is bound, so [`Network::listen_addrs`] has real ports.
    /// Does not wait for the bootstrap peers to answer: call [`Network::bootstrap`] for that.
    pub async fn start(config: NetConfig) -> Result<Network, NetError> {
        let peer_id = config.keypair.public().to_peer_id();
        let mut bootstrap = Vec::new();
        for addr in &config.bootstrap {
            let peer = parse_bootstrap(addr)?;
            if peer == peer_id {
                // A bootstrap node may share the swarm-wide bootstrap list that names itself.
                tracing::debug!(%addr, "skipping own address in bootstrap list");
                continue;
            }
            bootstrap.push((peer, addr.clone()));
        }

        let mut config = config;
        if config.swarm_key.is_some() {
            let quic = |a: &Multiaddr| {
                a.iter()
                    .any(|p| matches!(p, Protocol::QuicV1 | Protocol::Quic))
            };
            if config.listen.iter().any(quic) {
                tracing::info!(
                    "private swarm: QUIC cannot carry the swarm key; listening on TCP only"
                );
            }
            config.listen.retain(|a| !quic(a));
            config.bootstrap.retain(|a| !quic(a));
        }
        let mut swarm = build_swarm(&config)?;
        if config.dht_server && config.use_relays {
            // A server that may sit behind NAT answers DHT queries only once AutoNAT finds it reachable, so peers
            // never learn it as a DHT server they cannot dial. Bootstrap peers (no relays to use) serve at once.
            swarm
                .behaviour_mut()
                .kad
                .set_mode(Some(libp2p::kad::Mode::Client));
        }
        for addr in &config.announce {
            swarm.add_external_address(addr.clone());
        }
        let control = swarm.behaviour().stream.control();
        let (commands, receiver) = mpsc::channel(COMMAND_QUEUE);
        let reach = ReachabilityState::new(config.use_relays, &config.announce);
        let reachability = reach.subscribe();
        let mut actor = Actor::new(swarm, receiver, bootstrap, reach, config.dht_server);
        actor.listen(&config.listen, LISTEN_TIMEOUT).await?;
        actor.connect_bootstrap();
        tracing::info!(%peer_id, dht_server = config.dht_server, "network started");
        tokio::spawn(actor.run());
        Ok(Network {
            commands,
            control,
            peer_id,
            keypair: config.keypair.clone(),
            reachability,
        })
    }

    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// `record` signed with this peer's key, as stored under its server key.
    pub fn sign_record(&self, record: &ServerRecord) -> Result<Vec<u8>, NetError> {
        crate::records::sign_record(&self.keypair, record)
    }

    /// Sends a command built around a fresh reply channel and waits for the answer.
    async fn request<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, NetError> {
        let (reply, answer) = oneshot::channel();
        self.commands
            .send(make(reply))
            .await
            .map_err(|_| NetError::Closed)?;
        answer.await.map_err(|_| NetError::Closed)
    }

    /// Every address this node listens on, each ending in `/p2p/<peer id>`, with the real port (never `:0`).
    /// Empty if the actor is gone.
    pub async fn listen_addrs(&self) -> Vec<Multiaddr> {
        self.request(|reply| Command::ListenAddrs { reply })
            .await
            .unwrap_or_default()
    }

    /// Runs a Kademlia bootstrap (self-lookup plus bucket refresh) and waits for its self-lookup; the refresh goes
    /// on in the background. `Ok` at once if no bootstrap peers are configured and the routing table is empty (the
    /// first node of a swarm); an error if no peer could be reached.
    pub async fn bootstrap(&self) -> Result<(), NetError> {
        self.request(|reply| Command::Bootstrap { reply }).await?
    }

    /// Stores `value` under `key` locally and on the closest peers (quorum one), expiring `ttl` from now
    /// everywhere: re-put before then to keep it. `Ok` when stored locally and no peer is known yet.
    pub async fn put_record(
        &self,
        key: Vec<u8>,
        value: Vec<u8>,
        ttl: Duration,
    ) -> Result<(), NetError> {
        self.request(|reply| Command::PutRecord {
            key,
            value,
            ttl,
            reply,
        })
        .await?
    }

    /// Every distinct value stored under `key` (the local store included) found before the lookup ends or
    /// `timeout` passes. Empty if nobody has it.
    pub async fn get_records(
        &self,
        key: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, NetError> {
        let mut values = Vec::new();
        self.lookup(
            |found, reply| Command::GetRecords { key, found, reply },
            timeout,
            |value| values.push(value),
        )
        .await?;
        Ok(values)
    }

    /// Announces this node as a provider of `key` (locally and at the closest peers). Kademlia republishes the
    /// provider record every ttl/3 until [`Network::stop_providing`].
    pub async fn start_providing(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.request(|reply| Command::StartProviding { key, reply })
            .await?
    }

    /// Stops announcing; remote peers forget this provider when their copy expires (one record TTL).
    pub async fn stop_providing(&self, key: Vec<u8>) {
        let _ = self
            .request(|reply| Command::StopProviding { key, reply })
            .await;
    }

    /// Providers of `key` found before the lookup ends or `timeout` passes; includes this node if it provides.
    pub async fn get_providers(
        &self,
        key: Vec<u8>,
        timeout: Duration,
    ) -> Result<HashSet<PeerId>, NetError> {
        let mut providers = HashSet::new();
        self.lookup(
            |found, reply| Command::GetProviders { key, found, reply },
            timeout,
            |batch| providers.extend(batch),
        )
        .await?;
        Ok(providers)
    }

    /// Starts a provider lookup and returns its results as they arrive; the receiver ends with the lookup.
    /// Callers must [`Network::cancel_query`] if they stop reading early.
    pub(crate) async fn providers_stream(
        &self,
        key: Vec<u8>,
    ) -> Result<(QueryId, mpsc::UnboundedReceiver<HashSet<PeerId>>), NetError> {
        let (found, receiver) = mpsc::unbounded_channel();
        let id = self
            .request(|reply| Command::GetProviders { key, found, reply })
            .await?;
        Ok((id, receiver))
    }

    /// Stops a lookup started by [`Network::providers_stream`].
    pub(crate) async fn cancel_query(&self, id: QueryId) {
        let _ = self.commands.send(Command::CancelQuery { id }).await;
    }

    /// Runs a streaming lookup to its end or `timeout`, feeding each result to `sink`, and cancels the Kademlia
    /// query if the timeout won (so it stops using the network).
    async fn lookup<T>(
        &self,
        make: impl FnOnce(mpsc::UnboundedSender<T>, Reply<QueryId>) -> Command,
        timeout: Duration,
        mut sink: impl FnMut(T),
    ) -> Result<(), NetError> {
        let (found, mut receiver) = mpsc::unbounded_channel();
        let id = self.request(|reply| make(found, reply)).await?;
        let collect = async {
            while let Some(item) = receiver.recv().await {
                sink(item);
            }
        };
        if tokio::time::timeout(timeout, collect).await.is_err() {
            self.cancel_query(id).await;
        }
        Ok(())
    }

    /// Remembers addresses for `peer` (e.g. from its server record) so [`Network::open_stream`] can dial it.
    pub async fn add_addresses(&self, peer: PeerId, addrs: Vec<Multiaddr>) {
        let _ = self
            .request(|reply| Command::AddAddresses { peer, addrs, reply })
            .await;
    }

    /// Connects to `peer` unless already connected (addresses as for [`Network::open_stream`]), within `timeout`.
    pub async fn connect(&self, peer: PeerId, timeout: Duration) -> Result<(), NetError> {
        with_timeout(timeout, "connect", self.dial(peer)).await
    }

    /// Asks the actor for a connection to `peer` (see `actor/connections.rs`: a relayed one waits for hole punching).
    async fn dial(&self, peer: PeerId) -> Result<(), NetError> {
        self.request(|reply| Command::Connect { peer, reply })
            .await?
    }

    /// Opens an inference stream to `peer`, dialing it first if needed (known addresses: [`Network::add_addresses`]
    /// and the DHT routing table). Bounded by [`OPEN_STREAM_TIMEOUT`].
    pub async fn open_stream(&self, peer: PeerId) -> Result<Stream, NetError> {
        let stream_error = |reason: String| NetError::Stream { peer, reason };
        with_timeout(OPEN_STREAM_TIMEOUT, "open_stream", async {
            self.dial(peer).await?;
            self.control
                .open_stream(peer)
                .await
                .map_err(|e| stream_error(e.to_string()))
        })
        .await
    }

    /// Inbound inference streams, as `(peer, stream)` pairs. Only one acceptor may exist at a time; dropping it
    /// allows a new one. Up to [`crate::streams::ACCEPT_BACKLOG`] streams wait while it is not polled; beyond that
    /// they are reset, so poll it continuously (hand each stream to its own task).
    pub fn accept_streams(&self) -> Result<crate::IncomingStreams, NetError> {
        self.control.accept().ok_or_else(|| NetError::Stream {
            peer: self.peer_id,
            reason: format!(
                "cannot accept {}: another acceptor is alive",
                petal_proto::INFERENCE_PROTOCOL
            ),
        })
    }

    /// Latest ping round-trip time to `peer`, if connected and pinged at least once.
    pub async fn rtt(&self, peer: PeerId) -> Option<Duration> {
        self.request(|reply| Command::Rtt { peer, reply })
            .await
            .ok()
            .flatten()
    }

    /// Whether this node is reachable (AutoNAT), its confirmed external addresses and its relayed ones; changes
    /// are published as they happen.
    pub fn reachability(&self) -> tokio::sync::watch::Receiver<Reachability> {
        self.reachability.clone()
    }

    /// How the connection to `peer` travels: directly, or through a relay (`None`: not connected).
    pub async fn connection_path(&self, peer: PeerId) -> Option<ConnectionPath> {
        self.request(|reply| Command::Path { peer, reply })
            .await
            .ok()
            .flatten()
    }

    /// Closes every connection to `peer` and waits (at most `timeout`) until they are gone, so the next
    /// [`Network::open_stream`] dials afresh instead of reusing a connection that is breaking.
    pub async fn disconnect(&self, peer: PeerId, timeout: Duration) {
        self.close_connections_before(peer, std::time::Instant::now(), timeout)
            .await
    }

    /// Closes the connections to `peer` established before `instant` (the moment one of them was seen failing)
    /// and waits (at most `timeout`) until they are gone. Connections made since, and dials under way, are left
    /// alone: other sessions to the same peer may already be using them.
    pub async fn close_connections_before(
        &self,
        peer: PeerId,
        instant: std::time::Instant,
        timeout: Duration,
    ) {
        let closed = self.request(|reply| Command::Disconnect {
            peer,
            established_before: instant,
            reply,
        });
        if tokio::time::timeout(timeout, closed).await.is_err() {
            tracing::debug!(%peer, "connections still closing; going on");
        }
    }

    /// Peers with at least one open connection.
    pub async fn connected_peers(&self) -> Vec<PeerId> {
        self.request(|reply| Command::ConnectedPeers { reply })
            .await
            .unwrap_or_default()
    }

    /// Stops the actor, closing all listeners and connections. Other clones then get [`NetError::Closed`].
    /// Idempotent.
    pub async fn shutdown(&self) {
        let _ = self.request(|reply| Command::Shutdown { reply }).await;
    }
}

async fn with_timeout<T>(
    limit: Duration,
    what: &'static str,
    fut: impl Future<Output = Result<T, NetError>>,
) -> Result<T, NetError> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| NetError::Timeout(what))?
}
