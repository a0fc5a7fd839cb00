//! Petal networking, shared by the server (`petal-node`) and the client (`petal-client`).
//!
//! - [`Network`]: a handle to one libp2p peer (TCP+noise+yamux and QUIC; Kademlia, identify, ping and raw
//!   inference streams), run by a single actor task that owns the swarm.
//! - [`records`]: the DHT layout for server announcements and [`find_servers`].
//! - [`Announcer`]: keeps a server's record fresh and withdraws it on shutdown.
//! - [`identity`]: the node's persistent ed25519 key.
//!
//! Typical server: `Network::start` with `dht_server = true` and the bootstrap list, `accept_streams()` for
//! inference, `Announcer::spawn` with a `watch` of its `ServerRecord`, `withdraw()` on SIGTERM. Typical client:
//! `Network::start` with `dht_server = false`, `find_servers`, then `open_stream` to the chosen servers.

mod actor;
pub mod announcer;
mod behaviour;
mod command;
mod config;
mod error;
pub mod identity;
mod network;
pub mod reachability;
pub mod records;
pub mod streams;
pub mod swarm_key;

pub use announcer::{Announcer, AnnouncerHandle};
pub use behaviour::{IDENTIFY_PROTOCOL_VERSION, KAD_PROTOCOL};
pub use config::{
    default_connection_limits, NetConfig, DEFAULT_IDLE_CONNECTION_TIMEOUT, DEFAULT_RECORD_TTL,
};
pub use error::NetError;
pub use identity::{generate_to_file, load_from_file};
pub use libp2p::connection_limits::ConnectionLimits;
pub use network::{inference_protocol, Network, HANDSHAKE_TIMEOUT, OPEN_STREAM_TIMEOUT};
pub use reachability::{ConnectionPath, NatStatus, Reachability, RelayLimits};
pub use records::{find_servers, is_live, model_key, now_unix_ms, server_key, SERVERS_KEY};

/// Re-exported so callers need not depend on libp2p directly for the types in this API.
pub use libp2p::{identity::Keypair, Multiaddr, PeerId, Stream};
pub use streams::IncomingStreams;
