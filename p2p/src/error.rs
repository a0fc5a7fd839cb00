//! The one error type of the networking layer.
//!
//! Every variant carries strings rather than libp2p error types so the error is `Clone`, `Send` and stable across
//! libp2p upgrades; callers (node, client) only ever log these or map them to their own errors.

use std::path::PathBuf;

use libp2p::{Multiaddr, PeerId};

/// Errors from starting the swarm, talking to the DHT or opening streams.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NetError {
    /// Building the transport (TCP/noise/yamux, QUIC) or the behaviour failed.
    #[error("transport error: {0}")]
    Transport(String),
    /// A listen address could not be bound.
    #[error("cannot listen on {addr}: {reason}")]
    Listen { addr: Multiaddr, reason: String },
    /// A bootstrap address is unusable, e.g. it does not end in `/p2p/<peer id>`.
    #[error("bad bootstrap address: {0}")]
    BadBootstrap(String),
    /// A Kademlia operation failed (record store full, no quorum reached, ...).
    #[error("DHT error: {0}")]
    Dht(String),
    /// An inference stream to `peer` could not be opened.
    #[error("cannot open stream to {peer}: {reason}")]
    Stream { peer: PeerId, reason: String },
    /// The identity key file is missing, unreadable or corrupt (or would be overwritten).
    #[error("identity file {}: {reason}", path.display())]
    Identity { path: PathBuf, reason: String },
    /// The swarm key file is missing, unreadable or not a swarm key (or would be overwritten).
    #[error("swarm key file {}: {reason}", path.display())]
    SwarmKey { path: PathBuf, reason: String },
    /// An operation did not finish in time; the text names the operation.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The swarm actor has stopped (after `shutdown`, or because it failed).
    #[error("network actor is gone")]
    Closed,
}
