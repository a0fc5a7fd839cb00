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
    // Announced speeds that make the one-hop route the cheapest by far: with equal ones the choice would rest on
    // measured RTTs, and a peer the client has not pinged yet counts 250 ms (`UNKNOWN_RTT`), which on a busy
    // machine sent the first generation through the two-node chain.
    let (fast, slow) = (["--throughput", "1000"], ["--throughput", "2"]);
    let mut swarm = Swarm::builder()
        .node_with(&model, "0..5", &fast)
        .node_with(&model, "0..2", &slow)
        .node_with(&model, "2..5", &slow)
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

/// Issue acceptance: two replicas of every span; one server on the route is `kill -9`ed in the middle of a 64-token
/// greedy generation, ten times with different kill points. Every run must complete with exactly the undisturbed
/// (local) tokens. The client bans the dead server, re-plans its blocks onto the replica and replays the history.
#[test]
fn kill_9_mid_generation_ten_times() {
    const RUNS: usize = 10;
    let model = smollm_gguf();
    let prompt = "The capital of France is";
    let mut swarm = Swarm::builder()
        .record_ttl(5.0)
        .node(&model, "0..15")
        .node(&model, "0..15")
        .node(&model, "15..30")
        .node(&model, "15..30")
        .start();
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(64)
        .ignore_eos()
        .run_json();

    // The kill points are fractions of an undisturbed routed generation timed here, from its session opening to
    // its end: fixed delays stopped landing mid-generation once decoding got faster than they assumed.
    let generation = swarm
        .generate(&model, prompt)
        .max_new_tokens(64)
        .ignore_eos()
        .time_routed("undisturbed", &local.tokens);

    let mut failover_ms = vec![];
    for run in 0..RUNS {
        let (mut client, hops) = swarm
            .generate(&model, prompt)
            .max_new_tokens(64)
            .ignore_eos()
            .spawn_routed(&format!("generate{run}"));
        assert_eq!(hops.len(), 2, "unexpected route {hops:?}");
        // Kill points spread over the generation, alternating between the first and the last hop.
        let victim_name = hops[run % 2].clone();
        // Spread over the first 90% of the undisturbed generation, one point per run.
        let delay = generation.mul_f64(0.9 * (run as f64 + 0.5) / RUNS as f64);
        std::thread::sleep(delay);
        let blocks = swarm.kill(&victim_name);

        let (_, tokens) = spawned_json(&mut client, Duration::from_secs(120));
        assert_eq!(
            tokens,
            local.tokens,
            "run {run}: output differs after killing {victim_name}\n{}",
            client.report()
        );
        let log = client.stderr_log();
        let elapsed = log
            .lines()
            .filter(|l| l.contains("replacement ready"))
            .filter_map(|l| {
                l.split("elapsed_ms=")
                    .nth(1)?
                    .split_whitespace()
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .collect::<Vec<_>>();
        eprintln!(
            "run {run}: killed {victim_name} [{blocks}] {} ms after the session opened; failovers took {elapsed:?} ms",
            delay.as_millis()
        );
        failover_ms.extend(elapsed);
        // Bring the span back to two replicas for the next run.
        swarm.add_node(&model, &blocks, &[]);
    }
    eprintln!("failover times (ms): {failover_ms:?}");
    assert!(
        failover_ms.len() >= RUNS / 2,
        "most kills should land mid-generation and trigger a failover; saw {}",
        failover_ms.len()
    );
}
