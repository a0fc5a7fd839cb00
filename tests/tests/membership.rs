//! Nodes leave the swarm's DHT: at once on SIGTERM (the record is withdrawn), within the record TTL on SIGKILL.
//! Both use `--record-ttl 3` on the bootstrap and the nodes.
use petal_tests::*;
use std::time::{Duration, Instant};

const TTL_SECS: f64 = 3.0;

/// Bootstrap + two stories nodes with a 3 s record TTL; both listed before the test acts.
fn two_node_swarm() -> Swarm {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .record_ttl(TTL_SECS)
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let listed = poll_until(Duration::from_secs(10), Duration::from_millis(200), || {
        let peers = swarm.listed_peers();
        swarm.nodes.iter().all(|n| peers.contains(&n.peer_id))
    });
    assert!(
        listed.is_some(),
        "both nodes should be listed by `petal swarm`: {:?}",
        swarm.records()
    );
    swarm
}

/// Polls `petal swarm --json` until `peer` is gone while `survivor` is still listed (so an empty answer from a
/// failed lookup does not count as gone); returns how long that took after `since`.
fn wait_gone(
    swarm: &Swarm,
    peer: &str,
    survivor: &str,
    since: Instant,
    limit: Duration,
) -> Option<Duration> {
    poll_until(limit, Duration::from_millis(250), || {
        let peers = swarm.listed_peers();
        !peers.iter().any(|p| p == peer) && peers.iter().any(|p| p == survivor)
    })
    .map(|_| since.elapsed())
}

/// The node that was not stopped must stay listed after several TTLs: its record is refreshed in time.
fn survivor_stays_listed(swarm: &Swarm, survivor: usize) {
    std::thread::sleep(Duration::from_secs_f64(TTL_SECS * 1.5));
    let peer = &swarm.nodes[survivor].peer_id;
    let listed = poll_until(Duration::from_secs(3), Duration::from_millis(250), || {
        swarm.listed_peers().contains(peer)
    });
    assert!(
        listed.is_some(),
        "the surviving node should stay listed past the TTL (its record must be refreshed): {:?}",
        swarm.records()
    );
}

#[test]
fn sigterm_node_leaves_swarm() {
    let mut swarm = two_node_swarm();
    let peer = swarm.nodes[0].peer_id.clone();
    let start = Instant::now();
    swarm.nodes[0].proc.sigterm();
    let status = swarm.nodes[0].proc.wait_exit(Duration::from_secs(15));
    eprintln!("SIGTERM: exited {status:?} after {:?}", start.elapsed());
    assert_eq!(
        status.map(|s| s.code()),
        Some(Some(0)),
        "a SIGTERMed node with no sessions should exit 0 promptly\n{}",
        swarm.nodes[0].proc.report()
    );
    let survivor = swarm.nodes[1].peer_id.clone();
    let gone = wait_gone(&swarm, &peer, &survivor, start, Duration::from_secs(8));
    eprintln!("SIGTERM: gone from `petal swarm` after {gone:?}");
    assert!(
        gone.is_some(),
        "a SIGTERMed node should leave `petal swarm` within ~TTL + margin: {:?}",
        swarm.records()
    );
    let log = swarm.nodes[0].proc.stderr_log();
    assert!(!log.contains("panicked"), "node panicked\n{log}");
    survivor_stays_listed(&swarm, 1);
}

#[test]
fn sigkill_node_expires() {
    let mut swarm = two_node_swarm();
    let peer = swarm.nodes[1].peer_id.clone();
    let start = Instant::now();
    swarm.nodes[1].proc.sigkill();
    assert!(swarm.nodes[1]
        .proc
        .wait_exit(Duration::from_secs(5))
        .is_some());
    let survivor = swarm.nodes[0].peer_id.clone();
    let gone = wait_gone(&swarm, &peer, &survivor, start, Duration::from_secs(10));
    eprintln!("SIGKILL: gone from `petal swarm` after {gone:?} (TTL {TTL_SECS} s)");
    assert!(
        gone.is_some(),
        "a SIGKILLed node's record should expire within the TTL ({TTL_SECS} s) + margin: {:?}",
        swarm.records()
    );
    survivor_stays_listed(&swarm, 0);
}
