//! A client no single peer can stop: servers in the DHT that refuse everything, or whose records point nowhere,
//! are routed around, and the text equals the local run's.
//!
//! The hostile servers are real libp2p peers in this test process (`petal_p2p::Network` and `Announcer`, as a node
//! uses them) that announce a record claiming every block, so the router's fewest-hops rule picks them first.
mod support;

use futures::StreamExt;
use petal_p2p::Network;
use petal_proto::pb::{self, ErrorCode};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES};
use petal_tests::*;
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};
use support::{impostor, wait_listed};

const PROMPT: &str = "Once upon a time";

/// Answers every request on every stream with an error, as a broken or hostile server might.
fn refuse_everything(net: &Network) -> tokio::task::JoinHandle<()> {
    let mut incoming = net.accept_streams().expect("accept");
    tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            tokio::spawn(async move {
                let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
                let codes = [
                    ErrorCode::WrongModel,
                    ErrorCode::BlocksNotServed,
                    ErrorCode::BadRequest,
                ];
                let mut i = 0;
                while let Ok(Some(_)) = framed.recv::<pb::Request>().await {
                    let refusal = pb::Response::error(codes[i % codes.len()], "no");
                    i += 1;
                    if framed.send(&refusal).await.is_err() {
                        break;
                    }
                }
            });
        }
    })
}

fn local_run() -> GenOutput {
    Generate::new(stories_bin(), PROMPT)
        .local()
        .max_new_tokens(24)
        .ignore_eos()
        .run_json()
}

#[test]
fn server_claiming_every_block_and_refusing_everything_is_routed_around() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (rogue, _announcer) = rt.block_on(impostor(&swarm, "rogue", vec![]));
    let _serving = {
        let _in_runtime = rt.enter();
        refuse_everything(&rogue)
    };
    wait_listed(&swarm, &rogue.peer_id().to_string());

    let local = local_run();
    let remote = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(24)
        .ignore_eos()
        .run_json();
    eprintln!("client log:\n{}", remote.stderr);
    assert_same_tokens("around the rogue server", &remote, &local);
    let route = remote.route.clone().unwrap_or_default();
    assert!(
        route.len() == 2 && route.iter().all(|hop| !hop.contains("rogue")),
        "the route should be the honest two-node chain: {route:?}"
    );
    assert!(
        remote.stderr.contains("routing around it"),
        "the rogue server should have been tried (and refused) first:\n{}",
        remote.stderr
    );
}

#[test]
fn six_dead_whole_model_records_do_not_hold_up_generation() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    // A tar pit: accepts TCP connections and never says a word, like a black-holed or wedged host, so a dial to it
    // fails only by timing out.
    let tarpit = TcpListener::bind("127.0.0.1:0").expect("tar pit");
    let tarpit_addr = format!(
        "/ip4/127.0.0.1/tcp/{}",
        tarpit.local_addr().expect("tar pit address").port()
    );
    let _held: std::thread::JoinHandle<Vec<TcpStream>> =
        std::thread::spawn(move || tarpit.incoming().take(64).filter_map(|s| s.ok()).collect());
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let mut dead = vec![];
    for i in 0..6 {
        let (net, announcer) = rt.block_on(impostor(
            &swarm,
            &format!("dead{i}"),
            vec![tarpit_addr.clone()],
        ));
        dead.push((net.peer_id().to_string(), net, announcer));
    }
    for (peer, _, _) in &dead {
        wait_listed(&swarm, peer);
    }
    // Gone without withdrawing (kill -9, a lost machine): their records live on until the TTL.
    for (_, net, _) in &dead {
        rt.block_on(net.shutdown());
    }
    let listed = swarm.listed_peers();
    assert!(
        dead.iter().all(|(peer, _, _)| listed.contains(peer)),
        "the dead records must still be listed for this test to mean anything"
    );

    let local = local_run();
    let started = Instant::now();
    let remote = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(24)
        .ignore_eos()
        .run_json();
    let took = started.elapsed();
    eprintln!("took {took:?}; client log:\n{}", remote.stderr);
    assert_same_tokens("around six dead records", &remote, &local);
    assert!(
        took < Duration::from_secs(10),
        "generation took {took:?} with six dead records in the DHT"
    );
}

/// A node whose weights differ by one byte (a corrupted download, a tampered file) announces the same model id,
/// since the id samples the weights, but not the same block hashes: it is never chained, even though it serves
/// the whole model (the route the router would otherwise prefer), and every generation equals the honest one.
#[test]
fn node_with_one_changed_weight_byte_is_never_chained() {
    let model = stories_bin();
    let dir = tempfile::tempdir().expect("tempdir");
    let corrupted = dir.path().join("stories260K.bin");
    let mut bytes = std::fs::read(&model).expect("read model");
    // A float inside the blocks (between the embedding table and the final norm), most significant byte flipped.
    let at = (bytes.len() * 2 / 5) & !3;
    bytes[at + 3] ^= 0x40;
    std::fs::write(&corrupted, bytes).expect("write the corrupted copy");

    let swarm = Swarm::builder()
        .node(&corrupted, "0..5")
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    assert_eq!(
        swarm.nodes[0].model_id, swarm.nodes[1].model_id,
        "the changed byte must be outside the id's sample for this test to mean anything"
    );
    let corrupted_peer = swarm.nodes[0].peer_id.clone();
    let local = local_run();
    for _ in 0..3 {
        let remote = swarm
            .generate(&model, PROMPT)
            .max_new_tokens(24)
            .ignore_eos()
            .run_json();
        assert_same_tokens("beside a corrupted replica", &remote, &local);
        let route = remote.route.clone().unwrap_or_default();
        assert!(
            route.len() == 2 && route.iter().all(|hop| !hop.contains("node1")),
            "the corrupted node1 must not be chained: {route:?}"
        );
        assert!(
            remote.stderr.contains(&corrupted_peer) && remote.stderr.contains("differ"),
            "the client should say why it leaves node1 out:\n{}",
            remote.stderr
        );
    }
}
