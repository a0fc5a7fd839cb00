//! A private swarm (`--swarm-key`): its nodes serve each other's clients, a node holding another key is never
//! listed or chained, and a client without the key finds nothing.
use petal_tests::*;
use std::process::Command;
use std::time::Duration;

const PROMPT: &str = "Once upon a time";

fn new_key(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let path = dir.join(name);
    let mut cmd = Command::new(bin("petal-node"));
    cmd.args(["swarm-key", "--new"]).arg(&path);
    let out = run_with_timeout(cmd, Duration::from_secs(30));
    assert!(out.success(), "petal-node swarm-key failed\n{out}");
    assert!(
        !out.stdout.trim().is_empty(),
        "no fingerprint printed\n{out}"
    );
    // A second --new on the same file is refused: the swarm's key is never overwritten by accident.
    let mut again = Command::new(bin("petal-node"));
    again.args(["swarm-key", "--new"]).arg(&path);
    assert!(!run_with_timeout(again, Duration::from_secs(30)).success());
    path
}

#[test]
fn private_swarm_serves_its_members_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = new_key(dir.path(), "swarm.key");
    let other = new_key(dir.path(), "other.key");
    let model = stories_bin();
    let mut swarm = Swarm::builder()
        .swarm_key(&key)
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    // A node with another key, serving the whole model: the router would prefer it if it could see it.
    let outsider = swarm
        .add_node(&model, "0..5", &["--swarm-key", &other.to_string_lossy()])
        .peer_id
        .clone();

    let mut members = vec![
        swarm.nodes[0].peer_id.clone(),
        swarm.nodes[1].peer_id.clone(),
    ];
    members.sort();
    let mut listed = swarm.listed_peers();
    listed.sort();
    assert_eq!(listed, members, "only the key's holders are listed");
    assert!(!listed.contains(&outsider));

    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(24)
        .ignore_eos()
        .run_json();
    let remote = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(24)
        .ignore_eos()
        .run_json();
    assert_same_tokens("private swarm", &remote, &local);
    assert_eq!(remote.route.as_ref().map(Vec::len), Some(2));

    // Without the key the bootstrap is unreachable: nothing is listed.
    let seen = swarm.records_as(None);
    assert!(
        seen.is_empty(),
        "a client without the key saw servers: {seen:?}"
    );
}
