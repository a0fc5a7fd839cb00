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
