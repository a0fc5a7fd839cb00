//! The client routes around a crashed server whose DHT record has not expired yet.
use petal_tests::*;
use std::time::Duration;

const PROMPT: &str = "Once upon a time";

/// A node serving the whole model (the one-hop route the router prefers) is SIGKILLed while its record still
/// lives (default 60 s TTL). The client must fail to reach it, drop it and re-plan through the two-node chain,
/// producing exactly the local run's tokens.
#[test]
fn stale_record_of_killed_node_is_routed_around() {
    let model = stories_bin();
    let mut swarm = Swarm::builder()
        .node(&model, "0..5")
        .node(&model, "0..2")
        .node(&model, "2..5")
        .start();
    let whole = swarm.nodes[0].peer_id.clone();

    // With everyone alive, the fewest-hops route is the whole-model node.
    let before = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    let route = before.route.clone().unwrap_or_default();
    eprintln!("route with all nodes alive: {route:?}");
    assert_eq!(route.len(), 1, "one node serves 0..5: {route:?}");

    swarm.nodes[0].proc.sigkill();
    assert!(swarm.nodes[0]
        .proc
        .wait_exit(Duration::from_secs(5))
        .is_some());
    assert!(
        swarm.listed_peers().contains(&whole),
        "the killed node's record should still be listed (TTL 60 s) for this test to mean anything"
    );

    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(64)
        .ignore_eos()
        .run_json();
    let after = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(64)
        .ignore_eos()
        .timeout(Duration::from_secs(60))
        .run_json();
    let route = after.route.clone().unwrap_or_default();
    eprintln!(
        "route after the kill: {route:?} ({:.0} ms to the first token)",
        after.first_token_ms
    );
    eprintln!("client log:\n{}", after.stderr);
    assert_same_tokens("after failover", &after, &local);
    assert_eq!(
        route.len(),
        2,
        "the route should go around the dead node: {route:?}"
    );
    assert!(
        route.iter().all(|hop| !hop.contains("node1")),
        "route still names the dead node1: {route:?}"
    );
}
