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
    core::transport::ListenerId,
    identify,
    kad::{self, store::RecordStore, QueryId},
    multiaddr::Protocol,
    ping,
    swarm::{
        dial_opts::{DialOpts, PeerCondition},
        DialError, SwarmEvent,
    },
    Multiaddr, PeerId, Swarm,
};
use tokio::sync::mpsc;

use crate::{
    behaviour::{PetalBehaviour, PetalBehaviourEvent, KAD_PROTOCOL},
    command::{Command, Reply},
    NetError,
};

/// How often the actor re-dials lost bootstrap peers and purges expired records.
const MAINTENANCE_INTERVAL: Duration = Duration::from_secs(5);
/// Addresses remembered per peer in the address book; old ones are dropped first.
const MAX_ADDRS_PER_PEER: usize = 16;

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
}

impl Actor {
    pub(crate) fn new(
        swarm: Swarm<PetalBehaviour>,
        commands: mpsc::Receiver<Command>,
        bootstrap: Vec<(PeerId, Multiaddr)>,
    ) -> Self {
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
        // Callers of `open_stream` that timed out leave their reply behind until the dial ends; drop them now.
        self.connects.retain(|_, replies| {
            replies.retain(|reply| !reply.is_closed());
            !replies.is_empty()
        });
        if !self.bootstrap.is_empty() && self.swarm.connected_peers().next().is_none() {
            tracing::debug!("not connected to any peer; re-dialing bootstrap peers");
            self.connect_bootstrap();
        }
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
            // Handled in `run`, which must leave the loop.
            Command::Shutdown { reply } => {
                let _ = reply.send(());
            }
        }
    }

    fn remember_addresses(&mut self, peer: PeerId, addrs: Vec<Multiaddr>) {
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

    fn connect(&mut self, peer: PeerId, reply: Reply<Result<(), NetError>>) {
        if self.swarm.is_connected(&peer) {
            let _ = reply.send(Ok(()));
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
            SwarmEvent::NewListenAddr { address, .. } => {
                tracing::info!(%address, "listening");
            }
            SwarmEvent::ConnectionEstablished {
                peer_id, endpoint, ..
            } => {
                tracing::debug!(peer = %peer_id, addr = %endpoint.get_remote_address(), "connected");
                for reply in self.connects.remove(&peer_id).unwrap_or_default() {
                    let _ = reply.send(Ok(()));
                }
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established,
                cause,
                ..
            } => {
                tracing::debug!(peer = %peer_id, ?cause, "connection closed");
                if num_established == 0 {
                    self.rtts.remove(&peer_id);
                }
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
                addresses, reason, ..
            } => {
                tracing::info!(?addresses, ?reason, "listener closed");
            }
            other => tracing::trace!(event = ?other, "swarm event"),
        }
    }

    fn on_identify_event(&mut self, event: identify::Event) {
        if let identify::Event::Received { peer_id, info, .. } = event {
            // Only DHT servers belong in the routing table: a client-mode peer does not list the Kademlia
            // protocol and cannot answer queries.
            if info.protocols.contains(&KAD_PROTOCOL) {
                for addr in info.listen_addrs {
                    self.swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                }
            }
            tracing::debug!(peer = %peer_id, agent = %info.agent_version, "identified peer");
        }
    }

    fn on_kad_event(&mut self, event: kad::Event) {
        let kad::Event::OutboundQueryProgressed {
            id, result, step, ..
        } = event
        else {
            tracing::trace!(?event, "kademlia event");
            return;
        };
        match result {
            kad::QueryResult::PutRecord(result) => {
                if let Some(pending) = self.puts.remove(&id) {
                    let result = match result {
                        Ok(_) => Ok(()),
                        Err(e) if !pending.had_peers => {
                            tracing::debug!(error = %e, "record stored locally only: no peers yet");
                            Ok(())
                        }
                        Err(e) => Err(NetError::Dht(format!("put_record: {e}"))),
                    };
                    let _ = pending.reply.send(result);
                }
            }
            kad::QueryResult::StartProviding(result) => {
                if let Some(pending) = self.providing.remove(&id) {
                    let result = match result {
                        Ok(_) => Ok(()),
                        Err(e) if !pending.had_peers => {
                            tracing::debug!(error = %e, "providing locally only: no peers yet");
                            Ok(())
                        }
                        Err(e) => Err(NetError::Dht(format!("start_providing: {e}"))),
                    };
                    let _ = pending.reply.send(result);
                }
            }
            kad::QueryResult::GetRecord(result) => {
                if let Some(lookup) = self.record_lookups.get_mut(&id) {
                    match result {
                        Ok(kad::GetRecordOk::FoundRecord(found)) => {
                            if lookup.seen.insert(found.record.value.clone()) {
                                // A closed receiver means the caller gave up; the cancel command follows.
                                let _ = lookup.found.send(found.record.value);
                            }
                        }
                        Ok(kad::GetRecordOk::FinishedWithNoAdditionalRecord { .. }) => {}
                        Err(e) => tracing::debug!(error = %e, "get_record ended"),
                    }
                    if step.last {
                        self.record_lookups.remove(&id);
                    }
                }
            }
            kad::QueryResult::GetProviders(result) => {
                if let Some(lookup) = self.provider_lookups.get_mut(&id) {
                    match result {
                        Ok(kad::GetProvidersOk::FoundProviders { providers, .. }) => {
                            let new: HashSet<PeerId> = providers
                                .into_iter()
                                .filter(|p| lookup.seen.insert(*p))
                                .collect();
                            if !new.is_empty() {
                                let _ = lookup.found.send(new);
                            }
                        }
                        Ok(kad::GetProvidersOk::FinishedWithNoAdditionalRecord { .. }) => {}
                        Err(e) => tracing::debug!(error = %e, "get_providers ended"),
                    }
                    if step.last {
                        self.provider_lookups.remove(&id);
                    }
                }
            }
            kad::QueryResult::Bootstrap(result) => {
                if step.last {
                    if let Some(reply) = self.bootstraps.remove(&id) {
                        let result = match result {
                            Ok(_) if self.swarm.connected_peers().next().is_some() => Ok(()),
                            Ok(_) => Err(NetError::Dht("no bootstrap peer reachable".into())),
                            Err(e) => Err(NetError::Dht(format!("bootstrap: {e}"))),
                        };
                        let _ = reply.send(result);
                    }
                }
            }
            other => tracing::trace!(?other, "kademlia query progressed"),
        }
    }
}
