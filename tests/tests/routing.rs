//! Routing by announced throughput: of two chains with as many hops, the client takes the faster one, and its
//! output is the local run's.
use petal_tests::*;
use std::time::Duration;

const PROMPT: &str = "Once upon a time";

#[test]
fn the_faster_of_two_equal_hop_chains_is_taken() {
    let model = stories_bin();
    // node1+node2 announce 20 tokens/s, node3+node4 20,000: the slow pair starts first and is listed first, so
    // neither start order nor listing order can be what picks the fast pair.
    let swarm = Swarm::builder()
        .node_with(&model, "0..3", &["--throughput", "20"])
        .node_with(&model, "3..5", &["--throughput", "20"])
        .node_with(&model, "0..3", &["--throughput", "20000"])
        .node_with(&model, "3..5", &["--throughput", "20000"])
        .start();
    // Every record listed first: the client must choose among all four, not take whichever spread first.
    let mut records = vec![];
    let listed = poll_until(Duration::from_secs(30), Duration::from_millis(200), || {
        records = swarm.records();
        records.len() == 4
    });
    assert!(listed.is_some(), "4 servers never listed: {records:?}");
    let announced: Vec<f64> = records
        .iter()
        .filter_map(|r| r["throughput_tokens_per_sec"].as_f64())
        .collect();
    assert!(
        announced.contains(&20.0) && announced.contains(&20000.0),
        "the announced throughputs are the ones given: {records:?}"
    );

    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    let remote = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    assert_same_tokens("routing by throughput", &remote, &local);
    let route = remote.route.clone().unwrap_or_default();
    assert!(
        route.len() == 2 && route[0].starts_with("node3(") && route[1].starts_with("node4("),
        "the route should be the fast pair, node3 -> node4: {route:?}\n{}",
        swarm.report()
    );
}
