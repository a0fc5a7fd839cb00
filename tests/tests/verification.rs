//! Output verification (`--verify`): a server whose answers are wrong is caught by the answers of two other
//! chains over the same blocks, banned and replaced, and the text equals the honest run's; honest servers are
//! never blamed.
//!
//! The liar is a real libp2p peer in this test process that announces the whole model with the right block hashes
//! (so the router's fewest-hops rule picks it first) and really computes every block, with the engine a node uses,
//! then adds noise to each answer: well-formed, finite, plausible hidden states that only a second opinion exposes.
mod support;

use candle_core::Tensor;
use futures::StreamExt;
use petal_client::LocalSpans;
use petal_model::compute::wire::{from_wire, to_wire};
use petal_model::{ModelSource, Placement};
use petal_p2p::Network;
use petal_proto::pb::{self, request, response, ErrorCode};
use petal_proto::{FramedStream, DEFAULT_MAX_FRAME_BYTES};
use petal_tests::*;
use serde_json::Value;
use std::time::Instant;
use support::{impostor, wait_listed};

const PROMPT: &str = "Once upon a time";
/// The noise's size against the mean magnitude of an answer's values: enough to change the story.
const NOISE: f32 = 0.5;

/// Serves every block of stories260K on each stream, computed honestly, with noise added to every answer.
fn serve_noisy(net: &Network) -> tokio::task::JoinHandle<()> {
    let source = ModelSource::open(stories_bin()).expect("model");
    let spans = LocalSpans::load(&source, &Placement::cpu_f32(), None).expect("blocks");
    let mut incoming = net.accept_streams().expect("accept");
    tokio::spawn(async move {
        while let Some((_, stream)) = incoming.next().await {
            let spans = spans.clone();
            tokio::spawn(async move {
                let mut framed = FramedStream::new(stream, DEFAULT_MAX_FRAME_BYTES);
                let mut session = None;
                while let Ok(Some(req)) = framed.recv::<pb::Request>().await {
                    let reply = match req.kind {
                        Some(request::Kind::Open(open))
                            if open.start_block == 0 && open.end_block == 5 =>
                        {
                            session =
                                Some(spans.open_local(open.max_length as usize).expect("session"));
                            pb::Response {
                                kind: Some(response::Kind::Opened(pb::SessionOpened {
                                    session_id: 1,
                                    start_block: 0,
                                    end_block: 5,
                                    dtype: pb::WireDType::F32 as i32,
                                    max_length: open.max_length,
                                    ..Default::default()
                                })),
                            }
                        }
                        Some(request::Kind::Step(step)) => match (session.as_mut(), step.hidden) {
                            (Some(session), Some(hidden)) => {
                                let started = Instant::now();
                                let shape: Vec<usize> =
                                    hidden.shape.iter().map(|&d| d as usize).collect();
                                let x = from_wire(&hidden, pb::WireDType::F32, &shape)
                                    .expect("hidden states");
                                let y = tokio::task::block_in_place(|| session.forward_now(&x))
                                    .expect("forward");
                                pb::Response {
                                    kind: Some(response::Kind::Step(pb::StepResult {
                                        session_id: 1,
                                        position: step.position,
                                        hidden: Some(
                                            to_wire(
                                                &perturb(&y, step.position),
                                                pb::WireDType::F32,
                                            )
                                            .expect("wire"),
                                        ),
                                        compute_micros: started.elapsed().as_micros() as u64,
                                        ..Default::default()
                                    })),
                                }
                            }
                            _ => pb::Response::error(ErrorCode::UnknownSession, "no session"),
                        },
                        Some(request::Kind::Close(_)) => break,
                        _ => pb::Response::error(ErrorCode::BlocksNotServed, "only 0..5"),
                    };
                    if framed.send(&reply).await.is_err() {
                        break;
                    }
                }
            });
        }
    })
}

/// `y` plus noise uniform in +-[`NOISE`] times its mean absolute value, drawn from a generator seeded by the
/// step's position: every run gets the same noise, so whether it changes the text does not vary.
fn perturb(y: &Tensor, position: u32) -> Tensor {
    let values = y
        .flatten_all()
        .and_then(|v| v.to_vec1::<f32>())
        .expect("values");
    let scale = NOISE * values.iter().map(|v| v.abs()).sum::<f32>() / values.len().max(1) as f32;
    let mut rng = XorShift::new(u64::from(position) + 1);
    let noisy: Vec<f32> = values
        .iter()
        .map(|v| v + scale * ((rng.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0))
        .collect();
    Tensor::from_vec(noisy, y.shape(), y.device()).expect("noisy")
}

fn verification(out: &GenOutput) -> &Value {
    &out.raw["verification"]
}

#[test]
fn a_server_perturbing_its_answers_is_caught_and_the_text_equals_the_honest_run() {
    let model = stories_bin();
    // Two replicas of each half: every hop has a second and a third chain on other servers.
    let swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let local = Generate::new(&model, PROMPT)
        .local()
        .max_new_tokens(24)
        .ignore_eos()
        .run_json();
    let generate = |verify: &str| {
        swarm
            .generate(&model, PROMPT)
            .max_new_tokens(24)
            .ignore_eos()
            .args(&["--verify", verify])
            .run_json()
    };

    // Honest servers only: every hop step is checked, and none is blamed.
    let honest = generate("all");
    assert_same_tokens("honest swarm, every step checked", &honest, &local);
    let checks = verification(&honest);
    assert_eq!(
        checks["checked_steps"].as_u64(),
        Some(2 * 24),
        "two hops x 24 steps should all be checked: {checks}\n{}",
        honest.stderr
    );
    assert_eq!(
        checks["mismatches"].as_array().map(Vec::len),
        Some(0),
        "{checks}"
    );

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (noisy, _announcer) = rt.block_on(impostor(&swarm, "noisy", vec![]));
    let noisy_peer = noisy.peer_id().to_string();
    let _serving = {
        let _in_runtime = rt.enter();
        serve_noisy(&noisy)
    };
    wait_listed(&swarm, &noisy_peer);

    // Unchecked, the noisy server (the only one-hop route) changes the story: the noise matters.
    let unchecked = generate("off");
    assert!(
        unchecked
            .route
            .iter()
            .flatten()
            .any(|hop| hop.contains("noisy")),
        "the noisy server should be the route: {:?}",
        unchecked.route
    );
    assert_ne!(
        unchecked.tokens, local.tokens,
        "the noise should change the text, or this test proves nothing"
    );

    // Checking every step: caught at its first answer, outvoted by two honest chains, banned and replaced.
    let checked = generate("all");
    eprintln!("client log:\n{}", checked.stderr);
    assert_same_tokens("noisy server under --verify all", &checked, &local);
    let checks = verification(&checked);
    let mismatches = checks["mismatches"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        mismatches.len(),
        1,
        "one mismatch, then the liar is gone: {checks}"
    );
    let caught = &mismatches[0];
    assert_eq!(caught["verdict"], "primary_deviated", "{caught}");
    assert_eq!(caught["primary"], noisy_peer.as_str(), "{caught}");
    assert_eq!(
        caught["position"], 0,
        "caught at the prompt's step: {caught}"
    );
    assert_eq!(
        caught["banned"],
        serde_json::json!([noisy_peer]),
        "{caught}"
    );
    let route = checked.route.clone().unwrap_or_default();
    assert!(
        route.len() == 2 && route.iter().all(|hop| !hop.contains("noisy")),
        "the honest chain that outvoted it carries on: {route:?}"
    );
    let failovers = checked.raw["failovers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        failovers
            .iter()
            .any(|f| f["failed_peer"] == noisy_peer.as_str()),
        "the replacement is reported as a failover: {failovers:?}"
    );
}
