//! Automatic spans on SmolLM2 (30 blocks): nodes started one after another with `--num-blocks 10` cover 0..30
//! without overlap, a fourth joins where the announced throughput is lowest, and when the only server of some
//! blocks is killed another node moves to cover them within two balance periods; the swarm then still generates
//! the local run's tokens.
use petal_tests::*;
use serde_json::Value;
use std::time::{Duration, Instant};

/// Short, so a killed node's record is gone soon.
const TTL_SECS: f64 = 4.0;
const PERIOD_SECS: u64 = 4;

/// (public name, start, end) of every listed server, sorted by start then name.
fn spans(records: &[Value]) -> Vec<(String, u64, u64)> {
    let mut spans: Vec<(String, u64, u64)> = records
        .iter()
        .map(|r| {
            (
                r["public_name"].as_str().unwrap_or_default().to_string(),
                r["start_block"].as_u64().unwrap_or(u64::MAX),
                r["end_block"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect();
    spans.sort_by(|a, b| (a.1, &a.0).cmp(&(b.1, &b.0)));
    spans
}

fn covers_all(spans: &[(String, u64, u64)], num_blocks: u64) -> bool {
    (0..num_blocks).all(|b| spans.iter().any(|(_, s, e)| *s <= b && b < *e))
}

fn serving_line_blocks(node: &Node) -> String {
    node.proc
        .stdout
        .iter()
        .find_map(|l| l.strip_prefix("serving blocks "))
        .and_then(|l| l.split(' ').next())
        .unwrap_or_default()
        .to_string()
}

#[test]
fn nodes_choose_their_blocks_and_move_to_cover_a_gap() {
    let model = smollm_gguf();
    let period = PERIOD_SECS.to_string();
    let args = |throughput: &'static str| {
        vec![
            "--num-blocks".to_string(),
            "10".to_string(),
            "--throughput".to_string(),
            throughput.to_string(),
            "--balance-period".to_string(),
            period.clone(),
        ]
    };
    let mut swarm = Swarm::builder().record_ttl(TTL_SECS).start();
    // One after another, each waiting for the previous one's record: node2 is the slowest.
    for (i, throughput) in ["100", "50", "100"].into_iter().enumerate() {
        let a = args(throughput);
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        swarm.add_node(&model, "", &a);
        let listed = poll_until(Duration::from_secs(20), Duration::from_millis(250), || {
            swarm.records().len() == i + 1
        });
        assert!(
            listed.is_some(),
            "node{} never listed\n{}",
            i + 1,
            swarm.report()
        );
    }
    let chosen: Vec<String> = swarm.nodes.iter().map(serving_line_blocks).collect();
    assert_eq!(
        chosen,
        ["0..10", "10..20", "20..30"],
        "three nodes of 10 blocks tile the model\n{}",
        swarm.report()
    );

    // The fourth goes where throughput is lowest: the slow node2's blocks.
    let a = args("100");
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    swarm.add_node(&model, "", &a);
    assert_eq!(
        serving_line_blocks(&swarm.nodes[3]),
        "10..20",
        "{}",
        swarm.report()
    );
    let mut records = vec![];
    let listed = poll_until(Duration::from_secs(20), Duration::from_millis(250), || {
        records = swarm.records();
        records.len() == 4
    });
    assert!(listed.is_some(), "4 servers never listed: {records:?}");
    // Balanced: nobody moves in a few periods (node2 and node4 could only trade places, which helps nothing).
    std::thread::sleep(Duration::from_secs(2 * PERIOD_SECS));
    let steady = spans(&swarm.records());
    assert_eq!(
        steady
            .iter()
            .map(|(n, s, e)| format!("{n}:{s}..{e}"))
            .collect::<Vec<_>>(),
        [
            "node1:0..10",
            "node2:10..20",
            "node4:10..20",
            "node3:20..30"
        ],
        "{}",
        swarm.report()
    );

    // node1 is the only server of 0..10: once its record expires, node2 or node4 moves there.
    swarm.nodes[0].proc.sigkill();
    let killed = Instant::now();
    let limit = Duration::from_secs_f64(TTL_SECS) + Duration::from_secs(2 * PERIOD_SECS);
    let mut last = vec![];
    let covered = poll_until(
        limit + Duration::from_secs(10),
        Duration::from_millis(250),
        || {
            last = spans(&swarm.records());
            !last.iter().any(|(n, _, _)| n == "node1") && covers_all(&last, 30)
        },
    );
    let took = killed.elapsed();
    assert!(
        covered.is_some(),
        "blocks 0..10 never covered again: {last:?}\n{}",
        swarm.report()
    );
    eprintln!(
        "covered again {:.1} s after the kill: {last:?}",
        took.as_secs_f64()
    );
    assert!(
        took <= limit + Duration::from_secs(3),
        "covering took {:.1} s, more than the TTL and two balance periods",
        took.as_secs_f64()
    );
    let movers = last.iter().filter(|(_, s, _)| *s == 0).count();
    assert_eq!(movers, 1, "exactly one node moved into the gap: {last:?}");

    // The moved swarm computes what the model computes.
    let prompt = "The capital of France is";
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    let remote = swarm
        .generate(&model, prompt)
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    assert_same_tokens("after a move", &remote, &local);
}

/// A node that moves while a generation holds a session on its old span: the session drains, its stream is closed,
/// and the client replays elsewhere; the tokens are the local run's. stories260K (5 blocks): node1 chooses 0..3 and
/// is the fast server of it, node2 serves 3..5, node3 0..3 too, slowly. Killing node2 mid-generation leaves 3..5
/// uncovered, so node1 moves to 2..5 while the client's session for 0..3 is still on it.
#[test]
fn a_move_drains_live_sessions_and_their_clients_replay_elsewhere() {
    let model = stories_bin();
    let mut swarm = Swarm::builder().record_ttl(TTL_SECS).start();
    swarm.add_node(
        &model,
        "",
        &[
            "--num-blocks",
            "3",
            "--throughput",
            "10000",
            "--balance-period",
            "2",
            "--drain-timeout",
            "1",
        ],
    );
    assert_eq!(serving_line_blocks(&swarm.nodes[0]), "0..3");
    // 3..5 first: with it uncovered, node1 would move there as soon as node2 doubled 0..3.
    swarm.add_node(&model, "3..5", &["--throughput", "10000"]);
    swarm.add_node(&model, "0..3", &["--throughput", "10"]);
    let listed = poll_until(Duration::from_secs(20), Duration::from_millis(250), || {
        swarm.records().len() == 3
    });
    assert!(
        listed.is_some(),
        "3 servers never listed\n{}",
        swarm.report()
    );

    let prompt = "Once upon a time";
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(400)
        .ignore_eos()
        .run_json();
    let generate = swarm
        .generate(&model, prompt)
        .max_new_tokens(400)
        .ignore_eos()
        .args(&["--verify", "off"]);
    let undisturbed = generate.time_routed("undisturbed", &local.tokens);
    let (mut client, hops) = generate.spawn_routed("generate");
    assert_eq!(hops, ["node1", "node2"], "the fast chain is taken");
    // A quarter of the way in: 3..5 is then lost while the session on node1's 0..3 still has most tokens to go.
    std::thread::sleep(undisturbed / 4);
    swarm.kill("node2");

    let (v, tokens) = spawned_json(&mut client, Duration::from_secs(120));
    assert_eq!(
        tokens,
        local.tokens,
        "output differs after the move\n{}",
        client.report()
    );
    let moved = spans(&swarm.records());
    assert!(
        moved
            .iter()
            .any(|(n, s, e)| n == "node1" && (*s, *e) == (2, 5)),
        "node1 moved to cover 3..5: {moved:?}"
    );
    let failed: Vec<&str> = v["failovers"]
        .as_array()
        .map(|f| f.iter().filter_map(|x| x["failed_peer"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        failed.contains(&swarm.nodes[0].peer_id.as_str()),
        "the session on node1's old span was closed and replayed elsewhere: {failed:?}\n{}",
        client.report()
    );
    assert!(
        swarm.nodes[0].proc.stderr_log().contains("span retired"),
        "node1 closed the old span's stream\n{}",
        swarm.report()
    );
}
