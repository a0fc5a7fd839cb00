//! Settings for [`Network::start`](crate::Network::start).

use std::time::Duration;

use libp2p::{connection_limits::ConnectionLimits, identity::Keypair, Multiaddr};

use crate::reachability::RelayLimits;

/// Default lifetime of DHT records and provider records.
pub const DEFAULT_RECORD_TTL: Duration = Duration::from_secs(60);
/// Default time an unused connection is kept open. Long enough that a client between two generation steps, or a
/// server between two announcements, does not pay for a new handshake.
pub const DEFAULT_IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);

/// How to run one peer of the swarm.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// The node's identity; its public key is the peer id.
    pub keypair: Keypair,
    /// Addresses to listen on, e.g. `/ip4/0.0.0.0/tcp/31337` and `/ip4/0.0.0.0/udp/31337/quic-v1`. Port 0 picks a
    /// free port; [`Network::listen_addrs`](crate::Network::listen_addrs) reports the real one. Empty for a client
    /// that only dials out.
    pub listen: Vec<Multiaddr>,
    /// Peers to join the DHT through. Each must end in `/p2p/<peer id>`: Kademlia needs the id to place the peer
    /// in its routing table, and the noise handshake checks it.
    pub bootstrap: Vec<Multiaddr>,
    /// `true` for servers and bootstrap nodes: they answer DHT queries and store records (Kademlia server mode).
    /// `false` for clients, which only query. Set explicitly because Kademlia would otherwise stay client-only
    /// until it sees a confirmed external address, which never happens on a LAN or loopback.
    pub dht_server: bool,
    /// Lifetime of records and provider records in the DHT. Announcers refresh at a third of it, so a node that
    /// dies without withdrawing disappears at most this long after its last refresh.
    pub record_ttl: Duration,
    /// How long a connection with no open streams or pending queries stays open.
    pub idle_connection_timeout: Duration,
    /// Addresses this node is reachable at that it cannot see itself (a port forward, a container's published
    /// port, a DNS name): announced as confirmed external addresses.
    pub announce: Vec<Multiaddr>,
    /// Run a circuit-relay server with these limits, so peers behind NAT can be reached through this one
    /// (`None`: no relay). Relaying only helps when this node is itself reachable.
    pub relay: Option<RelayLimits>,
    /// Reserve slots on relays and listen through them when AutoNAT finds this node unreachable (servers).
    pub use_relays: bool,
    /// The private swarm's pre-shared key ([`crate::swarm_key`]): only peers holding it can connect. QUIC is off
    /// when it is set.
    pub swarm_key: Option<crate::swarm_key::PreSharedKey>,
    /// Bounds on connections, enforced before any protocol runs on them ([`default_connection_limits`]).
    pub connection_limits: ConnectionLimits,
}

/// The default bounds on a peer's connections: 128 handshakes in progress and 1,024 established connections
/// inbound, 2,048 in all, and 8 per remote peer (a client needs one, two while a relayed connection is upgraded to
/// a direct one). A flood of connections is refused before it costs a handshake or a stream each.
pub fn default_connection_limits() -> ConnectionLimits {
    ConnectionLimits::default()
        .with_max_pending_incoming(Some(128))
        .with_max_established_incoming(Some(1024))
        .with_max_established(Some(2048))
        .with_max_established_per_peer(Some(8))
}

impl NetConfig {
    /// A client-style config: no listeners, no bootstrap peers, DHT client mode, 60 s record TTL, no relay.
    pub fn new(keypair: Keypair) -> Self {
        NetConfig {
            keypair,
            listen: Vec::new(),
            bootstrap: Vec::new(),
            dht_server: false,
            record_ttl: DEFAULT_RECORD_TTL,
            idle_connection_timeout: DEFAULT_IDLE_CONNECTION_TIMEOUT,
            announce: Vec::new(),
            relay: None,
            use_relays: false,
            swarm_key: None,
            connection_limits: default_connection_limits(),
        }
    }
}
