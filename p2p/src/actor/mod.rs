//! The swarm actor: the only owner of the libp2p `Swarm`.
//!
//! One tokio task runs [`Actor::run`], a `select!` over swarm events, [`Command`]s from `Network` handles and a
//! maintenance tick. Every pending request lives in a map keyed by its Kademlia `QueryId` (or peer id, for
//! dials) and is answered through its oneshot/mpsc channel when the matching event arrives. Nothing here holds a
//! lock or awaits anything but the next event, so a slow caller can never stall the swarm.

use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use futures::StreamExt;
use libp2p::{
    autonat,
    core::transport::ListenerId,
    dcutr, identify,
    kad::{self, store::RecordStore, QueryId},
    multiaddr::Protocol,
    ping, relay,
    swarm::{
        dial_opts::{DialOpts, PeerCondition},
        ConnectionId, DialError, SwarmEvent,
    },
    Multiaddr, PeerId, Swarm,
};
use tokio::sync::mpsc;

mod connections;
mod dht_store;
mod kad_events;

use crate::{
    behaviour::{PetalBehaviour, PetalBehaviourEvent, KAD_PROTOCOL},
    command::{Command, Reply},
    reachability::{is_loopback, is_relayed, NatStatus, ReachabilityState},
    NetError,
};

/// How often the actor re-dials lost bootstrap peers and purges expired records.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// Addresses remembered per peer in the address book; old ones are dropped first.
const MAX_ADDRS_PER_PEER: usize = 16;
/// How long a `Connect` that reached its peer only through a relay waits for hole punching to give a direct
/// connection before it settles for the relayed one.
const DIRECT_UPGRADE_WAIT: Duration = Duration::from_secs(5);
/// How long a failed hole punch with a peer is remembered (its NAT will not have changed much sooner).
const PUNCH_FAILURE_MEMORY: Duration = Duration::from_secs(10 * 60);

/// An established connection: whose, whether it goes through a relay, and the address we dialed (`None` when the
/// peer dialed us).
struct ConnectionInfo {
    peer: PeerId,
    relayed: bool,
    dialed: Option<Multiaddr>,
    /// Whether the peer's end of the connection is a loopback address (it runs on this machine).
    loopback: bool,
    established: Instant,
}

/// A record lookup in flight: values already forwarded (to report each distinct value once) and where to send
/// new ones. Dropping `found` tells the caller the lookup is over.
struct RecordLookup {
    seen: HashSet<Vec<u8>>,
    found: mpsc::UnboundedSender<Vec<u8>>,
}

struct ProviderLookup {
    seen: HashSet<PeerId>,
    found: mpsc::UnboundedSender<HashSet<PeerId>>,
}

/// A put or start-providing query: the caller's reply, and whether the routing table had any peer when it
/// started (a query with nobody to store at is still a success: the value is in the local store).
struct PendingStore {
    reply: Reply<Result<(), NetError>>,
    had_peers: bool,
}

/// Fails if `addr`'s fixed TCP or UDP port is already taken.
///
/// libp2p-tcp sets `SO_REUSEPORT` on its listeners, so a second node on the same port would bind successfully
/// and the kernel would then spread incoming connections between the two processes. A plain bind (without
/// `SO_REUSEPORT`) of the same port fails if anyone holds it; the probe socket is closed at once.
fn probe_port_free(addr: &Multiaddr) -> Result<(), NetError> {
    let mut ip = None;
    for protocol in addr.iter() {
        let busy = |e: std::io::Error| NetError::Listen {
            addr: addr.clone(),
            reason: e.to_string(),
        };
        match protocol {
            Protocol::Ip4(v4) => ip = Some(std::net::IpAddr::V4(v4)),
            Protocol::Ip6(v6) => ip = Some(std::net::IpAddr::V6(v6)),
            Protocol::Tcp(port) if port != 0 => {
                if let Some(ip) = ip {
                    std::net::TcpListener::bind((ip, port)).map_err(busy)?;
                }
                return Ok(());
            }
            Protocol::Udp(port) if port != 0 => {
                if let Some(ip) = ip {
                    std::net::UdpSocket::bind((ip, port)).map_err(busy)?;
                }
                return Ok(());
            }
            _ => {}
        }
    }
    Ok(())
}

pub(crate) struct Actor {
    swarm: Swarm<PetalBehaviour>,
    commands: mpsc::Receiver<Command>,
    /// Bootstrap peers and their addresses, re-added to Kademlia if the routing table loses them.
    bootstrap: Vec<(PeerId, Multiaddr)>,
    puts: HashMap<QueryId, PendingStore>,
    providing: HashMap<QueryId, PendingStore>,
    record_lookups: HashMap<QueryId, RecordLookup>,
    provider_lookups: HashMap<QueryId, ProviderLookup>,
    bootstraps: HashMap<QueryId, Reply<Result<(), NetError>>>,
    connects: HashMap<PeerId, Vec<Reply<Result<(), NetError>>>>,
    /// Addresses learned from server records (`add_addresses`), used when dialing for `open_stream`.
    address_book: HashMap<PeerId, Vec<Multiaddr>>,
    /// Latest ping round trip per connected peer.
    rtts: HashMap<PeerId, Duration>,
    connections: HashMap<ConnectionId, ConnectionInfo>,
    /// Whether this peer serves the DHT (while reachable).
    dht_server: bool,
    /// Peers hole punching failed with, and when: a reconnect to them does not wait for another attempt.
    punch_failed: HashMap<PeerId, Instant>,
    /// `Disconnect` callers, each answered when the last of the connections it closes is gone.
    disconnects: Vec<(HashSet<ConnectionId>, Reply<()>)>,
    /// How many provider keys each peer holds in our DHT store.
    provider_quotas: dht_store::ProviderQuotas,
    /// Peers whose `Connect` callers wait for a direct connection, until the deadline.
    awaiting_direct: HashMap<PeerId, tokio::time::Instant>,
    reach: ReachabilityState,
}

impl Actor {
    pub(crate) fn new(
        swarm: Swarm<PetalBehaviour>,
        commands: mpsc::Receiver<Command>,
        bootstrap: Vec<(PeerId, Multiaddr)>,
        mut reach: ReachabilityState,
        dht_server: bool,
    ) -> Self {
        // Bootstrap peers are reachable by definition: the first relays to ask.
        for (peer, addr) in &bootstrap {
            reach.add_candidate(*peer, addr.clone());
        }
        Actor {
            swarm,
            commands,
            bootstrap,
            puts: HashMap::new(),
            providing: HashMap::new(),
            record_lookups: HashMap::new(),
            provider_lookups: HashMap::new(),
            bootstraps: HashMap::new(),
            connects: HashMap::new(),
            address_book: HashMap::new(),
            rtts: HashMap::new(),
            connections: HashMap::new(),
            dht_server,
            awaiting_direct: HashMap::new(),
            disconnects: Vec::new(),
            punch_failed: HashMap::new(),
            provider_quotas: dht_store::ProviderQuotas::default(),
            reach,
        }
    }

    /// Binds every listen address and waits until each listener reports its real address, so that
    /// `Network::start` returns with known ports. Events seen meanwhile are handled normally.
    pub(crate) async fn listen(
        &mut self,
        addrs: &[Multiaddr],
        timeout: Duration,
    ) -> Result<(), NetError> {
        let mut waiting: HashMap<ListenerId, Multiaddr> = HashMap::new();
        for addr in addrs {
            probe_port_free(addr)?;
            let id = self
                .swarm
                .listen_on(addr.clone())
                .map_err(|e| NetError::Listen {
                    addr: addr.clone(),
                    reason: e.to_string(),
                })?;
            waiting.insert(id, addr.clone());
        }
        let deadline = tokio::time::Instant::now() + timeout;
        while !waiting.is_empty() {
            let event = tokio::time::timeout_at(deadline, self.swarm.select_next_some())
                .await
                .map_err(|_| NetError::Timeout("waiting for listeners"))?;
            match &event {
                SwarmEvent::NewListenAddr { listener_id, .. } => {
                    waiting.remove(listener_id);
                }
                SwarmEvent::ListenerError { listener_id, error } => {
                    if let Some(addr) = waiting.remove(listener_id) {
                        return Err(NetError::Listen {
                            addr,
                            reason: error.to_string(),
                        });
                    }
                }
                SwarmEvent::ListenerClosed {
                    listener_id,
                    reason,
                    ..
                } => {
                    if let Some(addr) = waiting.remove(listener_id) {
                        let reason = match reason {
                            Ok(()) => "listener closed".to_string(),
                            Err(e) => e.to_string(),
                        };
                        return Err(NetError::Listen { addr, reason });
                    }
                }
                _ => {}
            }
            self.on_swarm_event(event);
        }
        Ok(())
    }

    /// Adds the bootstrap peers to Kademlia and dials those we are not connected to. Called at start and from the
    /// maintenance tick, because Kademlia drops addresses that failed to dial, which would otherwise leave a
    /// node isolated for good after its bootstrap peer restarts.
    pub(crate) fn connect_bootstrap(&mut self) {
        for (peer, addr) in self.bootstrap.clone() {
            self.swarm
                .behaviour_mut()
                .kad
                .add_address(&peer, addr.clone());
            if self.swarm.is_connected(&peer) {
                continue;
            }
            let opts = DialOpts::peer_id(peer)
                .addresses(vec![addr.clone()])
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .build();
            match self.swarm.dial(opts) {
                Ok(()) | Err(DialError::DialPeerConditionFalse(_)) => {}
                Err(e) => tracing::warn!(%peer, %addr, error = %e, "cannot dial bootstrap peer"),
            }
        }
    }

    /// The event loop. Ends on `Shutdown`, or when every `Network` handle is dropped; dropping the swarm closes
    /// all listeners and connections.
    pub(crate) async fn run(mut self) {
        let mut tick = tokio::time::interval(MAINTENANCE_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut shutdown_reply = None;
        loop {
            let upgrade_deadline = self.next_upgrade_deadline();
            let awaiting = !self.awaiting_direct.is_empty();
            tokio::select! {
                command = self.commands.recv() => match command {
                    Some(Command::Shutdown { reply }) => {
                        shutdown_reply = Some(reply);
                        break;
                    }
                    Some(command) => self.on_command(command),
                    None => break,
                },
                event = self.swarm.select_next_some() => self.on_swarm_event(event),
                _ = tick.tick() => self.maintenance(),
                _ = tokio::time::sleep_until(upgrade_deadline), if awaiting => {
                    let now = tokio::time::Instant::now();
                    let expired: Vec<PeerId> = self.awaiting_direct.iter().filter(|(_, d)| **d <= now).map(|(p, _)| *p).collect();
                    for peer in expired {
                        tracing::info!(%peer, "no direct connection in time; staying on the relay");
                        self.connected(peer);
                    }
                }
            }
        }
        let peer_id = *self.swarm.local_peer_id();
        // Dropping the swarm closes listeners and connections; pending callers see their channels close and
        // report `NetError::Closed`.
        drop(self);
        tracing::debug!(%peer_id, "network actor stopped");
        if let Some(reply) = shutdown_reply {
            let _ = reply.send(());
        }
    }

    fn maintenance(&mut self) {
        self.provider_quotas.prune(Instant::now());
        // Callers of `open_stream` that timed out leave their reply behind until the dial ends; drop them now.
        self.connects.retain(|_, replies| {
            replies.retain(|reply| !reply.is_closed());
            !replies.is_empty()
        });
        if !self.bootstrap.is_empty() && self.swarm.connected_peers().next().is_none() {
            tracing::debug!("not connected to any peer; re-dialing bootstrap peers");
            self.connect_bootstrap();
        }
        self.punch_failed
            .retain(|_, since| since.elapsed() < PUNCH_FAILURE_MEMORY);
        // Replace relay reservations that ended.
        self.reach.reserve(&mut self.swarm);
        // Without Kademlia's replication job nothing else sweeps the store, and records of dead servers would pile
        // up until lookups touched them.
        let now = Instant::now();
        let store = self.swarm.behaviour_mut().kad.store_mut();
        let expired: Vec<kad::RecordKey> = store
            .records()
            .filter(|r| r.is_expired(now))
            .map(|r| r.key.clone())
            .collect();
        for key in expired {
            store.remove(&key);
        }
    }

    fn routing_table_has_peers(&mut self) -> bool {
        self.swarm
            .behaviour_mut()
            .kad
            .kbuckets()
            .any(|bucket| bucket.num_entries() > 0)
    }

    fn on_command(&mut self, command: Command) {
        match command {
            Command::ListenAddrs { reply } => {
                let local = *self.swarm.local_peer_id();
                let mut addrs: Vec<Multiaddr> = Vec::new();
                for addr in self
                    .swarm
                    .listeners()
                    .chain(self.swarm.external_addresses())
                {
                    let addr = addr.clone().with_p2p(local).unwrap_or_else(|a| a);
                    if !addrs.contains(&addr) {
                        addrs.push(addr);
                    }
                }
                let _ = reply.send(addrs);
            }
            Command::Bootstrap { reply } => {
                if self.bootstrap.is_empty() && !self.routing_table_has_peers() {
                    let _ = reply.send(Ok(()));
                    return;
                }
                self.connect_bootstrap();
                match self.swarm.behaviour_mut().kad.bootstrap() {
                    Ok(id) => {
                        self.bootstraps.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NetError::Dht(e.to_string())));
                    }
                }
            }
            Command::PutRecord {
                key,
                value,
                ttl,
                reply,
            } => {
                let had_peers = self.routing_table_has_peers();
                let mut record = kad::Record::new(key, value);
                // Explicit expiry: stores drop the record `ttl` after this put unless it is put again.
                record.expires = Some(Instant::now() + ttl);
                match self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .put_record(record, kad::Quorum::One)
                {
                    Ok(id) => {
                        self.puts.insert(id, PendingStore { reply, had_peers });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NetError::Dht(format!("local store: {e:?}"))));
                    }
                }
            }
            Command::GetRecords { key, found, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_record(kad::RecordKey::new(&key));
                self.record_lookups.insert(
                    id,
                    RecordLookup {
                        seen: HashSet::new(),
                        found,
                    },
                );
                let _ = reply.send(id);
            }
            Command::StartProviding { key, reply } => {
                let had_peers = self.routing_table_has_peers();
                match self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .start_providing(kad::RecordKey::new(&key))
                {
                    Ok(id) => {
                        self.providing.insert(id, PendingStore { reply, had_peers });
                    }
                    Err(e) => {
                        let _ = reply.send(Err(NetError::Dht(format!("local store: {e:?}"))));
                    }
                }
            }
            Command::StopProviding { key, reply } => {
                self.swarm
                    .behaviour_mut()
                    .kad
                    .stop_providing(&kad::RecordKey::new(&key));
                let _ = reply.send(());
            }
            Command::GetProviders { key, found, reply } => {
                let id = self
                    .swarm
                    .behaviour_mut()
                    .kad
                    .get_providers(kad::RecordKey::new(&key));
                self.provider_lookups.insert(
                    id,
                    ProviderLookup {
                        seen: HashSet::new(),
                        found,
                    },
                );
                let _ = reply.send(id);
            }
            Command::CancelQuery { id } => {
                self.record_lookups.remove(&id);
                self.provider_lookups.remove(&id);
                if let Some(mut query) = self.swarm.behaviour_mut().kad.query_mut(&id) {
                    query.finish();
                }
            }
            Command::AddAddresses { peer, addrs, reply } => {
                self.remember_addresses(peer, addrs);
                let _ = reply.send(());
            }
            Command::Connect { peer, reply } => self.connect(peer, reply),
            Command::Rtt { peer, reply } => {
                let _ = reply.send(self.rtts.get(&peer).copied());
            }
            Command::ConnectedPeers { reply } => {
                let _ = reply.send(self.swarm.connected_peers().copied().collect());
            }
            Command::Disconnect {
                peer,
                established_before,
                reply,
            } => {
                // Connection by connection, not `disconnect_peer_id`: that would also abort dials and close the
                // fresh connections that other sessions to the same peer are opening at the same time.
                let stale: HashSet<ConnectionId> = self
                    .connections
                    .iter()
                    .filter(|(_, c)| c.peer == peer && c.established < established_before)
                    .map(|(id, _)| *id)
                    .filter(|id| self.swarm.close_connection(*id))
                    .collect();
                if stale.is_empty() {
                    let _ = reply.send(());
                } else {
                    self.disconnects.push((stale, reply));
                }
            }
            Command::Path { peer, reply } => {
                let _ = reply.send(self.path(&peer));
            }
            // Handled in `run`, which must leave the loop.
            Command::Shutdown { reply } => {
                let _ = reply.send(());
            }
        }
    }

    fn on_swarm_event(&mut self, event: SwarmEvent<PetalBehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(PetalBehaviourEvent::Kad(event)) => self.on_kad_event(event),
            SwarmEvent::Behaviour(PetalBehaviourEvent::Identify(event)) => {
                self.on_identify_event(event)
            }
            SwarmEvent::Behaviour(PetalBehaviourEvent::Ping(ping::Event {
                peer, result, ..
            })) => match result {
                Ok(rtt) => {
                    self.rtts.insert(peer, rtt);
                }
                Err(e) => tracing::debug!(%peer, error = %e, "ping failed"),
            },
            SwarmEvent::Behaviour(PetalBehaviourEvent::Stream(())) => {}
            SwarmEvent::Behaviour(PetalBehaviourEvent::Limits(never)) => match never {},
            SwarmEvent::Behaviour(PetalBehaviourEvent::Autonat(event)) => {
                self.on_autonat_event(event)
            }
            SwarmEvent::Behaviour(PetalBehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            })) => match result {
                Ok(_) => {
                    tracing::info!(peer = %remote_peer_id, "hole punching succeeded: direct connection")
                }
                Err(e) => {
                    tracing::info!(peer = %remote_peer_id, error = %e, "hole punching failed; staying on the relay");
                    self.punch_failed.insert(remote_peer_id, Instant::now());
                    if self.awaiting_direct.contains_key(&remote_peer_id) {
                        self.connected(remote_peer_id);
                    }
                }
            },
            SwarmEvent::Behaviour(PetalBehaviourEvent::RelayClient(event)) => match event {
                relay::client::Event::ReservationReqAccepted {
                    relay_peer_id,
                    renewal,
                    ..
                } => {
                    tracing::debug!(relay = %relay_peer_id, renewal, "relay reservation accepted");
                }
                other => tracing::debug!(event = ?other, "relay client"),
            },
            SwarmEvent::Behaviour(PetalBehaviourEvent::RelayServer(event)) => {
                tracing::debug!(?event, "relay server");
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
                self.reach.on_new_listen_addr(&address);
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.reach.on_expired_listen_addr(&address);
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                self.reach.on_external_addr(&address, true);
            }
            SwarmEvent::ExternalAddrExpired { address } => {
                self.reach.on_external_addr(&address, false);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                let relayed = endpoint.is_relayed();
                tracing::debug!(peer = %peer_id, addr = %endpoint.get_remote_address(), relayed, "connected");
                let dialed = endpoint
                    .is_dialer()
                    .then(|| endpoint.get_remote_address().clone());
                let loopback = is_loopback(endpoint.get_remote_address());
                self.connections.insert(
                    connection_id,
                    ConnectionInfo {
                        peer: peer_id,
                        relayed,
                        dialed,
                        loopback,
                        established: Instant::now(),
                    },
                );
                self.on_connection_established(peer_id, relayed);
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                cause,
                ..
            } => {
                tracing::debug!(peer = %peer_id, ?cause, "connection closed");
                self.connections.remove(&connection_id);
                if num_established == 0 {
                    self.rtts.remove(&peer_id);
                }
                for (closing, _) in &mut self.disconnects {
                    closing.remove(&connection_id);
                }
                for (_, reply) in self
                    .disconnects
                    .extract_if(.., |(closing, _)| closing.is_empty())
                {
                    let _ = reply.send(());
                }
                self.on_connection_closed(peer_id);
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id: Some(peer),
                error,
                ..
            } => {
                tracing::debug!(%peer, error = %error, "dial failed");
                if !self.swarm.is_connected(&peer) {
                    for reply in self.connects.remove(&peer).unwrap_or_default() {
                        let _ = reply.send(Err(NetError::Stream {
                            peer,
                            reason: format!("cannot connect: {error}"),
                        }));
                    }
                }
            }
            SwarmEvent::ListenerError { listener_id, error } => {
                tracing::warn!(?listener_id, error = %error, "listener error");
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                addresses,
                reason,
            } => {
                tracing::info!(?addresses, ?reason, "listener closed");
                self.reach
                    .on_listener_closed(listener_id, &addresses, reason.is_err());
            }
            other => tracing::trace!(event = ?other, "swarm event"),
        }
    }

    fn on_autonat_event(&mut self, event: autonat::Event) {
        match event {
            autonat::Event::StatusChanged { old, new } => {
                tracing::debug!(?old, ?new, "AutoNAT status");
                let status = match new {
                    autonat::NatStatus::Public(_) => NatStatus::Public,
                    autonat::NatStatus::Private => NatStatus::Private,
                    autonat::NatStatus::Unknown => NatStatus::Unknown,
                };
                self.reach.set_status(&mut self.swarm, status);
                // A DHT server nobody can dial would only slow everyone's queries down: behind NAT, query only.
                let mode = match status {
                    NatStatus::Public if self.dht_server => Some(kad::Mode::Server),
                    NatStatus::Private => Some(kad::Mode::Client),
                    _ => None,
                };
                if let Some(mode) = mode {
                    self.swarm.behaviour_mut().kad.set_mode(Some(mode));
                }
            }
            other => tracing::trace!(event = ?other, "AutoNAT"),
        }
    }

    fn on_identify_event(&mut self, event: identify::Event) {
        if let identify::Event::Received {
            peer_id,
            info,
            connection_id,
        } = event
        {
            // Only DHT servers belong in the routing table: a client-mode peer does not list the Kademlia
            // protocol and cannot answer queries. Its loopback addresses are only worth passing on when it is
            // on this machine (connected over loopback): anyone else would dial their own machine.
            let over_loopback = self
                .connections
                .get(&connection_id)
                .is_some_and(|c| c.loopback);
            if info.protocols.contains(&KAD_PROTOCOL) {
                let routable = info
                    .listen_addrs
                    .iter()
                    .filter(|a| !is_relayed(a) && (over_loopback || !is_loopback(a)));
                for addr in routable {
                    self.swarm
                        .behaviour_mut()
                        .kad
                        .add_address(&peer_id, addr.clone());
                }
            }
            // A relay we reached by dialing it directly can relay for us.
            if info.protocols.contains(&relay::HOP_PROTOCOL_NAME) {
                let dialed = self
                    .connections
                    .values()
                    .filter(|c| c.peer == peer_id && !c.relayed)
                    .find_map(|c| c.dialed.clone());
                if let Some(addr) = dialed {
                    self.reach.add_candidate(peer_id, addr);
                    self.reach.reserve(&mut self.swarm);
                }
            }
            tracing::debug!(peer = %peer_id, agent = %info.agent_version, "identified peer");
        }
    }
}
