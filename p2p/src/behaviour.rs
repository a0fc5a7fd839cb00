//! The composed libp2p behaviour: Kademlia (records + providers), identify (learn peers' listen addresses and
//! protocols), ping (liveness and RTT for server selection), [`crate::streams`] (raw inference streams), and what makes
//! peers behind NAT reachable ([`crate::reachability`]): AutoNAT, the circuit-relay client and server, and DCUtR.

use std::time::Duration;

use libp2p::{
    autonat, connection_limits, dcutr, identify,
    identity::Keypair,
    kad::{self, store::MemoryStore, store::MemoryStoreConfig},
    ping, relay,
    swarm::{behaviour::toggle::Toggle, NetworkBehaviour},
    StreamProtocol,
};

use crate::{reachability::RelayLimits, streams, NetConfig};

/// Kademlia protocol name. Distinct from the IPFS DHT so a Petal node never joins (or pollutes) the public one.
pub const KAD_PROTOCOL: StreamProtocol = StreamProtocol::new("/petal/kad/1.0.0");
/// Identify protocol version string; peers with another one are still identified but logged.
pub const IDENTIFY_PROTOCOL_VERSION: &str = "/petal/id/1.0.0";
/// Upper bound for one Kademlia query. Queries on a healthy swarm end far sooner; this only caps a query
/// stuck on unreachable peers.
pub const QUERY_TIMEOUT: Duration = Duration::from_secs(30);

/// Every behaviour of a Petal peer. The derive generates `PetalBehaviourEvent` with one variant per field.
#[derive(NetworkBehaviour)]
pub struct PetalBehaviour {
    pub kad: kad::Behaviour<MemoryStore>,
    pub identify: identify::Behaviour,
    pub ping: ping::Behaviour,
    pub stream: streams::Behaviour,
    /// Listening and dialing through relays (`/p2p-circuit` addresses).
    pub relay_client: relay::client::Behaviour,
    /// Relaying for peers behind NAT: on unless `--no-relay`.
    pub relay_server: Toggle<relay::Behaviour>,
    /// Upgrades relayed connections to direct ones (hole punching).
    pub dcutr: dcutr::Behaviour,
    /// Learns whether this node is reachable (servers only: a client never needs to be dialed).
    pub autonat: Toggle<autonat::Behaviour>,
    /// Refuses connections beyond [`NetConfig::connection_limits`].
    pub limits: connection_limits::Behaviour,
}

impl PetalBehaviour {
    /// Builds the behaviour for `keypair` with the DHT timings derived from `config.record_ttl`; `relay_client`
    /// comes from the transport builder, which pairs it with the relay transport.
    pub fn new(
        keypair: &Keypair,
        relay_client: relay::client::Behaviour,
        config: &NetConfig,
    ) -> Self {
        let peer_id = keypair.public().to_peer_id();
        let ttl = config.record_ttl.max(Duration::from_millis(300));

        let mut kad_config = kad::Config::new(KAD_PROTOCOL);
        kad_config
            // Records and provider records vanish from every store `ttl` after their last refresh, so a node that
            // was killed without withdrawing disappears on its own.
            .set_record_ttl(Some(ttl))
            .set_provider_record_ttl(Some(ttl))
            // No background replication or republication of value records: publishers (the `Announcer`) re-put
            // their record every ttl/3 instead. Kademlia's replication would resurrect dead records: it sends the
            // remaining TTL in whole seconds, a record with under a second left goes out as TTL 0 ("no expiry"),
            // and the receiver stores it for a full `record_ttl` again, so a killed server could live on forever.
            .set_replication_interval(None)
            .set_publication_interval(None)
            // Provider records are only ever republished by the provider itself, so that job is safe and keeps
            // `start_providing` meaning "until stop_providing" across the (short) provider TTL.
            .set_provider_publication_interval(Some(ttl / 3))
            .set_query_timeout(QUERY_TIMEOUT)
            // Provider answers for the "all servers" key list every server; the 16 KiB default is too small.
            .set_max_packet_size(1024 * 1024)
            // Write-back caching would copy records to peers without renewing them; we never use it.
            .set_caching(kad::Caching::Disabled)
            // Inbound puts go through `actor::dht_store`, which keeps only signed server records and a quota of
            // provider records per peer.
            .set_record_filtering(kad::StoreInserts::FilterBoth);

        let store_config = MemoryStoreConfig {
            max_records: 16 * 1024,
            max_value_bytes: crate::records::MAX_RECORD_BYTES,
            // Every server provides the same two keys; the default (20, the replication factor) would make the
            // closest peers forget all but 20 servers of a model.
            max_providers_per_key: 1024,
            max_provided_keys: 1024,
        };
        let store = MemoryStore::with_config(peer_id, store_config);
        let mut kad = kad::Behaviour::with_config(peer_id, store, kad_config);
        kad.set_mode(Some(if config.dht_server {
            kad::Mode::Server
        } else {
            kad::Mode::Client
        }));

        let identify = identify::Behaviour::new(
            identify::Config::new(IDENTIFY_PROTOCOL_VERSION.to_string(), keypair.public())
                .with_agent_version(format!("petal/{}", env!("CARGO_PKG_VERSION"))),
        );

        let ping = ping::Behaviour::new(ping::Config::new().with_interval(Duration::from_secs(10)));

        PetalBehaviour {
            kad,
            identify,
            ping,
            stream: streams::Behaviour::new(crate::network::inference_protocol()),
            relay_client,
            relay_server: Toggle::from(
                config
                    .relay
                    .as_ref()
                    .map(|limits| relay::Behaviour::new(peer_id, relay_config(limits))),
            ),
            dcutr: dcutr::Behaviour::new(peer_id),
            autonat: Toggle::from(
                config
                    .dht_server
                    .then(|| autonat::Behaviour::new(peer_id, autonat_config())),
            ),
            limits: connection_limits::Behaviour::new(config.connection_limits.clone()),
        }
    }
}

/// The relay server's limits, with per-peer rate limits loose enough for a client that opens a session per hop
/// and retries (libp2p's defaults allow one circuit per peer every two minutes).
fn relay_config(limits: &RelayLimits) -> relay::Config {
    let per_minute = |n: u32| std::num::NonZeroU32::new(n).unwrap_or(std::num::NonZeroU32::MIN);
    relay::Config {
        max_reservations: limits.max_reservations,
        max_reservations_per_peer: 4,
        reservation_duration: Duration::from_secs(60 * 60),
        reservation_rate_limiters: vec![],
        max_circuits: limits.max_circuits,
        max_circuits_per_peer: limits.max_circuits_per_peer,
        max_circuit_duration: limits.max_circuit_duration,
        max_circuit_bytes: limits.max_circuit_bytes,
        circuit_src_rate_limiters: vec![],
    }
    .reservation_rate_per_peer(per_minute(30), Duration::from_secs(60))
    .circuit_src_per_peer(per_minute(120), Duration::from_secs(60))
}

/// How long an AutoNAT probe waits for the server's answer: longer than the server's dial-back can take. It dials
/// our addresses one at a time (libp2p's AutoNAT v1), and behind a NAT that drops unsolicited packets (most do)
/// each attempt runs until its transport gives up: `network::HANDSHAKE_TIMEOUT` for
/// TCP, 5 s for QUIC, over three or four addresses. A probe that gave up first learned nothing, and the next one
/// found that dial-back still running and was refused: with 10 s here a node behind such a NAT could go on
/// probing for minutes without ever concluding that it is private (seen in `scripts/test-nat`).
const AUTONAT_TIMEOUT: Duration = Duration::from_secs(60);

/// AutoNAT probing: the first probe soon after start (a node wants to know before it announces for long), then
/// every 10 s until two answers agree, then every 5 minutes. Private addresses count: swarms on a LAN or in
/// containers are real swarms, and a peer that dials us back on a private address did reach us.
fn autonat_config() -> autonat::Config {
    autonat::Config {
        timeout: AUTONAT_TIMEOUT,
        boot_delay: Duration::from_secs(1),
        retry_interval: Duration::from_secs(10),
        refresh_interval: Duration::from_secs(5 * 60),
        throttle_server_period: Duration::from_secs(5),
        confidence_max: 2,
        only_global_ips: false,
        ..autonat::Config::default()
    }
}
