//! Server-to-server push: decode steps go from hop to hop without the client in between, and the output is the
//! local run's, token for token; when the middle server is killed mid-generation the client drives the step
//! itself, replaces the server with replay, and the output is still the local run's.
use petal_tests::*;
use std::time::Duration;

const PROMPT: &str = "Once upon a time";

fn pushed_steps(out: &GenOutput) -> u64 {
    out.raw["pushed_steps"].as_u64().unwrap_or(u64::MAX)
}

#[test]
fn pushed_and_client_driven_generation_equal_local() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node(&model, "0..2")
        .node(&model, "2..4")
        .node(&model, "4..5")
        .start();
    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(48)
        .ignore_eos()
        .run_json();
    // --verify off: a step drawn for a check is driven by the client.
    let pushed = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(48)
        .ignore_eos()
        .args(&["--verify", "off"])
        .run_json();
    assert_same_tokens("pushed", &pushed, &local);
    assert_eq!(pushed.route.as_ref().map(Vec::len), Some(3));
    // Every decode step (all but the prompt's) went server to server.
    assert_eq!(pushed_steps(&pushed), 47, "{}", pushed.raw);

    // --verify all on a chain where no other server holds any span: the prompt's step finds nothing to check
    // against, and from then on no draw stands in the way of a push.
    let unchecked = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(48)
        .ignore_eos()
        .args(&["--verify", "all"])
        .run_json();
    assert_same_tokens("pushed, every step drawn", &unchecked, &local);
    assert_eq!(pushed_steps(&unchecked), 47, "{}", unchecked.raw);
    let checks = &unchecked.raw["verification"];
    assert_eq!(checks["checked_steps"].as_u64(), Some(0), "{checks}");
    // Every hop of every step was drawn, and none could be checked: 3 hops x (the prompt + 47 decode steps).
    assert_eq!(checks["unverifiable"].as_u64(), Some(3 * 48), "{checks}");

    let driven = swarm
        .generate(&model, PROMPT)
        .max_new_tokens(48)
        .ignore_eos()
        .args(&["--verify", "off", "--no-push"])
        .run_json();
    assert_same_tokens("client-driven", &driven, &local);
    assert_eq!(pushed_steps(&driven), 0, "{}", driven.raw);
}

#[test]
fn killing_the_middle_server_mid_generation_falls_back_to_the_client() {
    let model = smollm_gguf();
    let prompt = "The capital of France is";
    let mut swarm = Swarm::builder()
        .record_ttl(5.0)
        .node(&model, "0..10")
        .node(&model, "10..20")
        .node(&model, "10..20")
        .node(&model, "20..30")
        .start();
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(160)
        .ignore_eos()
        .run_json();
    let generate = swarm
        .generate(&model, prompt)
        .max_new_tokens(160)
        .ignore_eos()
        .args(&["--verify", "off"]);
    let undisturbed = generate.time_routed("undisturbed", &local.tokens);
    let (mut client, hops) = generate.spawn_routed("generate");
    assert_eq!(hops.len(), 3, "unexpected route {hops:?}");
    // A quarter of the way in, so that pushed steps come both before and after the failover.
    std::thread::sleep(undisturbed / 4);
    swarm.kill(&hops[1]);

    let (v, tokens) = spawned_json(&mut client, Duration::from_secs(120));
    assert_eq!(
        tokens,
        local.tokens,
        "output differs after killing {}\n{}",
        hops[1],
        client.report()
    );
    let failovers = v["failovers"].as_array().map_or(0, Vec::len);
    assert!(
        failovers >= 1,
        "the kill landed after the generation: {v}\n{}",
        client.report()
    );
    let pushed = v["pushed_steps"].as_u64().unwrap_or(0);
    assert!(
        pushed >= 10,
        "steps before and after the failover go server to server: {v}"
    );
    eprintln!(
        "{pushed} of 159 decode steps pushed; failovers: {}",
        v["failovers"]
    );
}
