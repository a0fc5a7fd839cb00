//! Issue 56: a model that no single node's budget holds. The Llama-3-8B shape as a 4.2 GB Q4_0 GGUF (random
//! weights, SmolLM2's vocabulary), written once per run beside the binaries and kept for later runs, served by
//! nodes whose `--max-memory` is below the file's size.
use petal_client::{ClientError, HopClient, SwarmClient};
use petal_model::synthetic::{write_gguf, GgufFormat, GgufTokenizer, SyntheticShape};
use petal_model::BlockRange;
use petal_proto::pb::ErrorCode;
use petal_tests::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

/// Each node's budget: below the model's 3.9 GiB, above a third of it with its workspace and KV.
const BUDGET: &str = "3GiB";
const BUDGET_BYTES: u64 = 3 << 30;
const SEED: u64 = 56;
const TIMEOUT: Duration = Duration::from_secs(60);

/// The 8B-shaped Q4_0 file, written by the first test that asks (the others wait) unless a run before left it.
fn model_8b() -> PathBuf {
    static WRITING: Mutex<()> = Mutex::new(());
    let _one_writer = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    let dir = bin_dir().join("synthetic");
    std::fs::create_dir_all(&dir).expect("create the synthetic model directory");
    let shape = SyntheticShape::named("8b").expect("the 8b shape");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let written = write_gguf(
        &dir.join("8b-q4_0.gguf"),
        &shape,
        GgufFormat::Q4_0,
        &tokenizer,
        SEED,
    )
    .expect("write the 8B GGUF");
    assert!(
        written.bytes > BUDGET_BYTES,
        "the model ({} bytes) must be larger than each node's budget, or this tests nothing",
        written.bytes
    );
    written.path
}

fn u64_field(record: &Value, key: &str) -> u64 {
    record[key]
        .as_u64()
        .unwrap_or_else(|| panic!("record field {key} missing: {record}"))
}

/// The record's weights and KV budget fit the node's budget, which it announces.
fn assert_within_budget(record: &Value) {
    let weights = u64_field(record, "weight_bytes");
    let kv = u64_field(record, "kv_bytes_total");
    assert_eq!(
        u64_field(record, "memory_budget_bytes"),
        BUDGET_BYTES,
        "{record}"
    );
    assert!(weights > 0 && kv > 0, "{record}");
    assert!(
        weights + kv <= BUDGET_BYTES,
        "weights {weights} + KV {kv} bytes are over the budget: {record}"
    );
}

fn peak_rss(node: &Node) -> u64 {
    proc_status_bytes(node.proc.pid(), "VmHWM")
}

/// Eight tokens sampled at temperature 1 with one seed through the swarm equal the local run's (random weights make
/// greedy decoding repeat one token, which would hide a wrong block).
fn assert_swarm_samples_as_local(swarm: &Swarm, model: &Path, timeout: Duration) {
    let sampled = |g: Generate| {
        g.max_new_tokens(8)
            .ignore_eos()
            .args(&["--temperature", "1", "--seed", "7"])
            .timeout(timeout)
            .run_json()
    };
    let prompt = "The capital of France is";
    let local = sampled(Generate::new(model, prompt).local());
    let remote = sampled(swarm.generate(model, prompt));
    assert_eq!(local.tokens.len(), 8);
    assert_eq!(
        remote.tokens, local.tokens,
        "the swarm's tokens differ from the local run's"
    );
}

/// Three nodes, each with a budget below the model's size, serve it and give the local run's tokens (sampled at
/// temperature 1 with one seed: random weights make greedy decoding repeat one token, which would hide a wrong
/// block). Each node's KV budget is what the bytes leave (--cache-tokens asks far more), and a session longer
/// than that is refused with the typed error while the node goes on serving.
#[test]
fn three_nodes_each_below_the_models_size_serve_it_as_the_local_run_does() {
    let model = model_8b();
    let args = ["--max-memory", BUDGET, "--cache-tokens", "1000000"];
    let swarm = Swarm::builder()
        .node_with(&model, "0..11", &args)
        .node_with(&model, "11..22", &args)
        .node_with(&model, "22..32", &args)
        .start();
    let records = swarm.records();
    assert_eq!(records.len(), 3, "{records:?}");
    for r in &records {
        assert_within_budget(r);
        assert!(
            u64_field(r, "cache_tokens_total") < 1_000_000,
            "the byte budget, not --cache-tokens, bounds the KV cache: {r}"
        );
    }

    assert_swarm_samples_as_local(&swarm, &model, Duration::from_secs(600));

    let node = &swarm.nodes[0];
    let total = records
        .iter()
        .find(|r| r["peer_id"] == node.peer_id.as_str())
        .map(|r| u64_field(r, "cache_tokens_total"))
        .expect("node1's record") as usize;
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async {
        let bootstrap = swarm.bootstrap_addr.parse().expect("bootstrap address");
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let hop = client
            .plan(&node.model_id, BlockRange::new(0, 11), TIMEOUT)
            .await
            .expect("plan")[0]
            .clone();
        match HopClient::open(
            client.network(),
            &node.model_id,
            hop.clone(),
            total + 1,
            TIMEOUT,
        )
        .await
        {
            Err(ClientError::Server { code, message, .. }) => {
                assert_eq!(code, ErrorCode::CacheFull, "{message}");
                assert!(message.contains("MiB"), "the refusal says bytes: {message}");
            }
            Err(other) => panic!("expected the typed cache-full error, got {other}"),
            Ok(_) => panic!(
                "a session of {} positions fit a cache of {total}",
                total + 1
            ),
        }
        let mut session = HopClient::open(client.network(), &node.model_id, hop, 64, TIMEOUT)
            .await
            .expect("a session within the budget, after the refusal");
        let x = candle_core::Tensor::randn(0f32, 1.0, (1, 4, 4096), &candle_core::Device::Cpu)
            .expect("tensor");
        let out = session.step(&x, 0, TIMEOUT).await.expect("a step");
        assert_eq!(out.hidden.dims(), &[1, 4, 4096]);
        client.shutdown().await;
    });
    for node in &swarm.nodes {
        let peak = peak_rss(node);
        assert!(
            peak <= BUDGET_BYTES,
            "{} peaked at {} MiB, over its {BUDGET} budget",
            node.spec.name,
            peak >> 20
        );
    }
}

/// A mixture of experts no node's budget holds (Qwen3-MoE-shaped, 64 experts of 512 per block, Q4_K_M, 0.8 GB):
/// under 900 MiB each, of which a step's workspace and receive buffers take some 590, a node holds a third of its
/// blocks with all their experts, not the model; split by blocks over three nodes it equals the local run.
#[test]
fn a_mixture_of_experts_no_node_holds_is_split_over_three_and_equals_the_local_run() {
    const MOE_BUDGET: &str = "900MiB";
    const MOE_BUDGET_BYTES: u64 = 900 << 20;
    let dir = tempfile::tempdir().expect("tempdir");
    let shape = SyntheticShape::named("moe-1b").expect("the moe-1b shape");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let written = write_gguf(
        &dir.path().join("moe-1b-q4_k_m.gguf"),
        &shape,
        GgufFormat::Q4KM,
        &tokenizer,
        SEED,
    )
    .expect("write the MoE GGUF");
    let model = written.path;
    let args = ["--max-memory", MOE_BUDGET, "--cache-tokens", "1024"];
    // The whole model under the same budget: refused before a weight is read.
    let mut cmd = Command::new(bin("petal-node"));
    cmd.arg("serve")
        .arg("--model")
        .arg(&model)
        .args(["--blocks", "0..12", "--listen", LISTEN])
        .args(args);
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    assert!(!out.success() && !out.timed_out(), "{out}");
    assert!(
        out.stderr.contains("do not fit") && out.stderr.contains("nothing was loaded"),
        "{out}"
    );
    let swarm = Swarm::builder()
        .node_with(&model, "0..4", &args)
        .node_with(&model, "4..8", &args)
        .node_with(&model, "8..12", &args)
        .start();
    let records = swarm.records();
    assert_eq!(records.len(), 3, "{records:?}");
    for r in &records {
        let weights = u64_field(r, "weight_bytes");
        assert!(
            weights > 0 && weights + u64_field(r, "kv_bytes_total") <= MOE_BUDGET_BYTES,
            "{r}"
        );
    }
    assert_swarm_samples_as_local(&swarm, &model, Duration::from_secs(300));
    for node in &swarm.nodes {
        assert!(
            peak_rss(node) <= MOE_BUDGET_BYTES,
            "{} peaked at {} MiB, over its {MOE_BUDGET} budget",
            node.spec.name,
            peak_rss(node) >> 20
        );
    }
}

/// With the same budget and no --blocks a node takes only what fits, each block with the full KV cache; asked for
/// the whole model it refuses at start-up, naming the sizes, before it reads a weight.
#[test]
fn one_node_with_the_same_budget_takes_what_fits_and_refuses_the_whole_model() {
    let model = model_8b();
    let mut cmd = Command::new(bin("petal-node"));
    cmd.arg("serve").arg("--model").arg(&model).args([
        "--blocks",
        "0..32",
        "--max-memory",
        BUDGET,
        "--listen",
        LISTEN,
    ]);
    let out = run_with_timeout(cmd, Duration::from_secs(60));
    assert!(!out.success() && !out.timed_out(), "{out}");
    assert!(!out.stderr.contains("panicked"), "{out}");
    let error = out
        .stderr
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_else(|| panic!("no `error:` line\n{out}"));
    for part in ["0..32", "--max-memory 3.0 GiB", "GiB", "nothing was loaded"] {
        assert!(error.contains(part), "{part:?} missing from {error:?}");
    }

    let swarm = Swarm::builder()
        .node_with(
            &model,
            "",
            &["--max-memory", BUDGET, "--cache-tokens", "2048"],
        )
        .start();
    let records = swarm.records();
    let r = &records[0];
    let blocks = u64_field(r, "end_block") - u64_field(r, "start_block");
    assert!((1..32).contains(&blocks), "took {blocks} blocks: {r}");
    assert_eq!(
        u64_field(r, "cache_tokens_total"),
        2048,
        "an automatic span keeps the full cache for each block: {r}"
    );
    assert_within_budget(r);
    let peak = peak_rss(&swarm.nodes[0]);
    assert!(peak <= BUDGET_BYTES, "peaked at {} MiB", peak >> 20);
}
