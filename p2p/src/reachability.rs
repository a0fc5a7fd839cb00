//! Reachability: whether other peers can dial this one, and what to do when they cannot.
//!
//! AutoNAT asks peers to dial this node back at its observed addresses: a success confirms a public address, a
//! failure means it sits behind NAT or a firewall. A node behind NAT reserves slots on relays (the bootstrap
//! peers, and peers it reached by dialing that offer the relay protocol) and listens on `/p2p-circuit` addresses
//! through them, which its DHT record then carries. A peer that connects through a relay is upgraded to a direct
//! connection by DCUtR (hole punching) where the NATs allow it; the actor closes the relayed connection once a
//! direct one exists, so inference streams take the direct path.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use libp2p::{core::transport::ListenerId, multiaddr::Protocol, Multiaddr, PeerId, Swarm};
use tokio::sync::watch;

use crate::behaviour::PetalBehaviour;

/// Relays a node behind NAT keeps reservations on at once: one is enough to be reached, two survive the loss of
/// one without a gap.
const MAX_RESERVATIONS: usize = 2;
/// How long a relay that refused or failed is left alone. A relay refuses reservations until it has a confirmed
/// external address itself (its own AutoNAT probes), so a node that starts with it retries soon.
const RELAY_RETRY: Duration = Duration::from_secs(10);

/// Limits of the circuit-relay server a reachable node runs. Inference over a relay is a long exchange of small
/// frames (a few KiB per token and hop), so circuits are allowed far longer and larger than libp2p's defaults
/// (2 minutes, 128 KiB), which would cut a generation short.
#[derive(Debug, Clone)]
pub struct RelayLimits {
    /// Peers holding a reservation (a slot to be reached through) at once.
    pub max_reservations: usize,
    /// Relayed connections at once, and per peer.
    pub max_circuits: usize,
    pub max_circuits_per_peer: usize,
    /// How long one relayed connection may last, and how many bytes it may carry (each direction).
    pub max_circuit_duration: Duration,
    pub max_circuit_bytes: u64,
}

impl Default for RelayLimits {
    fn default() -> Self {
        RelayLimits {
            max_reservations: 128,
            max_circuits: 64,
            max_circuits_per_peer: 8,
            max_circuit_duration: Duration::from_secs(60 * 60),
            max_circuit_bytes: 1 << 30,
        }
    }
}

/// What AutoNAT concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NatStatus {
    /// Not probed yet, or no peer could answer.
    #[default]
    Unknown,
    /// A peer dialed one of this node's addresses back.
    Public,
    /// Peers could not dial back: behind NAT or a firewall.
    Private,
}

impl NatStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            NatStatus::Unknown => "unknown",
            NatStatus::Public => "public",
            NatStatus::Private => "private",
        }
    }
}

/// This node's reachability as last observed, published through [`crate::Network::reachability`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Reachability {
    pub status: NatStatus,
    /// External addresses confirmed by AutoNAT or asserted with `--announce-addr`.
    pub external: Vec<Multiaddr>,
    /// `/p2p-circuit` addresses through relays holding a reservation for this node.
    pub relayed: Vec<Multiaddr>,
}

/// How a connection to a peer travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionPath {
    Direct,
    /// Through a circuit relay (no direct connection exists).
    Relayed,
}

/// Whether `addr` is a loopback address (127.0.0.0/8 or ::1).
pub fn is_loopback(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| match p {
        Protocol::Ip4(ip) => ip.is_loopback(),
        Protocol::Ip6(ip) => ip.is_loopback(),
        _ => false,
    })
}

/// The addresses worth announcing: loopback ones only when there is nothing else (a swarm on one machine).
pub fn announceable(addrs: Vec<Multiaddr>) -> Vec<Multiaddr> {
    if addrs.iter().all(is_loopback) {
        return addrs;
    }
    addrs.into_iter().filter(|a| !is_loopback(a)).collect()
}

/// Whether `addr` goes through a circuit relay.
pub fn is_relayed(addr: &Multiaddr) -> bool {
    addr.iter().any(|p| p == Protocol::P2pCircuit)
}

/// The actor's side: relay candidates, reservations, and the published [`Reachability`].
pub(crate) struct ReachabilityState {
    /// Whether to reserve relay slots when private (servers do; clients only dial out).
    use_relays: bool,
    /// Peers that can relay for us, with an address to reach them.
    candidates: HashMap<PeerId, Multiaddr>,
    /// Relays we listen through, by listener.
    reservations: HashMap<ListenerId, PeerId>,
    /// Relays that refused or failed, and when: not asked again for [`RELAY_RETRY`].
    failed: HashMap<PeerId, Instant>,
    current: Reachability,
    published: watch::Sender<Reachability>,
}

impl ReachabilityState {
    pub(crate) fn new(use_relays: bool, announce: &[Multiaddr]) -> Self {
        let current = Reachability {
            external: announce.to_vec(),
            ..Reachability::default()
        };
        ReachabilityState {
            use_relays,
            candidates: HashMap::new(),
            reservations: HashMap::new(),
            failed: HashMap::new(),
            published: watch::channel(current.clone()).0,
            current,
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Reachability> {
        self.published.subscribe()
    }

    /// A peer that can relay for us (a bootstrap peer, or a relay we reached by dialing it), at `addr` (a trailing
    /// `/p2p/<id>` is dropped: the circuit address adds it back).
    pub(crate) fn add_candidate(&mut self, peer: PeerId, mut addr: Multiaddr) {
        if let Some(Protocol::P2p(_)) = addr.iter().last() {
            addr.pop();
        }
        if !is_relayed(&addr) {
            self.candidates.entry(peer).or_insert(addr);
        }
    }

    pub(crate) fn set_status(&mut self, swarm: &mut Swarm<PetalBehaviour>, status: NatStatus) {
        if self.current.status == status {
            return;
        }
        tracing::info!(status = %status.as_str(), "reachability changed");
        self.current.status = status;
        self.failed.clear();
        if status == NatStatus::Public {
            // Directly reachable: relay slots would only add a slower path.
            for (listener, relay) in self.reservations.drain() {
                tracing::info!(%relay, "dropping the relay reservation: reachable directly");
                swarm.remove_listener(listener);
            }
        }
        self.reserve(swarm);
        self.publish();
    }

    /// Reserves slots on relays while private, up to [`MAX_RESERVATIONS`]. Also called from the maintenance tick,
    /// so a lost reservation is replaced.
    pub(crate) fn reserve(&mut self, swarm: &mut Swarm<PetalBehaviour>) {
        if !self.use_relays || self.current.status != NatStatus::Private {
            return;
        }
        let mut candidates: Vec<(PeerId, Multiaddr)> = self
            .candidates
            .iter()
            .filter(|(peer, _)| {
                self.failed
                    .get(*peer)
                    .is_none_or(|since| since.elapsed() >= RELAY_RETRY)
                    && !self.reservations.values().any(|r| r == *peer)
            })
            .map(|(p, a)| (*p, a.clone()))
            .collect();
        candidates.sort_by_key(|(p, _)| p.to_bytes());
        for (relay, addr) in candidates {
            if self.reservations.len() >= MAX_RESERVATIONS {
                break;
            }
            let circuit = addr
                .with_p2p(relay)
                .unwrap_or_else(|a| a)
                .with(Protocol::P2pCircuit);
            match swarm.listen_on(circuit.clone()) {
                Ok(listener) => {
                    tracing::info!(%relay, %circuit, "reserving a relay slot");
                    self.reservations.insert(listener, relay);
                }
                Err(e) => {
                    tracing::warn!(%relay, error = %e, "cannot listen through relay");
                    self.failed.insert(relay, Instant::now());
                }
            }
        }
    }

    /// A listener ended: if it was a relay reservation, forget it (and that relay, if it failed). Its addresses
    /// go too: libp2p reports them only here, not as expired listen addresses.
    pub(crate) fn on_listener_closed(
        &mut self,
        listener: ListenerId,
        addresses: &[Multiaddr],
        failed: bool,
    ) {
        if let Some(relay) = self.reservations.remove(&listener) {
            tracing::warn!(%relay, failed, "relay reservation ended");
            if failed {
                self.failed.insert(relay, Instant::now());
            }
        }
        for addr in addresses {
            self.on_expired_listen_addr(addr);
        }
    }

    pub(crate) fn on_new_listen_addr(&mut self, addr: &Multiaddr) {
        if is_relayed(addr) && !self.current.relayed.contains(addr) {
            tracing::info!(%addr, "reachable through a relay");
            self.current.relayed.push(addr.clone());
            self.publish();
        }
    }

    pub(crate) fn on_expired_listen_addr(&mut self, addr: &Multiaddr) {
        self.current.relayed.retain(|a| a != addr);
        self.publish();
    }

    pub(crate) fn on_external_addr(&mut self, addr: &Multiaddr, confirmed: bool) {
        if confirmed && !self.current.external.contains(addr) {
            tracing::info!(%addr, "external address confirmed");
            self.current.external.push(addr.clone());
        } else if !confirmed {
            self.current.external.retain(|a| a != addr);
        }
        self.publish();
    }

    fn publish(&self) {
        self.published.send_if_modified(|r| {
            let changed = *r != self.current;
            if changed {
                *r = self.current.clone();
            }
            changed
        });
    }
}
