//! Issue 14: a prompt whose hidden states do not fit in one frame goes through the swarm.
//!
//! A 4,100-token prompt on a model of hidden size 4096 is 4,100 x 4,096 f32 = 67 MB of hidden states per hop, more
//! than the 64 MiB frame limit. Sent as one step it used to fail in the client and be reported as the server's
//! (retryable) fault, so healthy servers were banned one after another. Nodes now announce `--max-chunk-tokens`
//! (default 512) and the client sends long steps in chunks of that size (`HopClient::step`): the prompt must go
//! through two real nodes, give the local run's tokens and log-probabilities, and get no server blamed.
use petal_client::{ChainConfig, Completion, Generator, SwarmClient, VerifyPolicy};
use petal_model::synthetic::{write_model, SyntheticFamily, SyntheticShape, WeightDType};
use petal_model::text::decoding::{FinishReason, GenerationConfig};
use petal_model::{BlockRange, ModelSource, Placement};
use petal_tests::*;
use std::time::{Duration, Instant};

/// Hidden size 4096 (a 7B-class width) with everything else as small as the point allows: two blocks (one per
/// node), a small MLP and vocabulary, and room for the prompt and then some. 444 MB of f32 weights.
const SHAPE: SyntheticShape = SyntheticShape {
    name: "long-prompt-h4096",
    hidden_size: 4096,
    num_blocks: 2,
    num_heads: 32,
    num_kv_heads: 8,
    intermediate_size: 1024,
    vocab_size: 512,
    tie_embeddings: true,
    max_position: 8192,
    family: SyntheticFamily::Llama,
    sliding_window: None,
    head_size: None,
    latent: None,
    experts: None,
};
const SEED: u64 = 14;
const PROMPT_TOKENS: usize = 4100;
const NEW_TOKENS: usize = 3;
/// What `petal-node serve` announces unless told otherwise.
const DEFAULT_MAX_CHUNK_TOKENS: u32 = 512;
/// Bound on each of the test's network waits and on each generation, so that nothing hangs.
const TIMEOUT: Duration = Duration::from_secs(60);
const GENERATION_TIMEOUT: Duration = Duration::from_secs(300);
/// Largest difference allowed between the swarm's and the local log-probabilities. Both run the same f32 kernels
/// on the same machine; they differ only in the prefill being computed in 512-token chunks against the KV cache
/// rather than in one step, which changes the order of sums in attention (about 1e-7 relative per block,
/// model/tests/chunking.rs). Measured here: below 1e-5; the bound leaves room for other CPUs' kernels.
const LOGPROB_TOLERANCE: f32 = 1e-3;

/// The greatest resident set size process `pid` has had, in bytes.
fn peak_rss(pid: u32) -> u64 {
    proc_status_bytes(pid, "VmHWM")
}

fn mib(bytes: u64) -> u64 {
    bytes >> 20
}

#[test]
fn a_4100_token_prompt_on_a_hidden_4096_model_goes_through_two_nodes() {
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("tempdir");
    let written = write_model(dir.path(), &SHAPE, WeightDType::F32, SEED).expect("write the model");
    let model = dir.path();
    let one_step_bytes = PROMPT_TOKENS * SHAPE.hidden_size * 4;
    assert!(
        one_step_bytes > petal_proto::DEFAULT_MAX_FRAME_BYTES,
        "the prompt's hidden states ({one_step_bytes} bytes) must not fit in one frame, or this tests nothing"
    );
    let mut rng = XorShift::new(SEED);
    let prompt: Vec<u32> = (0..PROMPT_TOKENS)
        .map(|_| (rng.next_u64() % SHAPE.vocab_size as u64) as u32)
        .collect();
    let config = GenerationConfig {
        max_new_tokens: NEW_TOKENS,
        logprobs: Some(4),
        ..GenerationConfig::default()
    };
    let mut source = ModelSource::open(model).expect("open the model");
    // This process's block hashes need no disk cache (the model is gone at the end of the test).
    source.set_hash_cache(None);
    let model_id = source.model_id().expect("model id");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let prepared = started.elapsed();

    // The whole model in this process, the prompt in one step.
    let t = Instant::now();
    let local = rt
        .block_on(async {
            let generator = Generator::local(&source, Placement::cpu_f32())?;
            tokio::time::timeout(GENERATION_TIMEOUT, generator.generate_ids(&prompt, &config))
                .await
                .expect("the local generation timed out")
        })
        .expect("local generation");
    let local_time = t.elapsed();

    // Two nodes with the default --max-chunk-tokens and --cache-tokens (16,384 positions: room for the prompt).
    let t = Instant::now();
    let swarm = Swarm::builder()
        .node(model, "0..1")
        .node(model, "1..2")
        .start();
    let startup_time = t.elapsed();
    for node in &swarm.nodes {
        assert_eq!(
            node.model_id, model_id,
            "{} serves other weights",
            node.spec.name
        );
    }
    let t = Instant::now();
    let (remote, banned) = rt.block_on(async {
        let bootstrap = swarm.bootstrap_addr.parse().expect("bootstrap address");
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let hops = client
            .plan(&model_id, BlockRange::new(0, SHAPE.num_blocks), TIMEOUT)
            .await
            .expect("plan");
        assert_eq!(hops.len(), 2, "one hop per node");
        for hop in &hops {
            assert_eq!(
                hop.record.max_chunk_tokens,
                DEFAULT_MAX_CHUNK_TOKENS,
                "{} announces its step limit",
                hop.describe()
            );
        }
        // Checks of answers need a second server per block, which this swarm does not have.
        let chain = ChainConfig {
            verify: VerifyPolicy::Off,
            ..ChainConfig::default()
        };
        let generator = Generator::remote(&client, &source, Placement::cpu_f32(), chain)
            .expect("remote generator");
        let remote =
            tokio::time::timeout(GENERATION_TIMEOUT, generator.generate_ids(&prompt, &config))
                .await
                .expect("the swarm generation timed out");
        let banned = client.banned();
        client.shutdown().await;
        (remote, banned)
    });
    let remote_time = t.elapsed();
    let remote: Completion = remote.unwrap_or_else(|e| {
        panic!(
            "the swarm generation failed after {remote_time:?}: {e}; banned: {banned:?}\n{}",
            swarm.report()
        )
    });
    let node_peaks: Vec<u64> = swarm.nodes.iter().map(|n| peak_rss(n.proc.pid())).collect();

    eprintln!(
        "model: {} MB of f32 weights written in {prepared:?}; prompt: {PROMPT_TOKENS} tokens, {} MB of hidden \
         states per hop (frame limit {} MB)",
        written.bytes / 1_000_000,
        one_step_bytes / 1_000_000,
        petal_proto::DEFAULT_MAX_FRAME_BYTES / 1_000_000
    );
    eprintln!(
        "local: {:?} in {local_time:?} (prefill {:.0} ms)",
        local.output.tokens, local.output.first_token_ms
    );
    eprintln!(
        "swarm: {:?} in {remote_time:?} (prefill {:.0} ms; nodes started in {startup_time:?}); route {:?}",
        remote.output.tokens, remote.output.first_token_ms, remote.cost.route
    );

    // The generation went through, on the route it was planned on, with no server blamed.
    assert!(
        remote.cost.failovers.is_empty(),
        "servers were replaced: {:?}",
        remote.cost.failovers
    );
    assert!(banned.is_empty(), "healthy servers were banned: {banned:?}");
    assert_eq!(remote.cost.route.len(), 2, "route {:?}", remote.cost.route);
    for (hop, blocks) in remote.cost.route.iter().zip(["[0..1]", "[1..2]"]) {
        assert!(hop.ends_with(blocks), "route {:?}", remote.cost.route);
    }
    let prefill = &remote.cost.steps[0];
    assert_eq!(
        prefill.tokens, PROMPT_TOKENS,
        "the prompt is one decode-loop step"
    );
    assert_eq!(prefill.hops.len(), 2);
    for (hop, t) in remote.cost.route.iter().zip(&prefill.hops) {
        eprintln!(
            "prefill at {hop}: round trip {:?}, server compute {:?}",
            t.round_trip, t.compute
        );
    }
    assert!(
        remote.cost.bytes_on_wire > 2 * one_step_bytes as u64,
        "the prompt's hidden states crossed both hops ({} bytes on the wire)",
        remote.cost.bytes_on_wire
    );

    // It computed what the whole model in one process computes.
    assert_eq!(local.output.prompt_tokens, PROMPT_TOKENS);
    assert_eq!(local.output.tokens.len(), NEW_TOKENS, "local: {local:?}");
    assert_eq!(local.output.finish_reason, FinishReason::Length);
    assert_eq!(remote.output.finish_reason, FinishReason::Length);
    assert_eq!(
        remote.output.tokens, local.output.tokens,
        "the swarm's greedy tokens differ from the local run's"
    );
    assert_eq!(remote.logprobs.len(), NEW_TOKENS);
    assert_eq!(local.logprobs.len(), NEW_TOKENS);
    let mut worst = 0f32;
    for (i, (r, l)) in remote.logprobs.iter().zip(&local.logprobs).enumerate() {
        assert_eq!(r.top.len(), l.top.len());
        let pairs = std::iter::once((r.logprob, l.logprob)).chain(
            r.top
                .iter()
                .zip(&l.top)
                .map(|(a, b)| (a.logprob, b.logprob)),
        );
        for (a, b) in pairs {
            worst = worst.max((a - b).abs());
        }
        let tops = |t: &petal_model::text::sampling::TokenLogprob| {
            t.top.iter().map(|a| a.token).collect::<Vec<_>>()
        };
        assert_eq!(tops(r), tops(l), "step {i}: the most likely tokens differ");
        let margin = l.top[0].logprob - l.top[1].logprob;
        eprintln!(
            "step {i}: token {} logprob local {:.6} swarm {:.6}; margin over the runner-up {margin:.4}",
            l.token, l.logprob, r.logprob
        );
    }
    eprintln!("largest log-probability difference: {worst:e}");
    assert!(
        worst <= LOGPROB_TOLERANCE,
        "log-probabilities differ by {worst:e} (more than {LOGPROB_TOLERANCE:e})"
    );

    let own_peak = peak_rss(std::process::id());
    eprintln!(
        "peak RSS: test process {} MiB, nodes {:?} MiB; whole test {:?}",
        mib(own_peak),
        node_peaks.iter().map(|&b| mib(b)).collect::<Vec<_>>(),
        started.elapsed()
    );
    // Measured here: about 810 MiB per node (its block's 218 MB of weights, a 512-token chunk's working memory
    // against 4,100 positions of context, the frames); a loose bound that still catches a node holding the whole
    // prompt's hidden states or attention over it at once.
    for (node, peak) in swarm.nodes.iter().zip(&node_peaks) {
        assert!(
            *peak < 2 << 30,
            "{} peaked at {} MiB",
            node.spec.name,
            mib(*peak)
        );
    }
}
