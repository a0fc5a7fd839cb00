//! Admission control across real processes: a node whose `--cache-tokens` holds two sessions refuses a third with
//! the typed cache-full error, the client routes it to a replica when one exists, and once a session ends a new one
//! is admitted again.
use petal_client::{ChainConfig, ChainSession, ClientError, SwarmClient, VerifyPolicy};
use petal_proto::pb::ErrorCode;
use petal_tests::*;
use std::time::Duration;

const MAX_LENGTH: usize = 32;

fn config() -> ChainConfig {
    ChainConfig {
        discovery_timeout: Duration::from_secs(5),
        failover_budget: Duration::ZERO,
        // Checking answers opens sessions on other servers, which would take the slots this test counts.
        verify: VerifyPolicy::Off,
        ..ChainConfig::default()
    }
}

#[test]
fn third_session_is_refused_then_served_by_a_replica_then_admitted_again() {
    let model = stories_bin();
    // 64 cache tokens = two sessions of 32 positions.
    let mut swarm = Swarm::builder()
        .node_with(&model, "0..5", &["--cache-tokens", "64"])
        .start();
    let model_id = swarm.nodes[0].model_id.clone();
    let bootstrap: petal_p2p::Multiaddr = swarm.bootstrap_addr.parse().expect("bootstrap address");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = SwarmClient::connect(vec![bootstrap.clone()])
            .await
            .expect("client");
        let a = ChainSession::open(&client, &model_id, 5, MAX_LENGTH, config())
            .await
            .expect("first session");
        let _b = ChainSession::open(&client, &model_id, 5, MAX_LENGTH, config())
            .await
            .expect("second session");
        match ChainSession::open(&client, &model_id, 5, MAX_LENGTH, config()).await {
            Err(ClientError::Server { code, message, .. }) => {
                assert_eq!(code, ErrorCode::CacheFull, "{message}");
                eprintln!("third session refused: {message}");
            }
            Err(other) => panic!("expected the typed cache-full error, got {other}"),
            Ok(_) => panic!("a third session fit into a cache sized for two"),
        }
        // Once a session ends, a new one is admitted (a fresh client: the first one banned the full server).
        a.close().await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let fresh = SwarmClient::connect(vec![bootstrap.clone()])
            .await
            .expect("client");
        let c = ChainSession::open(&fresh, &model_id, 5, MAX_LENGTH, config()).await;
        assert!(
            c.is_ok(),
            "after a close a new session must fit: {:?}",
            c.err()
        );
    });

    // With a replica, the refused session is served elsewhere instead.
    swarm.add_node(&model, "0..5", &["--cache-tokens", "64"]);
    rt.block_on(async {
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let with_retry = ChainConfig {
            failover_budget: Duration::from_secs(60),
            ..config()
        };
        let mut sessions = vec![];
        for i in 0..4 {
            let s = ChainSession::open(&client, &model_id, 5, MAX_LENGTH, with_retry.clone())
                .await
                .unwrap_or_else(|e| panic!("session {i} with a replica: {e}"));
            sessions.push(s);
        }
        let routes: Vec<String> = sessions.iter().map(|s| s.route().join(",")).collect();
        eprintln!("routes: {routes:?}");
        // Both servers hold two sessions each (stale sessions of the first client were freed on disconnect).
        let distinct: std::collections::HashSet<&String> = routes.iter().collect();
        assert!(
            distinct.len() >= 2,
            "the replica must take sessions the full server refused: {routes:?}"
        );
    });
}

/// One node of stories260K with room for two sessions of [`MAX_LENGTH`], evicting sessions idle for 1 s: the swarm,
/// its model id and its bootstrap address.
fn room_for_two() -> (Swarm, String, petal_p2p::Multiaddr) {
    let swarm = Swarm::builder()
        .node_with(
            stories_bin(),
            "0..5",
            &["--cache-tokens", "64", "--reclaim-idle", "1"],
        )
        .start();
    let model_id = swarm.nodes[0].model_id.clone();
    let bootstrap = swarm.bootstrap_addr.parse().expect("bootstrap address");
    (swarm, model_id, bootstrap)
}

/// A squatter fills the node's cache and keeps its sessions alive; a second peer still gets a session: the
/// squatter's least recently used idle session over its fair share is evicted, and its next step says so
/// (`EVICTED`, which a client answers by opening a new session elsewhere and replaying, not by banning).
#[test]
fn a_squatter_holding_its_maximum_never_blocks_a_second_peer() {
    let (_swarm, model_id, bootstrap) = room_for_two();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let squatter = SwarmClient::connect(vec![bootstrap.clone()])
            .await
            .expect("client");
        let mut held = vec![];
        for i in 0..2 {
            let s = ChainSession::open(&squatter, &model_id, 5, MAX_LENGTH, config())
                .await
                .unwrap_or_else(|e| panic!("squatter session {i}: {e}"));
            held.push(s);
        }
        match ChainSession::open(&squatter, &model_id, 5, MAX_LENGTH, config()).await {
            Err(ClientError::Server { code, .. }) => assert_eq!(code, ErrorCode::CacheFull),
            other => panic!("the squatter got more than the cache: {:?}", other.err()),
        }
        // Keep-alive: one of the squatter's sessions steps now and then; the other sits idle.
        let hidden = candle_core::Tensor::zeros(
            (1, 1, 64),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .expect("tensor");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        held[1].step(&hidden).await.expect("keep-alive step");
        let newcomer = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let mut theirs = ChainSession::open(&newcomer, &model_id, 5, MAX_LENGTH, config())
            .await
            .expect("a second peer gets a session while the squatter holds the cache");
        theirs.step(&hidden).await.expect("the second peer's step");
        // The idle one went, the busy one stayed.
        held[1]
            .step(&hidden)
            .await
            .expect("the recently used session stays");
        match held[0].step(&hidden).await {
            Err(e @ ClientError::Server { code, .. }) => {
                assert_eq!(code, ErrorCode::Evicted, "{e}");
                assert!(e.is_eviction());
            }
            other => panic!("expected EVICTED, got {:?}", other.map(|_| ())),
        }
    });
}

/// A session evicted while idle comes back by itself: its next step opens a new session (on the same server, once
/// there is room again), replays what it had sent, and answers as the uninterrupted session would, without the
/// server being banned.
#[test]
fn an_evicted_session_reopens_and_replays_without_banning_the_server() {
    let (_swarm, model_id, bootstrap) = room_for_two();
    let recovering = ChainConfig {
        failover_budget: Duration::from_secs(30),
        ..config()
    };
    let input = |tokens: usize, offset: usize| {
        let values: Vec<f32> = (0..tokens * 64)
            .map(|i| ((offset * 64 + i) as f32 * 0.37).sin())
            .collect();
        candle_core::Tensor::from_vec(values, (1, tokens, 64), &candle_core::Device::Cpu)
            .expect("tensor")
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let holder = SwarmClient::connect(vec![bootstrap.clone()])
            .await
            .expect("client");
        // Two sessions fed the same inputs: one will be evicted, the other is the reference.
        let mut evicted = ChainSession::open(&holder, &model_id, 5, MAX_LENGTH, recovering.clone())
            .await
            .expect("first session");
        let mut reference = ChainSession::open(&holder, &model_id, 5, MAX_LENGTH, recovering)
            .await
            .expect("second session");
        evicted.step(&input(3, 0)).await.expect("prefill");
        tokio::time::sleep(Duration::from_millis(1500)).await;
        reference.step(&input(3, 0)).await.expect("prefill");

        // Another peer takes the idle session's room, then leaves.
        let other = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let theirs = ChainSession::open(&other, &model_id, 5, MAX_LENGTH, config())
            .await
            .expect("the other peer gets a session");
        theirs.close().await;

        let (got, _) = evicted
            .step(&input(1, 3))
            .await
            .expect("step after eviction");
        let (want, _) = reference.step(&input(1, 3)).await.expect("reference step");
        let diff = (got - want)
            .expect("same shape")
            .abs()
            .and_then(|d| d.max_all())
            .and_then(|m| m.to_scalar::<f32>())
            .expect("difference");
        assert_eq!(diff, 0.0, "the replayed session answers differently");
        let failovers = evicted.failovers();
        assert_eq!(failovers.len(), 1, "{failovers:?}");
        assert_eq!(failovers[0].replayed_steps, 1, "{failovers:?}");
        assert!(
            failovers[0].reason.contains("evicted"),
            "{}",
            failovers[0].reason
        );
        assert!(holder.banned().is_empty(), "the server was banned");
    });
}
