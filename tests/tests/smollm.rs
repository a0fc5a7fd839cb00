//! SmolLM2-135M-Instruct (Q4_1 GGUF, 30 blocks): three nodes of 10 blocks each reproduce the local run, and the
//! instruct model answers a chat question correctly, locally and through the swarm.
use petal_tests::*;

const CHAT_PROMPT: &str = "What is the capital of France?";

#[test]
fn smollm_three_nodes_match_local() {
    let model = smollm_gguf();
    let swarm = Swarm::builder()
        .node(&model, "0..10")
        .node(&model, "10..20")
        .node(&model, "20..30")
        .start();
    let prompt = "The capital of France is";
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(64)
        .ignore_eos()
        .run_json();
    let remote = swarm
        .generate(&model, prompt)
        .max_new_tokens(64)
        .ignore_eos()
        .run_json();
    eprintln!(
        "local  ({:.1} tok/s): {:?}",
        local.tokens_per_second, local.text
    );
    eprintln!(
        "remote ({:.1} tok/s): {:?}",
        remote.tokens_per_second, remote.text
    );
    eprintln!("route: {:?}", remote.route);
    assert_eq!(local.tokens.len(), 64);
    assert_same_tokens("smollm 3 nodes", &remote, &local);
    let route = remote.route.expect("swarm runs report their route");
    assert_eq!(route.len(), 3, "route should have 3 hops: {route:?}");

    // The same swarm answers the chat question.
    let chat = swarm
        .generate(&model, CHAT_PROMPT)
        .chat()
        .max_new_tokens(32)
        .run_json();
    eprintln!("chat through the swarm: {:?}", chat.text);
    assert!(
        chat.text.contains("Paris"),
        "the swarm's chat answer should name Paris: {:?}",
        chat.text
    );
}

#[test]
fn smollm_chat_answers_paris() {
    let out = Generate::new(smollm_gguf(), CHAT_PROMPT)
        .local()
        .chat()
        .max_new_tokens(32)
        .run_json();
    eprintln!("local chat: {:?} ({})", out.text, out.finish_reason);
    assert!(
        out.text.contains("Paris"),
        "the chat answer should name Paris: {:?}",
        out.text
    );
}
