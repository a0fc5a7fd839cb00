//! Bounds a node keeps whatever a client sends (issue 14): a step is at most `--max-chunk-tokens` positions, and
//! clients split longer prompts into steps of that size with the same result.
use candle_core::{DType, Device, Tensor};
use petal_client::{ClientError, HopClient, SwarmClient};
use petal_model::compute::wire::to_wire;
use petal_model::BlockRange;
use petal_proto::pb::{ErrorCode, WireDType};
use petal_tests::*;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(60);

/// Resident memory of process `pid`, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// One step of 3 x 8,192 positions (what a client may ask for with SmolLM2's context; its attention scores alone
/// would take 7 GB) is refused with a typed code before any compute; the node's memory does not grow beyond the
/// frame it read, and the same session then takes a normal step.
#[test]
fn a_step_over_max_chunk_tokens_is_refused_before_any_compute() {
    let model = smollm_gguf();
    let swarm = Swarm::builder().node(&model, "0..2").start();
    let node = &swarm.nodes[0];
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let bootstrap = swarm.bootstrap_addr.parse().expect("bootstrap address");
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let hops = client
            .plan(&node.model_id, BlockRange::new(0, 2), TIMEOUT)
            .await
            .expect("plan");
        assert_eq!(
            hops[0].record.max_chunk_tokens, 512,
            "the record announces the limit"
        );
        let mut session = HopClient::open(
            client.network(),
            &node.model_id,
            hops[0].clone(),
            8192,
            TIMEOUT,
        )
        .await
        .expect("session");
        let before = rss(node.proc.pid());
        let huge = Tensor::zeros((3, 8192, 576), DType::F32, &Device::Cpu).expect("tensor");
        let refused = session
            .step_wire(to_wire(&huge, WireDType::F32).expect("wire"), 0, TIMEOUT)
            .await;
        match refused {
            Err(ClientError::Server { code, .. }) => assert_eq!(code, ErrorCode::StepTooLarge),
            other => panic!(
                "expected a STEP_TOO_LARGE refusal, got {:?}",
                other.map(|s| s.hidden.shape().clone())
            ),
        }
        let grown = rss(node.proc.pid()).saturating_sub(before);
        assert!(grown < 256 << 20, "the node grew by {} MiB", grown >> 20);
        let x = Tensor::randn(0f32, 1.0, (1, 16, 576), &Device::Cpu).expect("tensor");
        let out = session
            .step(&x, 0, TIMEOUT)
            .await
            .expect("a normal step after the refusal");
        assert_eq!(out.hidden.dims(), &[1, 16, 576]);
        client.shutdown().await;
    });
}

/// Nodes taking 3 positions per step: the client sends a 12-token prompt in 4 steps per hop, and the text equals
/// the local run's (f32: a prompt in chunks computes the same as in one step, model/tests/chunking.rs).
#[test]
fn prompts_split_into_chunks_give_the_local_text() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node_with(&model, "0..3", &["--max-chunk-tokens", "3"])
        .node_with(&model, "3..5", &["--max-chunk-tokens", "3"])
        .start();
    let prompt = "Once upon a time, there was a little girl named Lily";
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    assert!(
        local.prompt_tokens > 9,
        "the prompt must span several chunks"
    );
    let remote = swarm
        .generate(&model, prompt)
        .max_new_tokens(16)
        .ignore_eos()
        .run_json();
    assert_same_tokens("prompt in chunks of 3", &remote, &local);
}
