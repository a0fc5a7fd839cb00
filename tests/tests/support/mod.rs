//! Hostile peers for the trust tests: real libp2p peers in the test process (`petal_p2p::Network` and
//! `Announcer`, as a node uses them) that announce what they like.
use petal_p2p::{Announcer, AnnouncerHandle, Keypair, Multiaddr, NetConfig, Network};
use petal_proto::pb::ServerRecord;
use petal_tests::*;
use std::time::Duration;

const RECORD_TTL: Duration = Duration::from_secs(60);

/// A peer in the swarm announcing that it serves every block of the swarm's model, with the right block hashes,
/// at `addrs` (its own listen addresses when empty).
pub async fn impostor(swarm: &Swarm, name: &str, addrs: Vec<String>) -> (Network, AnnouncerHandle) {
    let node = &swarm.nodes[0];
    let mut config = NetConfig::new(Keypair::generate_ed25519());
    config.listen = vec!["/ip4/127.0.0.1/tcp/0".parse().expect("listen address")];
    config.bootstrap = vec![swarm
        .bootstrap_addr
        .parse::<Multiaddr>()
        .expect("bootstrap address")];
    config.dht_server = true;
    config.record_ttl = RECORD_TTL;
    let net = Network::start(config).await.expect("impostor network");
    net.bootstrap().await.expect("impostor joins the DHT");
    // The true block hashes: they are public (any honest record carries them), so an impostor copies them.
    let block_hashes = petal_model::ModelSource::open(stories_bin())
        .and_then(|m| m.manifest())
        .expect("block hashes")
        .to_vec();
    let record = ServerRecord {
        model_id: node.model_id.clone(),
        block_hashes,
        num_blocks: 5,
        start_block: 0,
        end_block: 5,
        public_name: name.into(),
        addrs,
        throughput_tokens_per_sec: 1e6,
        cache_tokens_free: 1 << 20,
        cache_tokens_total: 1 << 20,
        ..Default::default()
    };
    let (_keep, source) = tokio::sync::watch::channel(record);
    let announcer = Announcer::spawn(net.clone(), source, RECORD_TTL);
    assert!(
        announcer.first_published(Duration::from_secs(10)).await,
        "{name}: record not published"
    );
    (net, announcer)
}

/// Waits until the client-facing listing shows `peer`.
pub fn wait_listed(swarm: &Swarm, peer: &str) {
    let listed = poll_until(Duration::from_secs(20), Duration::from_millis(200), || {
        swarm.listed_peers().iter().any(|p| p == peer)
    });
    assert!(listed.is_some(), "{peer} never listed\n{}", swarm.report());
}
