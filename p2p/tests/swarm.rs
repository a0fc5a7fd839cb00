//! Real swarms on loopback: discovery through the DHT, withdrawal, expiry, inference streams.
//!
//! Every test is bounded by `tokio::time::timeout` so a networking bug fails instead of hanging. Set
//! `RUST_LOG=petal_p2p=debug` to see what the swarms do.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use futures::{AsyncReadExt, AsyncWriteExt, StreamExt};
use petal_p2p::{
    default_connection_limits, find_servers, model_key, now_unix_ms,
    records::{sign_record, verify_record},
    server_key,
    swarm_key::PreSharedKey,
    Announcer, Keypair, Multiaddr, NetConfig, NetError, Network, PeerId, HANDSHAKE_TIMEOUT,
};
use petal_proto::pb::ServerRecord;
use prost::Message;
use tokio::sync::watch;

/// Short TTL so expiry tests finish quickly.
const TTL: Duration = Duration::from_secs(3);
/// Bound on one test.
const TEST_LIMIT: Duration = Duration::from_secs(90);
/// Bound on one `find_servers` call.
const FIND_TIMEOUT: Duration = Duration::from_secs(3);

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
}

async fn bounded<F: Future<Output = ()>>(test: F) {
    init_tracing();
    tokio::time::timeout(TEST_LIMIT, test)
        .await
        .expect("test exceeded its time limit");
}

fn loopback_tcp() -> Multiaddr {
    "/ip4/127.0.0.1/tcp/0".parse().expect("multiaddr")
}

async fn start(dht_server: bool, listen: Vec<Multiaddr>, bootstrap: Vec<Multiaddr>) -> Network {
    let mut config = NetConfig::new(Keypair::generate_ed25519());
    config.dht_server = dht_server;
    config.listen = listen;
    config.bootstrap = bootstrap;
    config.record_ttl = TTL;
    Network::start(config).await.expect("network starts")
}

async fn first_addr(net: &Network) -> Multiaddr {
    net.listen_addrs()
        .await
        .into_iter()
        .next()
        .expect("listening")
}

/// A bootstrap node and its address.
async fn bootstrap_node() -> (Network, Multiaddr) {
    let net = start(true, vec![loopback_tcp()], vec![]).await;
    let addr = first_addr(&net).await;
    (net, addr)
}

async fn server(bootstrap: &Multiaddr) -> Network {
    start(true, vec![loopback_tcp()], vec![bootstrap.clone()]).await
}

/// A DHT server joining through `bootstrap` with `key`, for tests that sign records with it.
async fn server_with_key(bootstrap: &Multiaddr, key: Keypair) -> Network {
    let mut config = NetConfig::new(key);
    config.dht_server = true;
    config.listen = vec![loopback_tcp()];
    config.bootstrap = vec![bootstrap.clone()];
    config.record_ttl = TTL;
    Network::start(config).await.expect("network starts")
}

async fn client(bootstrap: &Multiaddr) -> Network {
    start(false, vec![], vec![bootstrap.clone()]).await
}

fn record(model_id: &str, start_block: u32, end_block: u32) -> ServerRecord {
    ServerRecord {
        model_id: model_id.to_string(),
        model_name: "test-model".to_string(),
        num_blocks: 8,
        start_block,
        end_block,
        cache_tokens_free: 1000,
        cache_tokens_total: 1000,
        ..Default::default()
    }
}

fn peers_of(records: &[ServerRecord]) -> Vec<String> {
    let mut peers: Vec<String> = records.iter().map(|r| r.peer_id.clone()).collect();
    peers.sort();
    peers
}

fn sorted(peers: &[&Network]) -> Vec<String> {
    let mut ids: Vec<String> = peers.iter().map(|n| n.peer_id().to_string()).collect();
    ids.sort();
    ids
}

/// Polls `find_servers` until `done` holds for its result, failing after `limit`. Returns the result and how
/// long it took.
async fn find_until(
    net: &Network,
    model_id: Option<&str>,
    limit: Duration,
    done: impl Fn(&[ServerRecord]) -> bool,
) -> (Vec<ServerRecord>, Duration) {
    let started = Instant::now();
    loop {
        let found = find_servers(net, model_id, FIND_TIMEOUT)
            .await
            .expect("find_servers");
        if done(&found) {
            return (found, started.elapsed());
        }
        assert!(
            started.elapsed() < limit,
            "condition not reached after {:?}; last result: {:?}",
            limit,
            peers_of(&found)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_are_discovered_by_model() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let s1 = server(&boot_addr).await;
        let s2 = server(&boot_addr).await;
        let other = server(&boot_addr).await;
        let client = client(&boot_addr).await;

        let (_tx1, rx1) = watch::channel(record("model-a", 0, 4));
        let (_tx2, rx2) = watch::channel(record("model-a", 4, 8));
        let (_tx3, rx3) = watch::channel(record("model-b", 0, 8));
        let _a1 = Announcer::spawn(s1.clone(), rx1, TTL);
        let _a2 = Announcer::spawn(s2.clone(), rx2, TTL);
        let _a3 = Announcer::spawn(other.clone(), rx3, TTL);

        let want = sorted(&[&s1, &s2]);
        let (found, took) =
            find_until(&client, Some("model-a"), Duration::from_secs(15), |found| {
                peers_of(found) == want
            })
            .await;
        tracing::info!(?took, "both model-a servers discovered");
        assert!(took < Duration::from_secs(10), "discovery took {took:?}");
        // Sorted by start block, stamped by the announcer.
        assert_eq!(found[0].start_block, 0);
        assert_eq!(found[1].start_block, 4);
        for r in &found {
            assert_eq!(r.model_id, "model-a");
            assert_eq!(r.ttl_ms, 3000);
            assert!(!r.withdrawn);
            assert!(!r.addrs.is_empty(), "announcer fills the listen addresses");
            assert_eq!(r.record_version, petal_proto::RECORD_VERSION);
        }

        let all = sorted(&[&s1, &s2, &other]);
        let (everyone, _) = find_until(&client, None, Duration::from_secs(15), |found| {
            peers_of(found) == all
        })
        .await;
        assert_eq!(everyone.len(), 3);

        let (only_b, _) = find_until(&client, Some("model-b"), Duration::from_secs(15), |found| {
            !found.is_empty()
        })
        .await;
        assert_eq!(peers_of(&only_b), vec![other.peer_id().to_string()]);

        // Records are refreshed: a later lookup sees a newer stamp than the first one.
        let first_stamp = found[0].updated_unix_ms;
        let (_, _) = find_until(&client, Some("model-a"), Duration::from_secs(10), |found| {
            found
                .iter()
                .any(|r| r.peer_id == s1.peer_id().to_string() && r.updated_unix_ms > first_stamp)
                || found.iter().any(|r| {
                    r.peer_id == s2.peer_id().to_string() && r.updated_unix_ms > first_stamp
                })
        })
        .await;

        for net in [&client, &s1, &s2, &other, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_changes_are_republished() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let s1 = server(&boot_addr).await;
        let client = client(&boot_addr).await;
        // A long TTL: only the change trigger, not the periodic refresh, can publish the new value in time.
        let ttl = Duration::from_secs(60);
        let (tx, rx) = watch::channel(record("model-c", 0, 8));
        let _announcer = Announcer::spawn(s1.clone(), rx, ttl);
        find_until(&client, Some("model-c"), Duration::from_secs(15), |f| {
            f.len() == 1
        })
        .await;

        tx.send_modify(|r| r.cache_tokens_free = 123);
        let (found, took) = find_until(&client, Some("model-c"), Duration::from_secs(15), |f| {
            f.first().is_some_and(|r| r.cache_tokens_free == 123)
        })
        .await;
        tracing::info!(?took, "change published");
        assert_eq!(found[0].ttl_ms, 60_000);

        for net in [&client, &s1, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawn_server_disappears() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let s1 = server(&boot_addr).await;
        let s2 = server(&boot_addr).await;
        let client = client(&boot_addr).await;
        // Long TTL: the server must vanish because of the withdrawal, not because its record expired.
        let ttl = Duration::from_secs(60);
        let (_tx1, rx1) = watch::channel(record("model-w", 0, 4));
        let (_tx2, rx2) = watch::channel(record("model-w", 4, 8));
        let a1 = Announcer::spawn(s1.clone(), rx1, ttl);
        let _a2 = Announcer::spawn(s2.clone(), rx2, ttl);

        let want = sorted(&[&s1, &s2]);
        find_until(&client, Some("model-w"), Duration::from_secs(15), |f| {
            peers_of(f) == want
        })
        .await;

        a1.withdraw().await.expect("withdraw");
        assert!(matches!(a1.withdraw().await, Err(NetError::Closed)));
        let only_s2 = vec![s2.peer_id().to_string()];
        let (_, took) = find_until(&client, Some("model-w"), Duration::from_secs(10), |f| {
            peers_of(f) == only_s2
        })
        .await;
        tracing::info!(?took, "withdrawn server gone");
        assert!(
            took < Duration::from_secs(5),
            "withdrawal took {took:?} to show"
        );
        // Also gone from the all-servers listing.
        let (all, _) = find_until(&client, None, Duration::from_secs(10), |f| {
            peers_of(f) == only_s2
        })
        .await;
        assert_eq!(all.len(), 1);

        for net in [&client, &s1, &s2, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_server_expires_after_ttl() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let s1 = server(&boot_addr).await;
        let s2 = server(&boot_addr).await;
        let client = client(&boot_addr).await;
        let (_tx1, rx1) = watch::channel(record("model-k", 0, 4));
        let (_tx2, rx2) = watch::channel(record("model-k", 4, 8));
        let a1 = Announcer::spawn(s1.clone(), rx1, TTL);
        let _a2 = Announcer::spawn(s2.clone(), rx2, TTL);

        let want = sorted(&[&s1, &s2]);
        find_until(&client, Some("model-k"), Duration::from_secs(15), |f| {
            peers_of(f) == want
        })
        .await;

        // Simulate SIGKILL: the network vanishes without withdrawing.
        s1.shutdown().await;
        let killed = Instant::now();
        assert!(s1.connected_peers().await.is_empty());
        assert!(matches!(s1.bootstrap().await, Err(NetError::Closed)));
        let only_s2 = vec![s2.peer_id().to_string()];
        let (_, _) = find_until(&client, Some("model-k"), TTL * 4, |f| {
            peers_of(f) == only_s2
        })
        .await;
        let took = killed.elapsed();
        tracing::info!(?took, "killed server expired");
        // Gone within one TTL of its last refresh (plus one find_servers round and polling slack).
        assert!(
            took <= TTL + FIND_TIMEOUT + Duration::from_secs(1),
            "expiry took {took:?}"
        );
        // The announcer notices its network is gone and stops.
        tokio::time::sleep(TTL).await;
        assert!(a1.is_finished());

        for net in [&client, &s2, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

/// Records forged by another peer change nothing: one signed by Mallory in an honest server's name (withdrawn,
/// or with another span), the old unsigned layout, and Mallory's own record stamped far in the future. Readers
/// skip them even when Mallory's own store answers with them, and other stores never keep them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_have_no_effect() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let honest = server(&boot_addr).await;
        let (_keep, source) = watch::channel(record("m", 0, 4));
        let announcer = Announcer::spawn(honest.clone(), source, TTL);
        assert!(announcer.first_published(Duration::from_secs(10)).await);

        let mallory_key = Keypair::generate_ed25519();
        let mallory = server_with_key(&boot_addr, mallory_key.clone()).await;
        mallory.bootstrap().await.expect("mallory joins");
        let target = honest.peer_id();
        let later = now_unix_ms() + 1_000;
        let claim = |r: ServerRecord| ServerRecord {
            peer_id: target.to_string(),
            updated_unix_ms: later,
            ttl_ms: 3_600_000,
            ..r
        };
        let sign = |r: &ServerRecord| sign_record(&mallory_key, r).expect("sign");
        let forgeries = [
            sign(&ServerRecord {
                withdrawn: true,
                ..claim(record("m", 0, 4))
            }),
            sign(&claim(record("m", 4, 8))),
            ServerRecord {
                withdrawn: true,
                ..claim(record("m", 0, 4))
            }
            .encode_to_vec(),
        ];
        for value in forgeries {
            let _ = mallory.put_record(server_key(&target), value, TTL).await;
        }
        let own = ServerRecord {
            peer_id: mallory.peer_id().to_string(),
            updated_unix_ms: u64::MAX / 2,
            ttl_ms: u64::MAX / 4,
            ..record("m", 0, 8)
        };
        let mallory_key_bytes = server_key(&mallory.peer_id());
        let _ = mallory
            .put_record(mallory_key_bytes.clone(), sign(&own), TTL)
            .await;
        let _ = mallory.start_providing(model_key("m")).await;

        let c = client(&boot_addr).await;
        c.bootstrap().await.expect("client joins");
        for _ in 0..5 {
            let found = find_servers(&c, Some("m"), FIND_TIMEOUT)
                .await
                .expect("find_servers");
            assert_eq!(peers_of(&found), vec![target.to_string()]);
            let r = &found[0];
            assert_eq!((r.start_block, r.end_block, r.withdrawn), (0, 4, false));
            assert!(r.updated_unix_ms < later);
        }

        // With Mallory gone, what the other stores hold is all genuine, and its future-stamped record is nowhere.
        mallory.shutdown().await;
        let values = c
            .get_records(server_key(&target), FIND_TIMEOUT)
            .await
            .expect("lookup");
        assert!(!values.is_empty());
        for value in &values {
            verify_record(&server_key(&target), value, now_unix_ms())
                .expect("stores keep only the server's own signed record");
        }
        let values = c
            .get_records(mallory_key_bytes, FIND_TIMEOUT)
            .await
            .expect("lookup");
        assert!(values.is_empty(), "a store kept a future-stamped record");
        for net in [&c, &honest, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

/// A private swarm: peers holding its key find each other; a peer with another key, or none, can neither join
/// through its bootstrap node nor be listed, nor open a stream to its servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn swarm_key_keeps_outsiders_out() {
    bounded(async {
        let key = PreSharedKey::new([7; 32]);
        let other = PreSharedKey::new([8; 32]);
        let peer =
            |swarm_key: Option<PreSharedKey>, dht_server: bool, bootstrap: Vec<Multiaddr>| {
                let mut config = NetConfig::new(Keypair::generate_ed25519());
                config.dht_server = dht_server;
                // QUIC is asked for and dropped: pnet cannot protect it.
                config.listen = vec![
                    loopback_tcp(),
                    "/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("quic"),
                ];
                config.bootstrap = bootstrap;
                config.record_ttl = TTL;
                config.swarm_key = swarm_key;
                Network::start(config)
            };
        let boot = peer(Some(key), true, vec![]).await.expect("bootstrap");
        let boot_addr = first_addr(&boot).await;
        assert!(boot
            .listen_addrs()
            .await
            .iter()
            .all(|a| !a.to_string().contains("quic")));
        let insider = peer(Some(key), true, vec![boot_addr.clone()])
            .await
            .expect("insider");
        let (_keep, source) = watch::channel(record("m", 0, 8));
        let announcer = Announcer::spawn(insider.clone(), source, TTL);
        assert!(announcer.first_published(Duration::from_secs(10)).await);
        for (name, swarm_key) in [("another key", Some(other)), ("no key", None)] {
            let outsider = peer(swarm_key, true, vec![boot_addr.clone()])
                .await
                .expect("outsider");
            let asked = Instant::now();
            assert!(
                outsider.bootstrap().await.is_err(),
                "{name}: joined the DHT"
            );
            // One refused handshake is all it waits for: not one more per bucket refresh (the maintenance tick
            // re-adds the bootstrap peer to the routing table), which took a CLI past its caller's deadline.
            let waited = asked.elapsed();
            assert!(
                waited < HANDSHAKE_TIMEOUT + HANDSHAKE_TIMEOUT / 2,
                "{name}: bootstrap took {waited:?}"
            );
            let (_keep, source) = watch::channel(record("m", 0, 8));
            let _announcer = Announcer::spawn(outsider.clone(), source, TTL);
            outsider
                .add_addresses(insider.peer_id(), insider.listen_addrs().await)
                .await;
            assert!(
                outsider.open_stream(insider.peer_id()).await.is_err(),
                "{name}: opened a stream"
            );
            let c = peer(Some(key), false, vec![boot_addr.clone()])
                .await
                .expect("client");
            c.bootstrap().await.expect("client joins");
            let (found, _) =
                find_until(&c, Some("m"), Duration::from_secs(10), |f| !f.is_empty()).await;
            assert_eq!(
                peers_of(&found),
                vec![insider.peer_id().to_string()],
                "{name}"
            );
            c.shutdown().await;
            outsider.shutdown().await;
        }
        insider.shutdown().await;
        boot.shutdown().await;
    })
    .await;
}

/// Client writes a request, server answers; both directions carry data on one stream.
async fn exchange(server: &Network, client: &Network, server_addrs: Vec<Multiaddr>) {
    let mut incoming = server.accept_streams().expect("accept");
    // Only one acceptor at a time.
    assert!(matches!(
        server.accept_streams(),
        Err(NetError::Stream { .. })
    ));
    let client_id = client.peer_id();
    let server_task = tokio::spawn(async move {
        let (peer, mut stream) = incoming.next().await.expect("an inbound stream");
        assert_eq!(peer, client_id);
        let mut request = [0u8; 5];
        stream.read_exact(&mut request).await.expect("read request");
        assert_eq!(&request, b"hello");
        let reply: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        stream.write_all(&reply).await.expect("write reply");
        stream.close().await.expect("close");
    });

    client.add_addresses(server.peer_id(), server_addrs).await;
    let mut stream = client
        .open_stream(server.peer_id())
        .await
        .expect("open_stream");
    stream.write_all(b"hello").await.expect("write");
    stream.flush().await.expect("flush");
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply).await.expect("read reply");
    assert_eq!(reply.len(), 100_000);
    assert!(reply.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
    server_task.await.expect("server side");

    assert!(client.connected_peers().await.contains(&server.peer_id()));
    // Ping runs as soon as the connection is up.
    let deadline = Instant::now() + Duration::from_secs(5);
    while client.rtt(server.peer_id()).await.is_none() {
        assert!(Instant::now() < deadline, "no ping RTT");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_stream_over_tcp() {
    bounded(async {
        let server = start(true, vec![loopback_tcp()], vec![]).await;
        let client = start(false, vec![], vec![]).await;
        let addrs = server.listen_addrs().await;
        assert!(addrs.iter().all(|a| !a.to_string().contains("/tcp/0/")));
        assert!(addrs.iter().all(|a| a
            .to_string()
            .ends_with(&format!("/p2p/{}", server.peer_id()))));
        exchange(&server, &client, addrs).await;
        client.shutdown().await;
        server.shutdown().await;
    })
    .await;
}

/// Streams opened all at once while the acceptor is busy wait in its backlog: none is reset. (libp2p-stream's
/// rendezvous channel dropped every stream that arrived while the previous one was being handed over, which broke
/// concurrent sessions.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_opened_at_once_all_reach_a_busy_acceptor() {
    const STREAMS: usize = 48;
    bounded(async {
        let server = start(true, vec![loopback_tcp()], vec![]).await;
        let client = start(false, vec![], vec![]).await;
        client
            .add_addresses(server.peer_id(), server.listen_addrs().await)
            .await;
        let mut incoming = server.accept_streams().expect("accept");
        // Every stream is opened and written to before the acceptor is polled even once.
        let opens = (0..STREAMS).map(|i| {
            let client = client.clone();
            let peer = server.peer_id();
            async move {
                let mut stream = client.open_stream(peer).await.expect("open_stream");
                stream.write_all(&[i as u8]).await.expect("write");
                stream.flush().await.expect("flush");
                stream
            }
        });
        let mut streams = futures::future::join_all(opens).await;
        let mut seen = vec![];
        for _ in 0..STREAMS {
            let (_, mut stream) = incoming.next().await.expect("an inbound stream");
            let mut byte = [0u8; 1];
            stream.read_exact(&mut byte).await.expect("read");
            stream.write_all(&byte).await.expect("echo");
            stream.close().await.expect("close");
            seen.push(byte[0] as usize);
        }
        seen.sort();
        assert_eq!(seen, (0..STREAMS).collect::<Vec<_>>());
        for (i, stream) in streams.iter_mut().enumerate() {
            let mut reply = vec![];
            stream.read_to_end(&mut reply).await.expect("read echo");
            assert_eq!(reply, [i as u8]);
        }
        client.shutdown().await;
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_stream_over_quic() {
    bounded(async {
        let quic: Multiaddr = "/ip4/127.0.0.1/udp/0/quic-v1".parse().expect("multiaddr");
        let server = start(true, vec![quic], vec![]).await;
        let client = start(false, vec![], vec![]).await;
        let addrs = server.listen_addrs().await;
        assert!(addrs.iter().all(|a| a.to_string().contains("/quic-v1/")));
        exchange(&server, &client, addrs).await;
        client.shutdown().await;
        server.shutdown().await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_to_unknown_or_unwilling_peer_fails_cleanly() {
    bounded(async {
        let server = start(true, vec![loopback_tcp()], vec![]).await;
        let client = start(false, vec![], vec![]).await;
        // No address known.
        let err = client
            .open_stream(PeerId::random())
            .await
            .expect_err("unknown peer");
        assert!(matches!(err, NetError::Stream { .. }), "{err}");
        // Reachable, but not accepting inference streams.
        client
            .add_addresses(server.peer_id(), server.listen_addrs().await)
            .await;
        let err = client
            .open_stream(server.peer_id())
            .await
            .expect_err("not accepting");
        assert!(matches!(err, NetError::Stream { .. }), "{err}");
        assert!(err.to_string().contains("/petal/inference/1"), "{err}");
        client.shutdown().await;
        server.shutdown().await;
        // Shut down: every call reports it.
        assert!(matches!(
            client.open_stream(server.peer_id()).await,
            Err(NetError::Closed)
        ));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_node_stores_locally() {
    bounded(async {
        let net = start(true, vec![loopback_tcp()], vec![]).await;
        net.bootstrap().await.expect("no bootstrap peers is fine");
        net.put_record(b"k".to_vec(), b"v".to_vec(), TTL)
            .await
            .expect("put alone");
        let values = net
            .get_records(b"k".to_vec(), Duration::from_secs(2))
            .await
            .expect("get");
        assert_eq!(values, vec![b"v".to_vec()]);
        assert!(net
            .get_records(b"missing".to_vec(), Duration::from_secs(2))
            .await
            .expect("get")
            .is_empty());

        net.start_providing(b"p".to_vec())
            .await
            .expect("provide alone");
        let providers = net
            .get_providers(b"p".to_vec(), Duration::from_secs(2))
            .await
            .expect("providers");
        assert!(providers.contains(&net.peer_id()));
        net.stop_providing(b"p".to_vec()).await;
        let providers = net
            .get_providers(b"p".to_vec(), Duration::from_secs(2))
            .await
            .expect("providers");
        assert!(providers.is_empty());

        // The local copy expires with its TTL too.
        net.put_record(b"short".to_vec(), b"v".to_vec(), Duration::from_millis(300))
            .await
            .expect("put");
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(net
            .get_records(b"short".to_vec(), Duration::from_secs(1))
            .await
            .expect("get")
            .is_empty());
        net.shutdown().await;
    })
    .await;
}

/// A server's record, put by the server, is read by a client through another peer's store. The record is a real
/// one (signed by the server, under its key): stores keep nothing else, so the arbitrary value this test used to
/// put was held by the putting server alone, and found only if the client's lookup happened to reach that server
/// (once in CI it did not: the lookup found nothing, most likely because the client learned of no peer but the
/// bootstrap node, whose store had refused the value).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_travel_between_peers() {
    bounded(async {
        let (boot, boot_addr) = bootstrap_node().await;
        let a_key = Keypair::generate_ed25519();
        let a = server_with_key(&boot_addr, a_key.clone()).await;
        let c = client(&boot_addr).await;
        a.bootstrap().await.expect("bootstrap");
        c.bootstrap().await.expect("bootstrap");
        let own = ServerRecord {
            peer_id: a.peer_id().to_string(),
            updated_unix_ms: now_unix_ms(),
            ttl_ms: 60_000,
            ..record("m", 0, 4)
        };
        let value = sign_record(&a_key, &own).expect("sign");
        a.put_record(server_key(&a.peer_id()), value.clone(), TTL)
            .await
            .expect("put with peers");
        let values = c
            .get_records(server_key(&a.peer_id()), Duration::from_secs(5))
            .await
            .expect("get");
        assert_eq!(values, vec![value]);
        for net in [&c, &a, &boot] {
            net.shutdown().await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bootstrap_address_is_rejected() {
    bounded(async {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.bootstrap = vec!["/ip4/127.0.0.1/tcp/4001".parse().expect("multiaddr")];
        let err = Network::start(config).await.expect_err("no /p2p suffix");
        assert!(matches!(err, NetError::BadBootstrap(_)), "{err}");
        assert!(err.to_string().contains("/p2p/"), "{err}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_conflict_is_reported() {
    bounded(async {
        let first = start(true, vec![loopback_tcp()], vec![]).await;
        let taken = first_addr(&first).await;
        // Same port, without the /p2p suffix.
        let mut taken_plain = taken.clone();
        taken_plain.pop();
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.listen = vec![taken_plain];
        let err = Network::start(config).await.expect_err("port in use");
        assert!(matches!(err, NetError::Listen { .. }), "{err}");
        first.shutdown().await;
    })
    .await;
}

/// A server taking at most two inbound connections refuses a third peer's, however it retries, and takes it once one
/// of the first two has gone: connections beyond the limits never reach a protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_limit_are_refused() {
    bounded(async {
        let mut config = NetConfig::new(Keypair::generate_ed25519());
        config.dht_server = true;
        config.listen = vec![loopback_tcp()];
        config.connection_limits =
            default_connection_limits().with_max_established_incoming(Some(2));
        let server = Network::start(config).await.expect("server");
        let _incoming = server.accept_streams().expect("accept");
        let addr = first_addr(&server).await;
        let peer = server.peer_id();
        let mut clients = vec![];
        for _ in 0..3 {
            let client = start(false, vec![], vec![]).await;
            client.add_addresses(peer, vec![addr.clone()]).await;
            clients.push(client);
        }
        for client in &clients[..2] {
            client
                .open_stream(peer)
                .await
                .expect("one of the first two");
        }
        let third = clients[2].open_stream(peer).await;
        assert!(third.is_err(), "a third inbound connection was accepted");
        // The refused connection may still be closing on the third client's side when its open fails, and a
        // retry would be answered by it; the client chain closes a connection seen failing before it dials
        // again, and so does this test.
        clients[2].disconnect(peer, Duration::from_secs(5)).await;
        assert!(!clients[2].connected_peers().await.contains(&peer));
        let connected = server.connected_peers().await;
        assert!(!connected.contains(&clients[2].peer_id()), "{connected:?}");
        assert_eq!(connected.len(), 2, "{connected:?}");

        clients[0].shutdown().await;
        let gone = clients[0].peer_id();
        while server.connected_peers().await.contains(&gone) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        clients[2]
            .open_stream(peer)
            .await
            .expect("a slot came free");
    })
    .await;
}
