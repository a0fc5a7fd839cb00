//! A broken connection to the only server of some blocks is not a failure: the chain reconnects to the same
//! server, replays what it had sent, and carries on with exactly the outputs of an undisturbed run. (Relay circuits
//! that end, NAT mappings that expire and network blips all look like this to the client.)
use petal_client::{ChainConfig, ChainSession, Failover, SwarmClient};
use petal_model::{Head, ModelSource, Placement};
use petal_tests::*;
use std::time::Duration;

/// Token ids sent one step each; the connection is cut before step `CUT`.
const IDS: [u32; 12] = [
    1, 365, 1099, 264, 931, 29892, 727, 471, 263, 2217, 7826, 29889,
];
const CUT: usize = 5;

#[test]
fn broken_connection_reconnects_to_the_same_server_and_replays() {
    let model = stories_bin();
    let swarm = Swarm::builder().node(&model, "0..5").start();
    let server = swarm.nodes[0].peer_id.clone();
    let model_id = swarm.nodes[0].model_id.clone();
    let bootstrap: petal_p2p::Multiaddr = swarm.bootstrap_addr.parse().expect("bootstrap address");
    let source = ModelSource::open(&model).expect("model");
    let head = source.load_head(Placement::cpu_f32()).expect("head");
    let vocab = source.spec().vocab_size as u32;
    let ids: Vec<u32> = IDS.iter().map(|id| id % vocab).collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let (undisturbed, none) = run(&client, &model_id, &head, &ids, None).await;
        assert!(none.is_empty());
        let (cut, failovers) = run(&client, &model_id, &head, &ids, Some(CUT)).await;
        eprintln!("failovers: {failovers:?}");
        assert_eq!(failovers.len(), 1, "one reconnect: {failovers:?}");
        let f = &failovers[0];
        assert_eq!(f.failed_peer, server, "the same, only server");
        assert!(f.reason.starts_with("reconnected"), "{}", f.reason);
        assert_eq!(
            f.replayed_steps, CUT,
            "every step before the cut is replayed"
        );
        assert_eq!(
            cut, undisturbed,
            "outputs after the reconnect equal the undisturbed run's"
        );
        client.shutdown().await;
    });
}

/// Steps `ids` through a fresh session one by one, cutting every connection to the server before step `cut`;
/// returns each step's output and the session's failovers.
async fn run(
    client: &SwarmClient,
    model_id: &str,
    head: &Head,
    ids: &[u32],
    cut: Option<usize>,
) -> (Vec<Vec<f32>>, Vec<Failover>) {
    let config = ChainConfig {
        discovery_timeout: Duration::from_secs(10),
        ..ChainConfig::default()
    };
    let mut session = ChainSession::open(client, model_id, 5, ids.len(), config)
        .await
        .expect("session");
    let mut outputs = vec![];
    for (i, id) in ids.iter().enumerate() {
        if cut == Some(i) {
            let peer = session.hops()[0].peer.parse().expect("peer id");
            client
                .network()
                .disconnect(peer, Duration::from_secs(5))
                .await;
        }
        let x = head.embed(&[*id]).expect("embed");
        let (y, _) = session.step(&x).await.expect("step");
        outputs.push(
            y.flatten_all()
                .and_then(|t| t.to_vec1::<f32>())
                .expect("output"),
        );
    }
    let failovers = session.failovers().to_vec();
    session.close().await;
    (outputs, failovers)
}
