//! Dialing peers for `Connect`, remembering their addresses, and preferring direct connections over relayed ones.
use libp2p::{
    multiaddr::Protocol,
    swarm::{
        dial_opts::{DialOpts, PeerCondition},
        ConnectionId, DialError,
    },
    Multiaddr, PeerId,
};

use super::{Actor, DIRECT_UPGRADE_WAIT, MAINTENANCE_INTERVAL, MAX_ADDRS_PER_PEER};
use crate::{command::Reply, reachability::ConnectionPath, NetError};

impl Actor {
    /// The next moment a `Connect` waiting for a direct connection gives up waiting.
    pub(super) fn next_upgrade_deadline(&self) -> tokio::time::Instant {
        self.awaiting_direct
            .values()
            .min()
            .copied()
            .unwrap_or_else(|| tokio::time::Instant::now() + MAINTENANCE_INTERVAL)
    }

    /// Answers the `Connect` callers of `peer`.
    pub(super) fn connected(&mut self, peer: PeerId) {
        self.awaiting_direct.remove(&peer);
        for reply in self.connects.remove(&peer).unwrap_or_default() {
            let _ = reply.send(Ok(()));
        }
    }

    /// How we are connected to `peer`: directly if any connection is direct.
    pub(super) fn path(&self, peer: &PeerId) -> Option<ConnectionPath> {
        let mut path = None;
        for c in self.connections.values().filter(|c| c.peer == *peer) {
            if !c.relayed {
                return Some(ConnectionPath::Direct);
            }
            path = Some(ConnectionPath::Relayed);
        }
        path
    }

    pub(super) fn remember_addresses(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
        let book = self.address_book.entry(peer).or_default();
        for addr in addrs {
            // Strip a trailing /p2p/<id>: DialOpts adds it back, and it must match `peer` anyway.
            let addr = match addr.iter().last() {
                Some(Protocol::P2p(id)) if id == peer => {
                    let mut a = addr.clone();
                    a.pop();
                    a
                }
                Some(Protocol::P2p(other)) => {
                    tracing::debug!(%peer, %other, %addr, "ignoring address of another peer");
                    continue;
                }
                _ => addr,
            };
            if !book.contains(&addr) {
                book.push(addr);
            }
        }
        if book.len() > MAX_ADDRS_PER_PEER {
            let excess = book.len() - MAX_ADDRS_PER_PEER;
            book.drain(..excess);
        }
    }

    /// When `peer` is reached only through a relay and hole punching may still give a direct connection, starts
    /// (or keeps) waiting for it, up to [`DIRECT_UPGRADE_WAIT`], and says so.
    fn await_direct(&mut self, peer: PeerId) -> bool {
        let worth_waiting = self.path(&peer) == Some(ConnectionPath::Relayed)
            && !self.punch_failed.contains_key(&peer);
        if worth_waiting {
            self.awaiting_direct
                .entry(peer)
                .or_insert_with(|| tokio::time::Instant::now() + DIRECT_UPGRADE_WAIT);
        }
        worth_waiting
    }

    pub(super) fn connect(&mut self, peer: PeerId, reply: Reply<Result<(), NetError>>) {
        if self.swarm.is_connected(&peer) {
            // A relayed connection (a DHT lookup reached the peer so) waits for a direct one like a fresh one.
            if self.await_direct(peer) {
                self.connects.entry(peer).or_default().push(reply);
            } else {
                let _ = reply.send(Ok(()));
            }
            return;
        }
        let addrs = self.address_book.get(&peer).cloned().unwrap_or_default();
        let opts = DialOpts::peer_id(peer)
            .addresses(addrs)
            // Kademlia's routing table may know more addresses.
            .extend_addresses_through_behaviour()
            .condition(PeerCondition::DisconnectedAndNotDialing)
            .build();
        match self.swarm.dial(opts) {
            // Already dialing: the outcome of that dial answers us too.
            Ok(()) | Err(DialError::DialPeerConditionFalse(_)) => {
                self.connects.entry(peer).or_default().push(reply);
            }
            Err(e) => {
                let _ = reply.send(Err(NetError::Stream {
                    peer,
                    reason: format!("cannot dial: {e}"),
                }));
            }
        }
    }

    /// A new connection answers waiting `Connect`s, except a relayed one to a peer we have no direct connection to:
    /// hole punching may give one within [`DIRECT_UPGRADE_WAIT`], and streams should not start on the relay. Once
    /// a direct connection exists, the relayed ones we opened for the wait are closed so streams take the direct.
    pub(super) fn on_connection_established(&mut self, peer: PeerId, relayed: bool) {
        if relayed {
            if !(self.connects.contains_key(&peer) && self.await_direct(peer)) {
                self.connected(peer);
            }
            return;
        }
        if self.awaiting_direct.contains_key(&peer) {
            let relayed: Vec<ConnectionId> = self
                .connections
                .iter()
                .filter(|(_, c)| c.peer == peer && c.relayed)
                .map(|(id, _)| *id)
                .collect();
            if !relayed.is_empty() {
                // Answer once they are gone (`on_connection_closed`): a stream opened meanwhile could still pick
                // a closing relayed connection.
                for id in relayed {
                    self.swarm.close_connection(id);
                }
                return;
            }
        }
        self.connected(peer);
    }

    /// A connection closed: a `Connect` waiting for the relayed connections to `peer` to go is answered once only
    /// direct ones remain.
    pub(super) fn on_connection_closed(&mut self, peer: PeerId) {
        if self.awaiting_direct.contains_key(&peer)
            && self.path(&peer) == Some(ConnectionPath::Direct)
        {
            let relayed_left = self
                .connections
                .values()
                .any(|c| c.peer == peer && c.relayed);
            if !relayed_left {
                self.connected(peer);
            }
        }
    }
}
