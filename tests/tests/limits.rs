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
        let before = node.proc.rss();
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
        let grown = node.proc.rss().saturating_sub(before);
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

/// A generation longer than what a session is first opened for (the prompt and 256 tokens ahead) grows its
/// reservation on every hop as it goes, and gives the local tokens.
#[test]
fn a_generation_beyond_its_first_reservation_grows_it_and_gives_the_local_text() {
    let model = stories_bin();
    let swarm = Swarm::builder()
        .node(&model, "0..3")
        .node(&model, "3..5")
        .start();
    let prompt = "Once upon a time";
    let new_tokens = 300;
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(new_tokens)
        .ignore_eos()
        .run_json();
    let remote = swarm
        .generate(&model, prompt)
        .max_new_tokens(new_tokens)
        .ignore_eos()
        .run_json();
    assert_eq!(remote.tokens.len(), new_tokens, "{}", remote.stderr);
    assert_same_tokens("past the first reservation", &remote, &local);
    assert_eq!(
        remote.raw["failovers"]
            .as_array()
            .map(Vec::len)
            .unwrap_or(0),
        0,
        "growing the sessions replaced a server: {}",
        remote.raw
    );
}

/// 100 streams of one peer each announce a frame of 64 MiB - 1 bytes and pour its bytes in as fast as the node
/// takes them (6.4 GB if all were buffered): the node holds at most its per-peer receive buffer, a generation by
/// another peer runs meanwhile and gives the local text, and once the frame timeout passes the node closes the
/// streams.
#[test]
fn a_hundred_streams_dripping_huge_frames_cannot_exhaust_a_node() {
    use futures::AsyncWriteExt;
    const STREAMS: usize = 100;
    const FRAME_TIMEOUT_S: u64 = 15;
    let model = stories_bin();
    let prompt = "Once upon a time";
    let local = Generate::new(&model, prompt)
        .local()
        .max_new_tokens(8)
        .run_json();
    let timeout = FRAME_TIMEOUT_S.to_string();
    let swarm = Swarm::builder()
        .node_with(&model, "0..5", &["--frame-timeout", &timeout])
        .start();
    let node = &swarm.nodes[0];
    let before = node.proc.rss();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let (closed, grown) = rt.block_on(async {
        let bootstrap: petal_p2p::Multiaddr =
            swarm.bootstrap_addr.parse().expect("bootstrap address");
        let attacker = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let hops = attacker
            .plan(&node.model_id, BlockRange::new(0, 5), TIMEOUT)
            .await
            .expect("plan");
        let peer: petal_p2p::PeerId = hops[0].record.peer_id.parse().expect("peer id");
        let started = std::time::Instant::now();
        let mut drips = vec![];
        for _ in 0..STREAMS {
            let mut stream = attacker.network().open_stream(peer).await.expect("stream");
            drips.push(tokio::spawn(async move {
                let len: u32 = (64 << 20) - 1;
                let chunk = vec![0x55u8; 256 << 10];
                let mut sent = 0usize;
                if stream.write_all(&len.to_be_bytes()).await.is_err() {
                    return (sent, None);
                }
                while sent + chunk.len() < len as usize {
                    if stream.write_all(&chunk).await.is_err() {
                        return (sent, Some(started.elapsed()));
                    }
                    sent += chunk.len();
                }
                // Hold the frame one byte short of complete until the node gives up on it.
                let mut byte = [0u8; 1];
                let _ = futures::AsyncReadExt::read(&mut stream, &mut byte).await;
                (sent, Some(started.elapsed()))
            }));
        }
        // Let the streams fill whatever the node lets them, then measure.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let grown = node.proc.rss().saturating_sub(before);
        // Another peer is served meanwhile (a process of its own; this thread may block: the drips run on the
        // runtime's workers).
        let remote = swarm.generate(&model, prompt).max_new_tokens(8).run_json();
        assert!(
            started.elapsed() < Duration::from_secs(FRAME_TIMEOUT_S),
            "the generation ended after the flood"
        );
        assert_same_tokens("during the flood", &remote, &local);
        let mut closed = vec![];
        for d in drips {
            closed.push(d.await.expect("drip task"));
        }
        attacker.shutdown().await;
        (closed, grown)
    });
    let sent: usize = closed.iter().map(|(s, _)| s).sum();

    eprintln!(
        "{STREAMS} streams sent {} MiB in all; node RSS grew by {} MiB",
        sent >> 20,
        grown >> 20
    );
    assert!(
        grown < 400 << 20,
        "the node grew by {} MiB holding unfinished frames",
        grown >> 20
    );
    for (sent, ended) in &closed {
        let ended = ended.unwrap_or_else(|| panic!("a stream could not even send its prefix"));
        assert!(
            ended < Duration::from_secs(FRAME_TIMEOUT_S + 30),
            "a stream that sent {sent} bytes was held for {ended:?}"
        );
    }
}
