//! Typed requests from [`Network`](crate::Network) handles to the swarm actor. Each carries the channel its
//! answer goes back on, so the actor never blocks on a caller and callers never touch the swarm.

use std::{collections::HashSet, time::Duration};

use libp2p::{kad::QueryId, Multiaddr, PeerId};
use tokio::sync::{mpsc, oneshot};

use crate::NetError;

pub(crate) type Reply<T> = oneshot::Sender<T>;

pub(crate) enum Command {
    ListenAddrs {
        reply: Reply<Vec<Multiaddr>>,
    },
    Bootstrap {
        reply: Reply<Result<(), NetError>>,
    },
    PutRecord {
        key: Vec<u8>,
        value: Vec<u8>,
        ttl: Duration,
        reply: Reply<Result<(), NetError>>,
    },
    /// Starts a record lookup. The query id comes back at once (so the caller can cancel it on timeout); each
    /// value found is sent on `found`, which the actor drops when the query ends.
    GetRecords {
        key: Vec<u8>,
        found: mpsc::UnboundedSender<Vec<u8>>,
        reply: Reply<QueryId>,
    },
    StartProviding {
        key: Vec<u8>,
        reply: Reply<Result<(), NetError>>,
    },
    StopProviding {
        key: Vec<u8>,
        reply: Reply<()>,
    },
    /// Like `GetRecords`, for provider lookups.
    GetProviders {
        key: Vec<u8>,
        found: mpsc::UnboundedSender<HashSet<PeerId>>,
        reply: Reply<QueryId>,
    },
    /// Stops a lookup whose caller gave up waiting.
    CancelQuery {
        id: QueryId,
    },
    AddAddresses {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        reply: Reply<()>,
    },
    /// Resolves once there is a connection to `peer` (dialing its known addresses if needed).
    Connect {
        peer: PeerId,
        reply: Reply<Result<(), NetError>>,
    },
    Rtt {
        peer: PeerId,
        reply: Reply<Option<Duration>>,
    },
    ConnectedPeers {
        reply: Reply<Vec<PeerId>>,
    },
    /// Closes the connections to `peer` established before `established_before` (pending dials and newer
    /// connections are left alone); answered once they are all gone.
    Disconnect {
        peer: PeerId,
        established_before: std::time::Instant,
        reply: Reply<()>,
    },
    /// Whether the connection to `peer` is direct or relayed (`None`: not connected).
    Path {
        peer: PeerId,
        reply: Reply<Option<crate::reachability::ConnectionPath>>,
    },
    Shutdown {
        reply: Reply<()>,
    },
}
