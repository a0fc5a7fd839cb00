//! Issue 16: every supported family through a real 3-node swarm. A random-weight model of each family (HF format,
//! written by the test) is served by three `petal-node` processes, blocks 0..2, 2..4 and 4..6; 32 greedy tokens
//! through them must equal the whole model run in this process (itself checked against candle-transformers'
//! models in model/tests/oracle_families.rs).
use petal_client::{ChainConfig, Generator, SwarmClient, VerifyPolicy};
use petal_model::synthetic::{
    gpt_oss_gguf_from_hf, gpt_oss_mxfp4_checkpoint, write_gguf, write_model, GgufFormat,
    GgufTokenizer, SyntheticFamily, SyntheticShape, WeightDType, MINI,
};
use petal_model::text::decoding::GenerationConfig;
use petal_model::{BlockRange, ModelSource, Placement};
use petal_tests::*;
use std::path::Path;
use std::time::Duration;

const SHAPE: SyntheticShape = MINI;
const SEED: u64 = 16;
const NEW_TOKENS: usize = 32;
const TIMEOUT: Duration = Duration::from_secs(60);

fn three_nodes_match_local(family: SyntheticFamily, window: Option<usize>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut shape = SHAPE.with_family(family);
    shape.sliding_window = window;
    write_model(dir.path(), &shape, WeightDType::F32, SEED).expect("write the model");
    swarm_matches_local(
        &format!("{family:?}"),
        dir.path(),
        &["0..2", "2..4", "4..6"],
    );
}

/// The named shape written as a Q4_K_M GGUF with SmolLM2's tokenizer, through one node per span of `spans`.
fn q4_k_m_gguf_matches_local(shape: &str, spans: &[&str]) {
    gguf_matches_local(shape, GgufFormat::Q4KM, spans);
}

/// The named shape written as a GGUF of `format` with SmolLM2's tokenizer, through one node per span of `spans`.
fn gguf_matches_local(shape: &str, format: GgufFormat, spans: &[&str]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let named = SyntheticShape::named(shape).expect("a named shape");
    let tokenizer = GgufTokenizer::from_gguf(&smollm_gguf()).expect("SmolLM2's tokenizer");
    let path = dir.path().join(format!("{shape}-{}.gguf", format.name()));
    write_gguf(&path, &named, format, &tokenizer, SEED).expect("write the GGUF");
    swarm_matches_local(&format!("{shape} GGUF"), &path, spans);
}

/// `NEW_TOKENS` greedy tokens of the model at `model` through one node per span of `spans` (in order, covering
/// the model) equal the whole model run in this process.
fn swarm_matches_local(label: &str, model: &Path, spans: &[&str]) {
    let mut source = ModelSource::open(model).expect("open the model");
    source.set_hash_cache(None);
    let model_id = source.model_id().expect("model id");
    let blocks = source.spec().num_blocks;
    let prompt: Vec<u32> = vec![1, 17, 42, 99, 5, 200, 3, 77, 8, 9, 10, 11];
    let config = GenerationConfig {
        max_new_tokens: NEW_TOKENS,
        ignore_eos: true,
        ..GenerationConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let local = rt
        .block_on(async {
            Generator::local(&source, Placement::cpu_f32())?
                .generate_ids(&prompt, &config)
                .await
        })
        .expect("local generation");

    let mut builder = Swarm::builder();
    for span in spans {
        builder = builder.node(model, span);
    }
    let swarm = builder.start();
    for node in &swarm.nodes {
        assert_eq!(
            node.model_id, model_id,
            "{label}: {} serves other weights",
            node.spec.name
        );
    }
    let remote = rt.block_on(async {
        let bootstrap = swarm.bootstrap_addr.parse().expect("bootstrap address");
        let client = SwarmClient::connect(vec![bootstrap]).await.expect("client");
        let hops = client
            .plan(&model_id, BlockRange::new(0, blocks), TIMEOUT)
            .await
            .expect("plan");
        assert_eq!(hops.len(), spans.len(), "{label}: one hop per node");
        let chain = ChainConfig {
            verify: VerifyPolicy::Off,
            ..ChainConfig::default()
        };
        let generator = Generator::remote(&client, &source, Placement::cpu_f32(), chain)
            .expect("remote generator");
        let out = tokio::time::timeout(TIMEOUT, generator.generate_ids(&prompt, &config))
            .await
            .expect("the swarm generation timed out");
        client.shutdown().await;
        out
    });
    let remote = remote
        .unwrap_or_else(|e| panic!("{label}: swarm generation failed: {e}\n{}", swarm.report()));
    eprintln!(
        "{label}: {:?} via {:?}",
        remote.output.tokens, remote.cost.route
    );
    assert_eq!(local.output.tokens.len(), NEW_TOKENS, "{label}");
    assert_eq!(
        remote.output.tokens, local.output.tokens,
        "{label}: the swarm's tokens differ from the local run's"
    );
    assert_eq!(
        remote.cost.route.len(),
        spans.len(),
        "{label}: route {:?}",
        remote.cost.route
    );
}

#[test]
fn qwen2_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Qwen2, None);
}

#[test]
fn qwen3_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Qwen3, None);
}

/// Windowed: a 6-position window over a 44-token context, every layer.
#[test]
fn mistral_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Mistral, Some(6));
}

#[test]
fn mixtral_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Mixtral, None);
}

#[test]
fn qwen3_moe_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Qwen3Moe, None);
}

/// A Qwen3-MoE GGUF in Q4_K_M (16 experts of 256, four per token, stacked as llama.cpp writes them) split over
/// two nodes: each reads only its blocks' expert slabs.
#[test]
fn qwen3moe_gguf_two_nodes_match_local() {
    q4_k_m_gguf_matches_local("moe-tiny", &["0..3", "3..6"]);
}

/// Latent attention: each node's cache holds its blocks' latents only, and the dense first block sits on the first.
#[test]
fn deepseek_v2_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::DeepseekV2, None);
}

/// V3's routing (sigmoid scores, the choice bias, group-limited) on every node.
#[test]
fn deepseek_v3_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::DeepseekV3, None);
}

/// A `deepseek2` GGUF in Q4_K_M as llama.cpp's MLA files are laid out (V3's routing, shared experts, the split
/// latent expansion in Q8_0 where K-quant blocks do not fit) split over two nodes.
#[test]
fn deepseek2_gguf_two_nodes_match_local() {
    q4_k_m_gguf_matches_local("deepseek-tiny", &["0..2", "2..6"]);
}

#[test]
fn phi3_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Phi3, None);
}

/// Windowed on even layers: 6 positions.
#[test]
fn gemma2_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Gemma2, Some(6));
}

/// Windowed on two layers in three, with their own RoPE base.
#[test]
fn gemma3_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::Gemma3, Some(6));
}

/// gpt-oss: sinks, windowed even layers (4 positions), biases, clamped SwiGLU experts, YaRN.
#[test]
fn gpt_oss_three_nodes_match_local() {
    three_nodes_match_local(SyntheticFamily::GptOss, Some(4));
}

/// A `gpt-oss` GGUF in Q4_K_M (stacked experts with stacked biases) split over two nodes.
#[test]
fn gpt_oss_gguf_two_nodes_match_local() {
    q4_k_m_gguf_matches_local("gpt-oss-tiny", &["0..1", "1..4"]);
}

/// A `gpt-oss` GGUF as llama-quantize's MXFP4_MOE writes it (stacked experts in MXFP4, the rest Q8_0) split over
/// two nodes.
#[test]
fn gpt_oss_mxfp4_gguf_two_nodes_match_local() {
    gguf_matches_local("gpt-oss-tiny", GgufFormat::Mxfp4Moe, &["0..3", "3..4"]);
}

/// A gpt-oss HF checkpoint (experts stacked input-major, gate and up interleaved) gives the greedy tokens of the
/// same weights converted to GGUF as llama.cpp's converter lays them out (which tests/tests/llama_oracle.rs runs
/// against llama.cpp).
#[test]
fn gpt_oss_checkpoint_equals_its_gguf_conversion() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shape = SyntheticShape::named("gpt-oss-tiny").expect("a named shape");
    write_model(dir.path(), &shape, WeightDType::F32, SEED).expect("write the checkpoint");
    checkpoint_equals_its_gguf_conversion(&shape, dir.path());
}

/// gpt-oss as OpenAI ships it (experts in MXFP4 `_blocks` and `_scales`, gate and up interleaved by row): through
/// three nodes as locally, and as its GGUF conversion (experts kept in MXFP4, as llama.cpp's converter does).
#[test]
fn gpt_oss_mxfp4_checkpoint_three_nodes_and_its_gguf_match_local() {
    let dir = tempfile::tempdir().expect("tempdir");
    let shape = SyntheticShape::named("gpt-oss-tiny").expect("a named shape");
    let (dense, mxfp4) = (dir.path().join("bf16"), dir.path().join("mxfp4"));
    write_model(&dense, &shape, WeightDType::BF16, SEED).expect("write the checkpoint");
    gpt_oss_mxfp4_checkpoint(&dense, &mxfp4).expect("quantize its experts");
    let source = ModelSource::open(&mxfp4).expect("open the MXFP4 checkpoint");
    assert_eq!(source.quantization(), "mxfp4");
    swarm_matches_local("gpt-oss MXFP4", &mxfp4, &["0..1", "1..3", "3..4"]);
    checkpoint_equals_its_gguf_conversion(&shape, &mxfp4);
}

/// The checkpoint of `shape` in `hf_dir` and its GGUF conversion give the same greedy tokens.
fn checkpoint_equals_its_gguf_conversion(shape: &SyntheticShape, hf_dir: &Path) {
    let gguf_dir = tempfile::tempdir().expect("tempdir");
    let gguf = gguf_dir.path().join("converted.gguf");
    gpt_oss_gguf_from_hf(shape, hf_dir, &gguf, None).expect("convert");
    let prompt: Vec<u32> = (1..30).map(|i| i * 37 % 4000).collect();
    let config = GenerationConfig {
        max_new_tokens: NEW_TOKENS,
        ignore_eos: true,
        ..GenerationConfig::default()
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let run = |model: &Path| {
        let mut source = ModelSource::open(model).expect("open the model");
        source.set_hash_cache(None);
        rt.block_on(async {
            Generator::local(&source, Placement::cpu_f32())?
                .generate_ids(&prompt, &config)
                .await
        })
        .expect("generation")
    };
    let (checkpoint, converted) = (run(hf_dir), run(&gguf));
    assert_eq!(checkpoint.output.tokens, converted.output.tokens);
    assert_eq!(checkpoint.output.tokens.len(), NEW_TOKENS);
}
